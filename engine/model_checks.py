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
from typing import TYPE_CHECKING, Any

from engine import envs
from engine.builtin.catalog import resolve_model_source
from engine.checkpoint_headers import checkpoint_headers
from engine.errors import ConfigError
from engine.hf_config import check_hf_config, num_experts
from engine.hf_defaults import HF_MODEL_TYPES, with_hf_defaults
from engine.model_heads import classifier_tokens, declared_architecture, resolve_task
from engine.quantization.config import parse_quantization
from engine.rope_config import rope_max_positions
from engine.s3_mirror import mirror_checkpoint
from engine.s3_store import is_s3_uri
from engine.validation import check_int, require
from engine.vlm_config import (
    flatten_vlm_config,
    is_vlm,
    max_image_tokens,
    whole_image_attention,
)

if TYPE_CHECKING:
    from engine.config_sections import DeviceConfig, KernelConfig, ModelConfig, ParallelConfig


def with_checkpoint(model: ModelConfig) -> ModelConfig:
    path = Path(model.model).expanduser()
    if is_s3_uri(model.model):
        # Config and tokenizer files copied to this node; the weights are fetched by the
        # workers that load them (engine.worker.model_loader), their headers read remotely.
        path = mirror_checkpoint(model.model, weights=False)
    elif not (path / "config.json").is_file():
        # A built-in (or a bad path, which the catalog names with the built-ins).
        path = resolve_model_source(model.model)
    if is_s3_uri(model.tokenizer):  # a tokenizer of its own in the store: copied likewise
        local = mirror_checkpoint(
            model.tokenizer, weights=False, field="tokenizer", require_config=False
        )
        model = dataclasses.replace(model, tokenizer=str(local))
    config_file = Path(path) / "config.json"
    # A VLM's nested config is read flat (engine.vlm_config); hf_overrides apply to that, and
    # what both leave out takes transformers' default, as HF's model would (engine.hf_defaults).
    declared = _read_json(config_file, "model")
    raw = flatten_vlm_config(declared)
    hf_config = with_hf_defaults({**raw, **(model.hf_overrides or {})})
    # Refused here, before anything is placed: what the engine cannot serve exactly.
    check_hf_config(hf_config)
    _check_local_tokenizer(model.tokenizer)
    _check_tokenizer_source(Path(model.tokenizer or path).expanduser(), declared, model.tokenizer)
    parse_quantization(hf_config, model.quantization)  # online fp8 of a quantized checkpoint
    model = dataclasses.replace(model, hf_config=hf_config, model_path=str(path))
    require(
        not is_vlm(hf_config) or resolve_task(hf_config, model.runner, model.convert) == "generate",
        "runner",
        f"{model.model} is a vision-language model: it serves runner: generate only",
    )
    if resolve_task(hf_config, model.runner, model.convert) == "generate":
        _check_lm_head(model.model if is_s3_uri(model.model) else path, hf_config)
    tokens = classifier_tokens(hf_config)
    if not tokens:
        return model
    return dataclasses.replace(model, classifier_token_ids=_token_ids(model, tokens))


def _read_json(file: Path, key: str) -> dict[str, Any]:
    """A checkpoint's JSON file (a truncated copy is refused naming the argument, not raised
    as a ``JSONDecodeError``)."""
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: {file} is not valid JSON ({exc})") from None
    require(isinstance(data, dict), key, f"{file} must hold a JSON object, got {data!r:.80}")
    return data


def _check_local_tokenizer(tokenizer: str | None) -> None:
    """A tokenizer written as a path (``/``, ``.`` or ``~`` first) must be a directory here, as
    ``model_source`` must; any other name is a Hub id, which transformers resolves."""
    if tokenizer is None or not tokenizer.startswith(("/", ".", "~")):
        return
    path = Path(tokenizer).expanduser()
    require(
        path.is_dir(),
        "tokenizer",
        f"{tokenizer!r} is not a directory on this machine (a path must be a tokenizer's "
        "local directory; else give a Hub name or s3://bucket/prefix)",
    )


