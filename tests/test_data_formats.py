"""Reading each on-disk format: values, checksums, and clear errors for bad files."""

from __future__ import annotations

import gzip
import shutil

import numpy as np
import pytest
from data_fixtures import (
    CIFAR_CLASSES,
    assert_equal_arrays,
    make_cifar_batches,
    make_fashion_mnist,
    make_image_folder,
    make_retinamnist,
    make_tar,
    max_diff,
    md5,
    trust_cifar_batches,
    trust_fashion_mnist,
)

from workbench.data import ChecksumMismatch, DataFormatError, checksums, load_dataset
from workbench.data.fashion_mnist import parse_idx

# ---------------------------------------------------------------- IDX / Fashion-MNIST


def test_parse_idx_roundtrip_and_errors(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    data = b"\x00\x00\x08\x03" + b"".join(d.to_bytes(4, "big") for d in (2, 3, 4)) + arr.tobytes()
    assert_equal_arrays(parse_idx(data, "x"), arr, "idx")
    with pytest.raises(DataFormatError, match=r"bad.idx: bad IDX magic number 0x12340803"):
        parse_idx(b"\x12\x34" + data[2:], "bad.idx")
    msg = r"short.idx: IDX file truncated: header declares shape \(2, 3, 4\) \(24 data bytes\), found 20"
    with pytest.raises(DataFormatError, match=msg):
        parse_idx(data[:-4], "short.idx")
    with pytest.raises(DataFormatError, match="truncated IDX header"):
        parse_idx(data[:9], "h.idx")


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_loads_exact_values(isolated, monkeypatch, gz):
    folder = isolated / "fm"
    expected = make_fashion_mnist(folder, gz=gz)
    trust_fashion_mnist(monkeypatch, folder)
    ds = load_dataset("fashion_mnist", folder)
    assert list(ds.splits) == ["train", "test"]
    for split, (images, labels) in expected.items():
        assert_equal_arrays(ds.splits[split].images.numpy(), images, f"{split} images")
        assert_equal_arrays(ds.splits[split].labels.numpy(), labels, f"{split} labels")
    assert ds.display_name == "Fashion-MNIST" and ds.class_names[0] == "T-shirt/top"
    assert "official" in ds.source and str(folder) in ds.source


def test_fashion_mnist_recompressed_gz_verified_by_content(isolated, monkeypatch):
    """Like Debian's package: other gzip bytes, same decompressed content -> accepted."""
    folder = isolated / "fm"
    make_fashion_mnist(folder)
    trust_fashion_mnist(monkeypatch, folder)
    for p in folder.glob("*.gz"):  # re-compress with another header and level
        p.write_bytes(gzip.compress(gzip.decompress(p.read_bytes()), compresslevel=1, mtime=12345))
    ds = load_dataset("fashion_mnist", folder)
    assert "md5 of decompressed content official" in ds.source


def test_fashion_mnist_checksum_mismatch_names_file(isolated, monkeypatch):
    folder = isolated / "fm"
    make_fashion_mnist(folder)
    trust_fashion_mnist(monkeypatch, folder)
    monkeypatch.setitem(checksums.FASHION_MNIST_GZ_MD5, "train-labels-idx1-ubyte.gz", "0" * 32)
    monkeypatch.setitem(checksums.FASHION_MNIST_RAW_MD5, "train-labels-idx1-ubyte", "1" * 32)
    with pytest.raises(ChecksumMismatch) as e:
        load_dataset("fashion_mnist", folder)
    assert e.value.path.endswith("train-labels-idx1-ubyte.gz")
    assert "1" * 32 in str(e.value) and e.value.actual in str(e.value)
    assert load_dataset("fashion_mnist", folder, verify=False).splits["train"].labels.shape == (
        200,
    )


def test_fashion_mnist_truncated_gz(isolated, monkeypatch):
    folder = isolated / "fm"
    make_fashion_mnist(folder)
    p = folder / "t10k-images-idx3-ubyte.gz"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(
        DataFormatError, match=r"t10k-images-idx3-ubyte.gz: cannot decompress gzip file \(truncated"
    ):
        load_dataset("fashion_mnist", folder, verify=False)


def test_fashion_mnist_count_mismatch(isolated, monkeypatch):
    folder = isolated / "fm"
    make_fashion_mnist(folder)
    p = folder / "train-labels-idx1-ubyte.gz"
    labels = np.zeros(7, np.uint8)
    p.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + (7).to_bytes(4, "big") + labels.tobytes()))
    with pytest.raises(
        DataFormatError, match="has 200 images but .*train-labels-idx1-ubyte.gz has 7 labels"
    ):
        load_dataset("fashion_mnist", folder, verify=False)


