"""``deepseek_v3`` and ``kimi_k2`` against vLLM 0.32's parsers of those names: the expectations
below were recorded by running vLLM's own ``Parser`` (``parse`` whole, ``parse_delta`` streamed
one, two and three tokens a delta, and all at once) with a tokenizer whose think tags are single
tokens. Where vLLM's whole and streamed answers disagree, the case says which one is kept here.
Then ``LLMServer`` over ``builtin:tiny-qwen3-reasoning``: the request's ``chat_template_kwargs``
switch the split of the same output."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.api.reasoning_parsers import ReasoningFront, get_reasoning_parser
from cluster.api.replica_messages import GenerateRequest
from cluster.serving.llm_server import LLMServer
from engine.builtin.tiny_reasoning_models import THINK_END_ID, THINK_START_ID
from engine.sampling_params import StructuredOutputsParams
from tests.cluster.api.test_reasoning_chat import serve_chat

START, END = 7, 8  # the think tags' token ids in the prompts below
PROMPTS = {"open": [1, START], "closed": [1, END], "none": [1, 2], "reopened": [END, 3, START]}

# (kwargs, prompt) -> whether the output starts in reasoning, as vLLM's stream reads it.
# deepseek_v3 thinks only when asked; kimi_k2 unless told not to. The kwargs are those vLLM
# hands its parser: a request's reasoning_effort adds enable_thinking (see below).
MODES: list[tuple[dict[str, Any] | None, dict[str, bool]]] = [
    (None, {"deepseek_v3": False, "kimi_k2": True}),
    ({"thinking": True}, {"deepseek_v3": True, "kimi_k2": True}),
    ({"thinking": False}, {"deepseek_v3": False, "kimi_k2": False}),
    ({"enable_thinking": True}, {"deepseek_v3": True, "kimi_k2": True}),
    ({"enable_thinking": False}, {"deepseek_v3": False, "kimi_k2": False}),
    ({"thinking": False, "enable_thinking": True}, {"deepseek_v3": True, "kimi_k2": True}),
    ({"thinking": "yes"}, {"deepseek_v3": True, "kimi_k2": True}),
    ({"thinking": 0}, {"deepseek_v3": False, "kimi_k2": False}),
]

# Thinking: text -> (reasoning, content) whole (None: absent); the stream's deltas add up to the
# same, None read as "". vLLM's whole and streamed answers agree on each unless noted.
THINKING: dict[str, list[tuple[str, tuple[str | None, str | None]]]] = {
    "deepseek_v3": [
        ("plan it</think>The answer.", ("plan it", "The answer.")),
        ("plan it</think>", ("plan it", None)),
        ("plan it", ("plan it", None)),  # cut off: all reasoning
        ("The answer.", ("The answer.", None)),  # no tags: all reasoning too
        ("", ("", None)),
        ("plan  \n</think>\n\nThe answer.\n", ("plan  \n", "\n\nThe answer.\n")),
        ("think </think and <th", ("think </think and <th", None)),
        ("a<|tool_calls_section_begin|>b", ("a<|tool_calls_section_begin|>b", None)),
        ("  plan  \n", ("  plan  \n", None)),
        # The model's own <think> is dropped: vLLM's stream keeps it when it shares a delta
        # with other text (two or three tokens a delta), its one-token stream and parse drop it.
        ("<think>plan it</think>The answer.", ("plan it", "The answer.")),
        ("<think>plan it", ("plan it", None)),
        ("<think>\n</think>answer", ("\n", "answer")),
        # vLLM's one-token stream; its parse splits at the first <think> (" b", " c </think> d").
        ("a <think> b</think> c </think> d", ("a  b", " c </think> d")),
        # vLLM's stream; its parse says ("z", "w").
        ("x</think>y<think>z</think>w", ("x", "y<think>z</think>w")),
    ],
    "kimi_k2": [
        ("plan it</think>The answer.", ("plan it", "The answer.")),
        ("plan it</think>", ("plan it", None)),
        ("plan it", ("plan it", None)),
        ("The answer.", ("The answer.", None)),
        ("", (None, None)),  # an empty reasoning is None
        ("<think>plan it</think>The answer.", ("plan it", "The answer.")),
        ("<think>plan it", ("plan it", None)),
        # The reasoning's trailing whitespace is trimmed, its leading kept.
        ("plan  \n</think>\n\nThe answer.\n", ("plan", "\n\nThe answer.\n")),
        ("  plan  \n", ("  plan", None)),
        ("<think>\n</think>answer", (None, "answer")),
        # Kimi's tool calls section ends the reasoning; the section is content.
        ("a<|tool_calls_section_begin|>b", ("a", "<|tool_calls_section_begin|>b")),
        # vLLM's parse; its stream loses the space before the held "<th" ("and<th").
        ("think </think and <th", ("think </think and <th", None)),
        # vLLM's stream one to three tokens a delta; its parse and one-delta stream drop a
        # </think> in the content (" c  d").
        ("a <think> b</think> c </think> d", ("a  b", " c </think> d")),
        ("x</think>y<think>z</think>w", ("x", "y<think>z</think>w")),
    ],
}
PARSERS = list(THINKING)
# Thinking off: vLLM's identity parser, every text whole as content, tags and all.
TEXTS = [text for text, _ in THINKING["kimi_k2"]]


def _chunkings(text: str) -> Iterator[list[str]]:
    for n in (1, 2, 3, 5):
        yield [text[i : i + n] for i in range(0, len(text), n)]
    yield [text]
    cuts = sorted({0, len(text)} | {i + k for i, c in enumerate(text) if c == "<" for k in (1, 4)})
    yield [text[a:b] for a, b in itertools.pairwise(cuts)]  # tags cut inside


def _streamed(parser: str, pieces: list[str], in_reasoning: bool) -> tuple[str, str]:
    streamer = get_reasoning_parser(parser).streamer(in_reasoning=in_reasoning)
    reasoning = content = ""
    for piece in pieces:
        r, c = streamer.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = streamer.finish()
    return reasoning + r, content + c


def _start(parser: str, prompt: str, kwargs: dict[str, Any] | None) -> bool:
    return get_reasoning_parser(parser).output_starts_in_reasoning(
        PROMPTS[prompt], START, END, kwargs
    )


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("kwargs,thinks", MODES)
@pytest.mark.parametrize("prompt", ["open", "none", "reopened"])
def test_thinking_follows_the_kwargs_as_vllm(
    parser: str, kwargs: dict[str, Any] | None, thinks: dict[str, bool], prompt: str
) -> None:
    assert _start(parser, prompt, kwargs) is thinks[parser]


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("kwargs,thinks", MODES)
def test_a_prompt_that_closed_the_think_block_leaves_all_content(
    parser: str, kwargs: dict[str, Any] | None, thinks: dict[str, bool]
) -> None:
    # vLLM's stream reads the prompt's </think> as the reasoning's end (is_reasoning_end) and
    # sends everything as content; its parse splits at </think> as if thinking. The stream's
    # reading is kept, whole and streamed.
    assert _start(parser, "closed", kwargs) is False
    text = "plan it</think>The answer."
    assert get_reasoning_parser(parser).extract(text, in_reasoning=False) == (None, text)


@pytest.mark.parametrize(
    "kwargs,thinking",
    [  # vLLM's ChatCompletionRequest.build_chat_params, then its parsers, as recorded
        ({"reasoning_effort": "none"}, {"deepseek_v3": False, "kimi_k2": False}),
        ({"reasoning_effort": "high"}, {"deepseek_v3": True, "kimi_k2": True}),
        ({"reasoning_effort": "none", "enable_thinking": True},
         {"deepseek_v3": True, "kimi_k2": True}),
        ({"reasoning_effort": "high", "thinking": False}, {"deepseek_v3": True, "kimi_k2": True}),
        ({"reasoning_effort": None}, {"deepseek_v3": False, "kimi_k2": True}),
    ],
)  # fmt: skip
def test_reasoning_effort_sets_enable_thinking_as_vllm(
    kwargs: dict[str, Any], thinking: dict[str, bool]
) -> None:
    for parser in PARSERS:
        assert _start(parser, "none", kwargs) is thinking[parser], parser


@pytest.mark.parametrize(
    "parser,text,expected",
    [(p, text, split) for p, cases in THINKING.items() for text, split in cases],
)
def test_thinking_split_whole_and_streamed(
    parser: str, text: str, expected: tuple[str | None, str | None]
) -> None:
    assert get_reasoning_parser(parser).extract(text, in_reasoning=True) == expected
    joined = (expected[0] or "", expected[1] or "")
    for pieces in _chunkings(text):
        assert _streamed(parser, pieces, True) == joined, pieces


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("text", TEXTS)
def test_thinking_off_is_all_content(parser: str, text: str) -> None:
    # An empty output's content is None, as with every parser here (vLLM's identity: "").
    assert get_reasoning_parser(parser).extract(text, in_reasoning=False) == (None, text or None)
    for pieces in _chunkings(text):
        assert _streamed(parser, pieces, False) == ("", text), pieces


def test_without_the_replica_word_each_parser_has_vllm_default() -> None:
    # in_reasoning None (no prompt read): vLLM's parser built with no chat_template_kwargs.
    text = "plan it</think>The answer."
    assert get_reasoning_parser("deepseek_v3").extract(text) == (None, text)
    assert get_reasoning_parser("kimi_k2").extract(text) == ("plan it", "The answer.")


class _Tokenizer:
    all_special_ids = (0,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [{"<think>": START, "</think>": END}[text]]


@pytest.mark.parametrize("parser", PARSERS)
def test_front_delays_the_grammar_only_while_thinking(parser: str) -> None:
    front = ReasoningFront(parser, _Tokenizer())
    on = StructuredOutputsParams(json_object=True)
    assert front.prepare(PROMPTS["open"], on, {"thinking": True}) is True
    assert on.reasoning_end_token_id == END
    for prompt, kwargs in (("open", {"thinking": False}), ("closed", {"thinking": True})):
        off = StructuredOutputsParams(json_object=True)  # vLLM: is_reasoning_end is true
        assert front.prepare(PROMPTS[prompt], off, kwargs) is False
        assert off.reasoning_end_token_id is None


# ---- LLMServer over the tiny reasoning model ----------------------------------------------

# The tiny model's template opens no think block (its generation prompt has no tags), so only
# the request's kwargs decide. Greedy with these biases it writes " most<think>…</think>…".
ARGS = {"model": "builtin:tiny-qwen3-reasoning", "num_kv_blocks": 64, "device": "cpu",
        "reasoning_parser": "deepseek_v3"}  # fmt: skip
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]
PARAMS = {"temperature": 0, "max_tokens": 24,
          "logit_bias": {THINK_START_ID: 6.0, THINK_END_ID: 8.0}}  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[LLMServer]:
    server = LLMServer("r", ARGS)
    yield server
    server.engine.shutdown()


def _joined(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(c["delta"].get(key) or "" for c in chunks)


def test_server_chat_template_kwargs_switch_the_split(server: LLMServer) -> None:
    ids = server.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    raw, _ = serve_chat(server, GenerateRequest(prompt_token_ids=ids, params=PARAMS), False)
    text = raw.choices[0].text
    reasoning, _, content = text.replace("<think>", "", 1).partition("</think>")
    assert content and "<think>" in reasoning  # the case measured: a second <think> inside
    for kwargs, expected in (
        (None, (None, text)),
        ({"thinking": False}, (None, text)),
        ({"thinking": True}, (reasoning, content)),
        ({"reasoning_effort": "high"}, (reasoning, content)),
    ):
        request = GenerateRequest(messages=MESSAGES, params=PARAMS, chat_template_kwargs=kwargs)
        whole, _ = serve_chat(server, request, stream=False)
        message = whole.whole()["choices"][0]["message"]
        assert (message.get("reasoning_content"), message["content"]) == expected, kwargs
        _, chunks = serve_chat(server, request, stream=True)
        assert _joined(chunks, "reasoning_content") == (expected[0] or ""), kwargs
        assert _joined(chunks, "content") == expected[1], kwargs
