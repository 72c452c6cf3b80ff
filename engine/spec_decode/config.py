"""``speculative_config``: vLLM's dict of speculative-decoding settings, as one frozen section.

    speculative_config = {"method": "ngram", "num_speculative_tokens": 3,
                          "prompt_lookup_min": 2, "prompt_lookup_max": 4}

``method``: ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence
of the sequence's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``).
``draft_model``: a smaller checkpoint (``model``, a local HF directory or ``builtin:<name>``, with
the target's vocabulary) run on the same workers proposes greedily (``engine.spec_decode.draft``).
vLLM's other methods are refused by name rather than silently ignored. Combinations the engine
cannot verify exactly are refused in ``check_speculative_support`` naming the other field.

No torch here: the deployment check imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.validation import check_choice, check_int, require

METHODS = ("ngram", "draft_model")
# vLLM's spellings that name a method this engine does not build yet.
_NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    # vLLM's defaults when neither is given.
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # method draft_model: the draft checkpoint (None for ngram).
    model: str | None = None

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
        check_int(self.prompt_lookup_min, key + "prompt_lookup_min", ge=1)
        check_int(
            self.prompt_lookup_max,
            key + "prompt_lookup_max",
            ge=self.prompt_lookup_min,
            le=32,
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

    @classmethod
    def from_arg(cls, value: Any) -> SpeculativeConfig | None:
        """The engine argument (a dict, or None: speculation off) as a config. vLLM fills
        ``prompt_lookup_min`` from ``prompt_lookup_max`` and vice versa when one is given."""
        if value is None:
            return None
        require(
            isinstance(value, dict),
            "speculative_config",
            f"must be a mapping (e.g. {{'method': 'ngram', 'num_speculative_tokens': 3}}) "
            f"or null, got {value!r}",
        )
        for name in value:
            require(
                name in _KEYS,
                f"speculative_config.{name}",
                f"must be one of the keys {', '.join(_KEYS)}, got an unknown key",
            )
        require(
            value.get("num_speculative_tokens") is not None,
            "speculative_config.num_speculative_tokens",
            f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] (it has no default), got None",
        )
        fields = dict(value)
        if "method" not in fields:
            # vLLM infers the method from the model when one is given.
            fields["method"] = "draft_model" if value.get("model") is not None else "ngram"
        lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        if lo is None and hi is not None:
            fields["prompt_lookup_min"] = hi
        if hi is None and lo is not None:
            fields["prompt_lookup_max"] = lo
        return cls(**fields)


def check_speculative_support(
    spec: SpeculativeConfig | None, *, pipeline_parallel_size: int
) -> None:
    """Engine settings speculation cannot run with, refused before anything is placed.
    Pipeline parallelism keeps several batches in flight, so a request's next proposal would
    be made before its previous verification returned."""
    if spec is None:
        return
    require(
        pipeline_parallel_size == 1,
        "speculative_config",
        f"needs pipeline_parallel_size 1 (batches in flight cannot be verified in order), "
        f"got pipeline_parallel_size {pipeline_parallel_size}",
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
