"""DeepSeek-V2 / V3 beyond what every MoE family is checked for (greedy tokens against HF
under chunked prefill, preemption and prefix caching, TP = 2 and EP = 2:
tests/engine/models/test_moe.py and test_moe_parallel.py; PP = 2:
tests/cluster/runtime/test_ray_executor_families.py): the router picks and weights experts exactly
as HF's router modules do (V3's noaux_tc, V2's greedy and group-limited greedy); the latent cache
holds ``kv_lora_rank + qk_rope_head_dim`` values per token and layer; V2's group-limited routing
gives HF's tokens; DeepSeek-V3's multi-token-prediction layers in a checkpoint are skipped by name;
configs the engine cannot serve exactly are refused by field."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.builtin.tiny_moe_models import tiny_moe_variant
from engine.errors import ConfigError
from engine.hf_config import check_hf_config, config_field
from engine.models import get_model_class
from engine.models.moe import Router
from engine.worker.model_loader import iterate_checkpoint, load_weights
from llm_kernels.backend import get_kernel_ops
from parallel.state import ParallelContext
from tests.engine.models.test_correctness import _hf_greedy, greedy_against_hf

HIDDEN = 32


# ---- the router against HF's --------------------------------------------------------------------


def _hf_router(version: str, **config: Any) -> torch.nn.Module:
    if version == "v3":
        cfg = DeepseekV3Config(hidden_size=HIDDEN, **config)
        return DeepseekV3TopkRouter(cfg)
    return DeepseekV2TopkRouter(DeepseekV2Config(hidden_size=HIDDEN, **config))


ROUTERS = {
    "v3-noaux_tc": ("v3", {"n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
                           "topk_group": 2, "norm_topk_prob": True,
                           "routed_scaling_factor": 2.5}),
    "v3-no-norm": ("v3", {"n_routed_experts": 16, "num_experts_per_tok": 3, "n_group": 8,
                          "topk_group": 3, "norm_topk_prob": False,
                          "routed_scaling_factor": 1.5}),
    "v2-greedy": ("v2", {"n_routed_experts": 16, "num_experts_per_tok": 4,
                         "topk_method": "greedy", "routed_scaling_factor": 16.0}),
    "v2-group_limited_greedy": ("v2", {"n_routed_experts": 16, "num_experts_per_tok": 4,
                                       "topk_method": "group_limited_greedy", "n_group": 4,
                                       "topk_group": 2, "routed_scaling_factor": 1.0}),
}  # fmt: skip


@pytest.mark.parametrize("router", list(ROUTERS))
def test_router_picks_and_weights_experts_as_hf(router: str) -> None:
    version, config = ROUTERS[router]
    hf = _hf_router(version, **config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=g))
        if version == "v3":
            hf.e_score_correction_bias.copy_(torch.randn(hf.num_experts, generator=g) * 0.5)
    arch = "DeepseekV3ForCausalLM" if version == "v3" else "DeepseekV2ForCausalLM"
    hf_dict = {"architectures": [arch], "hidden_size": HIDDEN, **config}
    model_class = get_model_class(arch)
    routing = model_class.routing(hf_dict)
    ours = Router(HIDDEN, config["n_routed_experts"], config["num_experts_per_tok"], routing)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(64, HIDDEN, generator=g)
    _, hf_weights, hf_ids = hf(x)
    weights, ids = ours(x)
    # The same experts with the same weights, in whatever order each top-k lists them.
    for t in range(x.shape[0]):
        expected = dict(zip(hf_ids[t].tolist(), hf_weights[t].tolist(), strict=True))
        got = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        assert got.keys() == expected.keys(), t
        for expert, weight in expected.items():
            assert got[expert] == pytest.approx(weight, rel=1e-6), (t, expert)


# ---- the latent cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-deepseek-v2"])
def test_the_cache_holds_one_latent_per_token_and_layer(name: str) -> None:
    llm = LLM(f"builtin:{name}", num_kv_blocks=8, block_size=16, dtype="float32")
    runner = llm.llm_engine.executor.worker.runner
    hf = llm.llm_engine.config.model.hf_config
    latent = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]  # 32 + 8
    assert [tuple(c.shape) for c in runner.cache_engine.kv_caches] == [(1, 8, 16, 1, latent)] * 3
    assert runner.cache_engine.block_bytes() == hf["num_hidden_layers"] * 16 * latent * 4
    # Against the expanded K/V an MHA layer of the same heads would cache per token.
    qk_head_dim = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    mha = hf["num_attention_heads"] * (qk_head_dim + hf["v_head_dim"])
    assert latent / mha == pytest.approx(40 / 160)


# ---- routing variants ---------------------------------------------------------------------------


@pytest.mark.slow
def test_v2_group_limited_greedy_matches_hf() -> None:
    path = tiny_moe_variant(
        "tiny-deepseek-v2", topk_method="group_limited_greedy", n_group=4, topk_group=2
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(9)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (3, 40, 90)]
    with torch.no_grad():
        expected = [_hf_greedy(hf, p, 16) for p in prompts]
    llm = LLM(str(path), max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


# ---- checkpoints --------------------------------------------------------------------------------


def _engine_model(path: Path, hf: dict[str, Any]) -> torch.nn.Module:
    model_class = get_model_class(hf["architectures"][0])
    with torch.device("cpu"):
        return model_class(hf, ParallelContext(), ops=get_kernel_ops("torch"))


def _with_mtp_layer(
    tmp_path: Path, layer: int, extra_layers: int, name: str = "tiny-deepseek-v3"
) -> tuple[Path, dict[str, Any]]:
    """The built-in ``name``'s checkpoint plus the MTP tensors DeepSeek-V3 and GLM-4.5 append at
    ``model.layers.<layer>`` (a copy of the last layer, and the MTP module's own projections and
    norms), with config ``num_nextn_predict_layers: extra_layers``."""
    source = resolve_model_source(f"builtin:{name}")
    hf = json.loads((source / "config.json").read_text())
    hf["num_nextn_predict_layers"] = extra_layers
    tensors = {name: t[...] for name, t in iterate_checkpoint(source, progress=False)}
    last = f"model.layers.{hf['num_hidden_layers'] - 1}."
    mtp = f"model.layers.{layer}."
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[mtp + name[len(last) :]] = tensors[name].clone()
    hidden = hf["hidden_size"]
    tensors[mtp + "eh_proj.weight"] = torch.zeros(hidden, 2 * hidden)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[mtp + f"{norm}.weight"] = torch.ones(hidden)
    tensors[mtp + "shared_head.head.weight"] = torch.zeros(hf["vocab_size"], hidden)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return tmp_path, hf


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-glm4-moe"])
def test_multi_token_prediction_layers_are_skipped_by_name(tmp_path: Path, name: str) -> None:
    path, hf = _with_mtp_layer(tmp_path, layer=3, extra_layers=1, name=name)
    reference = _engine_model(path, hf)
    source = resolve_model_source(f"builtin:{name}")
    load_weights(reference, iterate_checkpoint(source, progress=False), hf_config=hf)
    model = _engine_model(path, hf)
    load_weights(model, iterate_checkpoint(path, progress=False), hf_config=hf)
    for (name, a), (_, b) in zip(reference.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_layer_past_the_mtp_layers_is_still_named(tmp_path: Path) -> None:
    path, hf = _with_mtp_layer(tmp_path, layer=4, extra_layers=1)
    with pytest.raises(ValueError, match=r"'model\.layers\.4\.[\w.]+' .* not parameters"):
        load_weights(_engine_model(path, hf), iterate_checkpoint(path, progress=False),
                     hf_config=hf)  # fmt: skip


# ---- refused configs ----------------------------------------------------------------------------


def _config(name: str, **changes: Any) -> dict[str, Any]:
    hf = json.loads((resolve_model_source(f"builtin:{name}") / "config.json").read_text())
    hf.update(changes)
    return hf


@pytest.mark.parametrize(
    ("name", "changes", "field"),
    [
        ("tiny-deepseek-v2", {"norm_topk_prob": True}, "norm_topk_prob"),
        ("tiny-deepseek-v2", {"topk_method": "noaux_tc"}, "topk_method"),
        ("tiny-deepseek-v3", {"topk_method": "greedy"}, "topk_method"),
        ("tiny-deepseek-v3", {"scoring_func": "softmax"}, "scoring_func"),
        ("tiny-deepseek-v3", {"n_group": 3}, "n_group"),
        ("tiny-deepseek-v3", {"topk_group": 5}, "topk_group"),
        ("tiny-deepseek-v3", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ("tiny-deepseek-v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
        ("tiny-deepseek-v3", {"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ("tiny-deepseek-v3", {"kv_lora_rank": 0}, "kv_lora_rank"),
        ("tiny-deepseek-v3", {"q_lora_rank": -1}, "q_lora_rank"),
        ("tiny-deepseek-v3", {"routed_scaling_factor": 0}, "routed_scaling_factor"),
        ("tiny-deepseek-v2", {"topk_method": "group_limited_greedy"}, "n_group"),
        ("tiny-glm4-moe", {"n_group": 3}, "n_group"),
        ("tiny-glm4-moe", {"n_group": 8}, "n_group"),
        ("tiny-glm4-moe", {"topk_group": 3}, "topk_group"),
        ("tiny-glm4-moe", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ("tiny-glm4-moe", {"use_qk_norm": "yes"}, "use_qk_norm"),
        ("tiny-glm4-moe", {"n_shared_experts": -1}, "n_shared_experts"),
        ("tiny-glm4-moe", {"routed_scaling_factor": -2.5}, "routed_scaling_factor"),
        ("tiny-glm4-moe", {"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ],
)
def test_config_the_engine_cannot_serve_exactly_is_refused_by_field(
    name: str, changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        check_hf_config(_config(name, **changes))


def test_fields_a_config_leaves_out_take_transformers_defaults() -> None:
    """DeepSeek-V3's published config.json carries every field; one without them means
    transformers' DeepseekV3Config defaults (8 groups of which 4, 2.5 x, renormalized)."""
    hf = _config("tiny-deepseek-v3")
    for key in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob"):
        hf.pop(key)
    hf.update(n_routed_experts=16, num_experts_per_tok=4)
    check_hf_config(hf)
    routing = get_model_class("DeepseekV3ForCausalLM").routing(hf)
    assert (routing.num_groups, routing.topk_groups) == (8, 4)
    assert (routing.scaling_factor, routing.renormalize) == (2.5, True)


