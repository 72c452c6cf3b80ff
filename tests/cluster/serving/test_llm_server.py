"""LLMServer without Ray: its stream starts with a "start" item or a validation error, and its
health reflects the engine (Serve replaces a replica whose check_health raises)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.api.openai_models import ChatCompletionRequest, CompletionRequest
from cluster.api.openai_payloads import chat_payload, completion_payloads
from cluster.api.openai_responses import Completion
from cluster.api.replica_messages import (
    EmbedRequest,
    EmbedResult,
    GenerateRequest,
    StreamDelta,
    StreamError,
)
from cluster.api.tool_parsers import TOOL_PARSERS
from cluster.serving.llm_server import LLMServer, error_item
from engine import LLM, EngineDeadError, SamplingParams
from engine.builtin.catalog import resolve_model_source

ENGINE_ARGS = {"model": "builtin:tiny-llama", "num_kv_blocks": 64, "device": "cpu"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server() -> Iterator[LLMServer]:
    server = LLMServer("tiny", ENGINE_ARGS)
    yield server
    server.engine.shutdown()


async def stream(server: LLMServer, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The server's protocol messages for a ``GenerateRequest`` given by its fields, as plain
    data: ``{"type": "start" | "delta" | "error", ...}`` (msgspec's tagged form), a delta's
    choices as dicts of the engine's ``ChoiceDelta`` fields (logprobs as it sent them)."""
    async for item in server.generate(GenerateRequest(**request)):
        data = msgspec.to_builtins(item)
        if isinstance(item, StreamDelta):
            data["choices"] = [msgspec.structs.asdict(c) for c in item.choices]
        yield data


def collect(server: LLMServer, request: dict[str, Any]) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [item async for item in stream(server, request)]

    return asyncio.run(run())


def test_stream_is_start_then_deltas_matching_offline(server: LLMServer) -> None:
    params = {"temperature": 0, "max_tokens": 12}
    items = collect(server, {"prompt": "Once upon", "params": params})
    offline = LLM(**ENGINE_ARGS).generate("Once upon", SamplingParams(**params), use_tqdm=False)
    prompt_tokens = len(offline[0].prompt_token_ids)
    # n = 1 and the fields only echo, prompt logprobs and tools set are defaults, left out.
    assert items[0] == {"type": "start", "prompt_tokens": prompt_tokens, "replica_id": "local"}
    choices = [c for i in items[1:] for c in i["choices"]]
    assert "".join(c["text"] for c in choices) == offline[0].outputs[0].text
    assert choices[-1]["finish_reason"] == "length"
    assert choices[-1]["num_tokens"] == 12


def test_n_choices_stream_as_indexed_deltas_with_the_engine_logprobs(server: LLMServer) -> None:
    params = {"n": 2, "temperature": 1.0, "seed": 9, "max_tokens": 6, "logprobs": 1}
    items = collect(server, {"prompt": "Twice", "params": params})
    offline = LLM(**ENGINE_ARGS).generate("Twice", SamplingParams(**params), use_tqdm=False)
    assert items[0]["n"] == 2
    for ref in offline[0].outputs:
        choices = [c for i in items[1:] for c in i["choices"] if c["index"] == ref.index]
        assert "".join(c["text"] for c in choices) == ref.text
        per_token = [entry for c in choices for entry in c["logprobs"]]
        # Per token: token id -> Logprob, the sampled token first.
        assert [next(iter(entry)) for entry in per_token] == ref.token_ids
        assert [list(e.items()) for e in per_token] == [list(e.items()) for e in ref.logprobs]


def test_invalid_params_are_the_first_and_only_item(server: LLMServer) -> None:
    items = collect(server, {"prompt": "x", "params": {"top_p": 2.0}})
    assert len(items) == 1
    assert (items[0]["type"], items[0]["status"], items[0]["param"]) == ("error", 400, "top_p")


def test_unknown_sampling_parameter_is_rejected(server: LLMServer) -> None:
    items = collect(server, {"prompt": "x", "params": {"best_of": 2}})
    assert (items[0]["status"], items[0]["param"]) == (400, "best_of")


def test_dead_engine_fails_health_and_requests() -> None:
    server = LLMServer("tiny", ENGINE_ARGS)
    executor = server.engine.engine.executor

    def broken(request: Any) -> Any:
        raise EngineDeadError("worker 0 died")

    executor.execute_model = broken
    try:
        first = collect(server, {"prompt": "x", "params": {"max_tokens": 4}})
        assert first[-1]["type"] == "error" and first[-1]["status"] == 503
        with pytest.raises(EngineDeadError):
            asyncio.run(server.check_health())
        assert asyncio.run(server.health())["healthy"] is False
        after = collect(server, {"prompt": "x", "params": {"max_tokens": 4}})
        assert (after[0]["type"], after[0]["status"]) == ("error", 503)
    finally:
        server.engine.shutdown()


