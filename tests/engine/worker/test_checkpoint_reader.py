"""The parallel checkpoint reader gives the same tensors as safetensors, in file order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.checkpoint_headers import checkpoint_headers
from engine.worker import checkpoint_reader
from engine.worker.checkpoint_reader import read_checkpoint_file


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        # An odd number of bf16 elements puts the next tensor off a 4-byte boundary.
        "a.odd_bf16": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        "b.f32": torch.randn(7, 9, generator=generator),
        "c.big_f16": torch.randn(300, 70, generator=generator).to(torch.float16),
        "d.u8": torch.randint(0, 255, (11,), generator=generator, dtype=torch.uint8),
        "e.scalar": torch.tensor(2.5),
        "f.empty": torch.empty(0, 4),
    }
    save_file(tensors, str(path))
    return tensors


@pytest.mark.parametrize("run_bytes", [1 << 20, 64])  # one run; a run per tensor or two
def test_tensors_equal_safetensors_in_file_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_bytes: int
) -> None:
    monkeypatch.setattr(checkpoint_reader, "_RUN_BYTES", run_bytes)
    monkeypatch.setattr(checkpoint_reader, "_PIECE_BYTES", 1000)  # several reads per run
    monkeypatch.setattr(checkpoint_reader, "_AHEAD_BYTES", 4096)
    path = tmp_path / "model.safetensors"
    written = _checkpoint(path)
    got = list(read_checkpoint_file(path))
    headers = checkpoint_headers(tmp_path)
    assert [n for n, _ in got] == sorted(written, key=lambda n: headers[n]["data_offsets"])
    for name, tensor in got:
        assert isinstance(tensor, torch.Tensor)
        assert tensor.dtype == written[name].dtype
        assert torch.equal(tensor, written[name])


def test_tensors_not_read_whole_stay_lazy_slices(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    written = _checkpoint(path)
    got = dict(read_checkpoint_file(path, read_whole=lambda name: name != "c.big_f16"))
    lazy = got["c.big_f16"]
    assert not isinstance(lazy, torch.Tensor)
    assert list(lazy.get_shape()) == [300, 70]
    assert torch.equal(lazy[10:20], written["c.big_f16"][10:20])
    assert torch.equal(got["d.u8"], written["d.u8"])


def test_a_truncated_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    _checkpoint(path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(
        ValueError, match=r"model\.safetensors: the header says \d+ bytes, the file has \d+"
    ):
        list(read_checkpoint_file(path))
