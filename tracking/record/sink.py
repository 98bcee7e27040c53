"""RunSink: every MLflow call of one run, surviving a tracking server that goes away.

A sink logs to the run's store. When a call fails because the server is unreachable, it
creates a *mirror* run in the local fallback store (tagged ``sync.server_run_id`` with the
server run it continues), replays its journal there (params, tags, dataset inputs, every
metric point with its step and timestamp) and carries on locally for the rest of the run.
``workbench sync`` later merges the mirror into the server run. A run created while the
server was already unreachable lives in the fallback store from the start.

The journal is what makes the mirror a faithful continuation: metric points are logged
with explicit timestamps, so the copies in the mirror equal the ones the server already
has, and the sync can recognise them.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlflow
from mlflow.entities import DatasetInput, Metric, Param, Run, RunTag
from mlflow.tracking import MlflowClient

from tracking.record.schema import PARENT_RUN_ID
from tracking.store import health, offline_store, uris
from tracking.store.redact import redact_record, redact_text

SYNC_SERVER_RUN = "sync.server_run_id"  # on a mirror: the server run it continues
SYNC_SERVER_URI = "sync.server_uri"  # redacted: where the run was meant to go
SYNC_REASON = "sync.reason"
SYNC_SYNCED = "sync.synced_run_id"  # set by `workbench sync` once the run is fully on the server
# Text artifacts are redacted on their way up (``tracking.store.redact``); larger ones are data files.
TEXT_ARTIFACTS = {
    ".json",
    ".txt",
    ".yaml",
    ".yml",
    ".md",
    ".log",
    ".html",
    ".csv",
    ".cfg",
    ".ini",
    ".toml",
}
MAX_REDACTED_BYTES = 64 * 2**20
# How an attempt ended. A run continued (or finished) later keeps them only as history, in
# HISTORY_TAG, never as its current state: a FINISHED run with a killed_reason misleads.
OUTCOME_TAGS = (
    "killed_reason",
    "end_reason",
    "failure",
    "nonfinite_loss_step",
    "nonfinite_loss_epoch",
)
HISTORY_TAG = "earlier_ends"
HISTORY_CHARS = 5000
_SINKS: dict[str, "RunSink"] = {}


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Journal:
    """What the run holds so far, kept in memory to replay into a mirror run."""

    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    metrics: list[Metric] = field(default_factory=list)
    inputs: list[DatasetInput] = field(default_factory=list)
    start_time: int | None = None

    @classmethod
    def of(cls, client: MlflowClient, run: Run) -> "Journal":
        """The journal of an existing run: its params, tags, inputs and full metric histories."""
        metrics = [
            m for key in run.data.metrics for m in client.get_metric_history(run.info.run_id, key)
        ]
        inputs = list(run.inputs.dataset_inputs) if run.inputs else []
        return cls(dict(run.data.params), dict(run.data.tags), metrics, inputs, run.info.start_time)


@contextlib.contextmanager
def _global_uri(uri: str):
    """MLflow's model logging reads the global tracking URI; point it at ``uri`` for one call."""
    old = mlflow.get_tracking_uri()
    uris.set_process_uri(uri)
    try:
        yield
    finally:
        uris.set_process_uri(old)


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def log_batch(client: MlflowClient, run_id: str, metrics=(), params=(), tags=()) -> None:
    """``log_batch`` within MLflow's per-request limits (1000 metrics, 100 params, 100 tags)."""
    for chunk in _batches(list(params), 100):
        client.log_batch(run_id, params=chunk)
    for chunk in _batches(list(tags), 100):
        client.log_batch(run_id, tags=chunk)
    for chunk in _batches(list(metrics), 1000):
        client.log_batch(run_id, metrics=chunk)


def delete_tag_if_present(client: MlflowClient, run_id: str, key: str) -> None:
    """Delete a tag; one already gone is what was wanted. Two executions that reattach one run at
    once both clear its stale tags, and the slower one's delete answers RESOURCE_DOES_NOT_EXIST
    (CI: a worker died at start on this, beside one that had just cleared ``killed_reason``)."""
    from mlflow.exceptions import MlflowException

    try:
        client.delete_tag(run_id, key)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise


