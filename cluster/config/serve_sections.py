"""Serve's per-model options in the deployment YAML (``deployment_config``, with Ray Serve's
names): replicas and autoscaling, the request router and its knobs, the drain, and the
placement group (its strategy, and per-worker bundles that may ask for a fraction of a GPU);
each section's ``check(path)`` and what it hands to Serve (``serve_options``).
``cluster.config.deployment`` holds the tree they hang in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.validation import check_int, check_number, is_number, require

Strategy = Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"]
RequestRouterName = Literal["prefix_aware", "pow2"]
AutoscalingPolicyName = Literal["engine", "ongoing_requests"]


@dataclass(frozen=True)
class AutoscalingConfig:
    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    # Deprecated by Serve but still bounds look_back_period_s from below; omitted when unset.
    metrics_interval_s: float | None = None
    downscale_to_zero_delay_s: float | None = None  # the 1 -> 0 step; downscale_delay_s if unset
    # Ours, not Serve's: "engine" (cluster.serving.autoscaling_policy) scales on the replicas'
    # waiting queue and KV usage besides ongoing requests; "ongoing_requests" is Serve's own policy.
    policy: AutoscalingPolicyName = "engine"
    target_num_waiting: float = 2.0  # engine policy: mean waiting requests per replica
    target_kv_usage: float = 0.85  # engine policy: mean fraction of KV blocks in use

    def check(self, path: str) -> None:
        low = self.min_replicas
        check_int(low, f"{path}.min_replicas", ge=0)
        # Named only when it is the bound: max_replicas is at least 1 whatever min_replicas is.
        high = self.max_replicas
        note = "min_replicas" if low > 1 else ""
        check_int(high, f"{path}.max_replicas", ge=max(1, low), note=note)
        check_int(
            self.initial_replicas,
            f"{path}.initial_replicas",
            ge=low,
            le=high,
            note="min_replicas, max_replicas",
            optional=True,
        )
        for name in ("target_ongoing_requests", "look_back_period_s", "target_num_waiting"):
            check_number(getattr(self, name), f"{path}.{name}", gt=0)
        check_number(self.metrics_interval_s, f"{path}.metrics_interval_s", gt=0, optional=True)
        for name in ("upscale_delay_s", "downscale_delay_s"):
            check_number(getattr(self, name), f"{path}.{name}", ge=0)
        name = "downscale_to_zero_delay_s"
        check_number(getattr(self, name), f"{path}.{name}", ge=0, optional=True)
        check_number(self.target_kv_usage, f"{path}.target_kv_usage", gt=0, le=1)

    def serve_options(self) -> dict[str, Any]:
        """Serve's ``autoscaling_config``: its own keys, and the engine policy with its targets
        as ``policy_kwargs``."""
        ours = ("policy", "target_num_waiting", "target_kv_usage")
        options = {
            k: v for k, v in dataclasses.asdict(self).items() if v is not None and k not in ours
        }
        if self.policy == "engine":
            options["policy"] = {
                "policy_function": ENGINE_AUTOSCALING_POLICY,
                "policy_kwargs": {
                    "target_num_waiting": self.target_num_waiting,
                    "target_kv_usage": self.target_kv_usage,
                },
            }
        return options


# Serve imports it by path on the deploying machine and ships it by value to its controller.
ENGINE_AUTOSCALING_POLICY = "cluster.serving.autoscaling_policy:EngineSignalPolicy"
ROUTER_CLASSES: dict[str, str] = {
    "prefix_aware": "cluster.serving.prefix_router:PrefixAwareRouter",
    "pow2": "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter",
}


@dataclass(frozen=True)
class PrefixRouterConfig:
    """The prefix-aware router's knobs (``cluster.serving.prefix_router``)."""

    chunk_chars: int = 64  # the prompt is hashed in chunks of this many characters (or 16 ids)
    max_chunks_per_replica: int = 65536  # LRU bound of each replica's set of chunk hashes
    # A longest-prefix replica is skipped for the least-loaded one when its ongoing requests
    # exceed the least-loaded one's by more than balance_abs_threshold AND by a factor of
    # more than balance_rel_threshold (SGLang's cache-aware router's balance rule).
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    # Below this fraction of the prompt matched, the request goes to the least-loaded replica.
    min_match_fraction: float = 0.1
    routing_stats_period_s: float = 1.0  # how often replicas report queue / KV usage
    # With a KV store on each node (kv_transfer_config SharedStorageConnector): a chunk that a
    # replica's node's store holds counts this much of one in the replica's own cache.
    kv_store_credit: float = 0.5

    def check(self, path: str) -> None:
        check_int(self.chunk_chars, f"{path}.chunk_chars", ge=1)
        check_int(self.max_chunks_per_replica, f"{path}.max_chunks_per_replica", ge=1)
        check_int(self.balance_abs_threshold, f"{path}.balance_abs_threshold", ge=0)
        check_number(self.balance_rel_threshold, f"{path}.balance_rel_threshold", ge=1)
        check_number(self.min_match_fraction, f"{path}.min_match_fraction", ge=0, le=1)
        check_number(self.routing_stats_period_s, f"{path}.routing_stats_period_s", gt=0)
        check_number(self.kv_store_credit, f"{path}.kv_store_credit", ge=0, le=1)

    def router_kwargs(self) -> dict[str, Any]:
        kwargs = dataclasses.asdict(self)
        del kwargs["routing_stats_period_s"]
        return kwargs


