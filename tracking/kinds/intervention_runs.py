"""MLflow side of intervention studies: the acted-on cells read back, what a cell logs, the report's inputs.

Layout, as for ablations: one experiment per intervention protocol; one parent run per study
(protocol hash + training code fingerprint, tag ``intervention=true``); a child run per acted-on
model (arm, seed), tagged ``cell=true``, ``arm``, ``seed``, ``source_run_id`` (the trained cell)
and keyed by ``run_key`` = protocol hash, arm, seed, the acted-on weights (the trained cell's
run id, or the pretrained weights' sha256), data and split fingerprints and
``intervention_code_fingerprint()``. A child logs, per intervention ``<name>``:
``accuracy/<name>``, ``loss/<name>``, ``accuracy_change/<name>``, ``loss_change/<name>``
(``source_agreement/<name>`` for patches), plus ``intact_accuracy``, ``intact_loss``, the
reload proof and the wall time; and the artifacts ``interventions/per_example.npz``
(compressed: every example's class, loss and correctness, intact and under each
intervention), ``interventions/attention.npz`` (each head's mean attention map) and
``interventions/summary.json``.
"""

from __future__ import annotations

import io
import json
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

from tracking.kinds.figure_runs import CellArtifacts, load_cell
from tracking.kinds.transfer_runs import find_finished_cell
from tracking.record import queries
from tracking.record.queries import CellRecord
from tracking.record.schema import PROTOCOL_NAME
from tracking.record.sink import RunSink
from tracking.store.session import configure_tracking
from workbench.code_history import same_code
from workbench.interventions.evaluate import Evaluation
from workbench.sample import ClassCounts
from workbench.train.evaluate import ReloadProof
from workbench.train.fingerprint import PROJECT_ROOT, TRAINING_ROOTS, closure_fingerprint

ARTIFACT_DIR = "interventions"
PER_EXAMPLE = f"{ARTIFACT_DIR}/per_example.npz"
ATTENTION = f"{ARTIFACT_DIR}/attention.npz"
SUMMARY = f"{ARTIFACT_DIR}/summary.json"
PATCHING = f"{ARTIFACT_DIR}/patching.npz"
# Where the intervention kind's code identity starts (``workbench.train.fingerprint``): the
# training roots (the acted-on model and data) and the interventions library, whose import
# closure (the precision and input rule of ``workbench.interventions.evaluate``, the source
# adapter of ``workbench.transfer.source_model``) is hashed with them. The summary rows the
# report reads and the benchmark only read results: they start nothing.
INTERVENTION_ROOTS = TRAINING_ROOTS + ("workbench/interventions",)
INTERVENTION_READ_SIDE = (
    "workbench/interventions/summary.py",
    "workbench/interventions/benchmark.py",
)


def intervention_fingerprint(
    root: Path = PROJECT_ROOT, versions: dict[str, str] | None = None
) -> str:
    """The intervention kind's fingerprint of the checkout at ``root`` (``closure_fingerprint``)."""
    return closure_fingerprint(INTERVENTION_ROOTS, root, versions, INTERVENTION_READ_SIDE)


@lru_cache(maxsize=1)
def intervention_code_fingerprint() -> str:
    """This checkout's intervention code identity, once per process (part of every cell's key)."""
    return intervention_fingerprint()


# ---------------------------------------------------------------- the acted-on cells


def trained_cell(
    protocol_name: str, protocol_hash: str, arm: str, seed: int, workdir: Path
) -> CellArtifacts:
    """The newest finished run of a trained cell with its config, best checkpoint and saved predictions.

    Raises:
        workbench.transfer.source_model.SourceError: No finished run of that cell (says what to run).
        tracking.kinds.figure_runs.FiguresError: The run lacks its checkpoint, config or predictions.
    """
    run_id = find_finished_cell(protocol_name, protocol_hash, arm, seed)
    return load_cell(MlflowClient().get_run(run_id), workdir)


# ---------------------------------------------------------------- what a cell logs


