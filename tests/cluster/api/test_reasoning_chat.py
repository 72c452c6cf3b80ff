"""Chat responses of a reasoning model (``reasoning_parser``), without Ray: the response
builder on scripted server items (``reasoning`` and ``reasoning_content``, tool calls read from
the answer only, streamed and whole alike), and ``LLMServer`` over
``builtin:tiny-qwen3-reasoning`` (the split of its real output, the grammar of a structured
output starting after ``</think>``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from cluster.api.openai_models import ChatCompletionRequest
from cluster.api.openai_payloads import ToolChoice
from cluster.api.openai_responses import Completion
from cluster.api.reasoning_parsers import ReasoningFront, get_reasoning_parser
from cluster.api.replica_messages import GenerateRequest, StreamDelta, StreamError, StreamStart
from cluster.serving.llm_server import LLMServer
from engine import ConfigError
from engine.builtin.tiny_reasoning_models import THINK_END_ID, THINK_START_ID
from engine.client.core_messages import ChoiceDelta
from engine.sampling_params import StructuredOutputsParams
from tests.cluster.api.scripted_chat import scripted_chat

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
THOUGHT_CALL = '<tool_call>\n{"name": "ponder", "arguments": {}}\n</tool_call>'


def _respond(
    pieces: list[str], *, stream: bool, parser: str = "qwen3", in_reasoning: bool | None = None,
    tools: ToolChoice | None = None, tool_call_parser: str | None = None, **script: Any,
) -> tuple[Completion, list[dict[str, Any]]]:  # fmt: skip
    """A chat response built from a server stream whose deltas carry ``pieces``."""
    start = StreamStart(3, tool_call_parser=tool_call_parser, reasoning_parser=parser,
                        in_reasoning=in_reasoning)  # fmt: skip
    return scripted_chat(start, pieces, stream=stream, tools=tools, **script)


def _joined(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(c["delta"].get(key) or "" for c in chunks)


@pytest.mark.parametrize(
    "text,parser,in_reasoning",
    [
        ("<think>Let me see.</think>Four.", "qwen3", None),
        ("Four, no thinking.", "qwen3", None),
        ("Hm, 2+2.</think>\n\nFour.", "deepseek_r1", None),
        ("Hm, 2+2.</think>\n\nFour.", "qwen3", True),  # the prompt opened <think>
        ("Hm, 2+2.</think>\n\nFour.", "deepseek_r1", False),  # the prompt closed it
        ("Still thinking when max_tokens hit", "deepseek_r1", None),
    ],
)
def test_message_and_deltas_split_alike(text: str, parser: str, in_reasoning: bool | None) -> None:
    whole, _ = _respond([text], stream=False, parser=parser, in_reasoning=in_reasoning)
    message = whole.whole()["choices"][0]["message"]
    reasoning, content = get_reasoning_parser(parser).extract(text, in_reasoning=in_reasoning)
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert message["reasoning"] == reasoning  # vLLM 0.32's name, beside the older one
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # tags cut mid-way
    _, chunks = _respond(pieces, stream=True, parser=parser, in_reasoning=in_reasoning)
    assert chunks[0]["delta"]["role"] == "assistant"
    assert _joined(chunks, "reasoning_content") == (reasoning or "")
    assert all(c["delta"].get("reasoning") == c["delta"].get("reasoning_content") for c in chunks)
    assert _joined(chunks, "content") == (content or "")
    assert chunks[-1]["finish_reason"] == "stop"
    # A chunk per step, as without a parser, none carrying a tag.
    assert len(chunks) == len(pieces)
    assert not any("think>" in json.dumps(c["delta"]) for c in chunks)


def test_each_choice_has_its_own_split() -> None:
    texts = ["a</thi", "x", "nk>b", "</think>d"]  # choice 0: "a</think>b", 1: "x</think>d"
    completion = Completion("m", True, False, stream=True)
    completion.absorb(StreamStart(3, 2, reasoning_parser="deepseek_r1"))
    chunks = []
    for i, text in enumerate(texts):
        finish = "stop" if i >= 2 else None
        chunks += completion.absorb(
            StreamDelta([ChoiceDelta(i % 2, text, [i], None, finish, None, 1)])
        )
    for index, (reasoning, content) in enumerate([("a", "b"), ("x", "d")]):
        mine = [c for c in chunks if c["index"] == index]
        assert (_joined(mine, "reasoning_content"), _joined(mine, "content")) == (
            reasoning,
            content,
        )


@pytest.mark.parametrize(
    ("pieces", "parser", "in_reasoning", "reasoning_tokens"),
    [
        (["<think>", "Let", " me", " see", "</think>", "Four", "."], "qwen3", None, 3),
        (["Hm", ",", " 2+2", ".", "</think>", "Four"], "deepseek_r1", None, 4),
        (["Hm", ",", " 2+2", ".", "</think>", "Four"], "qwen3", True, 4),
        # In reasoning from the start (a grammar waits for </think>), the model's own <think>
        # is a tag, not reasoning.
        (["<think>", "Let", " me", "</think>", "{}"], "qwen3", True, 2),
        (["Four", "."], "qwen3", None, 0),
        (["<think>", "Still", " thinking"], "qwen3", None, 2),  # cut off inside
        (["Hm", "</think>", "Four"], "deepseek_v3", True, 1),  # thinking
        (["Hm", "</think>", "Four"], "deepseek_v3", False, 0),  # not: all content
        # Kimi K2: its tool calls section ends the reasoning too.
        (["Let", " me", " call", "<|tool_calls_section_begin|>", "<|tool_call_begin|>"],
         "kimi_k2", None, 3),
        (["<|channel|>", "analysis", "<|message|>", "Need", " it", ".", "<|end|>", "<|start|>",
          "assistant", "<|channel|>", "final", "<|message|>", "Four"], "openai_gptoss", None, 3),
    ],
)  # fmt: skip
def test_usage_counts_the_reasoning_tokens_as_vllm_does(
    pieces: list[str], parser: str, in_reasoning: bool | None, reasoning_tokens: int
) -> None:
    """vLLM's chat usage with a reasoning parser: ``completion_tokens_details.reasoning_tokens``,
    the tokens inside the think block (harmony: the analysis message's text), whole, streamed
    (the usage chunk) and in each chunk's continuous usage."""
    details = {"reasoning_tokens": reasoning_tokens}
    for stream in (False, True):
        completion, _ = _respond(pieces, stream=stream, parser=parser, in_reasoning=in_reasoning)
        assert completion.usage["completion_tokens"] == len(pieces)
        assert completion.usage["completion_tokens_details"] == details
    assert completion.usage_chunk()["usage"]["completion_tokens_details"] == details
    completion.continuous_usage = True
    chunk = completion.chunk({"index": 0, "delta": {}, "finish_reason": "stop"})
    assert chunk["usage"]["completion_tokens_details"] == details


def test_no_reasoning_parser_leaves_the_text_alone() -> None:
    completion = Completion("m", True, False)
    completion.absorb(StreamStart(3))
    completion.absorb(
        StreamDelta([ChoiceDelta(0, "<think>a</think>b", [1], None, "stop", None, 1)])
    )
    message = completion.whole()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>a</think>b"}
    assert "completion_tokens_details" not in completion.whole()["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_read_from_the_answer_only(stream: bool) -> None:
    text = f"<think>Maybe {THOUGHT_CALL} first?</think>Calling.\n{CALL}"
    tools = ToolChoice("auto")
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)] if stream else [text]
    completion, chunks = _respond(pieces, stream=stream, tools=tools, tool_call_parser="hermes")
    reasoning = f"Maybe {THOUGHT_CALL} first?"
    if stream:
        assert _joined(chunks, "reasoning_content") == reasoning
        calls = [call for c in chunks for call in c["delta"].get("tool_calls", ())]
        assert {c["function"]["name"] for c in calls if "name" in c.get("function", {})} == {
            "get_weather"
        }
        args = "".join(c["function"].get("arguments", "") for c in calls)
        assert json.loads(args) == {"city": "Oslo"}
        assert chunks[-1]["finish_reason"] == "tool_calls"
        return
    choice = completion.whole()["choices"][0]
    assert choice["message"]["reasoning_content"] == reasoning
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert choice["finish_reason"] == "tool_calls"