def test_request_past_its_timeout_ends_with_abort_then_a_408(server: LLMServer) -> None:
    params = {"temperature": 0, "max_tokens": 900, "ignore_eos": True}
    items = collect(server, {"prompt": "Once upon", "params": params, "timeout": 0.2})
    assert items[0]["type"] == "start"
    assert items[-2]["choices"][-1]["finish_reason"] == "abort"
    assert (items[-1]["type"], items[-1]["status"], items[-1]["param"]) == ("error", 408, "timeout")
    stats = asyncio.run(server.stats())
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_the_timeout_counts_from_the_requests_arrival(
    server: LLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Time the replica spends before the engine takes the request (here: waking the model)
    is within the request's timeout: past it, the engine ends the request at once."""
    waking = server._ensure_awake

    async def slow_wake() -> None:
        await asyncio.sleep(0.6)
        await waking()

    monkeypatch.setattr(server, "_ensure_awake", slow_wake)
    params = {"temperature": 0, "max_tokens": 900, "ignore_eos": True}
    items = collect(server, {"prompt": "Once upon", "params": params, "timeout": 0.5})
    assert (items[-1]["type"], items[-1]["status"], items[-1]["param"]) == ("error", 408, "timeout")
    # Ended at once, not after the 0.5 s of tokens it had before its deadline was moved.
    assert items[-2]["choices"][-1]["num_tokens"] < 20


def test_invalid_timeout_is_400_naming_it(server: LLMServer) -> None:
    items = collect(server, {"prompt": "x", "params": {}, "timeout": -1})
    assert (items[0]["status"], items[0]["param"]) == (400, "timeout")


def test_cache_salt_reaches_the_engine(server: LLMServer) -> None:
    items = collect(server, {"prompt": "x", "params": {}, "cache_salt": ""})
    assert (items[0]["status"], items[0]["param"]) == (400, "cache_salt")
    ok = collect(server, {"prompt": "x", "params": {"max_tokens": 2}, "cache_salt": "tenant"})
    assert ok[0]["type"] == "start"


def test_priority_reaches_the_engine(server: LLMServer) -> None:
    items = collect(server, {"prompt": "x", "params": {}, "priority": 2**63})
    assert (items[0]["status"], items[0]["param"]) == (400, "priority")
    ok = collect(server, {"prompt": "x", "params": {"max_tokens": 2}, "priority": -7})
    assert ok[0]["type"] == "start"


@pytest.mark.parametrize(
    ("request_fields", "param"),
    [
        ({"cache_salt": "\ud800"}, "cache_salt"),  # hashed as UTF-8 on the engine thread
        ({"params": {"seed": 2**64}}, "seed"),  # torch.Generator overflows in the worker
    ],
)
def test_input_that_failed_mid_step_is_400_and_the_engine_lives(
    server: LLMServer, request_fields: dict[str, Any], param: str
) -> None:
    items = collect(server, {"prompt": "x", "params": {"max_tokens": 2}, **request_fields})
    assert (items[0]["status"], items[0]["param"]) == (400, param)
    assert asyncio.run(server.health()) == {"healthy": True}
    assert collect(server, {"prompt": "x", "params": {"max_tokens": 2}})[0]["type"] == "start"


def test_a_request_that_breaks_an_engine_check_fails_alone_with_a_500(server: LLMServer) -> None:
    """An error the engine does not expect while taking one request (here the RecursionError a
    deep enough input once raised in a check) is that request's 500; the engine lives."""
    llm_engine = server.engine.engine

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded in /srv/engine/check.py")

    llm_engine.add_request = broken
    try:
        items = collect(server, {"prompt": "x", "params": {"max_tokens": 2}})
    finally:
        del llm_engine.add_request
    assert [(i["type"], i["status"], i["message"]) for i in items] == [
        ("error", 500, "internal server error")
    ]
    assert asyncio.run(server.health()) == {"healthy": True}
    assert collect(server, {"prompt": "x", "params": {"max_tokens": 2}})[0]["type"] == "start"


def test_engine_failure_messages_carry_no_internals() -> None:
    server = LLMServer("tiny", ENGINE_ARGS)
    secret = "/srv/models/secret/worker.py line 12: CUDA error, api_key=sk-123"

    def broken(request: Any) -> Any:
        raise RuntimeError(secret)

    server.engine.engine.executor.execute_model = broken
    try:
        during = collect(server, {"prompt": "x", "params": {"max_tokens": 4}})
        after = collect(server, {"prompt": "x", "params": {"max_tokens": 4}})
        health = asyncio.run(server.health())
        messages = [during[-1]["message"], after[0]["message"], health["error"]]
        assert [during[-1]["status"], after[0]["status"]] == [503, 503]
        for message in messages:
            assert "/srv" not in message and "sk-123" not in message and "line 12" not in message
    finally:
        server.engine.shutdown()


def test_full_waiting_queue_is_a_503_with_retry_after() -> None:
    server = LLMServer("tiny", {**ENGINE_ARGS, "max_num_seqs": 1, "max_waiting_requests": 1})
    long = {"prompt": "x", "params": {"max_tokens": 900, "ignore_eos": True}}

    async def run() -> list[dict[str, Any]]:
        running = stream(server, long)
        assert (await running.__anext__())["type"] == "start"  # the one seat is taken
        queued = stream(server, long)
        waiting = asyncio.ensure_future(queued.__anext__())
        while (await server.stats())["num_waiting"] < 1:
            await asyncio.sleep(0.01)
        try:
            return [item async for item in stream(server, long)]
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await running.aclose()

    try:
        refused = asyncio.run(run())
        assert len(refused) == 1
        error = refused[0]
        assert (error["status"], error["code"], error["retry_after"]) == (503, "overloaded", 1)
        assert "max_waiting_requests" in error["message"]
    finally:
        server.engine.shutdown()


def test_drain_lets_short_requests_finish_aborts_the_rest_and_refuses_new_ones() -> None:
    server = LLMServer("tiny", {**ENGINE_ARGS, "max_model_len": 2048, "num_kv_blocks": 256})

    async def run() -> tuple[list[Any], list[Any], list[Any], dict[str, int]]:
        async def one(max_tokens: int, **fields: Any) -> list[dict[str, Any]]:
            params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
            request = {"prompt": "a", "params": params, **fields}
            return [item async for item in stream(server, request)]

        # A timeout far off: the drain's abort is no timeout (no 408).
        long = asyncio.ensure_future(one(2000, timeout=600.0))
        while not server._active:
            await asyncio.sleep(0.01)
        # The short request registers in its task's first step, which runs on this yield:
        # draining right away, before it can finish (polling for both could miss it).
        short = asyncio.ensure_future(one(8))
        await asyncio.sleep(0)
        assert len(server._active) == 2
        counts = await server.drain(1.0)
        refused = await one(4)
        return await short, await long, refused, counts

    try:
        short, long, refused, counts = asyncio.run(run())
        assert short[-1]["choices"][-1]["finish_reason"] == "length"
        assert long[-1]["type"] == "delta" and long[-1]["choices"][-1]["finish_reason"] == "abort"
        assert long[-1]["choices"][-1]["num_tokens"] < 2000
        draining = error_item(503, refused[0]["message"], None, "draining", 1)
        assert refused == [msgspec.to_builtins(draining)]
        assert counts == {"finished": 1, "aborted": 1}
        stats = asyncio.run(server.stats())
        assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    finally:
        server.engine.shutdown()


# ---- embeddings -----------------------------------------------------------------------------


def embed(server: LLMServer, **fields: Any) -> Any:
    return asyncio.run(server.embed(EmbedRequest(**fields)))


def test_embed_text_equals_offline_embedding_and_counts_prompt_tokens(server: LLMServer) -> None:
    result = embed(server, prompt="Once upon a time")
    offline = LLM(**ENGINE_ARGS).embed("Once upon a time", use_tqdm=False)[0]
    assert isinstance(result, EmbedResult)
    assert result.prompt_tokens == len(offline.prompt_token_ids)
    assert result.embedding == pytest.approx(offline.outputs.embedding, abs=1e-6)
    by_ids = embed(server, prompt_token_ids=offline.prompt_token_ids)
    assert by_ids.embedding == pytest.approx(result.embedding, abs=1e-6)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": "x", "dimensions": 8}, "dimensions"),
        ({"prompt": "x", "normalize": "yes"}, "normalize"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": 42}, "prompt"),
        ({"prompt_token_ids": [1, 10**9]}, "prompt_token_ids"),
    ],
)
def test_invalid_embed_request_is_400_naming_the_field(
    server: LLMServer, fields: dict[str, Any], param: str
) -> None:
    error = embed(server, **fields)
    assert (error.status, error.param) == (400, param)
    assert error.message.startswith(f"{param}: ")


