"""The soak's outcome checks: what the client saw of one request (``RequestRecord``), the one
outcome it ended in (``OUTCOMES``) and the anomalies that break the one-outcome rule.

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
client itself consumes silently."""

from __future__ import annotations

from dataclasses import dataclass, field

OUTCOMES = ("success", "error", "abort", "refused", "rejected")


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    id: int
    source: str  # "client" (a looping client) or "burst"
    endpoint: str  # "completions" or "chat"
    max_tokens: int
    cancel_after: int | None  # close the stream after this many chunks; None: read to the end
    start: float
    end: float = 0.0
    status: int | None = None  # HTTP status; None if no response headers came
    error_code: str | None = None
    retry_after_s: float | None = None
    chunks: int = 0  # chunks carrying a choice (usage chunks excluded)
    completion_tokens: int = 0  # from the usage chunk, or the chunks read before an abort
    finishes: list[str] = field(default_factory=list)  # every finish_reason seen
    error_chunks: int = 0
    done_markers: int = 0  # counted by the transport tap
    data_after_done: int = 0
    closed_by_client: bool = False
    broken: str | None = None  # the exception that broke the connection, if one did
    timed_out: bool = False
    server_request_id: str | None = None  # the x-request-id header: finds it in Serve's logs
    last_chunk_at: float | None = None  # seconds from the start of the soak

    @property
    def accepted(self) -> bool:
        return self.status == 200

    def terminal_events(self) -> list[str]:
        events = ["success"] * len(self.finishes) + ["error"] * self.error_chunks
        return events + (["abort"] if self.closed_by_client else [])

    @property
    def outcome(self) -> str:
        """One of ``OUTCOMES``, or "none" / "several" for an accepted request without exactly
        one terminal event (an anomaly)."""
        if not self.accepted:
            return "refused" if self.error_code == "overloaded" else "rejected"
        events = self.terminal_events()
        if len(events) != 1:
            return "none" if not events else "several"
        return events[0]

    def anomalies(self) -> list[str]:
        found = []
        if self.timed_out:
            found.append("hang")
        if self.broken is not None:
            found.append("broken_stream")
        if not self.accepted:
            return found
        events = self.terminal_events()
        if not events and not found:
            found.append("no_terminal_event")
        if len(events) > 1:
            found.append("several_terminal_events")
        if events == ["success"] and self.done_markers == 0:
            found.append("success_without_done")
        if self.done_markers > 1 or self.data_after_done:
            found.append("data_after_done")
        return found
