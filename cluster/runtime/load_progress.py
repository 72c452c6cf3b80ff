"""Start-up progress of a model's workers, published to the Ray GCS internal KV so that
``cluster status`` can show, while a replica starts, where each worker is: its phase
(``engine.worker.executor.PHASE_*``) and, while it loads, the weight bytes read of its total.

    worker actor / head (in-process worker)          cluster status (any driver)
    ───────────────────────────────────────          ───────────────────────────
    LoadProgressPublisher ── put ≤ 2/s, ──▶ GCS KV ──▶ read_load_progress(): fresh records
                             heartbeat 5 s   "load-progress:<executor>:<rank>"

One record per worker, written at every phase change, at most every ``MIN_WRITE_INTERVAL_S``
while weights load, and every ``HEARTBEAT_S`` in between (a long KV profile or CUDA-graph
capture writes nothing else), and deleted once the worker is ready or its executor shuts down.
A killed worker cannot delete its record: readers drop records not updated for
``STALE_AFTER_S``. The KV is Ray's private API, so every call is guarded: without it nothing is
published and nothing is read, and loading goes on. This module imports neither Ray nor the
engine (torch) at import time: ``cluster status`` reads through it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

logger = logging.getLogger("llm_cluster.load_progress")

KV_NAMESPACE = "llm-cluster"
KEY_PREFIX = "load-progress:"
MIN_WRITE_INTERVAL_S = 0.5
HEARTBEAT_S = 5.0
STALE_AFTER_S = 30.0


class ProgressStore(Protocol):
    """Where records go: the GCS internal KV (``GcsProgressStore``), a dict in tests."""

    def put(self, key: str, value: str) -> None: ...

    def delete(self, key: str, by_prefix: bool = False) -> None: ...

    def items(self, prefix: str) -> list[tuple[str, str]]: ...


class GcsProgressStore:
    """``ray.experimental.internal_kv`` in ``KV_NAMESPACE``; a failed call is logged, not
    raised (progress must never stop a load)."""

    def put(self, key: str, value: str) -> None:
        self._call("put", lambda kv: kv._internal_kv_put(key, value, namespace=KV_NAMESPACE))

    def delete(self, key: str, by_prefix: bool = False) -> None:
        self._call(
            "delete",
            lambda kv: kv._internal_kv_del(key, del_by_prefix=by_prefix, namespace=KV_NAMESPACE),
        )

    def items(self, prefix: str) -> list[tuple[str, str]]:
        def read(kv: Any) -> list[tuple[str, str]]:
            found = []
            for key in kv._internal_kv_list(prefix, namespace=KV_NAMESPACE):
                value = kv._internal_kv_get(key, namespace=KV_NAMESPACE)
                if value is not None:  # deleted between the listing and the read
                    found.append((_text(key), _text(value)))
            return found

        return self._call("read", read) or []

    @staticmethod
    def _call(what: str, fn: Callable[[Any], Any]) -> Any:
        try:
            from ray.experimental import internal_kv  # private API: guarded here

            if not internal_kv._internal_kv_initialized():
                return None
            return fn(internal_kv)
        except Exception:
            logger.debug("load progress: KV %s failed", what, exc_info=True)
            return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def record_key(executor_id: str, rank: int) -> str:
    return f"{KEY_PREFIX}{executor_id}:{rank}"


class LoadProgressPublisher:
    """Publishes one worker's start-up record (rate-limited, with a heartbeat) until
    ``close``. ``heartbeat_s=None`` runs no heartbeat thread (tests drive ``clock``)."""

    def __init__(
        self,
        model_id: str,
        executor_id: str,
        rank: int,
        node: str,
        *,
        store: ProgressStore | None = None,
        clock: Callable[[], float] = time.time,
        min_interval_s: float = MIN_WRITE_INTERVAL_S,
        heartbeat_s: float | None = HEARTBEAT_S,
    ) -> None:
        self.key = record_key(executor_id, rank)
        self._store = store or GcsProgressStore()
        self._clock = clock
        self._min_interval_s = min_interval_s
        self._heartbeat_s = heartbeat_s
        now = clock()
        self.record: dict[str, Any] = {
            "model_id": model_id,
            "executor_id": executor_id,
            "rank": rank,
            "node": node,
            "phase": "",
            "bytes_read": 0,
            "bytes_total": 0,
            "started_at": now,
            "phase_started_at": now,
            "updated_at": now,
        }
        self._lock = threading.Lock()
        self._written_at = float("-inf")
        self._closed = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def phase(self, phase: str) -> None:
        """Enter ``phase`` (an ``engine.worker.executor.PHASE_*``; written at once)."""
        with self._lock:
            self.record["phase"] = phase
            self.record["phase_started_at"] = self._clock()
            self._write()
        self._start_heartbeat()

    def weights(self, read_bytes: int, total_bytes: int) -> None:
        """Bytes read so far; written when ``MIN_WRITE_INTERVAL_S`` has passed since the last
        write, or when the read is complete."""
        with self._lock:
            self.record["bytes_read"] = read_bytes
            self.record["bytes_total"] = total_bytes
            due = self._clock() - self._written_at >= self._min_interval_s
            if due or read_bytes >= total_bytes:
                self._write()

    def close(self) -> None:
        """Stop the heartbeat and delete the record (the worker is ready, or gone)."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._store.delete(self.key)

    def _write(self) -> None:
        if self._closed:
            return
        now = self._clock()
        self.record["updated_at"] = now
        self._written_at = now
        self._store.put(self.key, json.dumps(self.record))

    def _start_heartbeat(self) -> None:
        if self._heartbeat is not None or self._heartbeat_s is None or self._closed:
            return
        self._heartbeat = threading.Thread(
            target=self._beat, args=(self._heartbeat_s,), name=f"{self.key}", daemon=True
        )
        self._heartbeat.start()

    def _beat(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            with self._lock:
                if self._clock() - self._written_at >= period_s:
                    self._write()


def remove_executor_records(executor_id: str, store: ProgressStore | None = None) -> None:
    """Delete every record of an executor's workers (it shut down; killed workers cannot)."""
    (store or GcsProgressStore()).delete(f"{KEY_PREFIX}{executor_id}:", by_prefix=True)


def read_load_progress(
    store: ProgressStore | None = None,
    now: float | None = None,
    stale_after_s: float = STALE_AFTER_S,
) -> list[dict[str, Any]]:
    """Every fresh record (updated within ``stale_after_s``), by model, executor and rank."""
    now = time.time() if now is None else now
    records = []
    for key, value in (store or GcsProgressStore()).items(KEY_PREFIX):
        try:
            record = json.loads(value)
            fresh = now - float(record["updated_at"]) <= stale_after_s
        except (ValueError, KeyError, TypeError):
            logger.debug("load progress: unreadable record %s", key)
            continue
        if fresh:
            records.append(record)
    records.sort(key=lambda r: (r.get("model_id", ""), r.get("executor_id", ""), r.get("rank")))
    return records


def describe(record: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """A record as ``cluster status`` shows it: rank, node, phase, GiB read / total, %, and
    the seconds since the worker started and since it entered its phase."""
    now = time.time() if now is None else now
    read, total = int(record.get("bytes_read", 0)), int(record.get("bytes_total", 0))
    entry: dict[str, Any] = {
        "rank": record.get("rank"),
        "node": record.get("node"),
        "phase": record.get("phase"),
        "bytes_read": read,
        "bytes_total": total,
        "read_gib": round(read / (1 << 30), 3),
        "total_gib": round(total / (1 << 30), 3),
        "percent": round(100 * read / total, 1) if total else None,
        "seconds": round(now - float(record.get("started_at", now)), 1),
        "phase_seconds": round(now - float(record.get("phase_started_at", now)), 1),
    }
    return entry


__all__ = [
    "HEARTBEAT_S",
    "KEY_PREFIX",
    "MIN_WRITE_INTERVAL_S",
    "STALE_AFTER_S",
    "GcsProgressStore",
    "LoadProgressPublisher",
    "ProgressStore",
    "describe",
    "read_load_progress",
    "record_key",
    "remove_executor_records",
]