def _artifact(sink: RunSink, folder: Path, name: str, data: bytes) -> None:
    path = folder / name
    path.write_bytes(data)
    sink.log_artifact(path, artifact_path=ARTIFACT_DIR)


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def log_cell(
    sink: RunSink,
    ev: Evaluation,
    proof: ReloadProof | None,
    reference: np.ndarray | None,
    extra: dict,
    check=lambda: None,
    patching=None,
    counts: ClassCounts | None = None,
) -> None:
    """Metrics per intervention, the per-example outcomes, the attention maps and a summary; ``check`` fences writes.

    ``counts``: the evaluated images per class of the split, logged in ``per_example.npz`` as
    ``sample_classes`` and ``class_counts`` (what the report's "Scored images" reads).

    ``patching``: ``(PatchingResult, pairs)`` from ``patch_split``, logged as
    ``interventions/patching.npz`` (every pair's logit differences and probabilities under
    every patch, denoising and noising, and ``resid_reads``) with the branches' restored
    (denoising) and removed (noising) fractions as metrics. With attribution patching the
    pairs' dict also holds the AtP / AtP-IG arrays (``atp_resid_ld``, ...), and a third item
    holds their scores against the exact grid, logged as metrics.
    """
    metrics = {
        "intact_accuracy": ev.intact_accuracy,
        "intact_loss": float(ev.intact_loss.astype(np.float64).mean()),
        "evaluation_seconds": ev.seconds,
        "interventions": len(ev.names),
        "examples": len(ev.labels),
    }
    if proof is not None:
        metrics |= {
            "reload_proof_passed": float(proof.passed),
            "reload_proof_max_abs_diff": proof.max_abs_prob_diff,
        }
    per = ev.metrics()
    for name, values in per.items():
        metrics |= {f"{key}/{name}": value for key, value in values.items()}
    if patching is not None:
        metrics |= _patching_metrics(patching[0])
        metrics |= patching[2] if len(patching) > 2 else {}
    check()
    sink.log_lacking_metrics(metrics)  # a cell continued in place logs only what its run lacks
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        check()
        _artifact(
            sink,
            folder,
            "per_example.npz",
            _npz(
                names=np.array(ev.names),
                labels=ev.labels,
                indices=ev.indices,
                intact_predicted=ev.intact_predicted,
                intact_loss=ev.intact_loss,
                predicted=ev.predicted.astype(np.int32),
                loss=ev.loss,
                correct=ev.correct(),
                **{f"patch_source/{k}": v for k, v in ev.patch_sources.items()},
                **(
                    {"sample_classes": counts.classes, "class_counts": counts.counts}
                    if counts is not None
                    else {}
                ),
            ),
        )
        if ev.attention is not None:
            check()
            _artifact(
                sink,
                folder,
                "attention.npz",
                _npz(maps=ev.attention.astype(np.float32), query=np.array(ev.attention_query)),
            )
        if patching is not None:
            check()
            _artifact(sink, folder, "patching.npz", _npz(**patching[0].arrays(), **patching[1]))
        summary = {
            "intact": {"accuracy": ev.intact_accuracy, "loss": metrics["intact_loss"]},
            "interventions": per,
            "seconds": ev.seconds,
            "mean_reference_indices": None if reference is None else reference.tolist(),
            "reload_proof": proof.summary()
            if proof is not None
            else "not applicable (pretrained weights)",
            **extra,
        }
        check()
        _artifact(sink, folder, "summary.json", json.dumps(summary, indent=1).encode())


def _patching_metrics(result) -> dict[str, float]:
    """The branch patches' restored fractions and the run times; the grids are in the artifact."""
    out = {
        "patching_pairs": float(len(result.clean_ld)),
        "patching_seconds": result.seconds,
        "patching_clean_logit_diff": float(result.clean_ld.astype(np.float64).mean()),
        "patching_corrupted_logit_diff": float(result.corrupted_ld.astype(np.float64).mean()),
    }
    branch = result.restored(result.branch_ld)  # (depth, 2): denoising
    removed = result.removed(result.noising_branch_ld)  # (depth, 2): noising
    for i in range(branch.shape[0]):
        for j, kind in enumerate(("attn", "mlp")):
            out[f"restored/blocks.{i}.{kind}"] = float(branch[i, j])
            out[f"removed/blocks.{i}.{kind}"] = float(removed[i, j])
    return out


# ---------------------------------------------------------------- read back for the report


@dataclass
class InterventionCellResult:
    """One finished intervention cell as the report reads it."""

    record: CellRecord
    names: list[str]
    labels: np.ndarray
    intact_predicted: np.ndarray
    predicted: np.ndarray  # (K, N)
    attention: np.ndarray | None  # (depth, heads, rows, cols)
    attention_query: str
    indices: np.ndarray | None = None  # (N,) each example's position in the dataset's source split
    patching: dict[str, np.ndarray] | None = None  # patching.npz's arrays, when the cell patched
    # the evaluated images per class of the split; None for a cell logged before they were
    counts: ClassCounts | None = None


