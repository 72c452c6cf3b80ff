"""Multi-LoRA serving: the request type, adapter validation on the head, the slot table that
says which adapter each of the ``max_loras`` device slots holds, and the workers' loader.

    add_request(lora_request) ── head: read + check adapter_config.json and the tensor shapes
                                 (cached, LRU of max_cpu_loras) ── InvalidRequestError if bad
    schedule ── at most max_loras distinct adapters among running requests
    step ── LoRASlotTable.assign: adapters of this step's requests -> slots (LRU reuse);
            changed slots travel in ExecuteModelRequest.lora_slots (slot -> id, path)
    worker ── WorkerLoRAManager: reads each changed adapter from disk, its shard only, into
              the slot (an id whose files changed since it was read: an error, never other
              weights under it); per-token slot indices each step (-1: base model)

PEFT's checkpoint layout: ``adapter_config.json`` (r, lora_alpha, use_rslora, target_modules)
and ``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r]; the delta is ``B A x * scaling``, scaling = alpha / r (alpha /
sqrt(r) with use_rslora).
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine.errors import InvalidRequestError
from engine.lora_request import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterFiles,
    LoRARequest,
    adapter_files,
)
from engine.worker.step_messages import LoRASlotSpec
from llm_kernels.lora import LoRAMapping, add_lora
from parallel.lora import LinearLoRA, LoRABatch, attach_lora

# HF module name -> (our fused module, its shard id); the decoder projections LoRA may target.
# A checkpoint that fuses them (Phi-3's qkv_proj, gate_up_proj) has adapters on the fused
# module: one A, and a B over all its parts (shard id None).
TARGET_MODULES: dict[str, tuple[str, Any]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "qkv_proj": ("qkv_proj", None),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", None),
}
LORA_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
# A decoder's layers: ``model.layers.N`` (a causal LM), or a VLM's language model
# (``model.language_model.layers.N``; older transformers ``language_model.model.layers.N``).
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.language_model\.|language_model\.model\.|model\.)"
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_PARAM = "lora_request"
# PEFT initialisations that subtract the initial adapter from the base weights at load
# (PiSSA, CorDA, OLoRA, LoftQ): served on the unchanged base, the adapter is wrong. (LoRA-GA's
# loads as a plain adapter: without its gradients PEFT initialises it as Gaussian, base intact.)
_BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq")
# How many adapter ids a worker remembers the files of (far more than ever share a batch).
_MAX_READ_IDS = 1024
# PEFT's LoRA variants whose forward is not plain ``B A x * scaling`` (weights of their own, a
# block-diagonal or pooled product, routing), refused by name before any weight is looked at
# (DoRA, bias and the others that are one field: the ``unsupported`` table below).
_VARIANTS = {
    "use_qalora": "QALoRA",
    "use_bdlora": "BD-LoRA",
    "kasa_config": "KaSA",
    "use_kasa": "KaSA",
    "monteclora_config": "MonteCLoRA",
    "arrow_config": "Arrow",
}


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter: its rank and scaling, and the HF modules (q_proj, ...) it targets."""

    path: str
    rank: int
    scaling: float
    modules: frozenset[str]


def _fail(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=_PARAM)


