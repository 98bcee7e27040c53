"""Entry point: a transfer protocol's regimes × seeds from one source, selected on validation QWK, tested once.

Phase 1 trains and selects every cell on validation, with the test split locked away.
Phase 2 releases it and evaluates each selected checkpoint once. Rerunning the same
command skips finished cells, reuses finished selections and retrains the rest; the report
section is rebuilt from MLflow at the end and logged on the execution's parent run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import click
import torch
from tqdm.auto import tqdm

from reports.transfer.transfer_blocks import transfer_markdown
from studies.runtime.cell_end import end_cell, end_with_execution, hold_opened, outcome_of_error
from studies.runtime.options import StudyOptions, check_amp, study_options
from studies.runtime.outcome import CellOutcome, Status
from studies.runtime.preflight import check_writable_folder, remove_abandoned_cache_files
from studies.runtime.study_kind import StudyKind, open_study, run_cells, run_study, said_in_one_line
from studies.runtime.study_protocol import ProtocolError, load_protocol, load_transfer_protocol
from tracking.kinds import transfer_runs
from tracking.kinds.training_runs import log_kernel_identity
from tracking.record.lease import HEARTBEATS
from tracking.record.protocol_runs import STARTED_TAG
from tracking.record.sink import RunSink
from tracking.store.session import configure_tracking, environment_tags
from tracking.record.cell_runs import open_leased_run, same_code_key
from tracking.record.schema import RUN_NAME, SOURCE_IDENTITY, TRANSFER, TRUE, cell_tags
from workbench.convert.checkpoints import sha256_file
from workbench.data import DatasetNotFound, PreparedData, SplitSizeError, prepare
from workbench.precision import device_capability, resolve_amp
from workbench.protocol.transfer import SourceSpec, TransferCell, TransferData, TransferProtocol
from workbench.train.loop import resolve_device
from workbench.transfer.any_model import (
    SCRATCH_INIT_ANY,
    RegimeRefused,
    check_regimes,
    compute_pooled,
)
from workbench.transfer.features import FeatureCache, compute_features
from workbench.transfer.runner import (
    Selection,
    TestSplitGuard,
    TransferContext,
    evaluate_on_test,
    select_cell,
    split_off_test,
)
from workbench.transfer.source_model import (
    SCRATCH_INIT,
    SourceError,
    SourceModel,
    load_local_source,
    load_timm_source,
    parse_protocol_cell,
    parse_weights,
)

DEFAULT_PROTOCOL = "studies/protocols/retina_transfer_smoke.yaml"


@dataclass
class OpenCell:
    """A cell selected in phase 1 whose run this execution holds (leased) until phase 2 ends it."""

    cell: TransferCell
    sink: RunSink
    run_dir: Path
    selection: Selection
    token: str


def resolve_source(
    spec: SourceSpec, override: str | None, protocol_file: Path, download_dir: Path
) -> SourceModel:
    """Load the source named by ``--source`` or the protocol: timm (hub/random/file) or a workbench run.

    With ``source.sha256`` the resolved file's sha256 must equal it; a mismatch is refused
    (``SourceError``) before the file is loaded and before any run of the study opens.
    """
    weights = override or spec.weights
    scheme, rest = parse_weights(weights)
    where = f"--source {weights!r}" if override else f"source.weights={weights!r}"
    if scheme in ("hub", "random"):
        if not spec.model:
            raise SourceError(f"weights {scheme!r} need source.model in the protocol")
        if scheme == "random" and spec.sha256:
            raise SourceError(
                f"{protocol_file}: source.sha256: {where} is a random init, with no file to pin"
            )
        source = load_timm_source(spec.model, scheme, spec.seed)
        check_pinned_sha256(
            spec.sha256, source.info.sha256, protocol_file, f"{where} ({source.info.path})"
        )
        return source
    if scheme == "path":
        if Path(rest).is_file():
            check_pinned_sha256(spec.sha256, sha256_file(rest), protocol_file, f"{where} ({rest})")
        return load_local_source(rest, spec.model, uri=weights)
    if scheme == "protocol":
        name, arm, seed = parse_protocol_cell(rest)
        source_file = Path(protocol_file).parent / f"{name}.yaml"
        source_protocol = load_protocol(source_file)
        key = (
            f"--source {weights!r}" if override else f"{protocol_file}: source.weights={weights!r}"
        )
        check_source_cell(key, source_protocol, arm, seed)  # before the store is asked
        rest = transfer_runs.find_finished_cell(name, source_protocol.hash, arm, seed)
    local, run_id, note = transfer_runs.download_run_source(rest, download_dir)
    if spec.sha256:
        actual = sha256_file(local) if Path(local).is_file() else f"none ({local} is not a file)"
        check_pinned_sha256(
            spec.sha256, actual, protocol_file, f"{where} (run {run_id}, {Path(local).name})"
        )
    trained_on = transfer_runs.run_param(run_id, "data.display_name")
    source = load_local_source(local, spec.model, uri=weights, run_id=run_id, trained_on=trained_on)
    if note:
        source.info = replace(source.info, description=f"{source.info.description} ({note})")
    return source


def check_pinned_sha256(
    expected: str | None, actual: str, protocol_file: Path, resolved: str
) -> None:
    """Refuse a source file whose sha256 is not the protocol's pin (no pin: nothing to check)."""
    if expected and actual != expected:
        raise SourceError(
            f"{protocol_file}: source.sha256: expected {expected}, but {resolved} has sha256 "
            f"{actual or 'none'}; the protocol pins another checkpoint"
        )