def finished_cells(
    protocol_name: str, protocol_hash: str
) -> tuple[dict[tuple[str, int], CellRecord], list[CellRecord]]:
    """The newest finished run of each (arm, seed) of the hash, and every cell run (for the runs table).

    Code versions are never mixed: only runs of the newest finished run's interventions code
    fingerprint (param ``code_fingerprint``, or one ``workbench.code_history`` maps to the same
    code) are chosen; a cell finished only with other code is missing.
    """
    records = queries.cell_records(protocol_name, protocol_hash)
    return choose_cells(records), records


def choose_cells(records: list[CellRecord]) -> dict[tuple[str, int], CellRecord]:
    """The rule of ``finished_cells`` on given records (also those read back from an evidence export)."""
    finished = sorted(
        (r for r in records if r.status == "FINISHED"),
        key=lambda r: (r.end_time, r.run_id),
        reverse=True,
    )
    code = finished[0].params.get("code_fingerprint") if finished else None
    chosen: dict[tuple[str, int], CellRecord] = {}
    for r in finished:
        if r.params.get("code_fingerprint") == code or (
            code is not None and same_code(r.params.get("code_fingerprint"), code)
        ):
            chosen.setdefault((r.arm, r.seed), r)
    return chosen


def read_cell(record: CellRecord, workdir: Path) -> InterventionCellResult:
    """The per-example outcomes and attention maps a finished cell logged."""
    folder = Path(workdir) / record.run_id
    with np.load(queries.download_artifact(record.run_id, PER_EXAMPLE, folder)) as z:
        names, labels = [str(n) for n in z["names"]], z["labels"]
        intact, predicted = z["intact_predicted"], z["predicted"]
        indices = z["indices"] if "indices" in z.files else None
        counts = (
            ClassCounts(z["sample_classes"], z["class_counts"])
            if "class_counts" in z.files
            else None
        )
    attention, query = None, ""
    if queries.has_artifact(record.run_id, ATTENTION):
        with np.load(queries.download_artifact(record.run_id, ATTENTION, folder)) as z:
            attention, query = z["maps"], str(z["query"])
    return InterventionCellResult(
        record,
        names,
        labels,
        intact,
        predicted,
        attention,
        query,
        indices,
        read_patching(record, workdir),
        counts,
    )


def read_patching(record: CellRecord, workdir: Path) -> dict[str, np.ndarray] | None:
    """A finished cell's ``patching.npz`` arrays, or None when it logged no patching."""
    if not queries.has_artifact(record.run_id, PATCHING):
        return None
    folder = Path(workdir) / record.run_id
    with np.load(queries.download_artifact(record.run_id, PATCHING, folder)) as z:
        return {k: z[k] for k in z.files}


def log_benchmark(
    protocol_name: str,
    timing,
    params: dict,
    decision=None,
    load: dict[str, float] | None = None,
    goal: str | None = None,
) -> str:
    """A ``benchmark-intervene`` measurement as a run of the experiment ``benchmark-intervene``; returns its id.

    ``decision`` (``workbench.bench.timing.Decision``), ``load`` and the goal's verdict ``goal``
    are logged as ``verdict.*`` / ``use.*`` / ``goal_verdict`` tags and ``load/*`` metrics."""
    import statistics

    import mlflow

    from tracking.store.session import start_run

    configure_tracking()
    with start_run(
        "benchmark-intervene",
        run_name=f"{protocol_name} grid timing",
        tags={"benchmark": "intervene", PROTOCOL_NAME: protocol_name},
    ) as run:
        mlflow.log_params({**params, "threads": timing.threads})
        mlflow.log_metrics(
            {
                "total_seconds": timing.total,
                "cell_seconds_median": statistics.median(timing.cell_seconds),
                "cell_seconds_min": min(timing.cell_seconds),
                "cell_seconds_max": max(timing.cell_seconds),
                "intact_pass_seconds_median": statistics.median(timing.intact_seconds),
                "forward_equivalents": timing.forward_equivalents,
            }
        )
        if params.get(
            "goal_seconds"
        ):  # only a run of the goal's own configuration says whether it is met
            mlflow.log_metric("goal_met", float(timing.total < params["goal_seconds"]))
        for i, seconds in enumerate(timing.cell_seconds):
            mlflow.log_metric("cell_seconds", seconds, step=i)
        from tracking.kinds.benchmark_runs import log_verdicts

        log_verdicts([decision] if decision is not None else [], load or {})
        if goal is not None:
            mlflow.set_tag("goal_verdict", goal)
        return run.info.run_id