# Seconds between the end of a replica's drain (leftover requests aborted) and Serve's
# force-kill of it.
DRAIN_ABORT_MARGIN_S = 5.0


@dataclass(frozen=True)
class ServeDeploymentConfig:
    """Passed to Serve with Serve's names. Without ``autoscaling_config`` the model runs
    ``num_replicas`` replicas (default 1)."""

    num_replicas: int | None = None
    autoscaling_config: AutoscalingConfig | None = None
    max_ongoing_requests: int = 64
    max_queued_requests: int = -1  # -1: unbounded; beyond it requests get 503
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    graceful_shutdown_timeout_s: float = 20.0
    # None: prefix_aware when the model can run more than one replica, else pow2 (Serve's).
    request_router: RequestRouterName | None = None
    prefix_router: PrefixRouterConfig = field(default_factory=PrefixRouterConfig)
    # A model scaled to zero: how long a request waits for its first item (a replica to start,
    # then its prefill) before a 503 with Retry-After. Only used when min_replicas is 0.
    cold_start_timeout_s: float = 300.0

    @property
    def max_replicas(self) -> int:
        if self.autoscaling_config is not None:
            return self.autoscaling_config.max_replicas
        return self.num_replicas or 1

    @property
    def scales_to_zero(self) -> bool:
        return self.autoscaling_config is not None and self.autoscaling_config.min_replicas == 0

    @property
    def router(self) -> RequestRouterName:
        if self.request_router is not None:
            return self.request_router
        return "prefix_aware" if self.max_replicas > 1 else "pow2"

    def check(self, path: str) -> None:
        require(
            self.num_replicas is None or self.autoscaling_config is None,
            f"{path}.num_replicas",
            "cannot be set together with autoscaling_config",
        )
        check_int(self.num_replicas, f"{path}.num_replicas", ge=1, optional=True)
        if self.autoscaling_config is not None:
            self.autoscaling_config.check(f"{path}.autoscaling_config")
        check_int(self.max_ongoing_requests, f"{path}.max_ongoing_requests", ge=1)
        # -1 is the one negative value allowed: no bound on the queue.
        check_int(
            self.max_queued_requests, f"{path}.max_queued_requests", ge=-1, note="-1: unbounded"
        )
        for name in ("health_check_period_s", "health_check_timeout_s",
                     "graceful_shutdown_timeout_s", "cold_start_timeout_s"):  # fmt: skip
            check_number(getattr(self, name), f"{path}.{name}", gt=0)
        self.prefix_router.check(f"{path}.prefix_router")

    def request_router_config(self) -> dict[str, Any]:
        """Serve's ``request_router_config`` for this model."""
        config: dict[str, Any] = {"request_router_class": ROUTER_CLASSES[self.router]}
        if self.router == "prefix_aware":
            config["request_router_kwargs"] = self.prefix_router.router_kwargs()
            config["request_routing_stats_period_s"] = self.prefix_router.routing_stats_period_s
        return config

    def serve_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            # The replica drains for graceful_shutdown_timeout_s, then aborts what is left;
            # Serve's force-kill waits a little longer so those aborts reach the clients.
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s + DRAIN_ABORT_MARGIN_S,
        }
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = self.autoscaling_config.serve_options()
        else:
            options["num_replicas"] = self.num_replicas or 1
        options["request_router_config"] = self.request_router_config()
        return options


