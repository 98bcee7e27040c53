"""Entry point: train one configuration, resumably, tracked in MLflow.

The same ``train_one`` runs each cell of a protocol. A run is identified by a key made
of the config hash, the data and split fingerprints and any extra identity (protocol
hash, arm, seed); running the same key again continues the unfinished MLflow run and its
checkpoints, or skips it when it already finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from dataclasses import fields
from pathlib import Path

import click
import torch
import yaml
from tqdm.auto import tqdm

from studies.ablation.preemption import PreemptibleTrainer
from studies.runtime.cell_end import ended, hold_opened, training_outcome
from studies.runtime.options import FINITE, check_amp, threads_option
from studies.runtime.kernel_match import MATCH_ENV, check_takeover
from workbench.kernel_identity import kernel_identity, recorded_identity
from studies.runtime.outcome import CellOutcome, Status
from studies.runtime.stop_signals import Preempted, as_stop, stops_at_step_boundaries
from studies.runtime.study_execution import prepare_data
from studies.runtime.preflight import (
    check_trainable,
    check_writable_folder,
    outcome_line,
    trainable_problem,
)
from tracking.kinds.checkpoint_artifacts import CheckpointUploader, fetch_checkpoint, position
from tracking.kinds.training_runs import (
    MlflowTrainingObserver,
    log_run_inputs,
    log_training_result,
    started_threads,
)
from tracking.record.cell_runs import open_leased_run
from tracking.record.schema import RESUMED, RUN_NAME, STARTED_TAG, TRUE, USER, flag
from tracking.record.sink import RunSink
from tracking.store.session import configure_tracking, environment_tags, run_user
from workbench.data import DEFAULT_SIZES, PreparedData
from workbench.data.locate import DATASET_NAMES
from workbench.data.prepare import DEFAULT_VAL_FRACTION
from workbench.models.registry import STUDY_MODELS, build_model, model_config
from workbench.models.timm_arm import TimmModelError
from workbench.precision import device_capability, resolve_amp
from workbench.protocol.common import yaml_value
from workbench.train.config import (
    DataSpec,
    FastPathConfig,
    ModelSpec,
    OptimConfig,
    RecipeConfig,
    RunConfig,
    TrainConfig,
)
from workbench.train.fits import DataShape, misfits
from workbench.train.loop import (
    Observers,
    TrainingObserver,
    config_hash,
    resolve_device,
)


def run_key_for(cfg: TrainConfig, data: PreparedData, identity: dict | None = None) -> str:
    parts = [config_hash(cfg), data.data_fingerprint, data.split_fingerprint]
    parts += [f"{k}={v}" for k, v in sorted((identity or {}).items())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def train_one(
    cfg: TrainConfig,
    data: PreparedData,
    *,
    experiment: str,
    output_dir: Path,
    run_name: str,
    parent_run_id: str | None = None,
    identity: dict | None = None,
    tags: dict | None = None,
    observer: TrainingObserver | None = None,
    params: dict | None = None,
    log=tqdm.write,
    take_over: bool = False,
    threads: int = 0,
) -> CellOutcome:
    """Train ``cfg`` on ``data`` in its own MLflow run (a child of ``parent_run_id``).

    ``threads`` is the thread count the user asked for (``--threads``; 0: none asked). A
    cell that already has a run trains with the count it started with unless one was asked
    for (``cell_threads``): the count is part of the numbers.

    Every MLflow call goes through a ``RunSink``: if the tracking server is unreachable at
    the start or goes away mid-run, the run continues in the local fallback store and
    training goes on (``workbench sync`` copies it to the server later).
    """
    # AmpUnsupported before any run is opened
    resolve_amp(cfg.run.amp, resolve_device(cfg.run.device))
    # one class, or a batch larger than the training split: before any run
    check_trainable(cfg, data)
    # a read-only folder would fail at the first checkpoint, after an epoch
    check_writable_folder(output_dir)
    configure_tracking()
    key = run_key_for(cfg, data, identity)
    opened = open_leased_run(
        experiment,
        key,
        {RUN_NAME: run_name, USER: run_user(), **(tags or {})},
        parent_run_id,
        take_over=take_over,
    )
    untouched = hold_opened(None, opened, log, name=run_name)
    if untouched is not None:
        return untouched
    sink = opened.sink
    token = opened.token
    run_dir = Path(output_dir) / key
    mlflow_observer = MlflowTrainingObserver(sink, fenced=True, confirm=opened.confirm)
    started = started_threads(sink, opened.continues) if opened.status is not None else None
    with cell_threads(started, threads, run_name, log) as thread_tags:
        return _train(
            cfg,
            data,
            sink,
            token=token,
            previous=opened.status,
            run_dir=run_dir,
            mlflow_observer=mlflow_observer,
            observer=observer,
            run_name=run_name,
            params=params,
            thread_tags=thread_tags,
            log=log,
        )


def _train(
    cfg: TrainConfig,
    data: PreparedData,
    sink: RunSink,
    *,
    token: str,
    previous: str | None,
    run_dir: Path,
    mlflow_observer: MlflowTrainingObserver,
    observer: TrainingObserver | None,
    run_name: str,
    params: dict | None,
    thread_tags: dict,
    log,
) -> CellOutcome:
    """The training of one opened run, ended with a truthful status however it goes (``studies.runtime.cell_end``).

    A run continued from another execution first fetches the checkpoint that execution uploaded
    when this machine's ``run_dir`` has none as far on (``tracking.kinds.checkpoint_artifacts``);
    each epoch's checkpoint goes up to the run. A preemption (``Preempted``) stops the training at
    the next step boundary with a checkpoint of that step uploaded (``studies.ablation.preemption``).
    """
    try:
        if previous is not None and os.environ.get(MATCH_ENV):  # `worker --match-kernels`
            match_first_kernels(sink, cfg, run_name)
        if previous is not None:
            fetch_previous_checkpoint(sink, run_dir, log, run_name)
        uploader = CheckpointUploader(sink, run_dir, mlflow_observer.check, log)
        trainer = PreemptibleTrainer(
            cfg,
            data,
            run_dir,
            Observers(
                mlflow_observer,
                _Announce(run_name, sink.run_id, previous, log, cfg.fast_path.compile),
                observer,
                uploader,
            ),
        )
        # Device capability (bf16 units) and the threads of this execution as tags (a resumed
        # run may run elsewhere); the first execution's threads also as a param.
        threads = torch.get_num_threads()
        sink.set_tags(
            {
                **environment_tags(str(trainer.device)),
                **device_capability(trainer.device),
                "amp_dtype": str(trainer.amp_dtype or "float32").replace("torch.", ""),
                "threads": str(threads),
                "run_dir": str(run_dir.resolve()),
                RESUMED: flag(previous is not None),
                STARTED_TAG: TRUE,
                **thread_tags,
            }
        )
        log_run_inputs(
            sink,
            cfg,
            data,
            {"config_hash": trainer.hash, "threads": threads, **(params or {})},
            device=trainer.device,
        )
        try:
            with stops_at_step_boundaries():
                result = trainer.fit()
        except Preempted:  # the last epoch's upload, if still under way, completes before the exit
            uploader.wait()
            raise
        example = next(iter(trainer.eval_loaders["val"])).images[:2]
        log_training_result(
            sink,
            result,
            cfg,
            lambda: build_model(trainer.model.cfg),
            example,
            check=lambda: mlflow_observer.check(sync=True),
        )
        uploader.finish(len(result.history), position(trainer.last_path)[1])
    except BaseException as err:  # every end of a training run: studies.runtime.cell_end
        return training_outcome(sink, token, err, run_name)
    message = f"{run_name}: best val accuracy {result.final_metrics['best_val_accuracy']:.4f} at epoch {result.best_epoch}"
    if "test_accuracy" in result.final_metrics:  # touched once, with the best weights
        message += f"; test accuracy {result.final_metrics['test_accuracy']:.4f}"
    message += f"; {result.reload_proof.summary()}"
    if sink.offline:
        message += (
            f" [logged locally, run {sink.local_run_id}: `workbench sync` copies it to the server]"
        )
    if not result.reload_proof.passed:
        return ended(sink, token, "FAILED", Status.FAILED, message)
    return ended(sink, token, "FINISHED", Status.FINISHED, message)


def match_first_kernels(sink: RunSink, cfg: TrainConfig, run_name: str) -> None:
    """A CPU cell another execution began: on its first execution's kernels, or handed back
    (``studies.runtime.kernel_match``: the worker starts again under caps, or stops)."""
    device = resolve_device(cfg.run.device)
    if device.type == "cpu":
        check_takeover(recorded_identity(sink.journal.params), kernel_identity(device), run_name)


def fetch_previous_checkpoint(sink: RunSink, run_dir: Path, log, run_name: str) -> None:
    """The checkpoint an earlier execution of this run uploaded, into ``run_dir`` when it is further on.

    A fetch that fails (the store away, a damaged upload) is said and training goes on from what
    ``run_dir`` holds, from epoch 0 at worst: slower, never other numbers (a resume is bit-identical).
    """
    try:
        fetch_checkpoint(sink, run_dir, log)
    except Exception as err:  # noqa: BLE001 - a stop that came out as an error is still a stop
        stop = as_stop(err)
        if stop is not err:
            raise stop from err
        log(
            f"{run_name}: the uploaded checkpoint could not be fetched ({type(err).__name__}: {err}); "
            "training goes on from this machine's output folder"
        )


@contextlib.contextmanager
def cell_threads(started: int | None, requested: int, run_name: str, log):
    """Train a cell that already has a run with the thread count it started with, unless ``requested``.

    The thread count changes the order of floating-point reductions, so a cell resumed with
    another count is no longer bit-identical to an uninterrupted run: it keeps its own count
    by default; a count the user asked for wins, and then the console says so and the run
    is tagged ``threads_changed``. Yields the tags to record; restores the count afterwards.
    """
    before = torch.get_num_threads()
    tags: dict[str, str] = {}
    if started and started != before:
        if requested:
            log(
                f"{run_name}: resumed with {before} thread(s) as asked (--threads {requested}), but it started with "
                f"{started}: from here on it is not bit-identical to an uninterrupted run (tagged threads_changed)"
            )
            tags["threads_changed"] = f"started with {started}, resumed with {before}"
        else:
            torch.set_num_threads(started)
            log(
                f"{run_name}: resumes with {started} thread(s), the count it started with (--threads N overrides)"
            )
    try:
        yield tags
    finally:
        torch.set_num_threads(before)


# Said before a compiled cell's first step, which compiles silently otherwise. Measured: the
# first compiled step took 67.8 s in a fresh process (docs/training.md, "Fast path") and 127 s on
# another machine (issue 49); 0.17 to 0.24 s once torch's compile cache held it.
COMPILE_NOTICE = (
    "{run_name}: fast_path.compile: the first training step compiles the model (torch.compile); "
    "a cold compile takes about 1 to 2 minutes with no output, under a second once torch's "
    "compile cache holds it"
)


class _Announce(TrainingObserver):
    """One console line saying whether a cell starts, resumes (from where) or only completes its
    summary; and one before a compiled step's silent first compile (``compiles``)."""

    def __init__(
        self, run_name: str, run_id: str, previous: str | None, log, compiles: bool = False
    ) -> None:
        self.run_name, self.run_id, self.previous, self.log = run_name, run_id, previous, log
        self.compiles = compiles

    def on_start(self, info: dict) -> None:
        where = f"in run {self.run_id}"
        if info.get("finished"):
            self.log(f"{self.run_name}: training had ended; completing its summary {where}")
        elif info.get("resumed"):
            self.log(
                f"{self.run_name}: resumed from epoch {info['epoch']} step {info['step']} {where}"
            )
        elif self.previous is not None:
            self.log(
                f"{self.run_name}: restarted from scratch {where} ({self.previous}, no checkpoint here)"
            )
        else:
            self.log(f"{self.run_name}: started {where}")
        if self.compiles and not info.get("finished"):
            self.log(COMPILE_NOTICE.format(run_name=self.run_name))


