"""The prefix-aware router's choice, on fake replicas: chunk hashing, the per-replica LRU
index, and ``choose`` (longest prefix within the balance bounds, else least loaded)."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest

from cluster.api.replica_messages import GenerateRequest
from cluster.serving.prefix_router import (
    PrefixIndex,
    ReplicaLoad,
    RouterSettings,
    choose,
    chunk_hashes,
    prompt_text,
)

SETTINGS = RouterSettings(chunk_chars=8, balance_abs_threshold=4, balance_rel_threshold=1.5)


def test_equal_prefixes_hash_equal_and_a_different_chunk_changes_every_later_hash() -> None:
    a = chunk_hashes("system-prompt-A:" + "hello world!", 8)
    b = chunk_hashes("system-prompt-A:" + "goodbye all!", 8)
    c = chunk_hashes("system-prompt-B:" + "hello world!", 8)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert a[0] == c[0] and a[1] != c[1] and a[2] != c[2]  # chained: the parent is in the hash


def test_a_partial_trailing_chunk_is_not_hashed_and_token_ids_chunk_by_16() -> None:
    assert len(chunk_hashes("x" * 23, 8)) == 2
    assert len(chunk_hashes(list(range(40)), 8)) == 2


def test_prompt_text_reads_prompts_token_ids_and_chat_messages() -> None:
    assert prompt_text(GenerateRequest(prompt="hi")) == "hi"
    assert prompt_text(GenerateRequest(prompt_token_ids=[1, 2])) == [1, 2]
    chat = GenerateRequest(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        ]
    )
    assert prompt_text(chat) == "system:be brief\nuser:hello"
    assert prompt_text(SimpleNamespace()) is None


def test_an_image_part_is_part_of_the_prefix_by_its_url() -> None:
    def chat(url: str) -> GenerateRequest:
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hm"}]
        return GenerateRequest(messages=[{"role": "user", "content": parts}])

    a, b = (
        prompt_text(chat("data:image/png;base64,AAAA")),
        prompt_text(chat("data:image/png;base64,BBBB")),
    )
    assert a != b
    assert a == prompt_text(chat("data:image/png;base64,AAAA"))
    assert a.startswith("user:<image:") and a.endswith(">hm")


def test_index_matches_leading_chunks_only() -> None:
    index: PrefixIndex[str] = PrefixIndex(100)
    index.insert("r1", [1, 2, 3])
    assert index.match("r1", [1, 2, 3, 4]) == 3
    assert index.match("r1", [9, 2, 3]) == 0
    assert index.match("r2", [1]) == 0


def test_index_evicts_least_recently_used_chunks_keeping_the_prefix_roots() -> None:
    index: PrefixIndex[str] = PrefixIndex(4)
    index.insert("r1", [1, 2, 3])
    index.insert("r1", [1, 5, 6])  # 1 is touched again, last: it stays
    assert index.size("r1") == 4
    assert index.match("r1", [1, 5, 6]) == 3
    assert index.match("r1", [1, 2]) == 2 and index.match("r1", [1, 2, 3]) == 2  # 3 evicted


def test_index_forgets_replicas_that_are_gone() -> None:
    index: PrefixIndex[str] = PrefixIndex(10)
    index.insert("r1", [1])
    index.insert("r2", [1])
    index.retain({"r2"})
    assert index.size("r1") == 0 and index.size("r2") == 1


def loads(*in_flight: int) -> list[ReplicaLoad[str]]:
    return [ReplicaLoad(f"r{i}", n) for i, n in enumerate(in_flight)]


def test_longest_prefix_wins_when_load_is_within_bounds() -> None:
    chosen, reason = choose(loads(3, 0), {"r0": 10, "r1": 2}, 12, SETTINGS)
    assert (chosen, reason) == ("r0", "prefix")


def test_a_busy_longest_prefix_replica_loses_to_the_least_loaded_one() -> None:
    # 9 - 1 > 4 and 9 > 1.5 x 1: imbalanced.
    assert choose(loads(9, 1), {"r0": 10}, 12, SETTINGS) == ("r1", "balance")
    # 9 - 6 = 3 is within the absolute threshold: keep the prefix.
    assert choose(loads(9, 6), {"r0": 10}, 12, SETTINGS) == ("r0", "prefix")


def test_no_useful_match_goes_to_the_least_loaded_replica() -> None:
    assert choose(loads(2, 1), {}, 12, SETTINGS) == ("r1", "least_loaded")
    # 1 of 12 chunks is below min_match_fraction 0.1: not worth following.
    assert choose(loads(2, 1), {"r0": 1}, 12, SETTINGS) == ("r1", "least_loaded")


def test_equal_load_ties_go_to_the_replica_holding_fewer_chunks() -> None:
    replicas = [ReplicaLoad("r0", 0, 0.0, 50), ReplicaLoad("r1", 0, 0.0, 10)]
    assert choose(replicas, {}, 4, SETTINGS) == ("r1", "least_loaded")


def test_a_replica_with_a_full_kv_cache_is_not_chosen_for_its_prefix() -> None:
    replicas = [ReplicaLoad("r0", 1, 0.99), ReplicaLoad("r1", 1, 0.2)]
    chosen, _ = choose(replicas, {"r0": 10, "r1": 0}, 12, SETTINGS)
    assert chosen == "r1"


def test_a_sleeping_replica_is_chosen_only_when_every_awake_one_is_full_or_none_is_awake() -> None:
    replicas = [ReplicaLoad("r0", 0, 0.0, asleep=True), ReplicaLoad("r1", 3, 0.5)]
    assert choose(replicas, {"r0": 10, "r1": 0}, 12, SETTINGS)[0] == "r1"
    both = [ReplicaLoad("r0", 0, 0.0, asleep=True), ReplicaLoad("r1", 3, 0.0, asleep=True)]
    assert choose(both, {}, 12, SETTINGS) == ("r0", "least_loaded")
    # The awake one's KV cache is full: the sleeping one wakes for the load (the autoscaler
    # counts it as capacity, so it adds no replica while one sleeps).
    full = [ReplicaLoad("r0", 0, 0.0, asleep=True), ReplicaLoad("r1", 9, 0.99)]
    assert choose(full, {"r1": 10}, 12, SETTINGS)[0] == "r0"


def simulate(num_prefixes: int, num_requests: int, settings: RouterSettings) -> Counter[str]:
    """Requests with ``num_prefixes`` system prompts, uniform, against 2 replicas that finish
    a request after 4 later arrivals: the routed share per replica."""
    rng = random.Random(0)
    index: PrefixIndex[str] = PrefixIndex(10_000)
    in_flight = {"r0": [], "r1": []}
    shares: Counter[str] = Counter()
    prefixes = [f"system prompt {p:02d} " * 8 for p in range(num_prefixes)]
    for i in range(num_requests):
        for queue in in_flight.values():
            while queue and queue[0] <= i - 4:
                queue.pop(0)
        text = rng.choice(prefixes) + f"user {rng.random()}"
        hashes = chunk_hashes(text, settings.chunk_chars)
        replicas = [ReplicaLoad(k, len(v), 0.0, index.size(k)) for k, v in in_flight.items()]
        matches = {k: index.match(k, hashes) for k in in_flight}
        chosen, _ = choose(replicas, matches, len(hashes), settings, rng)
        index.insert(chosen, hashes)
        in_flight[chosen].append(i)
        shares[chosen] += 1
    return shares


def test_uniform_prefixes_spread_over_replicas_no_replica_above_70_percent() -> None:
    shares = simulate(8, 800, RouterSettings())
    assert max(shares.values()) <= 0.7 * 800, shares


def test_one_hot_prefix_spills_to_the_other_replica_under_load() -> None:
    shares = simulate(1, 400, RouterSettings(balance_abs_threshold=1, balance_rel_threshold=1))
    assert min(shares.values()) > 0.2 * 400, shares


# ---- the Serve RequestRouter around ``choose`` -----------------------------------------------


class FakeReplica:
    """What the router reads of Serve's ``RunningReplica``."""

    def __init__(self, name: str, kv_usage: float = 0.0) -> None:
        from ray.serve.request_router import ReplicaID

        self.replica_id = ReplicaID(unique_id=name, deployment_id=deployment_id())
        self.routing_stats = {"kv_usage": kv_usage, "num_waiting": 0}
        self.max_ongoing_requests = 32
        self.multiplexed_model_ids: set[str] = set()
        self.node_id = "node"
        self.availability_zone = None

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def deployment_id() -> object:
    from ray.serve._private.common import DeploymentID

    return DeploymentID(name="LLMServer:tiny", app_name="llm")


