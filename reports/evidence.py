"""A published study's evidence: its run records and per-example predictions, and the study read back.

``workbench report --evidence`` writes ``<report folder>/evidence/``:

- ``runs.json``: the protocol (hashed content, hash, where it came from), the store and
  experiment as the report names them, the report's build options (``interactions`` only
  when the report has any, so older exports keep their bytes), every cell run of
  the hash (any status: run id, status, start and end times, params, tags, latest metrics,
  metric histories with steps and timestamps), the parent runs, the cell-run counts of
  other hashes of the name, the analysis figures' manifest, and per reported cell its
  predictions files with their sha256.
- ``predictions/<arm>.seed<seed>.<split>.csv.gz``: per reported cell and split, one row
  per example: ``index`` (in the dataset's source split), ``label``, ``predicted``.
- ``README.md``: this format in words, and the command that rebuilds the report.

``load_evidence`` reads it back into the ``StudyData`` the report is rendered from, through
the same rule that chooses one run per cell (``collect.assemble_study``), so a report rebuilt
from the export shows the same numbers as the one built from the store. Everything is
written deterministically (sorted keys, gzip without a timestamp) and atomically; strings
carry no credentials and no absolute paths (``tracking.export.run_export``).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from reports import tables
from reports.collect import (
    CellData,
    CURVE_METRICS,
    COST_METRICS,
    ProtocolSpec,
    ReportError,
    StudyData,
    assemble_study,
)
from reports.provenance import BuildInputs
from tracking.export import run_export
from tracking.record import queries
from tracking.record.queries import AnalysisFigure, CellRecord
from workbench.atomic import atomic_write_bytes
from workbench.protocol.common import canonical_json

FORMAT = "workbench-evidence/1"
EVIDENCE_DIR = "evidence"
RUNS_FILE = "runs.json"
PREDICTION_COLUMNS = ("index", "label", "predicted")
FILE_MODE = 0o666  # masked by the umask, like the report files: group-readable under umask 022


# ------------------------------------------------------------------------------- export


def _prediction_bytes(table: pd.DataFrame) -> bytes:
    """The CSV (index, label, predicted), rows by example index, as text."""
    rows = table[list(PREDICTION_COLUMNS)].astype("int64")
    return rows.to_csv(index=False, lineterminator="\n").encode("utf-8")


def cell_entry(record: CellRecord, histories: dict | None = None) -> dict:
    """A cell run as published: the fields the report reads, cleaned of secrets and absolute paths
    (and its metric histories, for reports that read them)."""
    clean = run_export.clean_text
    entry = {
        "run_id": record.run_id,
        "experiment_id": record.experiment_id,
        "status": record.status,
        "start_time": record.start_time,
        "end_time": record.end_time,
        "params": {k: clean(v) for k, v in sorted(record.params.items())},
        "tags": {k: clean(v) for k, v in sorted(record.tags.items())},
        "metrics": {k: run_export.json_number(v) for k, v in sorted(record.metrics.items())},
    }
    return entry if histories is None else entry | {"metric_history": histories}


def write_gzip(folder: Path, name: str, data: bytes) -> str:
    """Write ``folder/name`` as gzip without a timestamp (same bytes every time); the sha256 of ``data``."""
    atomic_write_bytes(folder / name, gzip.compress(data, compresslevel=9, mtime=0), FILE_MODE)
    return hashlib.sha256(data).hexdigest()


def write_document(folder: Path, document: dict, readme: str) -> None:
    """``runs.json`` (sorted keys, strict JSON) and ``README.md``, each written atomically."""
    text = (
        json.dumps(document, sort_keys=True, indent=1, ensure_ascii=False, allow_nan=False) + "\n"
    )
    atomic_write_bytes(folder / RUNS_FILE, text.encode("utf-8"), FILE_MODE)
    atomic_write_bytes(folder / "README.md", readme.encode("utf-8"), FILE_MODE)


def remove_stale(folder: Path, pattern: str, written: set[Path]) -> None:
    """Remove files of an earlier export that this one did not write (a cell whose reported run changed)."""
    for stale in sorted(folder.glob(pattern)):
        if stale not in written:
            stale.unlink()


def export_evidence(
    folder: Path,
    study: StudyData,
    inputs: BuildInputs,
    logged_to: list[str],
    analysis: list[AnalysisFigure],
) -> Path:
    """Write ``folder`` (``runs.json``, ``predictions/``, ``README.md``) for ``study`` as reported.

    Raises:
        ReportError: A reported run's metric history changed since the report read it
            (a run written to while exporting): export again.
    """
    spec = study.spec
    cells, written = [], set()
    for record in sorted(study.records, key=lambda r: (r.arm, r.seed, r.run_id)):
        histories = run_export.metric_histories(record.run_id)
        entry = cell_entry(record, histories)
        cell = study.cells.get((record.arm, record.seed))
        if cell is not None and cell.record.run_id == record.run_id:
            for key, curve in cell.curves.items():
                if _published(curve) != _published(_curve(histories.get(key, []))):
                    raise ReportError(
                        f"run {record.run_id}: metric {key} changed while exporting; export again"
                    )
            entry["predictions"] = {}
            for split, table in sorted(cell.predictions.items()):
                name = f"predictions/{record.arm}.seed{record.seed}.{split}.csv.gz"
                digest = write_gzip(folder, name, _prediction_bytes(table))
                written.add(folder / name)
                entry["predictions"][split] = {
                    "file": name,
                    "rows": len(table),
                    "sha256": digest,
                    "classes": sum(c.startswith("prob_") for c in table.columns),
                    "logged_file": f"predictions/{split}.csv",
                    "logged_sha256": cell.sources.get(split, ""),
                }
                probs = [c for c in table.columns if c.startswith("prob_")]
                if probs:  # what the calibration section is computed from
                    name = f"predictions/{record.arm}.seed{record.seed}.{split}.probs.csv.gz"
                    data = table[["index", *probs]].to_csv(index=False, lineterminator="\n")
                    digest = write_gzip(folder, name, data.encode("utf-8"))
                    written.add(folder / name)
                    entry["predictions"][split]["probabilities"] = {"file": name, "sha256": digest}
        cells.append(entry)
    parents = [run_export.run_record(p.run_id) for p in queries.parent_runs(spec.name, spec.hash)]
    document = {
        "format": FORMAT,
        "protocol": {
            "name": spec.name,
            "hash": spec.hash,
            "description": spec.description,
            "arms": list(spec.arms),
            "reference": spec.reference,
            "seeds": list(spec.seeds),
            "evaluate_test": spec.evaluate_test,
            "source": spec.source,
            "canonical": spec.canonical,
        },
        "store": {"tracking_uri": study.tracking_uri, "experiment": spec.name},
        "build": {
            "hash_option": inputs.hash_option,
            "commit": inputs.commit,
            "compare": [list(pair) for pair in inputs.compare],
            "resamples": inputs.n_resamples,
            "bootstrap_seed": inputs.bootstrap_seed,
            "confidence": inputs.confidence,
            "strict": inputs.strict,
            "logged_to": list(logged_to),
            "num_classes": study.num_classes,
        }
        # Only when asked for: an export without interactions stays byte for byte what it was.
        | (
            {"interactions": [list(quad) for quad in inputs.interactions]}
            if inputs.interactions
            else {}
        ),
        "other_hashes": dict(sorted(study.other_hashes.items())),
        "parent_run_id": study.parent_run_id,
        "parents": parents,
        "cells": cells,
        "analysis_figures": [
            {
                "name": f.filename,
                "file": f"figures/analysis_{f.filename}",
                "caption": run_export.clean_text(f.caption),
                "run_id": f.run_id,
                "sha256": hashlib.sha256(f.png).hexdigest(),
            }
            for f in analysis
        ],
    }
    write_document(folder, document, _readme(spec, len(study.cells), len(cells)))
    remove_stale(folder / "predictions", "*.csv.gz", written)
    return folder


def _readme(spec: ProtocolSpec, reported: int, runs: int) -> str:
    return f"""# Evidence of {spec.name}@{spec.short_hash}