def check_source_cell(key: str, source, arm: str, seed: int) -> None:
    """Refuse a ``protocol:<name>/<arm>/seed<k>`` source whose arm or seed its protocol does not have.

    ``key`` says where the source was given (the protocol's ``source.weights`` or ``--source``).
    """
    arms = [a.name for a in source.arms]
    if arm not in arms:
        raise SourceError(f"{key}: {source.source} has no arm {arm!r} (arms: {', '.join(arms)})")
    if seed not in source.seeds:
        raise SourceError(
            f"{key}: {source.source} has no seed {seed} (seeds: {', '.join(map(str, source.seeds))})"
        )


def source_identity(source: SourceModel, spec: SourceSpec) -> str:
    """sha256 of the weights file, or what fixes a random init."""
    return source.info.sha256 or f"random:{source.info.architecture}:seed{spec.seed}"


def prepare_transfer_data(
    spec: TransferData, data_path: str | None, download: bool, image_size: int
) -> PreparedData:
    """Load the dataset; with ``size: auto`` prefer local RetinaMNIST files at the model's input size."""
    remove_abandoned_cache_files()
    common = dict(
        path=data_path,
        split_seed=spec.split_seed,
        train_size=spec.train_size,
        val_size=spec.val_size,
        subset=spec.subset,
    )
    if spec.name != "retinamnist" or (data_path and Path(data_path).is_file()):
        return prepare(spec.name, download=download, **common)  # an explicit file holds one size
    if spec.size != "auto":
        return prepare(spec.name, download=download, size=spec.size, **common)
    if image_size in (64, 128, 224):
        try:
            return prepare(spec.name, download=False, size=image_size, **common)
        except DatasetNotFound:
            pass  # fall back to 28 px upsampled in batches, which the input description then says
    return prepare(spec.name, download=download, size=28, **common)


def _cell_params(cell: TransferCell, ex: "TransferExecution") -> dict:
    r, ctx, data = cell.regime, ex.ctx, ex.data
    params = {
        "regime.name": r.name,
        "regime.kind": r.kind,
        "regime.epochs": r.epochs,
        "regime.blocks": r.blocks,
        "regime.layer_decay": r.layer_decay,
        "regime.patience": r.patience,
        "seed": cell.seed,
        "batch_size": ctx.batch_size,
        "eval_batch_size": ctx.eval_batch_size,
        "amp": str(ctx.amp_dtype),
        "threads": torch.get_num_threads(),
        "inputs": ex.inputs,
        "data.fingerprint": data.data_fingerprint,
        "data.split_fingerprint": data.split_fingerprint,
        "data.n_train": len(data.train),
        "data.n_val": len(data.val),
    }
    # the source's architecture only: never its weights, never pretrained
    scratch = r.kind == "scratch"
    init = SCRATCH_INIT if ex.source.is_vit else SCRATCH_INIT_ANY
    params |= {
        "regime.init": scratch_init(cell.seed, init) if scratch else "the source's weights",
        "regime.pretrained": "False" if scratch else str(ex.source.info.pretrained),
    }
    return (
        params
        | {f"optim.{k}": v for k, v in vars(r.optim).items()}
        | ex.source.info.as_params()
        | pin_params(ex.protocol.source)
    )


