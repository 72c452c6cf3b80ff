"""Quantized checkpoints served on CPU equal their references, token for token, with
logprobs to 1e-4:

- compressed-tensors checkpoints written by that library (FP8 per-channel with dynamic
  per-token activations, FP8 [128, 128] blocks with dynamic per-group activations, FP8
  per-tensor with static input scales, W4A16 group 128 asymmetric and symmetric) from random
  Llama and Qwen3 models, against HF transformers loading the same checkpoint in fp32. FP8 runs
  through HF's default compressed-tensors route, whose forward quantizes activations too; int4
  through ``dequantize=True`` (the default route cannot load packed zero points in
  transformers 5.x, and W4A16 has no activation step, so both routes compute the same);
- GPTQ (v1 zeros, g_idx) and AWQ (GEMM) checkpoints packed here from their documented
  layouts, against HF on the dense weights the format defines (no GPTQ/AWQ library on CPU);
- block-FP8 checkpoints in DeepSeek's / Qwen3-FP8's format (``weight_scale_inv`` per block,
  edge blocks partial) for Llama, Qwen3 and DeepSeek-V3 (MLA projections, experts), against
  HF on the dense weights the format defines (transformers' own CPU reading of the format is
  that dequantization);
- online FP8 against HF with the same per-tensor quantization done in plain torch, and within
  a stated bound of the float model.

The checkpoint tests run twice: weights dequantized at load (CPU's default) and kept quantized
(LLM_CLUSTER_CPU_KEEP_QUANTIZED=1, the CUDA layout, with ``llm_kernels.quant_gemm``'s torch
references doing the matmuls).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from engine import LLM, SamplingParams, envs
from engine.builtin.catalog import resolve_model_source
from engine.quantization.config import parse_quantization
from engine.quantization.kept import QuantizedLinearMethod
from engine.quantization.loading import QuantizedCheckpoint
from engine.worker.model_loader import iterate_checkpoint
from parallel.layers import ColumnParallelLinear, RowParallelLinear
from tests.engine.quantization.quant_checkpoints import (
    CASES,
    dense_model,
    write_compressed_tensors,
    write_fp8_blocks,
    write_gptq_awq,
)

TOL = 1e-4
LINEAR_TYPES = (ColumnParallelLinear, RowParallelLinear)
PROMPT_LEN, NEW_TOKENS = 40, 16
# FP8 activations (W8A8) on a shorter sequence: rounding to e4m3 (3 mantissa bits) turns a
# last-bit difference upstream (the attention kernel, a fused q/k/v matmul) into a whole fp8
# step on the odd element; past ~25 positions one such flip moved a tiny random model's
# logprobs by up to 3e-2 and parted a near-tie (top-2 logits 1e-3 apart). Up to 24 positions
# every case agrees with HF to ~1e-6 through F.linear.
ACT_PROMPT_LEN, ACT_NEW_TOKENS = 16, 8
# ... and a looser bound there: the CPU's oneDNN-packed GEMM sums in another order than HF's
# F.linear, and the next layer's fp8 rounding can turn that into 1e-4 (seen: 1.3e-4).
ACT_TOL = 1e-3

# Every format from both families, except the static-scale variant (Llama only).
PAIRS = [(c, f) for c in CASES for f in ("llama", "qwen3") if (c, f) != ("fp8-static", "qwen3")]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quant")


def _prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def _hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _engine_run(
    path: Path, prompt: list[int], new_tokens: int = NEW_TOKENS, **kwargs: Any
) -> tuple[list[int], list[float]]:
    """Greedy tokens and the logprob of every prompt token after the first and every sampled
    token (what HF's log_softmax row gives at the same position). With
    LLM_CLUSTER_CPU_KEEP_QUANTIZED=1, checks that every linear layer but the head kept its
    weight quantized."""
    llm = LLM(str(path), num_kv_blocks=64, **kwargs)
    if envs.cpu_keep_quantized():
        model = llm.llm_engine.executor.worker.runner.model
        linears = [m for m in model.modules() if isinstance(m, LINEAR_TYPES)]
        assert linears and all(isinstance(m.quant_method, QuantizedLinearMethod) for m in linears)
        assert all(m.weight.numel() == 0 for m in linears)
    params = SamplingParams(
        temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    lps = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    lps += [e[t].logprob for e, t in zip(out.outputs[0].logprobs, tokens)]
    return tokens, lps


def _assert_equal_to_hf(
    hf: Any, prompt: list[int], tokens: list[int], lps: list[float], tol: float = TOL
) -> None:
    """Greedy tokens equal HF's argmax at each step, logprobs within ``tol``."""
    rows = _hf_logprobs(hf, prompt + tokens)
    seq = prompt + tokens
    for j, token in enumerate(tokens):
        assert token == rows[len(prompt) - 1 + j].argmax().item(), f"token {j} differs from HF"
    expected = [rows[t - 1, seq[t]].item() for t in range(1, len(seq))]
    worst = max(abs(a - b) for a, b in zip(lps, expected))
    assert worst < tol, f"logprobs differ from HF by up to {worst:.2e}"


def _hf_quantized(path: Path, int4: bool) -> Any:
    kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if int4 else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@pytest.fixture(params=["dequantized", "kept"])
def keep(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both CPU modes: weights dequantized at load (the default), and kept quantized with
    ``llm_kernels.quant_gemm``'s torch references doing the matmuls (the CUDA path's layout)."""
    kept = request.param == "kept"
    monkeypatch.setenv("LLM_CLUSTER_CPU_KEEP_QUANTIZED", "1" if kept else "0")
    return kept


def _ct_checkpoint(root: Path, case: str, family: str) -> Path:
    out = root / f"{case}-{family}"
    if not out.exists():
        scheme, fmt, input_scale = CASES[case]
        write_compressed_tensors(dense_model(root, family), out, scheme, fmt, input_scale)
    return out


@pytest.mark.parametrize(("case", "family"), PAIRS)
def test_compressed_tensors_checkpoint_equals_hf(
    root: Path, case: str, family: str, keep: bool
) -> None:
    scheme, fmt, _ = CASES[case]
    path = _ct_checkpoint(root, case, family)
    hf = _hf_quantized(path, int4=fmt == "pack-quantized")
    activations = "input_activations" in scheme
    # W8A8 on the short sequence (see ACT_PROMPT_LEN): fewer chances for a flipped fp8 rounding.
    prompt = _prompt(seed=len(case), length=ACT_PROMPT_LEN if activations else PROMPT_LEN)
    tokens, lps = _engine_run(path, prompt, ACT_NEW_TOKENS if activations else NEW_TOKENS)
    _assert_equal_to_hf(hf, prompt, tokens, lps, ACT_TOL if activations else TOL)
    if activations:
        # The activation step is modelled, not dropped: HF without it is much further away.
        plain = _hf_logprobs(_hf_quantized(path, int4=True), prompt + tokens)
        seq = prompt + tokens
        drift = max(abs(plain[t - 1, seq[t]].item() - lps[t - 1]) for t in range(1, len(seq)))
        assert drift > 10 * ACT_TOL, f"HF without activation quantization is only {drift:.1e} off"


def test_fp8_weights_with_bf16_scales_equal_hf(root: Path) -> None:
    """A checkpoint quantized from a bf16 model (what llm-compressor writes from one) has bf16
    scales; the weights are dequantized in float32 as HF does, not in bf16 (which would round
    every weight to 8 bits of mantissa: logprobs 3e-2 off, tokens flipped)."""
    path = root / "fp8-bf16-scales"
    scheme = {"weights": {**CASES["fp8-channel"][0]["weights"]}}
    write_compressed_tensors(dense_model(root, "llama"), path, scheme, "float-quantized")
    weights = path / "model.safetensors"
    state = dict(iterate_checkpoint(path, progress=False))
    scales = [k for k in state if k.endswith("weight_scale")]
    assert scales
    save_file({k: v.to(torch.bfloat16) if k in scales else v for k, v in state.items()},
              str(weights), metadata={"format": "pt"})  # fmt: skip
    hf = _hf_quantized(path, int4=False)
    prompt = _prompt(seed=5)
    tokens, lps = _engine_run(path, prompt)
    _assert_equal_to_hf(hf, prompt, tokens, lps)


@pytest.mark.parametrize("case", ["fp8-channel", "fp8-static"])
def test_a_fused_layer_with_a_dense_part_and_fp8_activations_is_refused(
    root: Path, case: str, keep: bool
) -> None:
    """up_proj left dense beside an FP8-activation gate_proj: the fused gate_up layer would
    quantize up_proj's input too (or, with static scales, lose its columns)."""
    scheme, fmt, input_scale = CASES[case]
    path = root / f"{case}-up-dense"
    if not path.exists():
        write_compressed_tensors(dense_model(root, "llama"), path, scheme, fmt, input_scale,
                                 ignore=("lm_head", "model.layers.0.mlp.up_proj"))  # fmt: skip
    with pytest.raises(Exception, match=r"model\.layers\.0\.mlp\.(gate_up_proj|up_proj)"):
        LLM(str(path), num_kv_blocks=64)


@pytest.mark.parametrize(
    ("case", "change", "message"),
    [
        ("w4a16-asym", lambda s: s.t().contiguous(), r"has shape \[2, 512\]; strategy 'group'"),
        ("fp8-static", lambda s: s.expand(512, 1).contiguous(), r"strategy 'tensor' needs one"),
    ],
    ids=["int4-group-transposed", "fp8-tensor-as-channel"],
)  # fmt: skip
def test_a_scale_shaped_against_its_strategy_is_refused(
    root: Path, case: str, change: Any, message: str
) -> None:
    path = root / f"{case}-bad-scale"
    if not path.exists():
        shutil.copytree(_ct_checkpoint(root, case, "llama"), path)
        state = dict(iterate_checkpoint(path, progress=False))
        name = "model.layers.0.mlp.gate_proj.weight_scale"
        state[name] = change(state[name])
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match=message):
        LLM(str(path), num_kv_blocks=64)


