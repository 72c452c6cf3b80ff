"""Pooling models against HF transformers (fp32, same weights): sequence classifiers
(``Qwen3ForSequenceClassification``, ``LlamaForSequenceClassification``), a causal LM run as a
Qwen3-Reranker-style classifier (``hf_overrides.classifier_from_token``), and a Qwen3-Embedding
checkpoint (bare-model weights, no LM head) with Matryoshka dimensions — batches of mixed
lengths under chunked prefill; plus what each refuses, naming the argument or field."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

from engine import LLM, ConfigError, InvalidRequestError, PoolingParams, SamplingParams
from engine.builtin.catalog import resolve_model_source
from engine.client.scoring import pair_prompt
from engine.model_heads import pair_uses_sep_token

ATOL = 1e-4
LENGTHS = [1, 5, 16, 17, 40, 100]
# The tiny tokenizer has no "yes": any two single tokens stand for Qwen3-Reranker's no / yes.
RERANK_TOKENS = ["Ġno", "Ġthe"]
QUERY = "what is the capital of france"
DOCS = ["the capital of france is paris", "bananas are yellow", "paris", "a"]


def prompts(lengths: list[int], seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1000) for _ in range(n)]} for n in lengths]


def make_llm(name: str, **engine_args: Any) -> LLM:
    # A 32-token step budget splits every prompt over 16 tokens across steps.
    args = {"dtype": "float32", "num_kv_blocks": 128, "max_num_batched_tokens": 32}
    return LLM(f"builtin:{name}", **{**args, **engine_args})


def close(got: list[float], expected: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got), expected.to(torch.float32), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["tiny-qwen3-classifier", "tiny-llama-cross-encoder"])
def test_sequence_classifier_matches_hf(name: str) -> None:
    path = resolve_model_source(f"builtin:{name}")
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    llm = make_llm(name)
    batch = prompts(LENGTHS)
    probs = llm.classify(batch, use_tqdm=False)
    logits = llm.encode(batch, PoolingParams(task="classify", activation=False), use_tqdm=False)
    for i, prompt in enumerate(batch):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt["prompt_token_ids"]])).logits[0]
        activated = torch.softmax(expected, 0) if len(expected) > 1 else torch.sigmoid(expected)
        assert close(logits[i].outputs.data, expected), (name, i)
        assert close(probs[i].outputs.probs, activated), (name, i)
        assert len(probs[i].outputs.probs) == hf.config.num_labels


@pytest.mark.parametrize(
    ("overrides", "activate"),
    [
        ({"problem_type": "regression"}, lambda x: x),
        ({"problem_type": "multi_label_classification"}, torch.sigmoid),
        ({"problem_type": "single_label_classification"}, lambda x: torch.softmax(x, 0)),
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}},
         lambda x: x),
        ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"},
         torch.tanh),
    ],
)  # fmt: skip
def test_the_checkpoints_activation_makes_the_scores(
    overrides: dict[str, Any], activate: Any
) -> None:
    """As vLLM picks it: ``problem_type`` (a regression's logits are its scores), else a
    cross-encoder's sentence-transformers activation, else sigmoid / softmax by class count."""
    llm = make_llm("tiny-qwen3-classifier", hf_overrides=overrides)
    batch = prompts([5, 17])
    probs = llm.classify(batch, use_tqdm=False)
    logits = llm.encode(batch, PoolingParams(task="classify", activation=False), use_tqdm=False)
    for p, lg in zip(probs, logits, strict=True):
        assert close(p.outputs.probs, activate(torch.tensor(lg.outputs.data)))


def test_cross_encoder_score_is_the_pair_classified_as_hf_does() -> None:
    name = "tiny-llama-cross-encoder"
    path = resolve_model_source(f"builtin:{name}")
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    scores = make_llm(name).score(QUERY, DOCS, use_tqdm=False)
    for doc, out in zip(DOCS, scores, strict=True):
        ids = tokenizer(text=QUERY, text_pair=doc)["input_ids"]
        with torch.no_grad():
            expected = torch.sigmoid(hf(torch.tensor([ids])).logits[0, 0])
        assert abs(out.outputs.score - expected.item()) < ATOL, doc


@pytest.mark.parametrize(
    ("base", "two_way"),
    [("tiny-qwen3", True), ("tiny-qwen2", False)],  # untied and tied LM heads
)
def test_causal_lm_as_reranker_matches_hf_token_logits(base: str, two_way: bool) -> None:
    """Qwen3-Reranker's recipe: P(yes) = softmax(logits[no, yes])[yes] at the last token."""
    path = resolve_model_source(f"builtin:{base}")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.convert_tokens_to_ids(RERANK_TOKENS)
    overrides: dict[str, Any] = {
        "architectures": [hf.config.architectures[0].replace("CausalLM", "SequenceClassification")],
        "classifier_from_token": RERANK_TOKENS,
    }
    if two_way:
        overrides["is_original_qwen3_reranker"] = True
    llm = make_llm(base, hf_overrides=overrides)
    scores = llm.score(QUERY, DOCS, use_tqdm=False) if two_way else None
    probs = llm.classify([{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts(LENGTHS)],
                         use_tqdm=False)  # fmt: skip
    for i, prompt in enumerate(prompts(LENGTHS)):
        with torch.no_grad():
            last = hf(torch.tensor([prompt["prompt_token_ids"]])).logits[0, -1]
        pair = torch.softmax(last[ids], 0)
        assert close(probs[i].outputs.probs, pair[1:] if two_way else pair), (base, i)
    # Converted by method (is_original_qwen3_reranker): the pair is the two texts as one, as
    # vLLM encodes it (no separator between them).
    for doc, out in zip(DOCS, scores or [], strict=False):
        pair_ids = tokenizer(text=QUERY + doc)["input_ids"]
        with torch.no_grad():
            last = hf(torch.tensor([pair_ids])).logits[0, -1]
        assert abs(out.outputs.score - torch.softmax(last[ids], 0)[1].item()) < ATOL, doc


@pytest.fixture(scope="module")
def embedding_hf() -> Any:
    path = resolve_model_source("builtin:tiny-qwen3-embedding")
    return AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def test_qwen3_embedding_layout_and_matryoshka_match_hf(embedding_hf: Any) -> None:
    llm = make_llm("tiny-qwen3-embedding", runner="pooling", hf_overrides={"is_matryoshka": True})
    batch = prompts(LENGTHS, seed=1)
    full = llm.embed(batch, use_tqdm=False)
    short = llm.embed(batch, PoolingParams(dimensions=16), use_tqdm=False)
    for i, prompt in enumerate(batch):
        with torch.no_grad():
            last = embedding_hf(torch.tensor([prompt["prompt_token_ids"]])).last_hidden_state[0, -1]
        normalize = torch.nn.functional.normalize
        assert close(full[i].outputs.embedding, normalize(last, dim=0)), i
        assert close(short[i].outputs.embedding, normalize(last[:16], dim=0)), i
    # Scoring with an embedding model: the cosine of the two texts' embeddings.
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source("builtin:tiny-qwen3-embedding"))
    score = llm.score(QUERY, DOCS[0], use_tqdm=False)[0].outputs.score
    vectors = []
    for text in (QUERY, DOCS[0]):
        with torch.no_grad():
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            vectors.append(embedding_hf(ids).last_hidden_state[0, -1])
    assert abs(score - torch.cosine_similarity(*vectors, dim=0).item()) < ATOL


def test_matryoshka_sizes_and_models_without_them_are_refused() -> None:
    sized = make_llm(
        "tiny-qwen3-embedding",
        runner="pooling",
        hf_overrides={"matryoshka_dimensions": [16, 32]},
    )
    vector = sized.embed("hello", PoolingParams(dimensions=32), use_tqdm=False)[0].outputs.data
    assert len(vector) == 32
    with pytest.raises(InvalidRequestError, match=r"one of \[16, 32\], got 24") as err:
        sized.embed("hello", PoolingParams(dimensions=24), use_tqdm=False)
    assert err.value.param == "dimensions"
    plain = make_llm("tiny-qwen3-embedding", runner="pooling")
    with pytest.raises(InvalidRequestError, match="matryoshka") as err:
        plain.embed("hello", PoolingParams(dimensions=16), use_tqdm=False)
    assert err.value.param == "dimensions"


def test_pooling_models_refuse_generation_and_foreign_tasks() -> None:
    classifier = make_llm("tiny-qwen3-classifier")
    with pytest.raises(InvalidRequestError, match=r"pooling model.*does not generate") as err:
        classifier.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert err.value.param == "model"
    # A classifier still embeds (its pooled final hidden state) ...
    assert len(classifier.embed("hello", use_tqdm=False)[0].outputs.data) == 64
    # ... and scoring needs one class.
    with pytest.raises(InvalidRequestError, match="3 classes") as err:
        classifier.score("a", "b", use_tqdm=False)
    generator = make_llm("tiny-llama")
    with pytest.raises(InvalidRequestError, match="needs a classification model") as err:
        generator.classify("hello", use_tqdm=False)
    assert err.value.param == "task"


@pytest.mark.parametrize(
    ("name", "args", "match"),
    [
        ("tiny-qwen3-classifier", {"runner": "generate"}, r"^runner: 'generate' needs a causal"),
        ("tiny-qwen3", {"convert": "classify"}, r"^convert: 'classify' of Qwen3ForCausalLM"),
        ("tiny-qwen3-embedding", {}, r"^runner: the checkpoint has no lm_head.weight"),
        (
            "tiny-qwen3",
            {"hf_overrides": {"classifier_from_token": ["no", "not-a-token"]}},
            r"^classifier_from_token: 'not-a-token' is not one token",
        ),
        (
            "tiny-qwen3",
            {"hf_overrides": {"classifier_from_token": ["Ġno"], "method": "from_2_way_softmax"}},
            r"^classifier_from_token: a two-way softmax scores exactly two",
        ),
        ("tiny-qwen3", {"runner": "encode"}, r"^runner: "),
        (
            "tiny-qwen3-classifier",
            {"hf_overrides": {"sentence_transformers": {"activation_fn": "my.Gelu"}}},
            r"^sentence_transformers.activation_fn: 'my.Gelu' is not served",
        ),
        ("tiny-qwen3", {"hf_overrides": ["architectures"]}, r"^hf_overrides: must be a mapping"),
        (
            "tiny-qwen3",
            {"hf_overrides": {"architectures": ["Qwen3ForTokenClassification"]}},
            r"^architectures: 'Qwen3ForTokenClassification' is not supported",
        ),
    ],
)
def test_config_errors_name_the_argument(name: str, args: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_llm(name, **args)


@pytest.mark.parametrize(
    ("hf", "sep"),
    [
        ({}, True),  # a *ForSequenceClassification checkpoint: the tokenizer's pair encoding
        ({"classifier_from_token": RERANK_TOKENS, "is_original_qwen3_reranker": True}, False),
        ({"classifier_from_token": RERANK_TOKENS, "method": "from_2_way_softmax"}, False),
        ({"is_original_qwen3_reranker": True, "use_sep_token": True}, True),
        ({"use_sep_token": False}, False),
    ],
)
def test_a_pair_becomes_one_prompt_as_vllm_encodes_it(hf: dict[str, Any], sep: bool) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source("builtin:tiny-qwen3"))
    assert pair_uses_sep_token(hf) is sep
    ids = pair_prompt(tokenizer, QUERY, DOCS[0], sep)["prompt_token_ids"]
    joined = tokenizer(text=QUERY + DOCS[0])["input_ids"]
    paired = tokenizer(text=QUERY, text_pair=DOCS[0])["input_ids"]
    assert joined != paired
    assert ids == (paired if sep else joined)


def test_use_sep_token_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="use_sep_token: must be true or false, got 'yes'"):
        pair_uses_sep_token({"use_sep_token": "yes"})
