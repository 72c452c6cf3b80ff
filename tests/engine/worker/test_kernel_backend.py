"""The engine's kernel backend choice: config validation, and the Triton backend producing the
torch backend's greedy tokens (through the Triton interpreter without CUDA; with CUDA also
with CUDA graphs, against HF transformers)."""

from __future__ import annotations

import os
import random
import re

import pytest
import torch

from engine.builtin.catalog import resolve_model_source
from engine.client.llm import LLM
from engine.config import ConfigError, EngineConfig
from engine.config_sections import KernelConfig
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graphs import decode_batch_buckets

PROMPTS = [
    "the quick brown fox",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def greedy_tokens(model: str, prompts=PROMPTS, **engine_args) -> list[list[int]]:
    llm = LLM(model, num_kv_blocks=32, **engine_args)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    "model", ["builtin:tiny-llama", "builtin:tiny-qwen2", "builtin:tiny-deepseek-v3"]
)
def test_triton_backend_generates_the_torch_backends_greedy_tokens(model):
    # A 16-token budget chunks the longer prompt, so steps mix prefill chunks and decodes.
    args = {"max_num_batched_tokens": 16, "block_size": 16, "device": "cpu"}
    torch_tokens = greedy_tokens(model, attention_backend="torch", **args)
    assert greedy_tokens(model, attention_backend="triton", **args) == torch_tokens


def test_model_built_with_triton_backend_computes_through_triton_kernels():
    config = EngineConfig.from_kwargs(model="builtin:tiny-llama", attention_backend="triton")
    from engine.worker.model_loader import load_model
    from parallel.state import ParallelContext

    model = load_model(config, ParallelContext(), torch.device("cpu"))
    assert model.kernel_ops.name == "triton"
    assert all(layer.ops.name == "triton" for layer in model.attention_layers())


def test_auto_backend_on_cpu_is_torch_or_the_native_decode_kernel():
    # The native kernel's own choice is tested in tests/llm_kernels/test_cpu_decode.py.
    from llm_kernels.cpu_decode import native_decode_available

    expected = "cpu" if native_decode_available() else "torch"
    assert KernelConfig(attention_backend="auto").resolved_backend("cpu") == expected


def test_unknown_backend_is_rejected_naming_the_key():
    expected = "attention_backend: must be one of 'auto', 'triton', 'cpu', 'torch', got 'cuda'"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        EngineConfig.from_kwargs(model="builtin:tiny-llama", attention_backend="cuda")


def test_triton_on_cpu_without_interpreter_is_rejected(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(
        ConfigError, match="attention_backend: 'triton' on CPU needs TRITON_INTERPRET"
    ):
        EngineConfig.from_kwargs(
            model="builtin:tiny-llama", attention_backend="triton", device="cpu"
        )


def test_triton_backend_without_triton_installed_is_rejected(monkeypatch):
    import llm_kernels.backend

    monkeypatch.setattr(llm_kernels.backend.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="attention_backend: 'triton' needs the triton package"):
        KernelConfig(attention_backend="triton")


def test_enforce_eager_must_be_a_bool():
    with pytest.raises(ConfigError, match="enforce_eager: must be true or false, got 'yes'"):
        EngineConfig.from_kwargs(model="builtin:tiny-llama", enforce_eager="yes")


def test_decode_buckets_cover_every_batch_size_up_to_the_sequence_cap():
    buckets = decode_batch_buckets(max_num_seqs=100)
    assert buckets[:4] == (1, 2, 4, 8)
    assert all(any(b >= n for b in buckets) for n in range(1, 101))
    assert buckets[-1] == 104
    assert decode_batch_buckets(max_num_seqs=3) == (1, 2, 3)


def prompt_token_ids(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(model))
    return [tokenizer.encode(prompt) for prompt in PROMPTS]


def hf_greedy_tokens(model: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    path = resolve_model_source(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    tokens = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(
            ids, max_new_tokens=GREEDY.max_tokens, do_sample=False, min_new_tokens=GREEDY.max_tokens
        )
        tokens.append(out[0, ids.shape[1] :].tolist())
    return tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize(
    "model", ["builtin:tiny-llama", "builtin:tiny-mistral", "builtin:tiny-qwen2"]
)
def test_gpu_triton_engine_with_and_without_cuda_graphs_matches_hf(model, enforce_eager):
    assert os.environ.get("TRITON_INTERPRET", "0") != "1"
    prompts = prompt_token_ids(model)
    tokens = greedy_tokens(
        model,
        prompts,
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        enforce_eager=enforce_eager,
    )
    assert tokens == hf_greedy_tokens(model, prompts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_replay_equals_eager_for_a_padded_bucket():
    eager = LLM("builtin:tiny-llama", num_kv_blocks=64, device="cuda", enforce_eager=True)
    graphs = LLM("builtin:tiny-llama", num_kv_blocks=64, device="cuda", enforce_eager=False)
    prompts = [f"prompt number {i} says" for i in range(5)]  # 5 requests -> bucket 8
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert got == want


FAMILIES = [
    "builtin:tiny-qwen3",
    "builtin:tiny-gemma2",
    "builtin:tiny-gemma3",
    "builtin:tiny-phi3",
    "builtin:tiny-gpt-oss",
]


def long_prompts(lengths: tuple[int, ...] = (9, 70)) -> list[list[int]]:
    """Token-id prompts longer than the families' windows (24 to 64 positions)."""
    rng = random.Random(2)
    return [[rng.randrange(5, 1024) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("model", FAMILIES)
def test_triton_backend_equals_torch_for_windows_soft_caps_and_qk_norm(model):
    # Through the interpreter on CPU: the 70-token prompt is chunked (16-token budget) past
    # every window, and decodes attend only within theirs.
    args = {"max_num_batched_tokens": 16, "device": "cpu"}
    prompts = [{"prompt_token_ids": p} for p in long_prompts()]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(backend: str) -> list[list[int]]:
        llm = LLM(model, num_kv_blocks=32, attention_backend=backend, **args)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert run("triton") == run("torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", FAMILIES)
def test_gpu_triton_engine_matches_hf_for_each_family(model):
    assert os.environ.get("TRITON_INTERPRET", "0") != "1"
    prompts = long_prompts((9, 70, 200))
    tokens = greedy_tokens(
        model,
        [{"prompt_token_ids": p} for p in prompts],
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        max_num_batched_tokens=64,
    )
    assert tokens == hf_greedy_tokens(model, prompts)
