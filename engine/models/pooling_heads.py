"""A family's decoder under a pooling head (``engine.model_heads`` picks the task):

    embed      XModel                     the decoder alone, no LM head
    classify   XForSequenceClassification the decoder + ``score`` [num_labels, hidden]
               (from a causal LM)          ``score`` built from the LM head's rows of the
                                           ``classifier_from_token`` ids (two-way: yes - no)

The class is the family's ``CausalLM`` subclassed once per head, so the loader and the
meta-device parameter listing build the same model. ``classify_hidden`` maps pooled final
hidden states to class logits on the driver and ``class_scores`` those to scores; ``score`` is
kept in float32, replicated on every rank of the last stage (it is a few rows).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import nn

from engine.model_heads import classifier_activation, num_labels, two_way_softmax
from engine.models.decoder import CausalLM
from parallel.state import ParallelContext

_LM_HEAD = "lm_head.weight"
_EMBEDDING = "model.embed_tokens.weight"


class _BareDecoder:
    """Mixin for a ``CausalLM`` subclass: no LM head; a causal checkpoint's ``lm_head`` is
    skipped."""

    has_lm_head: ClassVar[bool] = False

    def checkpoint_skipped(self, name: str) -> bool:
        if name == _LM_HEAD and not self._reads_lm_head():
            return True
        family = getattr(super(), "checkpoint_skipped", None)
        return bool(family(name)) if family is not None else False

    def _reads_lm_head(self) -> bool:
        return False


class _Classifier(_BareDecoder):
    """Mixin: ``score`` [num_labels, hidden] on the last stage; from the checkpoint's
    ``score.weight``, or from LM-head rows when ``token_ids`` is set."""

    token_ids: ClassVar[tuple[int, ...]] = ()

    def __init__(self, hf: dict[str, Any], ctx: ParallelContext, ops: Any = None) -> None:
        super().__init__(hf, ctx, ops)  # type: ignore[call-arg]
        self.activation = classifier_activation(hf)
        self.score: nn.Linear | None = None
        if ctx.pp.is_last:
            self.score = nn.Linear(
                hf["hidden_size"], num_labels(hf), bias=False, dtype=torch.float32
            ).requires_grad_(False)
            if self.token_ids:
                two_way = two_way_softmax(hf)
                self.score.weight.weight_loader = functools.partial(  # type: ignore[attr-defined]
                    _load_token_rows, token_ids=self.token_ids, two_way=two_way
                )

    def _reads_lm_head(self) -> bool:
        return bool(self.token_ids)

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        if self.token_ids and name == _LM_HEAD:
            return "score.weight", None
        family = getattr(super(), "checkpoint_target", None)
        return family(name) if family is not None else None

    def checkpoint_aliases(self, name: str) -> Any:
        # Tied embeddings: the LM head's rows are the embedding's.
        tied = bool(self.hf.get("tie_word_embeddings", self.tie_word_embeddings_default))  # type: ignore[attr-defined]
        if self.token_ids and tied and name == _EMBEDDING:
            yield "score.weight"

    def classify_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Class logits (float32) of pooled final hidden states ``[N, hidden]``."""
        if self.score is None:
            raise RuntimeError("classify_hidden called on a pipeline stage without the head")
        return torch.nn.functional.linear(hidden.to(torch.float32), self.score.weight)

    def class_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """One input's scores ``[num_labels]`` from its logits, by the checkpoint's activation
        (``engine.model_heads.classifier_activation``)."""
        if self.activation == "softmax":
            return torch.softmax(logits, dim=-1)
        if self.activation == "sigmoid":
            return torch.sigmoid(logits)
        return torch.tanh(logits) if self.activation == "tanh" else logits


def _load_token_rows(
    param: nn.Parameter, tensor: torch.Tensor, *, token_ids: tuple[int, ...], two_way: bool
) -> None:
    """The classes' rows of a full LM-head (or tied embedding) tensor ``[vocab, hidden]``."""
    full = tensor if isinstance(tensor, torch.Tensor) else tensor[:]  # a safetensors slice
    rows = full[list(token_ids)].to(torch.float32)
    if two_way:
        rows = rows[1:2] - rows[0:1]  # logit(second) - logit(first): sigmoid = 2-way softmax
    if tuple(rows.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(rows.shape)} does not match {tuple(param.shape)}")
    param.data.copy_(rows)


@functools.cache
def with_head(family: type[CausalLM], task: str, token_ids: tuple[int, ...] = ()) -> type:
    """``family`` under the head of ``task`` (``embed`` or ``classify``), one class each."""
    base = family.__name__.removesuffix("ForCausalLM")
    if task == "embed":
        return type(f"{base}Model", (_BareDecoder, family), {})
    if task == "classify":
        attrs = {"token_ids": tuple(token_ids)}
        return type(f"{base}ForSequenceClassification", (_Classifier, family), attrs)
    raise ValueError(f"task: no pooling head for {task!r}")


__all__ = ["with_head"]
