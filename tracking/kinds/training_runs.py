"""MLflow side of training: per-epoch metrics, resumable runs, artifacts, the logged model."""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlflow
import torch
from mlflow.entities import Run, RunTag
from mlflow.tracking import MlflowClient

from tracking.record import create_once
from tracking.record.lease import (CONTINUES_TAG, HEARTBEAT_TAG, HEARTBEATS, HOST_TAG, PID_TAG, REASON_TAG, SUPERSEDED_TAG,
                                   TOKEN_TAG, is_mine, lease_state, possible_writer)
from tracking.record.sink import SYNC_SYNCED, RunSink, log_batch, store_for
from tracking.store import health, offline_store, uris
from tracking.store.session import run_user
from tracking.store.store_lock import store_lock
from workbench.data import PreparedData
from workbench.train.config import TrainConfig
from workbench.train.fingerprint import current_code_fingerprint
from workbench.train.loop import TrainingObserver, TrainResult

EPOCH_METRICS = ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "lr", "epoch_seconds",
                 "images_per_second", "best_epoch", "raw_val_loss", "raw_val_accuracy")  # raw_*: with weight EMA
# Set on a run once that part of its summary is in the store: a resume completes only the rest.
SUMMARY_ARTIFACTS_TAG = "summary.artifacts"
LEASE_TAGS = (HOST_TAG, PID_TAG, TOKEN_TAG, HEARTBEAT_TAG)


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
        self.fenced = fenced  # the run holds a lease (tracking.record.lease): stop once it is taken over
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
                self._logged = {m.step for m in self.client.get_metric_history(self.run_id, "val_accuracy")}
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


@dataclass
class KeyedRun:
    """The run of a run key: a sink to log through, and the status it had when found."""

    sink: RunSink | None
    run_id: str
    status: str | None  # None: created now; "BUSY": RUNNING under a live lease of another execution
    metrics: dict = field(default_factory=dict)
    why: str = ""  # for BUSY: who holds it
    previous_status: str | None = None
    continues: str | None = None  # the run this one continues because its holder may still write to it
    # The look once more before the first training step (``tracking.record.create_once``): raises
    # ``ClaimLost`` (or ``LeaseLost``) when another execution's run is the cell's after all.
    confirm: Callable[[], None] | None = None


