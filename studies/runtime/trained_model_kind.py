"""The study kind that acts on trained models: the steps ``intervene`` and ``attribute`` share.

For each cell (an arm at a seed of the acted-on ablation protocol, or the one pretrained model)
the execution finds the trained cell's newest finished run, keys the cell by it (a rerun skips
finished cells before downloading anything), reloads the best checkpoint and re-verifies it against
the cell's saved validation predictions (the reload proof, first), then hands the model to the
kind's ``evaluate``. Cells run under the study's one parent run with leases, as ``ablate`` and
``transfer`` do. A new kind that acts on a trained model subclasses ``TrainedModelKind`` and
writes what differs: its protocol, its images, its parameters, its evaluation.
"""

from __future__ import annotations

import functools
import hashlib
import time
from abc import abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from studies.runtime.cell_end import end_cell, hold_opened, outcome_of_error
from studies.runtime.options import StudyOptions, study_options
from studies.runtime.outcome import CellOutcome, Status
from studies.runtime.preflight import remove_abandoned_cache_files
from studies.runtime.study_execution import prepare_protocol_data
from studies.runtime.study_kind import StudyKind, open_study, run_study, said_in_one_line
from studies.runtime.study_protocol import ProtocolError
from tracking.kinds import intervention_runs
from tracking.kinds.transfer_runs import find_finished_cell
from tracking.record.cell_runs import open_leased_run, same_code_key
from tracking.kinds.training_runs import log_kernel_identity
from tracking.record.lease import HEARTBEATS
from tracking.record.protocol_runs import STARTED_TAG
from tracking.record.schema import RUN_NAME, SOURCE_IDENTITY, SOURCE_RUN_ID, TRUE, cell_tags
from tracking.record.sink import RunSink
from tracking.store.session import StoreUnavailableError, configure_tracking, environment_tags
from workbench.data import DatasetNotFound, PreparedData, PreparedSplit, prepare
from workbench.interventions import InterventionError
from workbench.interventions.evaluate import INTERVENTION_AS_TRAINED, Inputs, acted_inputs
from workbench.interventions.published_cells import PublishedCellError, PublishedCells
from workbench.interventions.sources import (
    ActedModel,
    model_labels,
    pretrained_model,
    read_across_note,
    reload_proof,
    saved_through_fused_attention,
    trained_cell_model,
)
from workbench.models.vit import ViTConfig, VisionTransformer
from workbench.protocol import InterventionCell
from workbench.train.evaluate import ReloadProof
from workbench.train.loop import resolve_device
from workbench.sample import MIN_PER_CLASS, ClassCounts, class_counts
from workbench.transfer.source_model import SourceError, adapt_split


@dataclass
class TrainedModelExecution:
    """What one execution shares across its cells: the data, the images each cell evaluates, the device."""

    protocol: Any  # an InterventionProtocol or AttributionProtocol: ``acts_on`` or ``pretrained``
    data: PreparedData
    images: PreparedSplit  # what every cell evaluates (the kind's ``evaluated_images``)
    device: torch.device
    workdir: Path
    counts: ClassCounts  # the evaluated images per class of the evaluated split
    parent: str = ""
    pretrained: ActedModel | None = None


@dataclass
class ActedCell:
    """One cell's model, reloaded and ready, with what its reload proof needs."""

    model: VisionTransformer
    proof_inputs: Inputs | None  # None: a pretrained model has no saved predictions to prove
    inputs: Inputs  # how the kind's evaluation feeds the model
    saved: np.ndarray | None  # the cell's saved validation predictions
    description: str
    fused: bool  # the saved predictions were made through fused attention


def pretrained_data(spec, data_path: str | None, download: bool) -> tuple[ActedModel, PreparedData]:
    """The pinned timm ViT and its dataset, with labels mapped to the model's outputs."""
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


