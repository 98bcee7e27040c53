"""MLflow side of training: per-epoch metrics, resumable runs, artifacts, the logged model."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import mlflow
import torch
from mlflow.tracking import MlflowClient

from workbench.data import PreparedData
from workbench.train.config import TrainConfig
from workbench.train.loop import TrainingObserver, TrainResult

EPOCH_METRICS = ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "lr", "epoch_seconds",
                 "images_per_second", "best_epoch")
# MLflow keeps dataset digests to 36 characters; the full fingerprint is logged as a param.
DIGEST_CHARS = 36


def flatten(prefix: str, value, out: dict) -> dict:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}."""
    if isinstance(value, dict):
        for key, inner in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value
    return out


class MlflowTrainingObserver(TrainingObserver):
    """Logs each epoch's metrics exactly once into the run, also across resumes and retries.

    The checkpoint's history is the truth: after a kill between the checkpoint write and
    the metric upload, ``on_resume`` logs the missing epochs; a cell retried from scratch on
    another machine (no checkpoint there) does not log an epoch the run already has.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.client = MlflowClient()
        self._logged: set[int] | None = None

    def logged_epochs(self) -> set[int]:
        if self._logged is None:
            self._logged = {m.step for m in self.client.get_metric_history(self.run_id, "val_accuracy")}
        return self._logged

    def on_resume(self, history: list[dict]) -> None:
        for metrics in history:
            self.on_epoch(metrics)

    def on_epoch(self, metrics: dict) -> None:
        epoch = int(metrics["epoch"])
        if epoch in self.logged_epochs():
            return
        values = {k: float(metrics[k]) for k in EPOCH_METRICS if k in metrics}
        mlflow.log_metrics(values, step=epoch, run_id=self.run_id)
        self._logged.add(epoch)


def log_run_inputs(cfg: TrainConfig, data: PreparedData, extra_params: dict | None = None) -> None:
    """Flattened config params, data identity, and the dataset as an MLflow input."""
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    params = flatten("", cfg.to_dict(), {})
    params.update({
        "data.fingerprint": data.data_fingerprint,
        "data.split_fingerprint": data.split_fingerprint,
        "data.display_name": data.display_name,
        "data.source": data.source[:490],
        "data.train_images": len(data.train.labels),
        "data.val_images": len(data.val.labels),
        "data.test_images": len(data.test.labels) if data.test is not None else 0,
        **(extra_params or {}),
    })
    existing = mlflow.get_run(mlflow.active_run().info.run_id).data.params
    mlflow.log_params({k: v for k, v in params.items() if k not in existing})  # resumed runs already have them
    dataset = MetaDataset(
        source=HTTPDatasetSource(url=f"file://{data.name}/{data.display_name}"),
        name=f"{data.name}-split{data.split_seed}",
        digest=data.data_fingerprint[:DIGEST_CHARS],
    )
    mlflow.log_input(dataset, context="training")


def log_training_result(result: TrainResult, cfg: TrainConfig, model_factory, example: torch.Tensor) -> None:
    """Final metrics, reload proof, predictions, checkpoints, config and the logged model."""
    proof = result.reload_proof
    mlflow.log_metrics({
        **result.final_metrics,
        "best_epoch": result.best_epoch,
        "reload_proof_passed": float(proof.passed),
        "reload_proof_max_abs_diff": proof.max_abs_prob_diff if math.isfinite(proof.max_abs_prob_diff) else -1.0,
    })
    mlflow.set_tags({
        "reload_proof": "passed" if proof.passed else "failed",
        "reload_proof_summary": proof.summary(),
        "stopped_early": str(result.stopped_early).lower(),
    })
    for split, path in result.predictions.items():
        mlflow.log_artifact(str(path), artifact_path="predictions")
    for kind, path in result.checkpoints.items():
        mlflow.log_artifact(str(path), artifact_path="checkpoints")
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps(cfg.to_dict(), indent=2, default=str))
        mlflow.log_artifact(str(config_path))
        history = Path(tmp) / "history.json"
        history.write_text(json.dumps(result.history, indent=1))
        mlflow.log_artifact(str(history))
    log_model(result, model_factory, example)


def log_model(result: TrainResult, model_factory, example: torch.Tensor) -> None:
    """The best weights as an MLflow PyTorch model with a signature, loadable offline."""
    from mlflow.models import infer_signature

    from workbench.train.checkpoint import load_checkpoint

    model = model_factory()
    model.load_state_dict(load_checkpoint(result.checkpoints["best"])["model"])
    model = model.cpu().eval()
    example = example.cpu()
    with torch.no_grad():
        output = model(example).numpy()
    signature = infer_signature(example.numpy(), output)
    requirements = [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}"]
    # torch.export ("pt2") stores a traced graph and tensors, not pickled code, so loading
    # it back needs neither this project's source nor unpickling of arbitrary objects.
    mlflow.pytorch.log_model(
        model, name="model", signature=signature, input_example=example.numpy(),
        pip_requirements=requirements, serialization_format="pt2",
    )