def _check_tokenizer_source(source: Path, declared: dict[str, Any], tokenizer: str | None) -> None:
    """A tokenizer that transformers loads only with the checkpoint's own code, which the engine
    never runs (``trust_remote_code``), is refused here by name rather than failing inside
    transformers once the engine starts: Kimi K2's tiktoken tokenizer (``auto_map`` to
    ``TikTokenTokenizer``, no tokenizer.json), or a model directory whose ``model_type`` only
    that code defines (AutoTokenizer reads the model's config.json too)."""
    if not source.is_dir():
        return  # a Hub name: transformers says what it lacks
    settings_file = source / "tokenizer_config.json"
    key = "model" if tokenizer is None else "tokenizer"
    settings = _read_json(settings_file, key) if settings_file.is_file() else {}
    auto_map = settings.get("auto_map")
    remote = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
    has_json = (source / "tokenizer.json").is_file()
    if remote and not has_json:
        raise ConfigError(
            f"tokenizer: {source} holds tokenizer_class "
            f"{settings.get('tokenizer_class')!r}, which is the checkpoint's own code "
            f"(auto_map AutoTokenizer: {remote!r}) and which the engine never runs, and no "
            "tokenizer.json; pass tokenizer: a directory with a transformers tokenizer"
        )
    model_type = declared.get("model_type")
    if tokenizer is not None or not (has_json or settings) or not model_type:
        return
    if model_type in HF_MODEL_TYPES.values() or _transformers_config_loads(source, model_type):
        return
    raise ConfigError(
        f"model_type: {model_type!r} is not one transformers knows (the checkpoint's own code "
        f"defines it, which the engine never runs), and transformers cannot read {source} "
        "to load the tokenizer from it; pass tokenizer: a directory with a transformers "
        f"tokenizer (the model itself is served as {declared_architecture(declared)})"
    )


def _transformers_config_loads(source: Path, model_type: str) -> bool:
    """Whether AutoTokenizer can read the model config in ``source``: its class when transformers
    knows ``model_type``, else the generic config it falls back to, which fails on some (a
    scaled rope). Imports transformers; only configs of a model_type outside the engine's
    families (``engine.hf_defaults.HF_MODEL_TYPES``) get here."""
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES:
        return True
    try:
        PretrainedConfig.from_pretrained(source)
    except (AttributeError, KeyError, TypeError, ValueError):
        return False
    return True


def _check_lm_head(path: Path | str, hf_config: dict[str, Any]) -> None:
    """An untied causal LM saved without its LM head (an embedding model's checkpoint) cannot
    generate: refused here, naming the argument that serves it."""
    if hf_config.get("tie_word_embeddings") is not False or is_vlm(hf_config):
        return  # (a VLM's head is under its own names; the loader checks it)
    names = checkpoint_headers(path)  # none: a config-only directory (cluster plan)
    if names and "lm_head.weight" not in names:
        raise ConfigError(
            "runner: the checkpoint has no lm_head.weight (untied), so it cannot generate; "
            "an embedding model's checkpoint is served with runner: pooling"
        )


def _token_ids(model: ModelConfig, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """Each classifier token's id in the model's vocabulary (one token each, as vLLM reads
    ``classifier_from_token``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer or model.model_path)
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        unknown = token_id is None or (
            token_id == tokenizer.unk_token_id and token != tokenizer.unk_token
        )
        vocab = int(model.hf_config["vocab_size"])
        if unknown or not 0 <= token_id < vocab:
            raise ConfigError(
                f"classifier_from_token: {token!r} is not one token of the model's vocabulary"
            )
        ids.append(int(token_id))
    return tuple(ids)


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
        pp == 1 or not is_vlm(model.hf_config),
        "pipeline_parallel_size",
        f"vision-language models run on one pipeline stage (the vision tower feeds stage 0's "
        f"embeddings), got {pp}",
    )
    require(
        pp <= model.num_hidden_layers,
        "pipeline_parallel_size",
        f"must be <= num_hidden_layers ({model.num_hidden_layers}), got {pp}",
    )


def check_whole_images(hf: dict[str, Any], sched_kwargs: dict[str, Any]) -> None:
    """A model whose image tokens attend each other both ways (Gemma 3) computes each image's
    tokens in one prefill chunk: ``disable_chunked_mm_input`` is set (refused if asked off),
    and one step's token budget must hold one image. Updates ``sched_kwargs`` in place."""
    if not whole_image_attention(hf):
        return
    require(
        sched_kwargs.get("disable_chunked_mm_input", True) is True,
        "disable_chunked_mm_input",
        f"{hf['architectures'][0]}'s image tokens attend to each other both ways, so an image "
        "is never split across prefill chunks; it cannot be false",
    )
    sched_kwargs["disable_chunked_mm_input"] = True
    tokens = max_image_tokens(hf)
    budget = sched_kwargs["max_num_batched_tokens"]
    require(
        not isinstance(budget, int) or budget >= tokens,
        "max_num_batched_tokens",
        f"must be >= {tokens}, the tokens of one image, which {hf['architectures'][0]} "
        f"computes in one step (its image tokens attend to each other both ways); got {budget}",
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
