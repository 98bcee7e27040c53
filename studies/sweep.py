"""Entry point: Optuna search over chosen fields of a protocol arm, each trial an MLflow child run.

TPE samples the fields; a median pruner stops trials whose validation curve falls behind
(reported each epoch from the training loop). The study lives on any Optuna storage, so
a sweep resumes where it stopped and several machines can run trials of the same study.
MLflow logging goes through the workbench's own runs (not Optuna's MLflowCallback): each
trial is a full training run with checkpoints, predictions and reload proof.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click
import optuna
import yaml
from mlflow.tracking import MlflowClient

from studies.ablate import prepare_protocol_data
from studies.cell_queue import open_storage, redact
from studies.protocol import ProtocolError, load_protocol
from studies.train import train_one
from tracking.protocols import experiment_id_for
from tracking.runs import configure_tracking, git_state
from tracking.storage_guard import check_optuna_storage
from workbench.models.registry import model_config
from workbench.train.config import TrainConfig
from workbench.train.loop import StopTraining, TrainingObserver

SECTIONS = ("model", "optim", "run", "dataset")


def parse_space(specs: tuple[str, ...]) -> dict[str, tuple]:
    """``"optim.lr=float:1e-4:1e-2:log"``, ``"model.dim=int:32:128"``, ``"model.heads=choice:2,4"``."""
    space = {}
    for spec in specs:
        try:
            field, dist = spec.split("=", 1)
            section, key = field.split(".", 1)
            kind, *args = dist.split(":")
        except ValueError:
            raise click.BadParameter(f"{spec!r}: expected SECTION.FIELD=KIND:ARGS", param_hint="--param") from None
        if section not in SECTIONS:
            raise click.BadParameter(f"{spec!r}: section {section!r} must be one of {', '.join(SECTIONS)}", param_hint="--param")
        if kind == "float" and len(args) in (2, 3):
            space[field] = ("float", float(args[0]), float(args[1]), args[2:] == ["log"])
        elif kind == "int" and len(args) == 2:
            space[field] = ("int", int(args[0]), int(args[1]))
        elif kind == "choice" and len(args) == 1:
            space[field] = ("choice", [yaml.safe_load(v) for v in args[0].split(",")])
        else:
            raise click.BadParameter(f"{spec!r}: kind must be float:LOW:HIGH[:log], int:LOW:HIGH or choice:A,B,...",
                                     param_hint="--param")
    return space


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
    sections = {"model": dict(cfg.model.overrides), "optim": {}, "run": {}, "dataset": {}}
    for field, value in values.items():
        section, key = field.split(".", 1)
        sections[section][key] = value
    model = replace(cfg.model, overrides=sections["model"])
    model_config(model.name, **model.overrides)
    return replace(cfg, model=model, optim=replace(cfg.optim, **sections["optim"]),
                   run=replace(cfg.run, **sections["run"]), data=replace(cfg.data, **sections["dataset"]))


class PruningObserver(TrainingObserver):
    """Reports validation accuracy to Optuna each epoch; stops the run when the pruner says so."""

    def __init__(self, trial: optuna.Trial) -> None:
        self.trial = trial

    def on_epoch(self, metrics: dict) -> None:
        self.trial.report(metrics["val_accuracy"], step=int(metrics["epoch"]))
        if self.trial.should_prune():
            raise StopTraining(f"pruned by Optuna at epoch {metrics['epoch']}")


@click.command("sweep")
@click.option("--protocol", "protocol_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--arm", default=None, help="Arm to tune (default: the reference arm).")
@click.option("--param", "params", multiple=True, required=True,
              help="Search field, e.g. optim.lr=float:1e-4:1e-2:log, model.dim=choice:64,96. Repeatable.")
@click.option("--trials", type=click.IntRange(min=1), default=10, show_default=True, help="Trials this process runs.")
@click.option("--seed", type=int, default=None, help="Training seed (default: the protocol's first seed).")
@click.option("--sampler-seed", type=int, default=0, show_default=True)
@click.option("--storage", default=None, help="Optuna storage URL; without it the study lives in memory.")
@click.option("--name", "study_name", default=None, help="Study name (default: sweep:<protocol>@<hash>:<arm>).")
@click.option("--device", default="auto", show_default=True)
@click.option("--data-path", default=None)
@click.option("--output-dir", type=click.Path(file_okay=False), default="outputs/sweep", show_default=True)
def sweep(protocol_path, arm, params, trials, seed, sampler_seed, storage, study_name, device, data_path, output_dir):
    """Tune fields of one protocol arm with TPE and median pruning; every trial is an MLflow run."""
    if storage:
        check_optuna_storage(storage)
    try:
        protocol = load_protocol(protocol_path)
    except ProtocolError as err:
        raise click.ClickException(str(err)) from err
    chosen = next((a for a in protocol.arms if a.name == (arm or protocol.reference.name)), None)
    if chosen is None:
        raise click.BadParameter(f"no arm {arm!r}; arms: {', '.join(a.name for a in protocol.arms)}", param_hint="--arm")
    space = parse_space(params)
    seed = protocol.seeds[0] if seed is None else seed
    base = replace(chosen.config, run=replace(chosen.config.run, seed=seed, device=device),
                   data=replace(chosen.config.data, path=data_path))
    name = study_name or f"sweep:{protocol.name}@{protocol.short_hash}:{chosen.name}"
    study = optuna.create_study(
        study_name=name, storage=open_storage(storage) if storage else None, direction="maximize",
        load_if_exists=True, sampler=optuna.samplers.TPESampler(seed=sampler_seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1),
    )
    configure_tracking()
    data = prepare_protocol_data(protocol, data_path, download=False)
    parent = _sweep_parent(protocol, name, chosen.name, space, storage)

    def objective(trial: optuna.Trial) -> float:
        values = suggest(trial, space)
        try:
            cfg = apply(base, values)
        except (ValueError, TypeError) as err:
            raise optuna.TrialPruned(f"invalid combination: {err}") from err
        outcome = train_one(
            cfg, data, protocol.name, Path(output_dir) / protocol.name, run_name=f"{name}#{trial.number}",
            parent_run_id=parent, identity={"sweep": name, "trial": trial.number},
            tags={"sweep": name, "trial_number": str(trial.number), "arm": chosen.name, "seed": str(seed)},
            observer=PruningObserver(trial),
        )
        trial.set_user_attr("mlflow_run_id", outcome.run_id)
        if outcome.status == "stopped":
            raise optuna.TrialPruned(outcome.message)
        if outcome.status == "failed":
            raise RuntimeError(outcome.message)
        return outcome.metrics["best_val_accuracy"]

    study.optimize(objective, n_trials=trials, catch=(RuntimeError,))
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    client = MlflowClient()
    if done:
        best = study.best_trial
        client.log_metric(parent, "best_val_accuracy", best.value)
        client.set_tag(parent, "best_trial", str(best.number))
        for field, value in best.params.items():
            client.set_tag(parent, f"best.{field}", str(value))
        click.echo(f"best trial {best.number}: val accuracy {best.value:.4f} with {best.params}")
    states = {s.name.lower(): sum(t.state == s for t in study.trials) for s in optuna.trial.TrialState}
    click.echo(f"{name}: {states}")
    client.set_terminated(parent, "FINISHED")


def _sweep_parent(protocol, name: str, arm: str, space: dict, storage: str | None) -> str:
    """One parent run per sweep invocation, holding the search space and the best result."""
    client = MlflowClient()
    tags = {"mlflow.runName": name, "sweep": name, "protocol_name": protocol.name,
            "protocol_hash": protocol.hash, "arm": arm, "sweep_parent": "true", **git_state()}
    run = client.create_run(experiment_id_for(protocol.name), tags=tags)
    client.log_param(run.info.run_id, "search_space", repr(space)[:500])
    client.log_param(run.info.run_id, "storage", redact(storage) if storage else "in-memory")
    return run.info.run_id
