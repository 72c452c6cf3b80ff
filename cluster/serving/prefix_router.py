"""Prefix-cache-aware request routing across a model's replicas (Ray Serve's ``RequestRouter``).

The router runs where the handle lives (the ingress) and keeps, per replica, the set of prompt
chunk hashes it has sent there: an approximation of that replica's prefix cache, bounded by an
LRU. A request goes to the replica that holds the longest run of its leading chunks, unless
that replica is much busier than the least-loaded one (SGLang's cache-aware router's balance
rule), so one hot prefix cannot pin every request to one replica:

    chunks = chained hashes of the prompt, chunk_chars characters (or 16 token ids) each
    best   = the replica matching the most leading chunks (ties: fewer in flight)
    least  = the replica with the fewest requests in flight (ties: fewest chunks held)
    route to best  if  match >= min_match_fraction of the prompt
                  and not (load(best) - load(least) > balance_abs_threshold
                           and load(best) > balance_rel_threshold * load(least))
    else route to least

The prompt is hashed as text (chat: role/content text), an approximation of the engine's
block hashes that costs only hit rate. Load is this router's own count in flight; a replica
reporting KV usage above ``kv_full`` counts as busy, one asleep is chosen only when every
awake one is busy (or none is awake), and a chunk in the node's KV store counts
``kv_store_credit`` (< 1) of one in the replica's own cache.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

TOKEN_CHUNK = 16  # token ids per chunk when the prompt arrives as ids (the engine's block size)
MAX_PREFIX_CHARS = 32768  # only the prompt's start is hashed: routing cost stays bounded
KV_FULL = 0.95  # reported KV usage above which a replica is not chosen for its prefix

K = TypeVar("K")


# ---- the request as chained chunk hashes -------------------------------------------------


def prompt_text(request: Any) -> str | list[int] | None:
    """What the router hashes of a ``GenerateRequest``-like object: its prompt text, its token
    ids, or its chat messages (and tools) rendered as text; None when it has no prompt."""
    messages = getattr(request, "messages", None)
    if messages is not None:
        parts = []
        tools = getattr(request, "tools", None)
        if tools:
            parts.append("tools:" + json.dumps(tools, sort_keys=True))
        for message in messages:
            if isinstance(message, dict):
                parts.append(f"{message.get('role')}:{_content_text(message.get('content'))}")
        return "\n".join(parts)
    ids = getattr(request, "prompt_token_ids", None)
    if isinstance(ids, list):
        return ids
    prompt = getattr(request, "prompt", None)
    return prompt if isinstance(prompt, str) else None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(_part_text(p) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _part_text(part: dict[str, Any]) -> str:
    """A text part's text; an image part as a digest of its URL (two images behind the same
    text are different prefixes, as the engine's prefix cache keys them by content)."""
    image = part.get("image_url")
    if part.get("type") == "image_url" and isinstance(image, dict):
        digest = hashlib.sha256(str(image.get("url", "")).encode()).hexdigest()[:16]
        return f"<image:{digest}>"
    return str(part.get("text", ""))


def chunk_hashes(prompt: str | list[int], chunk_chars: int) -> list[int]:
    """Chained hashes of the prompt's full chunks: hash i covers chunks 0..i, so equal hashes
    mean (up to collisions) equal prefixes. A trailing partial chunk is left out, as the
    engine leaves out a partial block."""
    size = TOKEN_CHUNK if isinstance(prompt, list) else chunk_chars
    prefix = prompt[:MAX_PREFIX_CHARS] if isinstance(prompt, str) else prompt
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(prefix) - size + 1, size):
        chunk = prefix[start : start + size]
        parent = hash((parent, chunk if isinstance(chunk, str) else tuple(chunk)))
        hashes.append(parent)
    return hashes


# ---- per-replica chunk sets --------------------------------------------------------------


class PrefixIndex(Generic[K]):
    """Per replica key, an LRU-bounded set of chunk hashes routed there."""

    def __init__(self, max_chunks_per_replica: int) -> None:
        self.max_chunks = max_chunks_per_replica
        self._chunks: dict[K, OrderedDict[int, None]] = {}

    def match(self, key: K, hashes: Sequence[int]) -> int:
        """How many leading chunks of ``hashes`` replica ``key`` holds."""
        held = self._chunks.get(key)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def insert(self, key: K, hashes: Sequence[int]) -> None:
        """Record that a request with these chunks went to ``key``. The first chunks are
        touched last, so they are the last to be evicted (later chunks hang off them)."""
        held = self._chunks.setdefault(key, OrderedDict())
        for h in reversed(hashes):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_chunks:
            held.popitem(last=False)

    def size(self, key: K) -> int:
        return len(self._chunks.get(key, ()))

    def retain(self, keys: set[K]) -> None:
        """Forget replicas that are gone."""
        for key in [k for k in self._chunks if k not in keys]:
            del self._chunks[key]