def test_glm_fields_a_config_leaves_out_take_transformers_defaults() -> None:
    """transformers' Glm4MoeConfig rotates half of each head unless told otherwise, has one
    expert group and renormalizes the top-k."""
    from engine.rope_config import rope_parameters

    hf = _config("tiny-glm4-moe")
    for key in ("n_group", "topk_group", "norm_topk_prob", "use_qk_norm", "rope_parameters"):
        hf.pop(key)
    check_hf_config(hf)
    assert rope_parameters(hf)["partial_rotary_factor"] == 0.5
    routing = get_model_class("DeepseekV3ForCausalLM").routing(hf)  # GLM's router is V3's
    assert (routing.num_groups, routing.topk_groups, routing.renormalize) == (1, 1, True)
    assert config_field(hf, "use_qk_norm") is False


def test_a_null_routing_method_means_the_architectures_own() -> None:
    """transformers' DeepseekV3Config has no ``topk_method`` / ``scoring_func``; a config it
    wrote may carry them as null, which means V3's sigmoid noaux_tc (HF's code has no other),
    while a value that names another method is still refused."""
    hf = _config("tiny-deepseek-v3", topk_method=None, scoring_func=None)
    check_hf_config(hf)
    assert config_field(hf, "topk_method") == "noaux_tc"
    assert config_field(hf, "scoring_func") == "sigmoid"
    with pytest.raises(ConfigError, match=r"^scoring_func: "):
        check_hf_config(_config("tiny-deepseek-v3", scoring_func="softmax"))


