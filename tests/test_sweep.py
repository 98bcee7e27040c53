"""sweep: TPE over arm fields, pruning on validation curves, each trial an MLflow child run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import optuna
import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from data_fixtures import make_image_folder
from studies.ablation.sweep import PruningObserver, parse_space
from studies.cli import main
from test_ablate import write_protocol
from workbench.train.loop import StopTraining

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # moved from the default tier to keep it under 5 min (docs/testing.md)
def test_sweep_runs_trials_as_child_runs_and_resumes_from_storage(
    tmp_path, mlflow_store, monkeypatch
):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    protocol = write_protocol(tmp_path, epochs=2)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    args = [
        "sweep",
        "--protocol",
        str(protocol),
        "--param",
        "optim.lr=float:1e-4:1e-2:log",
        "--param",
        "model.dim=choice:8,16",
        "--trials",
        "2",
        "--storage",
        storage,
        "--data-path",
        str(folder),
        "--device",
        "cpu",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    again = CliRunner().invoke(main, args)  # same study: two more trials
    assert again.exit_code == 0, again.output
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    assert len(study.trials) == 4
    client = MlflowClient(mlflow_store)
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs(
        [exp.experiment_id], "tags.sweep LIKE 'sweep:tiny%' and tags.trial_number != ''"
    )
    assert sorted(int(r.data.tags["trial_number"]) for r in runs) == [0, 1, 2, 3]
    for run in runs:
        trial = study.trials[int(run.data.tags["trial_number"])]
        assert float(run.data.params["optim.lr"]) == pytest.approx(
            trial.params["optim.lr"], rel=1e-12
        )
        assert run.data.params["model.overrides.dim"] == str(trial.params["model.dim"])
        if trial.state == optuna.trial.TrialState.COMPLETE:
            assert trial.value == run.data.metrics["best_val_accuracy"]
    # A resumed sweep draws new points (before: TPESampler(seed=0) anew in each process repeated trials 0 and 1).
    points = [tuple(sorted(t.params.items())) for t in study.trials]
    assert len(set(points)) == 4, points
    # ... under its one parent, reattached (before: one parent per execution), naming a trial run under it.
    (parent,) = client.search_runs([exp.experiment_id], "tags.sweep_parent = 'true'")
    assert parent.info.status == "FINISHED" and {
        r.data.tags["mlflow.parentRunId"] for r in runs
    } == {parent.info.run_id}
    best = study.trials[int(parent.data.tags["best_trial"])]
    assert best.value == max(
        t.value for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE
    )
    assert (
        client.get_run(best.user_attrs["mlflow_run_id"]).data.tags["mlflow.parentRunId"]
        == parent.info.run_id
    )


@pytest.mark.slow  # two processes with their own imports and data: 20 s on 2 idle cores
def test_two_processes_sharing_a_storage_train_different_configurations_under_one_parent(
    tmp_path, mlflow_store
):
    """Before: both processes trained lr 0.00125, wd 0.00726 (TPESampler(seed=0) anew in each) under two parents."""
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    protocol = write_protocol(tmp_path, epochs=1)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    args = [
        sys.executable,
        "-m",
        "studies.cli",
        "sweep",
        "--protocol",
        str(protocol),
        "--param",
        "optim.lr=float:1e-4:1e-2:log",
        "--param",
        "optim.weight_decay=float:1e-4:1e-1:log",
        "--trials",
        "1",
        "--storage",
        storage,
        "--data-path",
        str(folder),
        "--device",
        "cpu",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"),
    }
    sides = [
        subprocess.Popen(
            args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    try:
        outputs = [side.communicate(timeout=900)[0] for side in sides]
    finally:
        for side in sides:
            side.kill()
    assert [side.returncode for side in sides] == [0, 0], "\n\n".join(
        out[-3000:] for out in outputs
    )
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    points = [tuple(sorted(t.params.items())) for t in study.trials]
    assert len(points) == 2 and points[0] != points[1], points
    client = MlflowClient(mlflow_store)
    exp = client.get_experiment_by_name("tiny")
    (parent,) = client.search_runs([exp.experiment_id], "tags.sweep_parent = 'true'")
    trials = client.search_runs([exp.experiment_id], "tags.trial_number != ''")
    assert len(trials) == 2 and {r.data.tags["mlflow.parentRunId"] for r in trials} == {
        parent.info.run_id
    }
    assert parent.info.status == "FINISHED", parent.info.status


@pytest.mark.slow  # 9 s: the default tier neared its 5 minutes (docs/testing.md)
def test_ctrl_c_ends_the_sweep_parent_killed_and_a_live_sweep_is_never_reaped(
    tmp_path, mlflow_store, monkeypatch
):
    """The sweep's parent holds a lease: `status` of the protocol leaves a live sweep alone; Ctrl-C ends it KILLED."""
    from studies.ablation import sweep
    from tracking.record.lease import RELEASED_TAG, TOKEN_TAG

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    # short: a run without heartbeats looks dead soon
    monkeypatch.setenv("WORKBENCH_LEASE_SECONDS", "3")
    monkeypatch.delenv("WORKBENCH_HEARTBEAT_SECONDS", raising=False)  # a quarter of the lease
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    protocol = write_protocol(tmp_path, epochs=2)
    seen = []
    real = sweep.train_one

    def interrupted_second_trial(cfg, *args, **kwargs):
        if seen:
            import time

            time.sleep(3.5)  # past the lease: only the heartbeat keeps the parent alive now
            # What `workbench status` does (another process: a process never reaps its own runs).
            check = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "from tracking.record.protocol_runs import reap_dead_runs; "
                    "print([r for r, _ in reap_dead_runs('tiny')])",
                ],
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                capture_output=True,
                text=True,
            )
            assert check.returncode == 0, check.stderr
            seen.append(check.stdout.strip())
            raise KeyboardInterrupt
        seen.append(kwargs["parent_run_id"])
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(sweep, "train_one", interrupted_second_trial)

    args = [
        "sweep",
        "--protocol",
        str(protocol),
        "--param",
        "optim.lr=float:1e-4:1e-2:log",
        "--trials",
        "3",
        "--data-path",
        str(folder),
        "--device",
        "cpu",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    result = CliRunner().invoke(main, args)
    assert isinstance(result.exception, KeyboardInterrupt) or result.exit_code == 1, result.output
    parent_id, reaped = seen
    assert reaped == "[]", f"a live sweep's runs were marked KILLED: {reaped}"
    parent = MlflowClient(mlflow_store).get_run(parent_id)
    assert parent.info.status == "KILLED", parent.info.status
    assert parent.data.tags["end_reason"].startswith("KeyboardInterrupt")
    assert parent.data.tags[RELEASED_TAG] == parent.data.tags[TOKEN_TAG]
    assert parent.data.metrics["trials_complete"] == 1 and parent.data.tags["best_trial"] == "0"


def test_a_point_drawn_again_is_recognised_and_seeds_differ_per_trial():
    from studies.ablation.sweep import TrialSeededSampler, same_configuration

    study = optuna.create_study(direction="maximize", sampler=TrialSeededSampler(0))
    first = study.ask()
    first.suggest_categorical("x", [1, 2])
    study.tell(first, 0.5)
    again = study.ask()
    assert same_configuration(study, again, {"x": first.params["x"]}).number == 0
    assert same_configuration(study, again, {"x": 3 - first.params["x"]}) is None
    # Two processes on one storage, each with its own sampler and the same --sampler-seed (before: both drew
    # the same first point); the same trial number draws the same point again (reproducible).
    storage = optuna.storages.InMemoryStorage()
    one = optuna.create_study(study_name="s", storage=storage, sampler=TrialSeededSampler(0))
    two = optuna.load_study(study_name="s", storage=storage, sampler=TrialSeededSampler(0))
    draws = [side.ask().suggest_float("lr", 1e-4, 1e-2, log=True) for side in (one, two)]
    alone = (
        optuna.create_study(sampler=TrialSeededSampler(0))
        .ask()
        .suggest_float("lr", 1e-4, 1e-2, log=True)
    )
    assert draws[0] != draws[1] and alone == draws[0], (draws, alone)


def test_pruning_observer_stops_a_trial_the_pruner_rejects():
    study = optuna.create_study(
        direction="maximize", pruner=optuna.pruners.ThresholdPruner(lower=0.5)
    )
    trial = study.ask()
    observer = PruningObserver(trial)
    observer.on_epoch({"epoch": 1, "val_accuracy": 0.9})
    with pytest.raises(StopTraining, match="pruned by Optuna at epoch 2"):
        observer.on_epoch({"epoch": 2, "val_accuracy": 0.1})


@pytest.mark.parametrize(
    "spec",
    [
        "lr=float:1:2",
        "optim.lr=gauss:0:1",
        "optim.lr=float:1",
        "bogus.x=int:1:2",
        "optim.lr=float:0.1:0.01",
        "optim.lr=float:0:1:log",
        "model.dim=int:64:32",
        "model.dim=int:a:64",
        "optim.lr=float:1e-3:1e-2:lin",
    ],
)
def test_bad_search_specs_are_named(spec):
    import click

    with pytest.raises(click.BadParameter, match=spec.split("=")[0].replace(".", r"\.")):
        parse_space((spec,))


def _refused(tmp_path, mlflow_store, *specs):
    folder = tmp_path / "images"  # never read: the refusal comes before the data is loaded
    protocol = write_protocol(tmp_path, epochs=1)
    storage = tmp_path / "optuna.db"
    args = [
        "sweep",
        "--protocol",
        str(protocol),
        *[a for s in specs for a in ("--param", s)],
        "--trials",
        "3",
        "--storage",
        f"sqlite:///{storage}",
        "--data-path",
        str(folder),
        "--device",
        "cpu",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    store = tmp_path / "mlflow.db"  # the fixture's store, a copy of an empty migrated database
    before = store.read_bytes()
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit), (
        result.output
    )
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, result.output
    assert not storage.exists(), "an Optuna study was created before the refusal"
    assert store.read_bytes() == before, "the MLflow store was written before the refusal"
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow-offline").exists()
    assert not (tmp_path / "out").exists()
    return errors[0]


def test_unknown_field_is_refused_before_any_trial(tmp_path, mlflow_store):
    line = _refused(tmp_path, mlflow_store, "optim.lr=float:1e-4:1e-2:log", "model.bogus=int:1:4")
    # the valid fields are listed
    assert "model.bogus: unknown field" in line and "heads" in line, line


def test_space_where_every_trial_fails_validation_is_refused(tmp_path, mlflow_store):
    # dim 16 (from the protocol): heads 3 and 5 never divide it
    line = _refused(
        tmp_path, mlflow_store, "optim.lr=float:1e-4:1e-2:log", "model.heads=choice:3,5"
    )
    assert "model.heads: every value fails validation" in line and "must divide dim=16" in line, (
        line
    )


def test_space_whose_fields_are_valid_alone_but_never_together_is_refused(tmp_path, mlflow_store):
    # each field is fine with the protocol's other values (dim 16, heads 2), no pair of them is
    line = _refused(tmp_path, mlflow_store, "model.dim=choice:10,14", "model.heads=choice:4,8")
    assert "model.dim, model.heads: no combination passes validation" in line, line


def test_space_check_lets_partly_valid_spaces_through(tmp_path):
    from studies.runtime.study_protocol import load_protocol
    from studies.ablation.sweep import check_space

    arm = load_protocol(write_protocol(tmp_path)).reference
    # 4 divides 16: trials with 3 are pruned
    check_space(arm.config, parse_space(("model.heads=choice:3,4",)))
    check_space(arm.config, parse_space(("model.heads=int:3:5", "optim.weight_decay=float:0:0.1")))
    # only 4, 8 and 16 divide dim 16
    check_space(arm.config, parse_space(("model.heads=int:3:40",)))
    # valid: [0, 0.5)
    check_space(arm.config, parse_space(("dataset.translate_fraction=float:-10:20",)))
    with pytest.raises(click.BadParameter, match="optim.lr: every value fails validation"):
        check_space(arm.config, parse_space(("optim.lr=float:-2:-1",)))
    with pytest.raises(click.BadParameter, match="run.epoch: unknown field"):
        check_space(arm.config, parse_space(("run.epoch=int:1:3",)))


def test_recipe_fields_are_a_search_section(tmp_path):
    from studies.ablation.sweep import apply, check_space
    from studies.runtime.study_protocol import load_protocol

    arm = load_protocol(write_protocol(tmp_path)).reference
    space = parse_space(("recipe.mixup_alpha=float:0:1", "recipe.randaugment_ops=int:0:2"))
    check_space(arm.config, space)
    cfg = apply(arm.config, {"recipe.mixup_alpha": 0.4, "recipe.randaugment_ops": 2})
    assert (cfg.recipe.mixup_alpha, cfg.recipe.randaugment_ops) == (0.4, 2), cfg.recipe
    assert cfg.optim == arm.config.optim and cfg.model == arm.config.model
    with pytest.raises(click.BadParameter, match="recipe.ema_decay: every value fails validation"):
        check_space(arm.config, parse_space(("recipe.ema_decay=float:1:2",)))
    with pytest.raises(click.BadParameter, match="recipe.mixup: unknown field.*mixup_alpha"):
        check_space(arm.config, parse_space(("recipe.mixup=float:0:1",)))
