"""``cluster plan CONFIG``: whether each model of a deployment fits its GPUs, decided before
anything is placed; and ``preflight``, the same check as the first thing ``cluster deploy`` does.

Per model: the checkpoint's ``config.json`` (a local ``model_source``, or a built-in) and the
engine arguments go through ``engine.worker.memory_plan``; one GPU's memory comes from the model's
``accelerator_type`` (``GPU_MEMORY_GIB``) or ``--gpu-memory-gib``. A checkpoint that is not on
this machine (``/models/...`` that only the GPU nodes mount) is skipped, not refused: its
replicas check it when they start (``cluster.serving.start_errors``). A disaggregated model is
planned per pool (``ModelDeployment.pools``: its prefill and decode pools, each with its own
engine arguments over the model's), reported as ``m (prefill)`` and ``m (decode)``. Ray-free and
torch-free (a built-in model source imports the engine's tiny-model writer, which needs torch).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cluster.config import DeploymentConfig, ModelDeployment, _build
from cluster.config import deployment as deployment_config
from cluster.config.strict_yaml import load_yaml_file
from engine.errors import ConfigError
from engine.kv_transfer.config import KVTransferConfig
from engine.s3_mirror import mirror_checkpoint
from engine.s3_store import is_s3_uri
from engine.worker.memory_plan import MemoryPlan, plan_memory
from engine.worker.memory_plan_estimates import GiB, PlanSettings

# One GPU's memory by Ray's accelerator type name (``ray.util.accelerators``), in GiB as
# ``torch.cuda.mem_get_info`` reports the total: the HBM less what the driver keeps, e.g.
# 79.19 GiB for an "80 GB" H100 (vLLM logs "total_gpu_memory=79.19GiB"). Figures from
# published torch / vLLM logs, within ~0.5 GiB; an ambiguous name takes its smallest part;
# ``--gpu-memory-gib`` overrides.
GPU_MEMORY_GIB: dict[str, float] = {
    "T4": 14.75,  # 16 GB GDDR6
    "V100": 15.77,  # the 16 GB part (a 32 GB one exists: pass --gpu-memory-gib 31.74)
    "A10G": 22.07,  # 24 GB GDDR6
    "L4": 22.03,  # 24 GB GDDR6
    "L40S": 44.39,  # 48 GB GDDR6
    "A100": 39.39,  # ambiguous: the 40 GB part
    "A100-40G": 39.39,
    "A100-80G": 79.15,
    "H100": 79.19,  # 80 GB HBM3 (SXM and PCIe)
    "H20": 94.99,  # 96 GB HBM3
    "H200": 139.81,  # 141 GB HBM3e
    "B200": 178.35,  # 180 GB HBM3e (as the B200 reports it; 192 GB on paper)
    "RTX-PRO-6000": 94.97,  # 96 GB GDDR7
}


class PlanError(ConfigError):
    """Some model of the deployment cannot fit: ``problems`` maps each such model's id (a
    disaggregated model's pool: ``m (prefill)``) to every reason, each naming its numbers.
    Raised before anything is placed."""

    def __init__(self, problems: dict[str, list[str]]) -> None:
        lines = [f"model {model!r}: {'; '.join(reasons)}" for model, reasons in problems.items()]
        super().__init__("refused before anything was placed: " + " | ".join(lines))
        self.problems = problems

    def __reduce__(self) -> tuple[type[PlanError], tuple[dict[str, list[str]]]]:
        return type(self), (self.problems,)


def pool_name(model_id: str, role: str | None) -> str:
    """How reports name one of a model's Serve deployments (``ModelDeployment.pools``): the
    model id, with the pool's role for a disaggregated model (``m (prefill)``)."""
    return model_id if role is None else f"{model_id} ({role})"


