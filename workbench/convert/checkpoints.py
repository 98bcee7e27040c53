"""Pinned checkpoints and safe weight loading.

Weights come only from safetensors files or ``torch.load(weights_only=True)``; a pickle
that needs code execution is refused. A pinned checkpoint is verified against the sha256
in the lock file before a single tensor is read.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from workbench.atomic import atomic_write_bytes  # noqa: F401  (re-exported: callers import it from here)

LOCK_PATH = Path(__file__).with_name("pinned_checkpoints.json")
WEIGHT_FILE_NAMES = ("model.safetensors", "pytorch_model.bin", "model.pt", "model.pth")


class CheckpointError(ValueError):
    """A weight file is missing, corrupted, unsafe or not the pinned one."""


@dataclass(frozen=True)
class PinnedCheckpoint:
    name: str
    architecture: str
    hub_repo: str
    filename: str
    revision: str | None
    size_bytes: int | None
    sha256: str | None

    @property
    def is_pinned(self) -> bool:
        return bool(self.revision and self.sha256)


def read_lock(path: Path = LOCK_PATH) -> dict[str, PinnedCheckpoint]:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read the checkpoint lock file {path}: {err}") from err
    return {
        name: PinnedCheckpoint(name=name, **entry) for name, entry in raw["checkpoints"].items()
    }


def write_lock(entries: Mapping[str, PinnedCheckpoint], path: Path = LOCK_PATH) -> None:
    body = {
        "comment": "Pinned pretrained checkpoints. Update with `workbench pin NAME` on a connected machine.",
        "checkpoints": {
            name: {k: v for k, v in vars(entry).items() if k != "name"}
            for name, entry in sorted(entries.items())
        },
    }
    atomic_write_bytes(Path(path), (json.dumps(body, indent=2) + "\n").encode())


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def resolve_weight_file(path: str | Path) -> Path:
    """A weight file, or the weight file inside a folder (timm / Hugging Face layout)."""
    path = Path(path)
    if path.is_dir():
        for name in WEIGHT_FILE_NAMES:
            if (path / name).is_file():
                return path / name
        raise CheckpointError(
            f"no weight file in folder {path} (looked for {', '.join(WEIGHT_FILE_NAMES)})"
        )
    if not path.is_file():
        raise CheckpointError(f"weight file not found: {path}")
    return path


def load_state_dict_file(
    path: str | Path, expected_sha256: str | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """Load tensors from a safetensors file or a weights-only torch file.

    Returns:
        The state dict (on CPU) and the file's sha256.

    Raises:
        CheckpointError: naming the file, for a sha256 mismatch, a truncated or corrupted
            file, or a pickle that would need code execution.
    """
    path = resolve_weight_file(path)
    sha = sha256_file(path)
    if expected_sha256 and sha != expected_sha256.lower():
        raise CheckpointError(
            f"sha256 mismatch for {path}: expected {expected_sha256}, actual {sha}"
        )
    kind = sniff_weight_format(path)
    if kind is None and path.suffix != ".safetensors":
        raise CheckpointError(
            f"{path} is not a safetensors file or a torch checkpoint "
            f"(its first bytes are {_head(path).hex(' ')})"
        )
    if path.suffix == ".safetensors" or kind == "safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"corrupted or truncated safetensors file {path}: {err}") from err
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                f"refused {path}: it is a pickle that needs code execution to load; "
                f"only safetensors or weights-only torch files are accepted ({str(err).splitlines()[0]})"
            ) from err
        except (RuntimeError, EOFError, OSError) as err:
            raise CheckpointError(f"corrupted or truncated torch file {path}: {err}") from err
        if (
            isinstance(state, dict)
            and "state_dict" in state
            and isinstance(state["state_dict"], dict)
        ):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(
            isinstance(v, torch.Tensor) for v in state.values()
        ):
            raise CheckpointError(f"{path} does not hold a flat state dict of tensors")
    return state, sha


def _head(path: Path, n: int = 16) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def sniff_weight_format(path: Path) -> str | None:
    """'safetensors', 'torch' (zip archive or legacy pickle) or None, from the first bytes.

    Lets foreign bytes be called what they are instead of reaching torch's unpickler,
    whose complaint ("needs code execution") would misname a random file.
    """
    head = _head(path)
    # safetensors: little-endian u64 header length (JSON headers are small), then a JSON object
    if (
        len(head) >= 9
        and head[8:9] == b"{"
        and 0 < int.from_bytes(head[:8], "little") < 100_000_000
    ):
        return "safetensors"
    if head.startswith(b"PK\x03\x04"):  # torch.save's zip archive (the default since torch 1.6)
        return "torch"
    if (
        len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
    ):  # pickle protocol 2-5: legacy torch.save
        return "torch"
    return None


def download_pinned(entry: PinnedCheckpoint, cache_dir: str | None = None) -> Path:
    """Fetch a pinned checkpoint from the hub at its pinned revision."""
    if not entry.is_pinned:
        raise CheckpointError(
            f"{entry.name} has no pinned revision/sha256 in {LOCK_PATH}; run `workbench pin {entry.name}` "
            "on a connected machine first, or pass a local safetensors file"
        )
    from huggingface_hub import hf_hub_download

    try:
        return Path(
            hf_hub_download(
                entry.hub_repo, entry.filename, revision=entry.revision, cache_dir=cache_dir
            )
        )
    except Exception as err:  # the hub client raises many types; all mean "not available"
        raise CheckpointError(
            f"could not download {entry.hub_repo}/{entry.filename}@{entry.revision}: {err}. "
            "Offline? Pass a local safetensors file instead."
        ) from err


def pin_checkpoint(name: str, lock_path: Path = LOCK_PATH) -> PinnedCheckpoint:
    """Resolve the hub's current revision, size and sha256 of a lock entry and record them."""
    from huggingface_hub import HfApi

    entries = read_lock(lock_path)
    if name not in entries:
        raise CheckpointError(
            f"unknown checkpoint {name!r}; lock file has: {', '.join(sorted(entries))}"
        )
    entry = entries[name]
    try:
        info = HfApi().model_info(entry.hub_repo, files_metadata=True)
    except Exception as err:
        raise CheckpointError(f"could not reach the hub for {entry.hub_repo}: {err}") from err
    files = {s.rfilename: s for s in info.siblings or []}
    if entry.filename not in files or files[entry.filename].lfs is None:
        raise CheckpointError(f"{entry.hub_repo} has no LFS file {entry.filename}")
    lfs = files[entry.filename].lfs
    pinned = PinnedCheckpoint(
        name=name,
        architecture=entry.architecture,
        hub_repo=entry.hub_repo,
        filename=entry.filename,
        revision=info.sha,
        size_bytes=lfs.size,
        sha256=lfs.sha256,
    )
    entries[name] = pinned
    write_lock(entries, lock_path)
    return pinned
