"""The tokenizer every built-in tiny and bench model shares (``engine.builtin.tiny_models``): a
byte-level BPE trained at build time on ``engine/data/corpus.txt`` (shipped with the project),
its special tokens, its ChatML chat template with Hermes-style tool calls, and the tokenizer
files written beside a checkpoint. Nothing here touches a model hub.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# The trainer gives special tokens the first ids, in this order: <pad>=0, <s>=1, </s>=2, ...
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, IM_START_TOKEN_ID, IM_END_TOKEN_ID = range(5)

TOKENIZER_VOCAB_SIZE = 1024
# Qwen2's pre-tokenizer split (contractions, letter runs, single digits, punctuation runs,
# newlines, spaces); see _trained_tokenizer_json for why every tiny model uses it.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
MAX_POSITION_EMBEDDINGS = 2048

# ChatML. It starts with the bos token because chat prompts are encoded without special tokens
# (HF ``apply_chat_template(tokenize=True)`` and OpenAI-style servers both do so), while plain
# prompts are encoded with them; either way a model input starts with exactly one <s>.
#
# Tool calling follows the Hermes / Qwen2.5 convention, which the ``hermes`` tool parser reads
# back. Given ``tools`` (OpenAI tool dicts, or bare function dicts), a system turn lists them as
# JSON lines inside <tools></tools>, after the caller's own system message if it has one. An
# assistant turn's ``tool_calls`` become ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
# lines, and consecutive ``tool`` messages share one user turn of <tool_response> blocks. Without
# tools, tool calls and tool messages, the output is plain ChatML; a content that is not a string
# (None) renders as empty.
CHAT_TEMPLATE = "".join(
    (
        "{{ bos_token }}",
        "{% if tools %}",
        "{{ '<|im_start|>system\\n' }}",
        "{% if messages and messages[0]['role'] == 'system'",
        " and messages[0]['content'] is string %}",
        "{{ messages[0]['content'] + '\\n\\n' }}",
        "{% endif %}",
        "{{ '# Tools\\n\\nYou may call one or more functions to answer. Their signatures are",
        " listed as JSON inside <tools></tools>:\\n<tools>' }}",
        "{% for tool in tools %}",
        "{% set tool = tool if tool['function'] is defined",
        " else {'type': 'function', 'function': tool} %}",
        "{{ '\\n' + tool | tojson }}",
        "{% endfor %}",
        "{{ '\\n</tools>\\n\\nTo call a function, answer with one JSON object per call, each",
        " inside <tool_call></tool_call> tags:\\n<tool_call>\\n",
        '{\\"name\\": <function-name>, \\"arguments\\": <arguments-json-object>}',
        "\\n</tool_call><|im_end|>\\n' }}",
        "{% endif %}",
        "{% for message in messages %}",
        "{% set content = message['content'] if message['content'] is string else '' %}",
        "{% if tools and loop.first and message['role'] == 'system' %}",
        "{% elif message['role'] == 'tool' %}",
        "{% if loop.first or loop.previtem['role'] != 'tool' %}",
        "{{ '<|im_start|>user' }}",
        "{% endif %}",
        "{{ '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}",
        "{% if loop.last or loop.nextitem['role'] != 'tool' %}",
        "{{ '<|im_end|>\\n' }}",
        "{% endif %}",
        "{% elif message['role'] == 'assistant' and message['tool_calls'] %}",
        "{{ '<|im_start|>assistant' }}",
        "{% if content %}{{ '\\n' + content }}{% endif %}",
        "{% for call in message['tool_calls'] %}",
        "{% set function = call['function'] if call['function'] is defined else call %}",
        "{% set arguments = function['arguments'] if function['arguments'] is defined else {} %}",
        "{{ '\\n<tool_call>\\n{\"name\": ' + function['name'] | tojson + ', \"arguments\": ' }}",
        "{{ arguments if arguments is string else arguments | tojson }}",
        "{{ '}\\n</tool_call>' }}",
        "{% endfor %}",
        "{{ '<|im_end|>\\n' }}",
        "{% else %}",
        "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}",
        "{% endif %}",
        "{% endfor %}",
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    )
)
# The ``tool_call_parser`` that reads tool calls back out of these models' output (see above).
DEFAULT_TOOL_CALL_PARSER = "hermes"


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> str:
    corpus = (
        resources.files("engine.builtin").joinpath("data", "corpus.txt").read_text(encoding="utf-8")
    )
    tokenizer = Tokenizer(models.BPE())
    # The pipeline is exactly the one transformers 5 ``Qwen2Tokenizer`` rebuilds when it loads a
    # qwen2 checkpoint (it ignores tokenizer.json's normalizer and pre-tokenizer), so all three
    # models and both loaders (``AutoTokenizer``, raw ``tokenizers``) give the same ids. Byte-level:
    # every UTF-8 byte is in the base alphabet, so any NFC string round-trips and a character
    # absent from the corpus (most CJK, emoji) splits into several byte tokens.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    # Encoding with special tokens prepends <s> and appends nothing, like Llama and Mistral. The
    # template is the one transformers 5 writes for add_bos_token=True, so reloading is a no-op.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    for want, token in enumerate(SPECIAL_TOKENS):
        got = tokenizer.token_to_id(token)
        if got != want:
            raise RuntimeError(f"tokenizer trainer gave {token!r} id {got}, expected {want}")
    return tokenizer.to_str()


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Tokenizer:
    """The byte-level BPE tokenizer trained on the shipped corpus: 1024 tokens for the tiny models.

    A larger ``vocab_size`` (the bench models' 32000) gives exactly that many tokens, whose first
    1024 ids are the tiny models' tokenizer: training goes on while the corpus has pairs to merge
    (about 4200 tokens), then the corpus's runs of 2, 3, ... adjacent tokens become tokens of
    their own, in corpus order, until the vocabulary is full. Those span pre-token boundaries
    (" of the"), so encoding never produces them, but every id decodes to corpus text.
    """
    if vocab_size <= TOKENIZER_VOCAB_SIZE:
        return Tokenizer.from_str(_trained_tokenizer_json())
    return Tokenizer.from_str(_grown_tokenizer_json(vocab_size))


@functools.lru_cache(maxsize=4)
def _grown_tokenizer_json(vocab_size: int) -> str:
    trained = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    data = json.loads(trained.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[list[str]] = data["model"]["merges"]
    corpus = (
        resources.files("engine.builtin").joinpath("data", "corpus.txt").read_text(encoding="utf-8")
    )
    lines = [trained.encode(line, add_special_tokens=False).tokens for line in corpus.splitlines()]
    n = 2
    while len(vocab) < vocab_size:
        grew = False
        for tokens in lines:
            for i in range(len(tokens) - n + 1):
                head, last = "".join(tokens[i : i + n - 1]), tokens[i + n - 1]
                token = head + last
                # The (n-1)-run is a token already unless it was cut when the vocabulary filled.
                if token in vocab or head not in vocab:
                    continue
                vocab[token] = len(vocab)
                merges.append([head, last])
                grew = True
                if len(vocab) == vocab_size:
                    break
            if len(vocab) == vocab_size:
                break
        if not grew:
            raise ValueError(f"the corpus cannot fill a vocabulary of {vocab_size} tokens")
        n += 1
    return json.dumps(data, ensure_ascii=False)


# What the tiny models' generation_config.json holds: stop at EOS or ``<|im_end|>``.
GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": [EOS_TOKEN_ID, IM_END_TOKEN_ID],
    "pad_token_id": PAD_TOKEN_ID,
}


def special_token_entry(content: str) -> dict[str, Any]:
    """``content``'s entry in tokenizer_config.json's ``added_tokens_decoder``: a special token
    matched as written."""
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    added_tokens_decoder = {
        str(token_id): special_token_entry(token) for token_id, token in enumerate(SPECIAL_TOKENS)
    }
    special_tokens_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }
    # Written by hand rather than by ``save_pretrained``: transformers 5 would name its own
    # ``TokenizersBackend`` class and move the template to chat_template.jinja, which 4.x cannot
    # read. From ``add_bos_token`` transformers 5 rebuilds the post-processor, to the same one.
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        # Without an explicit null, Qwen2Tokenizer would add its default <|endoftext|> as unk.
        "unk_token": None,
        "added_tokens_decoder": added_tokens_decoder,
        **special_tokens_map,
        "chat_template": CHAT_TEMPLATE,
        # Byte-level decoding is exact; the cleanup would turn " ," into "," and break round-trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
    }
    write_json(out / "tokenizer_config.json", tokenizer_config)
    write_json(out / "special_tokens_map.json", special_tokens_map)


def declare_special_tokens(out: Path, tokens: dict[str, int], **fields: Any) -> None:
    """Declare ``tokens`` (content -> id, added to the tokenizer after ``write_tokenizer`` wrote
    ``out``) special in ``out``'s tokenizer_config.json, and set ``fields`` there."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for content, token_id in tokens.items():
        config["added_tokens_decoder"][str(token_id)] = special_token_entry(content)
    write_json(path, {**config, **fields})


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")
