"""A model's own chat template and template variables, vLLM's server options in
``engine_kwargs``: ``chat_template`` (a Jinja file's path, read where the config is loaded, or
the template itself) in place of the tokenizer's, and ``default_chat_template_kwargs`` under
each chat request's ``chat_template_kwargs``: in the prompt (``/tokenize`` and generation) and
for the reasoning parser they switch. ``LLMServer`` over ``builtin:tiny-qwen3-reasoning``,
against Hugging Face's ``apply_chat_template`` with the same template and variables."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.api.openai_models import ChatCompletionRequest
from cluster.api.openai_payloads import chat_payload
from cluster.api.replica_messages import GenerateRequest, TokenizeResult
from cluster.config import load_config
from cluster.serving.llm_server import LLMServer
from cluster.serving.request_inputs import with_template_defaults
from engine import ConfigError
from engine.config import EngineConfig
from tests.cluster.api.test_reasoning_chat import ARGS, MESSAGES, serve_chat
from tests.cluster.conftest import load_yaml

# Reads the variable the checkpoint's template reads (enable_thinking) and one of its own.
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}[quiet]{% endif %}"
    "{% if persona is defined %}[{{ persona }}]{% endif %}"
    "{% if documents is defined and documents %}{% for d in documents %}"
    "[doc {{ d.title }}: {{ d.text }}]{% endfor %}{% endif %}"
)
DEFAULTS = {"enable_thinking": False, "persona": "terse", "thinking": True}
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("templates") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(template_file: Path) -> Iterator[LLMServer]:
    # deepseek_v3's parser reads thinking from the kwargs: on, the output starts in reasoning.
    args = {**ARGS, "chat_template": str(template_file), "reasoning_parser": "deepseek_v3",
            "default_chat_template_kwargs": DEFAULTS}  # fmt: skip
    server = LLMServer("t", args)
    yield server
    server.engine.shutdown()


def _tokenize(server: LLMServer, kwargs: dict[str, Any] | None) -> list[int]:
    request = GenerateRequest(messages=MESSAGES, params={}, chat_template_kwargs=kwargs)
    result = asyncio.run(server.tokenize(request))
    assert isinstance(result, TokenizeResult), result
    return result.tokens


def _hf(server: LLMServer, **variables: Any) -> list[int]:
    return server.tokenizer.apply_chat_template(
        MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True,
        return_dict=False, **variables,
    )  # fmt: skip


def test_the_prompt_is_the_configured_template_with_the_defaults_under_the_request(
    server: LLMServer,
) -> None:
    quiet = _tokenize(server, None)
    assert quiet == _hf(server, enable_thinking=False, persona="terse")
    assert server.tokenizer.decode(quiet).endswith("<assistant>[quiet][terse]")
    own = _tokenize(server, {"enable_thinking": True, "persona": "chatty"})
    assert own == _hf(server, enable_thinking=True, persona="chatty")
    # As vLLM merges them, a request's null (or "auto") leaves the default.
    assert _tokenize(server, {"persona": None, "enable_thinking": "auto"}) == quiet


def test_chat_documents_are_the_templates_documents_as_hf_renders_them(
    server: LLMServer,
) -> None:
    """vLLM's ``documents`` (RAG): the template's variable, over chat_template_kwargs'."""
    docs = [{"title": "Paris", "text": "The capital of France."}, {"title": "b", "text": "c"}]
    body = {"model": "t", "messages": MESSAGES, "documents": docs,
            "chat_template_kwargs": {"documents": [{"title": "x", "text": "y"}]}}  # fmt: skip
    payload = chat_payload(ChatCompletionRequest.model_validate(body))
    result = asyncio.run(server.tokenize(payload))
    assert isinstance(result, TokenizeResult), result
    assert result.tokens == _hf(server, enable_thinking=False, persona="terse", documents=docs)
    assert "[doc Paris: The capital of France.][doc b: c]" in server.tokenizer.decode(result.tokens)
    with pytest.raises(ValueError, match="documents"):
        ChatCompletionRequest.model_validate({**body, "documents": [{"title": 3}]})


def test_a_null_or_auto_variable_is_no_value_with_or_without_defaults() -> None:
    own = {"enable_thinking": "auto", "persona": None, "x": 1}
    request = GenerateRequest(messages=MESSAGES, chat_template_kwargs=own)
    assert with_template_defaults(request, None).chat_template_kwargs == {"x": 1}
    merged = with_template_defaults(request, {"persona": "p"}).chat_template_kwargs
    assert merged == {"persona": "p", "x": 1}
    completion = GenerateRequest(prompt="hi", chat_template_kwargs=own)
    assert with_template_defaults(completion, {"persona": "p"}) is completion


def test_the_reasoning_parser_reads_the_merged_variables(server: LLMServer) -> None:
    def message(kwargs: dict[str, Any] | None) -> dict[str, Any]:
        request = GenerateRequest(messages=MESSAGES, params=GREEDY, chat_template_kwargs=kwargs)
        completion, _ = serve_chat(server, request, stream=False)
        return completion.whole()["choices"][0]["message"]

    thinking = message(None)  # the default's thinking: true
    off = message({"thinking": False})
    assert thinking["reasoning_content"] and thinking["content"] is None
    assert off["reasoning_content"] is None
    assert off["content"] == thinking["reasoning_content"]  # the same greedy text either way


def test_a_config_reads_the_template_file_where_it_is_loaded(template_file: Path) -> None:
    raw = load_yaml("tiny.yaml")
    raw["models"][0]["engine_kwargs"]["chat_template"] = str(template_file)
    config = load_config(raw)
    assert config.models[0].engine_kwargs["chat_template"] == TEMPLATE  # replicas get the text
    raw["models"][0]["engine_kwargs"]["chat_template"] = str(template_file.with_name("none.j2"))
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert str(info.value).startswith(
        "models[0].engine_kwargs.chat_template: '"
    ) and "cannot be read as a file: No such file or directory" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"default_chat_template_kwargs": ["x"]},
         "default_chat_template_kwargs: must be a mapping"),
        ({"default_chat_template_kwargs": {"tokenize": True}},
         "default_chat_template_kwargs.tokenize: is not a template variable"),
        ({"chat_template": ""}, "chat_template: must be a non-empty string"),
        ({"chat_template": 3}, "chat_template: must be a non-empty string"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}"):
        EngineConfig.from_kwargs(model="builtin:tiny-llama", device="cpu", **kwargs)


def test_gpt_oss_refuses_a_chat_template() -> None:
    with pytest.raises(ConfigError, match=r"^chat_template: gpt-oss's chats are rendered"):
        EngineConfig.from_kwargs(model="builtin:tiny-gpt-oss", device="cpu", chat_template=TEMPLATE)
