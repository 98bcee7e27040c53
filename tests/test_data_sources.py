"""Source resolution order, the not-found error, downloads (faked) and the decoded cache."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from data_fixtures import (
    assert_equal_arrays,
    make_fashion_mnist,
    make_image_folder,
    make_retinamnist,
    md5,
    trust_fashion_mnist,  # noqa: F401 (a fixture)
)

from workbench.data.errors import ChecksumMismatch
from workbench.data import DatasetNotFound, checksums, load_dataset, locate


def test_not_found_lists_every_place_and_remedies(isolated, monkeypatch):
    system = isolated / "usr-share-fm"
    monkeypatch.setattr(locate, "SYSTEM_DIRS", {"fashion_mnist": (system,)})
    monkeypatch.setenv("WORKBENCH_DATA_DIR", str(isolated / "datadir"))
    with pytest.raises(DatasetNotFound) as e:
        load_dataset("fashion_mnist")
    msg = str(e.value)
    kinds = [p.kind for p in e.value.places]
    assert kinds == ["explicit path", "$WORKBENCH_DATA_DIR", "user cache ($WORKBENCH_CACHE_DIR or ~/.cache)",
                     "system-wide", "download"], msg  # fmt: skip
    needles = (str(isolated / "datadir"), str(isolated / "cache"), str(system), "download=False",
               "apt install dataset-fashion-mnist", "--data-path", "WORKBENCH_DATA_DIR", "download=True")  # fmt: skip
    for needle in needles:
        assert needle in msg, f"{needle!r} missing from:\n{msg}"


def test_not_found_when_env_unset_and_image_folder_needs_path(isolated):
    with pytest.raises(DatasetNotFound, match=r"\$WORKBENCH_DATA_DIR: - \(not set\)"):
        load_dataset("retinamnist")
    with pytest.raises(DatasetNotFound, match=r"explicit path: - \(none given\)"):
        load_dataset("image_folder")
    with pytest.raises(ValueError, match=r"unknown dataset 'mnist'; expected one of"):
        load_dataset("mnist")


def test_bad_explicit_path_is_an_error_not_a_fallback(isolated, monkeypatch):
    folder = isolated / "system-fm"
    make_fashion_mnist(folder)
    monkeypatch.setattr(locate, "SYSTEM_DIRS", {"fashion_mnist": (folder,)})
    with pytest.raises(DatasetNotFound) as e:
        load_dataset("fashion_mnist", isolated / "nowhere", verify=False)
    assert [p.kind for p in e.value.places] == ["explicit path"]


def test_order_env_dir_before_system_copy(isolated, monkeypatch):
    env_dir, system = isolated / "datadir", isolated / "system"
    env_data = make_fashion_mnist(env_dir / "fashion-mnist", seed=1)
    make_fashion_mnist(system, seed=2)
    monkeypatch.setattr(locate, "SYSTEM_DIRS", {"fashion_mnist": (system,)})
    monkeypatch.setenv("WORKBENCH_DATA_DIR", str(env_dir))
    ds = load_dataset("fashion_mnist", verify=False)
    assert ds.resolution.used.kind == "$WORKBENCH_DATA_DIR"
    assert_equal_arrays(ds.splits["train"].images.numpy(), env_data["train"][0], "env copy used")
    monkeypatch.delenv("WORKBENCH_DATA_DIR")
    ds = load_dataset("fashion_mnist", verify=False)
    assert ds.resolution.used.kind == "system-wide" and ds.resolution.used.path == str(system)
    assert ds.resolution.describe()[-1].startswith("* system-wide")


def test_download_only_when_allowed_then_found_in_user_cache(isolated, monkeypatch):
    calls = []

    def fake_download(root, size):  # what medmnist would do: put the npz in root
        calls.append((root, size))
        make_retinamnist(root / "retinamnist.npz")

    monkeypatch.setitem(locate.DOWNLOADERS, "retinamnist", fake_download)
    with pytest.raises(DatasetNotFound):
        load_dataset("retinamnist")
    assert calls == []
    ds = load_dataset("retinamnist", download=True, verify=False)
    assert len(calls) == 1 and ds.resolution.used.kind == "download"
    ds = load_dataset("retinamnist", download=True, verify=False)  # now found in the user cache
    assert len(calls) == 1 and ds.resolution.used.kind.startswith("user cache")


def test_download_failure_is_reported(isolated, monkeypatch):
    def offline(root, size):
        raise OSError("Network is unreachable")

    monkeypatch.setitem(locate.DOWNLOADERS, "cifar10", offline)
    with pytest.raises(
        DatasetNotFound, match=r"download: .* \(failed: OSError: Network is unreachable\)"
    ):
        load_dataset("cifar10", download=True)


# ---------------------------------------------------------------- decoded-data cache


def _retina(isolated, monkeypatch):
    path = isolated / "retinamnist.npz"
    make_retinamnist(path)
    monkeypatch.setitem(checksums.RETINAMNIST_MD5, 28, md5(path))
    return path


def test_cache_hit_gives_same_data(isolated, monkeypatch):
    path = _retina(isolated, monkeypatch)
    first = load_dataset("retinamnist", path)
    second = load_dataset("retinamnist", path)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert first.fingerprint == second.fingerprint and first.source == second.source
    assert list(second.splits) == ["train", "val", "test"]
    for k in first.splits:
        assert_equal_arrays(second.splits[k].images.numpy(), first.splits[k].images.numpy(), k)
    assert os.path.dirname(second.cache_file) == str(isolated / "cache" / "decoded")
    assert not list((isolated / "cache" / "decoded").glob("*.tmp")), "temp files left behind"


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "garbage"])
def test_corrupted_cache_is_rebuilt(isolated, monkeypatch, damage):
    path = _retina(isolated, monkeypatch)
    first = load_dataset("retinamnist", path)
    cache = first.cache_file
    raw = bytearray(open(cache, "rb").read())
    if damage == "truncate":
        raw = raw[: len(raw) // 3]
    elif damage == "flip_byte":
        raw[len(raw) // 2] ^= 0xFF  # inside the pixel data
    else:
        raw = b"not a zip"
    open(cache, "wb").write(bytes(raw))
    with pytest.warns(UserWarning, match="unreadable .* rebuilding"):
        again = load_dataset("retinamnist", path)
    assert not again.from_cache and again.fingerprint == first.fingerprint
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt file is healthy: no warning
        assert load_dataset("retinamnist", path).from_cache


def test_changed_source_misses_cache(isolated, monkeypatch):
    path = _retina(isolated, monkeypatch)
    first = load_dataset("retinamnist", path)
    make_retinamnist(path, seed=5)
    monkeypatch.setitem(checksums.RETINAMNIST_MD5, 28, md5(path))
    second = load_dataset("retinamnist", path)
    assert not second.from_cache and second.fingerprint != first.fingerprint


def test_unverified_cache_entry_is_reverified(isolated, monkeypatch):
    path = isolated / "retinamnist.npz"
    make_retinamnist(path)
    assert load_dataset("retinamnist", path, verify=False).source.endswith("(verify=False)]")
    with pytest.raises(ChecksumMismatch):  # the unverified cache entry must not hide this
        load_dataset("retinamnist", path)


def test_folder_cache_key_follows_file_changes(isolated):
    root = isolated / "imgs"
    make_image_folder(root, per_class={"train": 2})
    first = load_dataset("image_folder", root)
    assert load_dataset("image_folder", root).from_cache
    from PIL import Image

    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / "train" / "cat" / "0.png")
    os.utime(root / "train" / "cat" / "0.png", ns=(1, 1))  # new mtime even on coarse clocks
    changed = load_dataset("image_folder", root)
    assert not changed.from_cache and changed.fingerprint != first.fingerprint