# ---- the choice ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterSettings:
    chunk_chars: int = 64
    max_chunks_per_replica: int = 65536
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    min_match_fraction: float = 0.1
    kv_store_credit: float = 0.0  # a chunk in the replica's node's KV store, against its own


@dataclass(frozen=True)
class ReplicaLoad(Generic[K]):
    key: K
    in_flight: int  # requests this router has sent there and not seen finish
    kv_usage: float = 0.0  # as last reported by the replica (record_routing_stats)
    chunks_held: int = 0
    asleep: bool = False  # sleep mode: its KV cache (and the prefixes in it) is gone


def choose(
    replicas: Sequence[ReplicaLoad[K]],
    matches: dict[K, float],
    num_chunks: int,
    settings: RouterSettings,
    rng: random.Random | None = None,
) -> tuple[K, str]:
    """The replica for one request and why: ``prefix`` (longest match, load within bounds),
    ``balance`` (the longest match was too busy), ``least_loaded`` (no useful match)."""
    if not replicas:
        raise ValueError("replicas: no replica to choose from")
    rng = rng or random.Random()
    order = list(replicas)
    rng.shuffle(order)  # equal replicas are picked at random, not by position
    # A sleeping replica costs a wake and holds no prefix: chosen only when every awake one
    # has a full KV cache (the autoscaler counts it as capacity and adds no replica for it).
    awake = [r for r in order if not r.asleep]
    usable = [r for r in awake if r.kv_usage < KV_FULL] or [r for r in order if r.asleep] or order
    least = min(usable, key=lambda r: (r.in_flight, r.chunks_held))
    best = max(usable, key=lambda r: (matches.get(r.key, 0), -r.in_flight))
    matched = matches.get(best.key, 0)
    if num_chunks == 0 or matched == 0 or matched < settings.min_match_fraction * num_chunks:
        return least.key, "least_loaded"
    too_busy = (
        best.in_flight - least.in_flight > settings.balance_abs_threshold
        and best.in_flight > settings.balance_rel_threshold * least.in_flight
    )
    if too_busy:
        return least.key, "balance"
    return best.key, "prefix"


# ---- the Serve request router ----------------------------------------------------------------

try:
    from ray.serve.request_router import (
        FIFOMixin,
        PendingRequest,
        ReplicaID,
        ReplicaResult,
        RequestRouter,
        RunningReplica,
    )
except ImportError:  # pragma: no cover - Ray without the RequestRouter API
    RequestRouter = FIFOMixin = object  # type: ignore[assignment,misc]


