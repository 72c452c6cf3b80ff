"""The YAML reader under the deployment config: a key given twice in one mapping is an error
naming both lines, wherever the mapping is; YAML's merge keys may still be overridden."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config.strict_yaml import load_yaml_file
from engine.errors import ConfigError


def load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_yaml_file(path)


def test_a_key_given_twice_in_a_nested_mapping_names_both_lines(tmp_path: Path) -> None:
    text = "http_options:\n  port: 8001\n  host: 0.0.0.0\n  port: 8002\n"
    with pytest.raises(
        ConfigError, match=r"c\.yaml: line 4: key 'port' given twice \(first at line 2\)"
    ):
        load(tmp_path, text)


def test_a_key_given_twice_in_one_flow_mapping_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"line 1: key 'a' given twice \(first at line 1\)"):
        load(tmp_path, "{a: 1, b: 2, a: 3}\n")


def test_equal_keys_in_different_mappings_and_merge_overrides_are_kept(tmp_path: Path) -> None:
    text = (
        "base: &base {device: cpu, max_model_len: 512}\n"
        "models:\n"
        "  - {engine_kwargs: {<<: *base, max_model_len: 1024}}\n"
        "  - {engine_kwargs: {<<: *base}}\n"
    )
    data = load(tmp_path, text)
    assert isinstance(data, dict)
    kwargs = [m["engine_kwargs"] for m in data["models"]]
    assert kwargs == [{"device": "cpu", "max_model_len": 1024},
                      {"device": "cpu", "max_model_len": 512}]  # fmt: skip


def test_a_missing_file_and_invalid_yaml_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.yaml: no such config file"):
        load_yaml_file(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match=r"c\.yaml: not valid YAML"):
        load(tmp_path, "models: [\n")
