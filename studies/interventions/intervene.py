"""Entry point: every intervention of a frozen intervention protocol on every acted-on model.

For each cell (an arm at a seed of the acted-on ablation protocol, or the one pretrained
model) the execution finds the trained cell's newest finished run, keys the intervention
cell by it (a rerun skips finished cells before downloading anything), reloads the best
checkpoint and re-verifies it against the cell's saved validation predictions (the reload
proof), then evaluates the intact model and each intervention over the in-memory split in
batches and logs the outcome (tracking/kinds/intervention_runs.py). Cells run under the study's one
parent run with leases, as ``ablate`` and ``transfer`` do (the steps every kind that acts on a
trained model shares: ``studies.runtime.trained_model_kind``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from studies.runtime.options import StudyOptions
from studies.runtime.outcome import CellOutcome
from studies.runtime.study_kind import run_cells
from studies.runtime.trained_model_kind import (
    ActedCell,
    TrainedModelKind,
    evaluated_split,
    trained_model_command,
)
from tracking.kinds import intervention_runs
from tracking.record.schema import INTERVENTION
from tracking.record.sink import RunSink
from workbench.data import PreparedData, PreparedSplit
from workbench.interventions import HeadAblation, flatten
from workbench.interventions.evaluate import evaluate, reference_means
from workbench.interventions.edge_patching import edge_agreement, edge_patch_split
from workbench.interventions.attribution_patching import (
    comparison_metrics,
    estimate_split,
    exact_passes,
)
from workbench.interventions.patching import patch_split
from workbench.protocol import InterventionCell, InterventionProtocol, load_intervention_protocol
from workbench.protocol.intervention import check_against_data, check_against_model
from workbench.train.evaluate import ReloadProof

DEFAULT_PROTOCOL = "studies/protocols/smoke_heads.yaml"


class InterventionStudy(TrainedModelKind):
    """An intervention protocol: every intervention on every acted-on model, one cell per arm and seed."""

    command_help = "Evaluate an intervention protocol: every head, branch and patch of every acted-on model, as MLflow child runs."
    tag = INTERVENTION
    done = "evaluated"
    work = "evaluating interventions"

    load = staticmethod(load_intervention_protocol)
    code_fingerprint = staticmethod(intervention_runs.intervention_code_fingerprint)

    @staticmethod
    def evaluated_images(protocol: InterventionProtocol, data: PreparedData) -> PreparedSplit:
        return evaluated_split(protocol, data, protocol.evaluation.split, "evaluation.split")

    def prepare_execution(self, protocol: InterventionProtocol, options: StudyOptions):
        ex = super().prepare_execution(protocol, options)
        # what the data and a pretrained model decide is checked now, before any run opens
        check_against_data(
            protocol, ex.images.labels, len(ex.data.train.labels), ex.data.display_name
        )
        if ex.pretrained is not None:
            check_against_model(protocol, ex.pretrained.model.cfg, "the pretrained model")
        return ex

    def plan(self, cell: InterventionCell, acted: ActedCell) -> tuple[list, dict]:
        p, e = self.ex.protocol, self.ex.protocol.evaluation
        grid = check_against_model(p, acted.model.cfg, f"model of {cell.key}")
        return grid, {
            "split": e.split,
            "batch_size": e.batch_size,
            "mean_images": e.mean_images,
            "mean_seed": e.mean_seed,
            "patch_seed": e.patch_seed,
            "interventions": len(grid),
            "amp": str(acted.inputs.amp_dtype or "off"),
        }

    def evaluate(
        self,
        cell: InterventionCell,
        acted: ActedCell,
        plan: list,
        *,
        proof: ReloadProof | None,
        sink: RunSink,
    ) -> tuple[str, float]:
        ex, e, grid = self.ex, self.ex.protocol.evaluation, plan
        model, inputs = acted.model, acted.inputs
        needs_mean = any(isinstance(s, HeadAblation) and s.mode == "mean" for s in flatten(grid))
        means, reference = (
            reference_means(model, ex.data.train.images, e.mean_images, e.mean_seed, inputs)
            if needs_mean
            else (None, None)
        )
        split = ex.images
        with tqdm(
            total=len(split), desc=f"{cell.key} {len(grid)} interventions", unit="img", leave=False
        ) as bar:
            ev = evaluate(
                model,
                split.images,
                split.labels,
                split.indices,
                inputs,
                grid,
                means,
                e.patch_seed,
                e.attention_maps,
                progress=lambda done: bar.update(done - bar.n),
            )
        patching = ex.protocol.patching
        patched = (
            patch_split(model, split.images, split.labels, split.indices, inputs, patching)
            if patching is not None
            else None
        )
        if patched is not None and patching.attribution_patching:
            patched = _with_attribution_patching(model, split, inputs, patching, patched)
        if patched is not None and patching.edges:
            patched = _with_edges(model, split, inputs, patching, patched)
        self.log_outcome(
            sink,
            acted,
            e.split,
            intervention_runs.log_cell,
            ev,
            proof,
            reference,
            patching=patched,
            counts=ex.counts,
        )
        worst = min(ev.metrics().items(), key=lambda kv: kv[1]["accuracy_change"], default=None)
        worst_text = (
            f"; largest drop {worst[0]} {100 * worst[1]['accuracy_change']:+.2f} points"
            if worst
            else ""
        )
        if patched is not None:
            worst_text += (
                f"; patching: {len(patched[0].clean_ld)} pairs in {patched[0].seconds:.1f} s"
            )
        return (
            f"{cell.key}: intact {e.split} accuracy {ev.intact_accuracy:.4f}; {len(grid)} interventions on {len(split)} "
            f"images in {ev.seconds:.1f} s{worst_text}"
        ), ev.seconds


def _with_attribution_patching(model, split, inputs, spec, patched) -> tuple:
    """``(result, pairs)`` extended: AtP, AtP-IG and the controls' arrays beside the pairs (so
    beside the exact grid in ``patching.npz``, with the exact grid's passes and wall time, which
    includes finding the read positions) and their scores against it as a third item (metrics)."""
    result, logged = patched
    estimates = estimate_split(model, split.images, split.labels, split.indices, inputs, spec)
    scores = comparison_metrics(
        result.arrays(), estimates, result.resid_reads, model, spec.ig_steps
    )
    cfg = model.cfg
    exact = exact_passes(cfg.depth, result.resid_ld.shape[2], cfg.heads)
    timing = {
        "exact_passes": np.array([exact["forward"], exact["backward"]]),
        "exact_seconds": np.array(result.seconds),
    }
    return result, {**logged, **estimates, **timing}, scores


def _with_edges(model, split, inputs, spec, patched) -> tuple:
    """``(result, pairs[, metrics])`` extended: the head -> class-token-reader edges, exact and
    edge AtP, beside the exact grid in ``patching.npz``, and their agreement as metrics."""
    arrays = edge_patch_split(model, split.images, split.labels, split.indices, inputs, spec)
    result, logged, *scores = patched
    metrics = {**(scores[0] if scores else {}), **edge_agreement(arrays)}
    return result, {**logged, **arrays}, metrics


def run_intervention_protocol(
    protocol: InterventionProtocol, protocol_file: Path, options: StudyOptions
) -> list[CellOutcome]:
    """Every cell of ``protocol`` under the study's one parent run; returns the outcomes (``run_cells``)."""
    return run_cells(InterventionStudy(options), protocol, protocol_file, options)


intervene = trained_model_command("intervene", InterventionStudy, DEFAULT_PROTOCOL)