@pytest.mark.parametrize("case", ["fp8-block", "w4a16-asym"])
def test_dequantized_weights_equal_the_library_decompression(root: Path, case: str) -> None:
    scheme, fmt, input_scale = CASES[case]
    path = write_compressed_tensors(
        dense_model(root, "llama"), root / f"{case}-weights", scheme, fmt, input_scale
    )
    hf_params = dict(_hf_quantized(path, int4=True).named_parameters())
    hf_config = json.loads((path / "config.json").read_text())
    names = {name for name, _ in iterate_checkpoint(path, progress=False)}
    checkpoint = QuantizedCheckpoint(parse_quantization(hf_config), names, lambda n: True)
    dense = dict(checkpoint.transform(iterate_checkpoint(path, progress=False)))
    quantized = list(checkpoint.schemes)
    assert len(quantized) == 14  # 7 linear layers x 2 decoder layers; lm_head ignored
    for module in quantized:
        assert torch.equal(dense[f"{module}.weight"], hf_params[f"{module}.weight"]), module


def _gptq_awq_checkpoint(root: Path, method: str, name: str, **kwargs: Any) -> tuple[Path, Path]:
    """(the GPTQ / AWQ checkpoint ``name``, the dense one its format defines)."""
    dense = dense_model(root, "llama")
    path, ref_dir = root / name, root / f"{name}-dense"
    if not path.exists():
        _with_weights(dense, ref_dir, write_gptq_awq(dense, path, method, **kwargs))
    return path, ref_dir


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_awq_checkpoint_equals_the_dense_model_of_its_weights(
    root: Path, method: str, keep: bool
) -> None:
    path, ref_dir = _gptq_awq_checkpoint(root, method, method)
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    prompt = _prompt(seed=3)
    tokens, lps = _engine_run(path, prompt)
    _assert_equal_to_hf(hf, prompt, tokens, lps)