What the report beside this folder (`../report.md`) was computed from, exported by
`workbench report --evidence` when the report was built, so that anyone can check every
number and rebuild the report without the MLflow store:

```bash
workbench report --from-evidence {spec.name}/evidence --out-dir rebuilt  # run from the folder that holds {spec.name}/
```

The rebuilt `report.md` equals `../report.md` except for one added header line
("Rebuilt offline from the evidence export ..."); the analysis figures are read from `../figures/`.

- `runs.json` (format `{FORMAT}`, JSON with sorted keys): the protocol (its hashed canonical
  content and hash `{spec.hash}`), the tracking store and experiment as the report names
  them, the report's build options, all {runs} cell runs of the hash (any status: run id,
  status, start and end times in ms since the epoch, params, tags, latest metrics, and
  `metric_history`: per metric `[step, timestamp_ms, value]` rows), the parent runs, the
  cell-run counts of other hashes of the name, and the analysis figures' sha256.
- `predictions/<arm>.seed<seed>.<split>.csv.gz`: for each of the {reported} reported cells and
  each split, one row per example: `index` (position in the dataset's source split),
  `label`, `predicted` (argmax of the model's probabilities). `runs.json` gives each file's
  sha256 (of the decompressed CSV), row count, number of classes, and the sha256 of the
  predictions file the run logged to MLflow (`predictions/<split>.csv`, which also holds the
  per-example loss and probabilities).
- `predictions/<arm>.seed<seed>.<split>.probs.csv.gz`: the same examples' probabilities
  (`index`, `prob_<k>`), from which the calibration section is computed; `runs.json` gives
  each file's sha256 under `probabilities`.

Strings carry no credentials and no absolute paths: paths are relative to the directory
the report was built from. Non-finite metric values are written as "NaN", "Infinity".
"""


# --------------------------------------------------------------------------------- load


@dataclass
class Evidence:
    """A study read back from its evidence export, with what the report was built with."""

    study: StudyData
    inputs: BuildInputs
    logged_to: list[str]
    analysis: list[AnalysisFigure]


def _published(curve: dict[int, float]) -> dict[int, float | str]:
    return {step: run_export.json_number(v) for step, v in curve.items()}  # NaN equal to NaN


def _curve(points: list) -> dict[int, float]:
    """Step -> value, a step logged twice keeping its later value (as ``queries.metric_history``)."""
    return {int(step): float(value) for step, _, value in points}


def cell_record(entry: dict, where: str) -> CellRecord:
    """A published cell run read back (``where``, the file, starts any error)."""
    tags = entry["tags"]
    try:
        seed = int(tags.get("seed", ""))
    except ValueError as err:
        raise ReportError(
            f"{where}: run {entry['run_id']} has tag seed={tags.get('seed')!r}, not an integer"
        ) from err
    return CellRecord(
        run_id=entry["run_id"],
        arm=tags.get("arm", ""),
        seed=seed,
        status=entry["status"],
        commit=tags.get("git_commit", "unknown"),
        dirty=tags.get("git_dirty", "unknown"),
        start_time=int(entry["start_time"]),
        end_time=int(entry["end_time"]),
        parent_run_id=tags.get("mlflow.parentRunId", ""),
        params=dict(entry["params"]),
        metrics={k: float(v) for k, v in entry["metrics"].items()},
        tags=dict(tags),
        experiment_id=entry["experiment_id"],
    )


def read_gzip(path: Path, sha256: str) -> bytes:
    """The decompressed bytes of an exported file, checked against the sha256 ``runs.json`` records."""
    try:
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise ReportError(f"{path}: not readable ({err})") from err
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ReportError(
            f"{path}: sha256 differs from the one {RUNS_FILE} records: the file was changed"
        )
    return data


def _read_table(folder: Path, info: dict) -> pd.DataFrame:
    path = folder / info["file"]
    table = pd.read_csv(io.BytesIO(read_gzip(path, info["sha256"])))
    if tuple(table.columns) != PREDICTION_COLUMNS or len(table) != info["rows"]:
        raise ReportError(
            f"{path}: expected columns {', '.join(PREDICTION_COLUMNS)} and {info['rows']} rows"
        )
    if "probabilities" in info:  # exports since probabilities were published (calibration)
        more = folder / info["probabilities"]["file"]
        probs = pd.read_csv(io.BytesIO(read_gzip(more, info["probabilities"]["sha256"])))
        if len(probs) != len(table) or set(probs["index"]) != set(table["index"]):
            raise ReportError(f"{more}: its examples are not those of {path}")
        table = table.merge(probs, on="index", how="left", validate="one_to_one")
    return table.sort_values("index", kind="stable").reset_index(drop=True)


def _analysis(folder: Path, entries: list[dict]) -> list[AnalysisFigure]:
    """The analysis figures, from the published report's ``figures/`` beside the export."""
    out = []
    for e in entries:
        path = folder.parent / e["file"]
        if not path.is_file():
            raise ReportError(
                f"{path}: missing; the report's analysis figures are read from beside the evidence folder"
            )
        png = path.read_bytes()
        if hashlib.sha256(png).hexdigest() != e["sha256"]:
            raise ReportError(f"{path}: sha256 differs from the one {RUNS_FILE} records")
        out.append(AnalysisFigure(e["name"], e["caption"], png, e["run_id"]))
    return out


def load_evidence(folder: Path) -> Evidence:
    """The study, build options and figures of an evidence export; no MLflow store is opened.

    Raises:
        ReportError: A file is missing, damaged or of another format; the message names it.
    """
    return read_document(folder, FORMAT, _evidence)


def export_format(folder: Path) -> str:
    """The ``format`` an export's ``runs.json`` declares (which kind of report it rebuilds)."""
    return str(_document(folder).get("format"))


def _document(folder: Path) -> dict:
    path = folder / RUNS_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ReportError(f"{path}: not a readable evidence export ({err})") from err
    if not isinstance(doc, dict):
        raise ReportError(f"{path}: not an evidence export (a JSON object expected)")
    return doc


def read_document(folder: Path, expected: str, read):
    """``read(folder, doc)`` on the export's ``runs.json`` of format ``expected``; a missing key or
    another format is a ``ReportError`` naming the file."""
    path = folder / RUNS_FILE
    doc = _document(folder)
    if doc.get("format") != expected:
        raise ReportError(f"{path}: format {doc.get('format')!r}, expected {expected!r}")
    try:
        return read(folder, doc)
    except KeyError as err:
        raise ReportError(f"{path}: key {err} missing") from err


def _evidence(folder: Path, doc: dict) -> Evidence:
    where = str(folder / RUNS_FILE)
    p, build = doc["protocol"], doc["build"]
    if hashlib.sha256(canonical_json(p["canonical"]).encode()).hexdigest() != p["hash"]:
        raise ReportError(
            f"{where}: protocol.canonical does not hash to protocol.hash {p['hash'][:12]}"
        )
    if (build["bootstrap_seed"], build["confidence"]) != (tables.BOOTSTRAP_SEED, tables.CONFIDENCE):
        raise ReportError(
            f"{where}: built with bootstrap seed {build['bootstrap_seed']} and confidence "
            f"{build['confidence']}; this code uses {tables.BOOTSTRAP_SEED} and {tables.CONFIDENCE}"
        )
    spec = ProtocolSpec(
        p["name"],
        p["hash"],
        p["description"],
        tuple(p["arms"]),
        p["reference"],
        tuple(int(s) for s in p["seeds"]),
        bool(p["evaluate_test"]),
        p["source"],
        p["canonical"],
    )
    entries = {e["run_id"]: e for e in doc["cells"]}
    records = [cell_record(e, where) for e in doc["cells"]]

    def cell_data(record: CellRecord) -> CellData:
        entry = entries[record.run_id]
        if "predictions" not in entry:
            raise ReportError(
                f"{where}: run {record.run_id} ({record.arm}/seed{record.seed}) is reported but its "
                "predictions were not exported"
            )
        history = entry["metric_history"]
        return CellData(
            record,
            {split: _read_table(folder, info) for split, info in entry["predictions"].items()},
            {key: _curve(history.get(key, [])) for key in CURVE_METRICS + COST_METRICS},
            {split: info["logged_sha256"] for split, info in entry["predictions"].items()},
        )

    study = assemble_study(
        spec,
        doc["other_hashes"],
        records,
        doc["parent_run_id"],
        doc["store"]["tracking_uri"],
        build["commit"],
        cell_data,
    )
    # the logged files' probability columns, not exported
    study.num_classes = int(build["num_classes"])
    study.rebuilt_from = f"{spec.name}/{EVIDENCE_DIR}"
    inputs = BuildInputs(
        p["source"],
        p["hash"],
        build["hash_option"],
        build["commit"],
        [tuple(pair) for pair in build["compare"]],
        int(build["resamples"]),
        int(build["bootstrap_seed"]),
        float(build["confidence"]),
        bool(build["strict"]),
        [tuple(quad) for quad in build.get("interactions", [])],
    )
    return Evidence(
        study, inputs, list(build["logged_to"]), _analysis(folder, doc["analysis_figures"])
    )
