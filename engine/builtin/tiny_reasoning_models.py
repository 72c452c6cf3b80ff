"""``builtin:tiny-qwen3-reasoning``: the tiny Qwen3 of ``engine.builtin.tiny_models`` made a
reasoning model the way Qwen3's checkpoints are: ``<think>`` and ``</think>`` are single added
tokens that decoding keeps in the text (not special tokens), and the chat template is Qwen3's hybrid
one: ``enable_thinking=False`` (a ``chat_template_kwargs`` entry) renders an empty, closed think
block ``<think>\\n\\n</think>\\n\\n`` after the assistant prompt, and earlier assistant turns lose
their think block (only their answer is shown again). Serve it with ``reasoning_parser: qwen3``.

With random weights the model writes ``</think>`` about as often as any other token (~1 in
1000); tests make it appear where they need it with ``logit_bias`` on ``THINK_END_ID``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from engine.builtin.builtin_names import TINY_REASONING_MODEL_NAMES, builtin_dirname
from engine.builtin.tiny_models import (
    _build_config,
    materialize,
    write_tiny_checkpoint,
)
from engine.builtin.tiny_tokenizer import (
    CHAT_TEMPLATE,
    TOKENIZER_VOCAB_SIZE,
    build_tokenizer,
    write_json,
)

THINK_START, THINK_END = "<think>", "</think>"
# Added after the trained vocabulary, as Qwen3's tokenizer adds them after its BPE vocabulary.
THINK_START_ID, THINK_END_ID = TOKENIZER_VOCAB_SIZE, TOKENIZER_VOCAB_SIZE + 1
REASONING_VOCAB_SIZE = TOKENIZER_VOCAB_SIZE + 2

_GENERATION_PROMPT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
_CONTENT = "{% set content = message['content'] if message['content'] is string else '' %}"
REASONING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    _CONTENT,
    _CONTENT
    + "{% if message['role'] == 'assistant' and '</think>' in content %}"
    + "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}",
).replace(
    _GENERATION_PROMPT,
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}",
)
# Both replacements must have found their text: a changed base template fails loudly here.
if REASONING_CHAT_TEMPLATE.count("</think>") != 3:
    raise RuntimeError("the reasoning chat template no longer matches the base template")


def build_reasoning_tokenizer() -> Tokenizer:
    tokenizer = build_tokenizer()
    tags = [AddedToken(t, special=False, normalized=False) for t in (THINK_START, THINK_END)]
    tokenizer.add_tokens(tags)
    if [tokenizer.token_to_id(t) for t in (THINK_START, THINK_END)] != [
        THINK_START_ID,
        THINK_END_ID,
    ]:
        raise RuntimeError("the think tokens did not get the ids after the trained vocabulary")
    return tokenizer


def make_tiny_reasoning_model(out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write ``tiny-qwen3-reasoning`` into ``out_dir``: tiny-qwen3's recipe over the vocabulary
    with the think tokens, whose rows are drawn like every other token's."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_reasoning_tokenizer()
    write_tiny_checkpoint(out, _build_config("tiny-qwen3", REASONING_VOCAB_SIZE), tokenizer, seed)
    tokenizer_config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text(encoding="utf-8"))
    tokenizer_config["chat_template"] = REASONING_CHAT_TEMPLATE
    for token_id, tag in ((THINK_START_ID, THINK_START), (THINK_END_ID, THINK_END)):
        tokenizer_config["added_tokens_decoder"][str(token_id)] = {
            "content": tag,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": False,
        }
    write_json(tokenizer_config_path, tokenizer_config)
    return out


def materialize_tiny_reasoning(name: str) -> Path:
    """``builtin:<name>`` of a tiny reasoning model: written once into the model cache."""
    if name not in TINY_REASONING_MODEL_NAMES:
        valid = ", ".join(TINY_REASONING_MODEL_NAMES)
        raise ValueError(f"unknown tiny reasoning model {name!r}; valid names are {valid}")
    return materialize(builtin_dirname(name), lambda out: make_tiny_reasoning_model(out))
