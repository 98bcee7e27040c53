"""An attribution study's evidence: its run records and per-image arrays, and the study read back.

``workbench report --evidence`` on an attribution protocol writes ``<report folder>/evidence/``:

- ``runs.json`` (format ``workbench-attribution-evidence/1``): the protocol (its hashed
  canonical content, and the text of its file and of the acted-on protocol's file, from which
  it is parsed again and its hash checked), the store and experiment as the report names them,
  the build options, every cell run of the hash (any status: ids, status, times, params, tags,
  latest metrics), the parent runs, and per reported cell its arrays file with its sha256 and
  the names and shapes of the arrays in it.
- ``arrays/<arm>.seed<seed>.npz``: the reported cell's ``attribution/per_image.npz`` arrays
  (``tracking.kinds.attribution_runs.per_image_arrays``), written as a NumPy ``.npz`` with fixed
  zip timestamps, so the same arrays give the same bytes.
- ``README.md``: the format in words, and the command that rebuilds the report.

``load_attribution_evidence`` reads it back into the ``AttributionStudy`` the report is rendered
from, choosing one run per cell by the rule the store build uses
(``tracking.kinds.intervention_runs.choose_cells``).
"""

from __future__ import annotations

import hashlib
import io
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reports.attribution.attribution_study import AttributionStudy
from reports.collect import ReportError
from reports.evidence import (
    EVIDENCE_DIR,
    FILE_MODE,
    RUNS_FILE,
    cell_entry,
    cell_record,
    read_document,
    remove_stale,
    write_document,
)
from reports.provenance import BuildInputs
from tracking.export import run_export
from tracking.kinds import attribution_runs
from tracking.kinds.intervention_runs import choose_cells
from tracking.record import queries
from workbench.atomic import atomic_write_bytes
from workbench.protocol import ProtocolError, load_attribution_protocol

FORMAT = "workbench-attribution-evidence/1"
FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the zip format's earliest date: no build time in the bytes


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """``arrays`` as an ``.npz`` (deflated, keys sorted, fixed timestamps) that ``numpy.load`` reads."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        for key in sorted(arrays):
            body = io.BytesIO()
            np.save(body, np.asarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, body.getvalue(), compresslevel=9)
    return buffer.getvalue()


def _protocol_files(study: AttributionStudy) -> dict[str, str]:
    """The protocol file and the acted-on protocol's file, by file name: what parses to the hash again."""
    path = Path(study.protocol.source_file)
    files = {path.name: path.read_text(encoding="utf-8")}
    if study.protocol.acts_on is not None:
        acted = path.parent / f"{study.protocol.acts_on.protocol}.yaml"
        files[acted.name] = acted.read_text(encoding="utf-8")
    return files


def export_attribution_evidence(
    folder: Path, study: AttributionStudy, inputs: BuildInputs, logged_to: list[str]
) -> Path:
    """Write ``folder`` (``runs.json``, ``arrays/``, ``README.md``) for ``study`` as reported."""
    protocol, cells, written = study.protocol, [], set()
    reported = {r.run_id: key for key, r in study.chosen.items()}
    for record in sorted(study.records, key=lambda r: (r.arm, r.seed, r.run_id)):
        entry = cell_entry(record)
        if record.run_id in reported:
            arrays = study.cells[reported[record.run_id]].arrays
            name = f"arrays/{record.arm}.seed{record.seed}.npz"
            data = npz_bytes(arrays)
            atomic_write_bytes(folder / name, data, FILE_MODE)
            written.add(folder / name)
            entry["arrays"] = {
                "file": name,
                "sha256": hashlib.sha256(data).hexdigest(),
                "shapes": {k: list(np.shape(v)) for k, v in sorted(arrays.items())},
            }
        cells.append(entry)
    document = {
        "format": FORMAT,
        "protocol": {
            "name": protocol.name,
            "hash": study.digest,
            "source": inputs.protocol_source,
            "canonical": protocol.canonical,
            "files": _protocol_files(study),
        },
        "store": {"tracking_uri": study.tracking_uri, "experiment": protocol.name},
        "build": {
            "hash_option": inputs.hash_option,
            "resamples": inputs.n_resamples,
            "bootstrap_seed": inputs.bootstrap_seed,
            "confidence": inputs.confidence,
            "strict": inputs.strict,
            "logged_to": list(logged_to),
        },
        "parents": [
            run_export.run_record(p.run_id)
            for p in queries.parent_runs(protocol.name, study.digest)
        ],
        "cells": cells,
    }
    write_document(
        folder, document, _readme(protocol.name, study.digest, len(study.chosen), len(cells))
    )
    remove_stale(folder / "arrays", "*.npz", written)
    return folder


