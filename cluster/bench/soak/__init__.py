"""``cluster bench soak``: a soak test, bounded in time, against an OpenAI-compatible endpoint.

    clients  --clients streaming clients loop until --duration: completions (random token-id
             prompts) and chat (random words), random max_tokens; about --cancel-fraction of the
             requests are closed by the client at a random point of their stream
    bursts   every --burst-interval s, one-shot streams sent at once, enough to bring the burst
             requests in flight up to --burst-size (by default 10x the model's
             max_ongoing_requests: well above capacity, so admission control must answer 503
             rather than queue without bound); the first falls inside the warm-up
    memory   the resident set of each model replica, the ingress and Serve's HTTP proxy,
             sampled every --rss-interval s; the --warmup s (allocator pools filling, the first
             burst) are left out and the rest of --duration (not the tail in which the last
             requests finish) split into two halves by time: growth is the median of the
             second half over the median of the first
    idle     after the run every replica of the model is polled until idle: free KV blocks
             must equal the total and no per-request state may remain on the head or workers

Every request ends in exactly one outcome:

    success   HTTP 200, one finish_reason (stop / length), then [DONE]
    error     HTTP 200, then an error chunk
    abort     HTTP 200, then the client closed the stream before it finished
    refused   HTTP 503 "overloaded" before the stream (admission control): never accepted
    rejected  any other failure before the stream: never accepted, and a finding, since the
              soak sends only valid requests

An accepted request is one that got its 200 (the server had taken it: the ingress answers only
after the model server validated and enqueued it). Anything else is an anomaly: a stream that
ends without a finish_reason or error chunk, or a success without [DONE]; a second terminal
event (two finish_reasons, a finish then an error, data after [DONE]); a connection broken
mid-stream; a request that outlives its client timeout (a hang). Streams are read with the
official ``openai`` client; a tap on its HTTP transport counts the [DONE] markers that the
client itself consumes silently.

``python -m cluster.bench.soak --config configs/tiny.yaml --duration 600`` deploys the config
on a new local Ray, runs the soak, prints the report as JSON and exits 1 on any finding;
``--base-url`` drives a running endpoint instead (outcomes only, unless ``--address`` attaches
to its Ray cluster for the memory and idle checks).

The package, by role: ``load`` (settings, client, the looping clients and bursts),
``outcomes`` (one request's record, outcome and anomalies), ``probes`` (processes, resident
memory, replica state), ``report`` (the summary and its findings) and ``driver`` (one run and
the command line).
"""

from __future__ import annotations

from cluster.bench.soak.driver import add_arguments, main, require_target, run, soak
from cluster.bench.soak.load import SoakLoad, SoakSettings, make_client, stream_request
from cluster.bench.soak.outcomes import OUTCOMES, RequestRecord
from cluster.bench.soak.probes import RssSampler, ServeProbe, replica_is_idle
from cluster.bench.soak.report import findings, summarize

__all__ = [
    "OUTCOMES",
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