def test_embed_on_a_dead_engine_is_503() -> None:
    server = LLMServer("tiny", ENGINE_ARGS)

    def broken(request: Any) -> Any:
        raise EngineDeadError("worker 0 died")

    server.engine.engine.executor.execute_model = broken
    try:
        assert embed(server, prompt="x").status == 503
        assert embed(server, prompt="x").status == 503
    finally:
        server.engine.shutdown()


def test_drain_aborts_an_embedding_in_flight_with_a_503_draining() -> None:
    server = LLMServer("tiny", ENGINE_ARGS)
    hold = threading.Event()

    async def run() -> Any:
        # The core thread runs commands in order: the embedding is added, then aborted by the
        # drain, before any step computes it.
        held = asyncio.ensure_future(server.engine.call(lambda e: hold.wait(10)))
        await asyncio.sleep(0.01)
        pending = asyncio.ensure_future(server.embed(EmbedRequest(prompt="a b c")))
        while not server._active:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        counts = await server.drain(0.0)
        hold.set()
        await held
        return await pending, counts

    try:
        error, counts = asyncio.run(run())
        assert (error.status, error.code, error.retry_after) == (503, "draining", 1)
        assert counts == {"finished": 0, "aborted": 1}
        state = asyncio.run(server.request_state())
        assert state["kv_free_blocks"] == state["kv_total_blocks"]
    finally:
        server.engine.shutdown()