def test_the_chat_request_declares_include_reasoning() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(body).include_reasoning is True
    request = ChatCompletionRequest.model_validate({**body, "include_reasoning": False})
    assert request.include_reasoning is False and not request.model_extra


@pytest.mark.parametrize("tool_call_parser", [None, "hermes"])
def test_include_reasoning_false_leaves_the_think_block_out(tool_call_parser: str | None) -> None:
    """vLLM's ``include_reasoning: false``: no reasoning in the message or any delta, nor the
    logprobs that would show it; the content and calls as with it."""
    text = f"<think>Maybe {THOUGHT_CALL} first?</think>Calling.\n{CALL}"
    tools = ToolChoice("auto") if tool_call_parser else None
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    script = {"tools": tools, "tool_call_parser": tool_call_parser, "logprobs": True}
    shown, _ = _respond(pieces, stream=False, **script)
    hidden, _ = _respond(pieces, stream=False, include_reasoning=False, **script)
    choice, expected = hidden.whole()["choices"][0], shown.whole()["choices"][0]
    del expected["message"]["reasoning_content"], expected["message"]["reasoning"]
    for message in (choice["message"], expected["message"]):
        for call in message.get("tool_calls", ()):
            call.pop("id")
    assert choice["message"] == expected["message"] and choice["logprobs"] is None
    _, chunks = _respond(pieces, stream=True, include_reasoning=False, **script)
    hidden_keys = {"reasoning", "reasoning_content"}
    assert not any(hidden_keys & set(c["delta"]) or c["logprobs"] for c in chunks)
    assert _joined(chunks, "content") == (choice["message"]["content"] or "")
    calls = [call for c in chunks for call in c["delta"].get("tool_calls", ())]
    assert "".join(c["function"].get("arguments", "") for c in calls) == "".join(
        c["function"]["arguments"] for c in choice["message"].get("tool_calls", ())
    )
    assert chunks[-1]["finish_reason"] == choice["finish_reason"]


