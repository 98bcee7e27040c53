"""Gather what a report needs from MLflow: the protocol, one finished run per cell, its data.

Which run stands for a cell: the protocol hash decides the study (other hashes of the same
name are never mixed in, only named). Within the hash a cell (arm, seed) can have several
finished runs, one per code commit or data fingerprint it was run with; the report uses the
newest finished one (latest end time, then run id), or the newest of the commit given with
``commit``, and lists the others as superseded. Cells without a finished run are missing.
"""

from __future__ import annotations

import contextlib

import hashlib
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from tracking.record import queries
from tracking.record.protocol_runs import reap_dead_runs
from tracking.record.queries import CellRecord, QueryError
from workbench.code_history import same_code
from workbench.kinds import BY_NAME, DEFAULT_KIND
from workbench.protocol import SHORT_HASH_LEN, kind_of, load_protocol
from workbench.text.portable import relative

PROTOCOL_DIR = Path(__file__).resolve().parent.parent / "studies" / "protocols"
CURVE_METRICS = ("val_accuracy", "val_loss", "train_accuracy", "train_loss")
COST_METRICS = ("epoch_seconds",)  # per-epoch training wall time: the cost table sums it
# the per-seed value of each split
METRIC_KEYS = {
    "val": "best_val_accuracy",
    "test": "test_accuracy",
}


class ReportError(ValueError):
    """The report cannot be built; the message says why and what to do."""


@dataclass(frozen=True)
class ProtocolSpec:
    """What the report needs to know about the protocol: its identity and its expected cells."""

    name: str
    hash: str
    description: str
    arms: tuple[str, ...]  # protocol order
    reference: str
    seeds: tuple[int, ...]  # protocol order
    evaluate_test: bool
    source: str  # where the spec came from, in words
    canonical: dict = field(default_factory=dict, repr=False, compare=False)  # the hashed content

    @property
    def short_hash(self) -> str:
        return self.hash[:SHORT_HASH_LEN]

    @property
    def splits(self) -> tuple[str, ...]:
        return ("val", "test") if self.evaluate_test else ("val",)


@dataclass
class CellData:
    """The chosen run of one cell with its predictions (split -> table) and curves (metric -> step -> value)."""

    record: CellRecord
    predictions: dict[str, pd.DataFrame] = field(default_factory=dict)
    curves: dict[str, dict[int, float]] = field(default_factory=dict)
    # split -> sha256 of the predictions file as logged
    sources: dict[str, str] = field(default_factory=dict)


@dataclass
class StudyData:
    """Everything the tables and figures are computed from."""

    spec: ProtocolSpec
    tracking_uri: str
    cells: dict[tuple[str, int], CellData]  # (arm, seed) -> chosen run
    missing: list[tuple[str, int, str]]  # (arm, seed, why) for cells without a finished run
    superseded: list[CellRecord]  # finished runs of a cell that were not chosen
    other_hashes: dict[str, int]  # hash -> cell runs under the same name, not used
    unexpected: list[CellRecord]  # runs of this hash whose (arm, seed) the protocol does not have
    parent_run_id: str | None  # newest parent run of this hash: the report is logged there
    commit_filter: str | None
    num_classes: int = 0
    # newer unfinished runs of reported cells
    attempts: list[CellRecord] = field(default_factory=list)
    # the evidence export the study was read from ("" when read from the store)
    rebuilt_from: str = ""
    # every cell run of the hash, any status, as read
    records: list[CellRecord] = field(default_factory=list)


def _spec_from_canonical(canonical: dict, digest: str, source: str) -> ProtocolSpec:
    kind = kind_of(canonical)
    if kind != DEFAULT_KIND:  # only the default kind's study is read from its canonical form
        raise ReportError(
            f"{canonical.get('name')}@{digest[:SHORT_HASH_LEN]} is {BY_NAME[kind].article} protocol: "
            "report it with its protocol file (studies/protocols/<name>.yaml or a path)"
        )
    arms = tuple(a["name"] for a in canonical["arms"])
    reference = next(a["name"] for a in canonical["arms"] if a.get("reference"))
    return ProtocolSpec(
        canonical["name"],
        digest,
        canonical["description"],
        arms,
        reference,
        tuple(int(s) for s in canonical["seeds"]),
        bool(canonical["run"].get("evaluate_test")),
        source,
        canonical,
    )


