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
  zip timestamps (``tracking.kinds.attribution_runs.npz_bytes``), so the same arrays give the
  same bytes.
- ``README.md``: the format in words, and the command that rebuilds the report.

``load_evidence`` reads it back into the ``AttributionReadout`` the report is rendered
from, choosing one run per cell by the rule the store build uses
(``tracking.kinds.intervention_runs.choose_cells``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from reports.attribution.attribution_study import AttributionReadout
from reports.collect import ReportError
from reports.common.evidence_parts import (
    export_acted,
    runs_item,
    ExportedReadout,
    ExportKind,
    evidence_readme,
)
from reports.evidence import (
    FILE_MODE,
    RUNS_FILE,
    remove_stale,
)
from reports.provenance import BuildInputs
from tracking.kinds import attribution_runs
from tracking.kinds.attribution_runs import npz_bytes
from tracking.record import queries
from workbench.atomic import atomic_write_bytes
from workbench.protocol import load_attribution_protocol

FORMAT = "workbench-attribution-evidence/1"


def export_evidence(
    folder: Path, study: AttributionReadout, inputs: BuildInputs, logged_to: list[str]
) -> Path:
    """Write ``folder`` (``runs.json``, ``arrays/``, ``README.md``) for ``study`` as reported."""
    written = export_acted(folder, FORMAT, study, inputs, logged_to, _write_arrays, _readme)
    remove_stale(folder / "arrays", "*.npz", written)
    return folder


def _write_arrays(
    folder: Path,
    entry: dict,
    record: queries.CellRecord,
    cell: attribution_runs.AttributionCellResult,
) -> set[Path]:
    """The reported cell's arrays as ``arrays/<arm>.seed<seed>.npz``, named in its ``entry``."""
    name = f"arrays/{record.arm}.seed{record.seed}.npz"
    data = npz_bytes(cell.arrays)
    atomic_write_bytes(folder / name, data, FILE_MODE)
    entry["arrays"] = {
        "file": name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "shapes": {k: list(np.shape(v)) for k, v in sorted(cell.arrays.items())},
    }
    return {folder / name}


def _readme(name: str, digest: str, reported: int, runs: int) -> str:
    keys = ", ".join(f"`{k}`" for k in attribution_runs.PER_IMAGE_KEYS)
    per_method = ", ".join(f"`{k}/<method>`" for k in attribution_runs.METHOD_ARRAYS)
    return evidence_readme(
        name,
        digest,
        "attribution",
        f"""
{runs_item(FORMAT, digest, runs)}`rho/<method>`,
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
  `random_draws/insertion_auc` (D, N), one row per random draw; the model-randomisation check of
  Adebayo et al. 2018: `sanity_layers` (S,) the layers from the logits down (head, final norm, last
  block, ..., first block, embeddings) and `sanity_cascade/<metric>/<method>` (S, N), step k with
  the first k + 1 layers re-initialised (nested: one draw), `sanity_independent/<metric>/<method>`
  (S, N), only layer k re-initialised, each with metric `rho`, `abs_rho` (Spearman rho of the
  absolute values) and `ssim`, the map of the randomised model against the trained model's (an
  older export holds `sanity/<method>` (L, N) instead: rho with the top 1..L
  blocks replaced by fresh noise per step, head, final norm and embeddings trained).
  Exported since the sample rule
  (docs/attribution.md, "Which images"): `sample_classes` and `class_counts` (C,), the scored images
  per class of the evaluated split (0 for a class with none); and the high-norm detector's planted
  positive control, `norm_control/ratios` and `norm_control/flagged` (R,) (the share of images
  whose planted token was flagged at each planted ratio), `norm_control/others_flagged` (R,),
  `norm_control/clean_flagged`, `norm_control/block`, `norm_control/position`, `norm_control/images`.
  Every number, interval and figure of the report comes from these.
""",
    )


# --------------------------------------------------------------------------------- load


def exported_cell(
    folder: Path, record: queries.CellRecord, entry: dict
) -> attribution_runs.AttributionCellResult:
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
    return attribution_runs.AttributionCellResult(record, arrays)


EXPORT = ExportKind(load_attribution_protocol, AttributionReadout, "arrays", exported_cell)


def load_evidence(folder: Path) -> ExportedReadout:
    """The attribution export in ``folder`` read back (``ExportKind.read``); no MLflow store is opened."""
    return EXPORT.read(folder, FORMAT)
