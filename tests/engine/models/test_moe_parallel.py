"""Expert parallelism (``enable_expert_parallel``): each EP rank holds exactly its experts'
whole weights (the shared expert stays TP-sliced), its partial sums add up to the TP = 1 layer
with one all-reduce, a checkpoint loads per expert or stacked, the CPU path agrees with
``fused_moe``'s ``expert_map`` contract, an expert count the EP size does not divide is
refused before anything loads, and EP = 2 (CPU, gloo, spawned workers) gives TP = 1's greedy
tokens for every MoE family (Qwen2-MoE with its shared expert, Qwen3-MoE, Mixtral)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.models import get_model_class
from engine.models.moe import Routing, SparseMoeBlock
from engine.worker.model_loader import iterate_checkpoint, load_weights
from llm_kernels.backend import get_kernel_ops
from llm_kernels.moe import fused_moe
from llm_kernels.ops import silu_and_mul
from parallel.moe import ParallelExperts, grouped_experts
from parallel.state import GroupCoordinator, ParallelContext
from tests.engine.models.test_moe import (
    TP_DECODE_STEPS,
    TP_PROMPTS,
    _config,
    _CountingGroup,
    _greedy_steps,
)
from tests.engine.spawned_ranks import greedy_steps, rank_config, run_ranks, workers_on_one_group

# Shared expert or not; DeepSeek's routing and latent attention.
EP_MODELS = (
    "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2", "tiny-glm4-moe",
    "tiny-gpt-oss",
)  # fmt: skip


def _ep_context(rank: int, size: int = 2) -> ParallelContext:
    tp = GroupCoordinator(rank=rank, size=size, ranks=tuple(range(size)))
    return ParallelContext(tp=tp, expert_parallel=True)


def _loaded_model(name: str, ctx: ParallelContext) -> torch.nn.Module:
    path = resolve_model_source(f"builtin:{name}")
    hf = json.loads((path / "config.json").read_text())
    model = get_model_class(hf["architectures"][0])(hf, ctx, ops=get_kernel_ops("torch"))
    load_weights(model, iterate_checkpoint(path, progress=False))
    return model


# ---- placement and loading --------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_each_ep_rank_loads_exactly_its_experts_whole(rank: int) -> None:
    whole = dict(_loaded_model("tiny-qwen2-moe", ParallelContext()).named_parameters())
    shard = _loaded_model("tiny-qwen2-moe", _ep_context(rank))
    experts = [m for m in shard.modules() if isinstance(m, ParallelExperts)]
    assert experts
    for module in experts:
        # 8 experts over 2 ranks: rank r owns experts [4r, 4r + 4), every intermediate row.
        assert (module.first_expert, module.num_local_experts) == (4 * rank, 4)
        assert module.expected_parts("down_proj") == frozenset(range(4 * rank, 4 * rank + 4))
    for name, param in shard.named_parameters():
        full = whole[name]
        if ".experts." in name:
            torch.testing.assert_close(param, full[4 * rank : 4 * rank + 4], rtol=0, atol=0)
        elif ".shared_expert.down_proj" in name:
            # The shared expert stays sliced on the intermediate dim as under TP.
            assert param.shape == (full.shape[0], full.shape[1] // 2), name
        elif ".mlp.gate." in name or "shared_expert_gate" in name:
            assert torch.equal(param, full), name  # the router and the gate: replicated


def test_stacked_checkpoint_tensors_load_only_the_ranks_experts() -> None:
    num_experts, hidden, inter = 8, 16, 12
    w13 = torch.randn(num_experts, 2 * inter, hidden)
    w2 = torch.randn(num_experts, hidden, inter)
    for rank in range(4):
        tp = GroupCoordinator(rank=rank, size=4, ranks=(0, 1, 2, 3))
        experts = ParallelExperts(
            num_experts, hidden, inter, silu_and_mul, tp=tp, expert_parallel=True
        )
        experts.gate_up_loader(experts.gate_up_proj, w13)
        experts.down_loader(experts.down_proj, w2)
        assert torch.equal(experts.gate_up_proj, w13[2 * rank : 2 * rank + 2])
        assert torch.equal(experts.down_proj, w2[2 * rank : 2 * rank + 2])


def test_expert_count_the_ep_size_does_not_divide_is_refused_by_the_layer() -> None:
    tp = GroupCoordinator(rank=0, size=3, ranks=(0, 1, 2))
    with pytest.raises(ValueError, match=r"num_experts \(enable_expert_parallel\) \(8\)"):
        ParallelExperts(8, 16, 12, silu_and_mul, tp=tp, expert_parallel=True)


# ---- compute -----------------------------------------------------------------------------------


def test_ep_ranks_partial_sums_add_up_to_the_whole_layer_with_one_all_reduce() -> None:
    hf = _config("tiny-qwen2-moe")
    ops = get_kernel_ops("torch")
    shared = {"routing": Routing(), "shared_expert_intermediate_size": 96}
    whole = SparseMoeBlock(hf, ParallelContext(), ops, **shared)
    g = torch.Generator().manual_seed(0)
    for p in whole.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    state = dict(whole.named_parameters())
    x = torch.randn(9, 64, generator=g)
    total = torch.zeros_like(x)
    for rank in range(2):
        tp = _CountingGroup(rank=rank, size=2, ranks=(0, 1))
        block = SparseMoeBlock(hf, ParallelContext(tp=tp, expert_parallel=True), ops, **shared)
        for name, param in block.named_parameters():
            # Each parameter's loader takes the whole tensor and keeps this rank's part: its
            # experts (stacked [E, ...]), its slice of the shared expert; the gates whole.
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(state[name])
            else:
                loader(param, state[name])
        total += block(x)
        assert tp.calls == [9]
    torch.testing.assert_close(total, whole(x), rtol=1e-5, atol=1e-6)


def test_grouped_experts_skip_pairs_of_another_rank() -> None:
    g = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(4, 16, 8, generator=g), torch.randn(4, 8, 8, generator=g)
    x, weights = torch.randn(5, 8, generator=g), torch.rand(5, 2, generator=g)
    ids = torch.tensor([[0, -1], [-1, -1], [3, 1], [-1, 2], [1, 1]])
    got = grouped_experts(x, w13, w2, ids, weights, silu_and_mul)
    masked = torch.where(ids < 0, 0.0, weights)
    expected = grouped_experts(x, w13, w2, ids.clamp(min=0), masked, silu_and_mul)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[1], torch.zeros(8))


def test_cpu_ep_path_equals_fused_moe_with_the_expert_map() -> None:
    """The contract the CUDA path relies on: ``fused_moe`` with this rank's ``expert_map``
    gives what the CPU path gives (fp32; here ``fused_moe``'s torch backend)."""
    g = torch.Generator().manual_seed(4)
    tp = GroupCoordinator(rank=1, size=2, ranks=(0, 1))
    experts = ParallelExperts(8, 32, 16, silu_and_mul, tp=tp, expert_parallel=True)
    experts.gate_up_proj.data.copy_(torch.randn(4, 32, 32, generator=g) / 6)
    experts.down_proj.data.copy_(torch.randn(4, 32, 16, generator=g) / 4)
    expert_map = experts.expert_map(torch.device("cpu"))
    assert expert_map.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    x = torch.randn(11, 32, generator=g)
    ids = torch.randint(0, 8, (11, 2), generator=g)
    weights = torch.rand(11, 2, generator=g)
    w13, w2 = experts.gate_up_proj, experts.down_proj
    expected = fused_moe(x, w13, w2, weights, ids, expert_map=expert_map, backend="torch")
    torch.testing.assert_close(experts(x, ids, weights), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_cuda_experts_use_the_fused_kernel_and_equal_the_cpu_path(
    expert_parallel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import parallel.moe

    calls: list[bool] = []

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs.get("expert_map") is not None)
        return fused_moe(*args, **kwargs)

    monkeypatch.setattr(parallel.moe, "fused_moe", counted)
    g = torch.Generator().manual_seed(5)
    tp = GroupCoordinator(rank=1, size=2, ranks=(0, 1))
    experts = ParallelExperts(8, 64, 32, silu_and_mul, tp=tp, expert_parallel=expert_parallel)
    for p in experts.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / 8)
    x = torch.randn(37, 64, generator=g)
    ids = torch.randint(0, 8, (37, 2), generator=g)
    weights = torch.rand(37, 2, generator=g)
    expected = experts(x, ids, weights)
    experts.cuda()
    got = experts(x.cuda(), ids.cuda(), weights.cuda())
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)
    assert calls == [expert_parallel]  # once, with an expert_map exactly under EP