# ---------------------------------------------------------------- RetinaMNIST npz


def test_retinamnist_loads_official_splits(isolated, monkeypatch):
    path = isolated / "retinamnist.npz"
    arrays = make_retinamnist(path)
    monkeypatch.setitem(checksums.RETINAMNIST_MD5, 28, md5(path))
    ds = load_dataset("retinamnist", path)
    assert {k: len(v) for k, v in ds.splits.items()} == {"train": 40, "val": 10, "test": 20}
    assert_equal_arrays(
        ds.splits["val"].images.numpy(), arrays["val_images"].transpose(0, 3, 1, 2), "val images"
    )
    assert_equal_arrays(
        ds.splits["test"].labels.numpy(), arrays["test_labels"][:, 0], "test labels"
    )
    assert (
        ds.display_name == "RetinaMNIST (28 px)"
        and ds.num_classes == 5
        and "md5 official" in ds.source
    )


def test_retinamnist_size_picks_file_and_md5(isolated, monkeypatch):
    path = isolated / "data" / "retinamnist_64.npz"
    make_retinamnist(path, size=64, counts=(5, 5, 5))
    monkeypatch.setitem(checksums.RETINAMNIST_MD5, 64, md5(path))
    ds = load_dataset("retinamnist", isolated / "data", size=64)
    assert ds.splits["train"].images.shape == (5, 3, 64, 64)
    monkeypatch.setitem(checksums.RETINAMNIST_MD5, 64, "f" * 32)
    shutil.rmtree(isolated / "cache")
    with pytest.raises(
        ChecksumMismatch, match=rf"retinamnist_64.npz: expected {'f' * 32}, got {md5(path)}"
    ):
        load_dataset("retinamnist", path)


def test_retinamnist_wrong_shape_names_key(isolated):
    path = isolated / "retinamnist.npz"
    make_retinamnist(path, val_images=np.zeros((10, 28, 28), np.uint8))
    msg = r"key 'val_images' has uint8 shape \(10, 28, 28\), expected uint8 \(N, 28, 28, 3\)"
    with pytest.raises(DataFormatError, match=msg):
        load_dataset("retinamnist", path, verify=False)


def test_retinamnist_missing_key_and_truncated(isolated):
    path = isolated / "retinamnist.npz"
    make_retinamnist(path, test_labels=None)
    with pytest.raises(DataFormatError, match=r"retinamnist.npz: missing key 'test_labels'"):
        load_dataset("retinamnist", path, verify=False)
    make_retinamnist(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataFormatError, match=r"retinamnist.npz: .*truncated or corrupted"):
        load_dataset("retinamnist", path, verify=False)


def test_retinamnist_label_shape_error(isolated):
    path = isolated / "retinamnist.npz"
    make_retinamnist(path, train_labels=np.zeros((40, 2), np.uint8))
    with pytest.raises(
        DataFormatError, match=r"key 'train_labels' has shape \(40, 2\), expected \(40, 1\)"
    ):
        load_dataset("retinamnist", path, verify=False)


# ---------------------------------------------------------------- CIFAR-10


def test_cifar_batches_folder_and_tar(isolated, monkeypatch):
    folder = isolated / "d" / "cifar-10-batches-py"
    expected = make_cifar_batches(folder)
    trust_cifar_batches(monkeypatch, folder)
    for path in (
        folder,
        folder.parent,
        make_tar(folder, isolated / "cifar-10-python.tar.gz", "cifar-10-batches-py"),
    ):
        ds = load_dataset("cifar10", path)
        assert ds.display_name == "CIFAR-10" and ds.class_names == CIFAR_CLASSES, path
        for split, (images, labels) in expected.items():
            assert_equal_arrays(ds.splits[split].images.numpy(), images, f"{path} {split}")
            assert_equal_arrays(ds.splits[split].labels.numpy(), labels, f"{path} {split} labels")