def _module_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) of each targetable projection of the base model."""
    hidden, inter = int(hf["hidden_size"]), int(hf["intermediate_size"])
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "qkv_proj": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
    }


def read_adapter_config(path: Path, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from ``adapter_config.json``; raises ``InvalidRequestError`` naming the
    problem for anything this engine cannot serve exactly."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise _fail(f"the adapter directory has no {CONFIG_FILE} (not a PEFT adapter?)")
    try:
        config = json.loads(file.read_text())
    except OSError as exc:
        raise _fail(f"{CONFIG_FILE} cannot be read: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise _fail(f"{CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(f"peft_type {peft_type!r} is not supported (only LORA)")
    for key, variant in _VARIANTS.items():
        if config.get(key):
            raise _fail(f"{CONFIG_FILE}: {key}: not supported ({variant} is not served)")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _fail(f"adapter rank r={rank} exceeds max_lora_rank ({max_rank})")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _fail(f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    unsupported = {
        "use_dora": config.get("use_dora"),
        "fan_in_fan_out": config.get("fan_in_fan_out"),
        "modules_to_save": config.get("modules_to_save"),
        "rank_pattern": config.get("rank_pattern"),
        "alpha_pattern": config.get("alpha_pattern"),
        "lora_bias": config.get("lora_bias"),
        "layer_replication": config.get("layer_replication"),
        "target_parameters": config.get("target_parameters"),
        "trainable_token_indices": config.get("trainable_token_indices"),
        "alora_invocation_tokens": config.get("alora_invocation_tokens"),
    }
    for key, value in unsupported.items():
        if value:
            raise _fail(f"{CONFIG_FILE}: {key}={value!r} is not supported")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise _fail(
            f"{CONFIG_FILE}: init_lora_weights={init!r} is not supported: PEFT rewrites the base "
            "model's weights when it loads such an adapter (save it converted, with PEFT's "
            "path_initial_model_for_weight_conversion)"
        )
    if config.get("bias", "none") != "none":
        raise _fail(f"{CONFIG_FILE}: bias={config['bias']!r} is not supported (only 'none')")
    # target_modules is not checked: the weights are (``_parse_key``), as vLLM does. PEFT skips a
    # listed module the base model lacks, and saves weights for every module it adapted.
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def load_adapter(path_str: str, hf_config: dict[str, Any], max_rank: int) -> LoRAAdapter:
    """Check an adapter against the base model without loading its weights (shapes only)."""
    path = Path(path_str).expanduser()
    if not path.is_dir():
        raise _fail("lora_path is not a directory")
    rank, scaling = read_adapter_config(path, max_rank)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise _fail(f"the adapter has no {WEIGHTS_FILE} (only safetensors adapters are read)")
    shapes = _module_shapes(hf_config)
    num_layers = int(hf_config["num_hidden_layers"])
    seen: dict[tuple[int, str], set[str]] = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                layer, module, ab = _parse_key(key, num_layers)
                _check_shape(key, module, ab, tuple(f.get_slice(key).get_shape()), rank, shapes)
                seen.setdefault((layer, module), set()).add(ab)
    except InvalidRequestError:
        raise
    except OSError as exc:  # (its message would name the file's path)
        raise _fail(f"{WEIGHTS_FILE} cannot be read: {exc.strerror}") from None
    except Exception as exc:  # a truncated or foreign file: safetensors' own error
        raise _fail(f"{WEIGHTS_FILE} cannot be read: {exc}") from None
    if not seen:
        raise _fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    for (layer, module), parts in seen.items():
        if parts != {"A", "B"}:
            raise _fail(f"layer {layer} {module}: lora_A and lora_B must both be present")
        fused, shard_id = TARGET_MODULES[module]
        if shard_id is not None and (layer, fused) in seen:
            raise _fail(f"layer {layer}: {module} and {fused} (which holds it) both have weights")
    return LoRAAdapter(str(path), rank, scaling, frozenset(m for _, m in seen))


def _parse_key(key: str, num_layers: int) -> tuple[int, str, str]:
    match = _KEY.match(key)
    if match is None:
        raise _fail(
            f"weight {key!r} is not supported: only the decoder projections "
            f"({', '.join(TARGET_MODULES)}) may carry LoRA weights"
        )
    layer, module, ab = int(match.group(1)), match.group(2), match.group(3)
    if module not in TARGET_MODULES:
        raise _fail(f"target module {module!r} is not supported ({key})")
    if layer >= num_layers:
        raise _fail(f"weight {key!r} is for layer {layer}; the base model has {num_layers}")
    return layer, module, ab


def _check_shape(
    key: str,
    module: str,
    ab: str,
    shape: tuple[int, ...],
    rank: int,
    shapes: dict[str, tuple[int, int]],
) -> None:
    out_f, in_f = shapes[module]
    want = (rank, in_f) if ab == "A" else (out_f, rank)
    if shape != want:
        raise _fail(
            f"weight {key!r} has shape {list(shape)}, the base model's {module} with r={rank} "
            f"needs {list(want)} (an adapter for another model?)"
        )


class LoRARegistry:
    """Head side: checked adapters by ``lora_int_id``, least recently used evicted beyond
    ``max_cpu_loras``. One id names one adapter: a request that reuses a live id for another
    name or path is refused; one with ``load_inplace`` checks its files again (refused if they
    changed since the id was checked)."""

    def __init__(self, hf_config: dict[str, Any], max_rank: int, max_cpu_loras: int) -> None:
        self.hf_config = hf_config
        self.max_rank = max_rank
        self.capacity = max_cpu_loras
        # lora_int_id -> (its request, the checked adapter, its files when checked)
        self._cache: OrderedDict[int, tuple[LoRARequest, LoRAAdapter, AdapterFiles]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._cache)

    def get(
        self,
        lora_request: LoRARequest,
        live: Callable[[], Iterable[LoRARequest]] = tuple,
    ) -> LoRAAdapter:
        """The checked adapter; ``live()`` gives the adapters of requests in flight (an id of
        one of them cannot be rebound, even once the cache has evicted it)."""
        check_lora_request(lora_request)
        lid, identity = lora_request.lora_int_id, lora_request.identity
        cached = self._cache.get(lid)
        if cached is not None and cached[0].identity == identity:
            self._cache.move_to_end(lid)
            if not lora_request.load_inplace:
                return cached[1]
            if adapter_files(lora_request.lora_path) != cached[2]:
                raise _fail(
                    f"load_inplace: the files of lora_int_id {lid} changed since it was loaded; "
                    "new weights need a new lora_int_id (KV blocks are cached under the id)"
                )
        bound = cached[0] if cached is not None else None
        for other in live():
            if other.lora_int_id == lid and other.identity != identity:
                bound = other
        if bound is not None and bound.identity != identity:
            raise _fail(
                f"lora_int_id {lid} already names adapter {bound.lora_name!r} (another name or "
                "path); one id names one adapter"
            )
        files = adapter_files(lora_request.lora_path)
        adapter = load_adapter(lora_request.lora_path, self.hf_config, self.max_rank)
        self._cache[lid] = (lora_request, adapter, files)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return adapter

    def forget(self, lora_int_id: int) -> None:
        """Drop a checked adapter (its files proved unreadable): its next use checks it again."""
        self._cache.pop(lora_int_id, None)


def check_lora_request(lora_request: Any) -> None:
    if not isinstance(lora_request, LoRARequest):
        raise _fail(f"must be a LoRARequest, got {type(lora_request).__name__}")
    lid = lora_request.lora_int_id
    if not isinstance(lid, int) or isinstance(lid, bool) or lid < 1:
        raise _fail(f"lora_int_id must be a positive integer, got {lid!r}")
    if not isinstance(lora_request.lora_name, str) or not lora_request.lora_name:
        raise _fail("lora_name must be a non-empty string")
    if not isinstance(lora_request.lora_path, str) or not lora_request.lora_path:
        raise _fail("lora_path must be a non-empty string (a local PEFT adapter directory)")
    if not isinstance(lora_request.load_inplace, bool):
        raise _fail(f"load_inplace must be a boolean, got {lora_request.load_inplace!r}")
    base = lora_request.base_model_name
    if base is not None and not isinstance(base, str):
        raise _fail(f"base_model_name must be a string or None, got {base!r}")


class LoRASlotTable:
    """Head side: which adapter each device slot holds. ``assign`` gives every adapter of a
    step a slot, keeping those already resident and reusing the least recently used slot not
    needed by this step; it returns the slots whose adapter changed (for the step message)."""

    def __init__(self, num_slots: int) -> None:
        self.specs: list[LoRASlotSpec | None] = [None] * num_slots
        self._last_used = [-1] * num_slots
        self._step = 0

    def assign(self, adapters: dict[int, str]) -> dict[int, LoRASlotSpec]:
        """``adapters``: lora_int_id -> path of this step's requests (at most num_slots)."""
        if len(adapters) > len(self.specs):
            raise RuntimeError(
                f"{len(adapters)} adapters in one step but only {len(self.specs)} slots "
                "(the scheduler must cap them at max_loras)"
            )
        self._step += 1
        missing = []
        for lid, path in adapters.items():
            slot = self.slot_of(lid, path)
            if slot is None:
                missing.append(LoRASlotSpec(lora_int_id=lid, lora_path=path))
            else:
                self._last_used[slot] = self._step
        changes: dict[int, LoRASlotSpec] = {}
        for spec in missing:
            # An id rebound to another path: its old slot is stale (workers map an id to one slot).
            self.forget(spec.lora_int_id)
            slot = min(
                (s for s in range(len(self.specs)) if self._last_used[s] < self._step),
                key=lambda s: (self.specs[s] is not None, self._last_used[s]),
            )
            self.specs[slot] = spec
            self._last_used[slot] = self._step
            changes[slot] = spec
        return changes

    def forget(self, lora_int_id: int) -> None:
        """Empty the slot holding ``lora_int_id`` (rebound to another path, or a worker could
        not load it there)."""
        for slot, held in enumerate(self.specs):
            if held is not None and held.lora_int_id == lora_int_id:
                self.specs[slot] = None

    def slot_of(self, lora_int_id: int, path: str) -> int | None:
        for slot, spec in enumerate(self.specs):
            if spec is not None and spec.lora_int_id == lora_int_id and spec.lora_path == path:
                return slot
        return None