def test_front_delays_the_grammar_unless_the_prompt_ended_the_reasoning() -> None:
    class Tokenizer:
        def __init__(self) -> None:
            self.all_special_ids = [0]

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [{"<think>": THINK_START_ID, "</think>": THINK_END_ID}[text]]

    front = ReasoningFront("deepseek_r1", Tokenizer())
    spec = StructuredOutputsParams(json_object=True)
    assert front.prepare([5, 6], spec) is True
    assert spec.reasoning_end_token_id == THINK_END_ID
    closed = StructuredOutputsParams(json_object=True)
    assert front.prepare([5, THINK_START_ID, 9, THINK_END_ID, 6], closed) is False
    assert closed.reasoning_end_token_id is None
    with pytest.raises(ConfigError, match="reasoning_parser: unknown parser 'r1'"):
        ReasoningFront("r1", Tokenizer())
    # qwen3 (the model opens <think> itself): with a grammar that waits for </think>, the
    # output is read from its start as reasoning, as the grammar reads it; without one, it
    # starts as content until a <think>.
    qwen3 = ReasoningFront("qwen3", Tokenizer())
    waits = StructuredOutputsParams(json_object=True)
    assert qwen3.prepare([5, 6], waits) is True and waits.reasoning_end_token_id == THINK_END_ID
    assert qwen3.prepare([5, 6], None) is False
    assert qwen3.prepare([5, THINK_START_ID, 9, THINK_END_ID, 6], closed) is False


