"""Entry point: every intervention of a frozen intervention protocol on every acted-on model.

For each cell (an arm at a seed of the acted-on ablation protocol, or the one pretrained
model) the execution finds the trained cell's newest finished run, keys the intervention
cell by it (a rerun skips finished cells before downloading anything), reloads the best
checkpoint and re-verifies it against the cell's saved validation predictions (the reload
proof), then evaluates the intact model and each intervention over the in-memory split in
batches and logs the outcome (tracking/kinds/intervention_runs.py). Cells run under the study's one
parent run with leases, as ``ablate`` and ``transfer`` do.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click
import torch
from tqdm.auto import tqdm

from studies.runtime.cell_end import end_cell, hold_opened, outcome_of_error
from studies.runtime.options import StudyOptions, study_options
from studies.runtime.outcome import CellOutcome, Status
from studies.runtime.preflight import remove_abandoned_cache_files
from studies.runtime.study_execution import prepare_protocol_data
from studies.runtime.study_kind import StudyKind, open_study, run_cells, run_study, said_in_one_line
from studies.runtime.study_protocol import ProtocolError
from tracking.kinds import intervention_runs
from tracking.kinds.transfer_runs import find_finished_cell
from tracking.record.lease import HEARTBEATS
from tracking.record.protocol_runs import STARTED_TAG
from tracking.record.sink import RunSink
from tracking.kinds.training_runs import log_kernel_identity
from tracking.store.session import configure_tracking, environment_tags
from tracking.record.cell_runs import open_leased_run
from tracking.record.schema import (
    INTERVENTION,
    RUN_NAME,
    SOURCE_IDENTITY,
    SOURCE_RUN_ID,
    TRUE,
    cell_tags,
)
from workbench.data import DatasetNotFound, PreparedData, PreparedSplit, prepare
from workbench.interventions import HeadAblation, InterventionError, flatten
from workbench.interventions.evaluate import Inputs, evaluate, reference_means
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
from workbench.protocol import InterventionCell, InterventionProtocol, load_intervention_protocol
from workbench.protocol.intervention import check_against_model
from workbench.train.loop import resolve_device
from workbench.transfer.source_model import SourceError, adapt_split

DEFAULT_PROTOCOL = "studies/protocols/smoke_heads.yaml"
BENCHMARK_GOAL_SECONDS = (
    120.0  # every head and branch of fmnist_seed_recipe's ViT, 5 seeds, 800 images, 2 cores
)


@dataclass
class Execution:
    """What one execution shares across its cells."""

    protocol: InterventionProtocol
    data: PreparedData
    device: torch.device
    workdir: Path
    parent: str = ""
    pretrained: ActedModel | None = None

    @property
    def split(self) -> PreparedSplit:
        split = self.data.test if self.protocol.evaluation.split == "test" else self.data.val
        if split is None:
            raise ProtocolError(
                f"{self.protocol.source_file}: evaluation.split=test but {self.data.display_name} "
                "has no test split"
            )
        return split


def prepare_execution(protocol: InterventionProtocol, options: StudyOptions) -> Execution:
    """The data every cell shares (the acted-on protocol's split), and a pretrained model, loaded once."""
    dev, data_path, download = resolve_device(options.device), options.data_path, options.download
    workdir = options.output_dir / protocol.name
    if protocol.acts_on is not None:
        return Execution(
            protocol, prepare_protocol_data(protocol.source, data_path, download), dev, workdir
        )
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
    data = replace(data, norm=acted.norm, **splits)
    return Execution(protocol, data, dev, workdir, pretrained=acted)


def cell_key(ex: Execution, cell: InterventionCell, identity: str) -> str:
    """Protocol hash, arm, seed, the acted-on weights, data and split, and the code that computes the results."""
    parts = [
        ex.protocol.hash,
        cell.arm,
        str(cell.seed),
        identity,
        ex.data.data_fingerprint,
        ex.data.split_fingerprint,
        f"code={intervention_runs.intervention_code_fingerprint()}",
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _inputs(
    ex: Execution, cfg: ViTConfig, *, batch_size: int, amp: str, resize_to: int | None
) -> Inputs:
    if resize_to is None and ex.data.train.images.shape[-1] != cfg.image_hw[-1]:
        resize_to = cfg.image_hw[-1]  # a pretrained model's input size
    return Inputs(ex.data.norm, batch_size, ex.device, resize_to, resolve_amp(amp, ex.device))


def _acted(ex: Execution, cell: InterventionCell, run_id: str | None):
    """(model, proof inputs, evaluation inputs, saved predictions, description, proof through fused attention)."""
    p = ex.protocol
    if ex.pretrained is not None:
        cfg = ex.pretrained.model.cfg
        inputs = _inputs(ex, cfg, batch_size=p.evaluation.batch_size, amp="off", resize_to=None)
        return ex.pretrained.model, None, inputs, None, ex.pretrained.description, False
    trained = intervention_runs.trained_cell(
        p.acts_on.protocol, p.acts_on.hash, cell.arm, cell.seed, ex.workdir / "sources"
    )
    params = trained.run.data.params
    for key, here in (
        ("data.fingerprint", ex.data.data_fingerprint),
        ("data.split_fingerprint", ex.data.split_fingerprint),
    ):
        if params.get(key) != here:
            raise InterventionError(
                f"the trained run {run_id} has {key} {str(params.get(key))[:12]}, the data here "
                f"{here[:12]}: not the data the cell was trained and validated on"
            )
    model = trained_cell_model(trained.config, trained.state_dict).to(ex.device)
    arm = next(a for a in p.source.arms if a.name == cell.arm).config
    proof = _inputs(
        ex,
        model.cfg,
        batch_size=arm.run.eval_batch_size,
        amp=arm.run.amp,
        resize_to=arm.data.resize_to,
    )
    inputs = _inputs(
        ex,
        model.cfg,
        batch_size=p.evaluation.batch_size,
        amp=arm.run.amp,
        resize_to=arm.data.resize_to,
    )
    description = f"{p.acts_on.protocol} cell {cell.key}, best checkpoint of run {run_id}{read_across_note(trained.config)}"
    return (
        model,
        proof,
        inputs,
        trained.predictions["val"],
        description,
        saved_through_fused_attention(trained.config),
    )


def run_cell(ex: Execution, cell: InterventionCell, allow_dirty: bool) -> CellOutcome:
    """Skip, or evaluate and log one cell; any error fails this cell only."""
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
        kind=INTERVENTION,
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
    token = opened.token
    if untouched is not None:
        return untouched
    try:
        return _evaluate_cell(ex, cell, sink=opened.sink, token=token, run_id=run_id)
    except BaseException as err:  # a failing cell must not take the others down; Ctrl-C goes up
        return outcome_of_error(cell, opened.sink, token, err)


def _evaluate_cell(
    ex: Execution, cell: InterventionCell, *, sink: RunSink, token: str, run_id: str | None
) -> CellOutcome:
    p, e = ex.protocol, ex.protocol.evaluation
    model, proof_inputs, inputs, saved, description, fused = _acted(ex, cell, run_id)
    grid = check_against_model(p, model.cfg, f"model of {cell.key}")
    fingerprint = intervention_runs.intervention_code_fingerprint()
    sink.set_tags(
        {
            **environment_tags(str(ex.device)),
            "code_fingerprint": fingerprint,
            "threads": str(torch.get_num_threads()),
            "acted_on": description[:500],
            STARTED_TAG: "true",
        }
    )
    log_kernel_identity(sink, ex.device)
    sink.log_params(
        {
            "arm": cell.arm,
            "seed": cell.seed,
            "split": e.split,
            "batch_size": e.batch_size,
            "mean_images": e.mean_images,
            "mean_seed": e.mean_seed,
            "patch_seed": e.patch_seed,
            "interventions": len(grid),
            "code_fingerprint": fingerprint,
            "source_run_id": run_id or "",
            "data.fingerprint": ex.data.data_fingerprint,
            "data.split_fingerprint": ex.data.split_fingerprint,
            "data.display_name": ex.data.display_name,
            "amp": str(inputs.amp_dtype or "off"),
        }
    )
    proof = None
    if saved is not None:  # first: the checkpoint must be the one that made the cell's predictions
        proof = reload_proof(model, ex.data.val, saved, proof_inputs, fast_attention=fused)
        if not proof.passed:
            raise InterventionError(
                f"{proof.summary()}: the checkpoint of run {run_id} is not the one that made "
                "its saved predictions; nothing evaluated"
            )
    needs_mean = any(isinstance(s, HeadAblation) and s.mode == "mean" for s in flatten(grid))
    means, reference = (
        reference_means(model, ex.data.train.images, e.mean_images, e.mean_seed, inputs)
        if needs_mean
        else (None, None)
    )
    split = ex.split
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
    HEARTBEATS.check(sink.run_id, verify=True)
    intervention_runs.log_cell(
        sink,
        ev,
        proof,
        reference,
        {"acted_on": description, "split": e.split},
        check=lambda: HEARTBEATS.check(sink.run_id, verify=True),
    )
    end_cell(sink, token, "FINISHED")
    worst = min(ev.metrics().items(), key=lambda kv: kv[1]["accuracy_change"])
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
            f"{cell.key}: intact {e.split} accuracy {ev.intact_accuracy:.4f}; {len(grid)} interventions on {len(split)} "
            f"images in {ev.seconds:.1f} s; largest drop {worst[0]} {100 * worst[1]['accuracy_change']:+.2f} points"
            f"{proof_text}{where}"
        ),
        sink.run_id,
        seconds=ev.seconds,
        offline=sink.offline,
    )