def parse_overrides(pairs: tuple[str, ...], option: str = "--set") -> dict:
    """``("dim=96", "pooling=mean")`` -> typed overrides, each value read as a protocol file reads it
    (``fused_attention=on`` is the string ``on``, as in a protocol, not YAML 1.1's true)."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise click.BadParameter(f"{pair!r}: expected FIELD=VALUE", param_hint=option)
        key, value = pair.split("=", 1)
        try:
            out[key.strip()] = yaml_value(value)
        except yaml.YAMLError as err:
            raise click.BadParameter(
                f"{pair!r}: {value.strip()!r} is not a value ({str(err).splitlines()[0]})",
                param_hint=option,
            ) from None
        if isinstance(out[key.strip()], float) and not math.isfinite(out[key.strip()]):
            raise click.BadParameter(
                f"{pair!r}: {value.strip()!r} is not a finite number (inf and nan are refused)",
                param_hint=option,
            )
    return out


RECIPE_KEYS = tuple(f.name for f in fields(RecipeConfig))


def parse_recipe(pairs: tuple[str, ...]) -> RecipeConfig:
    """``("mixup_alpha=0.8", "ema_decay=0.999")`` -> the recipe section, each key and value checked as a protocol's."""
    values = parse_overrides(pairs, "--recipe")
    unknown = [k for k in values if k not in RECIPE_KEYS]
    if unknown:
        raise click.BadParameter(
            f"{unknown[0]!r} is not a recipe key; the keys are {', '.join(RECIPE_KEYS)} "
            "(stochastic depth is a model field: --set drop_path_rate=R)",
            param_hint="--recipe",
        )
    try:
        return RecipeConfig(**values)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--recipe") from err