def inputs_for(
    ex: TrainedModelExecution,
    cfg: ViTConfig,
    *,
    batch_size: int,
    amp: str,
    resize_to: int | None,
    as_trained: bool = True,
) -> Inputs:
    """How the model is fed (``workbench.interventions.evaluate.acted_inputs``) on this execution's data and device."""
    return acted_inputs(
        ex.data.norm,
        ex.data.train.images.shape[-1],
        cfg.image_hw[-1],
        batch_size=batch_size,
        device=ex.device,
        amp=amp,
        resize_to=resize_to,
        as_trained=as_trained,
    )


def evaluated_split(protocol, data: PreparedData, split: str, key: str) -> PreparedSplit:
    """The ``val`` or ``test`` split the protocol names at ``key``; a test split the data lacks is
    refused with the file and key, before any run opens."""
    chosen = data.test if split == "test" else data.val
    if chosen is None:
        raise ProtocolError(
            f"{protocol.source_file}: {key}=test but {data.display_name} has no test split"
        )
    return chosen


class TrainedModelKind(StudyKind):
    """A protocol that acts on trained models: one cell per arm and seed (or the one pretrained model).

    A subclass names its cell tag, its error and its words, and writes ``load``,
    ``evaluated_images``, ``code_fingerprint``, ``plan`` and ``evaluate``.
    """

    user_errors = (
        ProtocolError,
        SourceError,
        DatasetNotFound,
        InterventionError,
        PublishedCellError,
    )
    tag: str  # the cell's kind tag and the parent's flag (tracking.record.schema)
    error: type[Exception] = InterventionError  # raised for a cell that cannot be evaluated
    done: str  # what a refused cell did not do: "nothing <done>"
    work: str  # the summary's "<seconds> s <work>"
    command_help: str  # the command's help (``trained_model_command``)
    # Evaluate in the precision the cell trained with (else float32): the kind's value from
    # workbench.interventions.evaluate, where the code identity of the acting kinds sees it.
    cell_precision: bool = INTERVENTION_AS_TRAINED
    settings_section: str = "evaluation"  # the protocol's section with ``split`` and ``batch_size``

    def __init__(
        self, options: StudyOptions, strict: bool = False, cells_from: str | None = None
    ) -> None:
        self.options = options
        # refuse evaluated images too thin to speak for the data (``sample_line``)
        self.strict = strict
        self.command_started = time.perf_counter()  # the "in all" of the summary: from the start
        # --cells-from: the acted-on cells from a published study's evidence, not from the store
        self.published = PublishedCells(cells_from) if cells_from else None

    def images_words(self, protocol) -> str:
        """What comes before the header's image count (an attribution sample: "the first ", ...)."""
        return ""

    @staticmethod
    @abstractmethod
    def evaluated_images(protocol, data: PreparedData) -> PreparedSplit:
        """The images every cell evaluates (``ProtocolError`` naming the file and key if there are none)."""

    @staticmethod
    @abstractmethod
    def code_fingerprint() -> str:
        """The fingerprint of the code that computes this kind's results (part of each cell's key)."""

    @staticmethod
    def log_outcome(sink: RunSink, acted: ActedCell, split: str, log, *outcome, **options):
        """``log(sink, *outcome, params, check=..., **options)``: the kind's ``log_cell`` with the
        cell's params (what it acted on, the split) once the cell's lease is checked again, and
        again as it logs, so a cell whose lease was taken over writes nothing more."""
        check = functools.partial(HEARTBEATS.check, sink.run_id, verify=True)
        check()
        params = {"acted_on": acted.description, "split": split}
        return log(sink, *outcome, params, check=check, **options)

    def settings(self, protocol):
        """The protocol's section that says how cells are evaluated (``split``, ``batch_size``)."""
        return getattr(protocol, self.settings_section)

    @abstractmethod
    def plan(self, cell: InterventionCell, acted: ActedCell) -> tuple[Any, dict]:
        """Check the cell's model before anything is logged; (what ``evaluate`` needs, the kind's params)."""

    @abstractmethod
    def evaluate(
        self,
        cell: InterventionCell,
        acted: ActedCell,
        plan: Any,
        *,
        proof: ReloadProof | None,
        sink: RunSink,
    ) -> tuple[str, float]:
        """Evaluate the proven model and log the results; (the outcome's message, seconds)."""

    def prepare_execution(self, protocol, options: StudyOptions) -> TrainedModelExecution:
        """The data and the evaluated images every cell shares (checked before any run opens); a pretrained model once."""
        dev, workdir = resolve_device(options.device), options.output_dir / protocol.name
        acted = None
        if protocol.acts_on is not None:
            data = prepare_protocol_data(protocol.source, options.data_path, options.download)
        else:
            acted, data = pretrained_data(protocol.pretrained, options.data_path, options.download)
        images = self.evaluated_images(protocol, data)
        split = data.test if self.settings(protocol).split == "test" else data.val
        counts = class_counts(images.labels.numpy(), np.unique(split.labels.numpy()))
        return TrainedModelExecution(protocol, data, images, dev, workdir, counts, pretrained=acted)

    def sample_line(self, protocol) -> str:
        """The evaluated images per class, and a warning where the sample misses a class of the split
        or has fewer than ``MIN_PER_CLASS`` of one; under ``--strict`` that is refused (``ProtocolError``
        naming the file), before any run opens."""
        counts = self.ex.counts
        problems = counts.problems(MIN_PER_CLASS)
        shown = (
            ", ".join(str(int(n)) for n in counts.counts)
            if len(counts.classes) <= 20
            else f"{int(counts.counts.min())} to {int(counts.counts.max())}"
        )
        line = f"per class ({len(counts.classes)} classes of the split): {shown}"
        if problems and self.strict:
            raise ProtocolError(
                f"{protocol.source_file}: --strict: the evaluated images do not speak for the data: "
                + "; ".join(problems)
            )
        return line + "".join(f"; warning: {p}" for p in problems)

    def store_for(self, protocol) -> str:
        """Where this execution's runs go: the store of the acted-on cells, never the local fallback
        store while a server is away nor a SQLite file that does not exist, where no trained cell can
        be (before, a dead server sent ``intervene`` to a new local store that opened a parent and
        failed every cell). A pretrained model, or cells read from published evidence
        (``--cells-from``), need no trained cell in the store: their runs may go to the fallback.
        """
        if protocol.acts_on is None or self.published is not None:
            return configure_tracking()
        try:
            configure_tracking(allow_offline=False)
        except StoreUnavailableError as err:
            raise StoreUnavailableError(
                f"{err}; {protocol.name} acts on the trained cells of {protocol.acts_on.protocol}, "
                "which no local fallback store holds: nothing was run (start the server, set "
                "MLFLOW_TRACKING_URI to the store of those cells, or give --cells-from)"
            ) from None
        return configure_tracking()  # the writer's checks too (a writable SQLite file)

    def prepare(self, protocol, protocol_file: Path, options: StudyOptions) -> str:
        if self.published is not None and protocol.acts_on is None:
            raise ProtocolError(
                f"{protocol.source_file}: --cells-from gives trained cells, but this protocol acts on "
                "a pretrained model"
            )
        self.store_for(protocol)
        self.ex = ex = self.prepare_execution(protocol, options)
        self.acted = (
            f"{protocol.acts_on.protocol}@{protocol.acts_on.hash[:12]} arms {', '.join(protocol.arms)}"
            if protocol.acts_on
            else ex.pretrained.description
        )
        self.started, self.protocol_file = time.perf_counter(), protocol_file
        return (
            f"{protocol.name}@{protocol.short_hash}: acts on {self.acted}; {len(protocol.cells())} cells; "
            f"{ex.data.display_name}, {self.images_words(protocol)}{len(ex.images)} "
            f"{self.settings(protocol).split} images; {self.sample_line(protocol)}"
        )

    def parent_tags(self) -> dict:
        return {self.tag: TRUE, "acts_on": self.acted[:500]}

    def begin(self, parent) -> None:
        self.ex.parent = parent.run_id

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
            f"time: {sum(o.seconds for o in outcomes):.1f} s {self.work} ({used} "
            f"thread{'s' if used != 1 else ''}), {time.perf_counter() - self.command_started:.1f} s in all; "
            f"report: workbench report --protocol {self.protocol_file}"
        ]

    def cell_key(self, cell: InterventionCell, identity: str, code: str | None = None) -> str:
        """Protocol hash, arm, seed, the acted-on weights, data and split, and the code that computes
        the results (``code``, else this kind's ``code_fingerprint()``)."""
        ex = self.ex
        parts = [
            ex.protocol.hash,
            cell.arm,
            str(cell.seed),
            identity,
            ex.data.data_fingerprint,
            ex.data.split_fingerprint,
            f"code={code or self.code_fingerprint()}",
        ]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]

    def acted_cell(self, cell: InterventionCell, run_id: str | None) -> ActedCell:
        """The cell's model: the pretrained one, or the trained cell's best checkpoint on this data."""
        ex, p = self.ex, self.ex.protocol
        if ex.pretrained is not None:
            cfg = ex.pretrained.model.cfg
            inputs = inputs_for(
                ex, cfg, batch_size=self.settings(p).batch_size, amp="off", resize_to=None
            )
            return ActedCell(
                ex.pretrained.model, None, inputs, None, ex.pretrained.description, False
            )
        if self.published is not None:
            trained = self.published.load(p.acts_on.hash, cell.arm, cell.seed)
            params = trained.params
        else:
            trained = intervention_runs.trained_cell(
                p.acts_on.protocol, p.acts_on.hash, cell.arm, cell.seed, ex.workdir / "sources"
            )
            params = trained.run.data.params
        for key, here in (
            ("data.fingerprint", ex.data.data_fingerprint),
            ("data.split_fingerprint", ex.data.split_fingerprint),
        ):
            if params.get(key) != here:
                raise self.error(
                    f"the trained run {run_id} has {key} {str(params.get(key))[:12]}, the data here "
                    f"{here[:12]}: not the data the cell was trained and validated on"
                )
        model = trained_cell_model(trained.config, trained.state_dict).to(ex.device)
        arm = next(a for a in p.source.arms if a.name == cell.arm).config
        proof = inputs_for(
            ex,
            model.cfg,
            batch_size=arm.run.eval_batch_size,
            amp=arm.run.amp,
            resize_to=arm.data.resize_to,
        )
        inputs = inputs_for(
            ex,
            model.cfg,
            batch_size=self.settings(p).batch_size,
            amp=arm.run.amp,
            resize_to=arm.data.resize_to,
            as_trained=self.cell_precision,
        )
        description = f"{p.acts_on.protocol} cell {cell.key}, best checkpoint of run {run_id}{read_across_note(trained.config)}"
        return ActedCell(
            model,
            proof,
            inputs,
            trained.predictions["val"],
            description,
            saved_through_fused_attention(trained.config, proof.device.type),
        )

    def run_cell(self, cell: InterventionCell, parent) -> CellOutcome:
        """Skip, or evaluate and log one cell; any error fails this cell only."""
        p = self.ex.protocol
        pretrained = self.ex.pretrained
        try:
            if pretrained:
                run_id = None
            elif self.published is not None:
                run_id = self.published.run_id(p.acts_on.hash, cell.arm, cell.seed)
            else:
                run_id = find_finished_cell(p.acts_on.protocol, p.acts_on.hash, cell.arm, cell.seed)
        except (SourceError, PublishedCellError) as err:
            return CellOutcome(cell, Status.FAILED, f"{cell.key}: {err}")
        identity = pretrained.identity if pretrained else run_id
        tags = cell_tags(
            protocol_name=p.name,
            protocol_hash=p.hash,
            arm=cell.arm,
            seed=cell.seed,
            kind=self.tag,
            allow_dirty=self.options.allow_dirty,
            **{SOURCE_RUN_ID: run_id or "", SOURCE_IDENTITY: identity},
        )
        opened = open_leased_run(
            p.name,
            same_code_key(
                p.name, lambda code: self.cell_key(cell, identity, code), self.code_fingerprint()
            ),
            {RUN_NAME: f"{cell.arm}-seed{cell.seed}", **tags},
            self.ex.parent,
        )
        untouched = hold_opened(cell, opened)
        if untouched is not None:
            return untouched
        token = opened.token
        try:
            return self._evaluate_cell(cell, sink=opened.sink, token=token, run_id=run_id)
        except BaseException as err:  # a failing cell must not take the others down; Ctrl-C goes up
            return outcome_of_error(cell, opened.sink, token, err)

    def _evaluate_cell(
        self, cell: InterventionCell, *, sink: RunSink, token: str, run_id: str | None
    ) -> CellOutcome:
        ex = self.ex
        acted = self.acted_cell(cell, run_id)
        plan, kind_params = self.plan(cell, acted)
        fingerprint = self.code_fingerprint()
        sink.set_tags(
            {
                **environment_tags(str(ex.device)),
                "code_fingerprint": fingerprint,
                "threads": str(torch.get_num_threads()),
                "acted_on": acted.description[:500],
                STARTED_TAG: "true",
            }
        )
        log_kernel_identity(sink, ex.device)  # the kernels that computed this cell's numbers
        sink.log_params(
            {
                "arm": cell.arm,
                "seed": cell.seed,
                **kind_params,
                "code_fingerprint": fingerprint,
                "source_run_id": run_id or "",
                "data.fingerprint": ex.data.data_fingerprint,
                "data.split_fingerprint": ex.data.split_fingerprint,
                "data.display_name": ex.data.display_name,
            }
        )
        proof = None
        if acted.saved is not None:  # first: the checkpoint must have made the cell's predictions
            proof = reload_proof(
                acted.model,
                ex.data.val,
                acted.saved,
                acted.proof_inputs,
                fast_attention=acted.fused,
            )
            if not proof.passed:
                raise self.error(
                    f"{proof.summary()}: the checkpoint of run {run_id} is not the one that made "
                    f"its saved predictions; nothing {self.done}"
                )
        message, seconds = self.evaluate(cell, acted, plan, proof=proof, sink=sink)
        end_cell(sink, token, "FINISHED")
        proof_text = f"; {proof.summary()}" if proof else ""
        where = (
            f" [logged locally, run {sink.local_run_id}: `workbench sync` copies it to the server]"
            if sink.offline
            else ""
        )
        return CellOutcome(
            cell,
            Status.FINISHED,
            f"{message}{proof_text}{where}",
            sink.run_id,
            seconds=seconds,
            offline=sink.offline,
        )