def scratch_init(seed: int, init: str = SCRATCH_INIT) -> str:
    """What a scratch cell's init is, as its run records it (``source_model.scratch_model``, ``any_model.scratch_copy``)."""
    return (
        f"trained from scratch: the source's architecture from a random init, torch.manual_seed(derive_seed("
        f"{seed}, 'init')), {init}; the seed's new head; NOT PRETRAINED"
    )


def pin_params(spec: SourceSpec) -> dict[str, str]:
    """The protocol's pin of the source file (``source.sha256``), recorded beside the sha256 actually read."""
    return {"source.sha256_pin": spec.sha256 or "none"}


@dataclass
class TransferExecution:
    """What one execution of a protocol shares across its cells."""

    protocol: TransferProtocol
    source: SourceModel
    data: PreparedData  # train and val only: the test split is behind ``guard``
    guard: TestSplitGuard
    ctx: TransferContext
    identity: str
    inputs: str
    output_dir: Path
    parent: str = ""
    cache: FeatureCache | None = None

    def features(self) -> FeatureCache:
        """The frozen backbone's features, computed on first use and shared by every seed."""
        if self.cache is None:
            cfg, ctx, splits = (
                self.source.cfg,
                self.ctx,
                {"train": self.data.train, "val": self.data.val},
            )
            if self.source.is_vit:
                starts = [
                    cfg.depth - r.blocks for r in self.protocol.regimes if r.kind == "partial"
                ]
                self.cache = compute_features(
                    self.source.model.to(ctx.device),
                    splits,
                    ctx.norm,
                    ctx.resize_to,
                    ctx.device,
                    ctx.eval_batch_size,
                    ctx.amp_dtype,
                    starts,
                )
            else:  # any other model: pooled features only; its partial regimes train on images
                self.cache = compute_pooled(
                    self.source.model.to(ctx.device),
                    splits,
                    ctx.norm,
                    ctx.resize_to,
                    ctx.device,
                    ctx.eval_batch_size,
                    ctx.amp_dtype,
                )
            RunSink.for_run(self.parent, self.protocol.name).log_metrics(
                {"feature_cache_seconds": self.cache.seconds}
            )
            tqdm.write(
                f"features of {self.cache.images} images cached in {self.cache.seconds:.1f} s"
            )
        return self.cache