@dataclass(frozen=True)
class ModelPlan:
    """One model of the deployment (or one pool of a disaggregated model: ``role``): its plan,
    or why there is none (``skipped``)."""

    model_id: str
    model_source: str
    accelerator_type: str | None
    gpu_memory_gib: float | None
    gpu_memory_from: str | None  # "accelerator_type H100", "--gpu-memory-gib", or None
    plan: MemoryPlan | None
    skipped: str | None = None
    hf_config_from: str | None = None  # where config.json was read (the cache, --hf-config)
    kv_store: KVTransferConfig | None = None  # kv_transfer_config, when the model has one
    # The fraction of one device each replica asks for (placement_group_config.bundles), or 1.
    device_share: float = 1.0
    role: str | None = None  # "prefill" or "decode" for a disaggregated model's pool

    @property
    def name(self) -> str:
        return pool_name(self.model_id, self.role)

    @property
    def problems(self) -> tuple[str, ...]:
        return self.plan.problems if self.plan is not None else ()

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "role": self.role,
            "model_source": self.model_source,
            "accelerator_type": self.accelerator_type,
            "gpu_memory_gib": self.gpu_memory_gib,
            "gpu_memory_from": self.gpu_memory_from,
            "fits": self.fits,
            "skipped": self.skipped,
            "hf_config_from": self.hf_config_from,
            "kv_store": asdict(self.kv_store) if self.kv_store is not None else None,
            "device_share": self.device_share,
            "plan": self.plan.to_dict() if self.plan is not None else None,
        }