@dataclass(frozen=True)
class PlacementGroupConfig:
    """Ray Serve LLM's ``placement_group_config``. ``bundles``: one bundle per worker (or one
    for all), each the worker's device share (``GPU``, or ``CPU`` on a CPU deployment: 1, or a
    fraction in (0, 1) when the model has one worker, so that several replicas share one
    device) and, on a GPU deployment, the ``CPU`` it reserves besides. The replica's own
    bundles are laid out from them (``ModelDeployment.placement_group_bundles``)."""

    bundles: list[dict[str, float]] | None = None
    strategy: Strategy = "PACK"

    def check(self, path: str, unit: str, num_workers: int) -> None:
        """``unit``: the device resource (``GPU`` or ``CPU``); ``num_workers``: TP x PP x DP."""
        if self.bundles is None:
            return
        where = f"{path}.bundles"
        require(
            len(self.bundles) in (1, num_workers),
            where,
            f"must list 1 bundle (every worker's) or one per worker "
            f"(tensor_parallel_size x pipeline_parallel_size x data_parallel_size = "
            f"{num_workers}), got {len(self.bundles)}",
        )
        allowed = sorted({unit, "CPU"})
        for i, bundle in enumerate(self.bundles):
            at = f"{where}[{i}]"
            for key in bundle:
                require(
                    key in allowed,
                    f"{at}.{key}",
                    f"unknown resource (allowed: {', '.join(allowed)}; the accelerator type is "
                    "the model's accelerator_type)",
                )
            require(unit in bundle, f"{at}.{unit}", "is required (the worker's device share)")
            share = bundle[unit]
            check_number(share, f"{at}.{unit}", gt=0, le=1, note="1, or a fraction < 1")
            require(
                share == 1 or num_workers == 1,
                f"{at}.{unit}",
                f"must be 1 with {num_workers} workers (tensor_parallel_size x "
                f"pipeline_parallel_size x data_parallel_size), got {share!r}: a fraction of a "
                "device is for a model with one worker; Ray may put two fractional workers of "
                "one placement group on the same device, and NCCL cannot run two ranks of one "
                "group on one device",
            )
            if unit != "CPU":
                check_number(bundle.get("CPU"), f"{at}.CPU", ge=0, optional=True)

    def worker_bundle(self, rank: int, unit: str) -> dict[str, float]:
        """Worker ``rank``'s bundle as given (``{unit: 1}`` when ``bundles`` is unset)."""
        if self.bundles is None:
            return {unit: 1.0}
        bundle = self.bundles[rank if len(self.bundles) > 1 else 0]
        return {key: float(value) for key, value in bundle.items()}

    def device_share(self, unit: str) -> float:
        """The device share each worker asks for: 1, or the fraction of a one-worker model
        (1 for a value ``check`` refuses, so that an unchecked config can still be planned)."""
        shares = [bundle.get(unit) for bundle in self.bundles or []]
        numbers = [float(share) for share in shares if is_number(share) and 0 < share < 1]
        return min(numbers, default=1.0)
