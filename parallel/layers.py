"""Tensor-parallel layers: each allocates only its shard, and its ``weight_loader`` reads only
that shard's slice of the checkpoint tensor.

``loaded`` in a weight loader is either a torch tensor or a safetensors slice (``get_slice``);
both support basic slicing, so a worker reads just its rows/columns from disk and a 70B tensor
is never materialized whole. With a TP group of size 1 these are plain layers.

Every loader first checks the FULL checkpoint tensor's shape against what the unsharded
parameter (or fused part) must be, and raises ValueError naming both shapes: a shard that
merely fits (or a [1, in] row that would broadcast) is never copied. The expected shape takes
its sharded dimension from the layer and the others from the destination, so the same loaders
serve LoRA's A/B views (``parallel.lora``).

    ColumnParallel:  W [out, in]  split on out   y_shard = x @ W_shard^T          (no comm)
    RowParallel:     W [out, in]  split on in    y = all_reduce(x_shard @ W_shard^T) + b
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llm_kernels.cpu_gemm import pack_linear_weight, packed_linear
from parallel.state import SINGLE, GroupCoordinator


def _shape(loaded: Any) -> tuple[int, ...]:
    return tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)


def narrow(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """``loaded[..., start:start+size, ...]`` along dim 0 or 1, read lazily from a slice."""
    if dim == 0:
        return loaded[start : start + size]
    if dim == 1:
        return loaded[:, start : start + size]
    raise ValueError(f"dim: must be 0 or 1, got {dim}")


def check_shape(loaded: Any, expected: tuple[int, ...], what: str) -> None:
    """Raise unless the full checkpoint tensor ``loaded`` has shape ``expected``; ``what`` says
    which parameter (or part) the expectation comes from."""
    actual = _shape(loaded)
    if actual != tuple(expected):
        raise ValueError(f"checkpoint shape {list(actual)} != expected {list(expected)} for {what}")


def _no_shard_id(layer: nn.Module, shard_id: Any) -> None:
    # A shard id reaches an unfused layer only through a wrong packed_modules_mapping.
    if shard_id is not None:
        raise ValueError(
            f"shard_id: {type(layer).__name__} is not fused, got shard_id {shard_id!r}"
        )


def load_full(param: nn.Parameter, loaded: Any) -> None:
    check_shape(loaded, tuple(param.shape), "a replicated parameter")
    param.data.copy_(loaded[:] if not isinstance(loaded, torch.Tensor) else loaded)


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


# Set while a model whose linear weights stay quantized is built: the linear layers' dense
# weights are then meta tensors (their shapes drive the loaders; no memory is allocated).
_META_LINEAR_WEIGHTS = False


@contextlib.contextmanager
def meta_linear_weights() -> Iterator[None]:
    """Build column / row parallel layers with meta-device weights (see ``copy_rows``)."""
    global _META_LINEAR_WEIGHTS
    old, _META_LINEAR_WEIGHTS = _META_LINEAR_WEIGHTS, True
    try:
        yield
    finally:
        _META_LINEAR_WEIGHTS = old


def _linear_weight(rows: int, cols: int) -> nn.Parameter:
    if _META_LINEAR_WEIGHTS:
        return nn.Parameter(torch.empty(rows, cols, device="meta"), requires_grad=False)
    return _param(rows, cols)


def copy_rows(layer: nn.Module, param: nn.Parameter, offset: int, rows: Any) -> None:
    """``param[offset : offset + len(rows)] = rows``; a quantized weight's slice (anything
    with ``store_into``, see ``engine.quantization.kept``) stores itself in the layer."""
    if hasattr(rows, "store_into") and param is getattr(layer, "weight", None):
        rows.store_into(layer, offset)
        return
    param.data[offset : offset + rows.shape[0]].copy_(rows)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by the tensor parallel size ({denominator})"
        )
    return numerator // denominator


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W split by output rows; output stays sharded."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        tp: GroupCoordinator = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size_per_partition = divide(output_size, tp.size, "output size")
        self.weight = _linear_weight(self.output_size_per_partition, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(self.output_size_per_partition) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
        # Set by ``parallel.lora.attach_lora`` when the engine serves LoRA adapters.
        self.lora: Any = None
        # Set by the loader for a quantized checkpoint whose matmul is not a plain one
        # (``engine.quantization``): ``quant_method.apply(layer, x, bias)`` computes it.
        self.quant_method: Any = None
        # This rank's weight shard [out, in], also once ``pack_linear_weights`` has released it.
        self.weight_shape = (self.output_size_per_partition, input_size)
        self.packed_weight: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        _no_shard_id(self, shard_id)
        size = param.shape[0]
        check_shape(
            loaded, (size * self.tp.size, *param.shape[1:]), f"{type(self).__name__} output rows"
        )
        copy_rows(self, param, 0, narrow(loaded, 0, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear(self, x, self.bias)
        if self.lora is not None:
            self.lora.add_delta(x, y)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (gate_proj + up_proj).

    Each rank holds [shard of output 0; shard of output 1; ...]. A checkpoint stores either
    one tensor per part (``shard_id`` = its index) or the parts fused in order (Phi-3's
    ``gate_up_proj``, ``shard_id=None``); either way each rank reads only its rows of each part.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        tp: GroupCoordinator = SINGLE,
    ) -> None:
        self.output_sizes = list(output_sizes)
        for i, size in enumerate(self.output_sizes):
            divide(size, tp.size, f"output_sizes[{i}]")
        super().__init__(input_size, sum(output_sizes), bias=bias, tp=tp)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        trailing = tuple(param.shape[1:])
        name = type(self).__name__
        if shard_id is None:
            check_shape(loaded, (sum(self.output_sizes), *trailing), f"fused {name} parts")
            for i in range(len(self.output_sizes)):
                self._load_part(param, loaded, i, sum(self.output_sizes[:i]))
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard_id: must be a part index in [0, {len(self.output_sizes)}), got {shard_id!r}"
            )
        check_shape(loaded, (self.output_sizes[shard_id], *trailing), f"{name} part {shard_id}")
        self._load_part(param, loaded, shard_id, 0)

    def _load_part(self, param: nn.Parameter, loaded: Any, index: int, start: int) -> None:
        """This rank's rows of part ``index``, which starts at row ``start`` of ``loaded``."""
        part = self.output_sizes[index] // self.tp.size
        offset = sum(self.output_sizes[:index]) // self.tp.size
        rows = narrow(loaded, 0, start + self.tp.rank * part, part)
        copy_rows(self, param, offset, rows)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across TP ranks.

    When TP > num_kv_heads, each KV head is replicated on tp_size / num_kv_heads ranks.
    Rank layout of the fused output: [q heads of this rank | its kv heads (k) | (v)].
    A checkpoint stores q, k and v separately (``shard_id`` "q"/"k"/"v") or fused as
    [q; k; v] of the whole model (Phi-3's ``qkv_proj``, ``shard_id=None``).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool = False,
        tp: GroupCoordinator = SINGLE,
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, tp.size, "num_attention_heads")
        if tp.size >= num_kv_heads:
            divide(tp.size, num_kv_heads, "tensor parallel size vs num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_replicas = tp.size // num_kv_heads
        else:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_replicas = 1
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden_size, out, bias=bias, tp=tp)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        trailing = tuple(param.shape[1:])
        q_rows = self.total_num_heads * self.head_dim
        kv_rows = self.total_num_kv_heads * self.head_dim
        if shard_id is None:
            check_shape(
                loaded,
                (q_rows + 2 * kv_rows, *trailing),
                f"fused q/k/v ({self.total_num_heads} + 2 x {self.total_num_kv_heads} heads "
                f"x head_dim {self.head_dim})",
            )
            for part, start in (("q", 0), ("k", q_rows), ("v", q_rows + kv_rows)):
                self._load_part(param, loaded, part, start)
            return
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"shard_id: must be 'q', 'k', 'v' or None, got {shard_id!r}")
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        check_shape(
            loaded,
            (heads * self.head_dim, *trailing),
            f"part {shard_id!r} ({heads} heads x head_dim {self.head_dim})",
        )
        self._load_part(param, loaded, shard_id, 0)

    def _load_part(self, param: nn.Parameter, loaded: Any, part: str, start: int) -> None:
        """This rank's heads of ``part``, whose whole-model rows start at row ``start``."""
        if part == "q":
            offset, size, index = 0, self.q_size, self.tp.rank
        else:
            # Ranks sharing a replicated KV head read the same rows.
            offset = self.q_size + (self.kv_size if part == "v" else 0)
            size, index = self.kv_size, self.tp.rank // self.kv_replicas
        rows = narrow(loaded, 0, start + index * size, size)
        copy_rows(self, param, offset, rows)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b with W split by input columns; bias added once.
    ``reduce_results=False`` returns the rank's partial sum (no bias) for a caller that adds
    other partial sums first and all-reduces once (an MoE layer's shared expert)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        tp: GroupCoordinator = SINGLE,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        if bias and not reduce_results:
            raise ValueError("bias: a RowParallelLinear without reduce_results cannot add a bias")
        self.tp = tp
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, tp.size, "input size")
        self.weight = _linear_weight(output_size, self.input_size_per_partition)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = load_full_loader
        self.lora: Any = None  # see ColumnParallelLinear
        self.quant_method: Any = None  # see ColumnParallelLinear
        self.weight_shape = (output_size, self.input_size_per_partition)
        self.packed_weight: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        _no_shard_id(self, shard_id)
        if param.dim() != 2:
            raise ValueError(f"RowParallelLinear splits 2-D weights, got a {param.dim()}-D one")
        size = param.shape[1]
        check_shape(
            loaded, (param.shape[0], size * self.tp.size), "RowParallelLinear input columns"
        )
        copy_rows(self, param, 0, narrow(loaded, 1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear(self, x, None)
        if self.lora is not None:
            # This rank's share of the delta joins the partial sum the all-reduce adds up.
            self.lora.add_delta(x, y)
        if not self.reduce_results:
            return y
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


def load_full_loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    load_full(param, loaded)


def _linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    quant = getattr(layer, "quant_method", None)
    if quant is not None:
        return quant.apply(layer, x, bias)
    if layer.packed_weight is not None:
        return packed_linear(x, layer.packed_weight, bias)
    return F.linear(x, layer.weight, bias)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s weights as loaded; a packed weight counts at its plain size (the
    oneDNN layout holds the same elements, padded to its blocks), a quantized one at its
    quantized size (data, scales and zero points)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    for module in model.modules():
        quantized = getattr(module, "quant_method", None)
        if hasattr(quantized, "nbytes"):  # a weight kept quantized: its own bytes
            total += quantized.nbytes()
        packed = getattr(module, "packed_weight", None)
        if packed is not None and module.weight.numel() == 0:
            total += math.prod(module.weight_shape) * module.weight.element_size()
        if hasattr(module, "packed_nbytes"):  # packed MoE experts (``parallel.moe``)
            total += module.packed_nbytes()
    return total


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every linear weight of ``model`` (on CPU) into oneDNN's layout once its checkpoint
    is loaded (``llm_kernels.cpu_gemm``); returns how many were packed. A packed layer's plain
    weight is released (its ``weight_shape`` stays), except the LM head's when an embedding
    shares it. Layers whose device or dtype the packed path does not cover are left alone."""
    embedded = {
        m.weight.data_ptr()
        for m in model.modules()
        if type(m) is VocabParallelEmbedding and m.weight.numel()
    }
    count = 0
    for module in model.modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            continue
        if getattr(module, "dense_only", False):
            continue  # its weight is read as a tensor (engine.models.mla's kv_b_proj)
        quant = getattr(module, "quant_method", None)
        if module.packed_weight is not None or (quant and not getattr(quant, "packable", False)):
            continue  # a quantized layer's matmul reads its own weights
        packed = pack_linear_weight(module.weight)
        if packed is None:
            continue
        module.packed_weight = packed
        if module.weight.data_ptr() not in embedded:
            weight = module.weight
            module.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
            module.weight.weight_loader = weight.weight_loader
        count += 1
    return count


class VocabParallelEmbedding(nn.Module):
    """Embedding split by vocabulary: rank r owns rows [r*shard, (r+1)*shard) of the padded vocab;
    tokens outside its range embed to zero, and an all-reduce sums the one non-zero row."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp: GroupCoordinator = SINGLE,
        pad_to: int = 64,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        multiple = pad_to * tp.size if tp.size > 1 else 1
        padded = -(-num_embeddings // multiple) * multiple
        self.shard_size = padded // tp.size
        self.vocab_start = tp.rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = _param(self.shard_size, embedding_dim)
        self.weight.weight_loader = self.weight_loader
        self.weight_shape = (self.shard_size, embedding_dim)
        # Only an LM head is packed (``pack_linear_weights``); an embedding never is.
        self.packed_weight: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        _no_shard_id(self, shard_id)
        # The checkpoint holds exactly the vocabulary; the padding rows are ours (zeros).
        check_shape(
            loaded,
            (self.num_embeddings, *param.shape[1:]),
            f"{type(self).__name__} (vocab_size {self.num_embeddings})",
        )
        rows = self.vocab_end - self.vocab_start
        param.data.zero_()
        if rows > 0:
            param.data[:rows].copy_(narrow(loaded, 0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight).masked_fill(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """LM head split by vocabulary; logits are gathered to TP rank 0 (which samples)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather(_linear(self, hidden, None), dim=-1)
        if logits is None:
            return None
        return logits[..., : self.num_embeddings]