def trained_model_command(
    name: str, kind: type[TrainedModelKind], default_protocol: str
) -> click.Command:
    """The command of a kind that acts on trained models: ``workbench <name> --protocol FILE``.

    Its help is the kind's ``command_help`` (the first sentence is the short help); its outputs
    default to ``outputs/<name>``; ``default_protocol`` is run when ``--protocol`` is not given.
    """

    @click.command(name, help=kind.command_help)
    @click.option(
        "--protocol",
        "protocol_path",
        default=default_protocol,
        show_default=True,
        type=click.Path(exists=True, dir_okay=False),
        help=f"{kind.tag.capitalize()} protocol YAML file.",
    )
    @click.option(
        "--strict",
        is_flag=True,
        help="Refuse evaluated images that miss a class of the split or hold fewer than "
        f"{MIN_PER_CLASS} of one (otherwise a warning).",
    )
    @study_options(f"outputs/{name}", "Downloaded checkpoints of the acted-on cells.")
    @click.option(
        "--cells-from",
        type=click.Path(exists=True, file_okay=False),
        default=None,
        help="A published study's evidence folder that ships the acted-on weights "
        "(docs/results/<study>/evidence): act on those cells instead of the store's.",
    )
    def command(protocol_path, strict, options: StudyOptions, cells_from):
        with said_in_one_line(kind):
            study = kind(options, strict, cells_from)
        with said_in_one_line(study):
            protocol = open_study(kind, protocol_path, options.allow_dirty, study.store_for)
        run_study(study, protocol, Path(protocol_path), options)

    return command
