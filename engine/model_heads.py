"""Which head sits on a checkpoint's decoder, and so what the model serves: text
(``generate``), embeddings (``embed``) or class scores (``classify``).

vLLM's rules and names: the ``runner`` engine argument (``auto`` / ``generate`` / ``pooling``)
and ``convert`` (``auto`` / ``none`` / ``embed`` / ``classify``) pick the task; ``auto`` reads
the architecture's suffix:

    XForCausalLM                 generate (runner pooling: embed, or classify with
                                 ``classifier_from_token``: scores from LM-head rows)
    XForSequenceClassification   classify (a ``score`` linear layer, ``id2label`` labels)
    XModel                       embed (the bare decoder; checkpoint names without ``model.``)

A generating model also serves embeddings (its pooled final hidden states). Every family
decoder builds under every head: ``family_architecture`` names the ``XForCausalLM`` whose
code runs. Torch-free: the CLI checks a config with it before anything is placed.
"""

from __future__ import annotations

from typing import Any, Literal

from engine.errors import ConfigError

Task = Literal["generate", "embed", "classify"]
RUNNERS: tuple[str, ...] = ("auto", "generate", "pooling")
CONVERTS: tuple[str, ...] = ("auto", "none", "embed", "classify")

_CAUSAL = "ForCausalLM"
_SUFFIX_TASK: tuple[tuple[str, Task], ...] = (
    ("ForSequenceClassification", "classify"),
    (_CAUSAL, "generate"),
    ("Model", "embed"),
)


def declared_architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    return str(archs[0]) if archs else ""


def _split(arch: str) -> tuple[str, Task] | None:
    for suffix, task in _SUFFIX_TASK:
        if arch.endswith(suffix) and len(arch) > len(suffix):
            return arch[: -len(suffix)], task
    return None


def family_architecture(hf: dict[str, Any]) -> str:
    """The ``XForCausalLM`` name whose decoder the checkpoint's architecture is (the declared
    name when it has none of the three suffixes)."""
    arch = declared_architecture(hf)
    split = _split(arch)
    return split[0] + _CAUSAL if split is not None else arch


def classifier_tokens(hf: dict[str, Any]) -> tuple[str, ...]:
    """``classifier_from_token`` (vLLM's ``hf_overrides`` key): the tokens whose LM-head rows
    are the classes of a causal LM run as a classifier (Qwen3-Reranker: ``["no", "yes"]``)."""
    tokens = hf.get("classifier_from_token")
    if tokens is None:
        return ()
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ConfigError(
            f"classifier_from_token: must be a non-empty list of token strings, got {tokens!r}"
        )
    return tuple(tokens)


def two_way_softmax(hf: dict[str, Any]) -> bool:
    """Two classifier tokens scored as one label, ``P(second) = sigmoid(l[1] - l[0])`` (vLLM's
    ``method: from_2_way_softmax``; Qwen3-Reranker's ``is_original_qwen3_reranker``)."""
    method = hf.get("method")
    two_way = bool(hf.get("is_original_qwen3_reranker")) or method == "from_2_way_softmax"
    if two_way and len(classifier_tokens(hf)) != 2:
        raise ConfigError(
            f"classifier_from_token: a two-way softmax scores exactly two tokens, got "
            f"{list(classifier_tokens(hf))!r}"
        )
    return two_way


def pair_uses_sep_token(hf: dict[str, Any]) -> bool:
    """How a cross-encoder's (text_1, text_2) pair becomes one prompt, as vLLM decides it: the
    tokenizer's pair encoding (its separator between them), except for a causal LM turned into a
    classifier by ``method`` (Qwen3-Reranker's ``is_original_qwen3_reranker``), whose texts are
    concatenated and encoded as one; the config's ``use_sep_token`` decides when it is set."""
    given = hf.get("use_sep_token")
    if given is not None:
        if not isinstance(given, bool):
            raise ConfigError(f"use_sep_token: must be true or false, got {given!r}")
        return given
    return hf.get("method") is None and not hf.get("is_original_qwen3_reranker")


def num_labels(hf: dict[str, Any]) -> int:
    """Classes of a classifier: one per classifier token (one for a two-way softmax), else
    ``id2label``'s entries (HF's default: 2)."""
    if classifier_tokens(hf):
        return 1 if two_way_softmax(hf) else len(classifier_tokens(hf))
    labels = hf.get("id2label")
    if labels is None:
        return int(hf.get("num_labels", 2))
    if not isinstance(labels, dict) or not labels:
        raise ConfigError(f"id2label: must be a non-empty mapping, got {labels!r}")
    return len(labels)


