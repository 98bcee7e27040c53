"""Entry point: Optuna search over chosen fields of a protocol arm, each trial an MLflow child run.

TPE samples the fields; a median pruner stops trials whose validation curve falls behind
(reported each epoch from the training loop). The study lives on any Optuna storage, so
a sweep resumes where it stopped and several machines can run trials of the same study.
MLflow logging goes through the workbench's own runs (not Optuna's MLflowCallback): each
trial is a full training run with checkpoints, predictions and reload proof.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import random
from dataclasses import fields, replace
from pathlib import Path

import click
import optuna
import yaml

from studies.ablation.cell_queue import open_storage, quiet_optuna, redact
from studies.ablation.train import train_one
from studies.runtime.options import check_amp, check_storage_option, threads_option
from studies.runtime.preflight import check_writable_folder
from studies.runtime.secret_options import storage_options
from studies.runtime.stop_signals import sigterm_raises
from studies.runtime.study_execution import prepare_protocol_data
from studies.runtime.study_protocol import ProtocolError, load_protocol
from tracking.kinds.sweep_runs import best_under, end_sweep_parent, start_sweep_parent, sweep_key
from tracking.store.session import configure_tracking
from tracking.store.store_lock import store_lock
from workbench.models.registry import model_config
from workbench.models.timm_arm import is_timm_name
from workbench.train.config import TrainConfig
from workbench.train.loop import StopTraining, TrainingObserver

SECTIONS = ("model", "optim", "run", "dataset", "recipe")
# apply() takes microseconds: checking this many costs well under a second
MAX_CHECKED_COMBINATIONS = 4096
MAX_INT_CANDIDATES = 1024


def parse_space(specs: tuple[str, ...]) -> dict[str, tuple]:
    """``"optim.lr=float:1e-4:1e-2:log"``, ``"model.dim=int:32:128"``, ``"model.heads=choice:2,4"``."""
    space = {}
    for spec in specs:
        try:
            field, dist = spec.split("=", 1)
            section, key = field.split(".", 1)
            kind, *args = dist.split(":")
        except ValueError:
            raise click.BadParameter(
                f"{spec!r}: expected SECTION.FIELD=KIND:ARGS", param_hint="--param"
            ) from None
        if section not in SECTIONS:
            raise click.BadParameter(
                f"{spec!r}: section {section!r} must be one of {', '.join(SECTIONS)}",
                param_hint="--param",
            )
        if field in space:
            raise click.BadParameter(f"{spec!r}: {field} is given twice", param_hint="--param")
        space[field] = _distribution(spec, kind, args)
    return space


def _distribution(spec: str, kind: str, args: list[str]) -> tuple:
    def bad(why: str) -> click.BadParameter:
        return click.BadParameter(f"{spec!r}: {why}", param_hint="--param")

    if kind == "choice" and len(args) == 1:
        values = [yaml.safe_load(v) for v in args[0].split(",")]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise bad("every choice must be a finite number (inf and nan are refused)")
        return ("choice", values)
    if not (
        (kind == "float" and (len(args) == 2 or args[2:] == ["log"]))
        or (kind == "int" and len(args) == 2)
    ):
        raise bad("kind must be float:LOW:HIGH[:log], int:LOW:HIGH or choice:A,B,...")
    number = float if kind == "float" else int
    try:
        low, high = number(args[0]), number(args[1])
    except ValueError:
        raise bad(f"LOW and HIGH must be {kind} numbers") from None
    if not (math.isfinite(low) and math.isfinite(high)):
        raise bad("LOW and HIGH must be finite numbers (inf and nan are refused)")
    if low > high:
        raise bad("LOW must not exceed HIGH")
    if kind == "int":
        return ("int", low, high)
    if args[2:] == ["log"] and low <= 0:
        raise bad("a log scale needs LOW > 0")
    return ("float", low, high, args[2:] == ["log"])


def suggest(trial: optuna.Trial, space: dict[str, tuple]) -> dict[str, object]:
    values = {}
    for field, (kind, *args) in space.items():
        if kind == "float":
            values[field] = trial.suggest_float(field, args[0], args[1], log=args[2])
        elif kind == "int":
            values[field] = trial.suggest_int(field, args[0], args[1])
        else:
            values[field] = trial.suggest_categorical(field, args[0])
    return values


def apply(cfg: TrainConfig, values: dict[str, object]) -> TrainConfig:
    """The arm's config with sampled values; validated like a protocol (bad values raise)."""
    sections = {
        "model": dict(cfg.model.overrides),
        "optim": {},
        "run": {},
        "dataset": {},
        "recipe": {},
    }
    for field, value in values.items():
        section, key = field.split(".", 1)
        sections[section][key] = value
    model = replace(cfg.model, overrides=sections["model"])
    model_config(model.name, **model.overrides)
    return replace(
        cfg,
        model=model,
        optim=replace(cfg.optim, **sections["optim"]),
        run=replace(cfg.run, **sections["run"]),
        data=replace(cfg.data, **sections["dataset"]),
        recipe=replace(cfg.recipe, **sections["recipe"]),
    )


