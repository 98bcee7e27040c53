"""Read-side MLflow queries: a protocol's cell runs, histories, artifacts, the launcher run.

The one implementation of each query that the reports (``reports/``), the analysis figures
(``tracking.kinds.figure_runs``) and the transfer section (``tracking.kinds.transfer_runs``) share. Report-facing
functions return plain dataclasses and files, so the report builder never touches MLflow
objects. Nothing here creates an experiment: a report on a protocol that was never run is
an error, not an empty experiment left behind in the store.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import mlflow
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tracking.record import study_record
from tracking.record.schema import (
    ARM,
    PARENT_RUN_ID,
    PROTOCOL_HASH,
    PROTOCOL_NAME,
    SEED,
    TRUE,
    cell_filter,
    parent_filter,
)
from tracking.store import ui_links
from tracking.store.session import configure_tracking
from workbench.kinds import DEFAULT_KIND, PROTOCOL_KINDS
from workbench.text.portable import portable_text

PAGE_SIZE = 1000  # below every store's per-page cap; pages are followed to the end


class QueryError(LookupError):
    """The tracking store does not hold what a report needs; the message says what is missing."""


@dataclass(frozen=True)
class CellRecord:
    """One cell run as the report sees it.

    Attributes:
        run_id: MLflow run id.
        arm: Tag ``arm``.
        seed: Tag ``seed`` as an int.
        status: MLflow status (FINISHED, RUNNING, FAILED, KILLED, SCHEDULED).
        commit: Tag ``git_commit`` ("unknown" when absent).
        dirty: Tag ``git_dirty`` ("true", "false" or "unknown").
        start_time: Milliseconds since the epoch (0 when unknown).
        end_time: Milliseconds since the epoch (0 while running).
        parent_run_id: Tag ``mlflow.parentRunId`` ("" when absent).
        params: All params.
        metrics: Latest value of every metric.
        tags: All tags (device, code fingerprint, environment).
        experiment_id: The run's experiment (for links to it on a server).
    """

    run_id: str
    arm: str
    seed: int
    status: str
    commit: str
    dirty: str
    start_time: int
    end_time: int
    parent_run_id: str
    params: dict[str, str] = field(repr=False)
    metrics: dict[str, float] = field(repr=False)
    tags: dict[str, str] = field(default_factory=dict, repr=False)
    experiment_id: str = ""


@dataclass(frozen=True)
class ParentRecord:
    """One protocol execution (a parent run)."""

    run_id: str
    protocol_hash: str
    status: str
    start_time: int
    commit: str


def tracking_uri() -> str:
    """The configured tracking URI as a page may print it: any user name or password removed, and
    a local store's absolute path relative to the working directory (``sqlite:////work/x/stores/a.db``
    run from ``/work/x`` shows as ``sqlite:///stores/a.db``, as the user could have given it)."""
    uri = configure_tracking(allow_offline=False)
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit(parts._replace(netloc=netloc))
    return portable_text(uri)


def run_url(record: CellRecord) -> str | None:
    """The run's page in the MLflow UI when the store is a server (http/https), else None."""
    return ui_links.run_url(tracking_uri(), record.experiment_id, record.run_id)


@dataclass(frozen=True)
class ProtocolEntry:
    """One protocol name recorded in the store: its newest execution and its cell runs by status."""

    name: str
    newest_hash: str
    newest_parent: str
    parent_status: str
    start_time: int
    kind: str  # a name of workbench.kinds.KINDS
    cell_status: dict[str, int]  # status -> cell runs of the newest hash
    hashes: int


def protocol_kind(parent: Run) -> str:
    """What a study parent ran, from its tags."""
    tags = parent.data.tags  # each kind's parents carry its name as a tag (ablation's: none)
    return next(
        (k.name for k in PROTOCOL_KINDS if k.name != DEFAULT_KIND and tags.get(k.name) == TRUE),
        DEFAULT_KIND,
    )


