"""The trained cells an acting study used, as its published evidence ships them (docs/attribution.md).

An acted-on study's evidence export writes, per reported cell, the acted-on cell's best weights
(safetensors), its ``config.json``, its saved validation predictions (the file the trainer wrote,
byte for byte, gzipped) and what identifies it (the source run id, the data and split
fingerprints), each file with its sha256 in ``weights/manifest.json``. This module reads them
back for ``workbench attribute`` / ``intervene --cells-from DIR``: a reader re-runs the study
offline on the same weights, keyed by the same source run ids, without re-training anything.
Only safetensors are read (no pickle), and every file is checked against its sha256 first.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from workbench.train.evaluate import read_predictions

WEIGHTS_DIR = "weights"
MANIFEST = f"{WEIGHTS_DIR}/manifest.json"
MANIFEST_FORMAT = "workbench-acted-weights/1"
# the params that say which data a cell was trained and validated on (checked against the data here)
DATA_PARAMS = ("data.fingerprint", "data.split_fingerprint")


class PublishedCellError(ValueError):
    """A published cells folder that is missing, incomplete or does not match its manifest."""


@dataclass(frozen=True)
class PublishedCell:
    """One acted-on cell read back from an evidence folder (what ``trained_cell`` gives from MLflow)."""

    run_id: str  # the trained cell's run id in the store the evidence was exported from
    params: dict  # at least DATA_PARAMS
    config: dict
    state_dict: dict[str, torch.Tensor]
    predictions: dict[str, pd.DataFrame]  # {"val": the saved validation predictions}


def cell_stem(arm: str, seed: int) -> str:
    return f"{arm}.seed{seed}"


def weight_files(*, state_dict: dict, config: dict, predictions_csv: bytes) -> dict[str, bytes]:
    """The bytes of one cell's files: ``model.safetensors``, ``config.json``, ``val.csv.gz``."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    return {
        "model.safetensors": save_safetensors(tensors),
        "config.json": (json.dumps(config, sort_keys=True, indent=1) + "\n").encode("utf-8"),
        "val.csv.gz": gzip.compress(predictions_csv, compresslevel=9, mtime=0),
    }


def manifest_entry(
    *,
    arm: str,
    seed: int,
    run_id: str,
    protocol: str,
    protocol_hash: str,
    params: dict,
    files: dict[str, bytes],
) -> dict:
    """What the manifest says of one cell: where its files are, their sha256, what it was trained on."""
    return {
        "arm": arm,
        "seed": int(seed),
        "source_run_id": run_id,
        "protocol": protocol,
        "protocol_hash": protocol_hash,
        "params": {k: params.get(k) for k in DATA_PARAMS},
        "files": {
            f"{WEIGHTS_DIR}/{cell_stem(arm, seed)}/{name}": hashlib.sha256(data).hexdigest()
            for name, data in sorted(files.items())
        },
    }


class PublishedCells:
    """The acted-on cells of one evidence folder, found by protocol, hash, arm and seed."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.is_file():
            raise PublishedCellError(
                f"{path}: no such file; --cells-from takes a published study's evidence folder "
                "whose export shipped the acted-on weights (docs/results/<study>/evidence)"
            )
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != MANIFEST_FORMAT:
            raise PublishedCellError(
                f"{path}: format {doc.get('format')!r}, expected {MANIFEST_FORMAT}"
            )
        self.entries = {(e["protocol_hash"], e["arm"], e["seed"]): e for e in doc["cells"]}

    def entry(self, protocol_hash: str, arm: str, seed: int) -> dict:
        try:
            return self.entries[(protocol_hash, arm, int(seed))]
        except KeyError:
            have = ", ".join(sorted(f"{a}/seed{s}" for _, a, s in self.entries)) or "none"
            raise PublishedCellError(
                f"{self.folder / MANIFEST}: no cell {arm}/seed{seed} of hash {protocol_hash[:12]} "
                f"(it holds {have})"
            ) from None

    def run_id(self, protocol_hash: str, arm: str, seed: int) -> str:
        return self.entry(protocol_hash, arm, seed)["source_run_id"]

    def _read(self, name: str, sha256: str) -> bytes:
        path = self.folder / name
        try:
            data = path.read_bytes()
        except OSError as err:
            raise PublishedCellError(f"{path}: {err.strerror or err}") from None
        if hashlib.sha256(data).hexdigest() != sha256:
            raise PublishedCellError(f"{path}: sha256 differs from {self.folder / MANIFEST}")
        return data

    def load(self, protocol_hash: str, arm: str, seed: int) -> PublishedCell:
        """The cell's weights, config and saved predictions, each checked against its sha256."""
        e = self.entry(protocol_hash, arm, seed)
        files = {Path(name).name: self._read(name, digest) for name, digest in e["files"].items()}
        return PublishedCell(
            run_id=e["source_run_id"],
            params=dict(e["params"]),
            config=json.loads(files["config.json"]),
            state_dict=load_safetensors(files["model.safetensors"]),
            predictions={"val": read_predictions(io.BytesIO(gzip.decompress(files["val.csv.gz"])))},
        )