def prepare_execution(
    protocol: TransferProtocol,
    protocol_file: Path,
    options: StudyOptions,
    *,
    source_override: str | None = None,
) -> TransferExecution:
    """Source, data (test split locked away at once) and the shared context."""
    output_dir = options.output_dir / protocol.name
    source = resolve_source(
        protocol.source, source_override, Path(protocol_file), output_dir / "sources"
    )
    if not source.is_vit:  # a regime the model cannot take, refused by its key before a run opens
        try:
            check_regimes(source.model, protocol.regimes, str(protocol_file))
        except RegimeRefused as err:
            raise ProtocolError(str(err)) from err
    image_size = source.image_size  # None: the model takes any size, and the data keeps its own
    try:
        data = prepare_transfer_data(
            protocol.dataset, options.data_path, options.download, image_size or 0
        )
    except SplitSizeError as err:
        raise ProtocolError(f"{protocol_file}: dataset: {err}") from err
    if len(data.class_names) < 2:  # a new head with one output learns nothing
        raise ProtocolError(
            f"{protocol_file}: {data.display_name} has {len(data.class_names)} class(es); "
            "a transfer study needs at least 2"
        )
    if protocol.run.batch_size > len(data.train):
        raise ProtocolError(
            f"{protocol_file}: run.batch_size={protocol.run.batch_size}: larger than the training "
            f"split ({len(data.train)} images of {data.display_name})"
        )
    if data.test is None:  # the container's field, not the images: nothing is read here
        raise ProtocolError(
            f"{protocol_file}: {data.display_name} has no test split; a transfer study reports test metrics"
        )
    dev, side = resolve_device(options.device), data.train.images.shape[-1]
    ctx = TransferContext(
        dev,
        resolve_amp(protocol.run.amp, dev),
        protocol.run.batch_size,
        protocol.run.eval_batch_size,
        source.norm,
        None if image_size is None or side == image_size else image_size,
        len(data.class_names),
    )
    # from here on only phase 2 can read the test split
    selection_data, guard = split_off_test(data, source.in_channels)
    inputs = (
        f"{side} px images upsampled in batches to {image_size} px (bilinear)"
        if ctx.resize_to
        else f"{side} px images at the model's input size"
        if image_size
        else f"{side} px images at their own size (the model takes any size)"
    )
    return TransferExecution(
        protocol,
        source,
        selection_data,
        guard,
        ctx,
        source_identity(source, protocol.source),
        inputs,
        output_dir,
    )


def cell_key(ex: "TransferExecution", cell: TransferCell, code: str | None = None) -> str:
    """A cell's identity: protocol, regime, seed, source, data and split, and the code that computes results.

    The code is ``code`` or else ``transfer_runs.transfer_code_fingerprint()`` (the import closure of the
    training and transfer library, and the torch/timm versions), not the git commit: a commit of docs or
    reports re-trains nothing.
    """
    code = code or transfer_runs.transfer_code_fingerprint()
    p, data = ex.protocol, ex.data
    return hashlib.sha256(
        "|".join(
            [
                p.hash,
                cell.regime.name,
                str(cell.seed),
                ex.identity,
                data.data_fingerprint,
                data.split_fingerprint,
                f"code={code}",
            ]
        ).encode()
    ).hexdigest()[:24]


def select_phase(
    ex: TransferExecution, cell: TransferCell, allow_dirty: bool
) -> CellOutcome | OpenCell:
    """Phase 1 for one cell: skip it, reuse its finished selection, or train and select it."""
    p, data = ex.protocol, ex.data
    key = same_code_key(
        p.name, lambda code: cell_key(ex, cell, code), transfer_runs.transfer_code_fingerprint()
    )
    tags = cell_tags(
        protocol_name=p.name,
        protocol_hash=p.hash,
        arm=cell.regime.name,
        seed=cell.seed,
        is_reference=cell.regime.reference,
        kind=TRANSFER,
        allow_dirty=allow_dirty,
        regime_kind=cell.regime.kind,
        **{SOURCE_IDENTITY: ex.identity},
    )
    opened = open_leased_run(
        p.name, key, {RUN_NAME: f"{cell.regime.name}-seed{cell.seed}", **tags}, ex.parent
    )
    untouched = hold_opened(cell, opened)
    token = opened.token
    if untouched is not None:
        return untouched
    sink, run_dir = opened.sink, ex.output_dir / key
    try:
        sink.set_tags(
            {
                **environment_tags(str(ex.ctx.device)),
                "code_fingerprint": transfer_runs.transfer_code_fingerprint(),
                **device_capability(ex.ctx.device),
                "threads": str(torch.get_num_threads()),
                "run_dir": str(run_dir.resolve()),
                "resumed": str(opened.status is not None).lower(),
                STARTED_TAG: "true",
            }
        )
        sink.log_params(
            {
                **_cell_params(cell, ex),
                "code_fingerprint": transfer_runs.transfer_code_fingerprint(),
            }
        )
        log_kernel_identity(sink, ex.ctx.device)
        selection = (
            Selection.load(run_dir) if sink.journal.tags.get("phase") == "selected" else None
        )
        if selection is None:
            cache = ex.features() if cell.regime.kind in ("linear", "partial") else None
            selection = select_cell(
                cell,
                ex.source,
                data,
                cache,
                ex.ctx,
                run_dir,
                transfer_runs.TransferEpochObserver(sink),
            )
            HEARTBEATS.check(sink.run_id, verify=True)
            transfer_runs.log_selection(sink, selection, p.run.log_checkpoints)
        if not selection.proof["passed"]:
            raise RuntimeError(f"{selection.proof['what']} failed: {selection.proof['summary']}")
    except BaseException as err:  # a failing cell must not take the others down; Ctrl-C goes up
        return outcome_of_error(cell, sink, token, err)
    tqdm.write(
        f"[selected] {cell.key}: epoch {selection.best_epoch}, val QWK {selection.best_val['val_qwk']:.4f} "
        f"({selection.seconds:.1f} s)"
    )
    return OpenCell(cell, sink, run_dir, selection, token)


