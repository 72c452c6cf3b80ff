"""The checks ``engine.config`` runs against a model before anything is placed: its checkpoint
read and refused where the engine cannot serve it exactly (``with_checkpoint``), its length
limit (``derive_max_model_len``), its shape against the parallel layout
(``check_parallel_shape``) and the kernel backend against the device (``check_kernel_device``).
Each raises ``ConfigError`` naming the engine argument.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine import envs
from engine.hf_config import check_hf_config, num_experts
from engine.quantization.config import parse_quantization
from engine.rope_config import rope_max_positions
from engine.validation import check_int, require

if TYPE_CHECKING:
    from engine.config import DeviceConfig, KernelConfig, ModelConfig, ParallelConfig


def with_checkpoint(model: ModelConfig) -> ModelConfig:
    # Imported here (start-up time): the built-in models pull in transformers, which a bare
    # config check need not load.
    from engine.builtin.catalog import resolve_model_source

    path = resolve_model_source(model.model)
    config_file = Path(path) / "config.json"
    hf_config = json.loads(config_file.read_text())
    # Refused here, before anything is placed: what the engine cannot serve exactly.
    check_hf_config(hf_config)
    parse_quantization(hf_config, model.quantization)  # online fp8 of a quantized checkpoint
    return dataclasses.replace(model, hf_config=hf_config, model_path=str(path))


def derive_max_model_len(model: ModelConfig) -> int:
    # max_position_embeddings, extended by the rope's scaling factor where the config states
    # the original length (vLLM's convention); sliding-window layers attend within their
    # window at any length, so the window does not bound it.
    limit = rope_max_positions(model.hf_config)
    if model.max_model_len is None:
        return limit
    check_int(
        model.max_model_len,
        "max_model_len",
        ge=1,
        le=limit,
        note="the model's max_position_embeddings, with rope scaling",
    )
    return model.max_model_len


def check_parallel_shape(model: ModelConfig, parallel: ParallelConfig) -> None:
    tp = parallel.tensor_parallel_size
    require(
        model.num_attention_heads % tp == 0,
        "tensor_parallel_size",
        f"must divide num_attention_heads ({model.num_attention_heads}), got {tp}",
    )
    inter = model.hf_config.get("intermediate_size")
    # Checked here so that a bad shape is a ConfigError on the head, not a worker that dies
    # while building its MLP shard.
    require(
        not inter or inter % tp == 0,
        "tensor_parallel_size",
        f"must divide intermediate_size ({inter}), got {tp}",
    )
    kv = model.num_kv_heads
    require(
        kv % tp == 0 or tp % kv == 0,
        "tensor_parallel_size",
        f"must divide or be a multiple of num_key_value_heads ({kv}), got {tp}",
    )
    experts = num_experts(model.hf_config)  # EP: num_experts / ep whole experts per rank
    ep = parallel.ep_size
    ep_size = (
        "tensor_parallel_size"
        if parallel.data_parallel_size == 1
        else "data_parallel_size x tensor_parallel_size"
    )
    require(
        not parallel.enable_expert_parallel or experts % ep == 0,
        "enable_expert_parallel",
        f"needs num_experts ({experts}) divisible by the EP size ({ep_size}), got {ep}",
    )
    require(
        parallel.data_parallel_size == 1 or experts > 0,
        "data_parallel_size",
        f"> 1 needs a mixture-of-experts model (its experts split over the DP ranks); "
        f"{model.model!r} has none. A dense model scales by replicas (num_replicas)",
    )
    pp = parallel.pipeline_parallel_size
    require(
        pp <= model.num_hidden_layers,
        "pipeline_parallel_size",
        f"must be <= num_hidden_layers ({model.num_hidden_layers}), got {pp}",
    )


def check_kernel_device(kernel: KernelConfig, device: DeviceConfig) -> None:
    # Triton compiles for GPUs; on CPU its kernels only run through the interpreter, which
    # must be switched on before the kernels are imported.
    require(
        kernel.attention_backend != "triton"
        or device.device_type == "cuda"
        or envs.triton_interpret(),
        "attention_backend",
        "'triton' on CPU needs TRITON_INTERPRET=1 in the environment (the Triton "
        "interpreter; slow, meant for tests); use 'torch' or 'auto' on CPU",
    )
    require(
        kernel.attention_backend != "cpu" or device.device_type == "cpu",
        "attention_backend",
        f"'cpu' runs on CPU only, not on {device.device_type!r}; use 'auto'",
    )
