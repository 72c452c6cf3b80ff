"""LoRA adapters of ``LLMServer`` without Ray, on the real engine and real adapter files: an
adapter replaced in place answers with its new weights from the next request on (never KV
blocks cached under the old ones), a removed one is a 404, a refused one a 400 naming the
``model`` the client sent (no server path) and counted by no metric, and the tokenizer calls
take an adapter's name."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.api.replica_messages import GenerateRequest, StreamError, TokenizeResult
from cluster.serving.llm_server import LLMServer
from engine import LLM, LoRARequest, SamplingParams
from engine.builtin.catalog import make_tiny_lora
from tests.cluster.serving.metric_recorders import prometheus_text, recorded_model_metrics

ENGINE_ARGS = {"model": "builtin:tiny-llama", "num_kv_blocks": 64, "device": "cpu",
               "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}  # fmt: skip
# Long enough for whole 16-token blocks in the prefix cache.
PROMPT = "The tiny model tells a long story about caches, adapters, replicas and routers. " * 2
PARAMS = {"temperature": 0, "max_tokens": 10}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {
        "a": make_tiny_lora("tiny-llama", root / "a", 8, ["q_proj", "v_proj"], seed=1),
        "b": make_tiny_lora("tiny-llama", root / "b", 8, ["o_proj", "down_proj"], seed=2),
        "big": make_tiny_lora("tiny-llama", root / "big", 16, ["q_proj"], seed=3),
    }


@pytest.fixture(scope="module")
def offline(sources: dict[str, Path]) -> dict[str, str]:
    """The offline engine's greedy text of PROMPT under each good adapter."""
    llm = LLM(**ENGINE_ARGS)
    texts = {}
    for i, name in enumerate(("a", "b")):
        lora = LoRARequest(name, i + 1, str(sources[name]))
        out = llm.generate(PROMPT, SamplingParams(**PARAMS), lora_request=lora, use_tqdm=False)
        texts[name] = out[0].outputs[0].text
    assert texts["a"] != texts["b"]
    return texts


@pytest.fixture
def loras(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def server(loras: Path) -> Iterator[LLMServer]:
    server = LLMServer("tiny", ENGINE_ARGS, lora_config={"dynamic_lora_loading_path": str(loras)})
    yield server
    server.engine.shutdown()


def _install(source: Path, dest: Path) -> None:
    """The adapter's files copied over ``dest``'s, in place (same files, new bytes)."""
    dest.mkdir(exist_ok=True)
    for file in source.iterdir():
        shutil.copyfile(file, dest / file.name)


def _generate(server: LLMServer, adapter: str) -> str | StreamError:
    """The text of a greedy request under ``adapter``, or the server's error item."""

    async def run() -> str | StreamError:
        items = [i async for i in server.generate(GenerateRequest(prompt=PROMPT, params=PARAMS,
                                                                  adapter=adapter))]  # fmt: skip
        if isinstance(items[0], StreamError):
            return items[0]
        return "".join(c.text for item in items[1:] for c in item.choices)

    return asyncio.run(run())


def test_an_adapter_replaced_in_place_answers_with_its_new_weights_at_once(
    server: LLMServer, loras: Path, sources: dict[str, Path], offline: dict[str, str]
) -> None:
    _install(sources["a"], loras / "fresh")
    assert _generate(server, "fresh") == offline["a"]
    assert _generate(server, "fresh") == offline["a"]  # its prompt's blocks are cached now
    _install(sources["b"], loras / "fresh")
    assert _generate(server, "fresh") == offline["b"]
    _install(sources["a"], loras / "fresh")
    assert _generate(server, "fresh") == offline["a"]


def _assert_not_found(item: Any, model: str) -> None:
    assert isinstance(item, StreamError)
    assert (item.status, item.param, item.code) == (404, "model", "model_not_found")
    assert item.message == f"The model `{model}` does not exist."


def test_a_removed_adapter_is_a_404_from_the_next_request_on(
    server: LLMServer, loras: Path, sources: dict[str, Path], offline: dict[str, str]
) -> None:
    _install(sources["a"], loras / "dyn")
    assert _generate(server, "dyn") == offline["a"]
    shutil.rmtree(loras / "dyn")
    _assert_not_found(_generate(server, "dyn"), "tiny:dyn")
    _install(sources["b"], loras / "dyn")  # a new adapter under the old name
    assert _generate(server, "dyn") == offline["b"]


def test_a_refused_adapter_is_a_400_naming_the_model_sent_and_is_not_counted(
    server: LLMServer, loras: Path, sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server.metrics = recorded_model_metrics(monkeypatch, "tiny")
    _install(sources["big"], loras / "big")
    _install(sources["a"], loras / "a")
    for _ in range(2):
        error = _generate(server, "big")
        assert isinstance(error, StreamError)
        assert (error.status, error.param) == (400, "model")
        assert error.message == (
            "LoRA adapter `tiny:big` cannot be served: adapter rank r=16 exceeds max_lora_rank (8)"
        )
    assert isinstance(_generate(server, "a"), str)
    requests = [line for line in prometheus_text().splitlines() if "lora_requests_total" in line]
    assert len(requests) == 1 and 'adapter="a"' in requests[0] and requests[0].endswith(" 1")


def test_an_adapter_without_weights_is_refused_without_the_servers_path(
    server: LLMServer, loras: Path, sources: dict[str, Path]
) -> None:
    _install(sources["a"], loras / "nofile")
    (loras / "nofile" / "adapter_model.safetensors").unlink()
    error = _generate(server, "nofile")
    assert isinstance(error, StreamError) and (error.status, error.param) == (400, "model")
    assert "`tiny:nofile`" in error.message and "adapter_model.safetensors" in error.message
    assert str(loras) not in error.message


def test_tokenize_and_detokenize_take_an_adapter_name_and_404_an_unknown_one(
    server: LLMServer, loras: Path, sources: dict[str, Path]
) -> None:
    _install(sources["a"], loras / "a")
    base = asyncio.run(server.tokenize(GenerateRequest(prompt=PROMPT)))
    under_a = asyncio.run(server.tokenize(GenerateRequest(prompt=PROMPT, adapter="a")))
    assert isinstance(base, TokenizeResult) and under_a == base
    text = asyncio.run(server.detokenize(base.tokens[1:4], "a"))
    assert text == asyncio.run(server.detokenize(base.tokens[1:4]))
    _assert_not_found(
        asyncio.run(server.tokenize(GenerateRequest(prompt=PROMPT, adapter="nope"))), "tiny:nope"
    )
    _assert_not_found(asyncio.run(server.detokenize([1, 2], "nope")), "tiny:nope")