def evaluate_phase(ex: TransferExecution, held: OpenCell) -> CellOutcome:
    """Phase 2 for one selected cell: the single test evaluation, logged; FINISHED only if file and memory agree."""
    evaluation, cell, sink = ex.protocol.evaluation, held.cell, held.sink
    try:
        HEARTBEATS.check(sink.run_id, verify=True)
        result = evaluate_on_test(
            held.selection, ex.source, ex.guard, ex.ctx, held.run_dir, evaluation
        )
        HEARTBEATS.check(sink.run_id, verify=True)
        transfer_runs.log_test(sink, result, evaluation.n_resamples, evaluation.confidence)
    except BaseException as err:  # the run records why it ended; Ctrl-C goes up
        return outcome_of_error(cell, sink, held.token, err)
    qwk = result.cis["qwk"]
    end_cell(sink, held.token, "FINISHED" if result.agree else "FAILED")
    where = (
        f" [logged locally, run {sink.local_run_id}: `workbench sync` copies it to the server]"
        if sink.offline
        else ""
    )
    return CellOutcome(
        cell,
        Status.FINISHED if result.agree else Status.FAILED,
        f"{cell.key}: test QWK {qwk.estimate:.4f} [{qwk.low:.4f}, {qwk.high:.4f}], "
        f"metrics from file {'agree' if result.agree else 'DIFFER'}{where}",
        sink.run_id,
        offline=sink.offline,
    )


class TransferStudy(StudyKind):
    """A transfer protocol's regimes x seeds: every cell selected on validation (phase 1, the test split locked
    away), then each selected cell tested once (phase 2, ``deferred``)."""

    user_errors = (ProtocolError, SourceError, DatasetNotFound)

    def __init__(self, options: StudyOptions, source_override: str | None = None) -> None:
        self.options, self.source_override = options, source_override
        self.pending: list[
            OpenCell
        ] = []  # selected, waiting for the test phase; this execution holds their runs

    @classmethod
    def load(cls, path: str) -> TransferProtocol:
        return load_transfer_protocol(path)

    def prepare(
        self, protocol: TransferProtocol, protocol_file: Path, options: StudyOptions
    ) -> str:
        configure_tracking()
        self.ex = ex = prepare_execution(
            protocol, protocol_file, options, source_override=self.source_override
        )
        return (
            f"{protocol.name}@{protocol.short_hash}: source {ex.source.info.label()} [{ex.identity[:16]}]; "
            f"{ex.data.display_name}, {len(ex.data.train)} train / {len(ex.data.val)} val; {ex.inputs}"
        )

    def parent_tags(self) -> dict:
        return {
            TRANSFER: TRUE,
            SOURCE_IDENTITY: self.ex.identity,
            "source_override": self.source_override or "",
        }

    def begin(self, parent) -> None:
        ex, protocol = self.ex, self.ex.protocol
        ex.parent = parent.run_id
        parent.sink.log_params(
            {
                **ex.source.info.as_params(),
                **pin_params(protocol.source),
                "transfer.regimes": ",".join(r.name for r in protocol.regimes),
                "transfer.reference": protocol.reference.name,
                "transfer.num_classes": ex.ctx.num_classes,
                "evaluation.n_resamples": protocol.evaluation.n_resamples,
                "evaluation.confidence": protocol.evaluation.confidence,
                "evaluation.seed": protocol.evaluation.seed,
                "inputs": ex.inputs,
                "data.display_name": ex.data.display_name,
                "data.fingerprint": ex.data.data_fingerprint,
                "data.split_fingerprint": ex.data.split_fingerprint,
            }
        )

    def run_cell(self, cell: TransferCell, parent) -> CellOutcome | None:
        result = select_phase(self.ex, cell, self.options.allow_dirty)
        if isinstance(result, OpenCell):
            self.pending.append(result)
            return None
        return result

    def deferred(self, parent):
        self.ex.guard.release()  # selection of every cell is over: phase 2 may read the test split
        parent.sink.log_params({"data.n_test": len(self.ex.guard.split())})
        while self.pending:  # taken off first: evaluate_phase ends its cell's run however it ends
            yield evaluate_phase(self.ex, self.pending.pop(0))

    def abandon(self, err: BaseException) -> None:
        # Selected cells waiting for their test evaluation end with the execution, as it ended;
        # the next execution reuses their selection (tag ``phase``) and only tests them.
        for held in self.pending:
            end_with_execution(held.sink, held.token, err)

    def end(self, parent, outcomes: list[CellOutcome]) -> None:
        if any(o.status in (Status.FINISHED, Status.SKIPPED) for o in outcomes):
            log_section(self.ex, parent.sink)


