"""The tokenizer of ``builtin:tiny-gpt-oss``: the tiny models' byte-level BPE with gpt-oss's
harmony special tokens added after the trained vocabulary (special, as in gpt-oss's own
tokenizer), and its tokenizer files. Generation stops at ``<|return|>`` (the end of a final
answer) and ``<|call|>`` (the end of a tool call), as gpt-oss's ``generation_config`` says.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from engine.tiny_tokenizer import (
    TOKENIZER_VOCAB_SIZE,
    build_tokenizer,
    write_json,
    write_tokenizer,
)

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
HARMONY_TOKENS: tuple[str, ...] = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
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
    """The tiny tokenizer's files with the harmony tokens declared special."""
    write_tokenizer(tokenizer, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for token, token_id in HARMONY_TOKEN_IDS.items():
        config["added_tokens_decoder"][str(token_id)] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    config["additional_special_tokens"] = [*config["additional_special_tokens"], *HARMONY_TOKENS]
    write_json(config_path, config)