@pytest.mark.parametrize("kind", ["generate", "embed"])
def test_a_request_the_drain_ends_before_it_reaches_the_engine_is_refused_not_started(
    kind: str,
) -> None:
    """A request still on its way to the engine when the drain's deadline passes (waking the
    model, loading its adapter: here a wake held open) is refused with 503 ``draining``; it
    used to reach the engine after the drain and run on a replica Serve is about to kill."""
    server = LLMServer("tiny", ENGINE_ARGS)
    woken = asyncio.Event()

    async def slow_wake() -> None:
        await woken.wait()

    server._ensure_awake = slow_wake  # type: ignore[method-assign]

    async def run() -> tuple[Any, dict[str, int]]:
        if kind == "generate":
            params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
            items = stream(server, {"prompt": "a", "params": params})
            pending = asyncio.ensure_future(anext(items))
        else:
            pending = asyncio.ensure_future(server.embed(EmbedRequest(prompt="a b c")))
        while not server._active:
            await asyncio.sleep(0.01)
        counts = await server.drain(0.05)
        woken.set()
        return await pending, counts

    try:
        answer, counts = asyncio.run(run())
        if kind == "generate":
            draining = error_item(503, answer["message"], None, "draining", 1)
            assert answer == msgspec.to_builtins(draining)
        else:
            assert (answer.status, answer.code, answer.retry_after) == (503, "draining", 1)
        assert counts == {"finished": 0, "aborted": 1}
        state = asyncio.run(server.request_state())
        assert not server._active and state["kv_free_blocks"] == state["kv_total_blocks"]
        stats = asyncio.run(server.stats())
        assert (stats["num_running"], stats["generation_tokens_total"]) == (0, 0), stats
    finally:
        server.engine.shutdown()


# ---- chat templates and /tokenize, as vLLM's ----


def tokenize(server: LLMServer, return_token_strs: bool = False, **fields: Any) -> Any:
    return asyncio.run(server.tokenize(GenerateRequest(**fields), return_token_strs))


