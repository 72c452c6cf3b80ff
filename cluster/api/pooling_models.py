"""Request bodies of the pooling routes beside OpenAI's embeddings, in vLLM's shapes:
``/classify`` (``ClassificationRequest``), ``/score`` (``ScoreRequest``: ``queries`` against
``documents``, or vLLM's other names for the two sides) and ``/rerank`` (``RerankRequest``:
Jina's and Cohere's ``query``, ``documents``, ``top_n``, ``return_documents``). Shapes are
checked here; ranges and what a model can do by the engine (``engine.client.scoring``), whose
400s name the field."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from cluster.api.openai_models import Text, TokenId, TruncationSide, _Model

_MAX_TEXTS = 1024  # documents per rerank request


class ClassificationRequest(_Model):
    model: Text
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]]  # as on /v1/embeddings
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (BOS)
    user: Text | None = None
    truncate_prompt_tokens: int | None = Field(None, json_schema_extra={"minimum": -1})
    truncation_side: TruncationSide | None = None


# vLLM 0.32's names for the two sides of a score request, its documented pair first.
SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
               ("text_1", "text_2"))  # fmt: skip
SCORE_FIELDS = tuple(dict.fromkeys(name for pair in SCORE_PAIRS for name in pair))


class ScoreRequest(_Model):
    """One side against the other, under any of vLLM's names for them (``SCORE_PAIRS``):
    ``sides()`` reads the pair the request gives."""

    model: Text
    queries: Text | list[Text] | None = None
    documents: Text | list[Text] | None = None
    items: Text | list[Text] | None = None
    data_1: Text | list[Text] | None = None
    data_2: Text | list[Text] | None = None
    text_1: Text | list[Text] | None = None
    text_2: Text | list[Text] | None = None
    user: Text | None = None

    def sides(self) -> tuple[str | list[str], str | list[str]] | tuple[str, None]:
        """The two sides (the first pair of ``SCORE_PAIRS`` given whole), or (the name of
        the field missing, None)."""
        given = {name for name in SCORE_FIELDS if getattr(self, name) is not None}
        for first, second in SCORE_PAIRS:
            if {first, second} <= given:
                return getattr(self, first), getattr(self, second)
        first, second = next(((a, b) for a, b in SCORE_PAIRS if {a, b} & given), SCORE_PAIRS[0])
        return (second if first in given else first), None


class RerankDocument(_Model):
    text: Text


class RerankRequest(_Model):
    model: Text
    query: Text
    # One document may come bare, as vLLM takes it.
    documents: Text | Annotated[list[Text | RerankDocument], Field(max_length=_MAX_TEXTS)]
    # 0 or None: every document (vLLM's and Jina's default); Cohere's name.
    top_n: int | None = Field(None, json_schema_extra={"minimum": 0})
    return_documents: bool = True
    user: Text | None = None

    def document_texts(self) -> list[str]:
        documents = [self.documents] if isinstance(self.documents, str) else self.documents
        return [d if isinstance(d, str) else d.text for d in documents]


__all__ = [
    "SCORE_PAIRS",
    "ClassificationRequest",
    "RerankDocument",
    "RerankRequest",
    "ScoreRequest",
]
