"""``load_dataset``: resolve a source, decode it once, then serve it from the cache."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from workbench.data import cifar10, fashion_mnist, retinamnist
from workbench.data.cache import decoded_cache_path, listing_key, load_decoded, save_decoded
from workbench.data.checksums import CIFAR10_JPEG_COPY_SHA256, CIFAR10_TGZ_MD5, file_digest
from workbench.data.dataset import ImageDataset, data_fingerprint, make_image_dataset
from workbench.data.errors import DataFormatError
from workbench.data.image_folder import decode_listing, list_folder, list_tar
from workbench.data.locate import Located, check_name, resolve

# Bump when decoding changes (different pixels or labels from the same files), so old
# cache files are not reused.
DECODER_VERSION = 1

Arrays = dict[str, tuple[np.ndarray, np.ndarray]]


def load_dataset(
    name: str,
    path: str | os.PathLike | None = None,
    download: bool = False,
    *,
    size: int | None = None,
    verify: bool = True,
) -> ImageDataset:
    """Load a dataset into memory as uint8 tensors with its official splits.

    The first load decodes the source files and writes the tensors to the user cache;
    later loads read that cache (keyed by the source files' content, see
    ``workbench.data.cache``) and take about a second even for CIFAR-10.

    Args:
        name: One of ``DATASET_NAMES``.
        path: Explicit file or folder; searched before every other place.
        download: Allow downloading into the user cache when no local copy is found.
        size: RetinaMNIST image side (28, 64, 128, 224); ``None`` means 28, or whatever an
            explicit file holds.
        verify: Check official checksums where known. Turn off only for files you made.

    Returns:
        The dataset; ``dataset.resolution`` lists the places looked and the one used.

    Raises:
        DatasetNotFound: No copy found; the message lists the places looked and the remedies.
        ChecksumMismatch: An official file has the wrong digest (file, expected, actual).
        DataFormatError: A file is truncated, has a bad header, a missing key or a wrong shape.
    """
    located, resolution = resolve(check_name(name), path, download, size)
    digests = {str(p): file_digest(p) for p in located.files}
    if located.files:
        source_key = sorted((Path(p).name, d) for p, d in digests.items())
    else:  # folder of many images: key on the listing, see workbench.data.cache
        source_key = listing_key(located.path, list_folder(located.path)[1])
    key_record = {
        "dataset": name,
        "decoder": DECODER_VERSION,
        "kind": located.kind,
        "source": source_key,
    }
    cache_path, key = decoded_cache_path(name, key_record)

    cached = load_decoded(cache_path, key)
    if cached is not None and (cached[1]["verified"] or not verify):
        arrays, meta = cached
        from_cache = True
    else:
        arrays, display, class_names, note = _decode(name, located, verify, size, digests)
        meta = {
            "display_name": display,
            "class_names": list(class_names),
            "check_note": note,
            "verified": verify,
            "fingerprint": data_fingerprint(arrays, class_names),
        }
        try:
            save_decoded(cache_path, key, arrays, meta)
        except OSError as e:  # a read-only cache must not stop the run, only slow the next one
            warnings.warn(f"could not write decoded-data cache {cache_path}: {e}", stacklevel=2)
        from_cache = False

    fmt = _FORMAT_NAMES[located.kind]
    return make_image_dataset(
        name=name,
        display_name=meta["display_name"],
        arrays=arrays,
        class_names=tuple(meta["class_names"]),
        source=f"{meta['display_name']} from {located.path} [{fmt}; {meta['check_note']}]",
        fingerprint=meta["fingerprint"],
        resolution=resolution,
        from_cache=from_cache,
        cache_file=str(cache_path),
    )


_FORMAT_NAMES = {
    "idx": "official IDX files",
    "batches": "official python batches",
    "batches_tar": "official python batches in a tar",
    "jpeg_folder": "JPEG image folder, re-encoded at quality 75, not the official pixels",
    "jpeg_tar": "JPEG image folder in a tar, re-encoded at quality 75, not the official pixels",
    "npz": "MedMNIST v2 npz",
    "folder": "image folder",
    "tar": "image folder in a tar",
}


def _decode(
    name: str, loc: Located, verify: bool, size: int | None, digests: dict[str, str]
) -> tuple[Arrays, str, tuple[str, ...], str]:
    """Decode a located source: ``(arrays, display name, class names, checksum note)``."""
    if name == "fashion_mnist":
        arrays, note = fashion_mnist.read_fashion_mnist(list(loc.files), verify)
        return arrays, "Fashion-MNIST", fashion_mnist.CLASS_NAMES, note
    if name == "retinamnist":
        arrays, note = retinamnist.read_retinamnist(loc.path, size, verify)
        side = arrays["train"][0].shape[-1]
        return arrays, f"RetinaMNIST ({side} px)", retinamnist.CLASS_NAMES, note
    if loc.kind in ("batches", "batches_tar"):
        if loc.kind == "batches":
            arrays, note = cifar10.read_batches_folder(loc.path, verify)
        else:
            arrays, note = cifar10.read_batches(
                cifar10.read_batches_tar(loc.path), str(loc.path), verify
            )
            if verify and file_digest(loc.path, "md5") == CIFAR10_TGZ_MD5:
                note += "; tar md5 official"
        return arrays, cifar10.OFFICIAL_NAME, cifar10.CLASS_NAMES, note

    listing = list_tar(loc.path) if loc.kind in ("tar", "jpeg_tar") else list_folder(loc.path)[0]
    arrays, class_names = decode_listing(listing, str(loc.path))
    if name == "image_folder":
        return arrays, f"image folder {loc.path.name}", class_names, "no official checksum"
    if class_names != cifar10.CLASS_NAMES:
        raise DataFormatError(
            f"{loc.path}: class folders {list(class_names)} are not CIFAR-10's {list(cifar10.CLASS_NAMES)}"
        )
    if loc.kind == "jpeg_tar" and digests.get(str(loc.path)) == CIFAR10_JPEG_COPY_SHA256:
        note = "sha256 matches the project's offline copy"
    else:
        note = "unverified JPEG copy (no official checksum)"
    return arrays, cifar10.JPEG_COPY_NAME, class_names, note