def section_fields(cfg: TrainConfig, section: str) -> list[str]:
    """The field names a ``--param`` may set in ``section`` of ``cfg``."""
    if section == "model":
        return [f.name for f in fields(model_config(cfg.model.name, **cfg.model.overrides))]
    return [
        f.name
        for f in fields(
            {"optim": cfg.optim, "run": cfg.run, "dataset": cfg.data, "recipe": cfg.recipe}[section]
        )
    ]


def _candidates(spec: tuple) -> list:
    """The values of one search field that the pre-flight check tries.

    Every choice; every int of a range up to ``MAX_INT_CANDIDATES`` wide (divisibility
    rules such as heads | dim make sparse valid sets), else its bounds, midpoint and powers
    of two; for floats a 9-point grid (geometric on a log scale) plus 0 when in range, since
    the configs' float rules are intervals that mostly start at 0.
    """
    kind, *args = spec
    if kind == "choice":
        return list(args[0])
    low, high = args[0], args[1]
    if kind == "int":
        if high - low < MAX_INT_CANDIDATES:
            return list(range(low, high + 1))
        powers = [2**k for k in range(64) if low <= 2**k <= high]
        return sorted({low, (low + high) // 2, high, *powers})
    if args[2]:  # log scale: LOW > 0 (parse_space checks it)
        grid = [low * (high / low) ** (i / 8) for i in range(9)]
    else:
        grid = [low + (high - low) * i / 8 for i in range(9)]
    return sorted(set(grid) | ({0.0} if low <= 0 <= high else set()))


def _invalid(cfg: TrainConfig, values: dict) -> str | None:
    try:
        apply(cfg, values)
    except (ValueError, TypeError) as err:
        return str(err)
    return None


def check_space(cfg: TrainConfig, space: dict[str, tuple], seed: int = 0) -> None:
    """Refuse, before any trial, a space naming an unknown field or one where every trial would fail validation.

    Each field's candidates (``_candidates``) are combined, all of them or a seeded sample
    of ``MAX_CHECKED_COMBINATIONS``; one valid combination is enough to go ahead (trials
    that draw an invalid one are pruned, as before). For choice and int spaces up to that
    size the check is exhaustive; beyond it a space is refused only if no sampled
    combination passes.

    Raises:
        click.BadParameter: Naming the ``--param`` field (exit status 2).
    """
    for field in space:
        section, key = field.split(".", 1)
        if section == "model" and is_timm_name(cfg.model.name):
            continue  # a timm arm's keys are timm.create_model's: the candidates' build below checks them
        known = section_fields(cfg, section)
        if key not in known:
            raise click.BadParameter(
                f"{field}: unknown field; {section} fields are {', '.join(known)}",
                param_hint="--param",
            )
    names = list(space)
    candidates = [_candidates(space[name]) for name in names]
    total = 1
    for values in candidates:
        total *= len(values)
    if total <= MAX_CHECKED_COMBINATIONS:
        combos = itertools.product(*candidates)
    else:
        rng = random.Random(seed)
        combos = (
            tuple(rng.choice(values) for values in candidates)
            for _ in range(MAX_CHECKED_COMBINATIONS)
        )
    first_error = None
    for combo in combos:
        error = _invalid(cfg, dict(zip(names, combo)))
        if error is None:
            return
        first_error = first_error or (combo, error)
    for name, values in zip(names, candidates):  # a field that fails on its own is the one to name
        errors = [_invalid(cfg, {name: v}) for v in values]
        if all(errors):
            raise click.BadParameter(
                f"{name}: every value fails validation ({errors[0]})", param_hint="--param"
            )
    combo, error = first_error
    raise click.BadParameter(
        f"{', '.join(names)}: no combination passes validation "
        f"(e.g. {dict(zip(names, combo))}: {error})",
        param_hint="--param",
    )


class TrialSeededSampler(optuna.samplers.BaseSampler):
    """TPE whose random stream is seeded by (``--sampler-seed``, trial number), not once per process.

    One ``TPESampler(seed=0)`` per process drew the same points in every process: two
    executions sharing a storage, or a sweep resumed, trained the same configurations
    again. Trial numbers are unique in a study, so each trial gets a stream of its own;
    the same study run again in the same order draws the same points (reproducible).
    TPE's constant liar (Optuna's default) counts the trials still running elsewhere.
    """

    def __init__(self, seed: int, **tpe_options) -> None:
        self.seed, self.tpe_options = seed, tpe_options
        self._by_trial: dict[int, optuna.samplers.TPESampler] = {}

    def _tpe(self, trial) -> optuna.samplers.TPESampler:
        if trial.number not in self._by_trial:
            digest = hashlib.sha256(f"{self.seed}:{trial.number}".encode()).digest()
            self._by_trial[trial.number] = optuna.samplers.TPESampler(
                seed=int.from_bytes(digest[:4], "big"), **self.tpe_options
            )
        return self._by_trial[trial.number]

    def infer_relative_search_space(self, study, trial):
        return self._tpe(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self._tpe(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._tpe(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial) -> None:
        self._tpe(trial).before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self._tpe(trial).after_trial(study, trial, state, values)
        self._by_trial.pop(trial.number, None)


def same_configuration(study: optuna.Study, trial: optuna.Trial, values: dict):
    """An earlier trial (complete or running) of the study with exactly these values, if any."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)
    return next(
        (
            t
            for t in study.get_trials(deepcopy=False, states=states)
            if t.number != trial.number and t.params == values
        ),
        None,
    )


class PruningObserver(TrainingObserver):
    """Reports validation accuracy to Optuna each epoch; stops the run when the pruner says so."""

    def __init__(self, trial: optuna.Trial) -> None:
        self.trial = trial

    def on_epoch(self, metrics: dict) -> None:
        self.trial.report(metrics["val_accuracy"], step=int(metrics["epoch"]))
        if self.trial.should_prune():
            raise StopTraining(f"pruned by Optuna at epoch {metrics['epoch']}")


@click.command("sweep")
@click.option(
    "--protocol", "protocol_path", required=True, type=click.Path(exists=True, dir_okay=False)
)
@click.option("--arm", default=None, help="Arm to tune (default: the reference arm).")
@click.option(
    "--param",
    "params",
    multiple=True,
    required=True,
    help="Search field, e.g. optim.lr=float:1e-4:1e-2:log, model.dim=choice:64,96. Repeatable.",
)
@click.option(
    "--trials",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Trials this process runs.",
)
@click.option(
    "--seed", type=int, default=None, help="Training seed (default: the protocol's first seed)."
)
@click.option("--sampler-seed", type=int, default=0, show_default=True)
@storage_options(required=False, help="Optuna storage URL; without it the study lives in memory.")
@click.option(
    "--name",
    "study_name",
    default=None,
    help="Study name (default: sweep:<protocol>@<hash>:<arm>).",
)
@click.option("--device", default="auto", show_default=True)
@click.option("--data-path", default=None)
@click.option(
    "--output-dir", type=click.Path(file_okay=False), default="outputs/sweep", show_default=True
)
@threads_option
def sweep(
    protocol_path,
    arm,
    params,
    trials,
    seed,
    sampler_seed,
    storage,
    study_name,
    device,
    data_path,
    output_dir,
    threads,
):
    """Tune fields of one protocol arm with TPE and median pruning; every trial is an MLflow run."""
    if storage:
        check_storage_option(storage)
    try:
        protocol = load_protocol(protocol_path)
    except ProtocolError as err:
        raise click.ClickException(str(err)) from err
    chosen = next((a for a in protocol.arms if a.name == (arm or protocol.reference.name)), None)
    if chosen is None:
        raise click.BadParameter(
            f"no arm {arm!r}; arms: {', '.join(a.name for a in protocol.arms)}", param_hint="--arm"
        )
    space = parse_space(params)
    seed = protocol.seeds[0] if seed is None else seed
    base = replace(
        chosen.config,
        run=replace(chosen.config.run, seed=seed, device=device),
        data=replace(chosen.config.data, path=data_path),
    )
    check_space(base, space, sampler_seed)  # before any trial, study or MLflow run exists
    check_writable_folder(output_dir)  # likewise: not at the first trial's first checkpoint
    check_amp(base.run.amp, device)
    name = study_name or f"sweep:{protocol.name}@{protocol.short_hash}:{chosen.name}"
    with store_lock(
        storage or ""
    ):  # two sweeps starting on a new SQLite file would both create Optuna's tables
        try:  # before any MLflow run exists: a refused storage leaves nothing behind
            optuna_storage = open_storage(storage) if storage else None
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--storage") from None
        quiet_optuna()
        study = optuna.create_study(
            study_name=name,
            storage=optuna_storage,
            direction="maximize",
            load_if_exists=True,
            sampler=TrialSeededSampler(sampler_seed),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1),
        )
    configure_tracking()
    data = prepare_protocol_data(protocol, data_path, download=False)
    where = redact(storage) if storage else "in-memory"
    parent = start_sweep_parent(
        protocol.name,
        name,
        {"protocol_name": protocol.name, "protocol_hash": protocol.hash, "arm": chosen.name},
        {"search_space": repr(space)[:500], "storage": where},
        sweep_key(protocol.hash, chosen.name, name, where, repr(space)),
    )

    def objective(trial: optuna.Trial) -> float:
        values = suggest(trial, space)
        twin = same_configuration(study, trial, values)
        if twin is not None:  # a point drawn again (a discrete space): never trained twice
            trial.set_user_attr("repeats_trial", twin.number)
            if twin.state == optuna.trial.TrialState.COMPLETE:
                click.echo(
                    f"trial {trial.number}: the configuration of trial {twin.number}; its value, nothing trained"
                )
                return twin.value
            raise optuna.TrialPruned(f"the configuration of trial {twin.number}, running now")
        try:
            cfg = apply(base, values)
        except (ValueError, TypeError) as err:
            raise optuna.TrialPruned(f"invalid combination: {err}") from err
        outcome = train_one(
            cfg,
            data,
            experiment=protocol.name,
            output_dir=Path(output_dir) / protocol.name,
            run_name=f"{name}#{trial.number}",
            parent_run_id=parent.run_id,
            identity={"sweep": name, "trial": trial.number},
            tags={
                "sweep": name,
                "trial_number": str(trial.number),
                "arm": chosen.name,
                "seed": str(seed),
            },
            observer=PruningObserver(trial),
        )
        trial.set_user_attr("mlflow_run_id", outcome.run_id)
        if outcome.status == "stopped":
            raise optuna.TrialPruned(outcome.message)
        if outcome.status == "failed":
            raise RuntimeError(outcome.message)
        return outcome.metrics["best_val_accuracy"]

    def summary() -> tuple[tuple | None, dict[str, int]]:
        trials = study.get_trials(deepcopy=False)
        done = [
            (t.number, t.value, t.params, t.user_attrs.get("mlflow_run_id"))
            for t in trials
            if t.state == optuna.trial.TrialState.COMPLETE
        ]
        # The best trial whose run is this parent's child (older executions' trials hang elsewhere).
        return best_under(parent, done), {
            s.name.lower(): sum(t.state == s for t in trials) for s in optuna.trial.TrialState
        }

    try:
        with sigterm_raises():
            study.optimize(objective, n_trials=trials, catch=(RuntimeError,))
    except BaseException as err:  # Ctrl-C, SIGTERM or a crash: the parent says how the sweep ended
        with contextlib.suppress(Exception):
            end_sweep_parent(
                parent,
                *summary(),
                status="KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED",
                why=f"{type(err).__name__}: {err}".strip(),
            )
        raise
    best, states = summary()
    if best:
        click.echo(f"best trial {best[0]}: val accuracy {best[1]:.4f} with {best[2]}")
    click.echo(f"{name}: {states}")
    end_sweep_parent(parent, best, states)
    if parent.sink.offline:
        click.echo(
            f"sweep parent and trials logged locally (run {parent.sink.local_run_id}): "
            "`workbench sync` copies them to the server",
            err=True,
        )
