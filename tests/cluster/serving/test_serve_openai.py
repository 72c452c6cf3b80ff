"""configs/tiny.yaml on a local Ray, driven like users drive it: the official ``openai`` client,
raw HTTP for the error contract and disconnects, and a gRPC client. The app is deployed with an
API key (from an environment variable, as a user would) so every request also proves the key
check runs on the app Serve actually serves."""

from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from openai import NotFoundError, OpenAI

from cluster.proto import llm_pb2, llm_pb2_grpc
from engine import LLM, SamplingParams
from tests.cluster.conftest import ServeCluster, load_yaml, wait_for

APP = "tiny"
MODEL = "tiny-llama"
PROMPT = "The capital of the tiny model is"
# A second model with one seat and one waiting slot: admission control is seen over HTTP / gRPC.
QUEUED = "tiny-queued"
KEY = "sk-tiny-test"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def base_url(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    config = load_yaml("tiny.yaml")
    queued = {**config["models"][0], "model_loading_config": {
        "model_id": QUEUED, "model_source": "builtin:tiny-llama"}}  # fmt: skip
    queued["engine_kwargs"] = {**queued["engine_kwargs"], "num_kv_blocks": 128,
                               "max_num_seqs": 1, "max_waiting_requests": 1}  # fmt: skip
    config["models"] = [config["models"][0], queued]
    yield serve_cluster.deploy(config, APP, "/", api_keys=f"sk-other,{KEY}")
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline() -> LLM:
    engine_kwargs = load_yaml("tiny.yaml")["models"][0]["engine_kwargs"]
    return LLM("builtin:tiny-llama", **engine_kwargs)


def greedy(offline: LLM, prompt: Any, max_tokens: int, **kw: Any) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    if isinstance(prompt, list):
        return offline.chat(prompt, params, use_tqdm=False)[0].outputs[0].text
    return offline.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def post(
    base_url: str, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **(AUTH if headers is None else headers)}
    request = urllib.request.Request(base_url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def engine_stats(model: str = MODEL) -> dict[str, Any]:
    from ray import serve

    handle = serve.get_deployment_handle(f"LLMServer:{model}", APP)
    return handle.stats.remote().result(timeout_s=30)


# ---- the openai client ----


def test_models_lists_the_configured_models(client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL, QUEUED]


def test_greedy_completion_equals_offline_llm(client: OpenAI, offline: LLM) -> None:
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    assert response.choices[0].text == greedy(offline, PROMPT, 20)
    assert response.usage.completion_tokens == 20


def test_greedy_streamed_completion_equals_offline_llm(client: OpenAI, offline: LLM) -> None:
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == greedy(offline, PROMPT, 20)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completion_uses_the_chat_template(client: OpenAI, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == greedy(offline, messages, 12)


def test_streamed_chat_with_usage_ends_with_a_usage_chunk(client: OpenAI, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Stream please."}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy(offline, messages, 10)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 10


def test_stop_string_ends_the_completion_before_it(client: OpenAI, offline: LLM) -> None:
    full = greedy(offline, PROMPT, 20)
    stop = full[6:9]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop]
    )
    assert response.choices[0].text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_stop_reason_names_the_matched_stop_string(client: OpenAI, offline: LLM) -> None:
    # vLLM's stop_reason, which the openai client keeps as an extra attribute.
    full = greedy(offline, PROMPT, 20)
    stop = full[6:9]
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20,
                              "temperature": 0, "stop": [stop]}  # fmt: skip
    response = client.completions.create(**kwargs)
    assert response.choices[0].stop_reason == stop
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].stop_reason == stop
    ended = client.completions.create(**{**kwargs, "stop": None})
    assert (ended.choices[0].finish_reason, ended.choices[0].stop_reason) == ("length", None)


def test_null_sampling_fields_from_the_client_are_the_defaults(client: OpenAI) -> None:
    # The openai client sends None as null; OpenAI's schema and vLLM take it as "not given".
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        temperature=None, top_p=None, n=None, presence_penalty=None, logprobs=None,
    )  # fmt: skip
    assert len(response.choices) == 1 and response.usage.completion_tokens == 2


