"""Entry point: every attribution method of a frozen attribution protocol scored on every acted-on model.

For each cell (an arm at a seed of the acted-on ablation protocol, or the one pretrained model)
the execution finds the trained cell's newest finished run, keys the attribution cell by it (a
rerun skips finished cells before downloading anything), reloads the best checkpoint and
re-verifies it against the cell's saved validation predictions (the reload proof, first), then
scores every method against the exact causal effect of each patch token on the protocol's
images (``workbench.attribution.score_cell``) and logs the outcome
(``tracking/kinds/attribution_runs.py``). Cells run under the study's one parent run with
leases, as ``intervene`` does (the steps every kind that acts on a trained model shares:
``studies.runtime.trained_model_kind``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from studies.runtime.options import StudyOptions
from studies.runtime.outcome import CellOutcome
from studies.runtime.study_kind import open_study, run_cells
from studies.runtime.study_protocol import ProtocolError
from studies.runtime.trained_model_kind import (
    ActedCell,
    TrainedModelKind,
    evaluated_split,
    trained_model_command,
)
from tracking.kinds import attribution_runs
from tracking.record.schema import ATTRIBUTION
from tracking.record.sink import RunSink
from workbench.attribution import AttributionError, as_glassbox, score_cell
from workbench.attribution.controls import Controls
from workbench.attribution.token_norms import PLANTED_IMAGES, planted_control
from workbench.data import PreparedData, PreparedSplit
from workbench.interventions.evaluate import ATTRIBUTION_AS_TRAINED, Inputs
from workbench.protocol import AttributionProtocol, InterventionCell, load_attribution_protocol
from workbench.sample import sample_positions
from workbench.train.evaluate import ReloadProof

DEFAULT_PROTOCOL = "studies/protocols/smoke_faithfulness.yaml"


def scored_images(protocol: AttributionProtocol, data: PreparedData) -> PreparedSplit:
    """The protocol's sample of the split (``workbench.sample``), the same for every cell (the pairing):
    a seeded class-stratified sample, the first ``attribution.images`` images, or the named positions."""
    s = protocol.settings
    split = evaluated_split(protocol, data, s.split, "attribution.split")
    key = "attribution.indices" if s.sample == "indices" else "attribution.images"
    if s.images > len(split):
        raise ProtocolError(
            f"{protocol.source_file}: {key}: {s.images} images, but the {s.split} split of "
            f"{data.display_name} has only {len(split)} images"
        )
    try:
        positions = sample_positions(
            split.labels.numpy(),
            s.images,
            "first" if s.sample == "indices" else s.sample,
            s.sample_seed,
            keys=split.indices.numpy(),
            indices=s.indices,
        )
    except ValueError as err:
        raise ProtocolError(
            f"{protocol.source_file}: {key}: {err} ({s.split} split of {data.display_name})"
        ) from err
    at = torch.from_numpy(positions)
    return PreparedSplit(split.images[at], split.labels[at], split.indices[at], split.source_split)


def model_inputs(
    split: PreparedSplit, inputs: Inputs
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """The scored images as the model sees them (normalised, resized, on the device), labels and indices."""
    xs, ys, idx = [], [], []
    for x, y, i in inputs.loader(split.images, split.labels, split.indices):
        xs.append(x.to(inputs.device))
        ys.append(y.to(inputs.device))
        idx.append(i.cpu())
    return torch.cat(xs), torch.cat(ys), torch.cat(idx).numpy()


class AttributionStudy(TrainedModelKind):
    """An attribution protocol: every method scored on every acted-on model, one cell per arm and seed."""

    user_errors = (*TrainedModelKind.user_errors, AttributionError)
    command_help = "Score an attribution protocol: every method against exact token-drop effects on every acted-on model, as MLflow child runs."
    tag = ATTRIBUTION
    error = AttributionError
    done = "scored"
    work = "scoring attributions"
    cell_precision = ATTRIBUTION_AS_TRAINED  # float32: see workbench.interventions.evaluate
    settings_section = "settings"

    def images_words(self, protocol: AttributionProtocol) -> str:
        s = protocol.settings
        return {
            "first": "the first ",
            "stratified": f"a class-stratified sample (seed {s.sample_seed}) of ",
            "indices": "the named ",
        }[s.sample]

    load = staticmethod(load_attribution_protocol)
    evaluated_images = staticmethod(scored_images)
    code_fingerprint = staticmethod(attribution_runs.attribution_code_fingerprint)

    def prepare_execution(self, protocol, options: StudyOptions):
        ex = super().prepare_execution(protocol, options)
        if ex.pretrained is not None:
            # a head attribution cannot read is refused here, before any run opens
            as_glassbox(ex.pretrained.model)
        return ex

    def plan(self, cell: InterventionCell, acted: ActedCell) -> tuple[None, dict]:
        s = self.ex.protocol.settings
        return None, {
            "split": s.split,
            "images": s.images,
            "sample": s.sample,
            **({"sample_seed": s.sample_seed} if s.sample == "stratified" else {}),
            "batch_size": s.batch_size,
            "methods": ",".join(s.methods),
            "norm_threshold": s.norm_threshold,
            "random_seed": s.random_seed,
            "examples": s.examples,
            **attribution_runs.control_params(s),
        }

    def evaluate(
        self,
        cell: InterventionCell,
        acted: ActedCell,
        plan: None,
        *,
        proof: ReloadProof | None,
        sink: RunSink,
    ) -> tuple[str, float]:
        ex, s = self.ex, self.ex.protocol.settings
        x, y, indices = model_inputs(ex.images, acted.inputs)
        with tqdm(
            total=len(y),
            desc=f"{cell.key}: {len(s.methods)} methods, every patch token dropped",
            unit="image",
            leave=False,
        ) as bar:  # advanced per image batch
            scored = score_cell(
                acted.model,
                x,
                y,
                s.methods,
                s.random_seed,
                s.norm_threshold,
                image_index=indices,
                batch_size=s.batch_size,
                progress=bar.update,
                controls=Controls(s.random_draws, s.sanity_check, cell.seed),
            )
        # the high-norm detector's positive control, on the first scored images (docs/attribution.md)
        control = planted_control(
            acted.model, x[:PLANTED_IMAGES], k=s.norm_threshold, batch_size=s.batch_size
        )
        examples = ex.images.images[
            : s.examples
        ].numpy()  # uint8, as in the dataset, for the report's example row
        metrics = self.log_outcome(
            sink,
            acted,
            s.split,
            attribution_runs.log_cell,
            scored,
            examples,
            proof,
            counts=ex.counts,
            norm_control=control,
        )
        rhos = ", ".join(
            f"{m} {metrics[f'rho/{m}']:+.3f}" for m in s.methods if f"rho/{m}" in metrics
        )
        return (
            f"{cell.key}: intact {s.split} accuracy {scored.intact_accuracy:.4f} on {len(y)} images; "
            f"{len(s.methods)} methods and {scored.causal.effects.shape[1]} single-token drops in {scored.seconds:.1f} s "
            f"({scored.forwards:,} sequences); Spearman rho {rhos}"
        ), scored.seconds


def open_attribution_protocol(path: str, allow_dirty: bool) -> AttributionProtocol:
    """Load the protocol, refuse it uncommitted or run before with another hash (``open_study``)."""
    return open_study(AttributionStudy, path, allow_dirty)


def run_attribution_protocol(
    protocol: AttributionProtocol, protocol_file: Path, options: StudyOptions
) -> list[CellOutcome]:
    """Every cell of ``protocol`` under the study's one parent run; returns the outcomes (``run_cells``)."""
    return run_cells(AttributionStudy(options), protocol, protocol_file, options)


attribute = trained_model_command("attribute", AttributionStudy, DEFAULT_PROTOCOL)
