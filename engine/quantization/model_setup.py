"""The loader's quantization steps for one model: which conversion the checkpoint needs,
whether its linear weights stay quantized on this device, and the linear layers' dense
weights around that (meta placeholders while loading, real ones where a layer stays dense)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine import envs
from engine.quantization.config import QuantConfig
from engine.quantization.loading import QuantizedCheckpoint
from parallel.layers import ColumnParallelLinear, RowParallelLinear

_LINEAR_TYPES = (ColumnParallelLinear, RowParallelLinear)


def keep_quantized_on(quant: QuantConfig | None, device: torch.device) -> torch.device | None:
    """Where the linear weights stay quantized: CUDA (``llm_kernels.quant_gemm``), and CPU only
    with ``LLM_CLUSTER_CPU_KEEP_QUANTIZED=1``; None: dequantized once at load, or no linear
    layer is quantized (MXFP4 quantizes experts only: ``engine.quantization.mxfp4``)."""
    if quant is None or not quant.groups:
        return None
    if device.type == "cuda" or (device.type == "cpu" and envs.cpu_keep_quantized()):
        return device
    return None


TargetOf = Callable[[str], tuple[str, Any]]


def _layer_of(model: nn.Module, target_of: TargetOf, name: str) -> str | None:
    """The column / row parallel layer a checkpoint weight name loads into and keeps as its
    GEMM's weight, or None (one that reads its weight as a tensor is ``dense_only``)."""
    layer = target_of(name)[0].removesuffix(".weight")
    try:
        module = model.get_submodule(layer)
    except AttributeError:
        return None  # another pipeline stage's layer, or not a layer at all
    keeps = isinstance(module, _LINEAR_TYPES) and not getattr(module, "dense_only", False)
    return layer if keeps else None


def quantized_checkpoint(
    model: nn.Module,
    quant: QuantConfig,
    names: set[str],
    target_of: Callable[[str], tuple[str, Any]],
    keep_on: torch.device | None,
) -> QuantizedCheckpoint:
    checkpoint = QuantizedCheckpoint(
        quant, names, lambda n: _layer_of(model, target_of, n) is not None, keep_on
    )
    if keep_on is not None:
        _check_fused_parts_agree(model, checkpoint, names, target_of)
    return checkpoint


def _check_fused_parts_agree(
    model: nn.Module,
    checkpoint: QuantizedCheckpoint,
    names: set[str],
    target_of: Callable[[str], tuple[str, Any]],
) -> None:
    """A fused layer (q/k/v, gate/up) holds one kind of weight: all parts kept quantized,
    with one scheme, or none."""
    parts: dict[str, set[str]] = {}
    for name in names:
        module = name.rpartition(".")[0]
        layer = _layer_of(model, target_of, f"{module}.weight")
        if layer is not None:
            parts.setdefault(layer, set()).add(module)
    for layer, modules in parts.items():
        kept = modules & checkpoint.kept
        schemes = {checkpoint.schemes[m] for m in kept}
        if kept and (kept != modules or len(schemes) > 1):
            raise ValueError(
                f"{layer}: its parts {sorted(modules)} are stored differently (quantized: "
                f"{sorted(kept)}); a fused layer keeps one quantized format"
            )


def materialize_dense_linears(
    model: nn.Module, checkpoint: QuantizedCheckpoint, target_of: Callable[[str], tuple[str, Any]]
) -> int:
    """Real weights for the linear layers built with meta placeholders that no kept module
    fills (a module the config leaves dense); returns how many."""
    kept = {_layer_of(model, target_of, f"{m}.weight") for m in checkpoint.kept}
    device, dtype = checkpoint.keep_on, torch.get_default_dtype()
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, _LINEAR_TYPES) and module.weight.is_meta and name not in kept:
            _replace_weight(module, torch.empty(module.weight.shape, device=device, dtype=dtype))
            count += 1
    return count


def release_placeholders(model: nn.Module, dtype: torch.dtype) -> None:
    """A kept layer's meta weight becomes an empty tensor of the model's dtype on the layer's
    device (LoRA and the byte counts read its dtype and device; ``weight_shape`` keeps the
    shard's shape). A layer still on meta was never loaded: an error naming it."""
    for name, module in model.named_modules():
        if not isinstance(module, _LINEAR_TYPES) or not module.weight.is_meta:
            continue
        method = module.quant_method
        if method is None or not hasattr(method, "data"):
            raise ValueError(f"{name}: no weight was loaded into this linear layer")
        _replace_weight(module, torch.empty(0, dtype=dtype, device=method.data.device))


def _replace_weight(module: nn.Module, tensor: torch.Tensor) -> None:
    loader = module.weight.weight_loader
    module.weight = nn.Parameter(tensor, requires_grad=False)
    module.weight.weight_loader = loader
