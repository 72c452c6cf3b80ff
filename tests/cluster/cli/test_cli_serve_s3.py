"""``cluster serve`` of a model whose checkpoint is in an S3-compatible store (moto's S3 server
on localhost, ``tests/s3_server.py``, reached over HTTP by boto3 in every process of the
deployment), driven with the official ``openai`` client: the served greedy completion is the
local checkpoint's, and the weights crossed the network once (the driver's config check and
the replica's front and head read only the safetensors headers; the worker copied the file)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from openai import OpenAI

from engine import LLM, SamplingParams
from engine.builtin.catalog import resolve_model_source
from tests.cluster.cli.test_cli_serving import start_serving, stop_process_group
from tests.cluster.conftest import free_port, load_yaml
from tests.s3_server import S3Server

PROMPT = "The quick brown fox"


@pytest.fixture
def local_model() -> Path:
    return resolve_model_source("builtin:tiny-llama")  # from the suite's cache


@pytest.fixture
def server(
    local_model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[S3Server]:
    server = S3Server()
    # Set in this process, so `cluster serve` and the local Ray it starts inherit them.
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LLM_CLUSTER_CACHE_DIR", str(tmp_path / "cache"))
    yield server
    server.stop()


@pytest.mark.slow
def test_serve_an_s3_model_source(server: S3Server, local_model: Path, tmp_path: Path) -> None:
    local = local_model
    uri = server.upload_dir(local, "ckpts", "tiny-llama")
    config = load_yaml("tiny.yaml")
    http_port = free_port()
    config["http_options"]["port"] = http_port
    config["grpc_options"]["port"] = free_port()
    model = config["models"][0]
    model["model_loading_config"] = {"model_id": "tiny", "model_source": {"bucket_uri": uri}}
    path = tmp_path / "s3.yaml"
    path.write_text(yaml.safe_dump(config))
    engine = {k: model["engine_kwargs"][k] for k in ("dtype", "max_model_len", "num_kv_blocks")}
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(str(local), **engine).generate([PROMPT], greedy, use_tqdm=False)[0]

    server.served.reset()
    serving = start_serving(path)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0)
        reply = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].text == expected.outputs[0].text
        assert reply.usage.completion_tokens == 8
    finally:
        stop_process_group(serving)
    size = (local / "model.safetensors").stat().st_size
    assert size <= server.served.bytes["ckpts/tiny-llama/model.safetensors"] < 1.2 * size
