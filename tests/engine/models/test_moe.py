"""Mixture-of-experts models: Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE (a dense layer
among sparse ones) give HF transformers' greedy tokens in fp32 under chunked prefill and
preemption; TP = 2 gives TP = 1's tokens; the grouped expert compute equals a per-token loop;
the loader takes per-expert and stacked checkpoints and names a missing expert; configs the
engine cannot serve exactly are refused by field."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.builtin.builtin_names import TINY_MOE_MODEL_NAMES
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_moe_models import tiny_moe_variant
from engine.errors import ConfigError
from engine.hf_config import check_hf_config
from engine.models import get_model_class
from engine.models.moe import Routing, SparseMoeBlock, route
from engine.worker.model_loader import iterate_checkpoint, load_weights
from llm_kernels.ops import silu_and_mul
from parallel.moe import grouped_experts
from parallel.state import GroupCoordinator, ParallelContext
from tests.engine.models.test_correctness import (
    SETTINGS,
    _assert_all_blocks_released,
    _hf_greedy,
    _prompts,
    assert_setting_held,
)
from tests.engine.spawned_ranks import greedy_steps, rank_config, run_ranks, workers_on_one_group

MOE_SETTINGS = SETTINGS  # defaults, chunked prefill, preemption by recompute and by swap
# The fast tier's prompts: 8 of up to 120 tokens and up to 32 generated. The two longest decode
# 32 tokens side by side, 2 x 10 blocks > the 16 blocks of its preemption setting.
SMALL_LENGTHS = [1, 3, 9, 17, 40, 64, 110, 120]
SMALL_SETTINGS = {
    **MOE_SETTINGS,
    "preempt_recompute": {"num_kv_blocks": 16, "preemption_mode": "recompute"},
    "preempt_swap": {"num_kv_blocks": 16, "preemption_mode": "swap", "swap_space": 0.05},
}


def _small_prompts(vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in SMALL_LENGTHS]
    max_tokens = [rng.choice([1, 8, 16, 32]) for _ in SMALL_LENGTHS]
    max_tokens[-2:] = [32, 32]
    return prompts, max_tokens


class Reference:
    """HF's greedy tokens for one tiny MoE model: the fast tier's small prompt set, or
    tests/engine/models/test_correctness.py's full one (16 prompts of up to 300 tokens + 64)."""

    def __init__(self, name: str, full: bool) -> None:
        self.name = name
        self.path = resolve_model_source(f"builtin:{name}")
        hf = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        make = _prompts if full else _small_prompts
        self.prompts, self.max_tokens = make(hf.config.vocab_size, 11)
        self.settings = MOE_SETTINGS if full else SMALL_SETTINGS
        with torch.no_grad():
            self.expected = [_hf_greedy(hf, p, m) for p, m in zip(self.prompts, self.max_tokens)]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((name, full), id=f"{name}-{'full' if full else 'small'}", marks=marks)
        for full, marks in ((False, ()), (True, pytest.mark.slow))
        for name in TINY_MOE_MODEL_NAMES
    ],
)
def ref(request: pytest.FixtureRequest) -> Reference:
    return Reference(*request.param)


