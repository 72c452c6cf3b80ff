"""Build a model for one worker and stream its weights from safetensors.

Each checkpoint tensor is handed to its parameter's ``weight_loader``: one this rank reads whole
as a CPU tensor read ahead in parallel (``engine.worker.checkpoint_reader``), one it reads part
of as a lazy safetensors slice, so a tensor-parallel layer reads only its shard from disk. HF
names of fused projections are mapped through the model's ``packed_modules_mapping`` (q,k,v ->
qkv_proj; gate,up -> gate_up_proj); a fused tensor stored fused (Phi-3) goes to its layer whole.

Loading is strict. A meta-device build of the whole model (TP 1, PP 1) says which names exist
at all, so a tensor this rank does not hold is either another pipeline stage's or an error
that names it; dtypes other than F32/F16/BF16 are refused, never cast (a quantized checkpoint's
tensors are first turned into dense weights by ``engine.quantization.loading``);
every layer's loader checks the full tensor's shape before copying its shard. An ``s3://``
model is read from this node's copy, fetched first where missing (``engine.s3_mirror``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from engine.checkpoint_headers import checkpoint_headers
from engine.config import EngineConfig
from engine.models import model_class as model_class_of
from engine.quantization.config import parse_quantization
from engine.quantization.loading import QuantizedCheckpoint
from engine.quantization.model_setup import (
    keep_quantized_on,
    materialize_dense_linears,
    quantized_checkpoint,
    release_placeholders,
)
from engine.quantization.mxfp4 import Mxfp4Checkpoint, mxfp4_weights
from engine.s3_mirror import mirror_checkpoint
from engine.s3_store import is_s3_uri
from engine.startup_timeline import StartupTimeline
from engine.worker.checkpoint_reader import SAFETENSORS_DTYPES, read_checkpoint_file
from engine.worker.kv_cache_scales import is_kv_scale_name, load_kv_scale
from llm_kernels.backend import KernelOps, get_kernel_ops
from parallel.layers import (
    check_shape,
    load_full_loader,
    meta_linear_weights,
    pack_linear_weights,
)
from parallel.moe import pack_expert_weights
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
    model_path: str | Path,
    *,
    progress: bool = True,
    read_whole: Callable[[str], bool] = lambda name: True,
) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor of every ``*.safetensors`` file, file by file: read
    ahead in parallel where ``read_whole(name)``, a lazy slice where the rank reads only part
    (``engine.worker.checkpoint_reader``)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors files in {model_path}")
    for file in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=not progress):
        yield from read_checkpoint_file(file, read_whole)


def checkpoint_tensor_bytes(model_path: str | Path) -> dict[str, int]:
    """Bytes of every tensor of every ``*.safetensors`` file, from the files' headers."""
    return {name: _nbytes(info) for name, info in checkpoint_headers(model_path).items()}


def _nbytes(info: dict[str, Any]) -> int:
    start, end = info["data_offsets"]
    return end - start


# Checkpoint tensors that belong to no parameter on purpose (matched as a name suffix).
_UNUSED_CHECKPOINT_TENSORS = (
    # Rotary inverse frequencies (and cos/sin caches) that older HF checkpoints saved as
    # persistent buffers; HF recomputes them from rope_theta / rope_scaling, and so does
    # RotaryEmbedding here.
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)

# The dtypes a weight may have: copying one of them into the model's dtype is an ordinary cast.
# Anything else (FP8, int8/uint8/int32 packs) is a quantized format whose numbers mean nothing
# without its scales; a module the quantization_config describes never gets here as such.
_WEIGHT_DTYPES = frozenset({"F32", "F16", "BF16"})
_MAX_NAMED = 5  # tensor names an error lists
_MODEL_PREFIX = "model."
_HEAD_NAMES = ("lm_head.", "score.")  # top-level in every layout


def _shape(tensor: Any) -> tuple[int, ...]:
    """A checkpoint tensor's shape, whether read whole or a lazy safetensors slice."""
    return tuple(tensor.get_shape()) if hasattr(tensor, "get_shape") else tuple(tensor.shape)