@dataclass(frozen=True)
class DeploymentPlan:
    models: tuple[ModelPlan, ...]

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.models)

    def problems(self) -> dict[str, list[str]]:
        return {m.name: list(m.problems) for m in self.models if m.problems}

    def to_dict(self) -> dict[str, Any]:
        return {"fits": self.fits, "models": [m.to_dict() for m in self.models]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format_text(self) -> str:
        return "\n\n".join(format_model(m) for m in self.models)


def load_unchecked(path: str) -> DeploymentConfig | None:
    """The deployment YAML built with its structure checked but not its engine arguments
    against the checkpoint (``load_config`` refuses what the engine refuses, which a plan
    reports as its problems instead); None when even the structure is wrong."""
    try:
        return _build(DeploymentConfig, load_yaml_file(path), "")
    except (ConfigError, OSError):
        return None


def gpu_memory_gib_for(accelerator_type: str | None) -> float | None:
    """One GPU's memory for a Ray accelerator type name (case-insensitive), None if unknown."""
    if not accelerator_type:
        return None
    by_upper = {name.upper(): gib for name, gib in GPU_MEMORY_GIB.items()}
    return by_upper.get(accelerator_type.upper())


def read_hf_config(source: str, model_id: str | None = None) -> tuple[dict[str, Any], str] | None:
    """The checkpoint's config.json and where it was read, or None when it is not on this
    machine: ``source``'s own, else (for a hub-style ``model_id``) the copy in the local
    Hugging Face cache, which is only read, never fetched."""
    if source.startswith("builtin:"):
        from engine.builtin.catalog import resolve_model_source

        path: Path | None = resolve_model_source(source) / "config.json"
    elif is_s3_uri(source):  # config.json copied from the store, no weights
        path = mirror_checkpoint(source, weights=False, field="model_source") / "config.json"
    else:
        path = Path(source).expanduser() / "config.json"
        # The same test as the config's own engine-argument check: a checkpoint it cannot
        # see here is one its replicas check when they start.
        if not deployment_config._checkpoint_reachable(source):
            path = _hub_cache_config(model_id) if model_id else None
            if path is None:
                return None
    return read_config_json(path), str(path)


def read_config_json(path: Path, what: str = "model_source") -> dict[str, Any]:
    """A config.json as a dict; a ConfigError naming ``what`` gave the path otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{what}: {path} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} is not a JSON object")
    return data


def _hub_cache_config(model_id: str) -> Path | None:
    """``config.json`` of ``model_id`` ("org/name") in the local Hugging Face hub cache
    (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub): the snapshot
    ``refs/main`` names, else any snapshot that has one."""
    if model_id.count("/") != 1:
        return None
    hub = os.environ.get("HF_HUB_CACHE") or str(
        Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    )
    repo = Path(hub).expanduser() / ("models--" + model_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    candidates = []
    if ref.is_file():
        candidates.append(repo / "snapshots" / ref.read_text().strip() / "config.json")
    candidates += sorted((repo / "snapshots").glob("*/config.json"))
    return next((c for c in candidates if c.is_file()), None)


def plan_model(
    model: ModelDeployment,
    gpu_memory_gib: float | None = None,
    hf_config: dict[str, Any] | None = None,
    role: str | None = None,
) -> ModelPlan:
    """The plan of one model's replica; ``gpu_memory_gib`` overrides its accelerator type and
    ``hf_config`` its checkpoint's config.json (``cluster plan --hf-config``: plan on a machine
    that lacks the checkpoint). ``role``: ``model`` is that pool of a disaggregated model
    (``ModelDeployment.pools``)."""
    device = "cuda" if model.uses_gpu else "cpu"
    gib, origin = None, None
    if device == "cuda":
        if gpu_memory_gib is not None:
            gib, origin = float(gpu_memory_gib), "--gpu-memory-gib"
        else:
            gib = gpu_memory_gib_for(model.accelerator_type)
            origin = f"accelerator_type {model.accelerator_type}" if gib is not None else None
    source = model.model_loading_config.source
    unit = "GPU" if device == "cuda" else "CPU"
    common = {
        "device_share": model.placement_group_config.device_share(unit),
        "model_id": model.model_id,
        "model_source": source,
        "accelerator_type": model.accelerator_type,
        "gpu_memory_gib": gib,
        "gpu_memory_from": origin,
        "role": role,
    }
    found = (
        (hf_config, "--hf-config")
        if hf_config is not None
        else read_hf_config(source, model.model_id)
    )
    if found is None:
        skipped = (
            f"{source}/config.json is not on this machine, nor {model.model_id!r} in the local "
            "Hugging Face cache: not planned (the replicas check the checkpoint when they "
            f"start; plan it here with --hf-config {model.model_id}=PATH/config.json)"
        )
        return ModelPlan(**common, plan=None, skipped=skipped)
    hf, config_from = found
    settings = PlanSettings.from_engine_kwargs(model.engine_args(), device)
    plan = plan_memory(hf, settings, int(gib * GiB) if gib is not None else None)
    if device == "cuda" and gib is None:
        named = model.accelerator_type
        why = (
            f"accelerator_type {named!r} has no known memory size"
            if named
            else "no accelerator_type is set"
        )
        notes = tuple(
            f"{n} ({why}; pass --gpu-memory-gib)" if n.startswith("GPU memory unknown") else n
            for n in plan.notes
        )
        plan = replace(plan, notes=notes)
    kv_store = KVTransferConfig.from_arg(model.engine_kwargs.get("kv_transfer_config"))
    return ModelPlan(**common, plan=plan, hf_config_from=config_from, kv_store=kv_store)


def plan_deployment(
    config: DeploymentConfig,
    gpu_memory_gib: float | None = None,
    hf_configs: dict[str, dict[str, Any]] | None = None,
) -> DeploymentPlan:
    """Every model's plan (a disaggregated model's: one per pool); ``gpu_memory_gib`` (one
    GPU's memory) overrides every model's accelerator type, ``hf_configs`` (by model id) their
    checkpoints' config.json."""
    if gpu_memory_gib is not None and not gpu_memory_gib > 0:
        raise ConfigError(f"gpu_memory_gib: must be > 0, got {gpu_memory_gib!r}")
    hf_configs = hf_configs or {}
    unknown = sorted(set(hf_configs) - {m.model_id for m in config.models})
    if unknown:
        ids = ", ".join(repr(m.model_id) for m in config.models)
        raise ConfigError(f"hf_config: no model {unknown[0]!r} in the config (models: {ids})")
    return DeploymentPlan(
        tuple(
            plan_model(pool, gpu_memory_gib, hf_configs.get(m.model_id), role)
            for m in config.models
            for role, pool in m.pools()
        )
    )


def preflight(config: DeploymentConfig, gpu_memory_gib: float | None = None) -> DeploymentPlan:
    """Raise ``PlanError`` naming every model that cannot fit and every reason; returns the
    plan otherwise. Touches no cluster."""
    plan = plan_deployment(config, gpu_memory_gib)
    problems = plan.problems()
    if problems:
        raise PlanError(problems)
    return plan


# ---- the text report ---------------------------------------------------------------------------


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def format_model(model: ModelPlan) -> str:
    verdict = "not planned" if model.plan is None else "fits" if model.fits else "REFUSED"
    lines = [f"{model.name}: {verdict}"]
    plan = model.plan
    if plan is None:
        lines.append(f"  {model.skipped}")
        return "\n".join(lines)
    dp = plan.data_parallel_size
    devices = plan.tensor_parallel_size * plan.pipeline_parallel_size * dp
    unit = "GPU" if plan.device == "cuda" else "CPU worker"
    shape = f"TP {plan.tensor_parallel_size} x PP {plan.pipeline_parallel_size}"
    if dp > 1:
        shape = f"DP {dp} x {shape}"
    lines.append(
        f"  {model.model_source}: {plan.architecture}, {plan.dtype}, max_model_len "
        f"{plan.max_model_len}, {shape} = {devices} {unit}{'s' if devices > 1 else ''} "
        "per replica"
    )
    own = str(Path(model.model_source).expanduser() / "config.json")
    if model.hf_config_from not in (None, own) and not model.model_source.startswith("builtin:"):
        lines.append(f"  config.json from {model.hf_config_from}")
    if plan.device == "cuda" and plan.gpu_memory_bytes is not None:
        lines.append(
            f"  GPU memory {_size(plan.gpu_memory_bytes)} ({model.gpu_memory_from}), usable "
            f"{_size(plan.usable_gpu_bytes)} at gpu_memory_utilization "
            f"{plan.gpu_memory_utilization}"
        )
    if model.device_share < 1:
        device = unit.split()[0]
        memory = ", each within its gpu_memory_utilization of the memory" if device == "GPU" else ""
        lines.append(
            f"  {model.device_share:g} of a {device} per replica (placement_group_config."
            f"bundles): replicas share a {device} while their shares sum to at most 1 "
            f"({int(1 // model.device_share)} of these){memory}"
        )
    if plan.stages:
        lines.extend(_stage_table(plan))
        lines.append(_kv_summary(plan))
        lines.extend(_kv_group_lines(plan))
        if model.kv_store is not None:
            lines.append(_kv_store_line(plan, model.kv_store))
        if plan.device == "cuda":
            lines.append(
                f"  ~ estimates: activation = one step of max_num_batched_tokens "
                f"{plan.max_num_batched_tokens} tokens (+ logits of {plan.max_num_seqs} rows "
                "on the last stage); reserves = CUDA context, NCCL, CUDA-graph pool"
            )
    lines.extend(f"  note: {note}" for note in plan.notes)
    lines.extend(f"  problem: {problem}" for problem in plan.problems)
    return "\n".join(lines)


def _stage_table(plan: MemoryPlan) -> list[str]:
    per = "per GPU" if plan.device == "cuda" else "per worker"
    header = ["weights", "buffers", "LoRA", "activation~", "reserves~", "KV/token", "KV blocks"]
    rows = []
    for s in plan.stages:
        label = f"stage {s.pp_rank} ({s.num_layers} layers, {s.first_layer}-{s.end_layer - 1})"
        if plan.tensor_parallel_size > 1:
            label += f" x{plan.tensor_parallel_size}"
        rows.append(
            [
                label,
                _size(s.weight_bytes),
                _size(s.buffer_bytes),
                _size(s.lora_bytes) if s.lora_bytes else "-",
                _size(s.activation_bytes) if plan.device == "cuda" else "-",
                _size(s.reserve_bytes) if plan.device == "cuda" else "-",
                _size(s.kv_bytes_per_token),
                "-" if s.kv_blocks is None else f"{s.kv_blocks:,}",
            ]
        )
    # Columns that say nothing for this device (CPU: no activation or reserves) are left out.
    keep = [i for i in range(len(header)) if any(r[i + 1] != "-" for r in rows)]
    header = [header[i] for i in keep]
    rows = [[r[0], *(r[i + 1] for i in keep)] for r in rows]
    width = max(len(per), *(len(r[0]) for r in rows))
    cols = [max(len(h), *(len(r[i + 1]) for r in rows)) for i, h in enumerate(header)]
    out = ["  " + per.ljust(width) + "  " + "  ".join(h.rjust(c) for h, c in zip(header, cols))]
    for r in rows:
        out.append(
            "  " + r[0].ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(r[1:], cols))
        )
    return out


