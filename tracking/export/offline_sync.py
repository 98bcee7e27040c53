"""`workbench sync`: copy runs logged to the local fallback store onto the tracking server, exactly once.

Each local run goes to one server run:

- a *mirror* (tag ``sync.server_run_id``) merges into the server run it continues;
- any other run goes to a server run created on its first sync and found again on every
  later one by the tag ``sync.source_run_id``, so a rerun never creates a second copy.
  A finished run whose run key already has a finished server run (the same cell, run
  twice while the server was away) is not copied again.

What the server lacks is added: params, tags, every metric point (deduplicated on key,
step, timestamp and value: the sink logs with explicit timestamps, so a point the server
already has arrives again unchanged), dataset inputs, artifact files (by path and size,
uploaded with retries and backoff), logged models, and the final status. Parents go before
their children and ``mlflow.parentRunId`` is mapped to the parent's server id. A run is
marked ``sync.synced_run_id`` only after all of it is on the server and it has ended; a
run still RUNNING is copied as far as it got and looked at again next time.

"Synced" is remembered per target: a tag ``sync.to.<key>`` per (server URL, experiment),
``key`` a hash of the URL without credentials (normalised: lower-case host, no default
port, no trailing slash; a SQLite file by its resolved path) and the experiment name. Its
value is ``<server run id> <end time> <normalised URL>``; a run that ended again since
(continued locally) is looked at again. So a sync into the wrong store does not stop the
real sync from copying, and a second sync to the same target copies nothing.
``plan`` says what a sync would do, without changing anything (``sync --dry-run``).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import mlflow
from mlflow.entities import LoggedModelOutput, Metric, Param, Run, RunTag, ViewType
from mlflow.tracking import MlflowClient

from tracking.record import schema
from tracking.record.sink import SYNC_SERVER_RUN, SYNC_SYNCED, log_batch
from tracking.store import health, offline_store, uris

SYNC_SOURCE_RUN = "sync.source_run_id"
SYNC_SOURCE_MODEL = "sync.source_model_id"
TERMINAL = ("FINISHED", "FAILED", "KILLED")
SYNC_TO_PREFIX = "sync.to."
NOT_COPIED_TAGS = (SYNC_SERVER_RUN, SYNC_SYNCED, schema.PARENT_RUN_ID)
DEFAULT_PORTS = {"http": 80, "https": 443}


def normalise_target(uri: str) -> str:
    """A target store's URL without credentials, spelled one way (safe to store and print)."""
    if uri.startswith("sqlite:///"):
        return f"sqlite:///{Path(uri.removeprefix('sqlite:///')).expanduser().resolve()}"
    parts = urlsplit(uri)
    if parts.scheme in DEFAULT_PORTS and parts.hostname:
        host = parts.hostname.lower()
        host = f"[{host}]" if ":" in host else host
        port = parts.port if parts.port not in (None, DEFAULT_PORTS[parts.scheme]) else None
        netloc = f"{host}:{port}" if port else host
        return urlunsplit((parts.scheme.lower(), netloc, parts.path.rstrip("/"), parts.query, ""))
    return uris.redact_uri(uri)


def target_tag(target_uri: str, experiment: str) -> str:
    """The tag that records a sync of a run to ``experiment`` on ``target_uri``."""
    digest = hashlib.sha256(f"{normalise_target(target_uri)}\n{experiment}".encode()).hexdigest()[
        :16
    ]
    return f"{SYNC_TO_PREFIX}{digest}"


def is_sync_tag(key: str) -> bool:
    return key in NOT_COPIED_TAGS or key.startswith(SYNC_TO_PREFIX)


@dataclass
class SyncReport:
    runs_created: int = 0
    runs_updated: int = 0
    runs_unchanged: int = 0
    runs_skipped: int = 0  # already synced to this target, unchanged since
    runs_pending: int = 0  # still RUNNING locally: copied so far, looked at again next time
    duplicates: int = 0
    metric_points: int = 0
    params: int = 0
    artifacts: int = 0
    models: int = 0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"runs: {self.runs_created} created, {self.runs_updated} updated, {self.runs_unchanged} unchanged, "
            f"{self.runs_skipped} already synced to this target, {self.runs_pending} still running, {self.duplicates} duplicates "
            f"not copied; added {self.metric_points} metric points, {self.params} params, {self.artifacts} "
            f"artifact files, {self.models} models; {len(self.errors)} errors"
        )