def _check_dtype(name: str, tensor: Any, raw_params: frozenset[str], target: str) -> None:
    if hasattr(tensor, "store_into"):
        return  # a weight kept quantized, as quantization_config describes it
    if target in raw_params:
        return  # a parameter that holds a packed format itself (MXFP4 blocks); it checks it
    if hasattr(tensor, "get_dtype"):
        code = tensor.get_dtype()
        dtype = SAFETENSORS_DTYPES.get(code)
    else:
        dtype = tensor.dtype
        code = next((c for c, d in SAFETENSORS_DTYPES.items() if d == dtype), str(dtype))
    if code in _WEIGHT_DTYPES:
        return
    described = f"{str(dtype).removeprefix('torch.')} ({code})" if dtype is not None else code
    raise ValueError(
        f"checkpoint tensor {name!r} is {described}: weights must be F32, F16 or BF16 unless "
        "config.json's quantization_config says how the tensor is quantized"
    )


def _packed_target(name: str, packed: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """The parameter name a checkpoint name loads into and the part it fills (None: whole)."""
    for hf_name, (fused, part) in packed.items():
        if f".{hf_name}." in name:
            return name.replace(f".{hf_name}.", f".{fused}."), part
    return name, None


def _target_of(model: nn.Module) -> Callable[[str], tuple[str, Any]]:
    """Checkpoint name -> (parameter name, part): the model's ``checkpoint_target`` first (an
    MoE model's per-expert tensors go into slots of stacked parameters), then its
    ``packed_modules_mapping``."""
    packed: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    special = getattr(model, "checkpoint_target", None)

    def target(name: str) -> tuple[str, Any]:
        mapped = special(name) if special is not None else None
        return mapped if mapped is not None else _packed_target(name, packed)

    return target


def whole_model_parameters(
    model_class: type[nn.Module], hf_config: dict[str, Any], ops: KernelOps | None = None
) -> tuple[dict[str, tuple[int, ...]], frozenset[str], frozenset[str]]:
    """Every parameter name of the whole model (TP 1, PP 1) with its unsharded shape, the
    names that are a second name of a tied tensor (``lm_head.weight`` under
    tie_word_embeddings), and those of integer parameters (a packed format the layer keeps,
    MXFP4 experts' blocks). Built on the meta device, so it costs no memory, with the rank's
    kernels ``ops`` (which decide whether experts stay MXFP4; default torch)."""
    with torch.device("meta"):
        whole = model_class(hf_config, ParallelContext(), ops=ops or get_kernel_ops("torch"))
    shapes: dict[str, tuple[int, ...]] = {}
    first_name: dict[int, str] = {}
    tied: set[str] = set()
    raw: set[str] = set()
    for name, param in whole.named_parameters(remove_duplicate=False):
        shapes[name] = tuple(param.shape)
        if id(param) in first_name:
            tied.add(name)
        first_name.setdefault(id(param), name)
        if not param.dtype.is_floating_point:
            raw.add(name)
    return shapes, frozenset(tied), frozenset(raw)


def _not_parameters_error(names: list[str], model_class: str, hf: dict[str, Any]) -> ValueError:
    shown = ", ".join(repr(n) for n in names[:_MAX_NAMED])
    if len(names) == 1:
        message = f"checkpoint tensor {shown} is not a parameter of {model_class}"
    else:
        message = (
            f"checkpoint tensors {shown} ({len(names)} in all) are not parameters of {model_class}"
        )
    if any(n.endswith(".bias") for n in names[:_MAX_NAMED]):
        # The usual cause: a config switch (mlp_bias, attention_bias, ...) that says the
        # checkpoint's layers have no bias, or a family whose biases this model lacks.
        fields = [f"{k}={v!r}" for k, v in sorted(hf.items()) if "bias" in k.lower()]
        message += (
            f" (config {', '.join(fields)}?)" if fields else " (config.json sets no *bias field)"
        )
    return ValueError(message)


def _missing_parameters(
    params: dict[str, nn.Parameter],
    loaded: dict[str, set[Any]],
    packed: dict[str, tuple[str, Any]],
    expected_parts: Callable[[str], frozenset[Any] | None] | None = None,
) -> list[str]:
    """Parameters nothing was loaded into, and fused ones with a part left unloaded
    (``expected_parts`` names a parameter's parts where ``packed`` does not: an MoE model's
    stacked experts)."""
    missing = []
    for name in params:
        got = loaded.get(name)
        if not got:
            missing.append(name)
            continue
        if None in got:
            continue  # loaded whole (an unfused tensor, or a fused one stored fused)
        parts = expected_parts(name) if expected_parts is not None else None
        if parts is None:
            parts = {part for fused, part in packed.values() if f".{fused}." in name}
        missing.extend(f"{name} (part {p!r})" for p in sorted(parts - got, key=str))
    return missing


def _check_tied_copy(name: str, tensor: Any, shape: tuple[int, ...]) -> None:
    try:
        check_shape(tensor, shape, "the tied parameter")
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e


def _load_one(param: nn.Parameter, name: str, tensor: Any, shard_id: Any) -> None:
    loader = getattr(param, "weight_loader", load_full_loader)
    try:
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e


def load_weights(
    model: nn.Module,
    weights: Iterator[tuple[str, Any]],
    *,
    hf_config: dict[str, Any] | None = None,
) -> None:
    """Load every checkpoint tensor into this rank's parameters, strictly.

    Each tensor is consumed by a parameter of this rank, belongs to another pipeline stage (a
    parameter of the whole model, see ``whole_model_parameters``), is a known-unused buffer or
    a part of the checkpoint the model skips by name (``checkpoint_skipped``: DeepSeek's
    multi-token-prediction layers), or is named in a ValueError; so is a non-float dtype, a
    wrong shape, and a parameter (or fused part) the checkpoint lacks. ``hf_config`` is the HF
    config dict the model was built from (default: ``model.hf``).
    """
    hf = hf_config if hf_config is not None else getattr(model, "hf", None)
    if hf is None:
        raise ValueError("hf_config: required when the model keeps no .hf config dict")
    whole, tied, raw = whole_model_parameters(type(model), hf, getattr(model, "kernel_ops", None))
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    target_of = _target_of(model)
    aliases_of = getattr(model, "checkpoint_aliases", lambda n: ())
    skipped = getattr(model, "checkpoint_skipped", lambda n: False)
    loaded: dict[str, set[Any]] = {}
    unknown: list[str] = []
    for name, tensor in weights:
        if name.endswith(_UNUSED_CHECKPOINT_TENSORS) or skipped(name):
            continue
        if is_kv_scale_name(name):  # an FP8 KV cache's scale, not a parameter
            load_kv_scale(model, name, tensor, int(hf["num_hidden_layers"]))
            continue
        target, shard_id = target_of(name)
        _check_dtype(name, tensor, raw, target)
        if target not in whole:
            # A zero-width layer carries no weights: HF writes DeepSeek's and GLM-4.5's shared
            # experts with n_shared_experts 0 as empty tensors, and the model has none.
            if math.prod(_shape(tensor)) > 0:
                unknown.append(name)
            continue
        if unknown:
            continue  # the load fails anyway: only gather the remaining unknown names
        if target in tied:
            # A tied checkpoint that also stores the head: the embedding's tensor is the one
            # that counts (HF ties the head to it; vLLM skips the head too), whatever order the
            # shards come in, so this copy is only shape-checked.
            _check_tied_copy(name, tensor, whole[target])
            continue
        for alias in (name, *aliases_of(name)):
            dest, part = (target, shard_id) if alias == name else target_of(alias)
            param = params.get(dest)
            if param is None:
                continue  # a parameter of another pipeline stage
            _load_one(param, name, tensor, part)
            loaded.setdefault(dest, set()).add(part)
    if unknown:
        raise _not_parameters_error(unknown, type(model).__name__, hf)
    missing = _missing_parameters(params, loaded, packed, getattr(model, "checkpoint_parts", None))
    if missing:
        raise ValueError(
            f"model: checkpoint lacks {len(missing)} parameters, e.g. {missing[:_MAX_NAMED]}"
        )


def rank_read_bytes(
    model: nn.Module,
    tensor_bytes: dict[str, int],
    hf_config: dict[str, Any],
    rename: Callable[[str], str] = str,
) -> dict[str, int]:
    """Of each checkpoint tensor, the bytes this rank reads: its share of the tensor (the
    rank's parameter elements over the whole parameter's, so 1/TP of a sharded weight, all of
    a replicated norm), 0 for another pipeline stage's tensor, a tied copy or an unused buffer.
    Summed, the weight bytes this rank goes through; every tensor's at TP = PP = 1. ``rename``
    maps a quantized checkpoint's tensor (``x.weight_scale``) to the weight it loads into."""
    ops = getattr(model, "kernel_ops", None)
    whole, tied, _ = whole_model_parameters(type(model), hf_config, ops)
    params = dict(model.named_parameters())
    target_of = _target_of(model)
    aliases_of = getattr(model, "checkpoint_aliases", lambda n: ())
    skipped = getattr(model, "checkpoint_skipped", lambda n: False)
    shares: dict[str, int] = {}
    for checkpoint_name, nbytes in tensor_bytes.items():
        name = rename(checkpoint_name)
        target, _ = target_of(name)
        share = 0.0
        unused = name.endswith(_UNUSED_CHECKPOINT_TENSORS) or skipped(name)
        if not unused and target in whole and target not in tied:
            for alias in (name, *aliases_of(name)):
                dest = target if alias == name else target_of(alias)[0]
                if dest in params:
                    share = max(share, params[dest].numel() / math.prod(whole[dest]))
        shares[checkpoint_name] = round(nbytes * min(share, 1.0))
    return shares


# Called as weights load: (checkpoint bytes this rank has read, checkpoint bytes it reads in
# all). Called once per tensor, so a callback that publishes somewhere rate-limits itself.
LoadProgressCallback = Callable[[int, int], None]

_GiB = float(1 << 30)
_MiB = float(1 << 20)
_LOG_EVERY_S = 10.0  # a progress line at least this often while loading ...
_LOG_EVERY_FRACTION = 0.1  # ... and at every further 10 %
_QUIET_S = 5.0  # a load shorter than this logs only its summary


class LoadMeter:
    """Counts the bytes a rank has read as its tensors are consumed; reports them to
    ``progress`` on every tensor and to the log every ``_LOG_EVERY_S`` or 10 % (once the load
    has run ``_QUIET_S``), then one summary line."""

    def __init__(
        self,
        rank: int,
        total_bytes: int,
        progress: LoadProgressCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank = rank
        self.total_bytes = total_bytes
        self.read_bytes = 0
        self._progress = progress
        self._clock = clock
        self._started = clock()
        self._logged_at = self._started
        self._logged_fraction = 0.0

    def wrap(
        self, weights: Iterator[tuple[str, Any]], shares: dict[str, int]
    ) -> Iterator[tuple[str, Any]]:
        """``weights`` unchanged; a tensor counts as read once its consumer asks for the next."""
        self.add(0)
        for name, tensor in weights:
            yield name, tensor
            self.add(shares.get(name, 0))

    def add(self, nbytes: int) -> None:
        self.read_bytes += nbytes
        if self._progress is not None:
            self._progress(self.read_bytes, self.total_bytes)
        now = self._clock()
        fraction = self.read_bytes / self.total_bytes if self.total_bytes else 1.0
        if now - self._started < _QUIET_S or self.read_bytes >= self.total_bytes:
            return
        if now - self._logged_at >= _LOG_EVERY_S or (
            fraction - self._logged_fraction >= _LOG_EVERY_FRACTION
        ):
            self._logged_at, self._logged_fraction = now, fraction
            logger.info("%s", self.line())

    def line(self) -> str:
        """``rank 0: loading weights 3.20/17.60 GiB (18%), 42 s, 78 MiB/s``."""
        elapsed = self._clock() - self._started
        percent = 100 * self.read_bytes / self.total_bytes if self.total_bytes else 100.0
        return (
            f"rank {self.rank}: loading weights {format_bytes(self.read_bytes, self.total_bytes)}"
            f" ({percent:.0f}%), {elapsed:.0f} s, {self._rate(elapsed)}"
        )

    def _rate(self, elapsed: float) -> str:
        rate = self.read_bytes / _MiB / elapsed if elapsed > 0 else 0.0
        return f"{rate:.1f} MiB/s" if rate < 10 else f"{rate:.0f} MiB/s"

    def finish(self) -> None:
        elapsed = self._clock() - self._started
        logger.info(
            "rank %d: loaded %s of weights in %.1f s (%s)",
            self.rank,
            format_bytes(self.read_bytes),
            elapsed,
            self._rate(elapsed),
        )


def format_bytes(nbytes: int, total: int | None = None) -> str:
    """``3.20 GiB``, or ``3.20/17.60 GiB`` against a total; MiB below 1 GiB."""
    scale, unit = (_GiB, "GiB") if max(nbytes, total or 0) >= _GiB else (_MiB, "MiB")
    if total is None:
        return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / scale:.2f}/{total / scale:.2f} {unit}"


def _canonical_name(model: nn.Module, names: Iterable[str]) -> Callable[[str], str]:
    """Checkpoint name -> the name the loader reads: ``model.``-prefixed where the checkpoint
    was saved from HF's bare ``XModel`` (no tensor under ``model.``; Qwen3-Embedding)."""
    if any(n.startswith(_MODEL_PREFIX) for n in names) or not any(
        n.startswith(_MODEL_PREFIX) for n, _ in model.named_parameters()
    ):
        return str
    return lambda name: name if name.startswith(_HEAD_NAMES) else _MODEL_PREFIX + name


def load_model(
    config: EngineConfig,
    ctx: ParallelContext,
    device: torch.device,
    progress: LoadProgressCallback | None = None,
    timeline: StartupTimeline | None = None,
) -> nn.Module:
    """Build this rank's shard of the model and load its weights; ``progress`` (when given)
    hears how far the read has got: (bytes read, bytes in all), once per tensor;
    ``timeline`` gets a mark as the build, the read and the CPU repack end."""
    timeline = timeline or StartupTimeline("load_model")
    model_class = model_class_of(config.model)
    backend = config.kernel.resolved_backend(device.type)
    dtype = config.model.torch_dtype
    quant = parse_quantization(config.model.hf_config, config.model.quantization)
    path = config.model.model_path
    if is_s3_uri(config.model.model):  # this node's copy, the weights fetched now if missing
        path = str(mirror_checkpoint(config.model.model))
    headers = checkpoint_headers(path)
    mxfp4 = None
    if quant is not None and quant.method == "mxfp4":  # checked before anything is placed
        shapes = {n: (h["dtype"], tuple(h["shape"])) for n, h in headers.items()}
        mxfp4 = mxfp4_weights(config.model.hf_config, shapes)
    keep_on = keep_quantized_on(quant, device)
    # Weights that stay quantized never exist dense: the linear layers get meta placeholders.
    placeholders = meta_linear_weights() if keep_on is not None else contextlib.nullcontext()
    with torch.device(device), _default_dtype(dtype), placeholders:
        model = model_class(config.model.hf_config, ctx, ops=get_kernel_ops(backend))
    timeline.mark("model build")
    canonical = _canonical_name(model, headers)
    tensor_bytes = {canonical(name): _nbytes(info) for name, info in headers.items()}
    quantized: QuantizedCheckpoint | Mxfp4Checkpoint | None = None
    if mxfp4 is not None:
        params = {name for name, _ in model.named_parameters()}
        kept = any(f"{weight}_blocks" in params for weight in mxfp4)
        quantized = Mxfp4Checkpoint(config.model.hf_config, kept, dtype)
    elif quant is not None:
        quantized = quantized_checkpoint(
            model, quant, set(tensor_bytes), _target_of(model), keep_on
        )
        if keep_on is not None:
            with _default_dtype(dtype):
                materialize_dense_linears(model, quantized, _target_of(model))
    rename = quantized.weight_name if quantized is not None else str
    shares = rank_read_bytes(model, tensor_bytes, config.model.hf_config, rename)
    meter = LoadMeter(config.parallel.rank, sum(shares.values()), progress)
    show_bar = ctx.tp.rank == 0 and ctx.pp.rank == 0
    # Only tensors this rank reads in full are read ahead; a shard stays a lazy slice.
    whole = {name for name, info in headers.items() if shares[canonical(name)] == _nbytes(info)}
    read = iterate_checkpoint(path, progress=show_bar, read_whole=whole.__contains__)
    weights = meter.wrap(((canonical(name), tensor) for name, tensor in read), shares)
    if quantized is not None:
        weights = quantized.transform(weights)
    load_weights(model, weights, hf_config=config.model.hf_config)
    meter.finish()
    timeline.mark("weights read")
    if quantized is not None:
        quantized.attach_activation_quant(model, _target_of(model))
        if keep_on is not None:
            release_placeholders(model, dtype)
    model.eval()
    if device.type == "cpu":
        packed = pack_linear_weights(model)
        experts = pack_expert_weights(model)
        logger.debug("packed %d linear weights and %d expert layers for oneDNN", packed, experts)
        timeline.mark("oneDNN repack")
    return model