FAST_PATH_KEYS = tuple(f.name for f in fields(FastPathConfig))


def parse_fast_path(pairs: tuple[str, ...]) -> FastPathConfig:
    """``("compile=true", "fused_attention=auto")`` -> the fast_path section, checked as a protocol's."""
    values = parse_overrides(pairs, "--fast")
    unknown = [k for k in values if k not in FAST_PATH_KEYS]
    if unknown:
        raise click.BadParameter(
            f"{unknown[0]!r} is not a fast_path key; the keys are {', '.join(FAST_PATH_KEYS)}",
            param_hint="--fast",
        )
    try:
        return FastPathConfig(**values)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--fast") from err


def _data_defaults() -> str:
    """What a training run gets without --train-size / --val-size, from the data layer's own defaults."""
    carved = "; ".join(f"{name} {t:,} / {v:,}" for name, (t, v) in DEFAULT_SIZES.items())
    return (
        f"Without --train-size/--val-size the training and validation images are carved, stratified, from "
        f"the dataset's official training split: {carved} (fashion_mnist: the seed study's subset, not all "
        f"60,000); an image folder without val/: {DEFAULT_VAL_FRACTION:.0%} of train/ for validation, the rest "
        f"for training. RetinaMNIST and folders with val/ keep their official splits. The official test split "
        f"is used only with --evaluate-test."
    )


