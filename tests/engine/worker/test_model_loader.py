"""The strict checkpoint loader: every checkpoint tensor is loaded, known to be another pipeline
stage's, or named in an error; every copy is shape-checked; quantized dtypes that no
quantization_config describes are refused.

The checkpoints are the built-in tiny models, copied and rewritten with safetensors.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from engine.builtin.catalog import resolve_model_source
from engine.models import get_model_class
from engine.worker.model_loader import iterate_checkpoint, load_weights
from parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from parallel.state import GroupCoordinator, ParallelContext

Tensors = dict[str, torch.Tensor]

# tiny-llama: hidden 64, intermediate 128, 2 layers, 4 heads and 2 KV heads of head_dim 16.
HIDDEN, INTER, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 64, 128, 16, 4, 2


def _checkpoint(name: str, tmp_path: Path, edit: Callable[[Tensors], None] | None = None) -> Path:
    """A copy of the built-in model ``name`` whose tensors ``edit`` may rewrite in place."""
    out = tmp_path / name
    shutil.copytree(resolve_model_source(f"builtin:{name}"), out)
    if edit is not None:
        tensors = load_file(out / "model.safetensors")
        edit(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _hf_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def _load(path: Path, ctx: ParallelContext | None = None) -> nn.Module:
    hf = _hf_config(path)
    model = get_model_class(hf["architectures"][0])(hf, ctx or ParallelContext())
    load_weights(model, iterate_checkpoint(path, progress=False), hf_config=hf)
    return model


def _stage(rank: int, size: int = 2) -> ParallelContext:
    return ParallelContext(pp=GroupCoordinator(rank=rank, size=size, ranks=tuple(range(size))))


def test_unmodified_checkpoint_loads_fused_parts_in_order(tmp_path: Path) -> None:
    path = _checkpoint("tiny-llama", tmp_path)
    model = _load(path)
    ref = load_file(path / "model.safetensors")
    layer = "model.layers.1"
    params = dict(model.named_parameters())
    qkv = torch.cat([ref[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([ref[f"{layer}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(params[f"{layer}.self_attn.qkv_proj.weight"], qkv)
    assert torch.equal(params[f"{layer}.mlp.gate_up_proj.weight"], gate_up)
    assert torch.equal(params["lm_head.weight"], ref["lm_head.weight"])


def test_unknown_tensor_is_refused_by_name(tmp_path: Path) -> None:
    def add(t: Tensors) -> None:
        t["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4, HIDDEN)

    path = _checkpoint("tiny-llama", tmp_path, add)
    with pytest.raises(ValueError) as err:
        _load(path)
    assert str(err.value) == (
        "checkpoint tensor 'model.layers.0.self_attn.extra_proj.weight' is not a parameter "
        "of LlamaForCausalLM"
    )


@pytest.mark.parametrize("leaf", ["weight_scale", "extra_proj.weight"])
def test_unknown_tensor_read_as_a_lazy_slice_is_refused_by_name(tmp_path: Path, leaf: str) -> None:
    """Through ``load_model``, which reads a tensor no parameter takes as a lazy safetensors
    slice (no rank reads it whole): named, not an AttributeError on the slice."""
    from engine.config import EngineConfig
    from engine.worker.model_loader import load_model

    name = f"model.layers.0.self_attn.{'k_proj.' if leaf == 'weight_scale' else ''}{leaf}"

    def add(t: Tensors) -> None:
        t[name] = torch.ones(1) if leaf == "weight_scale" else torch.zeros(4, HIDDEN)
        t["model.layers.0.mlp.shared_experts.down_proj.weight"] = torch.zeros(HIDDEN, 0)

    path = _checkpoint("tiny-llama", tmp_path, add)
    config = EngineConfig.from_kwargs(model=str(path), dtype="float32", attention_backend="torch")
    with pytest.raises(ValueError) as err:
        load_model(config, ParallelContext(), torch.device("cpu"))
    assert str(err.value) == f"checkpoint tensor {name!r} is not a parameter of LlamaForCausalLM"


def test_layer_beyond_num_hidden_layers_is_refused_on_a_later_stage(tmp_path: Path) -> None:
    # Stage 1 of 2 holds layer 1 only; a layer 2 is no stage's, so it is an error, not "elsewhere".
    def add(t: Tensors) -> None:
        t["model.layers.2.input_layernorm.weight"] = torch.ones(HIDDEN)

    path = _checkpoint("tiny-llama", tmp_path, add)
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.input_layernorm\.weight' is not"):
        _load(path, _stage(1))


def test_rotary_inv_freq_buffers_of_older_checkpoints_are_ignored(tmp_path: Path) -> None:
    def add(t: Tensors) -> None:
        for i in range(2):
            t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(HEAD_DIM // 2)

    _load(_checkpoint("tiny-llama", tmp_path, add))


def test_mlp_bias_checkpoint_is_refused_by_a_model_built_without_mlp_bias(tmp_path: Path) -> None:
    def add(t: Tensors) -> None:
        for i in range(2):
            for proj, rows in (("gate", INTER), ("up", INTER), ("down", HIDDEN)):
                t[f"model.layers.{i}.mlp.{proj}_proj.bias"] = torch.zeros(rows)

    path = _checkpoint("tiny-llama", tmp_path, add)  # its config.json says mlp_bias: false
    with pytest.raises(ValueError) as err:
        _load(path)
    message = str(err.value)
    assert message.startswith("checkpoint tensors 'model.layers.0.mlp.")
    assert "(6 in all) are not parameters of LlamaForCausalLM" in message
    assert message.endswith("(config attention_bias=False, mlp_bias=False?)")


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("model.layers.1.self_attn.k_proj.weight", [64, 64], [32, 64]),  # QKV part
        ("model.layers.1.mlp.up_proj.weight", [64, 64], [128, 64]),  # merged part
        ("model.layers.1.self_attn.o_proj.weight", [64, 1], [64, 64]),  # would broadcast
        ("model.layers.1.mlp.down_proj.weight", [64, 64], [64, 128]),  # row-parallel
        ("model.embed_tokens.weight", [1088, 64], [1024, 64]),  # the padding is ours
        ("model.norm.weight", [1], [64]),  # replicated; would broadcast
    ],
)
def test_wrong_shape_is_refused_naming_tensor_and_both_shapes(
    tmp_path: Path, name: str, shape: list[int], expected: list[int]
) -> None:
    def reshape(t: Tensors) -> None:
        t[name] = torch.zeros(shape)

    with pytest.raises(ValueError) as err:
        _load(_checkpoint("tiny-llama", tmp_path, reshape))
    assert str(err.value).startswith(
        f"{name}: checkpoint shape {shape} != expected {expected} for "
    )


@pytest.mark.parametrize(
    ("dtype", "described"),
    [(torch.float8_e4m3fn, "float8_e4m3fn (F8_E4M3)"), (torch.int8, "int8 (I8)")],
)
def test_quantized_dtype_is_refused_naming_tensor_and_dtype(
    tmp_path: Path, dtype: torch.dtype, described: str
) -> None:
    name = "model.layers.0.mlp.down_proj.weight"

    def quantize(t: Tensors) -> None:
        t[name] = t[name].to(dtype)

    with pytest.raises(ValueError) as err:
        _load(_checkpoint("tiny-llama", tmp_path, quantize))
    assert str(err.value) == (
        f"checkpoint tensor {name!r} is {described}: weights must be F32, F16 or BF16 unless "
        "config.json's quantization_config says how the tensor is quantized"
    )


def test_checkpoint_without_one_fused_part_is_refused(tmp_path: Path) -> None:
    def drop(t: Tensors) -> None:
        del t["model.layers.0.self_attn.v_proj.weight"]

    with pytest.raises(ValueError) as err:
        _load(_checkpoint("tiny-llama", tmp_path, drop))
    assert str(err.value) == (
        "model: checkpoint lacks 1 parameters, e.g. "
        "[\"model.layers.0.self_attn.qkv_proj.weight (part 'v')\"]"
    )


def test_pipeline_stage_1_loads_its_layers_and_skips_stage_0s(tmp_path: Path) -> None:
    path = _checkpoint("tiny-llama", tmp_path)
    model = _load(path, _stage(1))
    ref = load_file(path / "model.safetensors")
    params = dict(model.named_parameters())
    assert not any(name.startswith(("model.layers.0.", "model.embed_tokens")) for name in params)
    assert torch.equal(
        params["model.layers.1.mlp.down_proj.weight"], ref["model.layers.1.mlp.down_proj.weight"]
    )
    assert torch.equal(params["lm_head.weight"], ref["lm_head.weight"])


def _store_lm_head(t: Tensors) -> None:
    # Different from the embedding, so the test sees which of the two is loaded.
    t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1.0


@pytest.mark.parametrize("stage", [None, 0, 1], ids=["pp1", "pp-stage0", "pp-stage1"])
def test_tied_checkpoint_that_also_stores_lm_head_loads_the_embedding(
    tmp_path: Path, stage: int | None
) -> None:
    path = _checkpoint("tiny-qwen2", tmp_path, _store_lm_head)
    model = _load(path, None if stage is None else _stage(stage))
    embedding = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    weights = [m.weight for m in (model.model.embed_tokens, model.lm_head) if m is not None]
    assert weights
    for weight in weights:
        assert torch.equal(weight, embedding)


def test_tied_lm_head_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    def add(t: Tensors) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"][:-1].clone()

    with pytest.raises(ValueError, match=r"^lm_head\.weight: checkpoint shape \[\d+, 64\]"):
        _load(_checkpoint("tiny-qwen2", tmp_path, add))


def test_checkpoint_storing_qkv_and_gate_up_fused_loads_like_separate_parts(
    tmp_path: Path,
) -> None:
    def fuse(t: Tensors) -> None:
        for i in range(2):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            t[f"{attn}.qkv_proj.weight"] = torch.cat(
                [t.pop(f"{attn}.{p}_proj.weight") for p in "qkv"]
            )
            t[f"{mlp}.gate_up_proj.weight"] = torch.cat(
                [t.pop(f"{mlp}.{p}_proj.weight") for p in ("gate", "up")]
            )

    separate = dict(_load(_checkpoint("tiny-llama", tmp_path / "a")).named_parameters())
    fused = dict(_load(_checkpoint("tiny-llama", tmp_path / "b", fuse)).named_parameters())
    assert separate.keys() == fused.keys()
    for name, param in separate.items():
        assert torch.equal(fused[name], param), name


# Layer level, TP = 2: the fused tensor read as a lazy safetensors slice gives each rank the
# same shard as the separate tensors, and each rank reads only its own rows.


class _RecordingSlice:
    """A safetensors slice that remembers the row ranges read from it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rows: list[tuple[int, int]] = []

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, key: Any) -> torch.Tensor:
        rows = key[0] if isinstance(key, tuple) else key
        self.rows.append((rows.start, rows.stop))
        return self.inner[key]


