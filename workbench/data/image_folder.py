"""Image folders ``root/{train,val,test}/<class>/*.{jpg,jpeg,png}``, extracted or in a tar.

Class names are the sorted sub-folder names of ``train/``; labels follow that order.
Files inside a class folder are taken in natural order (``2.png`` before ``10.png``), so
the CIFAR-10 JPEG copy's file number k is the k-th image of its class.
"""

from __future__ import annotations

import io
import re
import tarfile
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import numpy as np
import torch
from tqdm.auto import tqdm

from workbench.data.errors import DataFormatError

SPLITS = ("train", "val", "test")
EXTENSIONS = (".jpg", ".jpeg", ".png")
TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar")

# split -> class -> list of (name for messages, natural sort key, bytes or path)
Listing = dict[str, dict[str, list[tuple[str, tuple, bytes | Path]]]]


def natural_key(name: str) -> tuple:
    """Sort key that orders digit runs by value: ``img2`` < ``img10``."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def is_tar(path: Path) -> bool:
    """Whether ``path`` is a file with a tar suffix."""
    return path.is_file() and path.name.lower().endswith(TAR_SUFFIXES)


def looks_like_image_folder(path: Path) -> bool:
    """Whether ``path/train`` holds at least one class sub-folder."""
    train = path / "train"
    return train.is_dir() and any(d.is_dir() for d in train.iterdir())


def list_folder(root: Path) -> tuple[Listing, list[Path]]:
    """List image files of an extracted folder.

    Returns:
        The listing (split -> class -> files) and the flat list of files (for the cache key).
    """
    listing: Listing = {}
    files = []
    for split in SPLITS:
        d = root / split
        if not d.is_dir():
            continue
        listing[split] = {}
        for cls in sorted(c for c in d.iterdir() if c.is_dir()):
            entries = [p for p in cls.iterdir() if p.is_file() and p.suffix.lower() in EXTENSIONS]
            listing[split][cls.name] = [(str(p), natural_key(p.name), p) for p in entries]
            files += entries
    return listing, files


def list_tar(path: Path) -> Listing:
    """Read every image member of a tar archive in one streaming pass.

    Streaming avoids unpacking tens of thousands of small files to disk: the decoded
    tensors are cached anyway, so the extracted copy would never be read again.
    Members may sit under one top-level folder (``cifar10-jpg/train/...``).
    """
    listing: Listing = defaultdict(lambda: defaultdict(list))
    try:
        with tarfile.open(path, "r:*") as tf:
            for m in tqdm(tf, desc=f"reading {path.name}", unit=" files", disable=None):
                parts = PurePosixPath(m.name).parts
                if not m.isfile() or not m.name.lower().endswith(EXTENSIONS) or len(parts) < 3:
                    continue
                split, cls, fname = parts[-3:]
                if split not in SPLITS:
                    continue
                f = tf.extractfile(m)
                listing[split][cls].append((f"{path}:{m.name}", natural_key(fname), f.read()))
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataFormatError(
            f"{path}: cannot read tar archive (truncated or corrupted?): {e}"
        ) from e
    return {s: dict(sorted(c.items())) for s, c in listing.items()}


def _decoder(channels: int | None) -> Callable[[bytes | Path], np.ndarray]:
    """A function decoding one image file to uint8 ``(C, H, W)``.

    Args:
        channels: 1 (grey), 3 (RGB, alpha dropped) or ``None`` (as stored).

    torchvision's decoder is about twice as fast as PIL on small JPEGs; PIL is the
    fallback for torchvision builds without (or, in future, after removal of) image ops.
    """
    try:
        from torchvision.io import ImageReadMode, decode_image  # ~1.5 s import, so done here
    except ImportError:
        decode_image = None
    if decode_image is not None:
        mode = {None: ImageReadMode.UNCHANGED, 1: ImageReadMode.GRAY, 3: ImageReadMode.RGB}[
            channels
        ]

        def decode(blob: bytes | Path) -> np.ndarray:
            data = blob.read_bytes() if isinstance(blob, Path) else blob
            return decode_image(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode
            ).numpy()

        return decode

    from PIL import Image

    def decode_pil(blob: bytes | Path) -> np.ndarray:
        img = Image.open(blob if isinstance(blob, Path) else io.BytesIO(blob))
        if channels is not None:
            img = img.convert("L" if channels == 1 else "RGB")
        arr = np.asarray(img)
        return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)  # (C, H, W)

    return decode_pil


def _decode_one(
    decode: Callable[[bytes | Path], np.ndarray], name: str, blob: bytes | Path
) -> np.ndarray:
    try:
        return decode(blob)
    except (RuntimeError, OSError, ValueError) as e:  # PIL raises OSError subclasses
        raise DataFormatError(f"{name}: cannot decode image: {e}") from e


def decode_listing(
    listing: Listing, desc: str
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], tuple[str, ...]]:
    """Decode every image of a listing; see ``_decode_listing``."""
    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its image I/O with one warning per call; it still works
        # and is the fastest decoder here, so do not repeat that warning 60,000 times.
        warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities")
        return _decode_listing(listing, desc)


def _decode_listing(
    listing: Listing, desc: str
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], tuple[str, ...]]:
    """Decode every image into one preallocated uint8 array per split.

    All images must share one size. Channels: grayscale when the first training image is
    grayscale, otherwise RGB (alpha dropped), so a folder yields one consistent tensor.

    Returns:
        ``(arrays, class_names)``; arrays: split -> (images uint8 (N, C, H, W), labels int64 (N,)).

    Raises:
        DataFormatError: No ``train`` split, an empty class folder, a split with unknown classes, an undecodable
            file, or images of different sizes.
    """
    if "train" not in listing or not listing["train"]:
        raise DataFormatError(
            f"{desc}: no train/<class>/ folders with {'/'.join(EXTENSIONS)} images"
        )
    class_names = tuple(listing["train"])
    for split, classes in listing.items():
        empty = [c for c, entries in classes.items() if not entries]
        if empty:  # a class with no images would silently shift every label after it
            raise DataFormatError(
                f"{desc}: class folder(s) {', '.join(f'{split}/{c}/' for c in empty)} hold no "
                f"{'/'.join(EXTENSIONS)} images; add images or remove the folder"
            )
    for split, classes in listing.items():
        unknown = sorted(set(classes) - set(class_names))
        if unknown:
            raise DataFormatError(
                f"{desc}: {split}/ has classes {unknown} that train/ does not have"
            )
    first_name, _, first_blob = min(next(iter(listing["train"].values())), key=lambda e: e[1])
    first = _decode_one(_decoder(None), first_name, first_blob)
    chw = (1 if first.shape[0] == 1 else 3, *first.shape[1:])
    decode = _decoder(chw[0])

    arrays = {}
    total = sum(len(v) for c in listing.values() for v in c.values())
    bar = tqdm(total=total, desc=f"decoding {desc}", unit=" img", disable=None)
    for split in (s for s in SPLITS if s in listing):
        entries = [
            (e, class_names.index(c))
            for c, es in listing[split].items()
            for e in sorted(es, key=lambda x: x[1])
        ]
        images = np.empty((len(entries), *chw), dtype=np.uint8)  # (N, C, H, W)
        labels = np.empty(len(entries), dtype=np.int64)
        # One decode call per image: on 2 CPU cores this beat batched list decoding and
        # thread pools (the decoder holds the GIL), about 40 us per 32x32 JPEG.
        for i, ((name, _, blob), label) in enumerate(entries):
            img = _decode_one(decode, name, blob)
            if tuple(img.shape) != chw:
                raise DataFormatError(
                    f"{name}: image is {tuple(img.shape)} (C, H, W) but {first_name} is {chw}; "
                    "all images of a folder dataset must share one size"
                )
            images[i] = img
            labels[i] = label
            bar.update()
        arrays[split] = (images, labels)
    bar.close()
    return arrays, class_names
