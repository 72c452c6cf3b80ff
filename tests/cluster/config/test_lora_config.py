"""A model's ``lora_config`` (Ray Serve LLM's keys): what is accepted, with Ray's defaults, and
what is refused before anything is deployed (naming the key path). Adapters are read from a
local or mounted directory, never downloaded."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import load_config
from engine.config import ConfigError

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
KEY = re.escape("models[0].lora_config")


def lora_config(**lora: Any) -> dict[str, Any]:
    data = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    data["models"][0]["lora_config"] = {"dynamic_lora_loading_path": "/loras", **lora}
    return data


def test_rays_download_keys_are_accepted_with_rays_defaults() -> None:
    lora = load_config(lora_config()).models[0].lora_config
    assert (lora.download_timeout_s, lora.max_download_tries) == (30.0, 3)
    lora = load_config(lora_config(download_timeout_s=12.5, max_download_tries=1)).models[0]
    assert (lora.lora_config.download_timeout_s, lora.lora_config.max_download_tries) == (12.5, 1)
    no_timeout = load_config(lora_config(download_timeout_s=None)).models[0].lora_config
    assert no_timeout.download_timeout_s is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("download_timeout_s", 0),
        ("download_timeout_s", -5),
        ("download_timeout_s", "30"),
        ("max_download_tries", 0),
        ("max_download_tries", 2.5),
        ("max_download_tries", True),
    ],
)
def test_download_keys_out_of_range_are_refused_naming_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"{KEY}\.{key}"):
        load_config(lora_config(**{key: value}))


def test_a_remote_adapter_store_is_refused() -> None:
    with pytest.raises(ConfigError, match=rf"{KEY}\.dynamic_lora_loading_path: must be a local"):
        load_config(lora_config(dynamic_lora_loading_path="s3://bucket/loras"))


def test_enable_lora_false_with_lora_config_is_refused() -> None:
    data = lora_config()
    data["models"][0].setdefault("engine_kwargs", {})["enable_lora"] = False
    with pytest.raises(ConfigError, match=r"engine_kwargs\.enable_lora: cannot be false"):
        load_config(data)