def _spec_from_parent(name: str, digest: str) -> ProtocolSpec:
    """The protocol of an older hash, from the canonical.json its parent run logged (sha256-checked)."""
    for parent in queries.parent_runs(name, digest):
        if not queries.has_artifact(parent.run_id, "protocol/canonical.json"):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            text = queries.download_artifact(
                parent.run_id, "protocol/canonical.json", Path(tmp)
            ).read_text(encoding="utf-8")
        if hashlib.sha256(text.encode()).hexdigest() != digest:
            raise ReportError(
                f"parent run {parent.run_id}: protocol/canonical.json does not hash to {digest[:SHORT_HASH_LEN]}"
            )
        return _spec_from_canonical(
            json.loads(text), digest, f"protocol/canonical.json of parent run {parent.run_id}"
        )
    raise ReportError(
        f"protocol {name!r}: no parent run of hash {digest[:SHORT_HASH_LEN]} holds protocol/canonical.json"
    )


def protocol_file(protocol: str) -> Path | None:
    """The file of a protocol given as a path or as a name (``studies/protocols/<name>.yaml``), if any."""
    path = Path(protocol)
    if not path.is_file() and (PROTOCOL_DIR / f"{protocol}.yaml").is_file():
        path = PROTOCOL_DIR / f"{protocol}.yaml"
    return path if path.is_file() else None


def recorded_file(protocol: str) -> Path | None:
    """The protocol file of this name that its parent runs record (``protocol_file``), if it is here.

    A protocol kept outside ``studies/protocols/`` (a subfolder, another folder) is found by
    name this way, as ``report --all`` names it. A recorded path is read as given (from the
    folder the execution ran in, usually the repository's root), then from the repository's
    root; a file that holds another protocol name is not it.
    """
    from tracking.record.protocol_runs import recorded_protocol_files
    from workbench.protocol import read_yaml

    root = PROTOCOL_DIR.parents[1]
    for recorded in recorded_protocol_files(protocol):
        for path in (Path(recorded), root / recorded):
            if path.is_file():
                with contextlib.suppress(Exception):  # unreadable or another protocol: not it
                    if read_yaml(path).get("name") == protocol:
                        return path
    return None


def resolve_hash(
    name: str, counts: dict[str, int], hash_prefix: str | None, file_hash: str | None
) -> str:
    """The full hash to report: the unique recorded one starting with ``hash_prefix``, else the file's,
    else the only recorded one.

    Raises:
        ReportError: The prefix matches no or several recorded hashes; no file and several hashes.
    """
    if hash_prefix:
        matches = [h for h in counts if h.startswith(hash_prefix)]
        if len(matches) != 1:
            found = ", ".join(h[:SHORT_HASH_LEN] for h in counts) or "none"
            raise ReportError(
                f"--hash {hash_prefix}: matches {len(matches)} recorded hashes of {name!r} (recorded: {found})"
            )
        return matches[0]
    if file_hash:
        return file_hash
    if len(counts) == 1:
        return next(iter(counts))
    raise ReportError(
        f"protocol {name!r}: no file and {len(counts)} recorded hashes; pick one with --hash "
        f"({', '.join(h[:SHORT_HASH_LEN] for h in counts)})"
    )


