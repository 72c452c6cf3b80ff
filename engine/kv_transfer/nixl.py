"""The head side of ``NixlConnector``: prefill/decode disaggregation led by the decode engine,
the blocks read from the prefill engine's KV cache with NIXL (vLLM's connector of that name).

    prefill engine (kv_producer)                 decode engine (kv_consumer)
    a request with {"do_remote_decode": true}
    finishes: its blocks are held (``hold``);
    its output's kv_transfer_params name them ──► a request with those params: the prompt's
    and this engine's agents                      full blocks allocated, counted as computed,
                                                  READ by its workers (``nixl_worker``) before
                                                  the forward pass; the rest is computed
    freed (``poll``) on the notification ◄─────── after that step, its head notifies (read
    or after abort_request_timeout_s              or not)

The handle is the prefill engine's ``engine_id`` (a nonce drawn at its start), its request id
and block ids: a restarted prefill engine has other agents, so a stale handle reads nothing
(the read fails; the prompt is computed). A handle past half the prefill's timeout
(``remote_deadline``, wall clock) is not read: its blocks may be reused by then. Failed or
timed-out reads are ``kv_load_failures``. NIXL is imported only when this connector is
configured (``nixl_api``).
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus

logger = logging.getLogger("llm_cluster.kv_transfer")

_PARAMS_KEYS = (
    "remote_engine_id", "remote_request_id", "remote_block_ids", "remote_namespace",
    "remote_block_size", "remote_head_agent", "remote_workers", "remote_timeout_s",
    "remote_deadline",
)  # fmt: skip


def nixl_api() -> Any:
    """NIXL's Python API (``nixl_agent``, ``nixl_agent_config``): the ``nixl`` package's, or
    ``nixl-cu12``'s module of the same API when only that wheel is installed."""
    try:
        from nixl import _api  # type: ignore[import-not-found]
    except ImportError:
        try:
            from nixl_cu12 import _api  # type: ignore[import-not-found]
        except ImportError as exc:
            raise ImportError(
                "kv_transfer_config.kv_connector: NixlConnector needs NIXL "
                "(pip install 'nixl-cu12>=1.5.1,<2')"
            ) from exc
    return _api


def new_agent(name: str) -> Any:
    """A NIXL agent over UCX (shared memory on one node; TCP, or RDMA where present, between
    nodes), with a progress thread, so transfers advance while the caller waits."""
    api = nixl_api()
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))


def encode_metadata(metadata: bytes) -> str:
    return base64.b64encode(metadata).decode()


def decode_metadata(text: str) -> bytes:
    return base64.b64decode(text)