def _slices(tensors: Tensors, tmp_path: Path) -> Callable[[str], _RecordingSlice]:
    file = tmp_path / "fused.safetensors"
    save_file(tensors, str(file))
    handle = safe_open(str(file), framework="pt")
    return lambda name: _RecordingSlice(handle.get_slice(name))


def _tp(rank: int) -> GroupCoordinator:
    return GroupCoordinator(rank=rank, size=2, ranks=(0, 1))


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_fused_qkv_shard_equals_separate_q_k_v_shards(
    tmp_path: Path, rank: int, num_kv_heads: int
) -> None:
    g = torch.Generator().manual_seed(rank + 10 * num_kv_heads)
    q_rows, kv_rows = NUM_HEADS * HEAD_DIM, num_kv_heads * HEAD_DIM
    parts = {
        "q": torch.randn(q_rows, HIDDEN, generator=g),
        "k": torch.randn(kv_rows, HIDDEN, generator=g),
        "v": torch.randn(kv_rows, HIDDEN, generator=g),
    }
    biases = {p: torch.randn(w.shape[0], generator=g) for p, w in parts.items()}
    fused = {"w": torch.cat(list(parts.values())), "b": torch.cat(list(biases.values()))}
    slice_of = _slices(fused, tmp_path)

    def layer() -> QKVParallelLinear:
        return QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, num_kv_heads, bias=True, tp=_tp(rank))

    separate, joined = layer(), layer()
    for part in "qkv":
        separate.weight_loader(separate.weight, parts[part], part)
        separate.bias.weight_loader(separate.bias, biases[part], part)
    weight, bias = slice_of("w"), slice_of("b")
    joined.weight_loader(joined.weight, weight)
    joined.bias.weight_loader(joined.bias, bias)
    assert torch.equal(joined.weight, separate.weight)
    assert torch.equal(joined.bias, separate.bias)
    # One head of q and (this rank's or the replicated) KV head of k and v: never all rows.
    local = [2 * HEAD_DIM, separate.kv_size, separate.kv_size]
    assert [stop - start for start, stop in weight.rows] == local


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_fused_gate_up_shard_equals_separate_gate_and_up_shards(
    tmp_path: Path, rank: int
) -> None:
    g = torch.Generator().manual_seed(rank)
    gate, up = torch.randn(INTER, HIDDEN, generator=g), torch.randn(INTER, HIDDEN, generator=g)
    slice_of = _slices({"w": torch.cat([gate, up])}, tmp_path)
    separate = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp=_tp(rank))
    joined = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp=_tp(rank))
    separate.weight_loader(separate.weight, gate, 0)
    separate.weight_loader(separate.weight, up, 1)
    weight = slice_of("w")
    joined.weight_loader(joined.weight, weight)
    assert torch.equal(joined.weight, separate.weight)
    half = INTER // 2
    assert weight.rows == [
        (rank * half, (rank + 1) * half),
        (INTER + rank * half, INTER + (rank + 1) * half),
    ]


@pytest.mark.parametrize(
    ("make", "shape", "expected"),
    [
        (
            lambda tp: ColumnParallelLinear(HIDDEN, INTER, tp=tp),
            (INTER // 2, HIDDEN),
            [INTER, HIDDEN],
        ),
        (lambda tp: RowParallelLinear(INTER, HIDDEN, tp=tp), (HIDDEN, INTER // 2), [HIDDEN, INTER]),
        (lambda tp: VocabParallelEmbedding(100, HIDDEN, tp=tp), (128, HIDDEN), [100, HIDDEN]),
        (
            lambda tp: MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp=tp),
            (INTER, HIDDEN),
            [2 * INTER, HIDDEN],
        ),
    ],
    ids=["column", "row", "vocab", "merged-fused"],
)
def test_tp2_loader_refuses_a_shard_sized_tensor(
    make: Callable[[GroupCoordinator], nn.Module], shape: tuple[int, ...], expected: list[int]
) -> None:
    # A tensor of exactly one rank's shard shape must not load as if it were the whole matrix.
    layer = make(_tp(1))
    with pytest.raises(ValueError, match=re.escape(f"!= expected {expected}")):
        layer.weight_loader(layer.weight, torch.zeros(shape))
