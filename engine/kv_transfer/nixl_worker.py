"""The worker side of ``NixlConnector``: this worker's KV cache registered with its own NIXL
agent once, at allocation (``register``); a decode worker READs a request's prompt blocks from
the prefill workers' registered caches straight into its own blocks (``load``), before the
forward pass, block-granular, re-sharded by KV head:

    cache (per layer): [planes (K, V), blocks, block_size, kv heads, head dim]
    a block's head h:  block_size runs of head_dim values, kv_heads x head_dim apart

A decode worker reads each KV head it holds from a prefill worker of its pipeline stage that
holds that head (``global_kv_heads``: TP 2 -> TP 1 reads half the heads from each rank, TP 1
-> TP 2 half of one rank's). Where both sides hold the same heads, a block of a layer's plane
is one contiguous region, read in place; otherwise the prefill worker's whole blocks go
through a registered staging buffer (``STAGING_BYTES``, a chunk of blocks at a time) and the
heads this worker holds are copied out (one region per token and head would cost NIXL tens
of milliseconds a block). A read that fails (the
prefill engine gone or restarted: its agents are unknown or disconnected) or outlasts
``transfer_timeout_s`` is reported like a missing stored block: the head recomputes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from engine.config import EngineConfig
from engine.kv_transfer.nixl import decode_metadata, encode_metadata, new_agent
from engine.kv_transfer.store import kv_families
from engine.kv_transfer.worker import global_kv_heads

logger = logging.getLogger("llm_cluster.kv_transfer")


# A read between different KV head sets goes through a registered buffer of this size (or
# one block, if larger), a chunk of blocks at a time.
STAGING_BYTES = 64 << 20


def _block_bytes(cache: dict[str, Any]) -> int:
    """One block of one plane of a cache: ``block_size x kv_heads x head_dim`` values."""
    return cache["block_size"] * cache["kv_heads"] * cache["head_dim"] * cache["itemsize"]


def _block_regions(cache: dict[str, Any], blocks: np.ndarray) -> np.ndarray:
    """``[address, length, device]`` rows of these whole blocks of one cache, every plane (in
    plane, then block order). ``cache``: ``NixlWorkerTransfer.metadata``'s description."""
    plane = np.arange(cache["planes"], dtype=np.uint64)[:, None] * np.uint64(cache["num_blocks"])
    starts = cache["address"] + (plane + blocks.astype(np.uint64)[None, :]) * _block_bytes(cache)
    rows = np.zeros((starts.size, 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = starts.reshape(-1), _block_bytes(cache), cache["device"]
    return rows


def _runs(ours: list[int], theirs: list[int]) -> list[tuple[int, int, int]]:
    """(local head, remote head, count) runs of consecutive heads on both sides."""
    runs: list[tuple[int, int, int]] = []
    for o, t in zip(ours, theirs, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == o and runs[-1][1] + runs[-1][2] == t:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((o, t, 1))
    return runs


class NixlWorkerTransfer:
    """``num_model_caches``: how many of the caches this worker passes are the model's (the
    rest are its draft's)."""

    def __init__(
        self, config: EngineConfig, stage: int, tp_rank: int, tp_size: int, num_model_caches: int
    ) -> None:
        kv = config.kv_transfer.kv_transfer_config
        if kv is None:
            raise ValueError("kv_transfer_config: not set")
        self.timeout_s = kv.transfer_timeout_s
        self.stage, self.tp_rank, self.tp_size = stage, tp_rank, tp_size
        self.num_model_caches = num_model_caches
        self.totals = dict(kv_families(config))
        self.agent = new_agent(f"{config.kv_transfer.engine_id}/{stage}.{tp_rank}")
        self._registered: Any = None
        self._staging: torch.Tensor | None = None
        self._staging_registered: Any = None
        self._caches: list[dict[str, Any]] = []
        self._remote_agents: set[str] = set()
        self.mem_type = "DRAM"

    def _family(self, index: int) -> str:
        return "t" if index < self.num_model_caches else "d"

    def register(self, caches: list[torch.Tensor]) -> None:
        """Register the (new) caches with this worker's agent, dropping the old ones."""
        if self._registered is not None:
            self.agent.deregister_memory(self._registered)
        self._registered = self.agent.register_memory(caches) if caches else None
        self.mem_type = "DRAM" if not caches or caches[0].device.type == "cpu" else "VRAM"
        self._caches = [
            {
                "address": cache.data_ptr(),
                "device": max(cache.get_device(), 0),
                "planes": cache.shape[0],
                "num_blocks": cache.shape[1],
                "block_size": cache.shape[2],
                "kv_heads": cache.shape[3],
                "head_dim": cache.shape[4],
                "itemsize": cache.element_size(),
                "dtype": str(cache.dtype),
                "heads": global_kv_heads(
                    self.totals[self._family(i)], cache.shape[3], self.tp_rank, self.tp_size
                ),
            }
            for i, cache in enumerate(caches)
        ]

    def metadata(self) -> dict[str, Any]:
        """What a decode worker needs to read this worker's blocks: its agent (its metadata,
        with the registered caches) and each cache's layout."""
        return {
            "agent": self.agent.name,
            "agent_metadata": encode_metadata(self.agent.get_agent_metadata()),
            "stage": self.stage,
            "caches": self._caches,
        }

    def save(self, caches: list[torch.Tensor], saves: list[tuple[bytes, int]]) -> None:
        """Nothing is saved: the decode side reads the prefill's cache in place."""

    def load(
        self,
        caches: list[torch.Tensor],
        loads: dict[str, list[tuple[Any, int]]],
        sources: dict[str, dict[str, Any]],
    ) -> dict[str, int]:
        """Read each request's blocks (remote block id, local block id) from the prefill
        workers ``sources[rid]`` names; returns the requests whose reads did not all complete
        (0 blocks loaded: their prompt is recomputed)."""
        failures: dict[str, int] = {}
        started: dict[str, tuple[list[Any], list[Any]]] = {}
        for rid, pairs in loads.items():
            try:
                started[rid] = self._start_reads(sources[rid], pairs)
            except Exception as exc:  # an unknown, stale or disconnected prefill engine
                logger.warning("kv_transfer: cannot read %s's blocks: %s", rid, exc)
                failures[rid] = 0
        deadline = time.monotonic() + self.timeout_s
        for rid, (handles, staged) in started.items():
            ok = self._wait(handles, deadline)
            try:
                ok = ok and all(self._read_staged(caches, *read, deadline) for read in staged)
            except Exception as exc:
                logger.warning("kv_transfer: %s", exc)
                ok = False
            if not ok:
                logger.warning("kv_transfer: reading %s's blocks failed or timed out", rid)
                failures[rid] = 0
        return failures

    def _start_reads(
        self, source: dict[str, Any], pairs: list[tuple[Any, int]]
    ) -> tuple[list[Any], list[Any]]:
        """Post the reads of whole blocks into this worker's cache; returns their handles and
        the staged reads still to do (``_read_staged``'s arguments)."""
        remote = np.asarray([int(r) for r, _ in pairs], dtype=np.int64)
        local = np.asarray([int(b) for _, b in pairs], dtype=np.int64)
        workers = [w for w in source["workers"] if w["stage"] == self.stage]
        handles, staged = [], []
        for worker_index, reads in self._plan(workers).items():
            worker = workers[worker_index]
            if worker["agent"] not in self._remote_agents:
                self.agent.add_remote_agent(decode_metadata(worker["agent_metadata"]))
                self._remote_agents.add(worker["agent"])
            partial = [read for read in reads if read[1] is not None]
            if partial:
                staged.append((worker, partial, remote, local))
            whole = [index for index, heads, _ in reads if heads is None]
            if not whole:
                continue
            mine = [_block_regions(self._caches[i], local) for i in whole]
            theirs = [_block_regions(worker["caches"][i], remote) for i in whole]
            handles.append(self._post(np.concatenate(mine), np.concatenate(theirs), worker))
        return handles, staged

    def _post(self, mine: np.ndarray, theirs: np.ndarray, worker: dict[str, Any]) -> Any:
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(mine, self.mem_type),
            self.agent.get_xfer_descs(theirs, self.mem_type),
            worker["agent"],
        )
        if self.agent.transfer(handle) == "ERR":
            handle.release()
            raise RuntimeError(f"NIXL refused the read from {worker['agent']}")
        return handle

    def _stage(self, nbytes: int, like: torch.Tensor) -> torch.Tensor:
        """The registered staging buffer, at least ``nbytes`` long."""
        if self._staging is None or self._staging.numel() < nbytes:
            if self._staging_registered is not None:
                self.agent.deregister_memory(self._staging_registered)
            size = max(nbytes, STAGING_BYTES)
            self._staging = torch.empty(size, dtype=torch.uint8, device=like.device)
            self._staging_registered = self.agent.register_memory([self._staging])
        return self._staging

    def _read_staged(
        self,
        caches: list[torch.Tensor],
        worker: dict[str, Any],
        reads: list[tuple[int, list[int], list[int]]],
        remote: np.ndarray,
        local: np.ndarray,
        deadline: float,
    ) -> bool:
        """Read the prefill worker's whole blocks of these caches into the staging buffer, a
        chunk at a time, and copy the heads this worker holds (``reads``: cache index, local
        head positions, remote head positions) into its blocks."""
        theirs = [worker["caches"][index] for index, _, _ in reads]
        per_block = sum(c["planes"] * _block_bytes(c) for c in theirs)
        stage = self._stage(per_block, caches[0])
        chunk = stage.numel() // per_block
        for start in range(0, len(remote), chunk):
            ids = remote[start : start + chunk]
            rows, views, offset = [], [], 0
            for (index, ours, their_heads), cache in zip(reads, theirs, strict=True):
                staged = {**cache, "address": stage.data_ptr() + offset, "num_blocks": len(ids),
                          "device": max(stage.get_device(), 0)}  # fmt: skip
                rows.append(
                    (_block_regions(staged, np.arange(len(ids))), _block_regions(cache, ids))
                )
                nbytes = cache["planes"] * len(ids) * _block_bytes(cache)
                shape = (cache["planes"], len(ids), cache["block_size"], cache["kv_heads"], -1)
                view = stage[offset : offset + nbytes].view(caches[index].dtype).view(shape)
                views.append((index, ours, their_heads, view))
                offset += nbytes
            mine = np.concatenate([m for m, _ in rows])
            handle = self._post(mine, np.concatenate([t for _, t in rows]), worker)
            if not self._wait([handle], deadline):
                return False
            blocks = torch.as_tensor(local[start : start + chunk], device=stage.device)
            for index, ours, their_heads, view in views:
                for o, t, n in _runs(ours, their_heads):
                    caches[index][:, :, :, o : o + n].index_copy_(
                        1, blocks, view[:, :, :, t : t + n]
                    )
        return True

    def _plan(self, workers: list[dict[str, Any]]) -> dict[int, list[Any]]:
        """Which prefill worker each of this worker's KV heads is read from: worker index ->
        [(cache index, local head positions, remote head positions)], where None for both
        means the whole block (the two hold the same heads in the same order)."""
        for worker in workers:
            self._check_layout(worker)
        plan: dict[int, list[Any]] = {}
        for index, mine in enumerate(self._caches):
            wanted: dict[int, tuple[list[int], list[int]]] = {}
            for position, head in enumerate(mine["heads"]):
                holders = [w for w, x in enumerate(workers) if head in x["caches"][index]["heads"]]
                owner = holders[0] if holders else None
                if owner is None:
                    raise RuntimeError(
                        f"no prefill worker of stage {self.stage} holds KV head {head}"
                    )
                ours, theirs = wanted.setdefault(owner, ([], []))
                ours.append(position)
                theirs.append(workers[owner]["caches"][index]["heads"].index(head))
            for owner, (ours, theirs) in wanted.items():
                whole = ours == theirs == list(range(mine["kv_heads"])) and (
                    workers[owner]["caches"][index]["kv_heads"] == mine["kv_heads"]
                )
                entry = (index, None, None) if whole else (index, ours, theirs)
                plan.setdefault(owner, []).append(entry)
        return plan

    def _check_layout(self, worker: dict[str, Any]) -> None:
        theirs = worker["caches"]
        if len(theirs) != len(self._caches):
            raise RuntimeError(
                f"the prefill worker has {len(theirs)} caches, this one {len(self._caches)}"
            )
        for a, b in zip(self._caches, theirs, strict=True):
            for key in ("planes", "block_size", "head_dim", "dtype"):
                if a[key] != b[key]:
                    raise RuntimeError(
                        f"the prefill worker's cache {key} is {b[key]}, not {a[key]}"
                    )

    def _wait(self, handles: list[Any], deadline: float) -> bool:
        """Wait for every read (True when all are done); release the handles."""
        ok = True
        try:
            for handle in handles:
                state = self.agent.check_xfer_state(handle)
                while state == "PROC" and time.monotonic() < deadline:
                    time.sleep(0)
                    state = self.agent.check_xfer_state(handle)
                ok = ok and state == "DONE"
        except Exception:
            ok = False
        for handle in handles:
            try:
                handle.release()
            except Exception as exc:  # still in flight past the timeout
                logger.warning("kv_transfer: cannot release a NIXL read: %s", exc)
        return ok
