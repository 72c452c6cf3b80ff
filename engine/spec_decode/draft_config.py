"""``method: draft_model``: the draft checkpoint's ``ModelConfig``, checked against the target's
before anything is placed (the head calls it from ``EngineConfig.from_kwargs``; each worker
calls it again to build its shard of the draft).

The draft is sharded like the target (same tensor-parallel ranks), so its heads and MLP must
divide by ``tensor_parallel_size``; its vocabulary must equal the target's, since its argmax
token ids are verified against the target's rows as they are.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from engine.errors import ConfigError
from engine.spec_decode.config import SpeculativeConfig
from engine.validation import require

if TYPE_CHECKING:
    from engine.config import ModelConfig, ParallelConfig


def draft_model_config(
    spec: SpeculativeConfig, target: ModelConfig, parallel: ParallelConfig
) -> ModelConfig:
    """The draft's ModelConfig (the target's dtype and max_model_len), or ConfigError naming
    ``speculative_config.model`` and what does not match."""
    # Imported here: engine.config imports this package's config module.
    from engine.config import ModelConfig, _check_parallel_shape, _with_checkpoint

    key = "speculative_config.model"
    dtype = str(target.torch_dtype).removeprefix("torch.")
    try:
        draft = _with_checkpoint(ModelConfig(model=str(spec.model), dtype=dtype))
    except (ConfigError, OSError, ValueError) as exc:
        raise ConfigError(f"{key}: draft {spec.model!r} cannot be served: {exc}") from exc
    draft = dataclasses.replace(draft, max_model_len=target.max_model_len)
    require(
        draft.vocab_size == target.vocab_size,
        key,
        f"the draft {spec.model!r} has vocab_size {draft.vocab_size}, the target "
        f"{target.model!r} has {target.vocab_size}: a draft needs the target's vocabulary",
    )
    require(
        draft.hf_config.get("quantization_config") is None,
        key,
        f"the draft {spec.model!r} is a quantized checkpoint: only float drafts are supported",
    )
    try:
        _check_parallel_shape(draft, parallel)
    except ConfigError as exc:
        raise ConfigError(
            f"{key}: the draft {spec.model!r} is sharded like the target and cannot be: {exc}"
        ) from exc
    return draft
