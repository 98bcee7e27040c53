"""An intervention study's evidence: its run records and per-example outcomes, and the study read back.

``workbench report --evidence`` on an intervention protocol writes ``<report folder>/evidence/``:

- ``runs.json`` (format ``workbench-intervention-evidence/1``): the protocol (its hashed
  canonical content, and the text of its file and of the acted-on protocol's file, from
  which it is parsed again and its hash checked), the store and experiment as the report
  names them, the build options, every cell run of the hash (any status: ids, status,
  times, params, tags, latest metrics), the parent runs, and per reported cell its files
  with their sha256.
- ``outcomes/<arm>.seed<seed>.csv.gz``: one row per evaluated example: ``index`` (in the
  dataset's source split), ``label``, ``intact`` (the intact model's predicted class), then
  one column per intervention, named as in the report, with the class predicted under it.
  The cell's ``runs.json`` entry holds the evaluated images per class of the split
  (``outcomes.class_counts``: ``classes``, ``counts``) where the cell logged them.
- ``attention/<arm>.seed<seed>.npy.gz``: each head's mean attention map (``.npy``, float32,
  depth x heads x rows x cols), which only the attention figure reads.
- ``README.md``: the format in words, and the command that rebuilds the report.

``load_evidence`` reads it back into the ``InterventionReadout`` the report is
rendered from, choosing one run per cell by the rule the store build uses
(``tracking.kinds.intervention_runs.choose_cells``). The shared mechanics (cleaned run records, gzip
without a timestamp, sha256 checks, atomic writes) are ``reports.evidence``'s.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd

from reports.collect import ReportError
from reports.common.evidence_parts import (
    export_acted,
    runs_item,
    ExportedReadout,
    ExportKind,
    evidence_readme,
)
from reports.evidence import (
    RUNS_FILE,
    read_gzip,
    remove_stale,
    write_gzip,
)
from reports.interventions.intervention_study import InterventionReadout
from reports.provenance import BuildInputs
from tracking.kinds import intervention_runs
from tracking.kinds.attribution_runs import npz_bytes
from tracking.record import queries
from workbench.protocol import load_intervention_protocol
from workbench.sample import ClassCounts

FORMAT = "workbench-intervention-evidence/1"
FIXED_COLUMNS = ("index", "label", "intact")


def _outcome_bytes(cell: intervention_runs.InterventionCellResult) -> bytes:
    """The cell's outcomes as CSV text: one row per example, one column per intervention."""
    n = len(cell.labels)
    # -1: the run logged no indices
    indices = cell.indices if cell.indices is not None else np.full(n, -1)
    # (N, 3 + K)
    table = pd.DataFrame(
        np.column_stack([indices, cell.labels, cell.intact_predicted, cell.predicted.T]).astype(
            "int64"
        ),
        columns=[*FIXED_COLUMNS, *cell.names],
    )
    return table.to_csv(index=False, lineterminator="\n").encode("utf-8")


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array, dtype=np.float32), allow_pickle=False)
    return buffer.getvalue()


def export_evidence(
    folder: Path, study: InterventionReadout, inputs: BuildInputs, logged_to: list[str]
) -> Path:
    """Write ``folder`` (``runs.json``, ``outcomes/``, ``attention/``, ``README.md``) for ``study`` as reported."""
    written = export_acted(folder, FORMAT, study, inputs, logged_to, _write_cell, _readme)
    for sub, pattern in (
        ("outcomes", "*.csv.gz"),
        ("attention", "*.npy.gz"),
        ("patching", "*.npz.gz"),
    ):
        remove_stale(folder / sub, pattern, written)
    return folder


def _write_cell(
    folder: Path,
    entry: dict,
    record: queries.CellRecord,
    cell: intervention_runs.InterventionCellResult,
) -> set[Path]:
    """The reported cell's outcomes, attention maps and patching arrays, named in its ``entry``."""
    written = set()
    stem = f"{record.arm}.seed{record.seed}"
    name = f"outcomes/{stem}.csv.gz"
    entry["outcomes"] = {
        "file": name,
        "sha256": write_gzip(folder, name, _outcome_bytes(cell)),
        "rows": len(cell.labels),
        "interventions": list(cell.names),
        "indices_logged": cell.indices is not None,
    }
    if cell.counts is not None:
        entry["outcomes"]["class_counts"] = {
            "classes": [int(c) for c in cell.counts.classes],
            "counts": [int(n) for n in cell.counts.counts],
        }
    written.add(folder / name)
    if cell.attention is not None:
        name = f"attention/{stem}.npy.gz"
        entry["attention"] = {
            "file": name,
            "sha256": write_gzip(folder, name, _npy_bytes(cell.attention)),
            "shape": list(cell.attention.shape),
            "query": cell.attention_query,
        }
        written.add(folder / name)
    if cell.patching is not None:
        name = f"patching/{stem}.npz.gz"
        entry["patching"] = {
            "file": name,
            "sha256": write_gzip(folder, name, npz_bytes(cell.patching)),
            "arrays": sorted(cell.patching),
        }
        written.add(folder / name)
    return written