def label_names(hf: dict[str, Any]) -> tuple[str, ...]:
    """Each class's name: ``id2label`` (``LABEL_i`` where it has none), the classifier
    tokens, or the second token alone for a two-way softmax."""
    tokens = classifier_tokens(hf)
    if tokens:
        return (tokens[1],) if two_way_softmax(hf) else tokens
    labels = hf.get("id2label") or {}
    return tuple(str(labels.get(str(i), f"LABEL_{i}")) for i in range(num_labels(hf)))


Activation = Literal["sigmoid", "softmax", "identity", "tanh"]
# The sentence-transformers cross-encoder activations (their torch.nn class names) served.
_NAMED_ACTIVATIONS: dict[str, Activation] = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
}


def classifier_activation(hf: dict[str, Any]) -> Activation:
    """What turns a classifier's logits into its scores, as vLLM and Hugging Face's loss pick
    it: ``problem_type`` (``regression``: the logits themselves; ``multi_label_classification``:
    a sigmoid per class), else a cross-encoder's ``sentence_transformers.activation_fn`` (or
    ``sbert_ce_default_activation_function``), else a sigmoid for one class and a softmax for
    more. An activation this engine does not have is a ``ConfigError`` naming it."""
    problem = hf.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem != "single_label_classification":
        st = hf.get("sentence_transformers")
        for field, named in (
            (
                "sentence_transformers.activation_fn",
                st.get("activation_fn") if isinstance(st, dict) else None,
            ),
            (
                "sbert_ce_default_activation_function",
                hf.get("sbert_ce_default_activation_function"),
            ),
        ):
            if named is None:
                continue
            if named not in _NAMED_ACTIVATIONS:
                raise ConfigError(
                    f"{field}: {named!r} is not served (one of {', '.join(_NAMED_ACTIVATIONS)})"
                )
            return _NAMED_ACTIVATIONS[named]
    return "sigmoid" if num_labels(hf) < 2 else "softmax"


def resolve_task(hf: dict[str, Any], runner: str, convert: str) -> Task:
    """The model's task from its architecture and the ``runner`` / ``convert`` arguments, or
    ``ConfigError`` naming the argument that asks for something the checkpoint cannot do (or a
    classifier's activation it cannot apply)."""
    task = _task(hf, runner, convert)
    if task == "classify":
        classifier_activation(hf)  # refused here, before anything is placed
    return task


def _task(hf: dict[str, Any], runner: str, convert: str) -> Task:
    arch = declared_architecture(hf)
    split = _split(arch)
    declared: Task = split[1] if split is not None else "generate"
    if runner == "generate":
        if declared != "generate":
            raise ConfigError(
                f"runner: 'generate' needs a causal LM; {arch} has no LM head (runner: pooling)"
            )
        if convert not in ("auto", "none"):
            raise ConfigError(f"convert: {convert!r} needs runner: pooling (got 'generate')")
        return "generate"
    if runner == "auto" and convert == "auto":
        return "classify" if declared == "generate" and classifier_tokens(hf) else declared
    # runner pooling (or a convert that implies it)
    if convert in ("auto", "none"):
        wanted: Task = "classify" if classifier_tokens(hf) else "embed"
        task = declared if declared != "generate" else wanted
    else:
        task = "embed" if convert == "embed" else "classify"
    if task == "classify" and declared != "classify" and not classifier_tokens(hf):
        raise ConfigError(
            f"convert: 'classify' of {arch} needs class weights: a *ForSequenceClassification "
            "checkpoint, or hf_overrides.classifier_from_token naming the tokens whose LM-head "
            "rows score the classes"
        )
    if task == "classify" and declared == "embed":
        raise ConfigError(f"convert: 'classify' of {arch}: a bare decoder has no class weights")
    return task


__all__ = [
    "CONVERTS",
    "RUNNERS",
    "Activation",
    "Task",
    "classifier_activation",
    "classifier_tokens",
    "declared_architecture",
    "family_architecture",
    "label_names",
    "num_labels",
    "pair_uses_sep_token",
    "resolve_task",
    "two_way_softmax",
]
