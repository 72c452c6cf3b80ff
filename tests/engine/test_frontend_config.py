"""``FrontendConfig``: the serving front's parser settings (vLLM's names), gpt-oss's harmony pair
and its default for ``GptOssForCausalLM``."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, check_engine_arg_ranges
from engine.config_sections import FrontendConfig
from engine.errors import ConfigError


@pytest.mark.parametrize(
    "named", [{"reasoning_parser": "openai_gptoss"}, {"tool_call_parser": "openai"}]
)
def test_naming_one_harmony_parser_names_the_other(named: dict[str, str]) -> None:
    config = FrontendConfig(**named)
    assert (config.reasoning_parser, config.tool_call_parser) == ("openai_gptoss", "openai")


def test_a_harmony_parser_with_another_format_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        FrontendConfig(reasoning_parser="openai_gptoss", tool_call_parser="hermes")
    assert str(info.value) == (
        "tool_call_parser: must be 'openai' (or unset) with reasoning_parser 'openai_gptoss': "
        "both read gpt-oss's harmony format, got 'hermes'"
    )
    with pytest.raises(ConfigError, match=r"^reasoning_parser: must be 'openai_gptoss'"):
        FrontendConfig(reasoning_parser="qwen3", tool_call_parser="openai")


def test_gpt_oss_reads_harmony_by_default_unless_a_parser_is_named() -> None:
    base = {"model": "builtin:tiny-gpt-oss", "device": "cpu"}
    frontend = EngineConfig.from_kwargs(**base).frontend
    assert (frontend.reasoning_parser, frontend.tool_call_parser) == ("openai_gptoss", "openai")
    off = EngineConfig.from_kwargs(**base, reasoning_parser=None).frontend
    assert (off.reasoning_parser, off.tool_call_parser) == (None, None)
    other = EngineConfig.from_kwargs(model="builtin:tiny-llama", device="cpu").frontend
    assert (other.reasoning_parser, other.tool_call_parser) == (None, None)


def test_auto_tool_choice_needs_a_parser_of_the_arguments_or_the_model() -> None:
    """The need is checked with the checkpoint's defaults: gpt-oss names its own."""
    check_engine_arg_ranges({"enable_auto_tool_choice": True})  # the model may name one
    with pytest.raises(ConfigError, match=r"^enable_auto_tool_choice: needs tool_call_parser"):
        EngineConfig.from_kwargs(
            model="builtin:tiny-llama", device="cpu", enable_auto_tool_choice=True
        )
    gpt_oss = EngineConfig.from_kwargs(
        model="builtin:tiny-gpt-oss", device="cpu", enable_auto_tool_choice=True
    )
    assert gpt_oss.frontend.tool_call_parser == "openai"
