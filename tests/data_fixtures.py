"""Small on-disk datasets in the real formats, built in tmp_path for the data tests.

Nothing here touches the network, the user's cache or /work/shared: ``isolated`` (conftest.py) points
the cache at tmp_path, clears ``$WORKBENCH_DATA_DIR``, hides system-wide copies and makes
any download attempt fail loudly.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from workbench.data import checksums

FASHION_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
CIFAR_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)


def md5(path: Path) -> str:
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode a uint8 array in IDX format (dtype code 0x08)."""
    header = b"\x00\x00\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def make_fashion_mnist(
    folder: Path, n_train: int = 200, n_test: int = 50, seed: int = 0, gz: bool = True
):
    """Write the four IDX files; return {split: (images (N,1,28,28), labels (N,))}."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        rng.shuffle(labels)
        for base, arr in zip(FASHION_FILES[split], (images, labels)):
            data = idx_bytes(arr)
            if gz:
                (folder / f"{base}.gz").write_bytes(gzip.compress(data, mtime=0))
            else:
                (folder / base).write_bytes(data)
        out[split] = (images[:, None], labels.astype(np.int64))
    return out


def trust_fashion_mnist(monkeypatch, folder: Path) -> None:
    """Make the generated files 'official': put their md5s in the checksum tables."""
    for base in (b for pair in FASHION_FILES.values() for b in pair):
        gz = folder / f"{base}.gz"
        if gz.exists():
            monkeypatch.setitem(checksums.FASHION_MNIST_GZ_MD5, gz.name, md5(gz))
            raw = gzip.decompress(gz.read_bytes())
        else:
            raw = (folder / base).read_bytes()
        monkeypatch.setitem(checksums.FASHION_MNIST_RAW_MD5, base, hashlib.md5(raw).hexdigest())


def make_retinamnist(path: Path, size: int = 28, counts=(40, 10, 20), seed: int = 0, **overrides):
    """Write a MedMNIST-format npz; ``overrides`` replace or (value None) drop keys."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, n in zip(("train", "val", "test"), counts):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % 5).astype(np.uint8)[:, None]
    for k, v in overrides.items():
        if v is None:
            arrays.pop(k)
        else:
            arrays[k] = v
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return arrays


def make_cifar_batches(folder: Path, per_batch: int = 20, seed: int = 0):
    """Write cifar-10-batches-py with small batches; return {split: (images, labels)}."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = {"train": ([], []), "test": ([], [])}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(x) for x in rng.integers(0, 10, per_batch)]
        entry = {
            b"batch_label": name.encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": [b"x.png"] * per_batch,
        }
        (folder / name).write_bytes(pickle.dumps(entry, protocol=2))
        split = "test" if name == "test_batch" else "train"
        out[split][0].append(data.reshape(-1, 3, 32, 32))
        out[split][1].append(np.array(labels, dtype=np.int64))
    return {k: (np.concatenate(v[0]), np.concatenate(v[1])) for k, v in out.items()}


def trust_cifar_batches(monkeypatch, folder: Path) -> None:
    for name in list(checksums.CIFAR10_BATCH_MD5):
        monkeypatch.setitem(checksums.CIFAR10_BATCH_MD5, name, md5(folder / name))


def make_image_folder(
    root: Path,
    classes=("cat", "dog", "emu"),
    per_class=None,
    fmt: str = "png",
    size: int = 8,
    mode: str = "RGB",
    seed: int = 0,
):
    """Write root/<split>/<class>/<k>.<fmt>; return {split: (images (N,C,H,W), labels)} in
    loader order (class-major, file number ascending). Images are smooth so JPEG stays close."""
    per_class = per_class or {"train": 4, "test": 2}
    rng = np.random.default_rng(seed)
    out = {}
    for split, n in per_class.items():
        imgs, labels = [], []
        for label, cls in enumerate(classes):
            d = root / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for k in range(n):
                base = rng.integers(40, 216, 3 if mode == "RGB" else 1).astype(np.float64)
                ramp = np.linspace(-30, 30, size)
                arr = np.clip(
                    base[None, None, :] + ramp[:, None, None] + ramp[None, :, None] * 0.5, 0, 255
                )
                arr = arr.astype(np.uint8)  # (H, W, C)
                img = Image.fromarray(arr if mode == "RGB" else arr[:, :, 0], mode)
                # Unpadded numbers on purpose: 10 must sort after 9 (natural order).
                img.save(d / f"{k}.{fmt}", quality=95) if fmt == "jpg" else img.save(
                    d / f"{k}.{fmt}"
                )
                imgs.append(arr.transpose(2, 0, 1))
                labels.append(label)
        out[split] = (np.stack(imgs), np.array(labels, dtype=np.int64))
    return out


def make_tar(src: Path, tar_path: Path, prefix: str = "") -> Path:
    """Pack the contents of ``src`` (optionally under a top folder ``prefix``) as .tar.gz."""
    with tarfile.open(tar_path, "w:gz") as tf:
        for p in sorted(src.rglob("*")):
            tf.add(p, arcname=str(Path(prefix) / p.relative_to(src)), recursive=False)
    return tar_path


def max_diff(a, b) -> float:
    """Largest absolute difference, for assertion messages."""
    a = torch.as_tensor(np.asarray(a) if not torch.is_tensor(a) else a).double()
    b = torch.as_tensor(np.asarray(b) if not torch.is_tensor(b) else b).double()
    return float((a - b).abs().max()) if a.numel() else 0.0


def assert_equal_arrays(actual, expected, what: str = "") -> None:
    """Exact equality with the max difference in the message."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.array_equal(actual, expected), f"{what}: max |diff| = {max_diff(actual, expected)}"


# fmt: skip
__all__ = [
    "CIFAR_CLASSES",
    "FASHION_FILES",
    "assert_equal_arrays",
    "io",
    "make_cifar_batches",
    "make_fashion_mnist",
    "make_image_folder",
    "make_retinamnist",
    "make_tar",
    "max_diff",
    "md5",
    "trust_cifar_batches",
    "trust_fashion_mnist",
]
