"""The reasoning parsers on strings: the whole-output split of each parser, the streamed split
(tags cut at every position, one character at a time), and the prompt's think tags."""

from __future__ import annotations

import itertools

import pytest

from cluster.api.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    get_reasoning_parser,
    think_token_ids,
)

# (text, in_reasoning or None for the default, qwen3's split, deepseek_r1's split)
CASES = [
    ("<think>I reason.</think>The answer.", None,
     ("I reason.", "The answer."), ("I reason.", "The answer.")),
    ("I reason.</think>The answer.", None,
     (None, "I reason.</think>The answer."), ("I reason.", "The answer.")),
    ("Just an answer.", None, (None, "Just an answer."), ("Just an answer.", None)),
    ("<think>cut off mid-thought", None,
     ("cut off mid-thought", None), ("cut off mid-thought", None)),
    ("<think></think>", None, ("", None), ("", None)),
    ("", None, (None, None), ("", None)),
    ("<think>a</think>b</think>c<think>d", None,
     ("a", "b</think>c<think>d"), ("a", "b</think>c<think>d")),
    ("pre<think>r</think>c", None, ("r", "pre" + "c"), ("prer", "c")),
    ("<thin>not a tag</thi", None, (None, "<thin>not a tag</thi"), ("<thin>not a tag</thi", None)),
    ("r<<think>x</</think>y<", None, ("x</", "r<y<"), ("r<x</", "y<")),
    # The prompt opened the block (a Qwen3-Thinking template): the output starts in reasoning.
    ("I reason.</think>The answer.", True,
     ("I reason.", "The answer."), ("I reason.", "The answer.")),
    # The prompt closed it (enable_thinking=False): all content, tags and all.
    ("x</think>y", False, (None, "x</think>y"), (None, "x</think>y")),
]  # fmt: skip


def _streamed(parser, text: str, cuts: tuple[int, ...], in_reasoning: bool | None):
    streamer = parser.streamer(in_reasoning=in_reasoning)
    reasoning, content = [], []
    bounds = [0, *cuts, len(text)]
    for a, b in itertools.pairwise(bounds):
        r, c = streamer.feed(text[a:b])
        reasoning.append(r)
        content.append(c)
    r, c = streamer.finish()
    reasoning.append(r)
    content.append(c)
    return "".join(reasoning), "".join(content), streamer.entered_reasoning


@pytest.mark.parametrize("text,in_reasoning,qwen3,deepseek_r1", CASES)
def test_extract(text, in_reasoning, qwen3, deepseek_r1) -> None:
    assert Qwen3ReasoningParser().extract(text, in_reasoning=in_reasoning) == qwen3
    assert DeepSeekR1ReasoningParser().extract(text, in_reasoning=in_reasoning) == deepseek_r1


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text,in_reasoning", [(c[0], c[1]) for c in CASES])
def test_streamed_split_adds_up_to_the_whole_split(name, text, in_reasoning) -> None:
    """Every cut into two deltas and every cut into three (tags split at every position), and
    one character per delta: the deltas join to the whole-output split."""
    parser = get_reasoning_parser(name)
    want_reasoning, want_content = parser.extract(text, in_reasoning=in_reasoning)
    n = len(text)
    cut_sets = [(i,) for i in range(n + 1)]
    cut_sets += list(itertools.combinations(range(1, n), 2))
    cut_sets.append(tuple(range(1, n)))
    for cuts in cut_sets:
        reasoning, content, entered = _streamed(parser, text, cuts, in_reasoning)
        if parser.empty_reasoning_is_none:
            reasoning = reasoning or None
        assert (reasoning if entered else None) == want_reasoning, cuts
        assert (content or None) == want_content, cuts


def test_held_back_only_while_a_tag_may_start() -> None:
    streamer = Qwen3ReasoningParser().streamer()
    assert streamer.feed("Hello <th") == ("", "Hello ")
    assert streamer.feed("ink>Hmm") == ("Hmm", "")
    assert streamer.feed(" ok </") == (" ok ", "")
    assert streamer.feed("b>") == ("</b>", "")
    assert streamer.feed("</think") == ("", "")
    assert streamer.feed(">Done <th") == ("", "Done <th")  # content: nothing held any more
    assert streamer.finish() == ("", "")

    streamer = DeepSeekR1ReasoningParser().streamer()
    assert streamer.feed("deep <") == ("deep ", "")
    assert streamer.finish() == ("<", "")


def test_prompt_tags_decide_where_the_output_starts() -> None:
    start, end = 7, 8
    qwen3, r1 = Qwen3ReasoningParser(), DeepSeekR1ReasoningParser()
    assert not qwen3.output_starts_in_reasoning([1, 2, 3], start, end)
    assert r1.output_starts_in_reasoning([1, 2, 3], start, end)
    assert qwen3.output_starts_in_reasoning([1, 7, 3], start, end)
    for parser in (qwen3, r1):
        assert not parser.output_starts_in_reasoning([7, 4, 8, 5], start, end)
        assert parser.reasoning_ended_in_prompt([7, 4, 8, 5], start, end)
        assert not parser.reasoning_ended_in_prompt([8, 4, 7, 5], start, end)
        assert not parser.reasoning_ended_in_prompt([1, 2], start, end)


def test_unknown_parser_names_field_and_choices() -> None:
    names = "deepseek_r1, deepseek_v3, glm45, kimi_k2, openai_gptoss, qwen3"
    with pytest.raises(ValueError, match=f"unknown parser 'qwen'; one of {names}"):
        get_reasoning_parser("qwen")


class _Tokenizer:
    """Encodes each known tag to one id, anything else to one id per character."""

    def __init__(self, vocab: dict[str, int], special: tuple[int, ...] = ()) -> None:
        self.vocab, self.all_special_ids = vocab, list(special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.vocab[text]] if text in self.vocab else [ord(c) for c in text]


def test_think_token_ids() -> None:
    assert think_token_ids(_Tokenizer({"<think>": 5, "</think>": 6}), "qwen3") == (5, 6)
    with pytest.raises(ValueError, match=r"reasoning_parser: 'qwen3' needs </think> as one token"):
        think_token_ids(_Tokenizer({"<think>": 5}), "qwen3")
    with pytest.raises(ValueError, match=r"</think> is a special token"):
        think_token_ids(_Tokenizer({"<think>": 5, "</think>": 6}, special=(6,)), "deepseek_r1")


def test_deployment_config_checks_the_name() -> None:
    from cluster.config import load_config
    from engine.errors import ConfigError
    from tests.cluster.conftest import load_yaml

    data = load_yaml("tiny.yaml")
    kwargs = data["models"][0]["engine_kwargs"]
    kwargs["reasoning_parser"] = "deepseek-r1"
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert str(info.value) == (
        "models[0].engine_kwargs.reasoning_parser: unknown parser 'deepseek-r1'; "
        "one of deepseek_r1, deepseek_v3, glm45, kimi_k2, openai_gptoss, qwen3"
    )
    kwargs["reasoning_parser"] = 3
    with pytest.raises(ConfigError, match=r"engine_kwargs\.reasoning_parser"):
        load_config(data)
    kwargs["reasoning_parser"] = "qwen3"
    assert load_config(data).models[0].engine_kwargs["reasoning_parser"] == "qwen3"
    shipped = load_config(load_yaml("tiny-reasoning.yaml")).models[0]
    assert shipped.engine_kwargs["reasoning_parser"] == "qwen3"