def _readme(name: str, digest: str, reported: int, runs: int) -> str:
    return evidence_readme(
        name,
        digest,
        "intervention",
        f"""
{runs_item(FORMAT, digest, runs)}`accuracy/<name>` of
  each intervention), the parent runs, and per reported cell its files below with their
  sha256 (of the decompressed bytes).
- `outcomes/<arm>.seed<seed>.csv.gz`: for each of the {reported} reported cells, one row per
  evaluated example: `index` (position in the dataset's source split; -1 where the run logged
  none), `label`, `intact` (the class the intact model predicted), then one column per
  intervention, named as in the report, with the class predicted under that intervention
  alone. Every accuracy change, interval and seed count of the report comes from these
  (each cell logged them to MLflow as `interventions/per_example.npz`, which also holds
  per-example losses; the report uses none). The cell's entry in `runs.json` names, under
  `outcomes.class_counts`, the split's classes and the evaluated images of each (exports made
  before these were logged lack it; their report has no "Scored images" section).
- `attention/<arm>.seed<seed>.npy.gz`: each head's mean attention map on the evaluation
  images (NumPy `.npy`, float32, blocks x heads x rows x columns), drawn in the attention figure.
- `patching/<arm>.seed<seed>.npz.gz` (cells that patched): `interventions/patching.npz` as
  logged: per pair the clean and corrupted logit differences and probabilities, and under
  every patch `resid_*` (pairs, blocks, tokens), `branch_*` (pairs, blocks, 2), `head_*`
  (pairs, blocks, heads) for denoising (clean into the corrupted run) and `noising_*` the same
  for noising (corrupted into the clean run); `resid_reads` (blocks, tokens), the positions the
  readout depends on; the pairs (`clean_index`, `source_index`, labels, `replaced`), and
  `sample_classes`, `class_counts` (the split's classes and the clean images of each). Exports
  made before noising existed lack `noising_*` and `resid_reads`; before the counts were
  logged, `sample_classes` and `class_counts`. Cells that ran attribution patching also hold
  `atp_*`, `atp_ig_*` and the control `atp_shuffled_*` in the same layout (the estimated
  patched logit differences), `*_position_branch_change` and `*_position_head_change` (each
  branch's and head's estimated change per token position, mean over pairs),
  `random_scores` (draws, locations), and the passes and seconds of each method
  (`*_passes`, `*_seconds`, `exact_passes`, `exact_seconds`).
""",
    )


# --------------------------------------------------------------------------------- load


def _cell(
    folder: Path, record: queries.CellRecord, entry: dict
) -> intervention_runs.InterventionCellResult:
    info = entry["outcomes"]
    path = folder / info["file"]
    table = pd.read_csv(io.BytesIO(read_gzip(path, info["sha256"])))
    names = list(info["interventions"])
    if list(table.columns) != [*FIXED_COLUMNS, *names] or len(table) != info["rows"]:
        raise ReportError(
            f"{path}: expected columns {', '.join(FIXED_COLUMNS)} and the {len(names)} interventions "
            f"{RUNS_FILE} lists, {info['rows']} rows"
        )
    values = table.to_numpy(dtype=np.int64)  # (N, 3 + K)
    counted = info.get("class_counts")  # absent from exports made before the counts were logged
    counts = (
        ClassCounts(np.array(counted["classes"]), np.array(counted["counts"])) if counted else None
    )
    attention, query = None, ""
    if "attention" in entry:
        a = entry["attention"]
        attention = np.load(
            io.BytesIO(read_gzip(folder / a["file"], a["sha256"])), allow_pickle=False
        )
        query = a["query"]
    patching = None
    if "patching" in entry:
        p = entry["patching"]
        with np.load(
            io.BytesIO(read_gzip(folder / p["file"], p["sha256"])), allow_pickle=False
        ) as z:
            patching = {k: z[k] for k in z.files}
        if sorted(patching) != p["arrays"]:
            raise ReportError(f"{folder / p['file']}: expected the arrays {', '.join(p['arrays'])}")
    return intervention_runs.InterventionCellResult(
        record,
        names,
        values[:, 1],
        values[:, 2],
        values[:, 3:].T,
        attention,
        query,
        values[:, 0] if info["indices_logged"] else None,
        patching,
        counts,
    )


EXPORT = ExportKind(load_intervention_protocol, InterventionReadout, "outcomes", _cell)


def load_evidence(folder: Path) -> ExportedReadout:
    """The intervention export in ``folder`` read back (``ExportKind.read``); no MLflow store is opened."""
    return EXPORT.read(folder, FORMAT)