# ---- config ------------------------------------------------------------------------------------


def _config_dir(tmp_path: Path, **changes: Any) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(_config("tiny-qwen3-moe", **changes)))
    return tmp_path


def test_experts_not_divisible_by_the_ep_size_are_refused_before_loading(tmp_path: Path) -> None:
    model = str(_config_dir(tmp_path, num_experts=6))
    # Only config.json exists: the refusal comes before any weight is read.
    with pytest.raises(ConfigError, match=r"^enable_expert_parallel: .*num_experts \(6\)"):
        EngineConfig.from_kwargs(model=model, tensor_parallel_size=4, enable_expert_parallel=True)
    config = EngineConfig.from_kwargs(model=model, tensor_parallel_size=4)
    assert not config.parallel.enable_expert_parallel  # TP slices the experts instead


def test_enable_expert_parallel_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^enable_expert_parallel: must be true or false"):
        EngineConfig.from_kwargs(model=str(_config_dir(tmp_path)), enable_expert_parallel=1)


def test_data_parallel_configs_the_engine_cannot_run_are_refused_by_name(tmp_path: Path) -> None:
    model = str(_config_dir(tmp_path))  # Qwen3-MoE, 8 experts; only config.json exists
    ep = {"enable_expert_parallel": True}
    refused = [
        ({"data_parallel_size": 2}, r"^data_parallel_size: > 1 needs enable_expert_parallel"),
        (
            {"data_parallel_size": 2, "pipeline_parallel_size": 2, **ep},
            r"^data_parallel_size: does not combine with pipeline parallelism",
        ),
        (
            {"data_parallel_size": 3, **ep},
            r"^enable_expert_parallel: needs num_experts \(8\) divisible by the EP size "
            r"\(data_parallel_size x tensor_parallel_size\), got 3",
        ),
        (
            {"data_parallel_size": 4, "tensor_parallel_size": 4, **ep},
            r"^enable_expert_parallel: .* got 16",
        ),
        ({"data_parallel_size": 0}, r"^data_parallel_size: must be an integer >= 1, got 0"),
        (
            {"data_parallel_size": 2, "distributed_executor_backend": "uni", **ep},
            r"^distributed_executor_backend: 'uni' runs one worker",
        ),
        (
            {
                "data_parallel_size": 2,
                "speculative_config": {
                    "method": "draft_model",
                    "model": model,
                    "num_speculative_tokens": 2,
                },
                **ep,
            },
            r"^speculative_config: method draft_model does not combine with data_parallel_size",
        ),
    ]
    for kwargs, message in refused:
        with pytest.raises(ConfigError, match=message):
            EngineConfig.from_kwargs(model=model, **kwargs)
    dense = str(resolve_model_source("builtin:tiny-llama"))
    with pytest.raises(ConfigError, match=r"^data_parallel_size: > 1 needs a mixture-of-experts"):
        EngineConfig.from_kwargs(model=dense, data_parallel_size=2, **ep)
    config = EngineConfig.from_kwargs(model=model, data_parallel_size=2, **ep)
    assert (config.parallel.world_size, config.parallel.ep_size) == (2, 2)
    assert config.parallel.executor_backend == "ray"