def make_router(*replicas: FakeReplica, **settings: object) -> object:
    from ray.serve._private.common import DeploymentHandleSource

    from cluster.serving.prefix_router import PrefixAwareRouter

    router = PrefixAwareRouter(deployment_id(), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(chunk_chars=8, **settings)
    router._replicas = {r.replica_id: r for r in replicas}
    router._replica_id_set = set(router._replicas)
    router._node_of = {r.replica_id: r.node_id for r in replicas}
    return router


def pending(text: str, request_id: str, multiplexed_model_id: str = "") -> object:
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id,
                               multiplexed_model_id=multiplexed_model_id)  # fmt: skip
    return SimpleNamespace(
        args=[GenerateRequest(prompt=text)],
        kwargs={},
        metadata=metadata,
        routing_context=PendingRequest.__dataclass_fields__["routing_context"].default_factory(),
    )


def test_router_sends_a_repeated_prefix_to_the_replica_it_went_to_first() -> None:
    import asyncio

    a, b = FakeReplica("a"), FakeReplica("b")
    router = make_router(a, b)
    prompt = "the shared system prompt, long enough for chunks. "

    async def route(text: str, request_id: str) -> list[list[object]]:
        request = pending(text, request_id)
        ranks = await router.choose_replicas([a, b], request)
        router.on_request_routed(request, ranks[0][0].replica_id, None)
        return ranks

    first = asyncio.run(route(prompt + "user 1", "1"))
    assert len(first) == 2 and len(first[0]) == 1 and len(first[1]) == 1
    chosen = first[0][0]
    second = asyncio.run(route(prompt + "user 2", "2"))
    assert second[0][0] is chosen  # same prefix: same replica though it has 1 more in flight
    other = asyncio.run(route("an unrelated prompt that shares nothing at all", "3"))
    assert other[0][0] is not chosen  # no match: the least-loaded replica
    router.on_request_completed(chosen.replica_id, "1")
    assert len(router._in_flight[chosen.replica_id]) == 1


