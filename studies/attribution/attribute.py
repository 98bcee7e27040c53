"""Entry point: every attribution method of a frozen attribution protocol scored on every acted-on model.

For each cell (an arm at a seed of the acted-on ablation protocol, or the one pretrained model)
the execution finds the trained cell's newest finished run, keys the attribution cell by it (a
rerun skips finished cells before downloading anything), reloads the best checkpoint and
re-verifies it against the cell's saved validation predictions (the reload proof, first), then
scores every method against the exact causal effect of each patch token on the protocol's
images (``workbench.attribution.score_cell``) and logs the outcome
(``tracking/kinds/attribution_runs.py``). Cells run under the study's one parent run with
leases, as ``intervene`` does.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click
import numpy as np
import torch
from tqdm.auto import tqdm

from studies.runtime.cell_end import end_cell, hold_opened, outcome_of_error
from studies.runtime.options import StudyOptions, study_options
from studies.runtime.outcome import CellOutcome, Status
from studies.runtime.preflight import remove_abandoned_cache_files
from studies.runtime.study_execution import prepare_protocol_data
from studies.runtime.study_kind import StudyKind, open_study, run_cells, run_study, said_in_one_line
from studies.runtime.study_protocol import ProtocolError
from tracking.kinds import attribution_runs, intervention_runs
from tracking.kinds.transfer_runs import find_finished_cell
from tracking.record.lease import HEARTBEATS
from tracking.record.protocol_runs import STARTED_TAG
from tracking.record.sink import RunSink
from tracking.store.session import configure_tracking, environment_tags
from tracking.record.cell_runs import open_leased_run
from tracking.record.schema import (
    ATTRIBUTION,
    RUN_NAME,
    SOURCE_IDENTITY,
    SOURCE_RUN_ID,
    TRUE,
    cell_tags,
)
from workbench.attribution import AttributionError, score_cell
from workbench.attribution.controls import Controls
from workbench.data import DatasetNotFound, PreparedData, PreparedSplit, prepare
from workbench.interventions import InterventionError
from workbench.interventions.evaluate import Inputs
from workbench.interventions.sources import (
    ActedModel,
    model_labels,
    pretrained_model,
    read_across_note,
    reload_proof,
    saved_through_fused_attention,
    trained_cell_model,
)
from workbench.models.vit import ViTConfig
from workbench.precision import resolve_amp
from workbench.protocol import AttributionProtocol, InterventionCell, load_attribution_protocol
from workbench.train.loop import resolve_device
from workbench.transfer.source_model import SourceError, adapt_split

DEFAULT_PROTOCOL = "studies/protocols/smoke_faithfulness.yaml"


@dataclass
class Execution:
    """What one execution shares across its cells: the data, its scored images, the device."""

    protocol: AttributionProtocol
    data: PreparedData
    images: PreparedSplit  # the protocol's images: the first ``attribution.images`` of its split
    device: torch.device
    workdir: Path
    parent: str = ""
    pretrained: ActedModel | None = None


def scored_images(protocol: AttributionProtocol, data: PreparedData) -> PreparedSplit:
    """The first ``attribution.images`` images of the split, the same for every cell (the pairing)."""
    s = protocol.settings
    split = data.test if s.split == "test" else data.val
    if split is None:
        raise ProtocolError(
            f"{protocol.source_file}: attribution.split=test but {data.display_name} has no test split"
        )
    if s.images > len(split):
        raise ProtocolError(
            f"{protocol.source_file}: attribution.images={s.images}: the {s.split} split of "
            f"{data.display_name} has only {len(split)} images"
        )
    n = s.images
    return PreparedSplit(split.images[:n], split.labels[:n], split.indices[:n], split.source_split)


def _pretrained_data(protocol: AttributionProtocol, data_path: str | None, download: bool):
    """The pinned timm ViT and its dataset, with labels mapped to the model's outputs (as ``intervene`` does)."""
    spec = protocol.pretrained
    acted = pretrained_model(spec.model, spec.weights, spec.seed, spec.timm_kwargs)
    remove_abandoned_cache_files()
    data = prepare(
        spec.dataset,
        path=data_path,
        download=download,
        split_seed=spec.split_seed,
        val_size=spec.val_size,
        subset=spec.subset,
    )
    cfg = acted.model.cfg
    to_model = model_labels(data.class_names, spec.class_index, cfg.num_classes)
    splits = {}
    for name in ("train", "val", "test"):
        split = getattr(data, name)
        if split is not None:  # the model's channels and output classes, the dataset's images
            split = adapt_split(split, cfg.in_channels)
            splits[name] = PreparedSplit(
                split.images, to_model[split.labels], split.indices, split.source_split
            )
    return acted, replace(data, norm=acted.norm, **splits)