# ---- EP = 2 equals TP = 1 ---------------------------------------------------------------------


def _ep_worker_config(name: str, rank: int, tp: int = 2, dp: int = 1) -> EngineConfig:
    return rank_config(
        rank,
        model=str(resolve_model_source(f"builtin:{name}")),
        dtype="float32",
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        enable_expert_parallel=True,
        num_kv_blocks=64,
        max_model_len=128,
    )


def _ep_rank_main(rank: int, ports: Any, results: Any) -> None:
    try:
        out = {}
        configs = {name: _ep_worker_config(name, rank) for name in EP_MODELS}
        for name, worker in workers_on_one_group(rank, 2, ports, configs):
            held = {
                (m.first_expert, m.num_local_experts)
                for m in worker.runner.model.modules()
                if isinstance(m, ParallelExperts)
            }
            out[name] = (_greedy_steps(worker, name), held)
        results.put((rank, out))
    except BaseException as exc:
        results.put((rank, repr(exc)))


@pytest.fixture(scope="module")
def ep2_results() -> dict[str, Any]:
    for name in EP_MODELS:
        resolve_model_source(f"builtin:{name}")  # built once, before the ranks race for it
    return run_ranks(_ep_rank_main, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", EP_MODELS)
def test_expert_parallel_2_equals_tensor_parallel_1(ep2_results: dict[str, Any], name: str) -> None:
    (tokens0, held0), (tokens1, held1) = ep2_results[0][name], ep2_results[1][name]
    assert (held0, held1) == ({(0, 4)}, {(4, 4)}), "each rank holds its half of the experts"
    assert tokens0 == tokens1, "the ranks disagree on the sampled tokens"
    llm = LLM(str(resolve_model_source(f"builtin:{name}")), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=TP_DECODE_STEPS + 1, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in TP_PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == tokens0


# ---- data-parallel attention: the token exchange --------------------------------------------

# Tokens per DP rank in each round: uneven, one rank idle, both idle, fewer tokens than TP ranks.
EXCHANGE_ROUNDS = ((5, 3), (0, 4), (1, 0), (0, 0), (9, 2))


def _exchange_rank_main(rank: int, ports: Any, results: Any, dp: int, tp: int) -> None:
    try:
        from parallel.distributed import (
            connect_store,
            create_store,
            destroy_distributed,
            init_distributed,
        )

        world = dp * tp
        if rank == 0:
            rendezvous = create_store("127.0.0.1", world)
            for _ in range(world - 1):
                ports.put(rendezvous.port)
            store = rendezvous.store
        else:
            store = connect_store("127.0.0.1", ports.get(timeout=60), world)
        ctx = init_distributed(store, rank, tp, 1, torch.device("cpu"), dp_size=dp)
        ctx = dataclasses.replace(ctx, expert_parallel=True)
        dp_rank = rank // tp
        out: dict[str, Any] = {}
        for name in EP_MODELS:
            whole = dict(_loaded_model(name, ParallelContext()).named_modules())
            part = _loaded_model(name, ctx)
            blocks = [(n, m) for n, m in part.named_modules() if isinstance(m, SparseMoeBlock)]
            hidden = part.hf["hidden_size"]
            held = {(b.experts.first_expert, b.experts.num_local_experts) for _, b in blocks}
            worst = 0.0
            for round_, counts in enumerate(EXCHANGE_ROUNDS):
                # The DP rank's TP ranks hold the same tokens; the DP ranks different ones.
                g = torch.Generator().manual_seed(100 * round_ + dp_rank)
                x = torch.randn(counts[dp_rank], hidden, generator=g)
                for block_name, block in blocks:
                    assert block.experts.exchanges_tokens
                    got, expected = block(x), whole[block_name](x)
                    assert got.shape == expected.shape, (got.shape, expected.shape)
                    if got.numel():
                        scale = expected.abs().max().item() + 1e-6
                        worst = max(worst, (got - expected).abs().max().item() / scale)
            # bfloat16: the expert ids ride in the rows' extra columns as two bf16 halves.
            g = torch.Generator().manual_seed(7 + dp_rank)
            x = torch.randn(6 + 3 * dp_rank, hidden, generator=g).bfloat16()
            worst_bf16 = 0.0
            for block_name, block in blocks:
                got = block.bfloat16()(x)
                expected = whole[block_name].bfloat16()(x)
                scale = expected.abs().max().item()
                worst_bf16 = max(worst_bf16, (got - expected).abs().max().item() / scale)
            out[name] = (held, worst, worst_bf16)
        destroy_distributed()
        results.put((rank, out))
    except BaseException as exc:
        import traceback

        results.put((rank, f"{exc!r}\n{traceback.format_exc()}"))


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (2, 2)], ids=["dp2-tp1", "dp2-tp2"])
def test_data_parallel_ep_exchanges_tokens_and_equals_the_whole_layer(dp: int, tp: int) -> None:
    """DP x TP ranks, each DP rank with its own tokens (uneven, idle, none at all), every expert
    on exactly one of the DP x TP ranks: each MoE layer (router, experts by all-to-all, shared
    experts, the TP all-reduce) gives what the whole layer on one rank gives for those tokens,
    for every MoE family (Qwen2-MoE's gated shared expert, Qwen3-MoE, Mixtral, DeepSeek-V2/V3's
    grouped routing, GLM-4.5, gpt-oss's biased experts)."""
    for name in EP_MODELS:
        resolve_model_source(f"builtin:{name}")  # built once, before the ranks race for it
    results = run_ranks(_exchange_rank_main, dp * tp, dp, tp)
    per_rank = 8 // (dp * tp)
    for rank, out in results.items():
        for name, (held, worst, worst_bf16) in out.items():
            assert held == {(rank * per_rank, per_rank)}, (name, rank, held)
            # fp32; each expert's GEMM sees the pairs of both DP ranks, so its row count (not
            # the arithmetic per row) differs from the whole layer's.
            assert worst < 1e-5, (name, rank, worst)
            assert worst_bf16 < 2e-2, (name, rank, worst_bf16)