def resolve_protocol(
    protocol: str, hash_prefix: str | None = None
) -> tuple[ProtocolSpec, dict[str, int]]:
    """The protocol to report on and the cell-run counts of every hash recorded under its name.

    Args:
        protocol: A protocol YAML path, or a protocol name (``studies/protocols/<name>.yaml``
            when it exists, else the protocol as logged on its parent runs).
        hash_prefix: Report this recorded hash (or unique prefix) instead of the file's.

    Raises:
        ReportError: Unknown protocol, hash not recorded or ambiguous, no file and several hashes.
        QueryError: The protocol's experiment does not exist in the tracking store.
    """
    path = protocol_file(protocol)
    loaded = load_protocol(path) if path else None
    name = loaded.name if loaded else protocol
    if not loaded and ("/" in protocol or protocol.endswith((".yaml", ".yml"))):
        raise ReportError(f"{protocol}: no such protocol file")
    counts = queries.hash_counts(name)
    digest = resolve_hash(name, counts, hash_prefix, loaded.hash if loaded else None)
    if loaded and digest == loaded.hash:
        spec = ProtocolSpec(
            loaded.name,
            loaded.hash,
            loaded.description,
            tuple(a.name for a in loaded.arms),
            loaded.reference.name,
            loaded.seeds,
            loaded.run.evaluate_test,
            f"file {shown_path(path)}",
            loaded.canonical,
        )
    else:
        spec = _spec_from_parent(name, digest)
    return spec, counts


def check_rebuild_folder(evidence_dir: Path, out_root: Path, name: str) -> None:
    """Refuse to rebuild a report into the folder that holds its evidence and published report."""
    folder = Path(out_root) / name
    if folder.resolve() == evidence_dir.resolve().parent:
        raise ReportError(
            f"--out-dir {out_root}: {folder} holds the evidence and its published report; "
            "rebuild into another folder and compare"
        )


def shown_path(path: Path) -> str:
    """The file as the report names it: relative to the project when inside it, so the text
    does not depend on whether it was given by name, relative or absolute path; elsewhere
    relative to the working directory (a published page names no absolute path)."""
    resolved = path.resolve()
    try:
        return str(resolved.relative_to(PROTOCOL_DIR.parent.parent))
    except ValueError:
        return relative(str(resolved))


def _newest(records: list[CellRecord]) -> CellRecord:
    return max(records, key=lambda r: (r.end_time, r.start_time, r.run_id))


def _read_predictions(path: Path) -> pd.DataFrame:
    # Only what the statistics use; the rows sorted by example index so arms line up.
    table = pd.read_csv(
        path, usecols=lambda c: c in ("index", "label", "predicted") or c.startswith("prob_")
    )
    return table.sort_values("index", kind="stable").reset_index(drop=True)


def load_study(spec: ProtocolSpec, counts: dict[str, int], commit: str | None = None) -> StudyData:
    """Choose one finished run per cell and load its predictions and training curves."""
    reap_dead_runs(spec.name, spec.hash)  # a dead execution's runs show as KILLED, not RUNNING
    records = queries.cell_records(spec.name, spec.hash)
    parents = queries.parent_runs(spec.name, spec.hash)
    with tempfile.TemporaryDirectory() as tmp:
        return assemble_study(
            spec,
            counts,
            records,
            parents[0].run_id if parents else None,
            queries.tracking_uri(),
            commit,
            lambda record: _cell_data(record, spec, Path(tmp) / record.run_id),
        )


