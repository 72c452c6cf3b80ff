"""``speculative_config``: vLLM's dict of speculative-decoding settings, as one frozen section.

    speculative_config = {"method": "ngram", "num_speculative_tokens": 3,
                          "prompt_lookup_min": 2, "prompt_lookup_max": 4}

``method``: ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence
of the sequence's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``).
``draft_model``: a smaller checkpoint (``model``, a local HF directory or ``builtin:<name>``, with
the target's vocabulary) run on the same workers proposes greedily (``engine.spec_decode.draft``).
Keys are vLLM's (``-`` read as ``_``, null as unset); vLLM's draft settings are accepted only
with the value this engine serves (the draft is sharded like the target, covers its
max_model_len, is unquantized and never captured in CUDA graphs). vLLM's other methods are
refused by name rather than silently ignored. Combinations the engine cannot verify exactly are
refused in ``check_speculative_support`` naming the other field.

No torch here: the deployment check imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.validation import check_choice, check_int, require

METHODS = ("ngram", "draft_model")
# vLLM's spellings that name a method this engine does not build yet.
_NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "draft_tensor_parallel_size",
    "max_model_len",
    "quantization",
    "revision",
    "enforce_eager",
)
MAX_SPECULATIVE_TOKENS = 16
# The n-gram index registers every n in [min, max] at each position (O(n_max^2) work and
# O(n_max) entries per token, engine.spec_decode.ngram), so n_max is kept small.
MAX_PROMPT_LOOKUP = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    # vLLM's defaults when neither is given.
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # method draft_model: the draft checkpoint (None for ngram).
    model: str | None = None
    # vLLM's draft settings, each accepted only where it asks for what is served anyway (None:
    # unset). The draft runs on the target's TP ranks, sharded by tensor_parallel_size
    # (check_speculative_support), with the target's max_model_len.
    draft_tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    quantization: str | None = None
    revision: str | None = None
    enforce_eager: bool | None = None

    def __post_init__(self) -> None:
        key = "speculative_config."
        require(
            self.method not in _NOT_BUILT,
            key + "method",
            f"must be one of {', '.join(repr(m) for m in METHODS)} "
            f"({self.method!r} is not supported by this engine), got {self.method!r}",
        )
        check_choice(self.method, key + "method", METHODS)
        check_int(
            self.num_speculative_tokens,
            key + "num_speculative_tokens",
            ge=1,
            le=MAX_SPECULATIVE_TOKENS,
        )
        check_int(self.prompt_lookup_min, key + "prompt_lookup_min", ge=1, le=MAX_PROMPT_LOOKUP)
        check_int(
            self.prompt_lookup_max,
            key + "prompt_lookup_max",
            ge=self.prompt_lookup_min,
            le=MAX_PROMPT_LOOKUP,
            note="prompt_lookup_min",
        )
        if self.method == "draft_model":
            require(
                isinstance(self.model, str) and bool(self.model),
                key + "model",
                f"must name the draft checkpoint (a local HF directory or builtin:<name>) for "
                f"method 'draft_model', got {self.model!r}",
            )
        else:
            require(
                self.model is None,
                key + "model",
                f"must be null for method {self.method!r} (only 'draft_model' loads a draft "
                f"model), got {self.model!r}",
            )
        self._check_draft_settings()

    def _check_draft_settings(self) -> None:
        """Those whose served value needs no other section; ``check_speculative_support``
        checks ``draft_tensor_parallel_size`` and ``max_model_len`` against the target's."""
        key = "speculative_config."
        check_int(self.draft_tensor_parallel_size, key + "draft_tensor_parallel_size", ge=1,
                  optional=True)  # fmt: skip
        check_int(self.max_model_len, key + "max_model_len", ge=1, optional=True)
        require(
            self.quantization is None,
            key + "quantization",
            f"must be null (a draft is served unquantized, in the target's dtype; quantized "
            f"draft checkpoints are refused), got {self.quantization!r}",
        )
        require(
            self.revision is None,
            key + "revision",
            f"must be null (nothing is fetched: point model at a directory holding that "
            f"revision), got {self.revision!r}",
        )
        require(
            self.enforce_eager is None or self.enforce_eager is True,
            key + "enforce_eager",
            f"must be null or true (the draft's passes always run eagerly: they are never "
            f"captured in CUDA graphs), got {self.enforce_eager!r}",
        )

    @classmethod
    def from_arg(cls, value: Any) -> SpeculativeConfig | None:
        """The engine argument (a dict, or None: speculation off) as a config. As in vLLM, a
        key's ``-`` reads as ``_``, a null value as unset, the method is inferred from
        ``model`` when left out, and ``prompt_lookup_min`` is filled from
        ``prompt_lookup_max`` and vice versa when one is given."""
        if value is None:
            return None
        require(
            isinstance(value, dict),
            "speculative_config",
            f"must be a mapping (e.g. {{'method': 'ngram', 'num_speculative_tokens': 3}}) "
            f"or null, got {value!r}",
        )
        fields = _given_fields(value)
        require(
            fields.get("num_speculative_tokens") is not None,
            "speculative_config.num_speculative_tokens",
            f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] (it has no default), got None",
        )
        if "method" not in fields:
            # vLLM infers draft_model from a model, and has no method to infer without one.
            require(
                "model" in fields,
                "speculative_config.method",
                f"must be one of {', '.join(repr(m) for m in METHODS)} when "
                f"speculative_config.model is not given (num_speculative_tokens was provided "
                f"without a speculative method or model)",
            )
            fields["method"] = "draft_model"
        lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        # Each given bound in its own range first, so that the filled-in one is not blamed.
        for name, bound in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            check_int(bound, f"speculative_config.{name}", ge=1, le=MAX_PROMPT_LOOKUP,
                      optional=True)  # fmt: skip
        if lo is None and hi is not None:
            fields["prompt_lookup_min"] = hi
        if hi is None and lo is not None:
            fields["prompt_lookup_max"] = lo
        return cls(**fields)


