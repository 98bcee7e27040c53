"""CIFAR-10: the official python batches, or the offline JPEG image-folder copy.

Official format: folder ``cifar-10-batches-py`` with ``data_batch_1..5`` and ``test_batch``
(pickled dicts of numpy arrays), or the ``cifar-10-python.tar.gz`` archive holding it.

JPEG copy: ``train/<class>/NNNN.jpg`` and ``test/<class>/NNNN.jpg``, a folder or a tar. Its
pixels are re-encoded JPEG (quality 75, PSNR about 30 dB), so it is always labelled
"CIFAR-10 (JPEG copy)" and never passed off as official CIFAR-10.
"""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path, PurePosixPath

import numpy as np

from workbench.data.checksums import CIFAR10_BATCH_MD5, bytes_digest
from workbench.data.errors import ChecksumMismatch, DataFormatError
from workbench.data.image_folder import is_tar, looks_like_image_folder

# fmt: skip
CLASS_NAMES = (
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
OFFICIAL_NAME = "CIFAR-10"
JPEG_COPY_NAME = "CIFAR-10 (JPEG copy)"
BATCHES_DIR = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCHES = ("test_batch",)
# Names to try inside a data folder, official format first.
CANDIDATES = (BATCHES_DIR, "cifar-10-python.tar.gz", "cifar10-jpg", "cifar10-jpg.tar.gz")


def locate(path: Path) -> tuple[str | None, Path | None, str]:
    """Classify a path as CIFAR-10 official batches, official tar, JPEG folder or JPEG tar.

    Args:
        path: A file or folder (the batches folder itself, a folder containing it, an
            extracted JPEG copy, or a tar of either).

    Returns:
        ``(kind, path, note)``: kind is ``"batches"``, ``"batches_tar"``, ``"jpeg_folder"``,
        ``"jpeg_tar"`` or ``None`` when nothing usable is there.
    """
    if is_tar(path):
        return ("batches_tar" if _tar_has_batches(path) else "jpeg_tar"), path, "found"
    if not path.is_dir():
        return None, None, "no such file or folder"
    if (path / "data_batch_1").is_file():
        return "batches", path, "found"
    if looks_like_image_folder(path):
        return "jpeg_folder", path, "found"
    for name in CANDIDATES:
        kind, p, _ = locate(path / name) if (path / name).exists() else (None, None, "")
        if kind:
            return kind, p, "found"
    return None, None, f"none of {', '.join(CANDIDATES)}"


def _tar_has_batches(path: Path) -> bool:
    """Whether the first file member of a tar is part of the official batches folder."""
    try:
        with tarfile.open(path, "r:*") as tf:
            for m in tf:
                if m.isfile():
                    return BATCHES_DIR in PurePosixPath(m.name).parts
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataFormatError(
            f"{path}: cannot read tar archive (truncated or corrupted?): {e}"
        ) from e
    return False


def read_batches_tar(path: Path) -> dict[str, bytes]:
    """Batch name -> pickle bytes, read from ``cifar-10-python.tar.gz``."""
    out = {}
    try:
        with tarfile.open(path, "r:*") as tf:
            for m in tf:
                name = PurePosixPath(m.name).name
                if m.isfile() and name in CIFAR10_BATCH_MD5:
                    out[name] = tf.extractfile(m).read()
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataFormatError(
            f"{path}: cannot read tar archive (truncated or corrupted?): {e}"
        ) from e
    return out


def read_batches(
    blobs: dict[str, bytes], where: str, verify: bool = True
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], str]:
    """Decode the official python batches.

    Args:
        blobs: Batch file name -> file bytes (all of ``data_batch_1..5`` and ``test_batch``).
        where: Folder or archive name, for messages.
        verify: Check each batch against its official md5.

    Returns:
        ``(arrays, note)``: train/test -> (images uint8 (N, 3, 32, 32), labels int64 (N,)).
    """
    arrays = {}
    for split, names in (("train", TRAIN_BATCHES), ("test", TEST_BATCHES)):
        images, labels = [], []
        for name in names:
            if name not in blobs:
                raise DataFormatError(f"{where}: missing CIFAR-10 batch file {name!r}")
            path = f"{where}/{name}"
            if verify:
                actual = bytes_digest(blobs[name], "md5")
                if actual != CIFAR10_BATCH_MD5[name]:
                    raise ChecksumMismatch(
                        path,
                        "md5",
                        CIFAR10_BATCH_MD5[name],
                        actual,
                        "Not the official CIFAR-10 batch; pass verify=False to load it anyway.",
                    )
            try:
                # Official batches are data-only dicts of numpy arrays and lists.
                entry = pickle.load(io.BytesIO(blobs[name]), encoding="bytes")
                data, lbl = entry[b"data"], entry[b"labels"]
            except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as e:
                raise DataFormatError(
                    f"{path}: not a CIFAR-10 python batch (truncated or corrupted?): {e!r}"
                ) from e
            data = np.asarray(data)
            if (
                data.dtype != np.uint8
                or data.ndim != 2
                or data.shape[1] != 3 * 32 * 32
                or len(lbl) != len(data)
            ):
                raise DataFormatError(
                    f"{path}: b'data' is {data.dtype} {data.shape} with {len(lbl)} labels, "
                    "expected uint8 (N, 3072) with N labels"
                )
            images.append(data.reshape(-1, 3, 32, 32))  # (N, C, H, W): rows are R, G, B planes
            labels.append(np.asarray(lbl, dtype=np.int64))
        lab = np.concatenate(labels)
        if lab.size and (lab.min() < 0 or lab.max() > 9):
            raise DataFormatError(f"{where}: {split} labels outside 0..9")
        arrays[split] = (np.concatenate(images), lab)
    note = "md5 official" if verify else "checksums not verified (verify=False)"
    return arrays, note


def read_batches_folder(
    folder: Path, verify: bool = True
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], str]:
    """Decode ``cifar-10-batches-py`` from disk."""
    blobs = {
        n: (folder / n).read_bytes() for n in TRAIN_BATCHES + TEST_BATCHES if (folder / n).is_file()
    }
    return read_batches(blobs, str(folder), verify)


def batch_files(folder: Path) -> list[Path]:
    """The six batch files of a batches folder (for the cache key)."""
    return [folder / n for n in TRAIN_BATCHES + TEST_BATCHES if (folder / n).is_file()]
