"""The acted-on cells' weights, written beside an acting study's evidence (``weights/``).

Read back by ``workbench.interventions.published_cells`` (``attribute`` / ``intervene
--cells-from``), so that a published attribution or intervention study re-runs offline on the
weights it acted on. Each cell's best checkpoint goes out as safetensors (model weights only),
with its ``config.json`` and the validation predictions its trainer saved (the same bytes, so the
reload proof holds bit for bit), each file's sha256 in ``weights/manifest.json``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from mlflow.tracking import MlflowClient

from tracking.record.queries import QueryError, download_artifact
from workbench.atomic import atomic_write_bytes
from workbench.interventions.published_cells import (
    MANIFEST,
    MANIFEST_FORMAT,
    WEIGHTS_DIR,
    cell_stem,
    manifest_entry,
    weight_files,
)
from workbench.train.checkpoint import load_checkpoint

FILE_MODE = 0o666  # masked by the umask, as the other evidence files


class WeightsExportError(ValueError):
    """An acted-on cell whose weights cannot be exported (its run or artifacts are not in the store)."""


def _cell_files(run_id: str) -> tuple[dict, dict[str, bytes]]:
    """The trained run's params and the bytes of its exported files."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        try:
            config = json.loads(download_artifact(run_id, "config.json", folder).read_text())
            state = load_checkpoint(
                download_artifact(run_id, "checkpoints/best.pt", folder / "checkpoints")
            )
            csv = download_artifact(run_id, "predictions/val.csv", folder / "predictions")
            files = weight_files(
                state_dict=state["model"], config=config, predictions_csv=csv.read_bytes()
            )
        except QueryError as err:
            raise WeightsExportError(f"acted-on run {run_id}: {err}") from err
    return MlflowClient().get_run(run_id).data.params, files


def export_weights(folder: Path, acts_on, cells: list[tuple[str, int, str]]) -> set[Path]:
    """Write ``folder/weights/<arm>.seed<seed>/`` for every ``(arm, seed, source run id)`` and the manifest.

    ``acts_on``: the acting protocol's ``acts_on`` (acted-on protocol name and hash). Returns the
    paths written, so the caller can remove what an older export left.
    """
    entries, written = [], set()
    for arm, seed, run_id in sorted(cells):
        params, files = _cell_files(run_id)
        for name, data in files.items():
            path = folder / WEIGHTS_DIR / cell_stem(arm, seed) / name
            atomic_write_bytes(path, data, FILE_MODE)
            written.add(path)
        entries.append(
            manifest_entry(
                arm=arm,
                seed=seed,
                run_id=run_id,
                protocol=acts_on.protocol,
                protocol_hash=acts_on.hash,
                params=params,
                files=files,
            )
        )
    doc = {"format": MANIFEST_FORMAT, "cells": entries}
    text = json.dumps(doc, sort_keys=True, indent=1) + "\n"
    atomic_write_bytes(folder / MANIFEST, text.encode("utf-8"), FILE_MODE)
    return written | {folder / MANIFEST}


def weights_readme_item(cells: int) -> str:
    """The README's bullet for ``weights/``."""
    return f"""- `weights/`: the {cells} acted-on cells as they were acted on, so that the study re-runs
  offline without re-training (`workbench attribute` or `intervene --cells-from <this folder>`):
  per cell `weights/<arm>.seed<seed>/model.safetensors` (the best checkpoint's model weights),
  `config.json` (the cell's training config) and `val.csv.gz` (the validation predictions its
  trainer saved, which the reload proof checks the weights against first); `weights/manifest.json`
  names each cell's trained run id, the data and split fingerprints it was trained on, and the
  sha256 of every file, which `--cells-from` checks before it reads a byte of the weights.
"""
