"""The tokenizer of ``builtin:tiny-gpt-oss``: the tiny models' byte-level BPE with gpt-oss's
harmony special tokens added after the trained vocabulary (special, as in gpt-oss's own
tokenizer), the harmony chat template (``engine.harmony_template``, which the server renders
every harmony chat with), and its tokenizer files. Generation stops at ``<|return|>`` (the end
of a final answer) and ``<|call|>`` (the end of a tool call), as gpt-oss's
``generation_config`` says. The ``openai-harmony`` package downloads its o200k encoding at run
time, and this tokenizer is not o200k, so neither it nor its renderer is used.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from engine.builtin.tiny_tokenizer import (
    IM_END_TOKEN,
    IM_START_TOKEN,
    TOKENIZER_VOCAB_SIZE,
    build_tokenizer,
    declare_special_tokens,
    write_tokenizer,
)
from engine.harmony_template import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    HARMONY_CHAT_TEMPLATE,
    HARMONY_TOKENS,
    MESSAGE,
    RETURN,
    START,
)

# The harmony tokens are defined in engine.harmony_template and re-exported here for the readers
# that take them from this module.
__all__ = [
    "CALL",
    "CHANNEL",
    "CONSTRAIN",
    "END",
    "HARMONY_STOP_TOKEN_IDS",
    "HARMONY_TOKENS",
    "HARMONY_TOKEN_IDS",
    "HARMONY_VOCAB_SIZE",
    "MESSAGE",
    "RETURN",
    "START",
    "build_harmony_tokenizer",
    "write_harmony_tokenizer",
]

# Added after the trained vocabulary in this order.
HARMONY_TOKEN_IDS: dict[str, int] = {
    token: TOKENIZER_VOCAB_SIZE + i for i, token in enumerate(HARMONY_TOKENS)
}
HARMONY_VOCAB_SIZE = TOKENIZER_VOCAB_SIZE + len(HARMONY_TOKENS)
# gpt-oss's generation_config stops at these two.
HARMONY_STOP_TOKEN_IDS: tuple[int, ...] = (HARMONY_TOKEN_IDS[RETURN], HARMONY_TOKEN_IDS[CALL])


def build_harmony_tokenizer() -> Tokenizer:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS]
    )
    got = {t: tokenizer.token_to_id(t) for t in HARMONY_TOKENS}
    if got != HARMONY_TOKEN_IDS:
        raise RuntimeError(f"the harmony tokens got ids {got}, expected {HARMONY_TOKEN_IDS}")
    return tokenizer


def write_harmony_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """The tiny tokenizer's files with the harmony tokens declared special and the harmony chat
    template."""
    write_tokenizer(tokenizer, out)
    declare_special_tokens(
        out,
        HARMONY_TOKEN_IDS,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN, *HARMONY_TOKENS],
        chat_template=HARMONY_CHAT_TEMPLATE,
    )