class InterventionStudy(StudyKind):
    """An intervention protocol: every intervention on every acted-on model, one cell per arm and seed."""

    user_errors = (ProtocolError, SourceError, DatasetNotFound, InterventionError)

    def __init__(self, options: StudyOptions) -> None:
        self.options = options
        self.command_started = (
            time.perf_counter()
        )  # the "in all" of the summary: from the command's start

    @classmethod
    def load(cls, path: str) -> InterventionProtocol:
        return load_intervention_protocol(path)

    def prepare(
        self, protocol: InterventionProtocol, protocol_file: Path, options: StudyOptions
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
            f"{ex.data.display_name}, {len(ex.split)} {protocol.evaluation.split} images"
        )

    def parent_tags(self) -> dict:
        return {INTERVENTION: TRUE, "acts_on": self.acted[:500]}

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
            f"time: {sum(o.seconds for o in outcomes):.1f} s evaluating interventions ({used} "
            f"thread{'s' if used != 1 else ''}), {time.perf_counter() - self.command_started:.1f} s in all; "
            f"report: workbench report --protocol {self.protocol_file}"
        ]


def run_intervention_protocol(
    protocol: InterventionProtocol, protocol_file: Path, options: StudyOptions
) -> list[CellOutcome]:
    """Every cell of ``protocol`` under the study's one parent run; returns the outcomes (``run_cells``)."""
    return run_cells(InterventionStudy(options), protocol, protocol_file, options)


@click.command("intervene")
@click.option(
    "--protocol",
    "protocol_path",
    default=DEFAULT_PROTOCOL,
    show_default=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Intervention protocol YAML file.",
)
@study_options("outputs/intervene", "Downloaded checkpoints of the acted-on cells.")
def intervene(protocol_path, options: StudyOptions):
    """Evaluate an intervention protocol: every head, branch and patch of every acted-on model, as MLflow child runs."""
    kind = InterventionStudy(options)
    with said_in_one_line(kind):
        protocol = open_study(InterventionStudy, protocol_path, options.allow_dirty)
    run_study(kind, protocol, Path(protocol_path), options)