def test_chat_echo_starts_the_answer_with_the_prefilled_message(client: OpenAI) -> None:
    """vLLM's chat ``echo`` with a prefill (``continue_final_message``): the answer, whole and
    streamed, is the last assistant message's text and then what the model wrote after it."""
    kwargs = {"model": MODEL, "max_tokens": 4, "temperature": 1.0, "seed": 3,
              "messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "Sure, the"}],
              "extra_body": {"echo": True, "add_generation_prompt": False,
                             "continue_final_message": True, "ignore_eos": True}}  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert whole.startswith("Sure, the") and len(whole) > len("Sure, the")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


# ---- n choices, logprobs, penalties ----


def test_n_seeded_choices_are_indexed_and_differ(client: OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1, n=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.text for c in response.choices}) > 1
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 3 * 8


def test_streamed_chat_n_choices_join_to_the_whole_response(client: OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Two of them."}],
              "max_tokens": 8, "temperature": 1.0, "seed": 4, "n": 2,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert {c.choices[0].index for c in chunks} == {0, 1}
    for choice in whole.choices:
        parts = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert parts[0].delta.role == "assistant"
        assert "".join(p.delta.content or "" for p in parts) == choice.message.content
        assert parts[-1].finish_reason == "length"


def test_completion_logprobs_are_top_k_plus_the_sampled_token(client: OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.top_logprobs) == 8
    # vLLM's rule: a byte token's text is "" until a token finishes its character (which then
    # carries all of it); a byte no token finishes stays "", the text shows U+FFFD for it.
    assert "".join(logprobs.tokens) == response.choices[0].text.replace("\ufffd", "")
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    for token_logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 + 1
        assert token_logprob == pytest.approx(max(top.values()))  # greedy: the most likely
    assert logprobs.text_offset[0] == 0


def test_streamed_completion_chunks_carry_their_own_logprobs(client: OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == whole.tokens
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == whole.text_offset


def test_chat_logprobs_have_top_logprobs_alternatives(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Logprobs?"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 6
    for token in content:
        assert [t.logprob for t in token.top_logprobs] == sorted(
            (t.logprob for t in token.top_logprobs), reverse=True
        )
        assert len(token.top_logprobs) == 2
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)
        assert token.bytes == list(token.token.encode())


def test_chat_top_logprobs_over_the_cap_is_400_naming_it(base_url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
            "top_logprobs": 21}  # fmt: skip
    code, payload = post(base_url, "/v1/chat/completions", body)
    assert (code, payload["error"]["param"]) == (400, "top_logprobs")


def test_prompt_logprobs_come_back_where_vllm_puts_them(client: OpenAI, offline: LLM) -> None:
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0].prompt_logprobs  # fmt: skip
    got = completion.choices[0].prompt_logprobs  # vLLM's extra field, on each choice
    assert got[0] is None and len(got) == len(ref) == completion.usage.prompt_tokens
    for entry, expected in zip(got[1:], ref[1:], strict=True):
        assert list(entry) == [str(t) for t in expected]
        for token, lp in expected.items():
            assert entry[str(token)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert (entry[str(token)]["rank"], entry[str(token)]["decoded_token"]) == (
                lp.rank, lp.decoded_token)  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens  # on the response


def test_penalties_and_vllm_extras_reach_the_engine(client: OpenAI, offline: LLM) -> None:
    extras = {"repetition_penalty": 1.5, "min_tokens": 4, "logit_bias": {"5": -100}}
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, frequency_penalty=1.0,
        extra_body=extras,
    )  # fmt: skip
    expected = greedy(offline, PROMPT, 12, frequency_penalty=1.0, repetition_penalty=1.5,
                      min_tokens=4, logit_bias={5: -100.0})  # fmt: skip
    assert response.choices[0].text == expected
    assert expected != greedy(offline, PROMPT, 12)  # the penalties changed the output


def test_missing_or_wrong_api_key_is_401(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"authorization": "Bearer sk-wrong"}):
        code, payload = post(base_url, "/v1/completions", body, headers)
        assert code == 401
        assert payload["error"]["type"] == "AuthenticationError"