@pytest.mark.parametrize("setting", list(MOE_SETTINGS))
def test_greedy_matches_hf(ref: Reference, setting: str) -> None:
    llm = LLM(str(ref.path), **ref.settings[setting])
    params = [SamplingParams(temperature=0, max_tokens=m) for m in ref.max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in ref.prompts], params, use_tqdm=False)
    for i, (out, expected) in enumerate(zip(outputs, ref.expected)):
        got = out.outputs[0].token_ids
        assert got == expected, f"{ref.name}/{setting}: prompt {i} differs"
    assert_setting_held(llm, setting)


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY_MOE_MODEL_NAMES)
def test_greedy_matches_hf_with_shared_prefix_cached(name: str) -> None:
    path = resolve_model_source(f"builtin:{name}")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(3)
    prefix = [rng.randrange(hf.config.vocab_size) for _ in range(70)]
    prompts = [
        prefix + [rng.randrange(hf.config.vocab_size) for _ in range(i + 1)] for i in range(6)
    ]
    with torch.no_grad():
        expected = [_hf_greedy(hf, p, 8) for p in prompts]
    llm = LLM(str(path), enable_prefix_caching=True, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.llm_engine.block_manager.prefix_hits > 0
    _assert_all_blocks_released(llm)


# Config switches the built-ins leave at one value: Qwen2-MoE sparse every 2nd layer (layer 0
# dense, HF's 1-based rule), Qwen3-MoE without top-k renormalization, Mixtral with a window
# shorter than the longer prompts.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2-moe-sparse-step-2": ("tiny-qwen2-moe", {"decoder_sparse_step": 2}),
    "qwen3-moe-no-topk-norm": ("tiny-qwen3-moe", {"norm_topk_prob": False}),
    "mixtral-window-48": ("tiny-mixtral", {"sliding_window": 48}),
    # GLM-4.5-Air's switches: one expert group, no q/k norm.
    "glm4-moe-air": ("tiny-glm4-moe", {"n_group": 1, "topk_group": 1, "use_qk_norm": False}),
    # No shared expert: HF writes its zero-width layer as empty tensors, which load as nothing.
    "deepseek-v3-no-shared": ("tiny-deepseek-v3", {"n_shared_experts": 0}),
    "glm4-moe-no-shared": ("tiny-glm4-moe", {"n_shared_experts": 0}),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variant_matches_hf(variant: str) -> None:
    name, overrides = VARIANTS[variant]
    path = tiny_moe_variant(name, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, max_tokens = _small_prompts(hf.config.vocab_size, 5)
    with torch.no_grad():
        expected = [_hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    llm = LLM(str(path), **SMALL_SETTINGS["chunked_prefill"])
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


# ---- the grouped expert compute ---------------------------------------------------------------


def _naive_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """One token, one expert at a time, in top-k order."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        acc = None
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            y = F.linear(silu_and_mul(F.linear(x[t : t + 1], w13[e])), w2[e])
            y = y * weights[t, k]
            acc = y if acc is None else acc + y
        out[t] = acc[0].to(x.dtype)
    return out


def _expert_weights(num_experts: int, hidden: int, inter: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w13, w2


def test_grouped_experts_equal_a_per_token_loop_with_uneven_loads() -> None:
    num_experts, hidden, inter, top_k = 8, 32, 16, 3
    w13, w2 = _expert_weights(num_experts, hidden, inter)
    x = torch.randn(13, hidden, generator=torch.Generator().manual_seed(1))
    # Expert 0 takes most pairs, 5 and 7 none; one token lists expert 2 twice.
    ids = torch.tensor(
        [[0, 1, 2]] * 6
        + [[0, 3, 4], [0, 6, 1], [2, 2, 0], [0, 1, 3], [6, 0, 4], [0, 3, 1]]
        + [[1, 0, 6]]
    )
    weights = torch.rand(13, top_k, generator=torch.Generator().manual_seed(2))
    got = grouped_experts(x, w13, w2, ids, weights, silu_and_mul)
    torch.testing.assert_close(got, _naive_moe(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


def test_grouped_experts_skip_experts_without_tokens_and_handle_no_tokens() -> None:
    w13, w2 = _expert_weights(8, 16, 8)
    # NaN weights in experts nobody picks: touching them would poison the output.
    w13[3:], w2[3:] = float("nan"), float("nan")
    x = torch.randn(4, 16)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 0]])
    weights = torch.full((4, 2), 0.5)
    got = grouped_experts(x, w13, w2, ids, weights, silu_and_mul)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _naive_moe(x, w13, w2, ids, weights))
    empty = grouped_experts(x[:0], w13, w2, ids[:0], weights[:0], silu_and_mul)
    assert empty.shape == (0, 16)


def test_routing_with_tied_router_logits_matches_the_naive_loop() -> None:
    num_experts, hidden, inter = 8, 16, 8
    w13, w2 = _expert_weights(num_experts, hidden, inter)
    x = torch.randn(6, hidden)
    # Rows of exact ties: all experts equal, and three equal leaders for top-2.
    logits = torch.zeros(6, num_experts)
    logits[1, [2, 5, 7]] = 1.0
    logits[2] = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.1, 0.1, 0.1, 0.1])
    logits[3:] = torch.randn(3, num_experts)
    for renormalize in (False, True):
        weights, ids = route(logits, 2, Routing(renormalize=renormalize), torch.float32)
        # Tied experts keep equal weights, and top-k picks distinct experts per token.
        assert torch.equal(weights[0], torch.full((2,), 0.5 if renormalize else 1 / 8))
        assert all(len(set(row.tolist())) == 2 for row in ids)
        assert set(ids[1].tolist()) <= {2, 5, 7}
        assert set(ids[2].tolist()) <= {0, 1, 2, 3}
        got = grouped_experts(x, w13, w2, ids, weights, silu_and_mul)
        torch.testing.assert_close(got, _naive_moe(x, w13, w2, ids, weights))


def test_qwen_routing_weights_are_applied_in_the_model_dtype() -> None:
    hf = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "hidden_act": "silu",
    }
    with torch.device("cpu"):
        routing = Routing(renormalize=True)
        block = SparseMoeBlock(hf, ParallelContext(), _torch_ops(), routing=routing).bfloat16()
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    weights, ids = route(F.linear(x, block.gate.weight), 2, routing, torch.float32)
    expected = _naive_moe(
        x, block.experts.gate_up_proj, block.experts.down_proj, ids, weights.bfloat16()
    )
    got = block(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@dataclasses.dataclass(frozen=True)
class _CountingGroup(GroupCoordinator):
    """Rank 0 of a TP group of 2 whose all-reduce only counts its calls."""

    calls: list[int] = dataclasses.field(default_factory=list)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return x


def test_moe_layer_with_shared_expert_all_reduces_once_per_forward() -> None:
    hf = _config("tiny-qwen2-moe")
    tp = _CountingGroup(rank=0, size=2, ranks=(0, 1))
    block = SparseMoeBlock(
        hf,
        ParallelContext(tp=tp),
        _torch_ops(),
        routing=Routing(),
        shared_expert_intermediate_size=96,
    )
    # Each rank holds half of every expert's and the shared expert's intermediate dimension.
    assert tuple(block.experts.gate_up_proj.shape) == (8, 32, 64)
    assert tuple(block.experts.down_proj.shape) == (8, 64, 16)
    assert tuple(block.shared_expert.down_proj.weight.shape) == (64, 48)
    assert tuple(block.shared_expert_gate.weight.shape) == (1, 64)
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    block(torch.randn(7, 64))
    assert tp.calls == [7]


def _torch_ops() -> Any:
    from llm_kernels.backend import get_kernel_ops

    return get_kernel_ops("torch")


# ---- loading -----------------------------------------------------------------------------------


def _engine_model(path: Path) -> Any:
    from engine.config import EngineConfig

    config = EngineConfig.from_kwargs(model=str(path), dtype="float32")
    hf = config.model.hf_config
    model = get_model_class(config.model.architecture)(hf, ParallelContext(), ops=_torch_ops())
    return model, hf


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen2-moe"])
def test_stacked_checkpoint_loads_like_the_per_expert_one(name: str, tmp_path: Path) -> None:
    path = resolve_model_source(f"builtin:{name}")
    per_expert, hf = _engine_model(path)
    load_weights(per_expert, iterate_checkpoint(path, progress=False))
    # transformers' in-memory layout: experts.gate_up_proj [E, 2I, H], experts.down_proj
    # [E, H, I], Mixtral's block under "mlp".
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    stacked, _ = _engine_model(path)
    load_weights(stacked, iterate_checkpoint(tmp_path, progress=False), hf_config=hf)
    for (n, a), (_, b) in zip(per_expert.named_parameters(), stacked.named_parameters()):
        assert torch.equal(a, b), n


def test_checkpoint_missing_an_expert_is_named(tmp_path: Path) -> None:
    path = resolve_model_source("builtin:tiny-qwen3-moe")
    model, hf = _engine_model(path)
    dropped = "model.layers.0.mlp.experts.5.up_proj.weight"
    weights = ((n, t) for n, t in iterate_checkpoint(path, progress=False) if n != dropped)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj \(part \(5, 1\)\)"
    ):
        load_weights(model, weights, hf_config=hf)


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_pipeline_stage_loads_only_its_layers_experts(pp_rank: int) -> None:
    path = resolve_model_source("builtin:tiny-qwen3-moe")
    whole, hf = _engine_model(path)
    load_weights(whole, iterate_checkpoint(path, progress=False))
    pp = GroupCoordinator(rank=pp_rank, size=2, ranks=(0, 1))
    stage = get_model_class(hf["architectures"][0])(hf, ParallelContext(pp=pp), ops=_torch_ops())
    load_weights(stage, iterate_checkpoint(path, progress=False))
    expected = dict(whole.named_parameters())
    names = [n for n, _ in stage.named_parameters()]
    assert any(".mlp.experts.gate_up_proj" in n for n in names)
    for name, param in stage.named_parameters():
        assert torch.equal(param, expected[name]), name


# ---- refused configs ---------------------------------------------------------------------------


def _config(name: str, **changes: Any) -> dict[str, Any]:
    import json

    path = resolve_model_source(f"builtin:{name}")
    hf = json.loads((path / "config.json").read_text())
    hf.update(changes)
    return hf


@pytest.mark.parametrize(
    ("name", "changes", "field"),
    [
        ("tiny-qwen3-moe", {"scoring_func": "sigmoid"}, "scoring_func"),
        ("tiny-mixtral", {"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
        ("tiny-qwen2-moe", {"n_group": 4}, "n_group"),
        (
            "tiny-qwen3-moe",
            {"use_sliding_window": True, "sliding_window": 64},
            "use_sliding_window",
        ),
        ("tiny-mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("tiny-qwen3-moe", {"mlp_only_layers": [7]}, "mlp_only_layers"),
        ("tiny-qwen2-moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("tiny-gpt-oss", {"swiglu_limit": None}, "swiglu_limit"),
        ("tiny-gpt-oss", {"swiglu_alpha": 0}, "swiglu_alpha"),
        ("tiny-gpt-oss", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ],
)
def test_config_the_engine_cannot_serve_exactly_is_refused_by_field(
    name: str, changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        check_hf_config(_config(name, **changes))


def test_tiny_moe_configs_are_accepted() -> None:
    for name in TINY_MOE_MODEL_NAMES:
        check_hf_config(_config(name))


# ---- TP = 2 equals TP = 1 ---------------------------------------------------------------------

TP_MODELS = (
    "tiny-qwen2-moe",
    "tiny-qwen3-moe",
    "tiny-deepseek-v3",
    "tiny-glm4-moe",
    "tiny-gpt-oss",
)
TP_PROMPTS = [[5, 9, 21, 7], [100, 3, 3, 8, 40, 41, 2] * 4, [17, 18], list(range(30, 71))]
TP_DECODE_STEPS = 12
BLOCKS_PER_REQUEST = 4  # 64 tokens: the longest prompt + the decode steps fit


def _worker_config(name: str, tp: int, rank: int) -> Any:
    return rank_config(
        rank,
        model=str(resolve_model_source(f"builtin:{name}")),
        dtype="float32",
        tensor_parallel_size=tp,
        num_kv_blocks=64,
        max_model_len=128,
    )


def _greedy_steps(worker: Any, prefix: str) -> list[list[int]]:
    """Prefill every TP prompt, then TP_DECODE_STEPS decode steps (rank 0 samples)."""
    return greedy_steps(
        worker, TP_PROMPTS, TP_DECODE_STEPS, prefix=prefix, blocks_per_request=BLOCKS_PER_REQUEST
    )


def _tp_rank_main(rank: int, ports: Any, results: Any) -> None:
    try:
        configs = {name: _worker_config(name, 2, rank) for name in TP_MODELS}
        out = {
            name: _greedy_steps(worker, name)
            for name, worker in workers_on_one_group(rank, 2, ports, configs)
        }
        results.put((rank, out))
    except BaseException as exc:
        results.put((rank, repr(exc)))


@pytest.fixture(scope="module")
def tp2_tokens() -> dict[str, list[list[int]]]:
    for name in TP_MODELS:
        resolve_model_source(f"builtin:{name}")  # built once, before the ranks race for it
    collected = run_ranks(_tp_rank_main, 2)
    assert collected[0] == collected[1], "the ranks disagree on the sampled tokens"
    return collected[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", TP_MODELS)
def test_tensor_parallel_2_equals_1(tp2_tokens: dict[str, list[list[int]]], name: str) -> None:
    llm = LLM(str(resolve_model_source(f"builtin:{name}")), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=TP_DECODE_STEPS + 1, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in TP_PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == tp2_tokens[name]
