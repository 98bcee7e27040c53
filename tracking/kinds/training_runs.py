"""MLflow side of training: per-epoch metrics, artifacts, the logged model (the cell's run itself: ``tracking.record.cell_runs``)."""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from pathlib import Path

import mlflow
import torch
from mlflow.tracking import MlflowClient

from tracking.record.lease import HEARTBEATS
from tracking.record.sink import RunSink
from tracking.store import health, offline_store
from workbench.data import PreparedData
from workbench.kernel_identity import kernel_differences, kernel_identity, recorded_identity
from workbench.train.config import TrainConfig
from workbench.train.fingerprint import current_code_fingerprint
from workbench.train.loop import TrainingObserver, TrainResult

# raw_*: with weight EMA
EPOCH_METRICS = (
    "train_loss",
    "train_accuracy",
    "val_loss",
    "val_accuracy",
    "lr",
    "epoch_seconds",
    "images_per_second",
    "best_epoch",
    "raw_val_loss",
    "raw_val_accuracy",
)
# Set on a run once that part of its summary is in the store: a resume completes only the rest.
SUMMARY_ARTIFACTS_TAG = "summary.artifacts"


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

    Given a ``RunSink`` it logs through it (and so survives a tracking server outage);
    given a run id it logs straight to the current tracking store.
    """

    def __init__(self, run: "RunSink | str", fenced: bool = False, confirm=None) -> None:
        self.sink = run if isinstance(run, RunSink) else None
        self.run_id = run.run_id if isinstance(run, RunSink) else run
        self.client = MlflowClient()
        self._logged: set[int] | None = None
        # the run holds a lease (tracking.record.lease): stop once it is taken over
        self.fenced = fenced
        # Called once, at the first check (before the first training step or resumed epoch):
        # raises when the cell's run turned out to be another execution's (``KeyedRun.confirm``).
        self.confirm = confirm

    def check(self, sync: bool = False) -> None:
        if self.confirm is not None:
            confirm, self.confirm = self.confirm, None
            confirm()
        if self.fenced:
            HEARTBEATS.check(self.run_id, verify=sync)

    def on_start(self, info: dict) -> None:
        self.check()  # before anyone says the cell starts

    def logged_epochs(self) -> set[int]:
        if self._logged is None:
            if self.sink is not None:
                self._logged = self.sink.metric_steps("val_accuracy")
            else:
                self._logged = {
                    m.step for m in self.client.get_metric_history(self.run_id, "val_accuracy")
                }
        return self._logged

    def on_resume(self, history: list[dict]) -> None:
        for metrics in history:
            self.on_epoch(metrics)

    def on_epoch(self, metrics: dict) -> None:
        epoch = int(metrics["epoch"])
        if epoch in self.logged_epochs():
            return
        self.check(sync=True)
        values = {k: float(metrics[k]) for k in EPOCH_METRICS if k in metrics}
        if self.sink is not None:
            self.sink.log_metrics(values, step=epoch)
        else:
            mlflow.log_metrics(values, step=epoch, run_id=self.run_id)
        self._logged.add(epoch)


def log_run_inputs(
    sink: RunSink,
    cfg: TrainConfig,
    data: PreparedData,
    extra_params: dict | None = None,
    *,
    device: torch.device | str | None = None,
) -> None:
    """Flattened config params, data identity, the kernel identity, and the dataset as an MLflow
    input (``tracking.kinds.dataset_inputs``).

    The kernel identity (``kernel.*``, ``workbench.kernel_identity``) is logged as params by the
    cell's first execution, with the data identity: params never change, so a run resumed on
    other kernels keeps the first one's and is tagged ``kernel_changed`` (``log_kernel_identity``).
    """
    from tracking.kinds.dataset_inputs import training_dataset_input

    params = flatten("", cfg.to_dict(), {})
    params.update(
        {
            "data.fingerprint": data.data_fingerprint,
            "data.split_fingerprint": data.split_fingerprint,
            "data.display_name": data.display_name,
            "data.source": data.source[:490],
            "data.train_images": len(data.train.labels),
            "data.val_images": len(data.val.labels),
            "data.test_images": len(data.test.labels) if data.test is not None else 0,
            "code_fingerprint": current_code_fingerprint(),
            **(extra_params or {}),
        }
    )
    if device is not None:
        log_kernel_identity(sink, device)
    sink.log_params(params)  # only the ones a resumed run does not have yet
    sink.log_inputs([training_dataset_input(data)])


def log_kernel_identity(sink: RunSink, device: torch.device | str) -> dict[str, str]:
    """Log this execution's kernel identity as ``kernel.*`` params (the first execution's stay).

    An execution on other kernels than the one that started the run tags it ``kernel_changed``
    (``field: first -> now; ...``): from there on the run is not what one execution on the first
    kernels would have computed. Returns the identity of this execution.
    """
    identity = kernel_identity(device)
    first = recorded_identity(sink.journal.params)
    changed = kernel_differences(first, identity) if first else []
    if changed:
        sink.set_tags({"kernel_changed": "; ".join(changed)})
    sink.log_params(identity)  # only the fields a resumed run does not have yet
    return identity


def log_training_result(
    sink: RunSink,
    result: TrainResult,
    cfg: TrainConfig,
    model_factory,
    example: torch.Tensor,
    check=lambda: None,
) -> None:
    """Summary metrics, reload proof, predictions, checkpoints, config and the logged model: once.

    Each part is skipped when the run already has it (a resume after a kill in the middle
    of the summary completes only the rest). Summary metrics have keys of their own (never
    a per-epoch key) and sit at the last epoch's step. ``check`` runs before each write
    and raises when the run was taken over.
    """
    proof = result.reload_proof
    summary = {
        **result.final_metrics,
        "reload_proof_passed": float(proof.passed),
        "reload_proof_max_abs_diff": proof.max_abs_prob_diff
        if math.isfinite(proof.max_abs_prob_diff)
        else -1.0,
    }
    have = {m.key for m in sink.journal.metrics}
    missing = {k: v for k, v in summary.items() if k not in have}
    if missing:
        check()
        sink.log_metrics(missing, step=len(result.history))
    check()
    sink.set_tags(
        {
            "reload_proof": "passed" if proof.passed else "failed",
            "reload_proof_summary": proof.summary(),
            "stopped_early": str(result.stopped_early).lower(),
            **{f"fast_path.{k}": v for k, v in result.fast_path.items()},
        }
    )
    if sink.journal.tags.get(SUMMARY_ARTIFACTS_TAG) != "logged":
        for path in result.predictions.values():
            check()
            sink.log_artifact(path, artifact_path="predictions")
        for path in result.checkpoints.values():
            check()
            sink.log_artifact(path, artifact_path="checkpoints")
        with tempfile.TemporaryDirectory() as tmp:
            config_path = Path(tmp) / "config.json"
            config_path.write_text(json.dumps(cfg.to_dict(), indent=2, default=str))
            sink.log_artifact(config_path)
            history = Path(tmp) / "history.json"
            history.write_text(json.dumps(result.history, indent=1))
            sink.log_artifact(history)
        sink.set_tags({SUMMARY_ARTIFACTS_TAG: "logged"})
    if _ready_model(sink):
        return
    check()
    sink.log_model(lambda run_id: log_model(result, model_factory, example, run_id))


def _ready_model(sink: RunSink) -> bool:
    """Whether the run already has a READY logged model; half-made ones (PENDING, FAILED) are deleted."""
    client = MlflowClient(offline_store.fallback_uri() if sink.mirror_id else sink.uri)
    run_id = sink.local_run_id
    try:
        exp_id = client.get_run(run_id).info.experiment_id
        models = client.search_logged_models([exp_id], filter_string=f"source_run_id = '{run_id}'")
    except Exception as err:  # the server went away: the sink decides where the model goes
        if health.is_unreachable(err):
            return False
        raise
    ready = False
    for model in models:
        if str(model.status).endswith("READY") and not ready:
            ready = True
        else:  # a model a killed execution left half-uploaded, or a second copy
            with contextlib.suppress(Exception):
                client.delete_logged_model(model.model_id)
    return ready


def log_model(
    result: TrainResult, model_factory, example: torch.Tensor, run_id: str | None = None
) -> None:
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
    kwargs = dict(
        name="model",
        signature=signature,
        input_example=example.numpy(),
        pip_requirements=requirements,
        serialization_format="pt2",
    )
    if run_id is None:
        mlflow.pytorch.log_model(model, **kwargs)
        return
    # Without an active run MLflow files the model under the active *experiment*, not the
    # run's; creating the LoggedModel here puts it beside its run in whichever store.
    client = MlflowClient()
    logged = client.create_logged_model(
        client.get_run(run_id).info.experiment_id, name="model", source_run_id=run_id
    )
    try:
        mlflow.pytorch.log_model(model, run_id=run_id, model_id=logged.model_id, **kwargs)
    except Exception:
        with contextlib.suppress(Exception):  # a half-uploaded model must not look usable
            client.finalize_logged_model(logged.model_id, "FAILED")
        raise


def started_threads(sink: RunSink, continues: str | None = None) -> int | None:
    """The thread count the cell's first execution trained with (its ``threads`` param), if recorded."""
    value = sink.journal.params.get("threads")
    if value is None and continues:  # a fresh run continuing one whose holder may still write
        with contextlib.suppress(Exception):
            value = MlflowClient(sink.uri).get_run(continues).data.params.get("threads")
    with contextlib.suppress(TypeError, ValueError):
        return int(value)
    return None
