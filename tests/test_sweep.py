"""sweep: TPE over arm fields, pruning on validation curves, each trial an MLflow child run."""

from __future__ import annotations

import optuna
import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from data_fixtures import make_image_folder
from studies.cli import main
from studies.sweep import PruningObserver, parse_space
from test_ablate import write_protocol
from workbench.train.loop import StopTraining


def test_sweep_runs_trials_as_child_runs_and_resumes_from_storage(tmp_path, mlflow_store, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    protocol = write_protocol(tmp_path, epochs=2)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    args = ["sweep", "--protocol", str(protocol), "--param", "optim.lr=float:1e-4:1e-2:log",
            "--param", "model.dim=choice:8,16", "--trials", "2", "--storage", storage,
            "--data-path", str(folder), "--device", "cpu", "--output-dir", str(tmp_path / "out")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    again = CliRunner().invoke(main, args)  # same study: two more trials
    assert again.exit_code == 0, again.output
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    assert len(study.trials) == 4
    client = MlflowClient(mlflow_store)
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id], "tags.sweep LIKE 'sweep:tiny%' and tags.trial_number != ''")
    assert sorted(int(r.data.tags["trial_number"]) for r in runs) == [0, 1, 2, 3]
    for run in runs:
        trial = study.trials[int(run.data.tags["trial_number"])]
        assert float(run.data.params["optim.lr"]) == pytest.approx(trial.params["optim.lr"], rel=1e-12)
        assert run.data.params["model.overrides.dim"] == str(trial.params["model.dim"])
        assert run.data.tags["mlflow.parentRunId"]
        if trial.state == optuna.trial.TrialState.COMPLETE:
            assert trial.value == run.data.metrics["best_val_accuracy"]
    parents = client.search_runs([exp.experiment_id], "tags.sweep_parent = 'true'")
    assert len(parents) == 2 and all("best_trial" in p.data.tags for p in parents)


def test_pruning_observer_stops_a_trial_the_pruner_rejects():
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.ThresholdPruner(lower=0.5))
    trial = study.ask()
    observer = PruningObserver(trial)
    observer.on_epoch({"epoch": 1, "val_accuracy": 0.9})
    with pytest.raises(StopTraining, match="pruned by Optuna at epoch 2"):
        observer.on_epoch({"epoch": 2, "val_accuracy": 0.1})


@pytest.mark.parametrize("spec", ["lr=float:1:2", "optim.lr=gauss:0:1", "optim.lr=float:1", "bogus.x=int:1:2"])
def test_bad_search_specs_are_named(spec):
    import click

    with pytest.raises(click.BadParameter, match=spec.split("=")[0].replace(".", r"\.")):
        parse_space((spec,))
