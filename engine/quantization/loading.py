"""A quantized checkpoint's tensors turned into what the layers hold, as the loader streams them.

Each quantized linear module's tensors (compressed-tensors ``weight`` / ``weight_packed``,
``weight_scale``, ``weight_zero_point``, ``weight_shape``, ``input_scale``; GPTQ / AWQ
``qweight``, ``qzeros``, ``scales``, ``g_idx``) are gathered, whichever shard files they sit
in, and leave as one ``<module>.weight``: dense, in the reference's numbers (``formats``), or,
where the weights stay quantized (CUDA; ``kept``), a ``QuantizedWeight`` in the engine's one
FP8 / int4 form. The layers' own weight loaders then cut each rank's shard from the full
tensor: a dense one shards exactly with no quantization group ever split (dequantize, then
shard); a quantized one carries its scales and zero points along.

Dequantizing is CPU's default: once at load, so it saves no memory. Layers whose checkpoint
quantizes activations (FP8 W8A8) then get an ``Fp8InputQuant`` as their ``quant_method``: the
input is quantized to e4m3 and back before the matmul, as the reference's forward does; except
a block-FP8 checkpoint of ``quant_method: fp8`` (DeepSeek's format), whose CPU reference is
transformers' dequantized reading, without activation quantization.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization.config import ActivationQuant, QuantConfig, QuantScheme
from engine.quantization.formats import (
    awq_to_int4,
    dequantize_fp8,
    dequantize_int4,
    fake_quantize_fp8_input,
    gptq_to_int4,
    quantize_fp8_per_tensor,
    unpack_ct_int4,
    unpack_ct_zero_points,
)
from engine.quantization.kept import kept_problem, quantized_form
from llm_kernels.cpu_gemm import packed_linear

# A tensor whose presence marks its module as quantized in the checkpoint.
_MARKERS = ("weight_scale", "weight_scale_inv", "weight_packed", "qweight")
_GPTQ_PARTS = ("qweight", "qzeros", "scales")


def _split(name: str) -> tuple[str, str]:
    module, _, leaf = name.rpartition(".")
    return module, leaf


def required_parts(scheme: QuantScheme) -> tuple[str, ...]:
    """The checkpoint tensors (leaf names) one module of ``scheme`` needs."""
    if scheme.source == "online-fp8":
        return ("weight",)
    if scheme.source in ("gptq", "awq"):
        return _GPTQ_PARTS
    if scheme.source == "fp8-block":
        return ("weight", "weight_scale_inv")
    weight = "weight_packed" if scheme.source == "ct-pack-quantized" else "weight"
    parts = [weight, "weight_scale"]
    if weight == "weight_packed":
        parts.append("weight_shape")
    if scheme.kind == "int4" and not scheme.symmetric:
        parts.append("weight_zero_point")
    if scheme.activations is not None and not scheme.activations.dynamic:
        parts.append("input_scale")
    return tuple(parts)


def _optional_parts(scheme: QuantScheme) -> tuple[str, ...]:
    # g_idx: GPTQ writes it even without act-order (then it is just k // group_size).
    return ("g_idx",) if scheme.source == "gptq" else ()


def dequantize_module(scheme: QuantScheme, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """One module's checkpoint tensors -> its dense weight [out, in]."""
    if scheme.source == "online-fp8":
        q, scale = quantize_fp8_per_tensor(parts["weight"])
        return q.to(torch.float32) * scale
    if scheme.source in ("gptq", "awq"):
        q, zp, scale = _int4_from_gptq_awq(scheme, parts)
        return dequantize_int4(q, scale, zp, scheme.group_size, dtype=torch.float32)
    if scheme.source == "fp8-block":
        return dequantize_fp8(parts["weight"], parts["weight_scale_inv"], scheme.block)
    if scheme.kind == "fp8":
        if scheme.strategy != "block":
            _check_scale(scheme, parts["weight_scale"], parts["weight"].shape[0], 1)
        return dequantize_fp8(parts["weight"], parts["weight_scale"], scheme.block)
    scale = parts["weight_scale"]
    if scheme.source == "ct-pack-quantized":
        n, k = (int(v) for v in parts["weight_shape"].tolist())
        q = unpack_ct_int4(parts["weight_packed"], k)
        zp = parts.get("weight_zero_point")
        if zp is not None:
            zp = unpack_ct_zero_points(zp, n)
    else:  # naive-quantized: int8 values as they are
        q, zp = parts["weight"], parts.get("weight_zero_point")
    groups = 1 if scheme.group_size is None else -(-q.shape[1] // scheme.group_size)
    _check_scale(scheme, scale, q.shape[0], groups)
    return dequantize_int4(q, scale, zp, scheme.group_size)


def _check_scale(scheme: QuantScheme, scale: torch.Tensor, rows: int, groups: int) -> None:
    """A compressed-tensors weight_scale has the shape its strategy gives: one value (tensor),
    one per output row (channel), one per row and group of input columns (group)."""
    if scheme.strategy == "tensor":
        ok, want = scale.numel() == 1, "one value"
    else:
        shapes = {(rows, groups), (rows,)} if groups == 1 else {(rows, groups)}
        ok, want = tuple(scale.shape) in shapes, f"[{rows}, {groups}]"
    if not ok:
        raise ValueError(
            f"weight_scale has shape {list(scale.shape)}; strategy {scheme.strategy!r} needs {want}"
        )


def _int4_from_gptq_awq(
    scheme: QuantScheme, parts: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if scheme.source == "awq":
        return awq_to_int4(parts["qweight"], parts["qzeros"], parts["scales"], scheme.group_size)
    q, zp, scale = gptq_to_int4(
        parts["qweight"], parts["qzeros"], parts["scales"], scheme.group_size, scheme.gptq_v1_zeros
    )
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        k = q.shape[1]
        size = scheme.group_size or k
        expected = torch.arange(k, dtype=torch.int64) // size
        if not torch.equal(g_idx.to(torch.int64), expected):
            raise ValueError(
                "g_idx: orders the input columns' groups differently from column // group_size "
                "(act-order); not supported"
            )
    return q, zp, scale


@dataclass
class _Pending:
    scheme: QuantScheme
    parts: dict[str, torch.Tensor]


class QuantizedCheckpoint:
    """Rewrites a quantized checkpoint's tensor stream into dense weights (or, for the modules
    in ``kept``, the quantized form that ``keep_on``'s layers keep).

    ``names``: every tensor name of the checkpoint (from the safetensors headers), so a module
    is known to be quantized before its tensors arrive. ``is_linear``: whether a checkpoint
    weight name loads into a linear layer (online FP8 quantizes only those).
    """

    def __init__(
        self,
        config: QuantConfig,
        names: set[str],
        is_linear: Callable[[str], bool],
        keep_on: torch.device | None = None,
    ) -> None:
        self.config = config
        self.keep_on = keep_on
        self._names = names
        # Modules whose weights stay quantized (``kept``): with ``keep_on``, every quantized
        # module that loads into a linear layer; the rest are dequantized.
        self.kept: set[str] = set()
        self.schemes: dict[str, QuantScheme] = {}
        # module -> the leaf names it is complete with (optional ones that the checkpoint has)
        self.parts_of: dict[str, tuple[str, ...]] = {}
        self.input_scales: dict[str, torch.Tensor] = {}
        if config.online:
            for name in names:
                module, leaf = _split(name)
                scheme = config.scheme_for(module)
                if leaf == "weight" and scheme is not None and is_linear(name):
                    self.schemes[module] = scheme
                    self.parts_of[module] = ("weight",)
            self._choose_kept(is_linear)
            return
        for name in names:
            module, leaf = _split(name)
            if leaf not in _MARKERS or module in self.schemes:
                continue
            scheme = config.scheme_for(module)
            if scheme is None:
                raise ValueError(
                    f"checkpoint tensor {name!r}: {module!r} is stored quantized, but "
                    "quantization_config ignores it or no config group targets it"
                )
            missing = [p for p in required_parts(scheme) if f"{module}.{p}" not in names]
            if missing:
                raise ValueError(
                    f"checkpoint: quantized module {module!r} lacks {missing} "
                    f"({scheme.kind}, {scheme.source})"
                )
            self.schemes[module] = scheme
            optional = [p for p in _optional_parts(scheme) if f"{module}.{p}" in names]
            self.parts_of[module] = (*required_parts(scheme), *optional)
        self._choose_kept(is_linear)

    def _choose_kept(self, is_linear: Callable[[str], bool]) -> None:
        if self.keep_on is None:
            return
        for module, scheme in self.schemes.items():
            if not is_linear(f"{module}.weight"):
                continue  # MoE experts and the like: dequantized
            problem = kept_problem(scheme)
            if problem is not None:
                raise ValueError(
                    f"{module}: {problem} cannot stay quantized on {self.keep_on.type} "
                    "(the FP8 GEMM quantizes activations its own way)"
                )
            self.kept.add(module)

    def weight_name(self, name: str) -> str:
        """The dense name a checkpoint tensor's bytes load into (``x.weight_packed`` ->
        ``x.weight``), for counting what each rank reads."""
        module, _ = _split(name)
        return f"{module}.weight" if module in self.schemes else name

    def transform(self, weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``weights`` with each quantized module's tensors replaced by its weight."""
        pending: dict[str, _Pending] = {}
        for name, tensor in weights:
            module, leaf = _split(name)
            scheme = self.schemes.get(module)
            wanted = self.parts_of.get(module, ())
            if leaf not in wanted:
                yield name, tensor
                continue
            entry = pending.setdefault(module, _Pending(scheme, {}))
            entry.parts[leaf] = tensor[:] if not isinstance(tensor, torch.Tensor) else tensor
            if all(p in entry.parts for p in wanted):
                del pending[module]
                if "input_scale" in entry.parts:
                    self.input_scales[module] = entry.parts["input_scale"]
                try:
                    if module in self.kept:
                        weight = quantized_form(
                            scheme, entry.parts, self.keep_on, _int4_from_gptq_awq
                        )
                    else:
                        weight = dequantize_module(scheme, entry.parts)
                except ValueError as e:
                    raise ValueError(f"{module}: {e}") from e
                yield f"{module}.weight", weight
        if pending:
            module = next(iter(pending))
            raise ValueError(f"checkpoint: quantized module {module!r} is incomplete")

    def attach_activation_quant(
        self, model: nn.Module, target_of: Callable[[str], tuple[str, Any]]
    ) -> int:
        """Give each layer of this rank whose checkpoint modules quantize activations an
        ``Fp8InputQuant``; returns how many. A fused layer's parts must agree on dynamic vs
        static (static parts keep their own scales), and none may be stored dense."""
        by_layer: dict[str, list[tuple[Any, QuantScheme, str]]] = {}
        for module, scheme in sorted(self.schemes.items()):
            if scheme.activations is None or module in self.kept:
                continue  # a kept module's GEMM quantizes its activations itself
            if scheme.source == "fp8-block":
                # Dequantized, it is transformers' reading of the format off the GPU
                # (FineGrainedFP8 with dequantize): activations stay in the model dtype.
                continue
            param, part = target_of(f"{module}.weight")
            by_layer.setdefault(param, []).append((part, scheme, module))
        params = dict(model.named_parameters())
        # Modules stored dense (``ignore``d), by the layer they load into.
        dense_parts: dict[str, list[str]] = {}
        for module, leaf in map(_split, self._names):
            if leaf == "weight" and module not in self.schemes:
                dense_parts.setdefault(target_of(f"{module}.weight")[0], []).append(module)
        count = 0
        for param, parts in by_layer.items():
            if param not in params:
                continue  # another pipeline stage's layer
            if param in dense_parts:
                raise ValueError(
                    f"{param.removesuffix('.weight')}: its parts {sorted(dense_parts[param])} "
                    f"are stored dense and {sorted(m for _, _, m in parts)} quantized with FP8 "
                    "activations; the fused layer quantizes its one input for all its parts "
                    "(quantize all of them, or leave all in quantization_config's ignore)"
                )
            layer_name, _, leaf = param.rpartition(".")
            layer = model.get_submodule(layer_name)
            # Stacked MoE experts (``w13_weight``), an LM head: no per-layer matmul hook.
            if leaf != "weight" or not hasattr(layer, "quant_method"):
                raise ValueError(
                    f"{parts[0][2]}: FP8 activation quantization on a {type(layer).__name__} "
                    "is not supported (linear layers only)"
                )
            layer.quant_method = self._input_quant(layer, parts)
            count += 1
        return count

    def _input_quant(self, layer: nn.Module, parts: list[tuple[Any, QuantScheme, str]]):
        acts = {scheme.activations for _, scheme, _ in parts}
        if len(acts) != 1:
            raise ValueError(f"{parts[0][2]}: fused parts quantize activations differently")
        act = acts.pop()
        if act.dynamic:
            return Fp8InputQuant(act, None)
        if len(parts) == 1 and parts[0][0] is None:
            return Fp8InputQuant(act, [(None, self.input_scales[parts[0][2]])])
        segments = [(layer_part_rows(layer, part), self.input_scales[m]) for part, _, m in parts]
        # Concatenated in row order, the parts' outputs are the fused layer's.
        return Fp8InputQuant(act, sorted(segments, key=lambda seg: seg[0][0]))


def layer_part_rows(layer: nn.Module, part: Any) -> tuple[int, int]:
    """The rows of this rank's fused weight that part ``part`` fills (q/k/v or an index)."""
    if part in ("q", "k", "v"):
        start = {"q": 0, "k": layer.q_size, "v": layer.q_size + layer.kv_size}[part]
        return start, start + (layer.q_size if part == "q" else layer.kv_size)
    sizes = [s // layer.tp.size for s in layer.output_sizes]
    start = sum(sizes[:part])
    return start, start + sizes[part]


class Fp8InputQuant:
    """A layer's ``quant_method`` on CPU for FP8 W8A8 checkpoints: y = x_q W^T (+ b), with x
    quantized to e4m3 and back (``formats.fake_quantize_fp8_input``) and W the dequantized
    weight. Static scales apply per fused part (each part's own ``input_scale``, rows
    ``(start, end)``; None: the whole layer), as the reference runs q, k and v separately."""

    def __init__(
        self, act: ActivationQuant, segments: list[tuple[tuple[int, int] | None, Any]] | None
    ) -> None:
        self.act = act
        self.segments = segments
        # One matmul over the whole weight: ``pack_linear_weights`` may pack it for oneDNN
        # (2-3x F.linear on CPU); per-part matmuls slice the plain weight instead.
        self.packable = segments is None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = layer.weight
        if self.segments is None:
            xq = fake_quantize_fp8_input(x, self.act, None)
            if layer.packed_weight is not None:
                return packed_linear(xq, layer.packed_weight, bias)
            return F.linear(xq, weight, bias)
        outs = []
        for rows, scale in self.segments:
            xq = fake_quantize_fp8_input(x, self.act, scale)
            if rows is None:
                return F.linear(xq, weight, bias)
            a, b = rows
            outs.append(F.linear(xq, weight[a:b], None if bias is None else bias[a:b]))
        return torch.cat(outs, dim=-1)