class RunSink:
    """The one path of a run's MLflow calls. ``run_id`` stays the id the run was created with."""

    def __init__(
        self, run_id: str, uri: str, experiment: str, journal: Journal | None = None
    ) -> None:
        self.run_id, self.uri, self.experiment = run_id, uri, experiment
        self.journal = journal or Journal(start_time=now_ms())
        self.mirror_id: str | None = None
        _SINKS[run_id] = self

    # ------------------------------------------------------------ opening

    @classmethod
    def create(
        cls,
        experiment: str,
        tags: dict,
        parent_run_id: str | None = None,
        uri: str | None = None,
        experiment_id: str | None = None,
    ) -> "RunSink":
        """A new run in ``uri`` (default: where runs go now), or in the fallback store if that fails."""
        uri = uri or store_for(parent_run_id)
        tags = {k: redact_text(v) for k, v in tags.items()}
        if parent_run_id:
            tags[PARENT_RUN_ID] = parent_run_id
        if uri != offline_store.fallback_uri():
            try:
                client = MlflowClient(uri)
                exp_id = experiment_id or offline_store.ensure_experiment(client, experiment)
                run = client.create_run(exp_id, tags=tags)
                return cls(
                    run.info.run_id,
                    uri,
                    experiment,
                    Journal(tags=dict(run.data.tags), start_time=run.info.start_time),
                )
            except Exception as err:
                offline_store.go_offline_or_raise(uri, err)
        client = offline_store.fallback_client()
        tags = {**tags, **offline_tags("server unreachable when the run started")}
        run = client.create_run(offline_store.ensure_experiment(client, experiment), tags=tags)
        return cls(
            run.info.run_id,
            offline_store.fallback_uri(),
            experiment,
            Journal(tags=dict(run.data.tags), start_time=run.info.start_time),
        )

    @classmethod
    def attach(cls, run: Run, uri: str, experiment: str) -> "RunSink":
        """A sink continuing an existing run (seeded with everything the run already holds)."""
        client = MlflowClient(uri)
        if run.info.status != "RUNNING":
            client.update_run(run.info.run_id, status="RUNNING")
            _to_history(client, run, run.info.status, run.info.end_time)
        if uri == offline_store.fallback_uri() and SYNC_SYNCED in run.data.tags:
            # It changes again, so the next `workbench sync` must look at it again.
            delete_tag_if_present(client, run.info.run_id, SYNC_SYNCED)
        return cls(run.info.run_id, uri, experiment, Journal.of(client, run))

    @classmethod
    def for_run(cls, run_id: str, experiment: str | None = None) -> "RunSink":
        """The live sink of ``run_id`` in this process, or one attached to wherever the run lives."""
        if run_id in _SINKS:
            return _SINKS[run_id]
        uri = (
            offline_store.fallback_uri()
            if offline_store.fallback_run_exists(run_id)
            else uris.tracking_uri()
        )
        client = MlflowClient(uri)
        try:
            run = client.get_run(run_id)
            name = experiment or client.get_experiment(run.info.experiment_id).name
            return cls.attach(run, uri, name)
        except Exception as err:
            health.raise_if_auth_failure(uri, err)
            if not health.is_unreachable(err):
                raise
            sink = cls(run_id, uri, experiment or "workbench-offline")
            sink._switch(err)  # nothing to seed from: the mirror starts empty and sync merges
            return sink

    # ------------------------------------------------------------ the calls

    @property
    def offline(self) -> bool:
        return self.mirror_id is not None or self.uri == offline_store.fallback_uri()

    @property
    def local_run_id(self) -> str:
        """The run this sink writes to now (the mirror after a switch)."""
        return self.mirror_id or self.run_id

    def _do(self, what: str, fn: Callable[[MlflowClient, str], object], retries: bool = False):
        if self.mirror_id is None and uris.is_remote(self.uri) and health.known_down(self.uri):
            # Another run of this process just found the server away: spare this one the
            # retries (seconds per call) and continue locally at once.
            self._switch(health.known_down(self.uri))
        if self.mirror_id is None and uris.is_remote(self.uri):
            client = MlflowClient(self.uri)
            try:
                if retries:  # a few tries only: past them, the local store is the better place
                    return health.with_retries(lambda: fn(client, self.run_id), what, attempts=3)
                return fn(client, self.run_id)
            except Exception as err:
                # Mid-run even refused credentials (a password rotated under a long run) are
                # answered by logging locally: the run is synced later with valid ones.
                if not (health.is_unreachable(err) or health.is_auth_failure(err)):
                    raise
                self._switch(err)
        return fn(
            MlflowClient(offline_store.fallback_uri() if self.mirror_id else self.uri),
            self.local_run_id,
        )

    def _switch(self, err: BaseException | str) -> None:
        """Continue in a mirror run in the fallback store, replaying the journal there."""
        why = err if isinstance(err, str) else health.describe_failure(err)
        reason = f"server unreachable mid-run: {why}"
        health.mark_down(self.uri, why)
        offline_store.warn_offline(self.uri, why)
        client = offline_store.fallback_client()
        tags = {**self.journal.tags, **offline_tags(reason), SYNC_SERVER_RUN: self.run_id}
        run = client.create_run(
            offline_store.ensure_experiment(client, self.experiment),
            start_time=self.journal.start_time,
            tags=tags,
        )
        self.mirror_id = run.info.run_id
        log_batch(
            client,
            self.mirror_id,
            metrics=self.journal.metrics,
            params=[Param(k, v) for k, v in self.journal.params.items()],
        )
        if self.journal.inputs:
            client.log_inputs(self.mirror_id, datasets=self.journal.inputs)

    def log_params(self, params: dict) -> None:
        """Params the run does not have yet (MLflow refuses to change one; resumed runs have them).

        Another execution sharing the run (two starts of one study) may log the same param a
        moment earlier: the store refuses the second insert, and a param it now holds with
        the same value is not an error (a different value is).
        """
        new = {k: redact_text(v)[:6000] for k, v in params.items() if k not in self.journal.params}
        if not new:
            return

        def log(client: MlflowClient, run_id: str) -> None:
            try:
                log_batch(client, run_id, params=[Param(k, v) for k, v in new.items()])
            except Exception as err:
                if not lost_insert_race(err):
                    raise
                have = client.get_run(run_id).data.params
                clash = {k for k, v in new.items() if k in have and have[k] != v}
                if clash:
                    raise
                log_batch(
                    client, run_id, params=[Param(k, v) for k, v in new.items() if k not in have]
                )

        self._do("log params", log)
        self.journal.params.update(new)

    def set_tags(self, tags: dict) -> None:
        clean = {k: redact_text(v)[:8000] for k, v in tags.items()}
        self._do(
            "set tags", lambda c, r: log_batch(c, r, tags=[RunTag(k, v) for k, v in clean.items()])
        )
        self.journal.tags.update(clean)

    def log_metrics(self, values: dict, step: int = 0, timestamp: int | None = None) -> None:
        stamp = timestamp or now_ms()
        points = [Metric(k, float(v), stamp, int(step)) for k, v in values.items()]
        self._do("log metrics", lambda c, r: log_batch(c, r, metrics=points))
        self.journal.metrics.extend(points)

    def log_lacking_metrics(self, values: dict, step: int = 0) -> None:
        """``log_metrics`` of the values whose key the run lacks at ``step``: a cell continued in place
        after its execution died between its results and its end logs each number once, not twice."""
        have = {(m.key, m.step) for m in self.journal.metrics}
        lacking = {k: v for k, v in values.items() if (k, int(step)) not in have}
        if lacking:
            self.log_metrics(lacking, step=step)

    def log_inputs(self, datasets: list[DatasetInput]) -> None:
        # MLflow's store looks the dataset up, then inserts it if it was missing: two runs of
        # one experiment logging the same new dataset at once (queue workers starting their
        # cells) collide on its unique key and the loser gets a 400. The dataset exists then,
        # so another try only links it to this run.
        for attempt in range(1, 4):
            try:
                self._do("log inputs", lambda c, r: c.log_inputs(r, datasets=datasets))
                break
            except Exception as err:
                if attempt == 3 or not lost_insert_race(err):
                    raise
                time.sleep(0.2 * attempt)
        self.journal.inputs.extend(datasets)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file; a text file goes up redacted (a copy: the local file is left as it is)."""
        with redacted_copy(Path(path)) as upload:
            self._do(
                f"upload {Path(path).name}",
                lambda c, r: c.log_artifact(r, str(upload), artifact_path),
                retries=True,
            )

    def log_record(self, record: dict, artifact_file: str) -> None:
        """A JSON record (e.g. ``executions/<name>.json``), redacted field by field before it is written."""
        folder, _, name = artifact_file.rpartition("/")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(json.dumps(redact_record(record), indent=1))
            self.log_artifact(path, artifact_path=folder or None)

    def log_model(self, log_fn: Callable[[str], object]) -> None:
        """Run ``log_fn(run_id)`` (an ``mlflow.<flavor>.log_model(..., run_id=run_id)``) against the active store."""

        def call(client: MlflowClient, run_id: str):
            with _global_uri(client.tracking_uri):
                return log_fn(run_id)

        self._do("log model", call, retries=True)

    def end(self, status: str = "FINISHED", end_time: int | None = None) -> None:
        """End the run (``end_time``: ms, default now); a FINISHED run keeps earlier outcomes only as history."""
        stale = {k: v for k, v in self.journal.tags.items() if k in OUTCOME_TAGS}
        if status == "FINISHED" and stale:
            history = _history_with(self.journal.tags.get(HISTORY_TAG, ""), "earlier", None, stale)
            self.set_tags({HISTORY_TAG: history})
            for key in stale:
                self._do("clear tag", lambda c, r, key=key: delete_tag_if_present(c, r, key))
                self.journal.tags.pop(key, None)
        self._do("end run", lambda c, r: c.set_terminated(r, status, end_time=end_time))
        _SINKS.pop(self.run_id, None)

    # ------------------------------------------------------------ what the run holds

    def metric_steps(self, key: str) -> set[int]:
        return {m.step for m in self.journal.metrics if m.key == key}

    def latest_metrics(self) -> dict[str, float]:
        latest: dict[str, Metric] = {}
        for m in self.journal.metrics:
            if m.key not in latest or (m.step, m.timestamp) >= (
                latest[m.key].step,
                latest[m.key].timestamp,
            ):
                latest[m.key] = m
        return {k: m.value for k, m in latest.items()}


def _history_with(history: str, status: str, end_time: int | None, outcome: dict[str, str]) -> str:
    when = (
        time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(end_time / 1000)) if end_time else "?"
    )
    line = f"{status} (ended {when}): " + "; ".join(f"{k}={v}" for k, v in outcome.items())
    return "\n".join(filter(None, [history, line]))[-HISTORY_CHARS:]


def _to_history(client: MlflowClient, run: Run, status: str, end_time: int | None) -> None:
    """A run continued now: how its last attempt ended moves from its current tags into ``HISTORY_TAG``."""
    tags = run.data.tags
    outcome = {k: tags[k] for k in OUTCOME_TAGS if k in tags}
    if not outcome:
        return
    history = _history_with(tags.get(HISTORY_TAG, ""), status, end_time, outcome)
    log_batch(client, run.info.run_id, tags=[RunTag(HISTORY_TAG, history)])
    for key in outcome:
        delete_tag_if_present(client, run.info.run_id, key)
        tags.pop(key, None)  # the journal is built from this run: it must not bring them back
    tags[HISTORY_TAG] = history


@contextlib.contextmanager
def redacted_copy(path: Path):
    """``path`` itself, or a redacted copy of it with the same name when it is text holding a secret."""
    if (
        path.suffix.lower() not in TEXT_ARTIFACTS
        or not path.is_file()
        or path.stat().st_size > MAX_REDACTED_BYTES
    ):
        yield path
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:  # not text after all
        yield path
        return
    clean = redact_text(text)
    if path.suffix.lower() == ".json":  # redacted as data: an escaped secret ("a\\"b") is found too
        with contextlib.suppress(ValueError):
            data = json.loads(text)
            redacted = redact_record(data)
            clean = text if redacted == data else json.dumps(redacted, indent=1)
    if clean == text:
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        copy.write_text(clean, encoding="utf-8")
        yield copy


def lost_insert_race(err: BaseException) -> bool:
    """Whether the store refused a row another writer inserted a moment before (unique key taken)."""
    text = str(err)
    return any(
        hint in text
        for hint in (
            "duplicate key value violates unique constraint",
            "UNIQUE constraint failed",
            "Duplicate entry",
        )
    )


def offline_tags(reason: str) -> dict[str, str]:
    return {SYNC_SERVER_URI: uris.redact_uri(uris.tracking_uri()), SYNC_REASON: reason[:500]}


def store_for(parent_run_id: str | None) -> str:
    """Where a new run goes: beside a parent living in the fallback store, else where runs go now."""
    if (
        parent_run_id
        and uris.is_remote(uris.tracking_uri())
        and offline_store.fallback_run_exists(parent_run_id)
    ):
        return offline_store.fallback_uri()
    return offline_store.active_store_uri()