def holds_study(protocol_name: str, kind: str) -> bool:
    """Whether the store holds a study of this name and kind (a name of ``PROTOCOL_KINDS`` other than
    ablation): its parent runs carry the kind's tag, in this account's record (``study_record``)."""
    # a reader: a store that is not there is said, not created
    configure_tracking(allow_offline=False)
    ids = study_record.record_ids(protocol_name)
    return bool(ids) and bool(
        MlflowClient().search_runs(ids, parent_filter(protocol_name, kind=kind), max_results=1)
    )


def protocol_entries() -> list[ProtocolEntry]:
    """Every protocol executed against this store, by name: its parents' ``protocol_name`` tag in
    this account's experiments, whatever they are called (``study_record``)."""
    configure_tracking(allow_offline=False)
    client, by_name = MlflowClient(), {}
    for exp in client.search_experiments():
        parents = search_runs(exp.experiment_id, parent_filter())
        if parents and study_record.owns(client, exp.experiment_id):
            for run in parents:
                by_name.setdefault(run.data.tags.get(PROTOCOL_NAME, ""), []).append(run)
    by_name.pop("", None)
    return [_entry(name, runs) for name, runs in sorted(by_name.items())]


def _entry(name: str, parents: list[Run]) -> ProtocolEntry:
    """A protocol's newest execution and the cells of its hash."""
    newest = min(parents, key=lambda r: (-(r.info.start_time or 0), r.info.run_id))
    digest = newest.data.tags.get(PROTOCOL_HASH, "")
    cells: dict[str, int] = {}
    for run in search_runs(sorted({r.info.experiment_id for r in parents}), cell_filter(digest)):
        cells[run.info.status] = cells.get(run.info.status, 0) + 1
    return ProtocolEntry(
        name,
        digest,
        newest.info.run_id,
        newest.info.status,
        int(newest.info.start_time or 0),
        protocol_kind(newest),
        dict(sorted(cells.items())),
        len({r.data.tags.get(PROTOCOL_HASH) for r in parents}),
    )


def _experiment_ids(protocol_name: str) -> list[str]:
    """The experiments holding this account's record of the protocol (``study_record``), renamed or not."""
    configure_tracking(allow_offline=False)
    ids = study_record.record_ids(protocol_name)
    if not ids:
        raise QueryError(
            f"no MLflow experiment of yours holds protocol {protocol_name!r} in {tracking_uri()}: "
            "the protocol has not been run against this tracking store"
        )
    return ids


def search_runs(experiment_ids: str | list[str], filter_string: str) -> list[Run]:
    """Every matching run, following pages (a server caps one page), in run-id order."""
    ids = [experiment_ids] if isinstance(experiment_ids, str) else list(experiment_ids)
    client, out, token = MlflowClient(), [], None
    while True:
        page = client.search_runs(
            ids, filter_string=filter_string, max_results=PAGE_SIZE, page_token=token
        )
        out.extend(page)
        token = page.token
        if not token:
            break
    return sorted(out, key=lambda r: r.info.run_id)


def hash_counts(protocol_name: str) -> dict[str, int]:
    """Protocol hash -> number of cell runs (any status) recorded under this protocol name."""
    counts: dict[str, int] = {}
    for run in search_runs(
        _experiment_ids(protocol_name), cell_filter(protocol_name=protocol_name)
    ):
        h = run.data.tags.get(PROTOCOL_HASH, "")
        if h:
            counts[h] = counts.get(h, 0) + 1
    for parent in parent_runs(
        protocol_name
    ):  # a hash whose execution made no cell yet still counts
        counts.setdefault(parent.protocol_hash, 0)
    return dict(sorted(counts.items()))


def _seed(run: Run) -> int:
    raw = run.data.tags.get(SEED, "")
    try:
        return int(raw)
    except ValueError as err:
        raise QueryError(f"run {run.info.run_id}: tag seed={raw!r} is not an integer") from err