def prepare_execution(protocol: AttributionProtocol, options: StudyOptions) -> Execution:
    """The data every cell shares and its scored images (checked before any run opens); a pretrained model once."""
    dev, workdir = resolve_device(options.device), options.output_dir / protocol.name
    if protocol.acts_on is not None:
        data = prepare_protocol_data(protocol.source, options.data_path, options.download)
        return Execution(protocol, data, scored_images(protocol, data), dev, workdir)
    acted, data = _pretrained_data(protocol, options.data_path, options.download)
    return Execution(protocol, data, scored_images(protocol, data), dev, workdir, pretrained=acted)


def cell_key(ex: Execution, cell: InterventionCell, identity: str) -> str:
    """Protocol hash, arm, seed, the acted-on weights, data and split, and the code that computes the results."""
    parts = [
        ex.protocol.hash,
        cell.arm,
        str(cell.seed),
        identity,
        ex.data.data_fingerprint,
        ex.data.split_fingerprint,
        f"code={attribution_runs.attribution_code_fingerprint()}",
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _inputs(
    ex: Execution, cfg: ViTConfig, batch_size: int, amp: str, resize_to: int | None
) -> Inputs:
    if resize_to is None and ex.data.train.images.shape[-1] != cfg.image_hw[-1]:
        resize_to = cfg.image_hw[-1]  # a pretrained model's input size
    return Inputs(ex.data.norm, batch_size, ex.device, resize_to, resolve_amp(amp, ex.device))


def _acted(ex: Execution, cell: InterventionCell, run_id: str | None):
    """(model, proof inputs, scoring inputs, saved predictions, description, proof through fused attention)."""
    p, s = ex.protocol, ex.protocol.settings
    if ex.pretrained is not None:
        cfg = ex.pretrained.model.cfg
        return (
            ex.pretrained.model,
            None,
            _inputs(ex, cfg, s.batch_size, "off", None),
            None,
            ex.pretrained.description,
            False,
        )
    trained = intervention_runs.trained_cell(
        p.acts_on.protocol, p.acts_on.hash, cell.arm, cell.seed, ex.workdir / "sources"
    )
    params = trained.run.data.params
    for key, here in (
        ("data.fingerprint", ex.data.data_fingerprint),
        ("data.split_fingerprint", ex.data.split_fingerprint),
    ):
        if params.get(key) != here:
            raise AttributionError(
                f"the trained run {run_id} has {key} {str(params.get(key))[:12]}, the data here "
                f"{here[:12]}: not the data the cell was trained and validated on"
            )
    model = trained_cell_model(trained.config, trained.state_dict).to(ex.device)
    arm = next(a for a in p.source.arms if a.name == cell.arm).config
    proof = _inputs(ex, model.cfg, arm.run.eval_batch_size, arm.run.amp, arm.data.resize_to)
    # Scored in float32 whatever the cell trained with: the drops' effects are differences of log-probabilities.
    inputs = _inputs(ex, model.cfg, s.batch_size, "off", arm.data.resize_to)
    description = f"{p.acts_on.protocol} cell {cell.key}, best checkpoint of run {run_id}{read_across_note(trained.config)}"
    return (
        model,
        proof,
        inputs,
        trained.predictions["val"],
        description,
        saved_through_fused_attention(trained.config),
    )


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


def run_cell(ex: Execution, cell: InterventionCell, allow_dirty: bool) -> CellOutcome:
    """Skip, or score and log one cell; any error fails this cell only."""
    p = ex.protocol
    try:
        run_id = (
            None
            if ex.pretrained
            else find_finished_cell(p.acts_on.protocol, p.acts_on.hash, cell.arm, cell.seed)
        )
    except SourceError as err:
        return CellOutcome(cell, Status.FAILED, f"{cell.key}: {err}")
    identity = ex.pretrained.identity if ex.pretrained else run_id
    tags = cell_tags(
        protocol_name=p.name,
        protocol_hash=p.hash,
        arm=cell.arm,
        seed=cell.seed,
        kind=ATTRIBUTION,
        allow_dirty=allow_dirty,
        **{SOURCE_RUN_ID: run_id or "", SOURCE_IDENTITY: identity},
    )
    opened = open_leased_run(
        p.name,
        cell_key(ex, cell, identity),
        {RUN_NAME: f"{cell.arm}-seed{cell.seed}", **tags},
        ex.parent,
    )
    untouched = hold_opened(cell, opened)
    if untouched is not None:
        return untouched
    token = opened.token
    try:
        return _score_cell(ex, cell, opened.sink, token, run_id)
    except BaseException as err:  # a failing cell must not take the others down; Ctrl-C goes up
        return outcome_of_error(cell, opened.sink, token, err)


def _score_cell(
    ex: Execution, cell: InterventionCell, sink: RunSink, token: str, run_id: str | None
) -> CellOutcome:
    s = ex.protocol.settings
    model, proof_inputs, inputs, saved, description, fused = _acted(ex, cell, run_id)
    fingerprint = attribution_runs.attribution_code_fingerprint()
    sink.set_tags(
        {
            **environment_tags(str(ex.device)),
            "code_fingerprint": fingerprint,
            "threads": str(torch.get_num_threads()),
            "acted_on": description[:500],
            STARTED_TAG: "true",
        }
    )
    sink.log_params(
        {
            "arm": cell.arm,
            "seed": cell.seed,
            "split": s.split,
            "images": s.images,
            "batch_size": s.batch_size,
            "methods": ",".join(s.methods),
            "norm_threshold": s.norm_threshold,
            "random_seed": s.random_seed,
            "examples": s.examples,
            **attribution_runs.control_params(s),
            "code_fingerprint": fingerprint,
            "source_run_id": run_id or "",
            "data.fingerprint": ex.data.data_fingerprint,
            "data.split_fingerprint": ex.data.split_fingerprint,
            "data.display_name": ex.data.display_name,
        }
    )
    proof = None
    if saved is not None:  # first: the checkpoint must be the one that made the cell's predictions
        proof = reload_proof(model, ex.data.val, saved, proof_inputs, fast_attention=fused)
        if not proof.passed:
            raise AttributionError(
                f"{proof.summary()}: the checkpoint of run {run_id} is not the one that made "
                "its saved predictions; nothing scored"
            )
    x, y, indices = model_inputs(ex.images, inputs)
    with tqdm(
        total=len(y),
        desc=f"{cell.key}: {len(s.methods)} methods, every patch token dropped",
        unit="image",
        leave=False,
    ) as bar:  # advanced per image batch
        scored = score_cell(
            model,
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
    HEARTBEATS.check(sink.run_id, verify=True)
    examples = ex.images.images[
        : s.examples
    ].numpy()  # uint8, as in the dataset, for the report's example row
    metrics = attribution_runs.log_cell(
        sink,
        scored,
        examples,
        proof,
        {"acted_on": description, "split": s.split},
        check=lambda: HEARTBEATS.check(sink.run_id, verify=True),
    )
    end_cell(sink, token, "FINISHED")
    rhos = ", ".join(f"{m} {metrics[f'rho/{m}']:+.3f}" for m in s.methods if f"rho/{m}" in metrics)
    proof_text = f"; {proof.summary()}" if proof else ""
    where = (
        f" [logged locally, run {sink.local_run_id}: `workbench sync` copies it to the server]"
        if sink.offline
        else ""
    )
    return CellOutcome(
        cell,
        Status.FINISHED,
        (
            f"{cell.key}: intact {s.split} accuracy {scored.intact_accuracy:.4f} on {len(y)} images; "
            f"{len(s.methods)} methods and {scored.causal.effects.shape[1]} single-token drops in {scored.seconds:.1f} s "
            f"({scored.forwards:,} sequences); Spearman rho {rhos}{proof_text}{where}"
        ),
        sink.run_id,
        seconds=scored.seconds,
        offline=sink.offline,
    )


class AttributionStudy(StudyKind):
    """An attribution protocol: every method scored on every acted-on model, one cell per arm and seed."""

    user_errors = (ProtocolError, SourceError, DatasetNotFound, InterventionError, AttributionError)

    def __init__(self, options: StudyOptions) -> None:
        self.options = options
        self.command_started = (
            time.perf_counter()
        )  # the "in all" of the summary: from the command's start

    @classmethod
    def load(cls, path: str) -> AttributionProtocol:
        return load_attribution_protocol(path)

    def prepare(
        self, protocol: AttributionProtocol, protocol_file: Path, options: StudyOptions
    ) -> str:
        configure_tracking()
        self.ex = ex = prepare_execution(protocol, options)
        self.acted = (
            f"{protocol.acts_on.protocol}@{protocol.acts_on.hash[:12]} arms {', '.join(protocol.arms)}"
            if protocol.acts_on
            else ex.pretrained.description
        )
        self.started, self.protocol_file = time.perf_counter(), protocol_file
        return (
            f"{protocol.name}@{protocol.short_hash}: acts on {self.acted}; {len(protocol.cells())} cells; "
            f"{ex.data.display_name}, the first {len(ex.images)} {protocol.settings.split} images"
        )

    def parent_tags(self) -> dict:
        return {ATTRIBUTION: TRUE, "acts_on": self.acted[:500]}

    def begin(self, parent) -> None:
        self.ex.parent = parent.run_id

    def run_cell(self, cell: InterventionCell, parent) -> CellOutcome:
        return run_cell(self.ex, cell, self.options.allow_dirty)

    def end(self, parent, outcomes: list[CellOutcome]) -> None:
        parent.sink.log_metrics(
            {
                "evaluation_seconds": sum(o.seconds for o in outcomes),
                "execution_seconds": time.perf_counter() - self.started,
                "cells_evaluated": sum(o.status == Status.FINISHED for o in outcomes),
            }
        )

    def summary_lines(self, outcomes: list[CellOutcome]) -> list[str]:
        used = torch.get_num_threads()  # --threads was applied when it was parsed
        return [
            f"time: {sum(o.seconds for o in outcomes):.1f} s scoring attributions ({used} "
            f"thread{'s' if used != 1 else ''}), {time.perf_counter() - self.command_started:.1f} s in all; "
            f"report: workbench report --protocol {self.protocol_file}"
        ]


def open_attribution_protocol(path: str, allow_dirty: bool) -> AttributionProtocol:
    """Load the protocol, refuse it uncommitted or run before with another hash (``open_study``)."""
    return open_study(AttributionStudy, path, allow_dirty)


def run_attribution_protocol(
    protocol: AttributionProtocol, protocol_file: Path, options: StudyOptions
) -> list[CellOutcome]:
    """Every cell of ``protocol`` under the study's one parent run; returns the outcomes (``run_cells``)."""
    return run_cells(AttributionStudy(options), protocol, protocol_file, options)


@click.command("attribute")
@click.option(
    "--protocol",
    "protocol_path",
    default=DEFAULT_PROTOCOL,
    show_default=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Attribution protocol YAML file.",
)
@study_options("outputs/attribute", "Downloaded checkpoints of the acted-on cells.")
def attribute(protocol_path, options: StudyOptions):
    """Score an attribution protocol: every method against exact token-drop effects on every acted-on model, as MLflow child runs."""
    kind = AttributionStudy(options)
    with said_in_one_line(kind):
        protocol = open_study(AttributionStudy, protocol_path, options.allow_dirty)
    run_study(kind, protocol, Path(protocol_path), options)
