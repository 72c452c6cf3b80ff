"""A model's default sampling values (``engine.generation_defaults``), as vLLM reads them: the
checkpoint's ``generation_config.json`` (``generation_config: auto``), none (``vllm``) or
another directory's, ``override_generation_config`` over them; a request's unset fields take
them. Offline, ``LLM.generate`` without ``SamplingParams`` samples with them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.client.llm import LLM
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.generation_defaults import generation_defaults, with_generation_defaults
from engine.sampling_params import SamplingParams

QWEN3_LIKE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True,
              "eos_token_id": [2, 4], "max_new_tokens": 20, "pad_token_id": 0}  # fmt: skip


def _checkpoint(root: Path, name: str, generation: dict | None, config: dict | None = None) -> Path:
    path = root / name
    path.mkdir()
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    (path / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    return path


def test_the_checkpoints_sampling_values_by_sampling_params_names(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path, "m", QWEN3_LIKE)
    assert generation_defaults(str(model)) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 20
    }  # fmt: skip
    assert generation_defaults(str(model), "vllm") == {}
    assert generation_defaults(str(model), "vllm", {"temperature": 0.2}) == {"temperature": 0.2}
    over = generation_defaults(str(model), "auto", {"top_p": 0.5, "max_new_tokens": 7})
    assert over == {"temperature": 0.6, "top_p": 0.5, "top_k": 20, "max_tokens": 7}
    other = _checkpoint(tmp_path, "other", {"repetition_penalty": 1.1, "min_p": 0.05})
    assert generation_defaults(str(model), str(other)) == {"repetition_penalty": 1.1, "min_p": 0.05}


def test_without_a_generation_config_json_there_are_none(tmp_path: Path) -> None:
    """A config.json's sampling fields are not read: transformers 5 drops them from a model
    config, so vLLM has none either."""
    legacy = _checkpoint(tmp_path, "legacy", None, {"model_type": "llama", "temperature": 0.3})
    assert generation_defaults(str(legacy)) == {}
    assert generation_defaults(str(tmp_path / "nothing-here")) == {}


def test_a_generation_config_that_cannot_be_used_is_refused_naming_it(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path, "m", {"top_p": 1.5})
    with pytest.raises(ConfigError, match=r"^generation_config\.top_p: must be in"):
        generation_defaults(str(model))
    with pytest.raises(ConfigError, match=r"^override_generation_config\.max_new_tokens: "):
        generation_defaults(str(model), "vllm", {"max_new_tokens": 0})
    with pytest.raises(ConfigError, match=r"^generation_config: must be 'auto', 'vllm' or a dir"):
        generation_defaults(str(model), str(tmp_path / "missing"))
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"^generation_config: cannot read "):
        generation_defaults(str(model))
    for override, message in (
        ({"do_sample": True}, r"^override_generation_config\.do_sample: is not one"),
        ({"temperature": 5}, r"^override_generation_config\.temperature: must be in \[0, 2\]"),
    ):  # with the config, before any checkpoint is read
        with pytest.raises(ConfigError, match=message):
            EngineConfig.from_kwargs(model="builtin:tiny-llama", device="cpu",
                                     override_generation_config=override)  # fmt: skip


def test_a_requests_unset_fields_take_the_defaults_and_max_tokens_fits_the_prompt() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 20}
    params = {"temperature": None, "top_k": 5, "max_tokens": None, "seed": 3}
    assert with_generation_defaults(params, defaults, room=100) == {
        "temperature": 0.6, "top_k": 5, "max_tokens": 20, "seed": 3
    }  # fmt: skip
    assert with_generation_defaults({}, defaults, room=8)["max_tokens"] == 8
    assert with_generation_defaults({"max_tokens": 50}, defaults, room=8)["max_tokens"] == 50


def greedy_checkpoint(tiny_llama_dir: Path, root: Path) -> Path:
    """A copy of tiny-llama whose generation_config.json says greedy, 5 tokens."""
    path = root / "tiny-llama-greedy"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=5)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def greedy_by_default(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return greedy_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("greedy"))


def test_llm_generate_without_params_samples_with_the_models_defaults(
    greedy_by_default: Path,
) -> None:
    prompts = ["The capital of France is", "Once upon a time"]
    llm = LLM(str(greedy_by_default), num_kv_blocks=32, device="cpu")
    try:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
        by_default = llm.generate(prompts, use_tqdm=False)
        greedy_params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        explicit = llm.generate(prompts, greedy_params, use_tqdm=False)
        for default, greedy in zip(by_default, explicit, strict=True):
            ids = default.outputs[0].token_ids
            assert ids == greedy.outputs[0].token_ids[: len(ids)] and 1 <= len(ids) <= 5
    finally:
        llm.llm_engine.shutdown()


def test_llm_with_generation_config_vllm_keeps_sampling_params_defaults(
    greedy_by_default: Path,
) -> None:
    llm = LLM(str(greedy_by_default), num_kv_blocks=32, device="cpu", generation_config="vllm",
              override_generation_config={"top_k": 3})  # fmt: skip
    try:
        assert llm.get_default_sampling_params() == SamplingParams(top_k=3)
    finally:
        llm.llm_engine.shutdown()