@pytest.mark.parametrize("credit", [0.5, 0.0])
def test_a_prefix_in_a_nodes_kv_store_draws_its_requests_to_that_nodes_replicas(
    credit: float,
) -> None:
    import asyncio

    a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
    a.node_id = b.node_id = "node-1"
    c.node_id = "node-2"
    router = make_router(a, b, c, kv_store_credit=credit)
    prompt = "the shared system prompt, long enough for chunks. "
    first = pending(prompt + "user 1", "1")
    asyncio.run(router.choose_replicas([a], first))
    router.on_request_routed(first, a.replica_id, None)  # a computed it: node-1's store has it
    router.on_request_completed(a.replica_id, "1")
    picks = set()
    # 48 picks: with no credit b and c tie and the router breaks ties at random, so both nodes
    # show up (all on one side: 2^-47); with the credit, b wins every time.
    for i in range(48):  # a is gone (or full): b shares node-1's store, c does not
        ranks = asyncio.run(router.choose_replicas([b, c], pending(prompt + f"u{i}", f"x{i}")))
        picks.add(ranks[0][0].node_id)
    assert picks == ({"node-1"} if credit else {"node-1", "node-2"})


def test_router_sends_a_lora_adapters_requests_to_the_replica_that_loaded_it() -> None:
    import asyncio

    a, b = FakeReplica("a"), FakeReplica("b")
    b.multiplexed_model_ids = {"sql"}
    router = make_router(a, b)
    prompt = "the shared system prompt, long enough for chunks. "

    async def route(text: str, request_id: str, adapter: str = "") -> list[list[object]]:
        request = pending(text, request_id, adapter)
        ranks = await router.choose_replicas([a, b], request)
        router.on_request_routed(request, ranks[0][0].replica_id, None)
        return ranks

    # a holds the prompt's prefix (the base model's earlier requests went there).
    router.index.insert(a.replica_id, router._hashes(pending(prompt + "base", "0")))
    # The adapter's requests go to b, which loaded it, despite a's matching prefix; a stays the
    # fallback.
    for i in range(3):
        ranks = asyncio.run(route(prompt + f"sql {i}", f"s{i}", "sql"))
        assert ranks[0] == [b] and ranks[-1] == [a]
    # An adapter nobody loaded yet: routed like any request.
    assert asyncio.run(route("unrelated text for a new adapter", "n", "new"))[0][0] in (a, b)


def test_router_asks_serve_to_back_off_when_no_replica_takes_the_request() -> None:
    # Serve retries a routing round at once unless told to back off: with every replica full
    # that is a busy loop in the ingress (it starved the replicas it was waiting for).
    import asyncio

    a, b = FakeReplica("a"), FakeReplica("b")
    router = make_router(a, b)
    request = pending("any prompt at all", "1")
    asyncio.run(router.choose_replicas([a, b], request))
    assert request.routing_context.should_backoff is True
