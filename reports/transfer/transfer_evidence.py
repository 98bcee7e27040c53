"""A transfer study's evidence: its run records and logged predictions, and the study read back.

``workbench report --evidence`` on a transfer protocol writes ``<report folder>/evidence/``:

- ``runs.json`` (format ``workbench-transfer-evidence/1``): the protocol (its hashed canonical
  content and the text of its file, parsed again and hash-checked by a rebuild), the store and
  experiment as the report names them, the build options, the newest execution's parent run
  (its ``source.*`` params: what the source weights are, their run, sha256 and whether they are
  a published pretrained checkpoint; its ``transfer.*`` and ``evaluation.*`` params: classes,
  regimes, reference, the bootstrap's resamples, confidence and seed), the source in a few
  plain keys, every parent run of the hash, every cell run of the hash (any status: ids,
  status, times, params, tags, latest metrics), and per reported cell its files with their
  sha256 and its per-epoch curves.
- ``predictions/<regime>.seed<seed>.<split>.csv.gz``: per reported cell the ``predictions/<split>.csv``
  it logged (``val``: the selected epoch on validation; ``test``: the one test evaluation), byte
  for byte: ``index, label, predicted, loss, prob_*``.
- ``README.md``: the format in words, and the command that rebuilds the report.

``load_transfer_evidence`` reads it back into the ``TransferReportData`` the report is rendered
from, choosing one run per cell by the rule the store build uses
(``tracking.kinds.transfer_runs.choose_cells``). The shared mechanics (cleaned run records, gzip
without a timestamp, sha256 checks, atomic writes) are ``reports.evidence``'s.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

from reports.collect import ReportError
from reports.common.evidence_parts import (
    evidence_document,
    evidence_readme,
    exported_inputs,
    exported_protocol,
    exported_records,
)
from reports.evidence import (
    EVIDENCE_DIR,
    RUNS_FILE,
    cell_entry,
    read_document,
    read_gzip,
    remove_stale,
    write_document,
    write_gzip,
)
from reports.provenance import BuildInputs
from reports.transfer.transfer_data import ReportedCell, TransferReportData
from tracking.export import run_export
from tracking.kinds import transfer_runs
from tracking.record.schema import SOURCE_IDENTITY
from workbench.protocol import load_transfer_protocol
from workbench.train.evaluate import read_predictions

FORMAT = "workbench-transfer-evidence/1"
# The source in plain keys (from the execution's source.* params): what a reader checks first.
SOURCE_KEYS = (
    "label",
    "kind",
    "pretrained",
    "provenance",
    "description",
    "uri",
    "run_id",
    "sha256",
    "architecture",
    "norm_from",
)


def source_summary(execution: dict) -> dict[str, str]:
    """The source weights as the execution logged them: run, sha256, description, and whether they are a
    published pretrained checkpoint (``pretrained``: "True" only for a pinned timm hub checkpoint)."""
    params = execution["params"]
    return {k: params.get(f"source.{k}", "") for k in SOURCE_KEYS}


def _curve_rows(curve: dict[int, float]) -> list[list]:
    return [[int(step), run_export.json_number(value)] for step, value in sorted(curve.items())]


def export_transfer_evidence(
    folder: Path, data: TransferReportData, inputs: BuildInputs, logged_to: list[str]
) -> Path:
    """Write ``folder`` (``runs.json``, ``predictions/``, ``README.md``) for ``data`` as reported."""
    protocol, cells, written = data.protocol, [], set()
    reported = {c.record.run_id: key for key, c in data.cells.items()}
    for record in sorted(data.records, key=lambda r: (r.arm, r.seed, r.run_id)):
        entry = cell_entry(record)
        if record.run_id in reported:
            cell = data.cells[reported[record.run_id]]
            entry["predictions"] = {}
            for split, raw in sorted(cell.files.items()):
                name = f"predictions/{record.arm}.seed{record.seed}.{split}.csv.gz"
                entry["predictions"][split] = {
                    "file": name,
                    "sha256": write_gzip(folder, name, raw),
                    "rows": len(read_predictions(io.BytesIO(raw))),
                    "logged_file": f"predictions/{split}.csv",
                }
                written.add(folder / name)
            entry["curves"] = {k: _curve_rows(v) for k, v in sorted(cell.curves.items())}
        cells.append(entry)
    protocol_file = {"name": f"{protocol.name}.yaml", "text": data.protocol_text}
    document = evidence_document(
        FORMAT,
        {
            "name": protocol.name,
            "hash": data.digest,
            "source": data.source,
            "canonical": protocol.canonical,
            "file": protocol_file,
        },
        tracking_uri=data.tracking_uri,
        inputs=inputs,
        logged_to=logged_to,
        parents=data.parents,
        cells=cells,
    )
    document["execution"] = data.execution
    document["source"] = source_summary(data.execution)
    write_document(
        folder, document, _readme(protocol.name, data.digest, len(data.cells), len(cells))
    )
    remove_stale(folder / "predictions", "*.csv.gz", written)
    return folder


def _readme(name: str, digest: str, reported: int, runs: int) -> str:
    return evidence_readme(
        name,
        digest,
        "transfer",
        f"""
