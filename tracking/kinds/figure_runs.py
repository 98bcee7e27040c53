"""MLflow side of the analysis figures: read finished protocol runs back, log the figures.

A protocol's runs are found the way ``ablate`` lays them out: one experiment named after
the protocol; parent runs tagged ``parent=true`` and ``protocol_hash``; cell runs tagged
``cell=true``, ``arm``, ``seed`` with the artifacts ``checkpoints/best.pt``,
``predictions/{val,test}.csv`` and ``config.json`` and per-epoch metrics stepped by epoch.
Where a cell has several finished runs (reruns at other commits), the newest one counts.
Figures are logged under ``figures/`` of the newest parent run of the hash, where the
report builder looks for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tracking.record import study_record
from tracking.record.queries import (
    QueryError,
    download_artifact,
    has_artifact,
    metric_history,
    search_runs,
)
from tracking.record.queries import launcher_run_id  # noqa: F401  (studies/tools/figures.py calls it from here)
from tracking.record.schema import (
    ARM,
    CELL,
    FIGURES,
    FINISHED,
    PARENT_RUN_ID,
    PROTOCOL_HASH,
    PROTOCOL_NAME,
    SEED,
    TRUE,
    cell_filter,
    parent_filter,
)
from tracking.store.session import configure_tracking
from workbench.train.checkpoint import load_checkpoint
from workbench.train.evaluate import read_predictions

FIGURES_ARTIFACT_PATH = "figures"
CURVE_METRICS = ("train_loss", "val_loss", "train_accuracy", "val_accuracy")


class FiguresError(ValueError):
    """The runs cannot be turned into figures; the message says why and what to do."""


@dataclass
class ProtocolRuns:
    """The runs of one protocol hash that the figures are built from.

    Attributes:
        name: Protocol name (= experiment name).
        protocol_hash: The hash the cells belong to.
        parent_run_id: Newest parent run of the hash (where figures are logged), if any.
        cells: One finished run per (arm, seed), sorted by arm and seed.
        superseded: Older finished runs of a cell that were not used.
    """

    name: str
    protocol_hash: str
    parent_run_id: str | None
    cells: list[Run]
    superseded: list[str] = field(default_factory=list)


@dataclass
class CellArtifacts:
    """What one cell run left in MLflow, read back.

    Attributes:
        run: The MLflow run.
        config: ``config.json`` (the flattened-before-logging TrainConfig as a dict).
        state_dict: Model weights of ``checkpoints/best.pt``.
        predictions: Split -> predictions table.
        history: Metric -> epoch -> value.
    """

    run: Run
    config: dict
    state_dict: dict
    predictions: dict[str, pd.DataFrame]
    history: dict[str, dict[int, float]]

    @property
    def arm(self) -> str:
        return self.run.data.tags.get(ARM, "")

    @property
    def seed(self) -> int:
        return int(self.run.data.tags.get(SEED, "0"))


def find_protocol_runs(name: str, protocol_hash: str | None = None) -> ProtocolRuns:
    """The finished cell runs and newest parent run of a protocol hash.

    Args:
        name: Protocol name.
        protocol_hash: Full hash; default: the hash of the newest parent run.

    Raises:
        FiguresError: No such experiment, hash or finished cell run.
    """
    configure_tracking(allow_offline=False)
    ids = study_record.record_ids(name)  # this account's record, renamed or not
    if not ids:
        raise FiguresError(
            f"no MLflow experiment of yours holds protocol {name!r} at {mlflow.get_tracking_uri()}: "
            "run the protocol first"
        )
    parents = sorted(
        search_runs(ids, parent_filter(name)),
        key=lambda r: (-(r.info.start_time or 0), r.info.run_id),
    )
    if protocol_hash is None:
        if not parents:
            raise FiguresError(
                f"protocol {name!r} has no parent run to take the hash from; pass the protocol file"
            )
        protocol_hash = parents[0].data.tags.get(PROTOCOL_HASH, "")
    parent = next((p for p in parents if p.data.tags.get(PROTOCOL_HASH) == protocol_hash), None)
    runs = search_runs(ids, cell_filter(protocol_hash, status=FINISHED))
    if not runs:
        raise FiguresError(
            f"no finished cell runs of {name}@{protocol_hash[:12]}: run or resume the protocol first"
        )
    newest: dict[tuple[str, str], Run] = {}
    superseded = []
    for run in sorted(runs, key=lambda r: (r.info.end_time or 0, r.info.run_id), reverse=True):
        key = (run.data.tags.get(ARM, ""), run.data.tags.get(SEED, ""))
        if key in newest:
            superseded.append(run.info.run_id)
        else:
            newest[key] = run
    cells = sorted(
        newest.values(), key=lambda r: (r.data.tags.get(ARM, ""), int(r.data.tags.get(SEED, "0")))
    )
    return ProtocolRuns(
        name, protocol_hash, parent.info.run_id if parent else None, cells, superseded
    )


def runs_by_id(run_ids: list[str]) -> ProtocolRuns:
    """Explicit cell runs; they must belong to one protocol hash.

    Raises:
        FiguresError: A run is missing, unfinished, not a cell run, or hashes differ.
    """
    configure_tracking()
    client = MlflowClient()
    runs = []
    for run_id in run_ids:
        try:
            run = client.get_run(run_id)
        except mlflow.exceptions.MlflowException as err:
            raise FiguresError(f"run {run_id}: {err}") from err
        if run.data.tags.get(CELL) != TRUE or run.info.status != FINISHED:
            raise FiguresError(
                f"run {run_id} is not a finished protocol cell run (tag cell={run.data.tags.get(CELL)!r}, "
                f"status {run.info.status})"
            )
        runs.append(run)
    hashes = {r.data.tags.get(PROTOCOL_HASH, "") for r in runs}
    if len(hashes) != 1:
        raise FiguresError(
            f"runs belong to {len(hashes)} protocol hashes {sorted(h[:12] for h in hashes)}; give runs of one"
        )
    name = runs[0].data.tags.get(PROTOCOL_NAME, "")
    parents = {r.data.tags.get(PARENT_RUN_ID) for r in runs} - {None}
    parent = parents.pop() if len(parents) == 1 else None
    cells = sorted(runs, key=lambda r: (r.data.tags.get(ARM, ""), int(r.data.tags.get(SEED, "0"))))
    return ProtocolRuns(name, hashes.pop(), parent, cells)


def load_cell(run: Run, workdir: Path) -> CellArtifacts:
    """Download a cell run's config, best checkpoint and predictions; read its curves."""
    run_id = run.info.run_id
    folder = Path(workdir) / run_id
    try:
        config = json.loads(download_artifact(run_id, "config.json", folder).read_text())
        state = load_checkpoint(
            download_artifact(run_id, "checkpoints/best.pt", folder / "checkpoints")
        )
        predictions = {
            split: read_predictions(
                download_artifact(run_id, f"predictions/{split}.csv", folder / "predictions")
            )
            for split in ("val", "test")
            if has_artifact(run_id, f"predictions/{split}.csv")
        }
    except QueryError as err:
        raise FiguresError(str(err)) from err
    if "val" not in predictions:
        raise FiguresError(f"run {run_id} has no predictions/val.csv")
    if masked := masked_fields(config):
        raise FiguresError(
            f"run {run_id}: its config.json has masked values ({', '.join(masked)} = '***'), written "
            "by a workbench whose redaction took class_token for a secret (from commit 0dcb45c until 6299e84); "
            "train the cell again to draw its figures"
        )
    history = {key: metric_history(run_id, key) for key in CURVE_METRICS}
    return CellArtifacts(run, config, state["model"], predictions, history)


def masked_fields(value, path: str = "") -> list[str]:
    """Dotted names of the values in a run's config that a redaction replaced by ``***``."""
    if isinstance(value, dict):
        return [
            f for k, v in value.items() for f in masked_fields(v, f"{path}.{k}" if path else str(k))
        ]
    return [path] if value == "***" else []


def log_figures(run_id: str, folder: Path, names: list[str]) -> None:
    """Log the named files of ``folder`` (PNGs and their manifest) to ``run_id`` under ``figures/``."""
    client = MlflowClient()
    for name in names:
        client.log_artifact(run_id, str(Path(folder) / name), artifact_path=FIGURES_ARTIFACT_PATH)


def log_inspection(
    folder: Path, names: list[str], params: dict, experiment: str = "figures"
) -> str:
    """Log a timm inspection's figures and what produced them to a run of ``experiment``.

    Under ``mlflow run`` the launcher's run is used; otherwise a new run is started.

    Returns:
        The run id.
    """
    from tracking.store.session import start_run

    with start_run(
        experiment, run_name=f"{params.get('model', 'model')} figures", tags={FIGURES: TRUE}
    ) as run:
        mlflow.log_params(params)
        log_figures(run.info.run_id, folder, names)
        return run.info.run_id