def test_gptq_act_order_with_one_group_per_channel_equals_the_dense_model_of_its_weights(
    root: Path,
) -> None:
    """desc_act with group_size -1 changes no scale (vLLM serves it as no act-order); its
    g_idx is all zeros. Served with vLLM's ``quantization="gptq_marlin"``, which names it."""
    path, ref_dir = _gptq_awq_checkpoint(root, "gptq", "gptq-act-order", group=-1, desc_act=True)
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    prompt = _prompt(seed=4)
    tokens, lps = _engine_run(path, prompt, quantization="gptq_marlin")
    _assert_equal_to_hf(hf, prompt, tokens, lps)


def test_compressed_tensors_int4_with_weight_actorder_equals_hf(root: Path) -> None:
    """actorder "weight" (GPTQ's passes in activation order, groups in column order: no
    g_idx) is served like none, as vLLM does; the library writes and HF reads it."""
    scheme = {"weights": {**CASES["w4a16-asym"][0]["weights"], "actorder": "weight"}}
    path = write_compressed_tensors(
        dense_model(root, "llama"), root / "w4a16-actorder-weight", scheme, "pack-quantized"
    )
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] == (
        "weight"
    )
    prompt = _prompt(seed=6)
    tokens, lps = _engine_run(path, prompt)
    _assert_equal_to_hf(_hf_quantized(path, int4=True), prompt, tokens, lps)