def run_transfer(
    protocol: TransferProtocol,
    protocol_file: Path,
    options: StudyOptions,
    *,
    source_override: str | None = None,
) -> list[CellOutcome]:
    """Run (or resume) every cell of ``protocol`` under the study's one parent run; returns the outcomes.

    However the execution ends (finished, failed, Ctrl-C, SIGTERM), the runs it holds end
    with a status that says so, and the parent's cell counts come from its children.
    """
    return run_cells(TransferStudy(options, source_override), protocol, protocol_file, options)


def log_section(ex: TransferExecution, parent: RunSink) -> None:
    """Rebuild the report section from the tracking server and log it on the parent run.

    The section is read back from the server; with the server away (the study went on in
    the local store) it is left for ``workbench report`` after ``workbench sync``.
    """
    later = (
        f"transfer section not built: the tracking server is unreachable; run `workbench sync`, then "
        f"`workbench report --protocol {ex.protocol.name}`"
    )
    if parent.offline:
        tqdm.write(later)
        return
    try:
        section = transfer_runs.transfer_section(ex.protocol.name, ex.protocol.hash, ex.identity)
    except Exception as err:
        if not transfer_runs.section_unavailable(err):
            raise
        tqdm.write(later)
        return
    markdown = transfer_markdown(section)
    transfer_runs.log_section(parent, section, markdown)
    click.echo(markdown)


@click.command("transfer")
@click.option(
    "--protocol",
    "protocol_path",
    default=DEFAULT_PROTOCOL,
    show_default=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Transfer protocol YAML file.",
)
@click.option(
    "--source",
    "source_override",
    default=None,
    help="Override the protocol's source weights: hub, random, a local file, runs:/<id>[/path] "
    "or protocol:<name>/<arm>/seed<k>. Cells are keyed by the source's sha256; a protocol's "
    "source.sha256 pin applies to the override too.",
)
@study_options("outputs/transfer", "Checkpoints, predictions and downloaded sources of each cell.")
def transfer(protocol_path, source_override, options: StudyOptions):
    """Run (or resume) a transfer protocol: linear probe, partial and full fine-tuning at paired seeds."""
    kind = TransferStudy(options, source_override)
    with said_in_one_line(kind):
        protocol = open_study(TransferStudy, protocol_path, options.allow_dirty)
        check_amp(protocol.run.amp, options.device)
        check_writable_folder(options.output_dir)  # before the data or a source model is loaded
    run_study(kind, protocol, Path(protocol_path), options)
