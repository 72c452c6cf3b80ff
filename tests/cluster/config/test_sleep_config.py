"""A model's ``sleep_config`` and the deployment's ``sleep_mode``: what the ingress's awake set
and the replicas get, and what is refused before anything is deployed (naming the key path)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import load_config
from engine.config import ConfigError

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def sleepy_config(max_awake: int | None = 1, **sleep: Any) -> dict[str, Any]:
    data = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    first = data["models"][0]
    first["sleep_config"] = {"level": 2, "sleep_after_idle_s": 30, **sleep}
    second = copy.deepcopy(first)
    second["model_loading_config"]["model_id"] = "tiny-llama-2"
    second["sleep_config"] = {"wake_timeout_s": 90}
    data["models"].append(second)
    if max_awake is not None:
        data["sleep_mode"] = {"max_awake_models": max_awake}
    return data


def test_the_ingress_gets_each_sleeping_models_level_the_limit_and_the_longest_wait() -> None:
    config = load_config(sleepy_config())
    assert config.awake_spec() == ({"tiny-llama": 2, "tiny-llama-2": 1}, 1, 300.0)
    assert config.models[0].sleep_config.sleep_after_idle_s == 30


def test_without_a_limit_models_sleep_only_on_their_own() -> None:
    config = load_config(sleepy_config(max_awake=None))
    assert config.awake_spec() is None and not config.starts_asleep("tiny-llama-2")


def test_the_sleeping_models_beyond_the_limit_start_asleep_in_config_order() -> None:
    data = sleepy_config(max_awake=1)
    third = copy.deepcopy(data["models"][0])
    third["model_loading_config"]["model_id"] = "awake-always"
    third.pop("sleep_config")
    data["models"].insert(0, third)  # no sleep_config: not counted, never asleep at start
    config = load_config(data)
    starts = {m.model_id: config.starts_asleep(m.model_id) for m in config.models}
    assert starts == {"awake-always": False, "tiny-llama": False, "tiny-llama-2": True}


@pytest.mark.parametrize(
    ("change", "path"),
    [
        (lambda c: c["models"][0]["sleep_config"].update(level=3),
         "models[0].sleep_config.level"),
        (lambda c: c["models"][0]["sleep_config"].update(sleep_after_idle_s=0),
         "models[0].sleep_config.sleep_after_idle_s"),
        (lambda c: c["models"][0]["sleep_config"].update(wake_timeout_s=-1),
         "models[0].sleep_config.wake_timeout_s"),
        (lambda c: (c["models"][0]["model_loading_config"].update(
            model_source="builtin:tiny-qwen3-moe"), c["models"][0]["engine_kwargs"].update(
            data_parallel_size=2, enable_expert_parallel=True)), "models[0].sleep_config"),
        (lambda c: c["models"][0]["engine_kwargs"].update(kv_transfer_config={
            "kv_connector": "NixlConnector", "kv_role": "kv_both"}), "models[0].sleep_config"),
        (lambda c: c["sleep_mode"].update(max_awake_models=0), "sleep_mode.max_awake_models"),
        (lambda c: c.setdefault("http_options", {}).update(ingress_replicas=2),
         "sleep_mode.max_awake_models"),
        (lambda c: [m.pop("sleep_config") for m in c["models"]], "sleep_mode.max_awake_models"),
    ],
)  # fmt: skip
def test_refused_before_deploying_naming_the_key(change: Any, path: str) -> None:
    config = sleepy_config()
    change(config)
    with pytest.raises(ConfigError, match=path.replace("[", r"\[").replace("]", r"\]")):
        load_config(config)
