"""The engine's input processing: what ``LLMEngine.add_request`` checks and derives before a
request is enqueued, with no engine state beyond the config, the tokenizer and the KV cache's
size.

One role: turn a prompt and its parameters into validated token ids and parameters, or an
``InvalidRequestError`` naming the field and the allowed range (prompt shape and vocabulary,
lengths against ``max_model_len`` and the KV cache, the server's sampling caps, stop strings,
logprobs, token ids in ``logit_bias`` / ``stop_token_ids`` / ``bad_words``, cache salts), and
split a request of ``n`` samples into each sample's own parameters. A vision-language model's
images (``multi_modal_data``) are preprocessed here, on the head (``engine.multimodal.processor``
says why), and their placeholder tokens expanded before any length is checked. What needs live state
(admission control, request ids in use, LoRA adapters) stays in ``LLMEngine``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import msgspec
from transformers import AutoTokenizer, GenerationConfig

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.multimodal.inputs import MultiModalFeature
from engine.multimodal.mrope import MRopePositions, mrope_positions
from engine.multimodal.processor import MultiModalProcessor
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.vlm_config import is_vlm

PromptType = str | dict[str, Any] | list[int]
_POOLING_ROUTES = {
    "embed": "embeddings (/v1/embeddings, /score, /rerank)",
    "classify": "class scores (/classify, /score, /rerank)",
}


def load_tokenizer(config: EngineConfig) -> Any:
    """The model's tokenizer, with the engine arguments' ``chat_template`` in place of its own."""
    path = config.model.tokenizer or config.model.model_path
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    if config.frontend.chat_template is not None:
        tokenizer.chat_template = config.frontend.chat_template
    return tokenizer


def eos_token_ids(model_path: str, tokenizer: Any) -> frozenset[int]:
    """EOS ids as vLLM stops on them: the tokenizer's and generation_config.json's (HF
    ``generate`` reads only the latter's where it has one; a checkpoint whose
    generation_config leaves out the tokenizer's EOS still stops on it in vLLM)."""
    ids: set[int] = set()
    if (Path(model_path) / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class InputProcessor:
    """Checks a request against ``config``, ``tokenizer`` and a cache of ``num_kv_blocks``."""

    def __init__(self, config: EngineConfig, tokenizer: Any, num_kv_blocks: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.num_kv_blocks = num_kv_blocks
        model = config.model
        self.multimodal = (
            MultiModalProcessor(
                model.hf_config, model.model_path, config.sampling.limit_mm_per_prompt
            )
            if is_vlm(model.hf_config)
            else None
        )

    def process_multimodal(
        self, prompt: PromptType, token_ids: list[int]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt's ``multi_modal_data`` preprocessed, and ``token_ids`` with each image's
        placeholder expanded to its tokens (unchanged for a prompt without images). A front
        that preprocessed the images itself sends ``mm_features`` with the expanded ids
        instead; they are checked against the prompt here."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        features = prompt.get("mm_features") if isinstance(prompt, dict) else None
        if self.multimodal is None:
            if data or features:
                raise InvalidRequestError(
                    f"{self.config.model.model} is a text-only model: it takes no images",
                    param="multi_modal_data",
                )
            return token_ids, []
        if features:
            if data:
                raise InvalidRequestError(
                    "give either multi_modal_data or preprocessed mm_features, not both",
                    param="multi_modal_data",
                )
            return token_ids, self.multimodal.check_features(token_ids, features)
        return self.multimodal.process(token_ids, data)

    def mrope_positions(
        self, token_ids: list[int], features: list[MultiModalFeature]
    ) -> MRopePositions | None:
        """An M-RoPE model's (Qwen2.5-VL's) 3-D positions of the prompt (``engine.multimodal.
        mrope``); None for other models and for a prompt without images (its positions are
        the text positions on all three axes)."""
        hf = self.config.model.hf_config
        if "mrope_section" not in hf or not features:
            return None
        merge = int(hf["vision_config"]["spatial_merge_size"])
        return mrope_positions(len(token_ids), features, merge)

    def check_cache_salt(self, cache_salt: str | None) -> None:
        # Checked here: the prefix-cache hash encodes it on the engine thread, mid-step.
        if cache_salt is not None and not (isinstance(cache_salt, str) and _is_utf8(cache_salt)):
            raise InvalidRequestError("must be a non-empty UTF-8 string", param="cache_salt")

    def check_sampling(self, params: SamplingParams, max_tokens: int) -> SamplingParams:
        """Checks that need the server's caps, the model or the tokenizer; returns the params
        with ``bad_words`` tokenized into ``bad_words_token_ids``."""
        caps = self.config.sampling
        if params.use_beam_search:
            raise InvalidRequestError(
                "beam search runs outside the engine core: use LLM.beam_search / LLM.generate "
                "or engine.client.beam_search.beam_search",
                param="use_beam_search",
            )
        _within(params.n, caps.max_n, "n", "max_n")
        _within(params.n, self.config.scheduler.max_num_seqs, "n", "max_num_seqs")
        stops = params.stop or []
        _within(len(stops), caps.max_stop_strings, "stop", "max_stop_strings")
        longest = max((len(s) for s in stops), default=0)
        _within(longest, caps.max_stop_str_len, "stop", "max_stop_str_len")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) is not None:
                _within(getattr(params, name), caps.max_logprobs, name, "max_logprobs")
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(
                f"must be <= max_tokens ({max_tokens}), got {params.min_tokens}",
                param="min_tokens",
            )
        vocab = self.config.model.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias),
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids),
        ):
            bad = [t for t in ids or () if t >= vocab]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param=name
                )
        if params.top_k > vocab:
            # The top k >= vocab tokens are all of them. Clamped so that every int a request
            # carries fits the step message (msgpack) and the sampler's int64 tensors.
            params = params.clone(top_k=vocab)
        banned = [list(seq) for seq in params.bad_words_token_ids or ()]
        for word in params.bad_words or ():
            banned.extend(self.bad_word_token_ids(word))
        if any(t >= vocab for seq in banned for t in seq):
            raise InvalidRequestError(
                f"token ids must be in [0, {vocab})", param="bad_words_token_ids"
            )
        if banned != (params.bad_words_token_ids or []):
            params = params.clone(bad_words_token_ids=_unique(banned))
        return params

    def bad_word_token_ids(self, word: str) -> list[list[int]]:
        """A bad word's token sequences, by vLLM's rule: as written at the start of a text, and
        with a leading space (as mid-text) where that is a word of its own: its first token
        differs and it has as many tokens."""
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        bare, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        out = [bare] if bare else []
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
        return out

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str) and not text:
            raise InvalidRequestError("must not be empty", param="prompt")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise InvalidRequestError("must be a string", param="prompt")
            token_ids = self.tokenizer.encode(text)
        elif isinstance(prompt, list):
            text, token_ids = None, prompt
        else:
            raise InvalidRequestError(
                "must be a string, a list of token ids, "
                "or a dict with 'prompt' or 'prompt_token_ids'",
                param="prompt",
            )
        if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise InvalidRequestError("must be a list of integers", param="prompt_token_ids")
        if not token_ids:
            raise InvalidRequestError("must not be empty", param="prompt")
        vocab = self.config.model.vocab_size
        bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {token_ids[bad]} at index {bad} is outside the vocabulary [0, {vocab})",
                param="prompt_token_ids",
            )
        return text, list(token_ids)

    def check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        max_len = self.config.max_model_len
        n = len(token_ids)
        if n >= max_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; it must be shorter than max_model_len ({max_len})",
                param="prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - n
        if n + max_tokens > max_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"max_model_len ({max_len}); max_tokens must be <= {max_len - n}",
                param="max_tokens",
            )
        bs, total = self.config.cache.block_size, self.num_kv_blocks
        needed = -(-(n + max_tokens) // bs)
        if needed > total:
            raise InvalidRequestError(
                f"prompt + max_tokens needs {needed} KV blocks but the cache holds {total}; "
                f"max_tokens must be <= {total * bs - n}",
                param="max_tokens",
            )
        return max_tokens

    def check_generates(self) -> None:
        """A pooling model (``runner: pooling``, a classifier, a bare decoder) has no LM head."""
        task = self.config.model.task
        if task != "generate":
            raise InvalidRequestError(
                f"{self.config.model.model} is a pooling model (task {task!r}): it does not "
                f"generate text; it serves {_POOLING_ROUTES[task]}",
                param="model",
            )

    def check_pooling(self, params: PoolingParams) -> PoolingParams:
        """The request's task (the model's when it names none) checked against the model, and
        ``dimensions`` against its Matryoshka sizes; returns the params with ``task`` set."""
        model = self.config.model
        task = params.task or ("classify" if model.task == "classify" else "embed")
        if task == "classify" and model.task != "classify":
            raise InvalidRequestError(
                f"'classify' needs a classification model; {model.model} serves {model.task!r}",
                param="task",
            )
        if params.dimensions is not None:
            self._check_dimensions(params.dimensions, task)
        return msgspec.structs.replace(params, task=task)

    def _check_dimensions(self, dimensions: int, task: str) -> None:
        hf = self.config.model.hf_config
        sizes = hf.get("matryoshka_dimensions")
        if task != "embed" or not (hf.get("is_matryoshka") or sizes):
            raise InvalidRequestError(
                f"{self.config.model.model} does not support matryoshka representation: its "
                "embeddings cannot be shortened",
                param="dimensions",
            )
        hidden = int(hf["hidden_size"])
        allowed = [int(d) for d in sizes] if sizes else None
        if not 1 <= dimensions <= hidden or (allowed is not None and dimensions not in allowed):
            shown = f"one of {allowed}" if allowed is not None else f"in [1, {hidden}]"
            raise InvalidRequestError(f"must be {shown}, got {dimensions}", param="dimensions")

    def check_pooling_length(self, token_ids: list[int]) -> None:
        """A pooling request generates nothing: its prompt may fill the whole context."""
        max_len, n = self.config.max_model_len, len(token_ids)
        if n > max_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; it must be at most max_model_len ({max_len})",
                param="prompt",
            )
        bs, total = self.config.cache.block_size, self.num_kv_blocks
        if -(-n // bs) > total:
            raise InvalidRequestError(
                f"the prompt needs {-(-n // bs)} KV blocks but the cache holds {total}",
                param="prompt",
            )


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index``'s own params: n = 1, its own seed stream, prompt logprobs only once."""
    if params.n == 1:
        return params
    changes: dict[str, Any] = {"n": 1}
    if params.seed is not None:
        # seed + i, wrapped to stay a 64-bit seed (as SamplingParams requires).
        changes["seed"] = (params.seed + index + 2**63) % 2**64 - 2**63
    if index > 0:
        changes["prompt_logprobs"] = None
    return params.clone(**changes)


def _is_utf8(text: str) -> bool:
    """Non-empty and encodable: a lone surrogate ("\\ud800", which JSON can carry) is not."""
    try:
        return bool(text.encode())
    except UnicodeEncodeError:
        return False


def _within(value: int, cap: int, name: str, cap_name: str) -> None:
    if value > cap:
        raise InvalidRequestError(
            f"must be <= {cap} (the server's {cap_name}), got {value}", param=name
        )


def _unique(seqs: list[list[int]]) -> list[list[int]]:
    return [list(s) for s in dict.fromkeys(tuple(s) for s in seqs)]