def test_unknown_model_is_404(client: OpenAI) -> None:
    with pytest.raises(NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert info.value.body["param"] == "model"


# ---- raw HTTP: the SSE framing and the error contract ----


def test_sse_stream_ends_with_done(base_url: str) -> None:
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    conn.request(
        "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json", **AUTH}
    )
    response = conn.getresponse()
    events = [e for e in response.read().decode().split("\n\n") if e]
    conn.close()
    assert response.getheader("content-type").startswith("text/event-stream")
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])


BAD_INPUTS = [
    ("malformed JSON", b'{"model": "tiny-llama", "prompt": ', 400, None),
    ("wrong type", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("out of range", {"model": MODEL, "prompt": "x", "temperature": -1.0}, 400, "temperature"),
    ("top_p range", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("too long", {"model": MODEL, "prompt": "word " * 1100, "max_tokens": 1}, 400, "prompt"),
    ("n over max_n", {"model": MODEL, "prompt": "x", "n": 200}, 400, "n"),
    ("logprobs over max", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (
        "penalty range",
        {"model": MODEL, "prompt": "x", "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
    ("logit_bias key", {"model": MODEL, "prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("suffix", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    (
        "output-changing unknown field",
        {"model": MODEL, "prompt": "x", "functions": []},
        400,
        "functions",
    ),
    ("missing prompt", {"model": MODEL}, 400, "prompt"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages"),
    ("unknown model", {"model": "nope", "prompt": "x"}, 404, "model"),
]


@pytest.mark.parametrize(
    ("case", "body", "status", "param"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_gets_an_openai_error_body(
    base_url: str, case: str, body: Any, status: int, param: str | None
) -> None:
    path = "/v1/chat/completions" if case == "empty messages" else "/v1/completions"
    code, payload = post(base_url, path, body)
    assert code == status
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["param"] == param
    assert "Traceback" not in payload["error"]["message"]


def test_body_over_the_limit_is_413(base_url: str) -> None:
    code, payload = post(base_url, "/v1/completions", {"model": MODEL, "prompt": "x" * (2 << 20)})
    assert code == 413
    assert payload["error"]["type"] == "RequestTooLargeError"


def test_server_keeps_serving_after_bad_input(base_url: str, client: OpenAI) -> None:
    for _, body, _, _ in BAD_INPUTS:
        post(base_url, "/v1/completions", body)
    response = client.completions.create(model=MODEL, prompt="still alive", max_tokens=3)
    assert response.usage.completion_tokens == 3


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(base_url: str) -> None:
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    conn.request(
        "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json", **AUTH}
    )
    response = conn.getresponse()
    assert response.readline().startswith(b"data: {")
    running = engine_stats()
    conn.sock.close()
    conn.close()
    assert running["num_running"] == 1 and running["kv_free_blocks"] < running["kv_total_blocks"]
    wait_for(
        lambda: (
            (s := engine_stats())["num_running"] == 0
            and s["kv_free_blocks"] == s["kv_total_blocks"]
        ),
        timeout_s=20,
        what="the disconnected request to be aborted and its blocks freed",
    )
    # Aborted, not finished: far fewer than the 900 tokens it asked for were generated.
    assert engine_stats()["generation_tokens_total"] - running["generation_tokens_total"] < 800


# ---- the other routes ----


def test_tokenize_then_detokenize_round_trips(base_url: str, offline: LLM) -> None:
    code, tokens = post(base_url, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert code == 200
    assert tokens["tokens"] == offline.get_tokenizer().encode(PROMPT)
    code, text = post(base_url, "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    assert (code, text["prompt"]) == (200, offline.get_tokenizer().decode(tokens["tokens"]))


def test_health_is_ok_without_an_api_key(base_url: str) -> None:
    with urllib.request.urlopen(base_url + "/health", timeout=30) as response:
        assert (response.status, json.loads(response.read())) == (200, {"status": "ok"})


def test_metrics_show_the_model_in_prometheus_format(base_url: str, client: OpenAI) -> None:
    # Five requests of ~1,000 tokens need 5 x 63 KV blocks of 16 tokens; tiny.yaml has 256, so
    # the scheduler must preempt: every metric, preemptions included, gets a sample.
    before = engine_stats()["num_preemptions"]
    with ThreadPoolExecutor(5) as pool:
        list(pool.map(lambda i: client.completions.create(
            model=MODEL, prompt=f"metrics {i}", max_tokens=1000, extra_body={"ignore_eos": True}
        ), range(5)))  # fmt: skip
    assert engine_stats()["num_preemptions"] > before
    wanted = ["time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
              "e2e_request_latency_seconds_count", "kv_cache_usage_perc", "requests_running",
              "requests_waiting", "prompt_tokens_total", "generation_tokens_total",
              "prefix_cache_hit_rate", "preemptions_total"]  # fmt: skip

    missing = list(wanted)

    def scraped() -> bool:
        request = urllib.request.Request(base_url + "/metrics", headers=AUTH)
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
        # The exact sample names Ray's exporter gives them (its ``ray_`` prefix, as documented).
        names = {ln.split("{", 1)[0] for ln in text.splitlines() if f'model="{MODEL}"' in ln}
        missing[:] = [w for w in wanted if f"ray_llm_cluster_{w}" not in names]
        return not missing

    try:
        wait_for(scraped, timeout_s=30, what="every per-model metric in /metrics", poll_s=2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; missing: {missing}") from None


# ---- gRPC ----


@pytest.fixture(scope="module")
def grpc_stub(serve_cluster: ServeCluster, base_url: str) -> Iterator[llm_pb2_grpc.LLMStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{serve_cluster.grpc_port}")
    yield llm_pb2_grpc.LLMStub(channel)
    channel.close()


METADATA = (("application", APP), ("authorization", f"Bearer {KEY}"))


def test_grpc_streamed_generate_equals_http(
    grpc_stub: llm_pb2_grpc.LLMStub, client: OpenAI
) -> None:
    request = llm_pb2.GenerateRequest(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    responses = list(grpc_stub.Generate(request, metadata=METADATA))
    http_text = (
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
        .choices[0]
        .text
    )
    assert "".join(r.text for r in responses) == http_text
    assert responses[-1].finish_reason == "length"
    assert responses[-1].completion_tokens == 16


@pytest.mark.parametrize(
    ("request_fields", "code"),
    [
        ({"model": MODEL, "prompt": "x", "temperature": -1}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"model": MODEL, "prompt": "x", "max_tokens": 5000}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"model": MODEL}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"model": "nope", "prompt": "x"}, grpc.StatusCode.NOT_FOUND),
        ({"model": MODEL, "prompt": "x", "n": 2}, grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=["temperature", "max_tokens", "no prompt", "unknown model", "n > 1"],
)
def test_grpc_errors_map_to_status_codes(
    grpc_stub: llm_pb2_grpc.LLMStub, request_fields: dict[str, Any], code: grpc.StatusCode
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(grpc_stub.Generate(llm_pb2.GenerateRequest(**request_fields), metadata=METADATA))
    assert info.value.code() == code


def test_grpc_without_api_key_is_unauthenticated(grpc_stub: llm_pb2_grpc.LLMStub) -> None:
    request = llm_pb2.GenerateRequest(model=MODEL, prompt="x", max_tokens=2)
    with pytest.raises(grpc.RpcError) as info:
        list(grpc_stub.Generate(request, metadata=(("application", APP),)))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_health_is_ok(grpc_stub: llm_pb2_grpc.LLMStub) -> None:
    assert grpc_stub.Health(llm_pb2.HealthRequest(model=MODEL), metadata=METADATA).healthy


def test_grpc_health_needs_no_api_key(grpc_stub: llm_pb2_grpc.LLMStub) -> None:
    request = llm_pb2.HealthRequest(model=MODEL)
    assert grpc_stub.Health(request, metadata=(("application", APP),)).healthy


def test_grpc_takes_the_api_key_by_http_s_rule(grpc_stub: llm_pb2_grpc.LLMStub) -> None:
    request = llm_pb2.GenerateRequest(model=MODEL, prompt="x", max_tokens=2)
    lower_case = (("application", APP), ("authorization", f"bearer {KEY}"))
    assert list(grpc_stub.Generate(request, metadata=lower_case))
    bare_key = (("application", APP), ("authorization", KEY))
    with pytest.raises(grpc.RpcError) as info:
        list(grpc_stub.Generate(request, metadata=bare_key))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_request_over_max_body_bytes_is_resource_exhausted(
    grpc_stub: llm_pb2_grpc.LLMStub,
) -> None:
    request = llm_pb2.GenerateRequest(model=MODEL, prompt="x" * (2 << 20), max_tokens=2)
    with pytest.raises(grpc.RpcError) as info:
        list(grpc_stub.Generate(request, metadata=METADATA))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_body_bytes" in info.value.details()


# ---- admission control ----


def open_request(base_url: str, body: dict[str, Any]) -> http.client.HTTPConnection:
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"content-type": "application/json", **AUTH}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    return conn


def test_full_waiting_queue_is_503_with_retry_after_and_grpc_resource_exhausted(
    base_url: str, grpc_stub: llm_pb2_grpc.LLMStub
) -> None:
    long = {"model": QUEUED, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True,
            "stream": True}  # fmt: skip
    running = open_request(base_url, long)
    assert running.getresponse().readline().startswith(b"data: {")  # the one seat is taken
    waiting = open_request(base_url, {**long, "max_tokens": 4, "stream": False})
    try:
        wait_for(lambda: engine_stats(QUEUED)["num_waiting"] == 1, timeout_s=30,
                 what="the second request to wait", poll_s=0.2)  # fmt: skip
        request = urllib.request.Request(
            base_url + "/v1/completions", data=json.dumps({**long, "stream": False}).encode(),
            headers={"content-type": "application/json", **AUTH},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=60)
        assert info.value.code == 503
        assert info.value.headers["Retry-After"] == "1"
        assert json.loads(info.value.read())["error"]["code"] == "overloaded"
        grpc_request = llm_pb2.GenerateRequest(model=QUEUED, prompt="x", max_tokens=2)
        with pytest.raises(grpc.RpcError) as grpc_info:
            list(grpc_stub.Generate(grpc_request, metadata=METADATA))
        assert grpc_info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        running.close()
        assert waiting.getresponse().status == 200  # admitted before the cap: it completes
        waiting.close()
    wait_for(
        lambda: (
            (s := engine_stats(QUEUED))["num_running"] + s["num_waiting"] == 0
            and s["kv_free_blocks"] == s["kv_total_blocks"]
        ),
        timeout_s=30,
        what="the queued model to be idle with every block free",
    )


# Starts Ray (and Serve): the full suite, not the fast tier (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow


def test_the_ingress_replica_runs_with_malloc_arenas_capped(base_url: str) -> None:
    """The ingress relays and computes nothing: its replica process caps glibc's arenas
    (``ingress_runtime_env``), which halved its resident-memory growth under a soak."""
    import ray

    from cluster.serving.serve import INGRESS_NAME

    prefix = f"SERVE_REPLICA::{APP}#{INGRESS_NAME}#"
    names = [
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    ]
    assert names, "no ingress replica actor"
    for name, namespace in names:
        actor = ray.get_actor(name, namespace=namespace)
        value = ray.get(actor.__ray_call__.remote(lambda _: os.environ.get("MALLOC_ARENA_MAX")))
        assert value == "2", (name, value)
