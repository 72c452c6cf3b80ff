"""A replica that cannot start for a known cause says why in one line
(``cluster.serving.start_errors``), and the deploy side finds that line in Serve's status
message. No Ray here; the same failures through real Serve replicas are in
``test_cli_serving.py``."""

from __future__ import annotations

import errno
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from ray.exceptions import RayTaskError

from cluster.serving.llm_server import LLMServer
from cluster.serving.start_errors import (
    EngineStartError,
    ModelStartError,
    known_start_failure,
    start_failure,
)
from engine.builtin.catalog import resolve_model_source
from engine.errors import ConfigError, EngineDeadError

ENGINE_ARGS = {"model": "builtin:tiny-llama", "num_kv_blocks": 64, "device": "cpu"}


def raised(outer: BaseException, cause: BaseException) -> BaseException:
    """``outer`` as raised ``from cause`` (its ``__cause__`` set, as Python does)."""
    try:
        try:
            raise cause
        except BaseException as exc:
            raise outer from exc
    except BaseException as exc:
        return exc


def test_a_config_error_is_a_known_cause_with_its_message() -> None:
    error = ConfigError("architectures: 'FooForCausalLM' is not supported; supported: X")
    assert known_start_failure(error) == str(error)


def test_a_cause_behind_an_unknown_wrapper_is_found() -> None:
    error = raised(EngineDeadError("load_model: worker rank 0 failed"),
                   ValueError("model.norm.weight: missing from the checkpoint"))  # fmt: skip
    assert known_start_failure(error) == "model.norm.weight: missing from the checkpoint"


def test_a_ray_task_error_gives_its_remote_exception_not_the_traceback_text() -> None:
    remote = ValueError("architectures: 'FooForCausalLM' is not supported")
    task_error = RayTaskError("load_model", "Traceback (most recent call last):\n  ...", remote)
    error = raised(EngineDeadError("load_model: worker rank 1 failed"), task_error)
    assert known_start_failure(error) == "architectures: 'FooForCausalLM' is not supported"


def test_a_port_in_use_is_a_known_cause() -> None:
    error = OSError(errno.EADDRINUSE, "Address already in use")
    assert known_start_failure(error) == "port in use: [Errno 98] Address already in use"


def test_a_missing_file_is_a_known_cause() -> None:
    error = FileNotFoundError(2, "No such file or directory", "/models/q3/config.json")
    assert "/models/q3/config.json" in known_start_failure(error)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (MemoryError(), "out of memory"),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\n(hint)"),
         "CUDA out of memory. Tried to allocate 2.00 GiB (hint)"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 10 bytes"),
         "DefaultCPUAllocator: can't allocate memory: you tried 10 bytes"),
    ],
)  # fmt: skip
def test_out_of_memory_is_a_known_cause_in_one_line(error: BaseException, reason: str) -> None:
    assert known_start_failure(error) == reason


@pytest.mark.parametrize(
    "error",
    [RuntimeError("placement group: could not be placed within 60 s"),
     ConnectionError("the GCS is unreachable"), OSError(errno.ECONNRESET, "reset")],
)  # fmt: skip
def test_a_failure_a_retry_may_cure_is_not_known(error: BaseException) -> None:
    assert known_start_failure(error) is None


def test_the_start_failure_line_is_found_in_serves_status_message() -> None:
    reason = "architectures: 'FooForCausalLM' is not supported; supported: LlamaForCausalLM"
    message = (
        "A replica failed to start with exception. Retrying 2 more time(s). Error:\n"
        "\x1b[36mray::ServeReplica:llm:LLMServer:q3.initialize_and_get_metadata()\x1b[39m "
        "(pid=1, ip=10.0.0.2)\n  File \"cluster/serving/llm_server.py\", line 97, in __init__\n"
        "engine.errors.ConfigError: " + reason + "\n\nThe above exception was the direct "
        "cause of the following exception:\n\n  File \"cluster/serving/llm_server.py\", line 104\n"
        "cluster.serving.start_errors.ModelStartError: model 'q3' cannot start: " + reason + "\n"
    )  # fmt: skip
    assert start_failure(message) == f"model 'q3' cannot start: {reason}"
    assert start_failure("A replica failed to start with exception. Error:\nKeyError: 'x'") is None
    assert start_failure("") is None


def test_start_errors_survive_pickling_with_their_reason() -> None:
    error = pickle.loads(pickle.dumps(ModelStartError("q3", "out of memory")))
    assert (error.model_id, error.reason, str(error)) == (
        "q3", "out of memory", "model 'q3' cannot start: out of memory")  # fmt: skip
    assert known_start_failure(error) == "out of memory"
    assert known_start_failure(EngineStartError("model: no *.safetensors files in /m")) == (
        "model: no *.safetensors files in /m"
    )


def test_a_replica_whose_lora_directory_is_missing_cannot_start(tmp_path: Path) -> None:
    missing = tmp_path / "loras"
    with pytest.raises(ModelStartError) as info:
        LLMServer("tiny", ENGINE_ARGS, lora_config={"dynamic_lora_loading_path": str(missing)})
    assert str(info.value) == (
        f"model 'tiny' cannot start: lora_config.dynamic_lora_loading_path: {str(missing)!r} "
        "is not a directory on this node"
    )


def test_a_replica_whose_checkpoint_has_no_weights_cannot_start(tmp_path: Path) -> None:
    checkpoint = tmp_path / "no-weights"
    shutil.copytree(resolve_model_source("builtin:tiny-llama"), checkpoint)
    for weights in checkpoint.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ModelStartError) as info:
        LLMServer("tiny", {**ENGINE_ARGS, "model": str(checkpoint)})
    assert str(info.value) == (
        f"model 'tiny' cannot start: model: no *.safetensors files in {checkpoint}"
    )
