"""Prometheus metrics per model, through ``ray.util.metrics``: every replica reports to its
node's Ray metrics agent, so one scrape of the cluster (each node's agent, or the ingress's
``/metrics``, which gathers them all) shows every replica, tagged by model and replica. Ray's
exporter names each with its ``ray_`` prefix (``ray_llm_cluster_requests_running``) and adds
its own labels (``Component``, ``NodeAddress``, ``SessionName``, ``Version``, ``WorkerId``).

Beyond the engine's queue, KV and latency series, each group below appears where it applies:

- mixture of experts, per sparse layer: ``llm_cluster_moe_expert_tokens_total{layer, expert}``
  (a token counts once per top-k expert) and ``_moe_expert_load_imbalance{layer}`` (max / mean
  of the layer's counts since start: 1 is even; a recent window is PromQL, README);
- data parallelism, per core: ``llm_cluster_core_requests_running``, ``_requests_waiting``,
  ``_kv_cache_usage_perc``;
- the node's KV store: ``llm_cluster_kv_store_{bytes,files,evicted_files,capacity_bytes}``;
- sleep mode: ``llm_cluster_sleep_level`` (0 awake), ``_sleeps_total``, ``_wakes_total``,
  ``_sleep_seconds``, ``_wake_seconds``;
- speculative decoding (vLLM's names): ``llm_cluster_spec_decode_num_drafts_total``,
  ``_num_draft_tokens_total``, ``_num_accepted_tokens_total``,
  ``_num_accepted_tokens_per_pos_total{position}`` (mean acceptance length = 1 + accepted /
  drafts; acceptance rate = accepted / proposed).
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray.util.metrics import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from engine.client.async_llm_engine import EngineStats

PREFIX = "llm_cluster_"
_TAGS = ("model", "replica")
# Seconds. Request latencies take vLLM's bucket sets (vllm/v1/metrics/buckets.py), so its
# dashboards' quantiles read the same: first token from 1 ms, token gaps from 10 ms, whole
# requests from 0.3 s to two hours. Sleep and wake times keep the general set.
_LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
TTFT_BOUNDARIES = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BOUNDARIES = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
E2E_BOUNDARIES = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                  60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip


class ModelMetrics:
    """The metric objects of one replica of one model."""

    def __init__(self, model_id: str, replica_id: str) -> None:
        self.tags = {"model": model_id, "replica": replica_id}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, tag_keys=_TAGS)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, tag_keys=_TAGS)

        def histogram(
            name: str, doc: str, boundaries: list[float] = _LATENCY_BOUNDARIES
        ) -> Histogram:
            return Histogram(PREFIX + name, doc, boundaries, tag_keys=_TAGS)

        self.running = gauge("requests_running", "Requests in the running batch.")
        self.waiting = gauge("requests_waiting", "Requests waiting or swapped out.")
        self.kv_usage = gauge(
            "kv_cache_usage_perc", "KV cache usage, a fraction: 1 means every block in use."
        )
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prompt tokens found cached.")
        self.prefix_queries = counter(
            "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("prefix_cache_hits_total", "Prompt tokens found cached.")
        self.external_queries = counter(
            "external_prefix_cache_queries_total",
            "Prompt tokens looked up in the KV store (kv_transfer_config) after the device cache.",
        )
        self.external_hits = counter(
            "external_prefix_cache_hits_total", "Prompt tokens loaded from the KV store."
        )
        self.preemptions = counter("preemptions_total", "Requests preempted.")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", TTFT_BOUNDARIES
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", ITL_BOUNDARIES
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, end to end.", E2E_BOUNDARIES
        )
        from engine.client.async_llm_engine import EngineStats  # torch: only replicas that have one

        self._last = EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0)
        self.expert_tokens = Counter(
            PREFIX + "moe_expert_tokens_total",
            "MoE: tokens routed to each expert of each sparse layer (once per top-k expert).",
            tag_keys=(*_TAGS, "layer", "expert"),
        )
        self.expert_imbalance = Gauge(
            PREFIX + "moe_expert_load_imbalance",
            "MoE: max / mean of a sparse layer's per-expert token counts (1 = even).",
            tag_keys=(*_TAGS, "layer"),
        )
        core_tags = (*_TAGS, "core")
        self.core_running = Gauge(
            PREFIX + "core_requests_running",
            "Requests running on the engine core.",
            tag_keys=core_tags,
        )
        self.core_waiting = Gauge(
            PREFIX + "core_requests_waiting",
            "Requests waiting on the engine core.",
            tag_keys=core_tags,
        )
        self.core_kv_usage = Gauge(
            PREFIX + "core_kv_cache_usage_perc",
            "The engine core's KV cache usage, a fraction: 1 means every block in use.",
            tag_keys=core_tags,
        )
        # Speculative decoding (vLLM's metric names).
        self.spec_drafts = counter("spec_decode_num_drafts_total", "Verification steps.")
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens_total", "Speculative tokens proposed."
        )
        self.spec_accepted = counter(
            "spec_decode_num_accepted_tokens_total", "Speculative tokens accepted."
        )
        self.spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos_total",
            "Speculative tokens accepted at each proposal position (0-based).",
            tag_keys=(*_TAGS, "position"),
        )
        # The node's KV store (kv_transfer_config SharedStorageConnector), as this replica sees it.
        self.kv_store_bytes = gauge("kv_store_bytes", "Bytes of KV blocks in the node's store.")
        self.kv_store_files = gauge("kv_store_files", "Block shard files in the node's store.")
        self.kv_store_evicted = gauge(
            "kv_store_evicted_files", "Files evicted from the node's store since it began."
        )
        self.kv_store_capacity = gauge(
            "kv_store_capacity_bytes", "The store's bound (max_storage_bytes)."
        )
        # Sleep mode (engine.worker.sleep_mode): transitions and their times.
        self.sleeping = gauge("sleep_level", "The engine's sleep level (0: awake).")
        self.sleeps = counter("sleeps_total", "Times the engine was put to sleep.")
        self.wakes = counter("wakes_total", "Times the engine woke up.")
        self.sleep_time = histogram("sleep_seconds", "Time to put the engine to sleep.")
        self.wake_time = histogram("wake_seconds", "Time to wake the engine up.")
        adapter_tags = (*_TAGS, "adapter")
        self.adapter_requests = Counter(
            PREFIX + "lora_requests_total", "Requests per LoRA adapter.", tag_keys=adapter_tags
        )
        self.adapter_tokens = Counter(
            PREFIX + "lora_generation_tokens_total",
            "Tokens generated per LoRA adapter.",
            tag_keys=adapter_tags,
        )

    def publish_kv_store(self, used: int, files: int, evicted: int, capacity: int) -> None:
        self.kv_store_bytes.set(used, self.tags)
        self.kv_store_files.set(files, self.tags)
        self.kv_store_evicted.set(evicted, self.tags)
        self.kv_store_capacity.set(capacity, self.tags)

    def on_sleep(self, level: int, seconds: float) -> None:
        self.sleeps.inc(1, self.tags)
        self.sleeping.set(level, self.tags)
        self.sleep_time.observe(seconds, self.tags)

    def on_start_asleep(self) -> None:
        """A replica that started asleep (no engine yet): level 2, nothing held."""
        self.sleeping.set(2, self.tags)

    def on_wake(self, seconds: float) -> None:
        self.wakes.inc(1, self.tags)
        self.sleeping.set(0, self.tags)
        self.wake_time.observe(seconds, self.tags)

    def on_adapter_request(self, adapter: str) -> None:
        self.adapter_requests.inc(1, {**self.tags, "adapter": adapter})

    def on_adapter_tokens(self, adapter: str, num_tokens: int) -> None:
        if num_tokens > 0:
            self.adapter_tokens.inc(num_tokens, {**self.tags, "adapter": adapter})

    def publish(self, stats: EngineStats) -> None:
        """Set gauges from a snapshot and advance counters by what changed since the last."""
        self.running.set(stats.num_running, self.tags)
        self.waiting.set(stats.num_waiting, self.tags)
        self.kv_usage.set(stats.kv_usage, self.tags)  # vLLM's 0-1, not percent
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate, self.tags)
        last, self._last = self._last, stats
        for counter, now, before in (
            (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
            (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
            (
                self.external_queries,
                stats.external_prefix_cache_queries,
                last.external_prefix_cache_queries,
            ),
            (
                self.external_hits,
                stats.external_prefix_cache_hits,
                last.external_prefix_cache_hits,
            ),
            (self.preemptions, stats.num_preemptions, last.num_preemptions),
            (self.prompt_tokens, stats.prompt_tokens_total, last.prompt_tokens_total),
            (self.generation_tokens, stats.generation_tokens_total, last.generation_tokens_total),
            (self.spec_drafts, stats.spec_num_drafts, last.spec_num_drafts),
            (self.spec_draft_tokens, stats.spec_num_draft_tokens, last.spec_num_draft_tokens),
            (self.spec_accepted, stats.spec_num_accepted_tokens, last.spec_num_accepted_tokens),
        ):
            if now > before:
                counter.inc(now - before, self.tags)
        self._publish_expert_load(stats.moe_expert_tokens, last.moe_expert_tokens)
        for index, core in enumerate(stats.cores):
            tags = {**self.tags, "core": str(index)}
            self.core_running.set(core.num_running, tags)
            self.core_waiting.set(core.num_waiting, tags)
            self.core_kv_usage.set(core.kv_usage, tags)
        before = last.spec_accepted_per_pos
        for pos, now in enumerate(stats.spec_accepted_per_pos):
            added = now - (before[pos] if pos < len(before) else 0)
            if added > 0:
                self.spec_accepted_per_pos.inc(added, {**self.tags, "position": str(pos)})

    def _publish_expert_load(
        self, tokens: dict[int, list[int]], before: dict[int, list[int]]
    ) -> None:
        for layer, counts in tokens.items():
            layer_tags = {**self.tags, "layer": str(layer)}
            previous = before.get(layer, [])
            for expert, now in enumerate(counts):
                added = now - (previous[expert] if expert < len(previous) else 0)
                if added > 0:
                    self.expert_tokens.inc(added, {**layer_tags, "expert": str(expert)})
            imbalance = expert_load_imbalance(counts)
            if imbalance is not None:
                self.expert_imbalance.set(imbalance, layer_tags)

    def on_pooled(self, start: float, at: float) -> None:
        """A pooling request's one output, its first output and its end at once (vLLM records
        both for embeddings, score and classify)."""
        self.ttft.observe(at - start, self.tags)
        self.e2e.observe(at - start, self.tags)

    def request_timer(self, start: float) -> RequestTimer:
        return RequestTimer(self, start)


def expert_load_imbalance(tokens_per_expert: list[int]) -> float | None:
    """Max over mean of one layer's per-expert token counts (1.0 when even, the number of
    experts when every token went to one); None before any token was routed."""
    total = sum(tokens_per_expert)
    if not tokens_per_expert or total <= 0:
        return None
    return max(tokens_per_expert) * len(tokens_per_expert) / total


@dataclass
class RequestTimer:
    """Latencies of one request: first token, each gap between steps, and the whole. As
    vLLM's: one inter-token sample per sequence per step, the whole gap (a step that gives a
    sequence several tokens, speculative decoding's, is one gap); ``sequences`` is the
    request's ``n`` (vLLM runs each as a request of its own)."""

    metrics: ModelMetrics
    start: float
    last_token: float | None = None
    sequences: int = 1

    def on_tokens(self, at: float, num_tokens: int) -> None:
        """``num_tokens`` new tokens at ``at``, over all of the request's sequences."""
        if num_tokens <= 0:
            return
        if self.last_token is None:
            self.metrics.ttft.observe(at - self.start, self.metrics.tags)
        else:
            gap = at - self.last_token
            for _ in range(min(num_tokens, self.sequences)):  # the sequences that advanced
                self.metrics.itl.observe(gap, self.metrics.tags)
        self.last_token = at

    def finish(self, at: float) -> None:
        self.metrics.e2e.observe(at - self.start, self.metrics.tags)


def scrape_cluster_metrics() -> str:
    """Every alive node's Ray metrics agent, filtered to this project's metrics: one scrape
    shows every replica of every model."""
    lines: list[str] = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        url = f"http://{node['NodeManagerAddress']}:{port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            continue
        lines += [line for line in text.splitlines() if PREFIX in line]
    return "\n".join(lines) + "\n"
