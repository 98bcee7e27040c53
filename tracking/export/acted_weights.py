"""The acted-on cells' weights, written beside an acting study's evidence (``weights/``).

Read back by ``workbench.interventions.published_cells`` (``attribute`` / ``intervene
--cells-from``), so that a published attribution or intervention study re-runs offline on the
weights it acted on. Each cell's best checkpoint goes out as safetensors (model weights only),
with its ``config.json`` and the validation predictions its trainer saved (the same bytes, so the
reload proof holds bit for bit), each file's sha256 in ``weights/manifest.json``.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tracking.record.queries import QueryError, download_artifact
from workbench.atomic import atomic_write_bytes
from workbench.interventions.published_cells import (
    MANIFEST,
    MANIFEST_FORMAT,
    WEIGHTS_DIR,
    PublishedCellError,
    PublishedCells,
    cell_stem,
    manifest_entry,
    weight_files,
)
from workbench.train.checkpoint import load_checkpoint

FILE_MODE = 0o666  # masked by the umask, as the other evidence files


class WeightsExportError(ValueError):
    """An acted-on cell whose weights cannot be exported (its run or artifacts are not in the store)."""


def _in_store(run_id: str) -> bool:
    try:
        MlflowClient().get_run(run_id)
    except MlflowException:
        return False
    return True


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


# Where a study acted on with ``--cells-from`` finds the weights it acted on: the published evidence
# folders of this repository (their weights carry the same source run ids).
PUBLISHED = Path(__file__).resolve().parents[2] / "docs" / "results"


def _published_files(acts_on, arm: str, seed: int, run_id: str, root: Path) -> tuple[dict, dict]:
    """A cell acted on from published weights (``--cells-from``), whose trained run is not in this
    store: its params and files from the evidence folder that shipped them, each checked against
    that folder's sha256. Raises ``WeightsExportError`` when no folder under ``root`` has them."""
    for manifest in sorted(root.glob(f"*/evidence/{MANIFEST}")):
        try:
            published = PublishedCells(manifest.parents[1])
            entry = published.entry(acts_on.hash, arm, seed)
        except PublishedCellError:
            continue
        if entry["source_run_id"] != run_id:
            continue
        files = {}
        for name, digest in entry["files"].items():
            data = (published.folder / name).read_bytes()
            if hashlib.sha256(data).hexdigest() != digest:
                raise WeightsExportError(
                    f"{published.folder / name}: sha256 differs from its manifest"
                )
            files[Path(name).name] = data
        return dict(entry["params"]), files
    raise WeightsExportError(
        f"acted-on run {run_id} ({arm}/seed{seed}) is not in this store, and no published evidence "
        f"folder under {root} ships its weights"
    )


def export_weights(
    folder: Path, acts_on, cells: list[tuple[str, int, str]], published: Path | None = None
) -> set[Path]:
    """Write ``folder/weights/<arm>.seed<seed>/`` for every ``(arm, seed, source run id)`` and the manifest.

    ``acts_on``: the acting protocol's ``acts_on`` (acted-on protocol name and hash). A cell whose
    trained run is not in the store (acted on ``--cells-from`` published weights) is copied from the
    evidence folder under ``published`` (default: this repository's docs/results) that ships it,
    byte for byte. Returns the paths written, so
    the caller can remove what an older export left.
    """
    found = []
    for arm, seed, run_id in sorted(cells):
        if _in_store(run_id):
            params, files = _cell_files(run_id)
        else:
            params, files = _published_files(acts_on, arm, seed, run_id, published or PUBLISHED)
        found.append((arm, seed, run_id, params, files, {}))
    return _write_weights(folder, acts_on, found)


def _write_weights(folder: Path, acts_on, cells: list[tuple]) -> set[Path]:
    """Each cell's files under ``folder/weights/<arm>.seed<seed>/`` and the manifest naming them.

    ``cells``: ``(arm, seed, run id, params, files, extra manifest keys)``. Returns the paths written.
    """
    entries, written = [], set()
    for arm, seed, run_id, params, files, extra in cells:
        for name, data in files.items():
            path = folder / WEIGHTS_DIR / cell_stem(arm, seed) / name
            atomic_write_bytes(path, data, FILE_MODE)
            written.add(path)
        entry = manifest_entry(
            arm=arm,
            seed=seed,
            run_id=run_id,
            protocol=acts_on.protocol,
            protocol_hash=acts_on.hash,
            params=params,
            files=files,
        )
        entries.append(entry | extra)
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


def attach_rebuilt_weights(
    evidence: Path, acts_on, cells: list[tuple[str, int, str, str, str]]
) -> set[Path]:
    """Ship the weights of cells rebuilt bit for bit beside a published acting study's evidence.

    For a study published before its export shipped weights: the trained runs it acted on are gone,
    but each was rebuilt by ``workbench reproduce --level bitwise`` (or shown equal by re-running
    the study) into the current store. ``cells``: ``(arm, seed, acted-on run id the evidence
    names, rebuilt run id in this store, proof)``, the proof saying how the rebuilt cell was shown
    to be the acted-on one. The manifest keys each cell by the acted-on run id, so
    ``--cells-from`` re-runs the study keyed as published, and records the rebuilt run and proof. Nothing else in the
    evidence changes. Returns the paths written.
    """
    found = []
    for arm, seed, acted_run, rebuilt_run, proof in sorted(cells):
        if not _in_store(rebuilt_run):
            raise WeightsExportError(
                f"rebuilt run {rebuilt_run} ({arm}/seed{seed}) is not in this store"
            )
        params, files = _cell_files(rebuilt_run)
        rebuilt = {"rebuilt": {"run_id": rebuilt_run, "proof": proof}}
        found.append((arm, seed, acted_run, params, files, rebuilt))
    return _write_weights(evidence, acts_on, found)