def _given_fields(value: dict[Any, Any]) -> dict[str, Any]:
    """The keys with ``-`` read as ``_`` (vLLM's create_speculative_config), null values
    dropped; an unknown key or one given in both spellings is refused."""
    fields: dict[str, Any] = {}
    for name, item in value.items():
        field_name = str(name).replace("-", "_")
        require(
            field_name in _KEYS,
            f"speculative_config.{name}",
            f"must be one of the keys {', '.join(_KEYS)}, got an unknown key",
        )
        require(
            field_name not in fields,
            f"speculative_config.{field_name}",
            "is given twice (as written with '-' and with '_'); give it once",
        )
        fields[field_name] = item
    return {name: item for name, item in fields.items() if item is not None}


def check_speculative_support(
    spec: SpeculativeConfig | None,
    *,
    pipeline_parallel_size: int,
    tensor_parallel_size: int = 1,
    max_model_len: int | None = None,
) -> None:
    """Engine settings speculation cannot run with, refused before anything is placed.
    Pipeline parallelism keeps several batches in flight, so a request's next proposal would
    be made before its previous verification returned. A draft runs on the target's ranks,
    sharded by ``tensor_parallel_size``, over the target's ``max_model_len`` (None: not known
    yet, checked later), so vLLM's draft_tensor_parallel_size and max_model_len may only name
    those."""
    if spec is None:
        return
    require(
        pipeline_parallel_size == 1,
        "speculative_config",
        f"needs pipeline_parallel_size 1 (batches in flight cannot be verified in order), "
        f"got pipeline_parallel_size {pipeline_parallel_size}",
    )
    require(
        spec.draft_tensor_parallel_size in (None, tensor_parallel_size),
        "speculative_config.draft_tensor_parallel_size",
        f"must be null or {tensor_parallel_size} (tensor_parallel_size: a draft is sharded "
        f"like the target, on the same ranks), got {spec.draft_tensor_parallel_size!r}",
    )
    require(
        max_model_len is None or spec.max_model_len in (None, max_model_len),
        "speculative_config.max_model_len",
        f"must be null or {max_model_len} (the target's max_model_len, which the draft covers; "
        f"speculation is not skipped past a shorter length), got {spec.max_model_len!r}",
    )


@dataclass(frozen=True)
class SpeculativeArgs:
    """``EngineConfig.speculative``: the ``speculative_config`` engine argument, given as
    vLLM's dict and kept parsed (None: speculation off)."""

    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        value = self.speculative_config
        if not isinstance(value, SpeculativeConfig):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_arg(value))