def test_a_grammar_after_an_unopened_think_end_reads_as_the_engine_constrained_it() -> None:
    """A qwen3 output with a grammar (the engine starts it at the first </think>) that never
    opened <think>: what came before </think> is reasoning, and the constrained JSON after it
    is the content whole, a <think> inside its strings included."""
    parser = get_reasoning_parser("qwen3")
    output = 'over</think>{"a": "x<think>y</think>z"}'
    assert parser.extract(output, in_reasoning=True) == ("over", '{"a": "x<think>y</think>z"}')


# ---- LLMServer over the tiny reasoning model ----------------------------------------------

ARGS = {"model": "builtin:tiny-qwen3-reasoning", "num_kv_blocks": 64, "device": "cpu"}
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]
# Greedy, with these biases the model writes " most<think>…</think>…" (measured): content, then
# a think block (holding a second <think>), then more content.
QWEN3_PARAMS = {"temperature": 0, "max_tokens": 24,
                "logit_bias": {THINK_START_ID: 6.0, THINK_END_ID: 8.0}}  # fmt: skip
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[LLMServer]:
    server = LLMServer("r", {**ARGS, "reasoning_parser": "qwen3"})
    yield server
    server.engine.shutdown()


def serve_chat(
    server: LLMServer, request: GenerateRequest, stream: bool
) -> tuple[Completion, list]:
    async def run() -> tuple[Completion, list]:
        completion = Completion("r", request.messages is not None, False, stream=stream)
        chunks: list[dict[str, Any]] = []
        async for item in server.generate(request):
            assert not isinstance(item, StreamError), item
            chunks += completion.absorb(item)
        return completion, chunks

    return asyncio.run(run())


def _raw(server: LLMServer, params: dict[str, Any]) -> str:
    """The model's own text for the chat prompt, read through the completions path."""
    ids = server.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    completion, _ = serve_chat(server, GenerateRequest(prompt_token_ids=ids, params=params), False)
    return completion.choices[0].text


def test_server_splits_the_real_output(server: LLMServer) -> None:
    raw = _raw(server, QWEN3_PARAMS)
    before, _, rest = raw.partition("<think>")
    reasoning, _, after = rest.partition("</think>")
    assert before and reasoning and after and "<think>" in reasoning  # the case measured
    request = GenerateRequest(messages=MESSAGES, params=QWEN3_PARAMS)
    whole, _ = serve_chat(server, request, stream=False)
    message = whole.whole()["choices"][0]["message"]
    assert message["reasoning_content"] == reasoning
    assert message["content"] == before + after
    _, chunks = serve_chat(server, request, stream=True)
    assert _joined(chunks, "reasoning_content") == reasoning
    assert _joined(chunks, "content") == before + after


def test_server_structured_output_constrains_the_answer_only(server: LLMServer) -> None:
    params = {**QWEN3_PARAMS, "max_tokens": 60, "structured_outputs": {"json": SCHEMA}}
    free = _raw(server, QWEN3_PARAMS)
    request = GenerateRequest(messages=MESSAGES, params=params)
    whole, _ = serve_chat(server, request, stream=False)
    message = whole.whole()["choices"][0]["message"]
    # The grammar waits for </think>: all before it is the unconstrained model's reasoning
    # (text before its <think> too, as the grammar reads it), and the answer is the schema's.
    before, _, rest = free.partition("<think>")
    assert before and message["reasoning_content"] == before + rest.partition("</think>")[0]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert whole.choices[0].finish_reason == "stop"
    _, chunks = serve_chat(server, request, stream=True)
    assert _joined(chunks, "reasoning_content") == message["reasoning_content"]
    assert _joined(chunks, "content") == message["content"]


def test_server_refuses_a_tokenizer_without_think_tokens() -> None:
    with pytest.raises(Exception, match="reasoning_parser: 'deepseek_r1' needs <think> as one"):
        LLMServer("r", {"model": "builtin:tiny-llama", "num_kv_blocks": 16, "device": "cpu",
                        "reasoning_parser": "deepseek_r1"})  # fmt: skip
