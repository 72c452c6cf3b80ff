"""Request bodies of the pooling routes beside OpenAI's embeddings, in vLLM's shapes:
``/classify`` (``ClassificationRequest``), ``/score`` (``ScoreRequest``: ``text_1`` against
``text_2``) and ``/rerank`` (``RerankRequest``: Jina's and Cohere's ``query``, ``documents``,
``top_n``, ``return_documents``). Shapes are checked here; ranges and what a model can do by
the engine (``engine.client.scoring``), whose 400s name the field."""

from __future__ import annotations

from pydantic import Field

from cluster.api.openai_models import Text, TruncationSide, _Model

_MAX_TEXTS = 1024  # texts per request, as the embeddings route's inputs


class ClassificationRequest(_Model):
    model: Text
    input: Text | list[Text]
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (BOS)
    user: Text | None = None
    truncate_prompt_tokens: int | None = Field(None, json_schema_extra={"minimum": -1})
    truncation_side: TruncationSide | None = None


class ScoreRequest(_Model):
    model: Text
    text_1: Text | list[Text]
    text_2: Text | list[Text]
    user: Text | None = None


class RerankDocument(_Model):
    text: Text


class RerankRequest(_Model):
    model: Text
    query: Text
    documents: list[Text | RerankDocument] = Field(max_length=_MAX_TEXTS)
    # 0 or None: every document (vLLM's and Jina's default); Cohere's name.
    top_n: int | None = Field(None, json_schema_extra={"minimum": 0})
    return_documents: bool = True
    user: Text | None = None

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


__all__ = ["ClassificationRequest", "RerankDocument", "RerankRequest", "ScoreRequest"]
