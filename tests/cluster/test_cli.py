"""The ``cluster`` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys


def _cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_make_model_writes_an_hf_directory(tmp_path) -> None:
    result = _cluster("make-model", "tiny-qwen2", str(tmp_path / "q"))
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (tmp_path / "q" / "tokenizer.json").exists()


def test_generate_prints_a_completion() -> None:
    result = _cluster(
        "generate", "Hello there", "--max-tokens", "5", "--engine-arg", "num_kv_blocks=64"
    )
    assert result.returncode == 0, result.stderr
    assert "completion:" in result.stdout and "finish_reason=length" in result.stdout


def test_generate_with_bad_engine_argument_exits_2_naming_it() -> None:
    result = _cluster("generate", "x", "--engine-arg", "block_sise=16")
    assert result.returncode == 2
    assert "block_sise: unknown engine argument" in result.stderr
