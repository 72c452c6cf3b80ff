"""``PoolingServer`` (``cluster.serving.pooling_server``) over a scripted engine, without Ray or
a model: a bi-encoder's score usage counts every text of the request as vLLM does (each text is
still embedded once), and every pooled input is a request in the latency metrics."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.api.replica_messages import EmbedRequest, ScoreRequest, ScoreResult
from cluster.serving.pooling_server import PoolingServer
from engine.outputs import PoolingOutput, PoolingRequestOutput
from tests.cluster.serving.metric_recorders import prometheus_text, recorded_model_metrics


class _Engine:
    """``encode`` of a prompt whose ids are one per character, as a unit vector."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    async def encode(self, prompt: dict[str, Any], params: Any, rid: str) -> PoolingRequestOutput:
        self.prompts.append(prompt["prompt"])
        return PoolingRequestOutput(rid, prompt["prompt_token_ids"], PoolingOutput([1.0, 0.0]))


class _Server(PoolingServer):
    def __init__(self, metrics: Any) -> None:
        self.engine = _Engine()
        self.config = SimpleNamespace(model=SimpleNamespace(task="embed"))
        self.metrics = metrics
        self.model_id = "m"
        self.draining = False
        self.drain_aborted = False
        self._active = set()

    def _ensure_stats_task(self) -> None:
        return None

    async def _ensure_awake(self) -> None:
        return None

    def _prompt(self, request: EmbedRequest) -> dict[str, Any]:
        return {"prompt": request.prompt, "prompt_token_ids": [ord(c) for c in request.prompt]}


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> _Server:
    return _Server(recorded_model_metrics(monkeypatch, "m"))


@pytest.mark.parametrize(
    ("text_1", "text_2", "tokens"),
    [
        (["query"], ["query", "doc"], 5 + 5 + 3),  # one against many: the query once
        (["a", "b"], ["a", "cc"], 1 + 1 + 1 + 2),  # pairwise: every text
    ],
)
def test_bi_encoder_score_usage_counts_every_text_of_the_request(
    server: _Server, text_1: list[str], text_2: list[str], tokens: int
) -> None:
    result = asyncio.run(server.score(ScoreRequest(text_1=text_1, text_2=text_2)))
    assert isinstance(result, ScoreResult) and result.prompt_tokens == tokens
    assert sorted(server.engine.prompts) == sorted(set(text_1 + text_2))  # each embedded once


def test_each_pooled_input_is_a_request_in_the_latency_metrics(server: _Server) -> None:
    asyncio.run(server.embed(EmbedRequest(prompt="hello")))
    asyncio.run(server.score(ScoreRequest(text_1=["q"], text_2=["a", "b"])))
    text = prometheus_text()
    tags = 'model="m",replica="r1"'
    assert f"llm_cluster_e2e_request_latency_seconds_count{{{tags}}} 4\n" in text
    assert f"llm_cluster_time_to_first_token_seconds_count{{{tags}}} 4\n" in text
    assert "inter_token_latency" not in text
