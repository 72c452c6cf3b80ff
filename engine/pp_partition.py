"""Which decoder layers each pipeline stage holds: one answer, from ``config.json`` and the
engine settings, for the model code (``engine.models.decoder.DecoderModel``), the memory plan
(``engine.worker.memory_plan``, what ``cluster plan`` prints) and the config check
(``engine.config``). Torch-free, like the memory plan that imports it.

Where the partition comes from, the first that applies:

    1. ``pp_layer_partition``, the engine argument: layers per stage, e.g. [7, 5];
    2. ``VLLM_PP_LAYER_PARTITION``, vLLM's variable ("7,5"), read when
       pipeline_parallel_size > 1 (``engine.config`` puts it into the config on the head, so
       every worker builds the same stages);
    3. the balanced default (``default_partition``): the last stage, which also runs the LM
       head, gets fewer layers so that the stages' estimated cost per token is as even as it
       can be (BENCHMARKS.md, "Pipelined PP: stage balance").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine import envs, hf_config
from engine.errors import ConfigError


def attention_macs(hf: Mapping[str, Any]) -> int:
    """Multiply-adds per token of one layer's attention projections (not the attention itself,
    which grows with the context)."""
    conf = dict(hf)
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hf_config.architecture(conf) in hf_config.DEEPSEEK_ARCHITECTURES:

        def field(key: str) -> int:
            return int(hf_config.config_field(conf, key) or 0)

        q_head = field("qk_nope_head_dim") + field("qk_rope_head_dim")
        q_lora = field("q_lora_rank")
        q = hidden * q_lora + q_lora * heads * q_head if q_lora else hidden * heads * q_head
        kv_lora = field("kv_lora_rank")
        kv = hidden * (kv_lora + field("qk_rope_head_dim"))
        kv += kv_lora * heads * (field("qk_nope_head_dim") + field("v_head_dim"))
        return q + kv + heads * field("v_head_dim") * hidden
    head_dim = int(hf.get("head_dim") or hidden // heads)
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def mlp_macs(hf: Mapping[str, Any], layer: int) -> int:
    """Multiply-adds per token of layer ``layer``'s feed-forward: the gated MLP, or the router
    and the experts a token goes through (top-k routed, plus the shared ones)."""
    conf = dict(hf)
    hidden = int(hf["hidden_size"])
    if not hf_config.is_sparse_layer(conf, layer):
        return 3 * hidden * int(hf["intermediate_size"])
    routed = int(hf["num_experts_per_tok"]) * hf_config.moe_intermediate_size(conf)
    shared = hf_config.shared_expert_intermediate_size(conf)
    return hidden * hf_config.num_experts(conf) + 3 * hidden * (routed + shared)


def mlp_params(hf: Mapping[str, Any], layer: int) -> int:
    """Weights of layer ``layer``'s feed-forward: every expert of a sparse layer, not its top-k."""
    conf = dict(hf)
    if not hf_config.is_sparse_layer(conf, layer):
        return mlp_macs(hf, layer)
    hidden, experts = int(hf["hidden_size"]), hf_config.num_experts(conf)
    routed = experts * hf_config.moe_intermediate_size(conf)
    shared = hf_config.shared_expert_intermediate_size(conf)
    return hidden * experts + 3 * hidden * (routed + shared)


def lm_head_layers(hf: Mapping[str, Any]) -> float:
    """The last stage's extra work (LM head) in decoder layers of the model's average cost."""
    num_layers = int(hf["num_hidden_layers"])
    layer = attention_macs(hf) + sum(mlp_macs(hf, i) for i in range(num_layers)) / num_layers
    head = int(hf["vocab_size"]) * int(hf["hidden_size"])
    return head / layer


