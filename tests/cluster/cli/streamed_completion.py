"""A long streamed completion of ``tiny-llama`` read on a thread, for the tests that stop or
drain a serving process while requests are in flight (``cluster serve``, ``cluster stop``)."""

from __future__ import annotations

import json
import threading

import httpx


class StreamedCompletion:
    """``max_tokens`` tokens streamed from ``/v1/completions``: its data payloads as they come,
    and the exception that cut the connection, if any. Returns once the first payload came."""

    def __init__(self, http_port: int, max_tokens: int, timeout_s: float = 120) -> None:
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": max_tokens,
                     "ignore_eos": True, "stream": True}  # fmt: skip
        self.url = f"http://127.0.0.1:{http_port}/v1/completions"
        self.timeout_s = timeout_s
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the stream never started"

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=self.timeout_s) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
        except BaseException as exc:
            self.error = exc
        finally:
            self.started.set()

    def finish_reasons(self, timeout_s: float) -> list[str]:
        """The choices' finish reasons, once the stream ended with ``[DONE]`` and no error."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive() and self.error is None, self.error
        assert self.events[-1] == "[DONE]", self.events[-3:]
        chunks = [json.loads(e) for e in self.events[:-1]]
        assert not [c for c in chunks if "error" in c], chunks[-1]
        return [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]

    def ending(self, timeout_s: float) -> str:
        """ "finish_reason=<reason>" or "error=<type>", asserting the stream then sent [DONE]
        and the connection was not cut."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, f"connection broken: {self.error!r} after {self.events[-2:]}"
        assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
        last = json.loads(self.events[-2])
        if "error" in last:
            return f"error={last['error'].get('type')}"
        reasons = [c["finish_reason"] for c in last["choices"] if c["finish_reason"]]
        assert reasons, last
        return f"finish_reason={reasons[0]}"
