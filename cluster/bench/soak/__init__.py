"""``cluster bench soak``: a soak test, bounded in time, against an OpenAI-compatible endpoint.

    clients  --clients streaming clients loop for --duration (completions and chat, random
             max_tokens); about --cancel-fraction are closed by the client mid-stream
    bursts   every --burst-interval s, one-shot streams up to --burst-size in flight (by
             default 10x max_ongoing_requests: admission control must answer 503)
    rests    after each half (split midway between --warmup and --duration) the clients
             pause until every request ends: every replica must be idle (all KV blocks
             free, no request state), then memory is read
    memory   held memory (after gc and malloc_trim) of each replica, the ingress and Serve's
             proxy, at each rest (growth: second over first) and every --rss-interval s
    ready    GET /health every second during the run: always 200 (a readiness probe would
             otherwise take the busy endpoint out of service)

Every request ends in exactly one outcome (success, error, abort, refused, rejected); anything
else is an anomaly (``outcomes`` defines both). ``python -m cluster.bench.soak --config
configs/tiny.yaml --duration 600`` deploys the config on a new local Ray, runs the soak, prints
the report as JSON and exits 1 on any finding; ``--base-url`` drives a running endpoint instead
(outcomes only, unless ``--address`` attaches to its Ray cluster for the memory and idle checks).

The package, by role: ``load`` (settings, client, the looping clients and bursts),
``outcomes`` (one request's record, outcome and anomalies), ``probes`` (processes, resident
memory, replica state), ``report`` (the summary and its findings) and ``driver`` (one run and
the command line).
"""

from __future__ import annotations

from cluster.bench.soak.driver import add_arguments, main, require_target, run, soak
from cluster.bench.soak.load import SoakLoad, SoakSettings, make_client, stream_request
from cluster.bench.soak.outcomes import OUTCOMES, RequestRecord
from cluster.bench.soak.probes import ReadinessSampler, RssSampler, ServeProbe, replica_is_idle
from cluster.bench.soak.report import findings, summarize

__all__ = [
    "OUTCOMES",
    "ReadinessSampler",
    "RequestRecord",
    "RssSampler",
    "ServeProbe",
    "SoakLoad",
    "SoakSettings",
    "add_arguments",
    "findings",
    "main",
    "make_client",
    "replica_is_idle",
    "require_target",
    "run",
    "soak",
    "stream_request",
    "summarize",
]
