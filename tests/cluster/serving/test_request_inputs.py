"""``request_prompt`` (``cluster.serving.request_inputs``) with a recording tokenizer: a text
prompt is tokenized with the tokenizer's special tokens unless the request turns them off, for
generation and pooling (vLLM's ``add_special_tokens``) alike."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.api.replica_messages import EmbedRequest, GenerateRequest
from cluster.serving.request_inputs import request_prompt


class _Tokenizer:
    """``encode`` as a BOS-adding tokenizer: one id per character, BOS (1) first if asked."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [ord(c) for c in text]


@pytest.mark.parametrize(
    ("request_", "with_bos"),
    [
        (EmbedRequest(prompt="hi"), True),
        (EmbedRequest(prompt="hi", add_special_tokens=False), False),
        (GenerateRequest(prompt="hi"), True),
        (GenerateRequest(prompt="hi", add_special_tokens=False), False),
    ],
)
def test_a_text_prompt_has_special_tokens_unless_turned_off(request_: Any, with_bos: bool) -> None:
    prompt = request_prompt(_Tokenizer(), request_, None, None)
    assert prompt == {"prompt": "hi", "prompt_token_ids": [1] * with_bos + [104, 105]}
