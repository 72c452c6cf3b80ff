"""Every environment variable the project reads, in one place.

Each is read when accessed (not at import), so tests can set them with monkeypatch.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import ConfigError

PP_LAYER_PARTITION = "VLLM_PP_LAYER_PARTITION"


def cache_dir() -> Path:
    """Where built-in models are materialized: ``LLM_CLUSTER_CACHE_DIR``
    (default ~/.cache/llm-cluster)."""
    value = os.environ.get("LLM_CLUSTER_CACHE_DIR")
    if value:
        return Path(value).expanduser()
    return Path.home() / ".cache" / "llm-cluster"


def log_level() -> str:
    """``LLM_CLUSTER_LOG_LEVEL``: level of the ``llm_cluster`` loggers (default INFO)."""
    return os.environ.get("LLM_CLUSTER_LOG_LEVEL", "INFO").upper()


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1`` runs Triton kernels on CPU tensors through the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dist_timeout_s() -> float:
    """``LLM_CLUSTER_DIST_TIMEOUT_S``: bound on rendezvous and on every collective / stage
    transfer, so a dead peer fails a step instead of hanging it (default 120 s)."""
    return float(os.environ.get("LLM_CLUSTER_DIST_TIMEOUT_S", "120"))


def step_timeout_s() -> float:
    """``LLM_CLUSTER_STEP_TIMEOUT_S``: longest the head waits for the workers to finish one
    step (or one control call) before it declares the engine dead (default 300 s)."""
    return float(os.environ.get("LLM_CLUSTER_STEP_TIMEOUT_S", "300"))


def load_timeout_s() -> float:
    """``LLM_CLUSTER_LOAD_TIMEOUT_S``: longest the head waits for the workers in each start-up
    phase (placement, device and process-group set-up, weight loading, KV-cache sizing,
    KV-cache allocation and CUDA-graph capture) before it gives up on the engine (default
    1800 s). Separate from the step timeout: eight workers each reading a 70B model's shard
    from a shared volume take minutes, a step takes seconds."""
    return float(os.environ.get("LLM_CLUSTER_LOAD_TIMEOUT_S", "1800"))


def cpu_keep_quantized() -> bool:
    """``LLM_CLUSTER_CPU_KEEP_QUANTIZED=1``: on CPU, keep a quantized checkpoint's linear
    weights quantized (FP8 / packed int4, as on CUDA) and dequantize them in every matmul
    (``llm_kernels.quant_gemm``'s torch references): less memory, much slower. Default 0: they are
    dequantized once at load."""
    return os.environ.get("LLM_CLUSTER_CPU_KEEP_QUANTIZED", "0") == "1"


def step_profile() -> bool:
    """``LLM_CLUSTER_STEP_PROFILE=1``: the workers' step timers synchronize the device at every
    phase boundary, so per-phase timings include device time (costs throughput; default 0:
    host-side phase times, see ``engine.timing``)."""
    return os.environ.get("LLM_CLUSTER_STEP_PROFILE", "0") == "1"


def pp_pipelining() -> bool:
    """``LLM_CLUSTER_PP_PIPELINING``: with pipeline_parallel_size > 1, keep up to
    pipeline_parallel_size batches in flight so no stage idles while another computes
    (default 1; ``0`` runs one batch at a time, for comparison)."""
    return os.environ.get("LLM_CLUSTER_PP_PIPELINING", "1") != "0"


def pp_layer_partition() -> tuple[int, ...] | None:
    """``VLLM_PP_LAYER_PARTITION`` (vLLM's name): decoder layers per pipeline stage, comma
    separated ("7,5"), used when the ``pp_layer_partition`` engine argument is not given and
    pipeline_parallel_size > 1 (``engine.pp_partition``). Unset or empty: None."""
    value = os.environ.get(PP_LAYER_PARTITION, "").strip()
    if not value:
        return None
    parts = [p.strip() for p in value.split(",")]
    if not all(p.isdecimal() and int(p) > 0 for p in parts):
        raise ConfigError(
            f"{PP_LAYER_PARTITION}: must be positive layer counts separated by commas, one "
            f"per pipeline stage (e.g. '7,5'), got {value!r}"
        )
    return tuple(int(p) for p in parts)


def head_core_process() -> bool:
    """``LLM_CLUSTER_HEAD_CORE_PROCESS=1``: a Serve replica's head runs its engine core in a
    plain child process (``engine.client.core_process``) where the engine keeps its workers
    in-process (TP = PP = 1), instead of on a thread of the head's Ray actor. Default 0: on CPU it
    did not improve both throughput and concurrency-1 TPOT (BENCHMARKS.md, "After delta outputs; the
    engine core in a child process")."""
    return os.environ.get("LLM_CLUSTER_HEAD_CORE_PROCESS", "0") == "1"


# boto3's own settings of an s3:// model's store (boto3 reads them itself, in every process):
# the endpoint and region reach the replicas with the app; credentials never travel in Ray's
# runtime_env (each node's environment, profile or instance role supplies them).
S3_STORE_SETTINGS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION")


def s3_endpoint_url() -> str | None:
    """The S3-compatible store boto3 talks to: ``AWS_ENDPOINT_URL_S3``, else
    ``AWS_ENDPOINT_URL`` (MinIO, Ceph, R2, ...); None: AWS S3 itself."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
