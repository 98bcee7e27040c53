"""RetinaMNIST from the MedMNIST v2 ``.npz`` files (28 px; 64/128/224 px where available).

The file holds ``{train,val,test}_images`` (N, S, S, 3) uint8 and ``{train,val,test}_labels``
(N, 1): five ordinal grades of diabetic retinopathy, kept in the official splits
(1,080 / 120 / 400).
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import numpy as np

from workbench.data.checksums import RETINAMNIST_MD5, file_digest
from workbench.data.errors import ChecksumMismatch, DataFormatError

CLASS_NAMES = ("0", "1", "2", "3", "4")  # medmnist's label names; ordinal severity grades
SPLITS = ("train", "val", "test")
SIZES = (28, 64, 128, 224)
SUBDIRS = (".", "medmnist", "retinamnist")


def file_name(size: int) -> str:
    """Official file name for a resolution: ``retinamnist.npz`` or ``retinamnist_224.npz``."""
    return "retinamnist.npz" if size == 28 else f"retinamnist_{size}.npz"


def find_file(folder: Path, size: int) -> tuple[Path | None, str]:
    """Locate ``file_name(size)`` in ``folder`` or a common sub-folder."""
    for sub in SUBDIRS:
        p = folder / sub / file_name(size)
        if p.is_file():
            return p, "found"
    return None, f"no {file_name(size)}"


def _size_from_name(path: Path) -> int | None:
    m = re.fullmatch(r"retinamnist(?:_(\d+))?\.npz", path.name)
    return None if m is None else int(m.group(1) or 28)


def read_retinamnist(
    path: Path, size: int | None = None, verify: bool = True
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], str]:
    """Decode and check a RetinaMNIST npz file.

    Args:
        path: The ``.npz`` file.
        size: Expected image side length; ``None`` accepts whatever the file holds.
        verify: Check the official md5 for the file's resolution.

    Returns:
        ``(arrays, note)``: split -> (images uint8 (N, 3, S, S), labels int64 (N,)), and a
        checksum note.

    Raises:
        DataFormatError: Unreadable file, missing key, wrong shape/dtype, labels out of range.
        ChecksumMismatch: md5 differs from the official one.
    """
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DataFormatError(
            f"{path}: not a readable npz file (truncated or corrupted?): {e}"
        ) from e
    arrays = {}
    with z:
        expected_keys = [f"{s}_{k}" for s in SPLITS for k in ("images", "labels")]
        missing = [k for k in expected_keys if k not in z.files]
        if missing:
            raise DataFormatError(
                f"{path}: missing key {missing[0]!r}; found keys {sorted(z.files)}, expected {expected_keys}"
            )
        for split in SPLITS:
            try:
                images, labels = z[f"{split}_images"], z[f"{split}_labels"]
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
                raise DataFormatError(
                    f"{path}: cannot read {split} arrays (truncated or corrupted?): {e}"
                ) from e
            s = size or (images.shape[1] if images.ndim == 4 else 28)
            if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (s, s, 3):
                raise DataFormatError(
                    f"{path}: key '{split}_images' has {images.dtype} shape {images.shape}, "
                    f"expected uint8 (N, {s}, {s}, 3)"
                )
            if labels.shape not in ((len(images), 1), (len(images),)):
                raise DataFormatError(
                    f"{path}: key '{split}_labels' has shape {labels.shape}, expected ({len(images)}, 1)"
                )
            labels = labels.reshape(-1).astype(np.int64)
            if labels.size and (labels.min() < 0 or labels.max() >= len(CLASS_NAMES)):
                raise DataFormatError(f"{path}: key '{split}_labels' has values outside 0..4")
            size = s
            # (N, 3, S, S)
            arrays[split] = (
                np.ascontiguousarray(images.transpose(0, 3, 1, 2)),
                labels,
            )
    note = "checksum not verified (verify=False)"
    if verify:
        expected = RETINAMNIST_MD5.get(_size_from_name(path) or size)
        if expected is None:
            raise ChecksumMismatch(
                str(path), "md5", f"one of {sorted(RETINAMNIST_MD5)} px files", "unknown size"
            )
        actual = file_digest(path, "md5")
        if actual != expected:
            raise ChecksumMismatch(
                str(path),
                "md5",
                expected,
                actual,
                "The file is not the official MedMNIST release; pass verify=False to load it anyway.",
            )
        note = "md5 official"
    return arrays, note
