"""``model: s3://bucket/prefix`` against moto's S3 server on localhost (``tests/s3_server.py``,
real boto3 over HTTP): the engine loaded from the store gives the local directory's greedy
tokens and HF transformers' (fp32); the config check reads only the safetensors headers; a
node's copy is downloaded once by concurrent copiers (threads, each with its own handle on the
lock file, as processes have), reused when complete, fetched again when an object changes or
the local file is damaged; a ``tokenizer`` of its own in the store; a bad URI, a missing
bucket, prefix or config.json, no credentials, an unreachable store and no boto3 are errors
naming the field and the URI."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import sys
import threading
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.s3_mirror import MANIFEST, mirror_checkpoint, mirror_dir
from tests.s3_server import S3Server

BUCKET = "ckpts"
PROMPTS = ["The quick brown fox", "Hello, my name is"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ARGS = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 32}


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _header_bytes(file: Path) -> int:
    with file.open("rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_engine_from_s3_matches_the_local_directory_and_hf(
    tiny_llama_store: S3Server, tiny_llama_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from_s3 = _tokens(LLM("s3://ckpts/tiny-llama", **ARGS))
    local = _tokens(LLM(str(tiny_llama_dir), **ARGS))
    assert from_s3 == local
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt, tokens in zip(PROMPTS, from_s3):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert tokens == out[0, ids.shape[1] :].tolist()
    copy = mirror_dir("s3://ckpts/tiny-llama")
    for file in tiny_llama_dir.iterdir():
        assert (copy / file.name).read_bytes() == file.read_bytes()


def test_config_check_reads_only_the_safetensors_headers(
    tiny_llama_store: S3Server, tiny_llama_dir: Path
) -> None:
    tiny_llama_store.upload_dir(tiny_llama_dir, BUCKET, "headers-only")
    tiny_llama_store.served.reset()
    config = EngineConfig.from_kwargs(model="s3://ckpts/headers-only", **ARGS)
    weights = tiny_llama_dir / "model.safetensors"
    served = tiny_llama_store.served.bytes
    assert config.model.hf_config["tie_word_embeddings"] is False  # so the headers were read
    assert served[f"{BUCKET}/headers-only/model.safetensors"] == _header_bytes(weights)
    assert _header_bytes(weights) * 20 < weights.stat().st_size
    assert served[f"{BUCKET}/headers-only/config.json"] > 0  # the small files were copied
    copy = Path(config.model.model_path)
    assert (copy / "tokenizer.json").is_file()
    assert not (copy / "model.safetensors").exists()


def test_concurrent_copies_download_once_then_reuse_then_refetch_a_change(
    tiny_llama_store: S3Server,
    tiny_llama_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setattr("engine.s3_store.PART_BYTES", 64 << 10)  # many ranged GETs per file
    tiny_llama_store.upload_dir(tiny_llama_dir, BUCKET, "shared")
    uri = "s3://ckpts/shared"
    weights_key = f"{BUCKET}/shared/model.safetensors"
    size = (tiny_llama_dir / "model.safetensors").stat().st_size
    tiny_llama_store.served.reset()
    results: list[Path] = []
    errors: list[BaseException] = []

    def copy() -> None:
        try:
            results.append(mirror_checkpoint(uri, cache_root=tmp_path))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=copy) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    target = results[0]
    assert tiny_llama_store.served.bytes[weights_key] == size  # once, in ranged parts
    assert tiny_llama_store.served.gets[weights_key] == -(-size // (64 << 10))
    assert (target / "model.safetensors").read_bytes() == (
        tiny_llama_dir / "model.safetensors"
    ).read_bytes()
    assert not [p for p in target.iterdir() if p.name.endswith(".s3-part")]

    tiny_llama_store.served.reset()
    mirror_checkpoint(uri, cache_root=tmp_path)  # complete: nothing is downloaded again
    assert sum(tiny_llama_store.served.bytes.values()) == 0

    changed = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    changed["max_new_tokens"] = 7
    s3 = tiny_llama_store.client()
    s3.put_object(
        Bucket=BUCKET, Key="shared/generation_config.json", Body=json.dumps(changed).encode()
    )
    s3.delete_object(Bucket=BUCKET, Key="shared/special_tokens_map.json")
    tiny_llama_store.served.reset()
    mirror_checkpoint(uri, cache_root=tmp_path)
    assert set(tiny_llama_store.served.bytes) == {f"{BUCKET}/shared/generation_config.json"}
    assert json.loads((target / "generation_config.json").read_text()) == changed
    assert not (target / "special_tokens_map.json").exists()
    manifest = json.loads((target / MANIFEST).read_text())
    assert "special_tokens_map.json" not in manifest

    (target / "model.safetensors").write_bytes(b"cut short")  # a damaged copy is fetched again
    tiny_llama_store.served.reset()
    mirror_checkpoint(uri, cache_root=tmp_path)
    assert tiny_llama_store.served.bytes[weights_key] == size


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://", "is not an s3://bucket/prefix URI"),
        ("s3://ab/x", "is not an s3://bucket/prefix URI"),
        ("s3://no-such-bucket/tiny", "has no bucket 'no-such-bucket'"),
        ("s3://ckpts/no-such-prefix", "no objects under this prefix"),
        ("s3://ckpts/no-config", "holds no config.json"),
    ],
)
def test_bad_sources_name_the_model_and_the_uri(
    tiny_llama_store: S3Server, tiny_llama_dir: Path, tmp_path: Path, uri: str, message: str
) -> None:
    if uri.endswith("no-config"):
        shutil.copytree(tiny_llama_dir, tmp_path / "no-config")
        (tmp_path / "no-config" / "config.json").unlink()
        tiny_llama_store.upload_dir(tmp_path / "no-config", BUCKET, "no-config")
    with pytest.raises(ConfigError, match=r"^model: ") as err:
        LLM(uri, **ARGS)
    assert message in str(err.value)
    assert uri.rstrip("/") in str(err.value)


def test_no_credentials_and_no_boto3_are_named(
    tiny_llama_store: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigError, match=r"^model: s3://ckpts/tiny-llama: no credentials"):
        EngineConfig.from_kwargs(model="s3://ckpts/tiny-llama", **ARGS)
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    needs = r"^model: s3://ckpts/tiny-llama: an s3:// checkpoint needs boto3.*llm-cluster\[s3\]"
    with pytest.raises(ConfigError, match=needs):
        EngineConfig.from_kwargs(model="s3://ckpts/tiny-llama", **ARGS)


def test_an_unreachable_store_is_named(
    tiny_llama_store: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=rf"^model: s3://ckpts/x: the store at .*:{port}"):
        EngineConfig.from_kwargs(model="s3://ckpts/x", **ARGS)


def test_a_tokenizer_in_the_store(
    tiny_llama_store: S3Server, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """``tokenizer: s3://...`` (a prefix of tokenizer files alone, no config.json)."""
    (tmp_path / "tok").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_llama_dir / name, tmp_path / "tok" / name)
    uri = tiny_llama_store.upload_dir(tmp_path / "tok", BUCKET, "tokenizer-only")
    config = EngineConfig.from_kwargs(model=str(tiny_llama_dir), tokenizer=uri, **ARGS)
    assert config.model.tokenizer == str(mirror_dir(uri))
    assert _tokens(LLM(str(tiny_llama_dir), tokenizer=uri, **ARGS)) == _tokens(
        LLM(str(tiny_llama_dir), **ARGS)
    )
