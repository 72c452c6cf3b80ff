"""llm_kernels.cpu_decode, the native AVX-512/AVX2 decode kernel (every build this CPU runs):
against the naive float64 reference of tests/llm_kernels/naive_attention.py over dtypes, head dims,
GQA ratios, block sizes and context lengths; the calls it declines (and that the torch path then
serves); the backend choice."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from engine.client.llm import LLM
from engine.config import ConfigError, EngineConfig
from engine.config_sections import KernelConfig
from engine.sampling_params import SamplingParams
from llm_kernels import attention, cpu_decode
from llm_kernels.attention_metadata import AttentionMetadata
from llm_kernels.backend import get_kernel_ops, resolve_attention_backend
from tests.llm_kernels.naive_attention import naive_paged_attention
from tests.llm_kernels.native_cpu import native_paged_attention, skip_unless_native
from tests.llm_kernels.triton_batches import paged_batch

# Against float64: fp32 to rounding (scores of head_dim 256 at this scale reach ~20), bf16 and
# fp16 to one rounding of the output.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SCALE = 0.3


@pytest.fixture(params=cpu_decode.ISAS)
def isa(request) -> str:
    """Every build of the kernel this CPU runs (an AVX-512 CPU runs the AVX2 one too)."""
    skip_unless_native(request.param)
    return request.param


@pytest.fixture(autouse=True)
def needs_native_kernel() -> None:
    skip_unless_native()


def check(batch, tol: float, isa: str | None = None, **options: object) -> torch.Tensor:
    query, kv_cache, metadata = batch
    out = native_paged_attention(query, kv_cache, metadata, SCALE, isa=isa, **options)
    expected = naive_paged_attention(query, kv_cache, metadata, SCALE, **options)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
def test_every_head_dim_and_dtype_matches_the_reference(dtype, head_dim, isa):
    # Contexts of one token, one block exactly, a block and one, and several blocks.
    batch = paged_batch(
        [1] * 5, [1, 16, 17, 70, 300], num_heads=6, num_kv_heads=2, head_dim=head_dim, dtype=dtype
    )
    check(batch, TOLERANCE[dtype], isa)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"),
    [(4, 4), (8, 4), (12, 4), (8, 1), (16, 2), (28, 4), (32, 8)],
    ids=lambda v: str(v),
)
def test_grouped_query_ratios(num_heads, num_kv_heads, isa):
    # G = 1, 2, 3, 8 (MQA), 8, 7 (more heads than one register tile holds), 4.
    batch = paged_batch(
        [1] * 4, [9, 40, 129, 33], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64
    )
    check(batch, TOLERANCE[torch.float32], isa)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_block_sizes(block_size, isa):
    batch = paged_batch(
        [1] * 4, [1, 31, 64, 100], num_heads=8, num_kv_heads=2, head_dim=64, block_size=block_size
    )
    check(batch, TOLERANCE[torch.float32], isa)


def test_long_context_over_many_shuffled_blocks(isa):
    batch = paged_batch([1, 1], [2500, 1], num_heads=8, num_kv_heads=2, head_dim=128)
    check(batch, TOLERANCE[torch.float32], isa)


def test_mixed_batch_leaves_prefill_rows_to_the_torch_path(isa):
    # Prefill chunks (from position 0 and mid-context) between decode rows.
    batch = paged_batch(
        [1, 7, 1, 12, 1], [20, 7, 90, 40, 1], num_heads=8, num_kv_heads=2, head_dim=64
    )
    check(batch, TOLERANCE[torch.float32], isa)
    check(batch, TOLERANCE[torch.float32], isa, sliding_window=10, logits_soft_cap=4.0)


def test_query_may_be_a_strided_view_of_fused_qkv(isa):
    query, kv_cache, metadata = paged_batch(
        [1, 1, 1], [5, 50, 17], num_heads=8, num_kv_heads=2, head_dim=64
    )
    fused = torch.randn(3, 12, 64)
    fused[:, :8] = query
    check((fused[:, :8], kv_cache, metadata), TOLERANCE[torch.float32], isa)


def test_agrees_with_the_torch_path_in_bfloat16(isa):
    """Both round one float32 result to bf16 (the torch path also rounds the probabilities), so
    they differ by at most a few bf16 steps of the output."""
    query, kv_cache, metadata = paged_batch(
        [1] * 8, [3, 17, 40, 64, 96, 130, 200, 31], num_heads=12, num_kv_heads=4,
        head_dim=64, dtype=torch.bfloat16,
    )  # fmt: skip
    native = native_paged_attention(query, kv_cache, metadata, SCALE, isa=isa)
    plain = attention.paged_attention(query, kv_cache, metadata, SCALE)
    torch.testing.assert_close(native.float(), plain.float(), atol=2e-2, rtol=2e-2)


def test_positions_past_a_request_context_are_never_read(isa):
    # NaN in every cache slot past each decode's seq_len inside its last block, and in the spare
    # blocks the table does not name.
    query, kv_cache, metadata = paged_batch(
        [1, 1, 1], [5, 16, 33], num_heads=4, num_kv_heads=2, head_dim=32
    )
    used = torch.zeros(kv_cache.shape[1], kv_cache.shape[2], dtype=torch.bool)
    for b, seq_len in enumerate(metadata.seq_lens.tolist()):
        for position in range(seq_len):
            used[metadata.block_table[b, position // 16], position % 16] = True
    poisoned = kv_cache.clone()
    poisoned[:, ~used] = float("nan")
    out = check((query, poisoned, metadata), TOLERANCE[torch.float32], isa)
    assert not out.isnan().any()


# --- calls the kernel declines ---------------------------------------------------------------


def declined(query, kv_cache, metadata) -> bool:
    out = torch.empty_like(query)
    return not cpu_decode.attend_decode(
        query,
        kv_cache,
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.decode_seqs,
        SCALE,
        None,
        None,
        None,
        out,
    )


@pytest.mark.parametrize(
    "case", ["head_dim_48", "fp8_cache", "query_dtype_differs", "query_last_dim_strided"]
)
def test_uncovered_calls_are_declined_and_served_by_the_torch_path(case):
    head_dim = 48 if case == "head_dim_48" else 32
    query, kv_cache, metadata = paged_batch(
        [1, 3, 1], [9, 3, 40], num_heads=4, num_kv_heads=2, head_dim=head_dim
    )
    options: dict[str, object] = {}
    if case == "fp8_cache":
        kv_cache = kv_cache.to(torch.float8_e4m3fn)
        query = query.to(torch.bfloat16)
        options = {"k_scale": 1.0, "v_scale": 1.0}
    elif case == "query_dtype_differs":
        kv_cache = kv_cache.to(torch.bfloat16)
        query = query.to(torch.float16)
    elif case == "query_last_dim_strided":
        query = torch.randn(query.shape[0], 4, 64)[:, :, ::2]
    if case != "fp8_cache":
        assert declined(query, kv_cache, metadata)
    # The whole call still answers, through the decode groups.
    cpu = functools.partial(attention.paged_attention, decode_kernel=cpu_decode.attend_decode)
    if case in ("fp8_cache", "query_dtype_differs"):
        return  # check_attention_args refuses mixed dtypes; FP8 is covered by its own tests
    got = cpu(query, kv_cache, metadata, SCALE, **options)
    torch.testing.assert_close(got, attention.paged_attention(query, kv_cache, metadata, SCALE))


def test_metadata_lists_the_decode_requests():
    metadata = AttentionMetadata.build(
        query_lens=np.array([1, 4, 0, 1]),
        seq_lens=np.array([9, 4, 5, 30]),
        block_table=np.arange(8).reshape(4, 2),
        slot_mapping=np.arange(6),
        block_size=16,
        device=torch.device("cpu"),
    )
    assert metadata.decode_seqs is not None
    assert metadata.decode_seqs.dtype == torch.int32
    assert metadata.decode_seqs.tolist() == [0, 3]


# --- the backend choice ------------------------------------------------------------------------


def test_auto_picks_the_native_kernel_on_cpu_and_torch_stays_selectable():
    assert resolve_attention_backend("auto", "cpu") == "cpu"
    assert KernelConfig(attention_backend="auto").resolved_backend("cpu") == "cpu"
    assert KernelConfig(attention_backend="torch").resolved_backend("cpu") == "torch"


def test_cpu_backend_on_a_gpu_device_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="attention_backend: 'cpu' runs on CPU only"):
        EngineConfig.from_kwargs(model="builtin:tiny-llama", attention_backend="cpu", device="cuda")
    with pytest.raises(ValueError, match="attention_backend 'cpu' needs a CPU device"):
        resolve_attention_backend("cpu", "cuda")


def test_cpu_ops_route_decode_rows_to_the_kernel(monkeypatch):
    calls = []
    real = cpu_decode.attend_decode

    def spy(*args):
        calls.append(args[5].tolist())
        return real(*args)

    monkeypatch.setattr(cpu_decode, "attend_decode", spy)
    ops = get_kernel_ops("cpu")
    assert ops.name == "cpu"
    query, kv_cache, metadata = paged_batch(
        [1, 5, 1], [9, 5, 40], num_heads=4, num_kv_heads=2, head_dim=32
    )
    # get_kernel_ops binds the function it finds, so the spy is seen through a fresh bundle.
    ops.paged_attention(query, kv_cache, metadata, SCALE)
    assert calls == [[0, 2]]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "the quick brown fox",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
    "a",
]


@pytest.mark.parametrize(
    "model", ["builtin:tiny-llama", "builtin:tiny-mistral", "builtin:tiny-gemma2"]
)
def test_engine_generates_the_torch_backends_greedy_tokens_in_fp32(model):
    # Gemma 2 brings soft-capping and sliding-window layers; a 16-token budget chunks the long
    # prompt, so steps mix prefill chunks and decodes.
    args = {"num_kv_blocks": 64, "max_num_batched_tokens": 16, "dtype": "float32"}
    tokens = {}
    for backend in ("torch", "cpu"):
        llm = LLM(model, attention_backend=backend, **args)
        layers = llm.llm_engine.executor.worker.runner.model.attention_layers()
        assert all(layer.ops.name == backend for layer in layers)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        tokens[backend] = [out.outputs[0].token_ids for out in outputs]
    assert tokens["cpu"] == tokens["torch"]
