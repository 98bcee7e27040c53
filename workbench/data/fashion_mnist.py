"""Fashion-MNIST from the official IDX files (``.gz`` or decompressed).

IDX layout: two zero bytes, a dtype code, the number of dimensions, then one big-endian
uint32 per dimension, then the data in C order.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from workbench.data.checksums import FASHION_MNIST_GZ_MD5, FASHION_MNIST_RAW_MD5, bytes_digest
from workbench.data.errors import ChecksumMismatch, DataFormatError

# fmt: skip
CLASS_NAMES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
# Split -> (images file, labels file), base names without ".gz".
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# Sub-folders where the four files are commonly found (torchvision downloads to FashionMNIST/raw).
SUBDIRS = (".", "fashion-mnist", "fashion_mnist", "FashionMNIST/raw", "FashionMNIST")

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def parse_idx(data: bytes, path: str | Path) -> np.ndarray:
    """Parse IDX bytes into an array.

    Args:
        data: The decompressed file content.
        path: File name, used in error messages.

    Returns:
        Array with the dims and dtype the header declares.

    Raises:
        DataFormatError: Bad magic number, unknown dtype code, or a size that does not
            match the header (truncated or padded file).
    """
    if len(data) < 4:
        raise DataFormatError(
            f"{path}: truncated IDX file ({len(data)} bytes, the header alone needs 4)"
        )
    if data[:2] != b"\x00\x00" or data[2] not in _IDX_DTYPES:
        raise DataFormatError(
            f"{path}: bad IDX magic number 0x{data[:4].hex()} "
            f"(expected 0x0000 then a dtype code in {sorted(hex(c) for c in _IDX_DTYPES)})"
        )
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataFormatError(
            f"{path}: truncated IDX header ({len(data)} bytes, need {header} for {ndim} dims)"
        )
    dims = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    found = len(data) - header
    if found != expected:
        what = "truncated" if found < expected else "has trailing bytes"
        raise DataFormatError(
            f"{path}: IDX file {what}: header declares shape {dims} ({expected} data bytes), found {found}"
        )
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)


def read_file_bytes(path: Path) -> bytes:
    """File content, decompressed when the name ends in ``.gz``; clear error if truncated."""
    raw = path.read_bytes()
    if path.suffix != ".gz":
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataFormatError(
            f"{path}: cannot decompress gzip file (truncated or corrupted): {e}"
        ) from e


def find_files(folder: Path) -> tuple[list[Path] | None, str]:
    """Locate the four IDX files in ``folder`` or a common sub-folder.

    Returns:
        ``(files, note)``: the four paths in ``FILES`` order, or ``None`` and what is missing.
    """
    missing_note = "no such folder"
    for sub in SUBDIRS:
        d = folder / sub
        if not d.is_dir():
            continue
        found, missing = [], []
        for base in (b for pair in FILES.values() for b in pair):
            p = next((q for q in (d / f"{base}.gz", d / base) if q.is_file()), None)
            (found if p else missing).append(p or base)
        if not missing:
            return found, "found"
        if sub == ".":
            missing_note = f"missing {', '.join(map(str, missing))}"
    return None, missing_note


def verify_md5(path: Path, raw: bytes) -> str:
    """Check one file against the official md5 of the ``.gz`` or of its decompressed bytes.

    Returns:
        A short note for the source string.

    Raises:
        ChecksumMismatch: Neither digest matches.
    """
    base = path.name.removesuffix(".gz")
    raw_expected = FASHION_MNIST_RAW_MD5[base]
    if path.suffix == ".gz" and bytes_digest(path.read_bytes()) == FASHION_MNIST_GZ_MD5[path.name]:
        return "gz md5 official"
    raw_actual = bytes_digest(raw)
    if raw_actual != raw_expected:
        raise ChecksumMismatch(
            str(path),
            "md5",
            f"{raw_expected} (decompressed content)",
            raw_actual,
            "The file is not the official Fashion-MNIST release; pass verify=False to load it anyway.",
        )
    # A re-compressed .gz (e.g. Debian's package) still holds the official bytes.
    return "md5 of decompressed content official"


def read_fashion_mnist(
    files: list[Path], verify: bool = True
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], str]:
    """Decode the four IDX files found by ``find_files``.

    Returns:
        ``(arrays, note)``: split -> (images uint8 (N, 1, 28, 28), labels int64 (N,)), and a
        checksum note.
    """
    by_base = {p.name.removesuffix(".gz"): p for p in files}
    arrays, notes = {}, set()
    for split, (img_base, lbl_base) in FILES.items():
        parsed = []
        for base, ndim in ((img_base, 3), (lbl_base, 1)):
            path = by_base[base]
            raw = read_file_bytes(path)
            if verify:
                notes.add(verify_md5(path, raw))
            arr = parse_idx(raw, path)
            if arr.ndim != ndim or arr.dtype != np.uint8:
                raise DataFormatError(
                    f"{path}: expected {ndim}-D uint8 IDX data, found {arr.ndim}-D {arr.dtype}"
                )
            parsed.append(arr)
        images, labels = parsed
        if len(images) != len(labels):
            raise DataFormatError(
                f"{by_base[img_base]} has {len(images)} images but {by_base[lbl_base]} has {len(labels)} labels"
            )
        if labels.size and labels.max() >= len(CLASS_NAMES):
            raise DataFormatError(
                f"{by_base[lbl_base]}: label {labels.max()} outside 0..{len(CLASS_NAMES) - 1}"
            )
        arrays[split] = (images[:, None].copy(), labels.astype(np.int64))  # (N, 1, H, W)
    note = "; ".join(sorted(notes)) if verify else "checksums not verified (verify=False)"
    return arrays, note