def _readme(name: str, digest: str, reported: int, runs: int) -> str:
    keys = ", ".join(f"`{k}`" for k in attribution_runs.PER_IMAGE_KEYS)
    per_method = ", ".join(f"`{k}/<method>`" for k in attribution_runs.METHOD_ARRAYS)
    return f"""# Evidence of {name}@{digest[:12]}

What the attribution report beside this folder (`../report.md`) was computed from, exported
by `workbench report --evidence` from the runs the report was built from, so that anyone can
check every number and rebuild the report (its tables, paragraphs and figures) without the
MLflow store:

```bash
workbench report --from-evidence {name}/evidence --out-dir rebuilt  # run from the folder that holds {name}/
```

The rebuilt `report.md` equals `../report.md` except for one added header line
("Rebuilt offline from the evidence export ...").

- `runs.json` (format `{FORMAT}`, JSON with sorted keys): the protocol (its hashed
  canonical content, hash `{digest}`, and the text of its file and of the acted-on
  protocol's file, which a rebuild parses again and checks against the hash), the tracking
  store and experiment as the report names them, the build options and the run the report
  was logged to, all {runs} cell runs of the hash (any status: run id, status, start and end
  times in ms since the epoch, params, tags, latest metrics, among them `rho/<method>`,
  `deletion_auc/<method>` and `insertion_auc/<method>`), the parent runs, and per reported
  cell its arrays file below with its sha256 and every array's shape.
- `arrays/<arm>.seed<seed>.npz`: for each of the {reported} reported cells, the arrays it
  logged to MLflow as `attribution/per_image.npz` (read them with `numpy.load`): {keys};
  per method {per_method}. N images, P patch tokens, F curve points, L blocks: scores,
  `effects` (log p(y) of the intact model minus log p(y) without that one patch token) and
  `cls_attention` are (N, P); `rho/<method>` (N,) (NaN where undefined); curves (N, F) over
  `fractions` (F,); `norms` (L, N, P) and `prefix_norms` (L, N, prefix); `example_images`
  the first scored images as the dataset holds them (uint8, E x C x H x W); how concentrated the class
  token's attention is per block (`workbench.attribution.concentration`), block first: `cls_attention_top1`,
  `cls_attention_topk` (the top `attention_top_k` patch tokens), `cls_attention_entropy` (normalised, over the
  patches), `cls_attention_on_self`, `cls_attention_on_registers` (L, N), and per head the `*_heads` arrays
  (L, N, H); an export made before these arrays existed lacks them, and its report has no concentration
  section. With the controls (protocol settings `random_draws`, `sanity_check`; docs/attribution.md):
  `insertion_start_predicted` and `insertion_start_prob` (N,), the class predicted from the class token
  alone and its probability; `random_draws/rho`, `random_draws/deletion_auc` and
  `random_draws/insertion_auc` (D, N), one row per random draw; `sanity/<method>` (L, N), each map's
  Spearman rho with itself with the top 1..L blocks randomised. Every number, interval and figure of
  the report comes from these.

Strings carry no credentials and no absolute paths: paths are relative to the directory
the report was built from.
"""


# --------------------------------------------------------------------------------- load


@dataclass
class AttributionEvidence:
    """An attribution study read back from its evidence export, with what the report was built with."""

    study: AttributionStudy
    inputs: BuildInputs
    logged_to: list[str]


def _protocol(where: str, p: dict):
    """The protocol parsed again from the exported files, its hash checked against the recorded one."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in p["files"].items():
            if Path(name).name != name:
                raise ReportError(f"{where}: protocol file name {name!r} is not a plain file name")
            (Path(tmp) / name).write_text(text, encoding="utf-8")
        try:
            protocol = load_attribution_protocol(Path(tmp) / f"{p['name']}.yaml")
        except ProtocolError as err:
            raise ReportError(f"{where}: the exported protocol does not parse ({err})") from err
    if protocol.hash != p["hash"] or protocol.canonical != p["canonical"]:
        raise ReportError(
            f"{where}: the exported protocol file hashes to {protocol.hash[:12]}, not protocol.hash "
            f"{p['hash'][:12]}"
        )
    return protocol


def exported_cell(
    folder: Path, record: queries.CellRecord, entry: dict
) -> attribution_runs.CellResult:
    info = entry["arrays"]
    path = folder / info["file"]
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ReportError(
            f"{path}: cannot read the exported arrays ({err.strerror or err})"
        ) from err
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise ReportError(
            f"{path}: sha256 differs from {RUNS_FILE}: the file was changed or damaged"
        )
    arrays = attribution_runs.read_npz(data)
    shapes = {k: list(np.shape(v)) for k, v in sorted(arrays.items())}
    if shapes != info["shapes"]:
        raise ReportError(f"{path}: its arrays are not the ones {RUNS_FILE} lists")
    return attribution_runs.CellResult(record, arrays)


def _evidence(folder: Path, doc: dict) -> AttributionEvidence:
    where = str(folder / RUNS_FILE)
    p, build = doc["protocol"], doc["build"]
    protocol = _protocol(where, p)
    entries = {e["run_id"]: e for e in doc["cells"]}
    records = [cell_record(e, where) for e in doc["cells"]]
    chosen = choose_cells(records)
    if not chosen:
        raise ReportError(f"{where}: no finished cell run: nothing to rebuild")
    lacking = [
        f"{r.arm}/seed{r.seed} ({r.run_id})"
        for r in chosen.values()
        if "arrays" not in entries[r.run_id]
    ]
    if lacking:
        raise ReportError(
            f"{where}: reported cells whose arrays were not exported: {', '.join(lacking)}"
        )
    cells = {key: exported_cell(folder, r, entries[r.run_id]) for key, r in chosen.items()}
    study = AttributionStudy(
        protocol,
        p["hash"],
        chosen,
        records,
        cells,
        doc["store"]["tracking_uri"],
        f"{protocol.name}/{EVIDENCE_DIR}",
    )
    e = (
        protocol.evaluation
    )  # the bootstrap seed and confidence are the protocol's: its hash is checked above
    inputs = BuildInputs(
        p["source"],
        p["hash"],
        build["hash_option"],
        None,
        [],
        int(build["resamples"]),
        e.seed,
        e.confidence,
        bool(build["strict"]),
    )
    return AttributionEvidence(study, inputs, list(build["logged_to"]))


def load_attribution_evidence(folder: Path) -> AttributionEvidence:
    """The study and build options of an attribution evidence export; no MLflow store is opened.

    Raises:
        ReportError: A file is missing, damaged or of another format; the message names it.
    """
    return read_document(Path(folder), FORMAT, _evidence)