def _candidates(client: MlflowClient, experiment_id: str, key: str) -> list[Run]:
    """The runs that may be a cell's run: every run of its key not closed as superseded."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.run_key = '{key}'", max_results=50)
    return [r for r in runs if SUPERSEDED_TAG not in r.data.tags]


def _find_by_key(client: MlflowClient, experiment_id: str, key: str, unsynced: bool = False) -> Run | None:
    runs = client.search_runs([experiment_id], filter_string=f"tags.run_key = '{key}'",
                              order_by=["attributes.start_time DESC"], max_results=50)
    if unsynced:  # a synced run is on the server too, where the search found (or will find) it
        runs = [r for r in runs if SYNC_SYNCED not in r.data.tags]
    return runs[0] if runs else None


def open_keyed_run(experiment: str, key: str, tags: dict, parent_run_id: str | None = None,
                   take_over: bool = False) -> KeyedRun:
    """Find the run of ``key`` or create it, in whichever store it belongs; never two runs for one key.

    A RUNNING run held by a live execution is returned as BUSY, unless ``take_over`` (a
    queue that found that execution's lease expired hands the cell on).
    A run with this key that exists only in the local fallback store (not synced yet)
    continues there even when the server is back: one run, one timeline, merged by
    ``workbench sync``. A FINISHED run is returned without a sink (nothing to do).
    A new run belongs to ``run_user()``: the account logged in to the server, if any.
    """
    tags = {**tags, "mlflow.user": run_user()}
    # Two executions reaching the same cell at once on a local store: one run, not two.
    with store_lock(store_for(parent_run_id)):
        return _find_or_create_keyed(experiment, key, tags, parent_run_id, take_over)


def _find_or_create_keyed(experiment: str, key: str, tags: dict, parent_run_id: str | None,
                          take_over: bool) -> KeyedRun:
    if uris.is_remote(uris.tracking_uri()) and offline_store.fallback_exists():
        found = _find_in_fallback(experiment, key, unsynced=True)
        if found is not None:
            return _keyed(found, offline_store.fallback_uri(), experiment, tags, parent_run_id, take_over)
    uri = store_for(parent_run_id)
    if uri != offline_store.fallback_uri():
        client = MlflowClient(uri)
        try:
            exp_id = (client.get_run(parent_run_id).info.experiment_id if parent_run_id
                      else offline_store.ensure_experiment(client, experiment))
            found = _find_by_key(client, exp_id, key)
        except Exception as err:
            offline_store.go_offline_or_raise(uri, err)
            uri = offline_store.fallback_uri()
        else:
            if found is not None:
                return _keyed(found, uri, experiment, tags, parent_run_id, take_over)
            sink = RunSink.create(experiment, {"run_key": key, **tags}, parent_run_id, uri=uri, experiment_id=exp_id)
            return KeyedRun(sink, sink.run_id, None) if sink.offline else _first_of_new(client, sink, exp_id, key)
    found = _find_in_fallback(experiment, key)
    if found is not None:
        return _keyed(found, uri, experiment, tags, parent_run_id, take_over)
    sink = RunSink.create(experiment, {"run_key": key, **tags}, parent_run_id, uri=uri)
    return KeyedRun(sink, sink.run_id, None)


def _first_of_new(client: MlflowClient, sink: RunSink, exp_id: str, key: str) -> KeyedRun:
    """The cell's new run, or the one another execution created at the same moment (``tracking.record.create_once``)."""
    candidates = lambda: _candidates(client, exp_id, key)  # noqa: E731
    first = create_once.resolve_new(client, sink.run_id, candidates)
    if first.info.run_id == sink.run_id:
        return KeyedRun(sink, sink.run_id, None,
                        confirm=lambda: create_once.confirm_first(client, sink.run_id, candidates))
    why = "another execution created its run at the same moment and trains it"
    create_once.withdraw(client, sink.run_id, first.info.run_id, why)
    status = "FINISHED" if first.info.status == "FINISHED" else "BUSY"
    return KeyedRun(None, first.info.run_id, status, dict(first.data.metrics), why)


def _find_in_fallback(experiment: str, key: str, unsynced: bool = False) -> Run | None:
    client = offline_store.fallback_client()
    exp = client.get_experiment_by_name(experiment)
    return _find_by_key(client, exp.experiment_id, key, unsynced) if exp else None


def _keyed(run: Run, uri: str, experiment: str, tags: dict, parent_run_id: str | None = None,
           take_over: bool = False) -> KeyedRun:
    if run.info.status == "FINISHED":
        return KeyedRun(None, run.info.run_id, "FINISHED", dict(run.data.metrics))
    if run.info.status == "RUNNING" and not is_mine(run) and not take_over:
        state = lease_state(run)
        if state.alive:  # another execution is training it right now: not ours to touch
            return KeyedRun(None, run.info.run_id, "BUSY", dict(run.data.metrics), state.why)
    writer = possible_writer(run)
    if writer is not None:
        return _continue_in_new_run(run, uri, experiment, tags, parent_run_id, writer)
    lease = {k: tags[k] for k in LEASE_TAGS if k in tags}
    if TOKEN_TAG in lease:  # two executions resuming it at the same moment: the token left on it holds it
        holder = create_once.claim_existing(MlflowClient(uri), run.info.run_id, lease)
        if holder is not None:
            return KeyedRun(None, run.info.run_id, "BUSY", dict(run.data.metrics), holder)
    sink = RunSink.attach(run, uri, experiment)
    old_parent = run.data.tags.get("mlflow.parentRunId")
    if parent_run_id and old_parent != parent_run_id:
        # A cell begun under another (older or duplicate) parent joins the study's one parent.
        sink.set_tags({"mlflow.parentRunId": parent_run_id, "previous_parent_run_id": old_parent or ""})
    confirm = (lambda: HEARTBEATS.check(run.info.run_id, verify=True)) if TOKEN_TAG in lease else None
    return KeyedRun(sink, run.info.run_id, run.info.status, confirm=confirm)


def _continue_in_new_run(old: Run, uri: str, experiment: str, tags: dict, parent_run_id: str | None,
                         writer: str) -> KeyedRun:
    """Close ``old`` as superseded and give the cell a fresh run with the same key.

    The old holder may still be alive (paused, cut off): fenced by the token, it stops at
    its next check, but a point it was already uploading would land in the run it holds.
    That run is no longer the cell's: its late writes cannot duplicate a step of the new
    run, which fills its earlier epochs from the checkpoint's history on resume.
    """
    client = MlflowClient(uri)
    old_id, token = old.info.run_id, tags.get(TOKEN_TAG, "superseded")
    new_tags = {"run_key": old.data.tags.get("run_key", ""), **tags, CONTINUES_TAG: old_id}
    # Fence first (a new token on the old run), then open the new run: the old holder's
    # next check fails whatever happens after this line.
    # Tags through log_batch: a reaper may write the same new key at the same moment, and
    # MLflow retries a lost insert there (a single set_tag would fail with a server error).
    log_batch(client, old_id, tags=[RunTag(TOKEN_TAG, token)])
    sink = RunSink.create(experiment, new_tags, parent_run_id or old.data.tags.get("mlflow.parentRunId"),
                          uri=uri, experiment_id=old.info.experiment_id)
    confirm = None
    if TOKEN_TAG in tags and not sink.offline:
        # Two executions continuing it at the same moment both fenced it: the token left on
        # the old run says which one continues the cell (``tracking.record.create_once``).
        holder = create_once.holder_after_wait(client, old_id, token)
        if holder is not None:
            create_once.withdraw(client, sink.run_id, "", holder)
            return KeyedRun(None, old_id, "BUSY", dict(old.data.metrics), holder)
        confirm = lambda: create_once.confirm_holder(client, old_id, token)  # noqa: E731
    closed = [RunTag(SUPERSEDED_TAG, sink.run_id)]
    if old.info.status == "RUNNING":
        closed.append(RunTag(REASON_TAG, f"taken over while its holder may still be alive ({writer}); "
                                         f"the cell continues in run {sink.run_id}"[:500]))
    log_batch(client, old_id, tags=closed)
    if old.info.status == "RUNNING":
        client.set_terminated(old_id, "KILLED")
    return KeyedRun(sink, sink.run_id, old.info.status, continues=f"{old_id} ({writer})", confirm=confirm)


def withdraw_candidate(sink: RunSink, lost: create_once.ClaimLost) -> None:
    """Take back a cell's run that lost its claim before training (``create_once.withdraw``)."""
    with contextlib.suppress(Exception):  # a server gone now: the reaper ends it once its lease expires
        create_once.withdraw(MlflowClient(sink.uri), sink.run_id, lost.winner, str(lost))


def log_run_inputs(sink: RunSink, cfg: TrainConfig, data: PreparedData, extra_params: dict | None = None) -> None:
    """Flattened config params, data identity, and the dataset as an MLflow input (``tracking.kinds.dataset_inputs``)."""
    from tracking.kinds.dataset_inputs import training_dataset_input

    params = flatten("", cfg.to_dict(), {})
    params.update({
        "data.fingerprint": data.data_fingerprint,
        "data.split_fingerprint": data.split_fingerprint,
        "data.display_name": data.display_name,
        "data.source": data.source[:490],
        "data.train_images": len(data.train.labels),
        "data.val_images": len(data.val.labels),
        "data.test_images": len(data.test.labels) if data.test is not None else 0,
        "code_fingerprint": current_code_fingerprint(),
        **(extra_params or {}),
    })
    sink.log_params(params)  # only the ones a resumed run does not have yet
    sink.log_inputs([training_dataset_input(data)])


def log_training_result(sink: RunSink, result: TrainResult, cfg: TrainConfig, model_factory,
                        example: torch.Tensor, check=lambda: None) -> None:
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
        "reload_proof_max_abs_diff": proof.max_abs_prob_diff if math.isfinite(proof.max_abs_prob_diff) else -1.0,
    }
    have = {m.key for m in sink.journal.metrics}
    missing = {k: v for k, v in summary.items() if k not in have}
    if missing:
        check()
        sink.log_metrics(missing, step=len(result.history))
    check()
    sink.set_tags({
        "reload_proof": "passed" if proof.passed else "failed",
        "reload_proof_summary": proof.summary(),
        "stopped_early": str(result.stopped_early).lower(),
    })
    if sink.journal.tags.get(SUMMARY_ARTIFACTS_TAG) != "logged":
        for split, path in result.predictions.items():
            check()
            sink.log_artifact(path, artifact_path="predictions")
        for kind, path in result.checkpoints.items():
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


def log_model(result: TrainResult, model_factory, example: torch.Tensor, run_id: str | None = None) -> None:
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
    kwargs = dict(name="model", signature=signature, input_example=example.numpy(), pip_requirements=requirements,
                  serialization_format="pt2")
    if run_id is None:
        mlflow.pytorch.log_model(model, **kwargs)
        return
    # Without an active run MLflow files the model under the active *experiment*, not the
    # run's; creating the LoggedModel here puts it beside its run in whichever store.
    client = MlflowClient()
    logged = client.create_logged_model(client.get_run(run_id).info.experiment_id, name="model", source_run_id=run_id)
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