def assemble_study(
    spec: ProtocolSpec,
    counts: dict[str, int],
    records: list[CellRecord],
    parent_run_id: str | None,
    tracking_uri: str,
    commit: str | None,
    cell_data: Callable[[CellRecord], CellData],
) -> StudyData:
    """The study from its cell runs (any status): the one rule choosing a run per cell, wherever the
    runs come from (the MLflow store, or a published evidence export). ``cell_data`` loads the
    chosen run's predictions and curves."""
    expected = {(a, s) for a in spec.arms for s in spec.seeds}
    unexpected = [r for r in records if (r.arm, r.seed) not in expected]
    study = StudyData(
        spec,
        tracking_uri,
        {},
        [],
        [],
        {h: n for h, n in counts.items() if h != spec.hash},
        unexpected,
        parent_run_id,
        commit,
        records=list(records),
    )
    # Runs group by the fingerprint of the code that computed them: without --commit the
    # report uses the group of the newest finished run, never a mix of code versions (a
    # fingerprint ``workbench.code_history`` maps to another names the same code).
    code = lambda r: r.params.get("code_fingerprint", "")  # noqa: E731
    done = [r for r in records if r.status == "FINISHED"]
    group = code(_newest(done)) if done and commit is None else None
    for seed in spec.seeds:
        for arm in spec.arms:
            mine = [r for r in records if (r.arm, r.seed) == (arm, seed)]
            finished = [r for r in mine if r.status == "FINISHED"]
            usable = (
                [r for r in finished if same_code(code(r), group)]
                if group is not None
                else [
                    r
                    for r in finished
                    if commit is None or r.commit.startswith(commit) or code(r).startswith(commit)
                ]
            )
            if not usable:
                study.missing.append(
                    (
                        arm,
                        seed,
                        _why_missing(
                            mine,
                            finished,
                            f"commit {commit}" if commit else f"code fingerprint {group}",
                        ),
                    )
                )
                continue
            chosen = _newest(usable)
            study.superseded.extend(r for r in finished if r is not chosen)
            study.cells[(arm, seed)] = cell_data(chosen)
    study.superseded.sort(
        key=lambda r: (spec.arms.index(r.arm), spec.seeds.index(r.seed), r.run_id)
    )
    study.attempts = newer_attempts(
        records, {k: c.record for k, c in study.cells.items()}, spec.arms, spec.seeds
    )
    study.num_classes = max(
        (
            sum(c.startswith("prob_") for c in t.columns)
            for cell in study.cells.values()
            for t in cell.predictions.values()
        ),
        default=0,
    )
    return study


def newer_attempts(
    records: list[CellRecord],
    chosen: dict[tuple[str, int], CellRecord],
    arms: tuple[str, ...],
    seeds: tuple[int, ...],
) -> list[CellRecord]:
    """Runs of a reported cell that are not finished and started after the reported run:
    a FAILED, KILLED or still RUNNING later attempt the reader should know about."""
    out = [
        r
        for r in records
        if (r.arm, r.seed) in chosen
        and r.status != "FINISHED"
        and r.start_time > chosen[(r.arm, r.seed)].start_time
    ]
    return sorted(
        out, key=lambda r: (arms.index(r.arm), seeds.index(r.seed), r.start_time, r.run_id)
    )


def _why_missing(mine: list[CellRecord], finished: list[CellRecord], commit: str | None) -> str:
    if finished:  # only possible with a commit filter
        return f"no finished run at {commit} (finished at {', '.join(sorted({r.commit[:10] for r in finished}))})"
    if not mine:
        return "no run"
    return "; ".join(f"{r.status} run {r.run_id}" for r in mine)


def _cell_data(record: CellRecord, spec: ProtocolSpec, tmp: Path) -> CellData:
    cell = CellData(record)
    for split in spec.splits:
        try:
            path = queries.download_artifact(record.run_id, f"predictions/{split}.csv", tmp)
        except QueryError as err:
            if (
                split == "val"
            ):  # every finished cell saves validation predictions: without them the run is broken
                raise ReportError(
                    f"{record.arm}/seed{record.seed}: {err}; the report needs the saved predictions"
                ) from err
            continue  # a test result can be absent (a dataset without a test split): has_split says so
        cell.predictions[split] = _read_predictions(path)
        cell.sources[split] = hashlib.sha256(path.read_bytes()).hexdigest()
    cell.curves = {
        key: queries.metric_history(record.run_id, key) for key in CURVE_METRICS + COST_METRICS
    }
    return cell


def has_split(cell: CellData, split: str) -> bool:
    """Whether the run has both the logged accuracy and the predictions file of ``split``."""
    return split in cell.predictions and METRIC_KEYS[split] in cell.record.metrics


def labels_and_predictions(cell: CellData, split: str) -> tuple[np.ndarray, np.ndarray]:
    table = cell.predictions[split]
    return table["label"].to_numpy(np.int64), table["predicted"].to_numpy(np.int64)
