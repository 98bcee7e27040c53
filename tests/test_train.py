"""Training engine: kill-and-resume bit-identity, reload proof, atomic checkpoints, NaN, early stopping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from synthetic import synthetic_data, tiny_config
from workbench.train.checkpoint import (
    FORMAT,
    CheckpointCorrupted,
    atomic_torch_save,
    load_checkpoint,
)
from workbench.train.evaluate import compare_predictions, predict, read_predictions
from workbench.train.loop import NonFiniteLoss, Trainer

CHILD = Path(__file__).parent / "scripts" / "train_child.py"
TIMING = {"epoch_seconds", "images_per_second"}


def child_env() -> dict:
    root = Path(__file__).resolve().parent.parent
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run_child(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHILD), str(run_dir), *extra],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def kill_child_mid_epoch(run_dir: Path, *extra: str, checkpoint: Path | None = None) -> None:
    """Run a child that SIGKILLs itself at training step 18 (epoch 2 of 4, 10 steps an epoch).

    Checkpoints fall every 3 steps, so the last one is at step 15 and steps 16-17 are lost.
    """
    env = {**child_env(), "WB_KILL_AT_FORWARD": "18"}
    done = subprocess.run(
        [sys.executable, str(CHILD), str(run_dir), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == -signal.SIGKILL, (
        f"child was not killed (rc {done.returncode}):\n{done.stderr[-3000:]}"
    )
    last = checkpoint or run_dir / "checkpoints" / "last.pt"
    state = load_checkpoint(last)
    assert not state["finished"] and (state["epoch"], state["batch"], state["step"]) == (
        1,
        5,
        15,
    ), (state["epoch"], state["batch"], state["step"])


def strip_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in TIMING} for h in history]


@pytest.mark.e2e  # two training subprocesses and a SIGKILL
def test_sigkill_mid_epoch_then_resume_is_bit_identical(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = run_child(straight)
    assert done.returncode == 0, done.stderr
    kill_child_mid_epoch(killed)
    resumed = run_child(killed)
    assert resumed.returncode == 0, resumed.stderr

    a, b = (
        load_checkpoint(straight / "checkpoints" / "last.pt"),
        load_checkpoint(killed / "checkpoints" / "last.pt"),
    )
    assert a["step"] == b["step"] and a["finished"] and b["finished"]
    for key, tensor in a["model"].items():
        diff = (tensor.double() - b["model"][key].double()).abs().max().item()
        assert torch.equal(tensor, b["model"][key]), (
            f"{key}: max |difference| {diff:.3g} (must be bit-identical)"
        )
    for (k1, s1), (_k2, s2) in zip(
        a["optimizer"]["state"].items(), b["optimizer"]["state"].items()
    ):
        assert all(torch.equal(torch.as_tensor(s1[n]), torch.as_tensor(s2[n])) for n in s1), (
            f"optimizer state {k1}"
        )
    assert strip_timing(a["history"]) == strip_timing(b["history"])
    assert read_predictions(straight / "predictions" / "val.csv").equals(
        read_predictions(killed / "predictions" / "val.csv")
    )


def test_reload_proof_reproduces_saved_predictions_and_detects_tampering(tmp_path):
    data = synthetic_data()
    result = Trainer(tiny_config(epochs=2, evaluate_test=True), data, tmp_path).fit()
    proof = result.reload_proof
    assert proof.passed and proof.predictions_equal and proof.max_abs_prob_diff == 0.0, (
        proof.summary()
    )
    assert proof.examples == 80
    assert set(result.predictions) == {"val", "test"}
    # every reported metric can be recomputed from the predictions table alone
    val = read_predictions(result.predictions["val"])
    assert (
        abs((val.label == val.predicted).mean() - result.final_metrics["best_val_accuracy"]) < 1e-12
    )
    assert {"index", "label", "predicted", "prob_0", "prob_9"} <= set(val.columns)
    # a changed weight is caught
    trainer = Trainer(tiny_config(epochs=2), data, tmp_path)
    best = load_checkpoint(result.checkpoints["best"])
    best["model"]["head.bias"] += 1e-3
    trainer.model.load_state_dict(best["model"])
    fresh = predict(trainer.model, trainer.eval_loaders["val"], trainer.device)
    tampered = compare_predictions(val, fresh, 0.0)
    assert not tampered.passed and tampered.max_abs_prob_diff > 0


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    atomic_torch_save({"format": FORMAT, "epoch": 1, "w": torch.ones(3)}, path)

    def crashing_save(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a zip file")
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(torch, "save", crashing_save)  # the torch the checkpoint module saves with
    with pytest.raises(KeyboardInterrupt):
        atomic_torch_save({"format": FORMAT, "epoch": 2, "w": torch.zeros(3)}, path)
    monkeypatch.undo()
    state = load_checkpoint(path)
    assert state["epoch"] == 1 and torch.equal(state["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"], "temp file left behind"


def test_corrupted_checkpoint_is_named(tmp_path):
    path = tmp_path / "last.pt"
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointCorrupted, match="last.pt"):
        load_checkpoint(path)


def test_nan_loss_stops_with_the_step_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    from workbench.train import loop

    real = torch.nn.functional.cross_entropy
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("nan") if calls["n"] == 13 else loss  # 10 train steps per epoch

    monkeypatch.setattr(loop, "F", type("F", (), {"cross_entropy": staticmethod(poisoned)}))
    trainer = Trainer(tiny_config(epochs=3), synthetic_data(), tmp_path)
    with pytest.raises(NonFiniteLoss) as err:
        trainer.fit()
    assert err.value.step == 12 and err.value.epoch == 1 and "nan" in str(err.value)
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert state["epoch"] == 1 and state["batch"] == 0 and len(state["history"]) == 1


def test_early_stopping_waits_for_patience(tmp_path):
    cfg = tiny_config(epochs=10, patience=2)
    cfg = type(cfg)(cfg.model, cfg.data, type(cfg.optim)(lr=1e-12), cfg.run)  # learns nothing
    # a small split: the test is about when training stops, not about what it learns
    result = Trainer(cfg, synthetic_data(n_train=64, n_val=16, n_test=16), tmp_path).fit()
    assert result.stopped_early
    assert len(result.history) == 3 and result.best_epoch == 1, [
        h["val_accuracy"] for h in result.history
    ]


def test_a_resumed_run_saves_the_same_random_states_as_an_uninterrupted_one(tmp_path):
    """last.pt holds Python's, NumPy's and torch's random states: after 2 epochs straight, and after
    1 epoch then a resume (in a process whose own random states differ), the same, exactly."""
    import random

    import numpy as np

    from workbench.train.loop import StopTraining, TrainingObserver

    class StopAfterFirstEpoch(TrainingObserver):
        def on_epoch(self, metrics: dict) -> None:
            raise StopTraining("interrupted at the epoch boundary")

    data = synthetic_data(n_train=64, n_val=16, n_test=16)
    random.seed(1), np.random.seed(1)
    Trainer(tiny_config(epochs=2), data, tmp_path / "straight").fit()
    random.seed(2), np.random.seed(2)
    with pytest.raises(StopTraining):
        Trainer(tiny_config(epochs=2), data, tmp_path / "resumed", StopAfterFirstEpoch()).fit()
    random.seed(3), np.random.seed(3)  # as a new process would have them
    Trainer(tiny_config(epochs=2), data, tmp_path / "resumed").fit()
    a, b = (
        load_checkpoint(tmp_path / d / "checkpoints" / "last.pt") for d in ("straight", "resumed")
    )
    assert a["finished"] and b["finished"] and a["step"] == b["step"]
    assert a["rng"]["python"] == b["rng"]["python"], "Python's random state differs"
    for i, (x, y) in enumerate(zip(a["rng"]["numpy"], b["rng"]["numpy"])):
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        assert same, f"NumPy's random state differs at field {i}"
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]), "torch's random state differs"
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