- `runs.json` (format `{FORMAT}`, JSON with sorted keys): the protocol (its hashed canonical
  content, hash `{digest}`, and the text of its file, which a rebuild parses again and checks
  against the hash), the tracking store and experiment as the report names them, the build
  options and the run the report was logged to; `execution`: the newest execution's parent
  run, whose tag `source_identity` picks the cells the report shows and whose params are the
  section's settings (`transfer.num_classes`, `transfer.regimes`, `transfer.reference`, and
  the bootstrap's `evaluation.n_resamples`, `evaluation.confidence`, `evaluation.seed`) and
  the source (`source.*`); `source`: the same source in plain keys (`kind`, `pretrained`:
  "True" only for a published pretrained checkpoint, `provenance` in words, `run_id` of the
  run that trained it if any, `sha256` of its weights, `description`); `parents`: every
  parent run of the hash; `cells`: all {runs} cell runs of the hash (any status: run id,
  status, start and end times in ms since the epoch, params, tags (`arm` is the regime),
  latest metrics: `test_qwk`, `test_accuracy`, `test_macro_f1`, `test_recall_<k>` and their
  logged intervals, `best_epoch`, `best_val_qwk`, `selection_seconds`), and per reported cell
  its files below with their sha256 (of the decompressed bytes) and `curves`: the per-epoch
  metrics the curves and the cost table read, as `[epoch, value]` rows.
- `predictions/<regime>.seed<seed>.<split>.csv.gz`: for each of the {reported} reported cells,
  the `predictions/<split>.csv` the run logged, byte for byte (`index` in the dataset's split,
  `label`, `predicted`, `loss`, `prob_<k>`): `val` at the epoch selected on validation QWK,
  `test` from the one test evaluation. Every test metric, bootstrap interval, paired
  difference and confusion matrix of the report is computed from the `test` files.
""",
        ' Non-finite metric values are written as "NaN", "Infinity".',
    )


# --------------------------------------------------------------------------------- load


@dataclass
class TransferEvidence:
    """A transfer study read back from its evidence export, with what the report was built with."""

    data: TransferReportData
    inputs: BuildInputs
    logged_to: list[str]


def _curve(rows: list) -> dict[int, float]:
    return {int(step): float(value) for step, value in rows}  # float("NaN") reads "NaN" back


def _cell(folder: Path, where: str, record, entry: dict) -> ReportedCell:
    if "predictions" not in entry or "test" not in entry["predictions"]:
        raise ReportError(
            f"{where}: run {record.run_id} ({record.arm}/seed{record.seed}) is reported but its "
            "test predictions were not exported"
        )
    files = {}
    for split, info in entry["predictions"].items():
        raw = read_gzip(folder / info["file"], info["sha256"])
        if len(read_predictions(io.BytesIO(raw))) != info["rows"]:
            raise ReportError(f"{folder / info['file']}: expected {info['rows']} rows")
        files[split] = raw
    return ReportedCell(record, files, {k: _curve(v) for k, v in entry.get("curves", {}).items()})


def _evidence(folder: Path, doc: dict) -> TransferEvidence:
    where = str(folder / RUNS_FILE)
    p, build, execution = doc["protocol"], doc["build"], doc["execution"]
    protocol = exported_protocol(where, p, load_transfer_protocol)
    if doc["source"] != source_summary(execution):
        raise ReportError(f"{where}: source differs from the execution's source.* params")
    entries, records = exported_records(folder, doc)
    chosen = transfer_runs.choose_cells(records, execution["tags"].get(SOURCE_IDENTITY, ""))
    if not chosen:
        raise ReportError(
            f"{where}: no finished cell run of the execution's source: nothing to rebuild"
        )
    cells = {key: _cell(folder, where, r, entries[r.run_id]) for key, r in chosen.items()}
    data = TransferReportData(
        protocol,
        p["file"]["text"],
        p["hash"],
        p["source"],
        execution,
        [parent["run_id"] for parent in doc["parents"]],
        records,
        cells,
        doc["store"]["tracking_uri"],
        f"{protocol.name}/{EVIDENCE_DIR}",
    )
    confidence = float(build["confidence"])
    if not math.isfinite(confidence):
        raise ReportError(f"{where}: build.confidence {build['confidence']!r} is not a number")
    inputs = exported_inputs(p, build, int(build["bootstrap_seed"]), confidence)
    return TransferEvidence(data, inputs, list(build["logged_to"]))


def load_transfer_evidence(folder: Path) -> TransferEvidence:
    """The study and build options of a transfer evidence export; no MLflow store is opened.

    Raises:
        ReportError: A file is missing, damaged or of another format; the message names it.
    """
    return read_document(Path(folder), FORMAT, _evidence)
