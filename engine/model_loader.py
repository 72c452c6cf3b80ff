"""Build a model for one worker and stream its weights from safetensors.

Each checkpoint tensor is handed to its parameter's ``weight_loader`` as a lazy safetensors
slice, so a tensor-parallel layer reads only its shard from disk. HF names of fused
projections are mapped through the model's ``packed_modules_mapping`` (q,k,v -> qkv_proj;
gate,up -> gate_up_proj).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from engine import envs
from engine.config import EngineConfig
from engine.models import get_model_class
from kernels.backend import get_kernel_ops
from parallel.layers import load_full_loader, pack_linear_weights
from parallel.state import ParallelContext

logger = logging.getLogger("llm_cluster.loader")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def iterate_checkpoint(
    model_path: str | Path, *, progress: bool = True
) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) for every tensor of every ``*.safetensors`` file, shard by shard."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors files in {model_path}")
    for file in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=not progress):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_slice(name)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, Any]]) -> None:
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    loaded: set[str] = set()
    for name, tensor in weights:
        aliases = getattr(model, "checkpoint_aliases", lambda n: ())(name)
        for target in (name, *aliases):
            shard_id = None
            for hf_name, (fused, part) in packed.items():
                if f".{hf_name}." in target:
                    target, shard_id = target.replace(f".{hf_name}.", f".{fused}."), part
                    break
            param = params.get(target)
            if param is None:
                continue  # another pipeline stage's weight, or a buffer we recompute (rotary)
            loader = getattr(param, "weight_loader", load_full_loader)
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"model: checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")


def load_model(config: EngineConfig, ctx: ParallelContext, device: torch.device) -> nn.Module:
    model_class = get_model_class(config.model.architecture)
    backend = config.kernel.resolved_backend(device.type)
    with torch.device(device), _default_dtype(config.model.torch_dtype):
        model = model_class(config.model.hf_config, ctx, ops=get_kernel_ops(backend))
    progress = ctx.tp.rank == 0 and ctx.pp.rank == 0
    load_weights(model, iterate_checkpoint(config.model.model_path, progress=progress))
    model.eval()
    if device.type == "cpu" and envs.cpu_packed_gemm():
        packed = pack_linear_weights(model)
        logger.debug("packed %d linear weights for oneDNN", packed)
    return model