def test_all_to_all_counts_are_checked_at_the_entry() -> None:
    group = GroupCoordinator()
    with pytest.raises(ValueError, match=r"send_counts: must be 1 non-negative row counts"):
        group.all_to_all(torch.zeros(2, 3), [1, 1], [2])
    with pytest.raises(ValueError, match=r"send_counts: must add up to the 2 rows of x"):
        group.all_to_all(torch.zeros(2, 3), [3], [3])
    assert group.all_to_all_counts([4]) == [4]


# ---- data parallel: whole workers in lockstep -----------------------------------------------

DP_MODELS = ("tiny-qwen3-moe", "tiny-deepseek-v3")
# Per DP rank: its prompts, the steps it idles before its prefill, its decode steps. Every
# rank runs DP_STEPS steps in all, idling after its last decode step.
DP_WORK = (
    (TP_PROMPTS[:3], 0, TP_DECODE_STEPS),
    (TP_PROMPTS[3:] + [[9, 8, 7, 6, 5]], 4, 6),
)
DP_STEPS = 4 + TP_DECODE_STEPS + 1


def _dp_rank_main(rank: int, ports: Any, results: Any, dp: int, tp: int) -> None:
    try:
        out = {}
        configs = {name: _ep_worker_config(name, rank, tp, dp) for name in DP_MODELS}
        for name, worker in workers_on_one_group(rank, dp * tp, ports, configs):
            dp_rank = rank // tp
            prompts, idle_before, steps = DP_WORK[dp_rank]
            tokens = greedy_steps(
                worker, prompts, steps, prefix=f"{name}-", blocks_per_request=4,
                driver_rank=dp_rank * tp, idle_before=idle_before,
                idle_after=DP_STEPS - idle_before - steps - 1,
                group=worker.ctx.tp,
            )  # fmt: skip
            held = {
                (m.first_expert, m.num_local_experts)
                for m in worker.runner.model.modules()
                if isinstance(m, ParallelExperts)
            }
            out[name] = (tokens, held)
        results.put((rank, out))
    except BaseException as exc:
        import traceback

        results.put((rank, f"{exc!r}\n{traceback.format_exc()}"))


