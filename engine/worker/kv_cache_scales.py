"""An FP8 KV cache's per-tensor scales from the checkpoint.

compressed-tensors' ``kv_cache_scheme`` (llm-compressor) writes one float32 scale per
attention layer for K and one for V, ``model.layers.<i>.self_attn.k_scale`` / ``v_scale``;
older FP8 checkpoints write a single ``kv_scale`` for both. They become the ``k_scale`` /
``v_scale`` floats of that layer's ``PagedAttention`` (1.0 where a checkpoint has none), which
the cache write divides by and the attention read multiplies by (``llm_kernels.kv_quant``). A
cache stored in the model's dtype (``kv_cache_dtype="auto"``) ignores them, as vLLM does.

The strict loader hands these names here instead of looking for a parameter: a scale is not
a parameter, so checkpoints without scales load exactly as before.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from llm_kernels.kv_quant import check_kv_scale

__all__ = ["is_kv_scale_name", "load_kv_scale"]

_KV_SCALE = re.compile(
    r"^(?P<attn>.*\.layers\.(?P<index>\d+)\.self_attn)\.(?P<kind>[kv]_scale|kv_scale)$"
)


def is_kv_scale_name(name: str) -> bool:
    return _KV_SCALE.match(name) is not None


def load_kv_scale(model: nn.Module, name: str, tensor: Any, num_hidden_layers: int) -> None:
    """Set the scale ``name`` on its layer's ``PagedAttention``; a layer of another pipeline
    stage is skipped. ``tensor`` is a torch tensor or a lazy safetensors slice."""
    match = _KV_SCALE.match(name)
    if match is None:
        raise ValueError(f"checkpoint tensor {name!r} is not an attention layer's KV cache scale")
    index = int(match["index"])
    if index >= num_hidden_layers:
        raise ValueError(
            f"checkpoint tensor {name!r}: layer {index} does not exist "
            f"(num_hidden_layers={num_hidden_layers})"
        )
    try:
        attn = model.get_submodule(f"{match['attn']}.attn")
    except AttributeError:
        return  # a layer of another pipeline stage
    value = check_kv_scale(name, tensor if isinstance(tensor, torch.Tensor) else tensor[...])
    kind = match["kind"]
    if kind in ("k_scale", "kv_scale"):
        attn.k_scale = value
    if kind in ("v_scale", "kv_scale"):
        attn.v_scale = value