def test_cifar_batch_checksum_and_corruption(isolated, monkeypatch):
    folder = isolated / "cifar-10-batches-py"
    make_cifar_batches(folder)
    trust_cifar_batches(monkeypatch, folder)
    monkeypatch.setitem(checksums.CIFAR10_BATCH_MD5, "data_batch_3", "a" * 32)
    with pytest.raises(ChecksumMismatch, match=r"cifar-10-batches-py/data_batch_3: expected a{32}"):
        load_dataset("cifar10", folder)
    (folder / "data_batch_2").write_bytes((folder / "data_batch_2").read_bytes()[:100])
    with pytest.raises(DataFormatError, match=r"data_batch_2: not a CIFAR-10 python batch"):
        load_dataset("cifar10", folder, verify=False)


@pytest.mark.parametrize("as_tar", [False, True])
def test_cifar_jpeg_copy_is_labelled(isolated, as_tar):
    root = isolated / "cifar10-jpg"
    expected = make_image_folder(
        root, classes=CIFAR_CLASSES, per_class={"train": 3, "test": 1}, fmt="jpg", size=32
    )
    path = make_tar(root, isolated / "c.tar.gz") if as_tar else root
    ds = load_dataset("cifar10", path)
    assert ds.display_name == "CIFAR-10 (JPEG copy)" and ds.name == "cifar10"
    assert "CIFAR-10 (JPEG copy)" in ds.source and "not the official pixels" in ds.source
    assert "unverified" in ds.source  # not the project's tar, so no checksum claim
    for split, (images, labels) in expected.items():
        assert_equal_arrays(ds.splits[split].labels.numpy(), labels, split)
        diff = max_diff(ds.splits[split].images.numpy(), images)
        assert diff <= 12, f"JPEG q95 decode of smooth images: max |diff| {diff} > 12"


def test_cifar_jpeg_copy_wrong_classes(isolated):
    make_image_folder(isolated / "x", classes=("a", "b"))
    with pytest.raises(DataFormatError, match=r"class folders \['a', 'b'\] are not CIFAR-10's"):
        load_dataset("cifar10", isolated / "x")


# ---------------------------------------------------------------- image folders


def test_image_folder_png_exact_with_val_and_natural_order(isolated):
    root = isolated / "imgs"
    expected = make_image_folder(root, per_class={"train": 11, "val": 2, "test": 1})
    ds = load_dataset("image_folder", root)
    assert ds.class_names == ("cat", "dog", "emu") and list(ds.splits) == ["train", "val", "test"]
    for split, (images, labels) in expected.items():  # PNG is lossless: exact
        assert_equal_arrays(ds.splits[split].images.numpy(), images, split)
        assert_equal_arrays(ds.splits[split].labels.numpy(), labels, split)


def test_image_folder_grayscale_and_tar(isolated):
    root = isolated / "gray"
    expected = make_image_folder(root, mode="L", per_class={"train": 2})
    ds = load_dataset("image_folder", make_tar(root, isolated / "g.tar.gz", prefix="top"))
    assert ds.splits["train"].images.shape == (6, 1, 8, 8)
    assert_equal_arrays(ds.splits["train"].images.numpy(), expected["train"][0], "gray")


def test_image_folder_size_mismatch_names_file(isolated):
    root = isolated / "imgs"
    make_image_folder(root, per_class={"train": 2})
    from PIL import Image

    Image.new("RGB", (9, 8)).save(root / "train" / "dog" / "5.png")
    with pytest.raises(
        DataFormatError, match=r"dog/5.png: image is \(3, 8, 9\) .* all images .* share one size"
    ):
        load_dataset("image_folder", root)


def test_image_folder_unknown_class_and_undecodable(isolated):
    root = isolated / "imgs"
    make_image_folder(root, per_class={"train": 2, "test": 1})
    (root / "test" / "yak").mkdir()
    (root / "test" / "yak" / "0.png").write_bytes(b"not a png")
    with pytest.raises(
        DataFormatError, match=r"test/ has classes \['yak'\] that train/ does not have"
    ):
        load_dataset("image_folder", root)
    (root / "test" / "yak" / "0.png").rename(root / "test" / "cat" / "9.png")
    (root / "test" / "yak").rmdir()
    with pytest.raises(DataFormatError, match=r"cat/9.png: cannot decode image"):
        load_dataset("image_folder", root)