def split_line(data: PreparedData, spec: DataSpec) -> str:
    """The console line saying which images this run trains and validates on, and whether they are defaults."""
    sizes = f"{len(data.train):,} train / {len(data.val):,} val"
    if data.val.source_split == "val":
        where = "the dataset's official train and val splits"
    elif spec.train_size is None and spec.val_size is None:
        seed_study = ": the seed study's subset" if data.name == "fashion_mnist" else ""
        where = (
            f"carved from the official training split with split seed {spec.split_seed} (the default sizes of "
            f"{data.name}{seed_study}; --train-size/--val-size change them)"
        )
    else:
        where = f"carved from the official training split with split seed {spec.split_seed}"
    subset = f", at most {spec.subset:,} per split (--subset)" if spec.subset else ""
    test = (
        f"; test {len(data.test):,} (read only with --evaluate-test)"
        if data.test is not None
        else ""
    )
    return f"split: {sizes}, {where}{subset}{test}"


@click.command("train", epilog=_data_defaults())
@click.option(
    "--model",
    default="fmnist_vit",
    show_default=True,
    help=f"A study model ({', '.join(STUDY_MODELS)}) or any timm model as timm/<architecture> "
    "(`workbench models --timm PATTERN` lists them).",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    help="Model field override FIELD=VALUE, e.g. --set dim=96; for a timm model a keyword argument of "
    "timm.create_model, e.g. --set num_classes=10 --set drop_path_rate=0.1.",
)
@click.option(
    "--recipe",
    "recipe",
    multiple=True,
    help="timm's recipe parts as KEY=VALUE, each off by default: mixup_alpha, cutmix_alpha, mixup_prob, "
    "mixup_switch_prob, mixup_mode, randaugment_ops, randaugment_magnitude, ema_decay, ema_warmup "
    "(docs/training.md), e.g. --recipe mixup_alpha=0.8 --recipe ema_decay=0.999.",
)
@click.option(
    "--fast",
    "fast_path",
    multiple=True,
    help="The fast training path as KEY=VALUE, each off by default: compile (true/false), "
    "fused_attention (off/on/auto), fused_adamw (true/false) (docs/training.md, 'Fast path'), "
    "e.g. --fast compile=true --fast fused_attention=auto.",
)
@click.option(
    "--dataset",
    default="fashion_mnist",
    show_default=True,
    help=f"One of {', '.join(DATASET_NAMES)} (image_folder: your images, with --data-path DIR).",
)
@click.option("--data-path", default=None, help="Explicit dataset file or folder.")
@click.option(
    "--download/--no-download", default=False, show_default=True, help="Allow a dataset download."
)
@click.option(
    "--train-size",
    type=int,
    default=None,
    help=f"Training images carved from the official training split (default per dataset: "
    f"{', '.join(f'{k} {t:,}' for k, (t, _) in DEFAULT_SIZES.items())}; see below).",
)
@click.option(
    "--val-size",
    type=int,
    default=None,
    help=f"Validation images carved likewise (default: "
    f"{', '.join(f'{k} {v:,}' for k, (_, v) in DEFAULT_SIZES.items())}; "
    f"an image folder without val/: {DEFAULT_VAL_FRACTION:.0%}).",
)
@click.option(
    "--subset",
    type=int,
    default=None,
    help="At most this many images per split (smoke runs); 0 = all.",
)
@click.option("--split-seed", type=int, default=42, show_default=True)
@click.option("--hflip/--no-hflip", default=False, show_default=True)
@click.option("--rotate", "rotate_degrees", type=FINITE, default=0.0, show_default=True)
@click.option("--translate", "translate_fraction", type=FINITE, default=0.0, show_default=True)
@click.option("--crop-padding", type=int, default=0, show_default=True)
@click.option("--epochs", type=int, default=10, show_default=True)
@click.option("--batch-size", type=int, default=128, show_default=True)
@click.option("--lr", type=FINITE, default=1e-3, show_default=True)
@click.option("--weight-decay", type=FINITE, default=1e-4, show_default=True)
@click.option("--warmup-epochs", type=FINITE, default=0.0, show_default=True)
@click.option("--label-smoothing", type=FINITE, default=0.0, show_default=True)
@click.option("--grad-clip", type=FINITE, default=None)
@click.option("--patience", type=int, default=None, help="Early stopping patience in epochs.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--amp", type=click.Choice(["off", "bf16", "fp16"]), default="off", show_default=True)
@click.option("--checkpoint-every", type=int, default=None, help="Also checkpoint every N steps.")
@click.option("--evaluate-test/--no-evaluate-test", default=False, show_default=True)
@click.option("--experiment", default="train", show_default=True)
@click.option(
    "--output-dir", type=click.Path(file_okay=False), default="outputs/train", show_default=True
)
@threads_option
def train(**o):
    """Train one model; re-running the same command resumes or skips it."""
    try:
        cfg = TrainConfig(
            model=ModelSpec(o["model"], parse_overrides(o["overrides"])),
            data=DataSpec(
                o["dataset"],
                path=o["data_path"],
                train_size=o["train_size"],
                val_size=o["val_size"],
                split_seed=o["split_seed"],
                subset=o["subset"] or None,
                crop_padding=o["crop_padding"],
                hflip=o["hflip"],
                rotate_degrees=o["rotate_degrees"],
                translate_fraction=o["translate_fraction"],
            ),
            optim=OptimConfig(
                lr=o["lr"],
                weight_decay=o["weight_decay"],
                warmup_epochs=o["warmup_epochs"],
                label_smoothing=o["label_smoothing"],
                grad_clip=o["grad_clip"],
            ),
            run=RunConfig(
                epochs=o["epochs"],
                batch_size=o["batch_size"],
                seed=o["seed"],
                patience=o["patience"],
                device=o["device"],
                amp=o["amp"],
                checkpoint_every_steps=o["checkpoint_every"],
                evaluate_test=o["evaluate_test"],
            ),
            recipe=parse_recipe(o["recipe"]),
            fast_path=parse_fast_path(o["fast_path"]),
        )
        # fail on a bad field before loading data
        model_config(cfg.model.name, **cfg.model.overrides)
        # bf16 without native units, fp16 on CPU: refused here
        check_amp(cfg.run.amp, cfg.run.device)
    except (
        TimmModelError
    ) as err:  # the option at fault: --model, or the --set of one keyword argument
        at = f"--model {err.value}" if err.key == "name" else f"--set {err.key}={err.value!r}"
        raise click.UsageError(f"{at}: {err}") from err
    except (ValueError, KeyError) as err:
        raise click.UsageError(str(err)) from err
    check_writable_folder(o["output_dir"])  # before the data is decoded, not after an epoch
    data = prepare_data(cfg.data, download=o["download"])
    click.echo(f"data: {data.source}")  # the source starts with the dataset's name
    # defaults stated: fashion_mnist is 3,200 images, not 60,000
    click.echo(split_line(data, cfg.data))
    problem = trainable_problem(cfg, data)  # one class, or a batch larger than the training split
    if (
        len(data.class_names) >= 2
    ):  # every other misfit too, before the run opens, each with its fix
        shape = DataShape.of(data)
        wrong = [
            f"{m.field}={m.value!r}: {m.why}"
            + ("" if m.wanted is None else f"; pass --set {m.field}={m.wanted}")
            for m in misfits(cfg.model.name, cfg.model.overrides, shape, cfg.data.resize_to)
        ]
        if wrong:
            problem = "; ".join(
                [
                    f"model {cfg.model.name} does not fit {shape.describe()}: {wrong[0]}",
                    *wrong[1:],
                    *([problem] if problem else []),
                ]
            )
    if problem:
        raise click.ClickException(problem)
    outcome = train_one(
        cfg,
        data,
        experiment=o["experiment"],
        output_dir=Path(o["output_dir"]),
        run_name=f"{cfg.model.name}-seed{cfg.run.seed}",
        parent_run_id=os.environ.get("MLFLOW_RUN_ID"),
        threads=o["threads"],
    )
    click.echo(outcome_line(outcome.status, outcome.message, outcome.run_id))
    if outcome.status == "failed":
        raise SystemExit(1)
