"""User cache: downloaded raw files and decoded uint8 tensors.

Layout under ``cache_dir()``::

    downloads/<dataset>/...            raw files fetched with download=True
    decoded/<dataset>-<key[:24]>.npz   decoded tensors, one file per distinct source

Cache key. A decoded file is keyed by the sha256 of a JSON record holding the dataset
name, the decoder version and a key for the source files:

- single files (npz, IDX .gz, CIFAR pickles, tar archives): sha256 of the full content.
  These are at most a few hundred MB, hashed at about 1 GB/s, so this stays cheap and
  can never serve stale data after a file is replaced in place;
- folders of many small images: sha256 of the sorted (relative path, size, mtime_ns)
  listing. Reading 60,000 files just to hash them would cost as much as decoding them;
  any edit, addition, removal or rename changes the listing.

The decoded file stores its own fingerprint; a load recomputes it, so a truncated or
bit-flipped cache file is detected, reported as a warning, and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from workbench.atomic import atomic_write
from workbench.data.dataset import data_fingerprint

CACHE_ENV = "WORKBENCH_CACHE_DIR"
_CACHE_FORMAT = 1


def cache_dir() -> Path:
    """The user cache folder: ``$WORKBENCH_CACHE_DIR``, else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, plus ``glassbox-workbench``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "glassbox-workbench"


def downloads_dir(name: str) -> Path:
    """Folder where ``download=True`` puts the raw files of dataset ``name``."""
    return cache_dir() / "downloads" / name


def listing_key(root: Path, files: list[Path]) -> str:
    """sha256 over the (relative path, size, mtime_ns) of each file; see module docstring."""
    h = hashlib.sha256()
    for p in sorted(files):
        st = p.stat()
        h.update(f"{p.relative_to(root).as_posix()}\x1f{st.st_size}\x1f{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def decoded_cache_path(name: str, key_record: Mapping[str, object]) -> tuple[Path, str]:
    """Path of the decoded-cache file for a source, and the full key it must contain."""
    key = hashlib.sha256(json.dumps(key_record, sort_keys=True).encode()).hexdigest()
    return cache_dir() / "decoded" / f"{name}-{key[:24]}.npz", key


def save_decoded(
    path: Path,
    key: str,
    arrays: Mapping[str, tuple[np.ndarray, np.ndarray]],
    meta: Mapping[str, object],
) -> None:
    """Write decoded arrays atomically: temp file in the same folder, fsync, rename.

    A crash mid-write leaves at worst a stray ``*.tmp`` file, never a half-written cache
    file under the final name.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    record = dict(meta, format=_CACHE_FORMAT, key=key, splits=list(arrays))
    payload = {"meta": np.array(json.dumps(record))}
    for split, (images, labels) in arrays.items():
        payload[f"{split}_images"] = images
        payload[f"{split}_labels"] = labels
    atomic_write(path, lambda f: np.savez(f, **payload))


def load_decoded(
    path: Path, key: str
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, object]] | None:
    """Read a decoded-cache file; ``None`` when absent, stale or corrupted.

    Corruption (unreadable zip, missing array, wrong key, fingerprint mismatch) gives a
    warning naming the file; the caller then rebuilds and overwrites it.
    """
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != _CACHE_FORMAT or meta.get("key") != key:
                raise ValueError("cache key or format does not match")
            arrays = {s: (z[f"{s}_images"], z[f"{s}_labels"]) for s in meta["splits"]}
        fp = data_fingerprint(arrays, tuple(meta["class_names"]))
        if fp != meta["fingerprint"]:
            raise ValueError(
                f"content fingerprint {fp[:12]} != stored {str(meta['fingerprint'])[:12]}"
            )
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        warnings.warn(
            f"Decoded-data cache {path} is unreadable ({e}); rebuilding it.", stacklevel=3
        )
        return None
    return arrays, meta