# FIFOMixin: Serve's base router hands a chosen replica to the pending request with the same
# internal request id, and the prompts of one batched completions request share that id (one
# HTTP request): all but one of them were never routed. FIFO hands it to the oldest pending
# request instead, as Serve's own power-of-two router does.
class PrefixAwareRouter(FIFOMixin, RequestRouter):  # type: ignore[misc,valid-type]
    """Serve's ``RequestRouter`` for an ``LLMServer`` deployment: ``choose`` over its replicas.

    ``choose_replicas`` returns the chosen replica alone as the first rank and the others by
    load as the second, so when the chosen one is full (``max_ongoing_requests``) Serve falls
    back to the least-loaded others instead of waiting. A LoRA adapter's request (Serve model
    multiplexing) chooses among the replicas that already loaded the adapter, when any did,
    and ranks the rest last. The chunk history is written when Serve reports the request
    routed (``on_request_routed``), to the replica it really went to.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self.settings = RouterSettings(**kwargs)
        self.index: PrefixIndex[ReplicaID] = PrefixIndex(self.settings.max_chunks_per_replica)
        # The chunks routed to each node (its KV store computed them), and each replica's node.
        self.node_index: PrefixIndex[str] = PrefixIndex(self.settings.max_chunks_per_replica)
        self._node_of: dict[ReplicaID, str] = {}
        self._in_flight: dict[ReplicaID, set[str]] = {}
        self._rng = random.Random()
        self._decisions = _routing_metrics()
        self._model = self._deployment_id.name.removeprefix("LLMServer:")

    def _hashes(self, pending_request: PendingRequest | None) -> list[int]:
        """The request's chunk hashes, computed once: routing rounds (a retry after a full
        replica) and ``on_request_routed`` reuse them from the request's routing context."""
        if pending_request is None or not pending_request.args:
            return []
        context = pending_request.routing_context
        hashes = getattr(context, "llm_cluster_hashes", None)
        if hashes is None:
            prompt = prompt_text(pending_request.args[0])
            hashes = chunk_hashes(prompt, self.settings.chunk_chars) if prompt else []
            context.llm_cluster_hashes = hashes  # type: ignore[attr-defined]
        return hashes

    def _load(self, replica: RunningReplica) -> ReplicaLoad[ReplicaID]:
        stats = replica.routing_stats or {}
        kv_usage = stats.get("kv_usage", 0.0)
        return ReplicaLoad(
            replica.replica_id,
            len(self._in_flight.get(replica.replica_id, ())),
            kv_usage if isinstance(kv_usage, (int, float)) else 0.0,
            self.index.size(replica.replica_id),
            stats.get("sleeping") is True,
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Every replica is in the ranks below: when none of them accepts the request (all at
            # max_ongoing_requests, or slow to report their queue), Serve must back off before
            # asking again. Without this it retries at once, forever: a busy loop that starves
            # the replicas it waits for.
            pending_request.routing_context.should_backoff = True
        # A LoRA adapter's request (Serve model multiplexing): among the replicas that already
        # loaded the adapter when any did; the others stay a fallback, least loaded first.
        fallback: list[RunningReplica] = []
        model_id = pending_request.metadata.multiplexed_model_id if pending_request else ""
        if model_id:
            holding = [r for r in candidate_replicas if model_id in r.multiplexed_model_ids]
            if holding:
                fallback = [r for r in candidate_replicas if r not in holding]
                candidate_replicas = holding
        hashes = self._hashes(pending_request)
        loads = [self._load(r) for r in candidate_replicas]
        matches = self._matches(candidate_replicas, hashes)
        chosen, reason = choose(loads, matches, len(hashes), self.settings, self._rng)
        if pending_request is not None:
            # Recorded once per request; a retry (the chosen replica was full) does not count.
            context = pending_request.routing_context
            if not getattr(context, "llm_cluster_counted", False):
                context.llm_cluster_counted = True  # type: ignore[attr-defined]
                self._record_decision(chosen, reason)
        by_id = {r.replica_id: r for r in candidate_replicas}
        rest = sorted(
            (lo for lo in loads if lo.key != chosen), key=lambda lo: (lo.in_flight, lo.chunks_held)
        )
        ranks = [[by_id[chosen]], [by_id[lo.key] for lo in rest]]
        if fallback:
            fallback_loads = sorted((self._load(r) for r in fallback),
                                    key=lambda lo: (lo.in_flight, lo.chunks_held))  # fmt: skip
            by_id.update((r.replica_id, r) for r in fallback)
            ranks.append([by_id[lo.key] for lo in fallback_loads])
        return [rank for rank in ranks if rank]

    def _matches(self, replicas: list[RunningReplica], hashes: list[int]) -> dict[Any, float]:
        """Each replica's matched chunks: its own, or its node's KV store's at
        ``kv_store_credit`` each (the store holds what any replica of the node computed)."""
        matches: dict[Any, float] = {}
        credit = self.settings.kv_store_credit
        for replica in replicas:
            own = self.index.match(replica.replica_id, hashes)
            stored = self.node_index.match(replica.node_id, hashes) if credit else 0
            matches[replica.replica_id] = max(own, credit * stored)
        return matches

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        self.index.insert(replica_id, self._hashes(pending_request))
        node = self._node_of.get(replica_id)
        if self.settings.kv_store_credit and node is not None:
            self.node_index.insert(node, self._hashes(pending_request))
        internal_id = pending_request.metadata.internal_request_id
        self._in_flight.setdefault(replica_id, set()).add(internal_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.get(replica_id, set()).discard(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._node_of = {r.replica_id: r.node_id for r in replicas}
        alive = {r.replica_id for r in replicas}
        self.index.retain(alive)
        for replica_id in [k for k in self._in_flight if k not in alive]:
            del self._in_flight[replica_id]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.retain(set(self._replicas) - {replica_id})
        self._in_flight.pop(replica_id, None)

    def _record_decision(self, replica_id: ReplicaID, reason: str) -> None:
        if self._decisions is None:
            return
        tags = {"model": self._model, "replica": replica_id.unique_id, "reason": reason}
        self._decisions.inc(1, tags)


_DECISIONS: Any = None


def _routing_metrics() -> Any:
    """``llm_cluster_routing_decisions_total{model, replica, reason}``, one per process (Ray
    metrics are registered by name); None outside a Ray worker."""
    global _DECISIONS
    if _DECISIONS is None:
        try:
            from ray.util.metrics import Counter

            _DECISIONS = Counter(
                "llm_cluster_routing_decisions_total",
                "Requests routed to a replica, by reason: prefix, balance, least_loaded.",
                tag_keys=("model", "replica", "reason"),
            )
        except Exception:  # no Ray worker to report to (unit tests)
            return None
    return _DECISIONS