class NixlScheduler:
    """The head's part of ``NixlConnector`` (module docstring), with the connector interface
    the scheduler drives (``KVTransferScheduler``'s, where blocks come from NIXL reads)."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        kv = config.kv_transfer.kv_transfer_config
        if kv is None:
            raise ValueError("kv_transfer_config: not set")
        self.config = kv
        self.block_manager = block_manager
        self.block_size = config.cache.block_size
        self.engine_id = config.kv_transfer.engine_id
        self.namespace = config.kv_transfer.namespace
        self.agent = new_agent(f"{self.engine_id}/head")
        self._head_metadata = encode_metadata(self.agent.get_agent_metadata())
        self.workers: list[dict[str, Any]] = []  # each worker's agent and KV layout
        # Prefill: requests whose blocks wait for the decode side's read -> their deadline.
        self._sending: dict[str, tuple[Request, float]] = {}
        # Decode: admitted requests whose prefill head is told once their step is done.
        self._to_notify: dict[str, dict[str, Any]] = {}
        self._sources: dict[str, dict[str, Any]] = {}  # request id -> its reads' source
        self._known_heads: set[str] = set()
        self.queried_tokens = 0  # prompt tokens a remote prefill offered (after device hits)
        self.hit_tokens = 0  # of those, read
        self.failed_tokens = 0  # read tokens voided by a failed read (recomputed)
        self.released_read = 0  # held requests released by the decode side's notification
        self.released_timeout = 0  # ... by abort_request_timeout_s

    def register_workers(self, metadata: list[dict[str, Any]]) -> None:
        """Every worker's agent and KV cache layout (``NixlWorkerTransfer.metadata``), taken
        once its cache is allocated and registered."""
        self.workers = list(metadata)

    # ---- decode side --------------------------------------------------------------------

    def _usable(self, request: Request) -> dict[str, Any] | None:
        """The request's remote prefill handle when it may be read now, else None."""
        params = request.remote_prefill
        if not params or not params.get("do_remote_prefill") or not self.config.loads:
            return None
        if not self.block_manager.may_reuse(request):
            return None
        missing = [k for k in _PARAMS_KEYS if k not in params]
        if missing:
            logger.warning("kv_transfer_params of %s lack %s: computing its prompt",
                           request.request_id, ", ".join(missing))  # fmt: skip
            return None
        if params["remote_namespace"] != self.namespace:
            logger.warning("kv_transfer_params of %s: the prefill engine's checkpoint or KV "
                           "layout differs from this one's: computing its prompt",
                           request.request_id)  # fmt: skip
            return None
        # Read only well before the prefill's timeout frees the blocks (wall clocks: the
        # engines may be on two nodes; the margin dwarfs their skew).
        margin = float(params["remote_timeout_s"]) / 2
        if time.time() + margin > float(params["remote_deadline"]):
            return None
        return params

    def _remote_range(self, request: Request, num_cached: int) -> range:
        params = self._usable(request)
        if params is None:
            return range(0)
        end = min(len(params["remote_block_ids"]), (request.num_tokens - 1) // self.block_size)
        return range(num_cached // self.block_size, max(end, num_cached // self.block_size))

    def stored_blocks(self, request: Request, num_cached: int) -> int:
        """How many blocks after the request's ``num_cached`` device hits the remote prefill
        holds (read, not computed)."""
        return len(self._remote_range(request, num_cached))

    def admit(self, request: Request, num_cached: int, count: int) -> list[tuple[int, int]]:
        """The request was admitted with ``count`` remote blocks after its device hits: their
        (remote block id, local block id) for the workers to read. The handle is spent here:
        a request preempted later computes its prompt."""
        blocks = self._remote_range(request, num_cached)
        params, request.remote_prefill = request.remote_prefill, None
        if params and params.get("do_remote_prefill"):
            self._to_notify[request.request_id] = params
        self.queried_tokens += len(blocks) * self.block_size
        self.hit_tokens += count * self.block_size
        if not count or params is None:
            self._notify(request.request_id)
            return []
        remote_ids = params["remote_block_ids"]
        table = self.block_manager.get_block_ids(request.request_id)
        self._sources[request.request_id] = {
            "engine_id": params["remote_engine_id"],
            "workers": params["remote_workers"],
        }
        return [(remote_ids[i], table[i]) for i in range(blocks.start, blocks.start + count)]

    def load_source(self, request_id: str) -> dict[str, Any] | None:
        """Where the request's reads of this step come from (the prefill's agents)."""
        return self._sources.pop(request_id, None)

    def completed(self, request: Request, before: int, after: int) -> None:
        """A step of the request's is done: its reads (if any) are over on every rank."""
        self._notify(request.request_id)

    def failed(self, request: Request, first: int, loaded: int, requested: int) -> None:
        """A rank read only ``loaded`` of the ``requested`` blocks from block ``first``: the
        request continues from there (computed)."""
        self.hit_tokens -= (requested - loaded) * self.block_size
        self.failed_tokens += (requested - loaded) * self.block_size
        request.num_computed_tokens = (first + loaded) * self.block_size
        request.num_cached_tokens = min(request.num_cached_tokens, request.num_computed_tokens)
        self._notify(request.request_id)

    def _notify(self, request_id: str) -> None:
        """Tell the prefill head that the request's blocks may go (read, or never to be)."""
        params = self._to_notify.pop(request_id, None)
        self._sources.pop(request_id, None)
        if params is None:
            return
        try:
            name = f"{params['remote_engine_id']}/head"
            if name not in self._known_heads:
                self.agent.add_remote_agent(decode_metadata(params["remote_head_agent"]))
                self._known_heads.add(name)
            self.agent.send_notif(name, str(params["remote_request_id"]).encode())
        except Exception as exc:  # a prefill engine gone: its blocks went with it
            logger.info("kv_transfer: cannot notify prefill engine %s: %s",
                        params.get("remote_engine_id"), exc)  # fmt: skip

    # ---- prefill side -------------------------------------------------------------------

    def hold(self, request: Request) -> bool:
        """A request is finishing: when it asked for remote decode and finished normally, its
        output gets ``kv_transfer_params`` naming its full prompt blocks, which stay
        allocated until the decode side's notification or the timeout (True: the caller
        must not free them)."""
        self._notify(request.request_id)  # a decode request aborted before its step
        params = request.sampling_params.kv_transfer_params or {}
        if not (params.get("do_remote_decode") and self.config.saves and request.index == 0):
            return False
        if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return False
        if not self.block_manager.may_reuse(request):
            return False
        full = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        table = self.block_manager.get_block_ids(request.request_id)[:full]
        request.kv_transfer_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": table,
            "remote_namespace": self.namespace,
            "remote_block_size": self.block_size,
            "remote_head_agent": self._head_metadata,
            "remote_workers": self.workers,
            "remote_timeout_s": self.config.abort_request_timeout_s,
            "remote_deadline": time.time() + self.config.abort_request_timeout_s,
        }
        if not table:
            return False
        deadline = time.monotonic() + self.config.abort_request_timeout_s
        self._sending[request.request_id] = (request, deadline)
        return True

    def holds(self, request_id: str) -> bool:
        """The request's blocks are held for a read (its id is still in use)."""
        return request_id in self._sending

    @property
    def num_held(self) -> int:
        """Finished requests whose blocks are held for another engine's read."""
        return len(self._sending)

    @property
    def has_pending(self) -> bool:
        """Blocks held for a decode engine's read."""
        return bool(self._sending)

    def poll(self) -> None:
        """Release the held blocks the decode side is done with, or whose time is up."""
        if not self._sending:
            return
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                if self._release(message.decode(errors="replace")):
                    self.released_read += 1
        now = time.monotonic()
        for request_id, (_, deadline) in list(self._sending.items()):
            if now >= deadline and self._release(request_id):
                self.released_timeout += 1
                logger.warning("kv_transfer: request %s's blocks were not read within "
                               "abort_request_timeout_s; released", request_id)  # fmt: skip

    def _release(self, request_id: str) -> bool:
        entry = self._sending.pop(request_id, None)
        if entry is None:
            return False
        self.block_manager.free(entry[0])
        return True

    # ---- the interface's other parts ----------------------------------------------------

    @property
    def has_saves(self) -> bool:
        return False

    def take_saves(self) -> list[tuple[bytes, int]]:
        return []