def test_add_generation_prompt_false_renders_no_assistant_opening(server: LLMServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    tok = server.tokenizer
    with_prompt = tokenize(server, messages=messages).tokens
    without = tokenize(server, messages=messages, add_generation_prompt=False).tokens
    for ids, add in ((with_prompt, True), (without, False)):
        assert ids == tok.apply_chat_template(messages, add_generation_prompt=add,
                                              return_dict=False)  # fmt: skip
    assert len(without) < len(with_prompt)
    items = collect(server, {"messages": messages, "add_generation_prompt": False,
                             "params": {"max_tokens": 1}})  # fmt: skip
    assert items[0]["prompt_tokens"] == len(without)


def test_developer_message_renders_as_system_for_a_template_without_the_role(
    server: LLMServer,
) -> None:
    user = {"role": "user", "content": "hi"}
    as_system = tokenize(server, messages=[{"role": "system", "content": "Be brief."}, user])
    as_developer = tokenize(server, messages=[{"role": "developer", "content": "Be brief."}, user])
    assert as_developer.tokens == as_system.tokens


def test_developer_messages_merge_into_one_first_system_message() -> None:
    from cluster.serving.request_inputs import developer_as_system

    messages = [{"role": "system", "content": "A"}, {"role": "user", "content": "hi"},
                {"role": "developer", "content": [{"type": "text", "text": "B"}]}]  # fmt: skip
    assert developer_as_system(messages) == [
        {"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "hi"}]  # fmt: skip
    assert developer_as_system(messages[:2]) == messages[:2]  # no developer: unchanged


def test_tokenize_honours_add_special_tokens_and_returns_token_strings(
    server: LLMServer,
) -> None:
    tok = server.tokenizer
    plain_ids = tokenize(server, prompt="hi")
    assert plain_ids.tokens == tok.encode("hi") and plain_ids.token_strs is None
    bare = tokenize(server, prompt="hi", add_special_tokens=False)
    assert bare.tokens == tok.encode("hi", add_special_tokens=False) == plain_ids.tokens[1:]
    pieces = tokenize(server, True, prompt="hi")
    assert pieces.token_strs == tok.convert_ids_to_tokens(plain_ids.tokens)
    assert pieces.token_strs[0] == tok.bos_token
    messages = [{"role": "user", "content": "hi"}]
    chat = tokenize(server, messages=messages).tokens
    assert tokenize(server, messages=messages, add_special_tokens=True).tokens == [
        tok.bos_token_id, *chat]  # fmt: skip


def test_completion_prompt_without_special_tokens(server: LLMServer) -> None:
    items = collect(server, {"prompt": "hi", "add_special_tokens": False,
                             "params": {"max_tokens": 1}})  # fmt: skip
    assert items[0]["prompt_tokens"] == len(server.tokenizer.encode("hi")) - 1


# ---- logprobs in vLLM's OpenAI shapes (the server's items through the ingress's Completion) ----


def openai_response(server: LLMServer, completion: Completion, payload: GenerateRequest) -> Any:
    """The whole OpenAI response ``completion`` makes of the server's items for ``payload``."""

    async def run() -> None:
        async for item in server.generate(payload):
            assert not isinstance(item, StreamError), item
            completion.absorb(item)

    asyncio.run(run())
    return completion.whole()


def hf_log_softmax(token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V]: row t = HF transformers' log_softmax after token_ids[: t + 1] (fp32)."""
    path = resolve_model_source(ENGINE_ARGS["model"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def assert_prompt_logprobs_equal_hf(
    prompt_logprobs: list[Any], prompt_ids: list[int], k: int, tokenizer: Any
) -> None:
    """vLLM's shape (None, then token id -> {logprob, rank, decoded_token}, the prompt's token
    first, then the top k), its values HF's; the prompt tokens' texts join into the prompt's."""
    hf = hf_log_softmax(prompt_ids)
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for t in range(1, len(prompt_ids)):
        entry, row, token = prompt_logprobs[t], hf[t - 1], prompt_ids[t]
        assert next(iter(entry)) == str(token)
        top_lp, top_ids = row.topk(k)
        assert set(entry) == {str(token), *map(str, top_ids.tolist())}
        assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        for rank, (alt, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist()), start=1):
            assert entry[str(alt)]["logprob"] == pytest.approx(lp, abs=1e-4)
            if alt != token:
                assert entry[str(alt)]["rank"] == rank
    texts = [prompt_logprobs[t][str(prompt_ids[t])]["decoded_token"]
             for t in range(1, len(prompt_ids))]  # fmt: skip
    assert "".join(texts) == tokenizer.decode(prompt_ids[1:])


def test_completion_prompt_logprobs_are_hfs_in_vllms_shape_on_each_choice(
    server: LLMServer,
) -> None:
    # "Ƿ" is two byte tokens: the first one's text is "" and the second's "Ƿ", as in vLLM.
    req = CompletionRequest(model="tiny", prompt="Once Ƿ upon a time", max_tokens=2,
                            temperature=0, n=2, prompt_logprobs=3)  # fmt: skip
    (payload,) = completion_payloads(req)
    response = openai_response(server, Completion("tiny", False, False), payload)
    prompt_ids = server.tokenizer.encode("Once Ƿ upon a time")
    assert response["usage"]["prompt_tokens"] == len(prompt_ids)
    for choice in response["choices"]:
        assert_prompt_logprobs_equal_hf(choice["prompt_logprobs"], prompt_ids, 3, server.tokenizer)
        assert choice["logprobs"] is None


def test_chat_prompt_logprobs_are_hfs_in_vllms_shape_on_the_response(server: LLMServer) -> None:
    messages = [{"role": "user", "content": "Once upon a time"}]
    req = ChatCompletionRequest(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                prompt_logprobs=0)  # fmt: skip
    response = openai_response(server, Completion("tiny", True, False), chat_payload(req))
    prompt_ids = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      return_dict=False)  # fmt: skip
    assert_prompt_logprobs_equal_hf(response["prompt_logprobs"], prompt_ids, 0, server.tokenizer)
    assert "prompt_logprobs" not in response["choices"][0]


def test_prompt_logprobs_above_max_logprobs_is_400_naming_it(server: LLMServer) -> None:
    req = CompletionRequest(model="tiny", prompt="x", max_tokens=1, prompt_logprobs=21)
    (payload,) = completion_payloads(req)
    items = collect(server, msgspec.structs.asdict(payload))
    assert (items[0]["type"], items[0]["status"], items[0]["param"]) == (
        "error", 400, "prompt_logprobs")  # fmt: skip
    assert "max_logprobs" in items[0]["message"]


def test_chat_logprob_bytes_of_a_character_split_over_tokens_join_into_its_utf8(
    server: LLMServer,
) -> None:
    # "Ƿ" (C7 B7) is two byte tokens, each alone decoding to U+FFFD. As vLLM (and OpenAI: the
    # tokens' bytes join into the text's UTF-8): the first one is "" with no bytes, the one that
    # finishes the character carries it.
    tokenizer = server.tokenizer
    first, second, *_ = ids = tokenizer.encode("Ƿok", add_special_tokens=False)
    assert tokenizer.decode([first]) == tokenizer.decode([second]) == "\ufffd"
    req = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                temperature=0, max_tokens=8, logprobs=True, top_logprobs=2,
                                structured_outputs={"choice": ["Ƿok"]})  # fmt: skip
    response = openai_response(server, Completion("tiny", True, False, 2), chat_payload(req))
    choice = response["choices"][0]
    assert choice["message"]["content"] == "Ƿok"
    content = choice["logprobs"]["content"]
    assert len(content) == len(ids) + 1  # and the stop token that ended it
    assert [t["token"] for t in content[:-1]] == ["", "Ƿ", "o", "k"]
    joined = b"".join(bytes(t["bytes"]) for t in content[:-1])
    assert joined == tokenizer.decode(ids).encode()
    for token in content:
        assert token["bytes"] == list(token["token"].encode())
        for alt in token["top_logprobs"]:
            assert alt["bytes"] == list(alt["token"].encode())
            assert "\ufffd" not in alt["token"]


# gpt-oss's harmony parser needs a harmony model (tests/cluster/serving/test_serve_harmony.py).
@pytest.mark.parametrize("parser", sorted(set(TOOL_PARSERS) - {"openai"}))
def test_a_tool_parser_that_reads_special_tokens_gets_them_in_the_text(parser: str) -> None:
    """A parser whose markers are special tokens (``keeps_special_tokens``) reads text decoded
    with them, as vLLM's parsers adjust such a request; the others keep the request's own
    ``skip_special_tokens``. The model is made to write ``<s>`` (a special token) by
    ``logit_bias``; only the auto tool choice the parser reads changes the decoding."""
    server = LLMServer("tools", {**ENGINE_ARGS, "enable_auto_tool_choice": True,
                                 "tool_call_parser": parser})  # fmt: skip
    try:
        bos = server.tokenizer.bos_token_id
        params = {"temperature": 0, "max_tokens": 3, "logit_bias": {bos: 100.0}}
        texts = {}
        for choice in ("auto", None):
            request = {"messages": [{"role": "user", "content": "Hi"}], "params": params,
                       "tool_choice": choice, "tools": [TOOL]}  # fmt: skip
            items = collect(server, request)
            assert items[0].get("tool_call_parser") == (parser if choice else None)
            texts[choice] = "".join(c["text"] for i in items[1:] for c in i["choices"])
    finally:
        server.engine.shutdown()
    assert texts[None] == ""  # skip_special_tokens, the default
    keeps = TOOL_PARSERS[parser].keeps_special_tokens
    assert texts["auto"] == ("<s>" * 3 if keeps else "")