def _kv_group_lines(plan: MemoryPlan) -> list[str]:
    """One line per KV cache group when sliding-window layers hold only their window."""
    if len(plan.kv_groups) <= 1:
        return []
    lines = []
    for g in plan.kv_groups:
        kind = "full attention" if g.sliding_window is None else f"window {g.sliding_window}"
        blocks = "-" if g.blocks is None else f"{g.blocks:,} blocks"
        lines.append(
            f"    KV cache group ({kind}): {g.num_layers} layers, "
            f"{_size(g.bytes_per_token)}/token, {blocks}"
        )
    return lines


def _kv_store_line(plan: MemoryPlan, kv: KVTransferConfig) -> str:
    """The node's KV store (``kv_transfer_config``): where, how large, and how many of this
    model's blocks it holds (a block: every worker's shard of it, K and V of every layer);
    NixlConnector has no store: the block size and how long unread blocks are held."""
    tp = plan.tensor_parallel_size
    block_bytes = sum(s.kv_bytes_per_token for s in plan.stages) * tp * plan.block_size
    if kv.kv_connector == "NixlConnector":
        return (
            f"  KV transfer (NixlConnector, {kv.kv_role}): blocks of {_size(block_bytes)} read "
            f"from the prefill engine's KV cache with NIXL; unread ones held at most "
            f"{kv.abort_request_timeout_s:g} s"
        )
    held = kv.max_storage_bytes // block_bytes if block_bytes else 0
    return (
        f"  KV store ({kv.kv_connector}, {kv.kv_role}): {kv.shared_storage_path}, up to "
        f"{_size(kv.max_storage_bytes)}, shared by the node's replicas: {held:,} blocks "
        f"({held * plan.block_size:,} prompt tokens) of {_size(block_bytes)}"
    )


def _kv_summary(plan: MemoryPlan) -> str:
    tokens = plan.kv_tokens
    if tokens is None:
        return "  KV cache: unknown without the GPU's memory"
    where = "GPU" if plan.device == "cuda" else "worker"
    blocks = f"{plan.kv_blocks:,} blocks of {plan.block_size}, the fewest of any {where}"
    if len(plan.kv_groups) > 1:
        blocks = (
            f"the full-attention group's {tokens // plan.block_size:,} blocks of "
            f"{plan.block_size}, from {plan.kv_blocks:,} of every layer, the fewest of any {where}"
        )
    if plan.data_parallel_size > 1:
        return (
            f"  KV cache per engine core ({plan.data_parallel_size} per replica, each on its "
            f"own TP group): {tokens:,} tokens ({blocks}); longest sequence {tokens:,} tokens; "
            f"{plan.max_concurrent_sequences:,} sequence(s) of max_model_len "
            f"{plan.max_model_len} at once per replica"
        )
    return (
        f"  KV cache per replica: {tokens:,} tokens ({blocks}); longest sequence {tokens:,} "
        f"tokens; {plan.max_concurrent_sequences:,} sequence(s) of max_model_len "
        f"{plan.max_model_len} at once"
    )