@pytest.mark.slow  # ~30-50 s each: spawned ranks loading two models
@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (2, 2)], ids=["dp2-tp1", "dp2-tp2"])
def test_data_parallel_workers_in_lockstep_give_tp1_greedy_tokens(dp: int, tp: int) -> None:
    """DP x TP workers (gloo, spawned), each DP rank with its own requests: one idles for the
    first steps and after its requests end while the other decodes (its MoE layers still take
    part in every exchange). Every request's greedy tokens equal TP = 1's, for Qwen3-MoE and
    DeepSeek-V3 (latent attention, grouped routing, shared experts)."""
    for name in DP_MODELS:
        resolve_model_source(f"builtin:{name}")  # built once, before the ranks race for it
    results = run_ranks(_dp_rank_main, dp * tp, dp, tp)
    per_rank = 8 // (dp * tp)
    for name in DP_MODELS:
        llm = LLM(str(resolve_model_source(f"builtin:{name}")), dtype="float32")
        for rank, out in results.items():
            tokens, held = out[name]
            assert held == {(rank * per_rank, per_rank)}, (name, rank, held)
            prompts, _, steps = DP_WORK[rank // tp]
            params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
            expected = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
            )
            assert tokens == [o.outputs[0].token_ids for o in expected], (name, rank)
        llm.llm_engine.shutdown()