def test_a_legacy_compression_config_is_read_as_the_quantization_config(root: Path) -> None:
    """Older compressed-tensors exports name the section ``compression_config``: served as
    HF serves the same checkpoint under ``quantization_config``, W8A8 activations included."""
    source = _ct_checkpoint(root, "fp8-channel", "llama")
    path = root / "fp8-channel-legacy-key"
    if not path.exists():
        shutil.copytree(source, path)
        config = json.loads((path / "config.json").read_text())
        config["compression_config"] = config.pop("quantization_config")
        (path / "config.json").write_text(json.dumps(config))
    prompt = _prompt(seed=len("fp8-channel"), length=ACT_PROMPT_LEN)
    tokens, lps = _engine_run(path, prompt, ACT_NEW_TOKENS, quantization="compressed-tensors")
    _assert_equal_to_hf(_hf_quantized(source, int4=False), prompt, tokens, lps, ACT_TOL)


def _with_weights(source: Path, out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """``source``'s checkpoint with ``weights`` as its tensors (float32)."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out


# (family, block): the official [128, 128] (every tiny shape a partial edge block) and a grid
# of uneven blocks cutting every weight into several, partial at the edges.
FP8_BLOCK_CASES = [("llama", (128, 128)), ("qwen3", (128, 128)), ("deepseek-v3", (128, 128)),
                   ("deepseek-v3", (16, 24))]  # fmt: skip


def _fp8_block_checkpoint(root: Path, family: str, block: tuple[int, int]) -> tuple[Path, Path]:
    """(the FP8 checkpoint, the dense one its format defines)."""
    name = f"fp8-{family}-{block[0]}x{block[1]}"
    path, ref_dir = root / name, root / f"{name}-dense"
    if not path.exists():
        if family == "deepseek-v3":
            source = resolve_model_source("builtin:tiny-deepseek-v3")
        else:
            source = dense_model(root, family)
        _with_weights(source, ref_dir, write_fp8_blocks(source, path, block))
    return path, ref_dir


@pytest.mark.parametrize(("family", "block"), FP8_BLOCK_CASES)
def test_block_fp8_checkpoint_equals_hf_on_the_dense_weights_it_defines(
    root: Path, family: str, block: tuple[int, int]
) -> None:
    path, ref_dir = _fp8_block_checkpoint(root, family, block)
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    prompt = [random.Random(block[1]).randrange(3, vocab) for _ in range(PROMPT_LEN)]
    tokens, lps = _engine_run(path, prompt)
    _assert_equal_to_hf(hf, prompt, tokens, lps)


def _quantize_inputs_per_group(model: Any, group: int, skip: tuple[str, ...]) -> None:
    """Forward pre-hooks on ``model``'s linear layers (but ``skip``): each input quantized to
    e4m3 and back per token and ``group`` features, as the kept FP8 block GEMM does it
    (``llm_kernels.fp8_activations.quantize_activations_fp8``)."""
    from llm_kernels.fp8_activations import quantize_activations_fp8

    def hook(_module: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        q, scale = quantize_activations_fp8(flat, None, group)
        full = scale.repeat_interleave(group, dim=1)[:, : flat.shape[1]]
        return ((q.to(torch.float32) * full).reshape(x.shape).to(x.dtype), *args[1:])

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(skip):
            module.register_forward_pre_hook(hook)


def test_block_fp8_kept_quantized_equals_hf_with_its_activation_quantization(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA layout (kept quantized, the GEMM quantizing activations per 1 x bk group, as
    DeepSeek's and vLLM's FP8 kernels do): every linear layer keeps its FP8 blocks except
    MLA's kv_b_proj, which attention reads as dense matrices; against HF on the dense weights
    with the same activation quantization before each of those layers."""
    block = (16, 24)
    path, ref_dir = _fp8_block_checkpoint(root, "deepseek-v3", block)
    monkeypatch.setenv("LLM_CLUSTER_CPU_KEEP_QUANTIZED", "1")
    llm = LLM(str(path), num_kv_blocks=64)
    model = llm.llm_engine.executor.worker.runner.model
    for name, module in model.named_modules():
        if isinstance(module, LINEAR_TYPES) and name != "lm_head":
            kept = isinstance(module.quant_method, QuantizedLinearMethod)
            assert kept != name.endswith("kv_b_proj"), name
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    _quantize_inputs_per_group(hf, block[1], skip=("kv_b_proj", "lm_head", "mlp.gate"))
    prompt = _prompt(seed=5, length=ACT_PROMPT_LEN)
    params = SamplingParams(
        temperature=0, max_tokens=ACT_NEW_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    lps = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    lps += [e[t].logprob for e, t in zip(out.outputs[0].logprobs, tokens)]
    _assert_equal_to_hf(hf, prompt, tokens, lps, ACT_TOL)


def test_block_fp8_variants_the_engine_cannot_serve_are_refused_by_field() -> None:
    from engine.errors import ConfigError

    base = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}  # fmt: skip
    for change, field in (
        ({"weight_block_size": None}, "weight_block_size"),
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"activation_scheme": "static"}, "activation_scheme"),
        ({"fmt": "e5m2"}, "fmt"),
    ):
        with pytest.raises(ConfigError, match=rf"^quantization_config\.{field}: "):
            parse_quantization({"quantization_config": {**base, **change}})


def _torch_online_fp8(dense: Path, out: Path) -> Path:
    """The float checkpoint with each linear weight (not lm_head) quantized per tensor in plain
    torch: scale = max|w| / 448, e4m3(w / scale) * scale."""
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                w = module.weight
                scale = w.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
                q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                w.copy_(q.float() * scale)
    model.save_pretrained(out)
    return out


# The online-FP8 model's logprobs stay within this of the float model's on random weights.
ONLINE_FP8_BOUND = 0.15


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_online_fp8_equals_torch_quantization_and_stays_near_float(root: Path, family: str) -> None:
    dense = dense_model(root, family)
    prompt = _prompt(seed=5)
    tokens, lps = _engine_run(dense, prompt, quantization="fp8")
    reference = _torch_online_fp8(dense, root / f"online-{family}")
    _assert_equal_to_hf(
        AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval(),
        prompt,
        tokens,
        lps,
    )
    float_rows = _hf_logprobs(
        AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval(), prompt + tokens
    )
    seq = prompt + tokens
    drift = max(abs(float_rows[t - 1, seq[t]].item() - lps[t - 1]) for t in range(1, len(seq)))
    assert 0 < drift < ONLINE_FP8_BOUND, f"online fp8 moved logprobs by {drift:.3f}"