def head_room_layers(hf: Mapping[str, Any]) -> int:
    """How many layers beyond the even split one stage may hold: as many whole layers as weigh
    no more than the LM head (vocab x hidden), which the last stage holds on top of its own."""
    num_layers = int(hf["num_hidden_layers"])
    layer = attention_macs(hf) + sum(mlp_params(hf, i) for i in range(num_layers)) / num_layers
    return int(int(hf["vocab_size"]) * int(hf["hidden_size"]) // layer)


def balanced_partition(
    num_layers: int, pp_size: int, last_stage_extra: float, head_room: int | None = None
) -> tuple[int, ...]:
    """Layers per stage that minimize the largest stage cost, with every layer costing 1 and the
    last stage ``last_stage_extra`` more, no stage holding more than ``head_room`` layers beyond
    the even split's largest (None: no bound). The stages before the last split the rest
    evenly, earlier ones taking the remainder; of equally slow choices the most even one wins,
    then the one with the fewest layers on the last stage. With no extra: the even split."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pp_size must be in [1, {num_layers}], got {pp_size}")
    if pp_size == 1:
        return (num_layers,)
    most = num_layers if head_room is None else -(-num_layers // pp_size) + head_room
    candidates = [
        stages
        for last in range(1, num_layers - pp_size + 2)
        if max(stages := _with_last_stage(num_layers, pp_size, last)) <= most
    ]

    def slowest_then_spread(stages: tuple[int, ...]) -> tuple[float, float]:
        costs = [*stages[:-1], stages[-1] + last_stage_extra]
        return max(costs), sum(c * c for c in costs)

    return min(candidates, key=slowest_then_spread)  # the first of equals: fewest on the last


def _with_last_stage(num_layers: int, pp_size: int, last: int) -> tuple[int, ...]:
    """``last`` layers on the last stage, the rest split evenly, earlier stages first."""
    base, extra = divmod(num_layers - last, pp_size - 1)
    return (*([base + 1] * extra), *([base] * (pp_size - 1 - extra)), last)


def default_partition(hf: Mapping[str, Any], pp_size: int) -> tuple[int, ...]:
    """The balanced default for ``hf``'s model over ``pp_size`` stages.

    A pipelined step moves at the pace of its slowest stage, and the stages do not carry the
    same work: the last one also runs the final norm, the LM head and sampling. The default
    estimates each stage's cost per token in multiply-adds and gives the last stage fewer
    layers, so that the largest stage cost is as small as it can be (each stage at least one
    layer, and no stage more layers beyond the even split's than weigh as much as the LM head:
    the memory a stage frees for its KV cache is not given away for little compute, as one MoE
    layer, all experts, would be)::

        decoder layer   q/k/v/o projections (latent attention: its down and up projections)
                        and the gated MLP, or for a sparse layer the router, top-k experts and
                        shared experts: averaged over the layers
        last stage      + the LM head, vocab x hidden per token (tied to the embedding or not);
                        its norm and sampling are elementwise: not counted
        first stage     + nothing: the embedding is a row lookup

    Plain multiply-adds, no correction (the bench model's 8 + 4 was the fastest of 6 + 6 ...
    9 + 3: BENCHMARKS.md). Attention over the cached context, which grows with it, is left out:
    it makes layers dearer at long contexts, a stage's layers alike.
    """
    num_layers = int(hf["num_hidden_layers"])
    return balanced_partition(num_layers, pp_size, lm_head_layers(hf), head_room_layers(hf))


def layer_partition(
    hf: Mapping[str, Any], pp_size: int, configured: tuple[int, ...] | None
) -> tuple[int, ...]:
    """Layers per stage: ``configured`` (the engine argument or the variable, as the config
    holds it) when given, else the balanced default."""
    return configured if configured is not None else default_partition(hf, pp_size)


def stage_layer_range(partition: tuple[int, ...], pp_rank: int) -> tuple[int, int]:
    """Decoder layers [start, end) of stage ``pp_rank``."""
    start = sum(partition[:pp_rank])
    return start, start + partition[pp_rank]


def requested_partition(
    explicit: tuple[int, ...] | None, pp_size: int, num_layers: int
) -> tuple[int, ...] | None:
    """The partition asked for, checked against the model: ``pp_layer_partition`` when given,
    else ``VLLM_PP_LAYER_PARTITION`` when PP > 1, else None (the balanced default). Raises
    ``ConfigError`` naming the one that does not fit."""
    if explicit is not None:
        _check(explicit, pp_size, num_layers, "pp_layer_partition")
        return explicit
    if pp_size == 1:
        return None
    from_env = envs.pp_layer_partition()
    if from_env is not None:
        _check(from_env, pp_size, num_layers, envs.PP_LAYER_PARTITION)
    return from_env


def _check(partition: tuple[int, ...], pp_size: int, num_layers: int, source: str) -> None:
    if (
        len(partition) != pp_size
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in partition)
        or sum(partition) != num_layers
    ):
        raise ConfigError(
            f"{source}: must list {pp_size} positive layer counts (one per pipeline stage) "
            f"summing to num_hidden_layers ({num_layers}), got {list(partition)}"
        )
