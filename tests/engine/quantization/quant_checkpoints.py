"""Quantized test checkpoints: compressed-tensors ones written by that library itself (its
``apply_quantization_config`` and ``ModelCompressor``, with min/max scales computed by its own
``calculate_qparams``), and GPTQ / AWQ and block-FP8 (``quant_method: fp8``) ones packed here
from the formats' documented layouts. Each starts from a random float model of
``engine.builtin.tiny_models``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.builtin.tiny_models import make_random_model
from engine.quantization.formats import pack_nibbles

# hidden 256 / intermediate 512: multiples of the 128-wide groups and blocks, also per rank
# at TP 2 (row-parallel inputs 128 and 256).
SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=512,
    max_position_embeddings=512,
)


# name -> (compressed-tensors scheme of the Linear layers, format, static input scale)
_FP8 = {"num_bits": 8, "type": "float", "symmetric": True}
_INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
_DYNAMIC_TOKEN = {**_FP8, "strategy": "token", "dynamic": True}
CASES: dict[str, tuple[dict[str, Any], str, float | None]] = {
    "fp8-channel": (
        {"weights": {**_FP8, "strategy": "channel"}, "input_activations": _DYNAMIC_TOKEN},
        "float-quantized",
        None,
    ),
    "fp8-block": (
        {
            "weights": {**_FP8, "strategy": "block", "block_structure": [128, 128]},
            "input_activations": {**_FP8, "strategy": "group", "group_size": 128, "dynamic": True},
        },
        "float-quantized",
        None,
    ),
    "fp8-static": (
        {
            "weights": {**_FP8, "strategy": "tensor"},
            "input_activations": {**_FP8, "strategy": "tensor", "dynamic": False},
        },
        "float-quantized",
        0.01,
    ),
    "w4a16-asym": (
        {"weights": {**_INT4, "symmetric": False}},
        "pack-quantized",
        None,
    ),
    "w4a16-sym": (
        {"weights": {**_INT4, "symmetric": True}},
        "pack-quantized",
        None,
    ),
}


def dense_model(root: Path, family: str) -> Path:
    return make_random_model(root / f"dense-{family}", family, **SHAPE)


def _copy_side_files(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)


def _observe(module: torch.nn.Module, args: Any) -> None:
    """Min/max scales (and zero points) for the module's weight, from the library's own
    ``calculate_qparams``, at the strategy's granularity."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w = module.weight.data
    if args.strategy == "group":
        g = w.unflatten(-1, (w.shape[1] // args.group_size, args.group_size))
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "block":
        bh, bw = args.block_structure
        b = w.unflatten(0, (-1, bh)).unflatten(-1, (-1, bw))
        lo, hi = b.amin((1, 3)), b.amax((1, 3))
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zp = calculate_qparams(lo, hi, args)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(
        module.weight_scale.shape
    )
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zp.to(module.weight_zero_point.dtype).reshape(
            module.weight_zero_point.shape
        )


def write_compressed_tensors(
    dense: Path,
    out: Path,
    scheme: dict[str, Any],
    fmt: str,
    input_scale: float | None = None,
    ignore: tuple[str, ...] = ("lm_head",),
) -> Path:
    """``dense`` quantized by compressed-tensors with ``scheme`` (weights / input_activations
    args for the Linear layers but ``ignore``), saved compressed in format ``fmt``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
        ignore=list(ignore),
        format=fmt,
    )
    apply_quantization_config(model, config, show_progress=False)
    for i, module in enumerate(m for m in model.modules() if hasattr(m, "quantization_scheme")):
        _observe(module, module.quantization_scheme.weights)
        if input_scale is not None:  # static activations: a distinct scale per module
            module.input_scale.data.fill_(input_scale * (1 + 0.05 * (i % 3)))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    _copy_side_files(dense, out)
    return out


def _linear_names(state: dict[str, torch.Tensor]) -> list[str]:
    return [
        k.removesuffix(".weight")
        for k, v in state.items()
        if k.endswith(("_proj.weight", "_proj_with_mqa.weight")) and v.dim() == 2
    ]


def _int4_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric unsigned int4 per group: (q_u [N, K], z_u [N, G], scale [N, G] fp16)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo = g.amin(-1).clamp(max=0)
    hi = g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).to(torch.float16)
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.round(g / scale.float().unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15)
    return q.reshape(n, k).to(torch.int32), zero.to(torch.int32), scale


def write_gptq_awq(
    dense: Path, out: Path, method: str, group: int = 128, desc_act: bool = False
) -> dict[str, Any]:
    """``dense``'s linear weights quantized to 4 bit and packed as ``method`` ("gptq", v1
    zeros, or "awq" GEMM) in the formats' documented layouts (``group`` -1: one group per
    output channel, GPTQ's g_idx all zeros, as AutoGPTQ writes it with or without
    ``desc_act``). Returns the dense weights the format defines, (q_u - z_u) * scale in
    float32, to build the reference from."""
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(dense / "model.safetensors"))
    reference = dict(state)
    awq_order = [0, 2, 4, 6, 1, 3, 5, 7]
    for name in _linear_names(state):
        w = state.pop(f"{name}.weight")
        n, k = w.shape
        size = k if group == -1 else group
        q_u, z_u, scale = _int4_groups(w, size)
        gi = torch.arange(k) // size
        reference[f"{name}.weight"] = (q_u - z_u[:, gi]).float() * scale.float()[:, gi]
        if method == "gptq":
            state[f"{name}.qweight"] = _pack_rows_k(q_u)
            state[f"{name}.qzeros"] = pack_nibbles((z_u - 1).t().contiguous())  # v1: zero - 1
            state[f"{name}.g_idx"] = gi.to(torch.int32)
        else:
            cols = q_u.t().contiguous().reshape(k, n // 8, 8)[:, :, awq_order].reshape(k, n)
            state[f"{name}.qweight"] = pack_nibbles(cols)
            zs = z_u.t().contiguous()
            state[f"{name}.qzeros"] = pack_nibbles(
                zs.reshape(zs.shape[0], n // 8, 8)[:, :, awq_order].reshape(zs.shape[0], n)
            )
        state[f"{name}.scales"] = scale.t().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    if method == "gptq":
        quant = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
                 "sym": False, "checkpoint_format": "gptq"}  # fmt: skip
    else:
        quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                 "version": "gemm"}  # fmt: skip
    config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(dense, out)
    return reference


def _pack_rows_k(q_u: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qweight``: q_u [N, K] -> int32 [K / 8, N], input row 8i + j in nibble j."""
    # pack_nibbles packs along columns: give it [N, K] and transpose the words.
    return pack_nibbles(q_u).t().contiguous()


def write_fp8_blocks(source: Path, out: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """``source``'s linear weights (every ``*_proj`` of the decoder layers, MoE experts and
    MLA projections included; not the router, embeddings or head) quantized as DeepSeek-V3's,
    Kimi K2's and Qwen3's ``-FP8`` releases store them: an e4m3 ``weight`` and a float32
    ``weight_scale_inv`` per [bn, bk] block (max |w| / 448; the edge blocks partial), with
    ``quantization_config`` ``{quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
    weight_block_size: [bn, bk]}``. Returns the dense weights the format defines (e4m3 value x
    block scale, float32), to build the reference from."""
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(source / "model.safetensors"))
    reference = dict(state)
    bn, bk = block
    fp8_max = float(torch.finfo(torch.float8_e4m3fn).max)
    for name in _linear_names(state):
        w = state.pop(f"{name}.weight").float()
        n, k = w.shape
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.zeros(rows * bn, cols * bk)
        padded[:n, :k] = w
        amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q = (w / full).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
        state[f"{name}.weight"] = q
        state[f"{name}.weight_scale_inv"] = scale
        reference[f"{name}.weight"] = q.float() * full
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [bn, bk]}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(source, out)
    return reference