def cell_records(protocol_name: str, protocol_hash: str) -> list[CellRecord]:
    """Every cell run of this protocol hash, any status, sorted by (arm, seed, run id)."""
    runs = search_runs(_experiment_ids(protocol_name), cell_filter(protocol_hash))
    records = [
        CellRecord(
            run_id=r.info.run_id,
            arm=r.data.tags.get(ARM, ""),
            seed=_seed(r),
            status=r.info.status,
            commit=r.data.tags.get("git_commit", "unknown"),
            dirty=r.data.tags.get("git_dirty", "unknown"),
            start_time=int(r.info.start_time or 0),
            end_time=int(r.info.end_time or 0),
            parent_run_id=r.data.tags.get(PARENT_RUN_ID, ""),
            params=dict(r.data.params),
            metrics=dict(r.data.metrics),
            tags=dict(r.data.tags),
            experiment_id=r.info.experiment_id,
        )
        for r in runs
    ]
    return sorted(records, key=lambda c: (c.arm, c.seed, c.run_id))


def parent_runs(protocol_name: str, protocol_hash: str | None = None) -> list[ParentRecord]:
    """Parent runs (protocol executions), newest first; only ``protocol_hash``'s when given."""
    where = parent_filter(protocol_name, protocol_hash)
    parents = [
        ParentRecord(
            r.info.run_id,
            r.data.tags.get(PROTOCOL_HASH, ""),
            r.info.status,
            int(r.info.start_time or 0),
            r.data.tags.get("git_commit", "unknown"),
        )
        for r in search_runs(_experiment_ids(protocol_name), where)
    ]
    return sorted(parents, key=lambda p: (-p.start_time, p.run_id))


def metric_history(run_id: str, key: str) -> dict[int, float]:
    """Step -> value of one metric; a step logged twice keeps its latest value."""
    points = sorted(
        MlflowClient().get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)
    )
    return {int(m.step): float(m.value) for m in points}


def has_artifact(run_id: str, path: str) -> bool:
    folder = os.path.dirname(path) or None
    return any(a.path == path for a in MlflowClient().list_artifacts(run_id, folder))


def download_artifact(run_id: str, path: str, dst: Path) -> Path:
    """Download one artifact file of a run into ``dst`` (a folder) and return its local path.

    Raises:
        QueryError: The run has no such artifact, or it cannot be read.
    """
    if not has_artifact(run_id, path):
        raise QueryError(f"run {run_id} has no artifact {path!r}")
    dst.mkdir(parents=True, exist_ok=True)
    try:
        with _quiet_downloads():
            return Path(
                mlflow.artifacts.download_artifacts(
                    run_id=run_id, artifact_path=path, dst_path=str(dst)
                )
            )
    except (mlflow.exceptions.MlflowException, OSError) as err:
        raise QueryError(f"run {run_id}: artifact {path!r} is not readable: {err}") from err


@contextlib.contextmanager
def _quiet_downloads() -> Iterator[None]:
    """No progress bar per file: a report downloads dozens of small files."""
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def log_report(run_id: str, folder: Path, artifact_path: str = "report") -> None:
    """Log every file under ``folder`` to ``run_id`` at ``artifact_path`` (replacing same-named files)."""
    MlflowClient().log_artifacts(run_id, str(folder), artifact_path=artifact_path)


def launcher_run_id() -> str | None:
    """The run ``mlflow run`` created around this process, if any (it also gets reports and figures)."""
    return os.environ.get("MLFLOW_RUN_ID") or None


@dataclass(frozen=True)
class AnalysisFigure:
    """A figure `workbench figures` logged on a parent run (``figures/`` with a manifest)."""

    filename: str
    caption: str
    png: bytes = field(repr=False)
    run_id: str = ""


def analysis_figures(protocol_name: str, protocol_hash: str, dst: Path) -> list[AnalysisFigure]:
    """The analysis figures of the newest parent run of this hash that has them, in manifest order."""
    import json

    for parent in parent_runs(protocol_name, protocol_hash):
        if not has_artifact(parent.run_id, "figures/figures.json"):
            continue
        manifest = json.loads(
            download_artifact(
                parent.run_id, "figures/figures.json", dst / parent.run_id
            ).read_text()
        )
        return [
            AnalysisFigure(
                name,
                meta.get("caption", ""),
                download_artifact(
                    parent.run_id, f"figures/{name}", dst / parent.run_id
                ).read_bytes(),
                parent.run_id,
            )
            for name, meta in manifest.get("figures", {}).items()
        ]
    return []
