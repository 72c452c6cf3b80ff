"""The offline API: ``LLM(model=..., **engine_args).generate(prompts, params)``; for pooling,
``embed(prompts)`` (embeddings pooled from the model's final hidden states), ``classify``
(a classification model's class probabilities) and ``score`` (text pairs); ``sleep`` /
``wake_up`` free and restore the KV cache and weights between uses (vLLM's sleep mode)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm.auto import tqdm

from engine.chat_messages import rendered
from engine.client.beam_search import beam_search
from engine.client.scoring import cosine, pair_prompt, score_pairs, single_class
from engine.config import EngineConfig
from engine.core.data_parallel import build_engine
from engine.core.llm_engine import PromptType
from engine.errors import InvalidRequestError
from engine.generation_defaults import generation_defaults
from engine.harmony_template import harmony_prompt_ids, is_harmony_tokenizer
from engine.lora import LoRARequest
from engine.model_heads import num_labels, pair_uses_sep_token
from engine.multimodal.chat import image_placeholder, split_content_parts
from engine.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Offline batched generation over the engine (vLLM's ``vllm.LLM``)."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        sampling = config.sampling
        # Before the load: a generation_config that cannot be used fails at once.
        self._default_sampling = generation_defaults(
            config.model.model_path, sampling.generation_config, sampling.override_generation_config
        )
        self.llm_engine = build_engine(config)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no ``SamplingParams``: the model's
        ``generation_config`` values over ``SamplingParams()``' (vLLM's)."""
        return SamplingParams(**self._default_sampling)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1; the weights stay in host memory) or the KV cache and
        the weights (level 2) until ``wake_up``, as vLLM's ``LLM.sleep``."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and the KV cache (``tags``: only these, weights first)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: int | Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order. A prompt is a string, a list of
        token ids, or ``{"prompt_token_ids": [...]}``. ``lora_request``: one adapter for every
        prompt, or a list aligned with the prompts (None: the base model); ``priority`` the
        same (vLLM's: lower first under ``scheduling_policy: priority``). Invalid input raises
        before anything runs."""
        prompts = _as_prompt_list(prompts)
        single_lora = lora_request is None or isinstance(lora_request, LoRARequest)
        loras = _per_prompt(lora_request, single_lora, len(prompts), "lora_request")
        priority = 0 if priority is None else priority
        single = not isinstance(priority, Sequence)  # (the engine checks each value)
        priorities = _per_prompt(priority, single, len(prompts), "priority")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        single = isinstance(sampling_params, SamplingParams)
        params_list = _per_prompt(sampling_params, single, len(prompts), "sampling_params")
        if any(p.use_beam_search for p in params_list):
            if any(lora is not None for lora in loras):
                raise InvalidRequestError(
                    "beam search does not run with LoRA adapters", param="lora_request"
                )
            return self._generate_with_beam_search(prompts, params_list, priorities, use_tqdm)
        ids = self._add_all(prompts, params_list, priorities, loras)
        return self._run(ids, use_tqdm)

    def _generate_with_beam_search(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priority: Sequence[int],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """Beam-search prompts run one after another on the engine; the others in one batch."""
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        plain = [i for i, p in enumerate(params) if not p.use_beam_search]
        if plain:
            sub_priority = [priority[i] for i in plain]
            ids = self._add_all(
                [prompts[i] for i in plain], [params[i] for i in plain], sub_priority
            )
            for i, out in zip(plain, self._run(ids, use_tqdm)):
                outputs[i] = out
        for i, p in enumerate(params):
            if p.use_beam_search:
                outputs[i] = beam_search(self.llm_engine, [prompts[i]], p)[0]
        return [o for o in outputs if o is not None]

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        beam_width: int,
        max_tokens: int = 16,
        ignore_eos: bool = False,
        length_penalty: float = 1.0,
        logprobs: bool = False,
    ) -> list[RequestOutput]:
        """Beam search (vLLM's ``LLM.beam_search``): per prompt, the ``beam_width`` best
        sequences by cumulative logprob / length ** length_penalty, best first."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = SamplingParams(
            n=beam_width,
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            use_beam_search=True,
            beam_width=beam_width,
            length_penalty=length_penalty,
            logprobs=1 if logprobs else None,
        )
        return beam_search(self.llm_engine, list(prompts), params)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt's final hidden states (the engine's ``pooling_type``) into one
        vector each; outputs in input order, the vector in ``outputs.data``."""
        prompts = _as_prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        single = isinstance(pooling_params, PoolingParams)
        params_list = _per_prompt(pooling_params, single, len(prompts), "pooling_params")
        ids = self._add_all(prompts, params_list, None)
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Embeddings (vLLM's ``LLM.embed``): ``encode`` with task ``embed`` (any model: a
        classifier's pooled final hidden state too), the vector read as ``outputs.embedding``."""
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = _embedding(pooling_params or PoolingParams())
        else:
            pooling_params = [_embedding(p) for p in pooling_params]
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm)

    def classify(
        self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True
    ) -> list[PoolingRequestOutput]:
        """Class probabilities of a classification model (vLLM's ``LLM.classify``), read as
        ``outputs.probs``; the class names are the model's ``id2label``."""
        return self.encode(prompts, PoolingParams(task="classify"), use_tqdm=use_tqdm)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """One score per pair (vLLM's ``LLM.score``; pairs and scores as
        ``engine.client.scoring`` makes them), read as ``outputs.score``."""
        pairs = score_pairs(data_1, data_2)
        model = self.llm_engine.config.model
        if model.task == "classify":
            single_class(num_labels(model.hf_config), model.model)
            tokenizer = self.get_tokenizer()
            sep = pair_uses_sep_token(model.hf_config)
            prompts = [pair_prompt(tokenizer, a, b, sep) for a, b in pairs]
            return self.encode(prompts, PoolingParams(task="classify"), use_tqdm=use_tqdm)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        vectors = dict(zip(texts, self.embed(texts, use_tqdm=use_tqdm), strict=True))
        outputs = []
        for a, b in pairs:
            first, second = vectors[a], vectors[b]
            assert first.outputs is not None and second.outputs is not None  # finished
            value = cosine(first.outputs.data, second.outputs.data)
            ids = first.prompt_token_ids + second.prompt_token_ids
            outputs.append(PoolingRequestOutput(first.request_id, ids, PoolingOutput([value])))
        return outputs

    def _add_all(
        self,
        prompts: list[PromptType],
        params: Sequence[SamplingParams | PoolingParams],
        priority: Sequence[int] | None,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[str]:
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._ids))
                if isinstance(p, SamplingParams):  # only the final output is read (as vLLM)
                    p = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(
                    rid,
                    prompt,
                    p,
                    priority=priority[i] if priority else 0,
                    lora_request=loras[i] if loras else None,
                )
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[Any]:
        pending = set(ids)
        finished: dict[str, Any] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while pending:
                for output in self.llm_engine.step():
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(1)
        return [finished[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (``chat_template``: another one, for these chats; a
        harmony model's, gpt-oss's: the harmony template, ``engine.harmony_template``), then
        generate. The template options are vLLM's ``LLM.chat``'s (``continue_final_message``
        leaves the last message open, with no generation prompt); ``chat_template_kwargs`` go over
        the engine arguments' ``default_chat_template_kwargs``. A message's content may be a
        list of OpenAI-style parts (``text``, ``image_url`` with a data: URL, ``image_pil``)
        for a vision-language model (``engine.multimodal.chat``). ``lora_request``: one adapter
        for every conversation, or a list aligned with them, as ``generate``'s."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        placeholder = image_placeholder(self.llm_engine.config.model.hf_config, tokenizer)
        harmony = is_harmony_tokenizer(tokenizer)
        if harmony and chat_template is not None:
            raise InvalidRequestError(
                "gpt-oss's chats are rendered in its harmony format, not by a chat template",
                param="chat_template",
            )
        # The engine arguments' default_chat_template_kwargs under these (as the server merges
        # them); the render's own options over both.
        defaults = self.llm_engine.config.frontend.default_chat_template_kwargs or {}
        options: dict[str, Any] = {**defaults, **(chat_template_kwargs or {})}
        for key in ("tools", "chat_template", "tokenize", "return_dict"):
            options.pop(key, None)
        options["add_generation_prompt"] = add_generation_prompt and not continue_final_message
        options["continue_final_message"] = continue_final_message
        prompts: list[PromptType] = []
        for conversation in conversations:
            text_messages, images = split_content_parts(list(conversation), placeholder)
            if harmony:  # gpt-oss: as the server renders it
                ids = harmony_prompt_ids(tokenizer, text_messages, tools, **options)
            else:
                ids = rendered(
                    lambda shaped: tokenizer.apply_chat_template(
                        shaped,
                        tools=tools,
                        chat_template=chat_template,
                        tokenize=True,
                        return_dict=False,
                        **options,
                    ),
                    text_messages,
                )
            prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)


def _per_prompt(value: Any, single: bool, num_prompts: int, param: str) -> list[Any]:
    """``value`` for every prompt when ``single``, else a list that must align with the prompts
    (vLLM's rule for the sampling and pooling parameters, ``lora_request`` and ``priority``)."""
    if single:
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        message = f"has {len(values)} entries for {num_prompts} prompts"
        raise InvalidRequestError(message, param=param)
    return values


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a string, a dict, a list of token ids) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _embedding(params: PoolingParams) -> PoolingParams:
    return params if params.task is not None else msgspec.structs.replace(params, task="embed")
