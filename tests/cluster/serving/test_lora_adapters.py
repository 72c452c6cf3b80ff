"""``AdapterCatalog`` (``cluster.serving.lora_adapters``) over real adapter directories: an
adapter's ``lora_int_id`` stands for its name and files as they are (alike in every replica),
so files replaced in place or by new ones get a new id (a new prefix-cache key and device
slot), and a removed adapter is not found at once."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from cluster.serving.lora_adapters import AdapterCatalog, AdapterNotFoundError
from engine.lora_request import CONFIG_FILE, WEIGHTS_FILE


def _adapter(root: Path, name: str, weights: bytes = b"w" * 64) -> Path:
    path = root / name
    path.mkdir()
    (path / CONFIG_FILE).write_text('{"r": 8}')
    (path / WEIGHTS_FILE).write_bytes(weights)
    return path


def _after_a_tick() -> None:
    time.sleep(0.02)  # file times move in kernel ticks (a few ms)


def test_same_files_keep_their_id_and_names_have_their_own(tmp_path: Path) -> None:
    a, b = _adapter(tmp_path, "a"), _adapter(tmp_path, "b")
    catalog = AdapterCatalog(str(tmp_path))
    first = catalog.request("a")
    assert (first.lora_name, first.lora_path) == ("a", str(a))
    assert catalog.request("a") == first
    assert catalog.request("b").lora_int_id != first.lora_int_id
    assert catalog.request("b").lora_path == str(b)


def test_every_replica_gives_the_same_files_the_same_id(tmp_path: Path) -> None:
    # (so that pools sharing KV blocks, e.g. prefill and decode, key an adapter's alike)
    _adapter(tmp_path, "a")
    assert AdapterCatalog(str(tmp_path)).request("a") == AdapterCatalog(str(tmp_path)).request("a")


def test_weights_rewritten_in_place_with_the_same_size_get_a_new_id(tmp_path: Path) -> None:
    path = _adapter(tmp_path, "a")
    catalog = AdapterCatalog(str(tmp_path))
    old = catalog.request("a")
    _after_a_tick()
    (path / WEIGHTS_FILE).write_bytes(b"v" * 64)  # same inode, same size
    new = catalog.request("a")
    assert new.lora_int_id != old.lora_int_id
    assert catalog.request("a") == new  # and it stays


@pytest.mark.parametrize("how", ["config_rewritten", "directory_replaced", "weights_replaced"])
def test_changed_files_get_an_id_never_used_before(tmp_path: Path, how: str) -> None:
    path = _adapter(tmp_path, "a")
    catalog = AdapterCatalog(str(tmp_path))
    seen = {catalog.request("a").lora_int_id}
    for _ in range(2):
        _after_a_tick()
        if how == "config_rewritten":
            (path / CONFIG_FILE).write_text('{"r": 8, "lora_alpha": 16}')
        elif how == "directory_replaced":
            shutil.rmtree(path)
            _adapter(tmp_path, "a", b"x" * 32)
        else:  # written next to it, then renamed over it (what a careful deploy does)
            (path / "new.tmp").write_bytes(b"y" * 64)
            os.replace(path / "new.tmp", path / WEIGHTS_FILE)
        lid = catalog.request("a").lora_int_id
        assert lid not in seen
        seen.add(lid)


def test_a_removed_adapter_is_not_found_and_a_recreated_one_is_new(tmp_path: Path) -> None:
    path = _adapter(tmp_path, "a")
    catalog = AdapterCatalog(str(tmp_path))
    old = catalog.request("a")
    shutil.rmtree(path)
    with pytest.raises(AdapterNotFoundError):
        catalog.request("a")
    assert not catalog.has("a") and catalog.available() == []
    _adapter(tmp_path, "a")
    assert catalog.request("a").lora_int_id != old.lora_int_id


@pytest.mark.parametrize("name", ["..", "../a", "a/b", ".hidden", "", "missing"])
def test_names_that_are_no_adapter_directory_are_not_found(tmp_path: Path, name: str) -> None:
    _adapter(tmp_path, "a")
    with pytest.raises(AdapterNotFoundError):
        AdapterCatalog(str(tmp_path)).request(name)