class WorkerLoRAManager:
    """Worker side: the model's LoRA layers, the adapter in each slot, and the per-step token
    -> slot mapping. An adapter is read from disk when its slot changes, each layer taking only
    its shard (as the model weights are loaded). One id, one set of weights: an id read again
    (its slot was reused meanwhile) whose files changed since is a load error, so its requests
    end rather than go on with other weights (or leave such KV blocks under the id)."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, batch: LoRABatch) -> None:
        self.batch = batch
        self.layers: dict[str, LinearLoRA] = attach_lora(
            model, LORA_MODULES, num_slots, max_rank, batch
        )
        self.max_rank = max_rank
        self.slot_of: dict[int, int] = {}
        # lora_int_id -> its files when this worker read them (most recent last, bounded).
        self._files: OrderedDict[int, AdapterFiles] = OrderedDict()

    def apply_slot_changes(self, changes: dict[int, LoRASlotSpec]) -> dict[int, str]:
        """Load each changed slot's adapter; returns lora_int_id -> error for those that could
        not be read (their slot stays empty: their tokens run on the base model)."""
        errors: dict[int, str] = {}
        for slot, spec in changes.items():
            for lid, held in list(self.slot_of.items()):
                if held == slot:
                    del self.slot_of[lid]
            for layer in self.layers.values():
                layer.clear_slot(slot)
            try:
                self._check_unchanged(spec)
                self._load(slot, Path(spec.lora_path))
            except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
                for layer in self.layers.values():
                    layer.clear_slot(slot)
                self._files.pop(spec.lora_int_id, None)  # (its next use starts afresh)
                errors[spec.lora_int_id] = f"adapter at {spec.lora_path!r} cannot be loaded: {exc}"
                continue
            self.slot_of[spec.lora_int_id] = slot
        return errors

    def _check_unchanged(self, spec: LoRASlotSpec) -> None:
        files = adapter_files(spec.lora_path)
        read = self._files.setdefault(spec.lora_int_id, files)
        self._files.move_to_end(spec.lora_int_id)
        if read != files:
            raise ValueError("its files changed since this id was read (new files need a new id)")
        while len(self._files) > _MAX_READ_IDS:
            self._files.popitem(last=False)

    def _load(self, slot: int, path: Path) -> None:
        _, scaling = read_adapter_config(path, self.max_rank)
        pairs: dict[tuple[str, Any], dict[str, Any]] = {}
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                match = _KEY.match(key)
                if match is None:
                    raise ValueError(f"{path}: unsupported LoRA weight {key!r}")
                layer, module, ab = match.group(1), match.group(2), match.group(3)
                fused, shard_id = TARGET_MODULES[module]
                name = f"model.layers.{layer}.{module_parent(module)}.{fused}"
                if name not in self.layers:
                    continue  # a layer of another pipeline stage
                pairs.setdefault((name, shard_id), {})[ab] = f.get_slice(key)
            for (name, shard_id), ab in pairs.items():
                self.layers[name].load_slice(slot, shard_id, ab["A"], ab["B"], scaling)

    def set_token_slots(self, lora_ids: list[int], query_lens: np.ndarray, device: Any) -> None:
        """This step's mapping: each request's tokens use its adapter's slot (-1: none)."""
        slots = np.array([self.slot_of.get(i, -1) if i else -1 for i in lora_ids], np.int32)
        if (slots < 0).all():
            self.batch.mapping = LoRAMapping.empty(device)
            return
        self.batch.mapping = LoRAMapping.build(np.repeat(slots, query_lens), device)


def module_parent(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj") else "mlp"


def lora_kernel(backend: str) -> Any:
    """The add_lora implementation of a kernel backend (``torch`` or ``triton``)."""
    if backend == "triton":
        from llm_kernels import triton_lora

        return triton_lora.add_lora
    return add_lora


def make_worker_lora_manager(
    model: nn.Module, num_slots: int, max_rank: int, backend: str, device: torch.device
) -> WorkerLoRAManager:
    return WorkerLoRAManager(model, num_slots, max_rank, LoRABatch(lora_kernel(backend), device))
