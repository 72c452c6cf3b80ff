"""A deployment whose ``model_source`` is an s3:// checkpoint (as a string, or Ray Serve LLM's
``{bucket_uri: ...}``), against moto's S3 server on localhost (``tests/s3_server.py``): the
driver's config check reads the config and tokenizer files and the safetensors headers, never
the weights; a store it cannot read is an error naming ``model_source``; the replicas get the
store's endpoint and region with the app, never its credentials."""

from __future__ import annotations

import copy
import struct
from pathlib import Path
from typing import Any

import pytest

from cluster.config import load_config
from engine.errors import ConfigError
from tests.s3_server import S3Server

BASE: dict[str, Any] = {
    "models": [
        {
            "model_loading_config": {"model_id": "tiny", "model_source": "s3://ckpts/tiny-llama"},
            "engine_kwargs": {"device": "cpu", "dtype": "float32", "max_model_len": 256},
        }
    ]
}


def _with_source(source: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data["models"][0]["model_loading_config"]["model_source"] = source
    return data


@pytest.mark.parametrize(
    "source", ["s3://ckpts/tiny-llama", {"bucket_uri": "s3://ckpts/tiny-llama"}]
)
def test_the_driver_check_reads_headers_not_weights(
    tiny_llama_store: S3Server, tiny_llama_dir: Path, source: Any
) -> None:
    tiny_llama_store.served.reset()
    config = load_config(_with_source(source))
    assert config.models[0].engine_args()["model"] == "s3://ckpts/tiny-llama"
    weights = tiny_llama_dir / "model.safetensors"
    with weights.open("rb") as f:
        header = 8 + struct.unpack("<Q", f.read(8))[0]
    assert tiny_llama_store.served.bytes["ckpts/tiny-llama/model.safetensors"] == header
    assert sum(tiny_llama_store.served.bytes.values()) < weights.stat().st_size / 5


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "s3://no-such-bucket/tiny",
            "models[0].model_loading_config.model_source: s3://no-such-bucket/tiny: the store "
            "at http://",
        ),
        (
            {"bucket_uri": "s3://ckpts/missing"},
            "models[0].model_loading_config.model_source: s3://ckpts/missing: no objects",
        ),
        (
            {"bucket_uri": "gs://ckpts/tiny"},
            "models[0].model_loading_config.model_source.bucket_uri: must be an s3://",
        ),
        (
            {"bucket_uri": "s3://ckpts/tiny-llama", "s3_sync_args": []},
            "models[0].model_loading_config.model_source.s3_sync_args: unknown key",
        ),
    ],
)
def test_errors_name_model_source(tiny_llama_store: S3Server, source: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_with_source(source))
    assert str(err.value).startswith(message)


def test_cluster_plan_reads_config_json_from_the_store(tiny_llama_store: S3Server) -> None:
    from cluster.ops.plan import format_model, plan_model

    plan = plan_model(load_config(_with_source({"bucket_uri": "s3://ckpts/tiny-llama"})).models[0])
    assert plan.plan is not None
    assert plan.plan.architecture == "LlamaForCausalLM"
    assert "s3://ckpts/tiny-llama: LlamaForCausalLM" in format_model(plan)


def test_replicas_get_the_store_not_its_credentials(
    tiny_llama_store: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cluster.serving.serve import runtime_env

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", tiny_llama_store.endpoint)
    env = runtime_env()["env_vars"]
    assert env["AWS_ENDPOINT_URL"] == env["AWS_ENDPOINT_URL_S3"] == tiny_llama_store.endpoint
    assert env["AWS_REGION"] == "us-east-1"
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env)