def _ordered(runs: list[Run]) -> list[Run]:
    """Parents before children (among the local runs)."""
    by_id = {r.info.run_id: r for r in runs}
    done, out = set(), []

    def visit(run: Run) -> None:
        if run.info.run_id in done:
            return
        done.add(run.info.run_id)
        parent = run.data.tags.get(schema.PARENT_RUN_ID)
        if parent in by_id:
            visit(by_id[parent])
        out.append(run)

    for run in sorted(runs, key=lambda r: r.info.start_time or 0):
        visit(run)
    return out


def _point(m: Metric) -> tuple:
    return (m.key, m.step, m.timestamp, "nan" if math.isnan(m.value) else m.value)


def _files(client: MlflowClient, run_id: str, path: str | None = None) -> dict[str, int]:
    """Every artifact file of a run: path -> size."""
    out = {}
    for info in client.list_artifacts(run_id, path):
        if info.is_dir:
            out.update(_files(client, run_id, info.path))
        else:
            out[info.path] = info.file_size
    return out


class Syncer:
    """One sync from ``source`` (the fallback store) to ``target`` (the server)."""

    def __init__(self, source_uri: str, target_uri: str, recheck: bool = False, log=print) -> None:
        if source_uri == target_uri:
            raise ValueError(
                f"sync source and target are the same store: {uris.redact_uri(source_uri)}"
            )
        self.src = MlflowClient(source_uri)
        self.source_uri, self.target_uri = source_uri, target_uri
        self.recheck, self.log = recheck, log
        self.report = SyncReport()
        self.server_id: dict[str, str] = {}  # local run id -> server run id
        self.experiments: dict[str, str] = {}  # local experiment id -> name

    @functools.cached_property
    def dst(self) -> MlflowClient:
        """The target, opened when first asked (opening a SQLite store creates its file)."""
        return MlflowClient(self.target_uri)

    def _local_runs(self) -> list[Run]:
        runs = []
        for exp in self.src.search_experiments(view_type=ViewType.ACTIVE_ONLY):
            self.experiments[exp.experiment_id] = exp.name
            runs += self.src.search_runs([exp.experiment_id], max_results=50000)
        for (
            r
        ) in runs:  # what earlier syncs to this target established, so children find their parents
            known = self._synced_to(r) or r.data.tags.get(SYNC_SERVER_RUN)
            if known:
                self.server_id[r.info.run_id] = known
        return _ordered(runs)

    def _tag_of(self, run: Run) -> str:
        return target_tag(self.target_uri, self.experiments[run.info.experiment_id])

    def _synced_to(self, run: Run) -> str | None:
        """The server run id this run was synced to on this target, if it has not changed since."""
        value = run.data.tags.get(self._tag_of(run), "")
        server_id, _, end_time = value.partition(" ")
        if (
            server_id
            and run.info.status in TERMINAL
            and end_time.split(" ")[0] == str(run.info.end_time)
        ):
            return server_id
        return None

    def _mark_synced(self, run: Run, server_id: str) -> None:
        value = f"{server_id} {run.info.end_time} {normalise_target(self.target_uri)}"
        self.src.set_tag(run.info.run_id, self._tag_of(run), value[:5000])
        if normalise_target(self.target_uri) == normalise_target(uris.tracking_uri()):
            # Training reads this as "on the tracking server too": only a sync to that server says so.
            self.src.set_tag(run.info.run_id, SYNC_SYNCED, server_id)

    def plan(self) -> list[tuple[Run, str]]:
        """``(local run, what a sync would do with it)`` for every local run; changes nothing."""
        out = []
        for run in self._local_runs():
            exp_name = self.experiments[run.info.experiment_id]
            done = self._synced_to(run)
            if done and not self.recheck:
                out.append((run, f"already synced (server run {done})"))
                continue
            exp = self.dst.get_experiment_by_name(exp_name) if self._target_exists() else None
            mirror = run.data.tags.get(SYNC_SERVER_RUN)
            if mirror and exp and self._exists(mirror):
                out.append((run, f"merge into server run {mirror}"))
                continue
            found = exp and self.dst.search_runs(
                [exp.experiment_id],
                f"tags.`{SYNC_SOURCE_RUN}` = '{run.info.run_id}'",
                ViewType.ALL,
                1,
            )
            out.append(
                (
                    run,
                    f"merge into server run {found[0].info.run_id}"
                    if found
                    else f"new run{'' if exp else ' in a new experiment'}",
                )
            )
        return out

    def _target_exists(self) -> bool:
        """False for a SQLite file not created yet (asking MLflow would create it)."""
        uri = self.target_uri
        return not uri.startswith("sqlite:///") or Path(uri.removeprefix("sqlite:///")).exists()

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.dst.get_run(run_id)
            return True
        except MlflowException as err:
            if err.get_http_status_code() == 404 or err.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise

    def run(self) -> SyncReport:
        runs, copied = self._local_runs(), []
        for run in runs:
            name = run.data.tags.get(schema.RUN_NAME, run.info.run_id)
            if self._synced_to(run) and not self.recheck:
                self.report.runs_skipped += 1
                continue
            try:
                self._sync_run(run)
                copied.append(run)
            except Exception as err:
                if health.is_unreachable(err) or health.is_auth_failure(
                    err
                ):  # nothing more gets through: stop
                    raise
                self.report.errors.append(
                    f"{name} ({run.info.run_id}): {uris.redact_uri(str(err))[:500]}"
                )
        self._recount_parents(copied)
        return self.report

    def _recount_parents(self, copied: list[Run]) -> None:
        """The study parents of the runs copied now: counts and status from their children on the target.

        A parent's counts in the fallback store saw only the cells logged there (an outage
        hides the server's); and a parent goes before its children, so its copy cannot know.
        """
        from tracking.record.executions import recount_parent

        parents = set()
        for run in copied:
            local = (
                run.info.run_id
                if run.data.tags.get(schema.PARENT) == schema.TRUE
                else run.data.tags.get(schema.PARENT_RUN_ID)
            )
            if local:
                parents.add(self.server_id.get(local, local))
        for server_id in sorted(parents):
            try:
                if self._exists(server_id):
                    recount_parent(self.dst, server_id, log=self.log)
            except Exception as err:
                if health.is_unreachable(err) or health.is_auth_failure(err):
                    raise
                self.report.errors.append(
                    f"recount of parent {server_id}: {uris.redact_uri(str(err))[:500]}"
                )

    # ------------------------------------------------------------ one run

    def _sync_run(self, run: Run) -> None:
        local_id, tags = run.info.run_id, run.data.tags
        target, created = self._target(run)
        if target is None:
            return
        self.server_id[local_id] = target
        before = (
            self.report.metric_points,
            self.report.params,
            self.report.artifacts,
            self.report.models,
        )
        self._params(run, target, created)
        self._tags(run, target)
        self._metrics(run, target, created)
        self._inputs(run, target, created)
        self._artifacts(run, target, created)
        self._models(run, target)
        self._checkpoint_pointer(run, target)
        changed = before != (
            self.report.metric_points,
            self.report.params,
            self.report.artifacts,
            self.report.models,
        )
        if run.info.status in TERMINAL:
            server = self.dst.get_run(target).info
            if server.status != run.info.status or server.end_time != run.info.end_time:
                self.dst.set_terminated(target, run.info.status, end_time=run.info.end_time)
                changed = True
            self._mark_synced(run, target)
        else:
            self.report.runs_pending += 1
        if created:
            self.report.runs_created += 1
        elif changed:
            self.report.runs_updated += 1
        else:
            self.report.runs_unchanged += 1
        self.log(
            f"{tags.get(schema.RUN_NAME, local_id)}: local {local_id} -> server {target} "
            f"({'new' if created else 'merged'}, {run.info.status})"
        )

    def _target(self, run: Run) -> tuple[str | None, bool]:
        """(server run id, whether it was created now); (None, False) for a duplicate not to copy."""
        tags = run.data.tags
        # A mirror continues a run of the server it was made for; another target gets a copy.
        if tags.get(SYNC_SERVER_RUN) and self._exists(tags[SYNC_SERVER_RUN]):
            return tags[SYNC_SERVER_RUN], False
        exp_id = offline_store.ensure_experiment(self.dst, self.experiments[run.info.experiment_id])
        found = self.dst.search_runs(
            [exp_id], f"tags.`{SYNC_SOURCE_RUN}` = '{run.info.run_id}'", ViewType.ALL, 1
        )
        if found:
            return found[0].info.run_id, False
        key = tags.get(schema.RUN_KEY)
        if key and run.info.status == schema.FINISHED:
            twins = self.dst.search_runs(
                [exp_id],
                schema.all_of(
                    schema.tag_is(schema.RUN_KEY, key), schema.status_is(schema.FINISHED)
                ),
                max_results=1,
            )
            if twins:
                self.log(
                    f"{tags.get(schema.RUN_NAME)}: the server already has a finished run of this cell "
                    f"({twins[0].info.run_id}); not copied"
                )
                self._mark_synced(run, twins[0].info.run_id)
                self.report.duplicates += 1
                return None, False
        new_tags = {k: v for k, v in tags.items() if not is_sync_tag(k)}
        new_tags[SYNC_SOURCE_RUN] = run.info.run_id
        if tags.get(schema.PARENT_RUN_ID):
            new_tags[schema.PARENT_RUN_ID] = self.server_id.get(
                tags[schema.PARENT_RUN_ID], tags[schema.PARENT_RUN_ID]
            )
        created = self.dst.create_run(exp_id, start_time=run.info.start_time, tags=new_tags)
        return created.info.run_id, True

    def _params(self, run: Run, target: str, created: bool) -> None:
        have = {} if created else self.dst.get_run(target).data.params
        new = [Param(k, v) for k, v in run.data.params.items() if k not in have]
        clash = [k for k, v in run.data.params.items() if k in have and have[k] != v]
        if clash:  # MLflow params are immutable: report, never overwrite
            self.report.errors.append(
                f"{run.info.run_id}: params differ on the server: {', '.join(clash)}"
            )
        log_batch(self.dst, target, params=new)
        self.report.params += len(new)

    def _tags(self, run: Run, target: str) -> None:
        # checkpoint.uri is a place in the local store: ``_checkpoint_pointer`` writes the server's
        tags = [
            RunTag(k, v)
            for k, v in run.data.tags.items()
            if not is_sync_tag(k) and k != schema.CHECKPOINT_URI
        ]
        parent = run.data.tags.get(schema.PARENT_RUN_ID)
        if parent:
            tags.append(RunTag(schema.PARENT_RUN_ID, self.server_id.get(parent, parent)))
        log_batch(self.dst, target, tags=tags)

    def _checkpoint_pointer(self, run: Run, target: str) -> None:
        """A cell's ``checkpoint.uri`` pointed into the server run's store (the same artifact path);
        a finished cell's ``resume/`` folders on the server (uploaded before the outage) deleted,
        as the worker does when the server is there at the end
        (``tracking.kinds.checkpoint_artifacts.settle_finished``)."""
        local_uri = run.data.tags.get(schema.CHECKPOINT_URI)
        if local_uri is None:
            return
        if run.info.status == "FINISHED":
            from tracking.kinds.checkpoint_artifacts import settle_finished

            where = settle_finished(self.dst, target)
        else:
            prefix = run.info.artifact_uri.rstrip("/")
            if not local_uri.startswith(prefix):
                return  # not a place in this run's store (a run continued from another): left out
            where = (
                self.dst.get_run(target).info.artifact_uri.rstrip("/") + local_uri[len(prefix) :]
            )
        log_batch(self.dst, target, tags=[RunTag(schema.CHECKPOINT_URI, where)])

    def _metrics(self, run: Run, target: str, created: bool) -> None:
        for key in run.data.metrics:
            have = (
                set() if created else {_point(m) for m in self.dst.get_metric_history(target, key)}
            )
            missing = {}
            for m in self.src.get_metric_history(run.info.run_id, key):
                if _point(m) not in have:
                    # no local model ids
                    missing[_point(m)] = Metric(m.key, m.value, m.timestamp, m.step)
            log_batch(self.dst, target, metrics=list(missing.values()))
            self.report.metric_points += len(missing)

    def _inputs(self, run: Run, target: str, created: bool) -> None:
        def ident(d):
            return d.dataset.name, d.dataset.digest, tuple(sorted((t.key, t.value) for t in d.tags))

        local = list(run.inputs.dataset_inputs) if run.inputs else []
        server = self.dst.get_run(target).inputs if local and not created else None
        have = {ident(d) for d in (server.dataset_inputs if server else [])}
        missing = [d for d in local if ident(d) not in have]
        if missing:
            self.dst.log_inputs(target, datasets=missing)

    def _artifacts(self, run: Run, target: str, created: bool) -> None:
        have = {} if created else _files(self.dst, target)
        with tempfile.TemporaryDirectory() as tmp:
            for path, size in sorted(_files(self.src, run.info.run_id).items()):
                if have.get(path) == size:
                    continue
                local = self.src.download_artifacts(run.info.run_id, path, tmp)
                folder = str(Path(path).parent) if "/" in path else None
                health.with_retries(
                    lambda local=local, folder=folder: self.dst.log_artifact(target, local, folder),
                    f"upload {path}",
                    attempts=5,
                )
                Path(local).unlink()
                self.report.artifacts += 1

    def _models(self, run: Run, target: str) -> None:
        local_models = self.src.search_logged_models(
            [run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'"
        )
        if not local_models:
            return
        exp_id = self.dst.get_run(target).info.experiment_id
        copies = {
            m.tags.get(SYNC_SOURCE_MODEL): m
            for m in self.dst.search_logged_models(
                [exp_id], filter_string=f"source_run_id = '{target}'"
            )
        }
        for model in local_models:
            if model.status != "READY":
                continue  # a model whose upload failed locally too
            copy = copies.get(model.model_id)
            if copy is not None and copy.status == "READY":
                continue
            if copy is None:
                copy = self.dst.create_logged_model(
                    exp_id,
                    name=model.name,
                    source_run_id=target,
                    tags={**model.tags, SYNC_SOURCE_MODEL: model.model_id},
                    params=model.params,
                    model_type=model.model_type,
                )
            self._upload_model(model, copy.model_id, target)
            self.dst.finalize_logged_model(copy.model_id, "READY")
            self.dst.log_outputs(target, [LoggedModelOutput(copy.model_id, step=0)])
            self.report.models += 1

    def _upload_model(self, model, new_id: str, target: str) -> None:
        import yaml

        with tempfile.TemporaryDirectory() as tmp:
            local = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=model.artifact_location, dst_path=tmp, tracking_uri=self.source_uri
                )
            )
            mlmodel = local / "MLmodel"
            if (
                mlmodel.exists()
            ):  # the model's own record of where it lives must name the server copy
                meta = yaml.safe_load(mlmodel.read_text())
                meta.update(run_id=target, model_id=new_id, model_uuid=new_id)
                mlmodel.write_text(yaml.safe_dump(meta, sort_keys=False))
            health.with_retries(
                lambda: self.dst.log_model_artifacts(new_id, str(local)),
                f"upload model {model.name}",
                attempts=5,
            )


def sync(source_uri: str, target_uri: str, recheck: bool = False, log=print) -> SyncReport:
    """Copy every run of ``source_uri`` onto ``target_uri`` (see the module docstring)."""
    uris.apply_http_defaults()
    # one line per run is enough
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return Syncer(source_uri, target_uri, recheck, log).run()


def plan(source_uri: str, target_uri: str, recheck: bool = False) -> list[str]:
    """One line per local run: where a sync would put it and how (nothing is changed)."""
    uris.apply_http_defaults()
    syncer = Syncer(source_uri, target_uri, recheck)
    where = normalise_target(target_uri)
    return [
        f"{run.data.tags.get(schema.RUN_NAME, run.info.run_id)} (local {run.info.run_id}, {run.info.status}) -> "
        f"{where} experiment {syncer.experiments[run.info.experiment_id]!r}: {action}"
        for run, action in syncer.plan()
    ]