# ---- Kimi K2's layout: model_type kimi_k2, a tokenizer of its own code --------------------------


def _kimi_layout(out: Path) -> Path:
    """tiny-deepseek-v3 as Kimi K2's config.json writes it: model_type kimi_k2, which only its
    own remote code defines, and a yarn ``rope_scaling`` beside a top-level ``rope_theta``, which
    transformers' generic config (its fallback for an unknown model_type) cannot read."""
    path = tiny_moe_variant("tiny-deepseek-v3", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})  # fmt: skip
    for file in path.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    config = json.loads((out / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config |= {"model_type": "kimi_k2", "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_model_type_only_remote_code_defines_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^model_type: 'kimi_k2' .*pass tokenizer:"):
        LLM(str(_kimi_layout(tmp_path)), dtype="float32")


def test_a_remote_code_tokenizer_is_refused_naming_its_class(tmp_path: Path) -> None:
    """Kimi K2's own tokenizer: tiktoken behind auto_map, no tokenizer.json."""
    path = _kimi_layout(tmp_path)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    remote = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    settings |= {"tokenizer_class": "TikTokenTokenizer", "auto_map": remote}
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    (path / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"^tokenizer: .*'TikTokenTokenizer'"):
        LLM(str(path), dtype="float32")


def test_kimi_layout_with_a_tokenizer_given_serves_hfs_tokens(tmp_path: Path) -> None:
    """The model is a DeepSeek-V3: with ``tokenizer`` pointed elsewhere it is served, and gives
    the tokens HF gives the same checkpoint written as deepseek_v3."""
    (tmp_path / "kimi").mkdir()
    kimi = _kimi_layout(tmp_path / "kimi")
    reference = tiny_moe_variant("tiny-deepseek-v3", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})  # fmt: skip
    got, expected = greedy_against_hf(kimi, (3, 40), 8, reference, tokenizer=str(reference))
    assert got == expected
