"""MLflow records of protocol executions: frozen hashes, parent runs, finished cells."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tracking.record import create_once, report_summary, study_record
from tracking.record.executions import (
    EXPECTED_TAG,
    children,
    close_dead_records,
    counts_of,
    end_time_for,
    execution_step,
    iso,
    new_record,
    study_status,
    write_record,
)
from tracking.record.lease import (
    HEARTBEATS,
    TOKEN_TAG,
    execution_states,
    execution_tag,
    execution_value,
    lease_state,
    lease_tags,
    new_token,
    reap_expired,
)
from tracking.record.schema import (
    ALLOW_DIRTY,
    FINISHED,
    PARENT,
    PROTOCOL_HASH,
    PROTOCOL_NAME,
    RUN_NAME,
    STARTED_TAG,
    STUDY_KEY,
    TRUE,
    USER,
    all_of,
    cell_filter,
    flag,
    parent_filter,
    tag_is,
)
from tracking.record.sink import SYNC_SYNCED, RunSink
from tracking.store import ui_links
from tracking.store.health import TrackingAuthError, is_permission_denied, is_unreachable
from tracking.store.offline_store import (
    ensure_experiment,
    fallback_client,
    fallback_exists,
    fallback_run_exists,
    fallback_uri,
)
from tracking.store.session import configure_tracking, git_state, run_user
from tracking.store.store_lock import store_lock
from tracking.store.uris import is_remote, redact_uri, tracking_uri
from workbench.code_history import older_names
from workbench.train.fingerprint import current_code_fingerprint


class ProtocolRecordError(RuntimeError):
    """The protocol's runs are spread over several experiments: which record is frozen is ambiguous."""


def experiment_id_for(protocol_name: str, record_run: str | None = None) -> str:
    """Each protocol has one experiment holding all its runs, created under the protocol's name.

    It is found by the ``protocol_name`` tag of the runs it holds in this account's experiments
    (``tracking.record.study_record``), not by its name: an experiment renamed in the UI keeps
    the protocol's frozen record, and one of the protocol's name that another account holds is
    never used (the record is created as ``protocol@account`` instead, said in one line).
    ``record_run``: the parent run a cell queue names; its experiment is the study's record
    (a worker with an EDIT grant works in the owner's experiment).
    """
    configure_tracking()
    client = MlflowClient()
    if record_run:
        try:
            return client.get_run(record_run).info.experiment_id
        except MlflowException as err:
            # Not in this store (the local fallback while the server is away): found by name there.
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
    record = study_record.find_record(client, protocol_name)
    holding = record.experiments
    if len(holding) > 1:
        names = ", ".join(f"{n!r} (id {i})" for i, n in sorted(holding.items()))
        raise ProtocolRecordError(
            f"runs of protocol {protocol_name!r} are in {len(holding)} experiments: {names}; "
            "move them into one (or delete the stray experiment) before running it again"
        )
    if holding:
        if record.squatted:
            study_record.tell(study_record.squat_line(client, record))
        return next(iter(holding))
    try:
        name = study_record.own_name(client, record)
    except PermissionError as err:
        raise ProtocolRecordError(str(err)) from None
    if record.squatted:
        study_record.tell(study_record.squat_line(client, record, name))
    return ensure_experiment(client, name)


def _experiments_holding(client: MlflowClient, protocol_name: str) -> dict[str, str]:
    """``{experiment id: name}`` of this account's experiments holding a parent run of this protocol."""
    return study_record.find_record(client, protocol_name).experiments


def recorded_hashes(protocol_name: str) -> set[str]:
    """Every protocol hash this protocol name has been run with."""
    runs = MlflowClient().search_runs(
        [experiment_id_for(protocol_name)],
        filter_string=tag_is(PROTOCOL_NAME, protocol_name),
        max_results=5000,
    )
    return {r.data.tags.get(PROTOCOL_HASH, "") for r in runs} - {""}


# STARTED_TAG is set on a cell run when its work begins (model built, data checked, first
# step next). A protocol name is frozen by its first cell that started: not by a parent, or
# cells, that failed before any training (a misfit found late, a crash while opening).


def cell_started(run: Run) -> bool:
    """Whether a cell run started its work: finished, tagged ``STARTED_TAG``, or (older records) logged a metric."""
    return (
        run.info.status == FINISHED
        or run.data.tags.get(STARTED_TAG) == TRUE
        or bool(run.data.metrics)
    )


def frozen_hashes(protocol_name: str) -> set[str]:
    """The hashes that froze this protocol name: those with a cell that started training (``cell_started``).

    Only reads: the check runs before the kind's own checks (a transfer source's sha256 pin, the
    data), so creating the protocol's experiment here left an empty one behind every refusal.
    """
    client = MlflowClient()
    ids = list(_experiments_holding(client, protocol_name))
    if not ids:
        return set()
    runs = client.search_runs(
        ids, filter_string=cell_filter(protocol_name=protocol_name), max_results=50000
    )
    return {r.data.tags.get(PROTOCOL_HASH, "") for r in runs if cell_started(r)} - {""}


def cell_runs(protocol_name: str, protocol_hash: str, *, reader: bool = False) -> list[Run]:
    """All cell runs (children) recorded for this protocol hash, any status.

    ``reader``: only look (``workbench status``): no experiment is created and the store
    may be read-only, so it is not configured for writing first.
    """
    client = MlflowClient()
    ids = (
        list(_experiments_holding(client, protocol_name))
        if reader
        else [experiment_id_for(protocol_name)]
    )
    if not ids:
        return []
    return client.search_runs(
        ids,
        filter_string=cell_filter(protocol_hash),
        max_results=50000,
    )


def study_key(protocol, fingerprint: str | None = None) -> str:
    """One study = one protocol hash run by one code fingerprint (``fingerprint``, else this
    checkout's training fingerprint): its one parent run's key."""
    code = fingerprint or current_code_fingerprint()
    return hashlib.sha256(f"{protocol.hash}|{code}".encode()).hexdigest()[:24]


def study_keys(protocol) -> list[str]:
    """The study's key, then its keys under older fingerprints of the same code (``workbench.code_history``):
    a parent made before the fingerprint's computation moved is still the study's parent."""
    current = current_code_fingerprint()
    return [study_key(protocol, code) for code in (current, *older_names(current))]


@dataclass(frozen=True)
class RecordedProtocol:
    """What the study record needs of a protocol of any kind, read from it once, when its
    parent run is opened: the record's code is handed this, never the protocol again."""

    name: str
    hash: str
    short_hash: str
    description: str
    canonical_json: str
    cells: int
    arms: tuple[str, ...]  # ablation arms, transfer regimes
    seeds: tuple
    dataset: str

    @classmethod
    def of(cls, protocol) -> RecordedProtocol:
        arms = getattr(protocol, "arms", None) or getattr(protocol, "regimes", ())
        seeds = tuple(getattr(protocol, "seeds", ()))
        cells = getattr(protocol, "cells", None)
        return cls(
            name=protocol.name,
            hash=protocol.hash,
            short_hash=protocol.short_hash,
            description=protocol.description,
            canonical_json=protocol.canonical_json(),
            cells=len(cells()) if callable(cells) else len(arms) * len(seeds),
            arms=tuple(getattr(a, "name", str(a)) for a in arms),
            seeds=seeds,
            dataset=getattr(getattr(protocol, "dataset", None), "name", "?"),
        )


def parent_note(study: RecordedProtocol, report_hint: str) -> str:
    """The parent's description in the MLflow UI: what the study is, its configuration, its report."""
    rows = [
        ("protocol", f"`{study.name}` @ `{study.short_hash}`"),
        ("dataset", study.dataset),
        ("arms", ", ".join(study.arms)),
        ("seeds", ", ".join(map(str, study.seeds))),
        ("cells", str(study.cells)),
        ("code fingerprint", f"`{current_code_fingerprint()}`"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (
        f"{study.description.strip()}\n\n| | |\n|---|---|\n{table}\n\n"
        f"Cells are this run's children (group the runs list by `arm`). Report: {report_hint}"
    )


def reap_dead_runs(
    protocol_name: str, protocol_hash: str | None = None, log=None
) -> list[tuple[str, str]]:
    """Mark this protocol's RUNNING runs whose lease expired as KILLED (reads only an existing experiment)."""
    client = MlflowClient()
    where = (
        tag_is(PROTOCOL_HASH, protocol_hash)
        if protocol_hash
        else tag_is(PROTOCOL_NAME, protocol_name)
    )
    return [
        reaped
        for exp_id in _study_experiments(client, protocol_name)
        for reaped in reap_expired(client, exp_id, where, log=log)
    ]


def _study_experiments(client: MlflowClient, protocol_name: str) -> list[str]:
    """The experiments a reader looks in: those ``experiment_id_for`` would find (renamed ones
    included, by their runs' tags; another account's never), else this account's experiment of
    the protocol's name; none is created."""
    holding = study_record.record_ids(protocol_name, client)
    if holding:
        return holding
    named = client.get_experiment_by_name(protocol_name)
    mine = named is not None and study_record.owns(client, named.experiment_id)
    return [named.experiment_id] if mine else []


@dataclass
class StudyParent:
    """The one parent run of a study, held by this execution until ``close_study_parent``."""

    run_id: str
    sink: RunSink
    experiment: str
    expected_cells: int
    execution_token: str = ""
    execution: dict = field(default_factory=dict)
    previous_end: int | None = None  # the parent's end time before this execution reopened it (ms)
    started_ms: int = 0
    status: str | None = None  # set by ``close_study_parent``
    # What this execution did with cells itself, when it is a worker (``tracking.record.executions.work_line``):
    # filled while it works, so a record closed by Ctrl-C says how far it got too.
    work: dict | None = None


def open_study_parent(
    protocol,
    protocol_file: Path,
    allow_dirty: bool,
    extra_tags: dict | None = None,
    log=print,
    record_run: str | None = None,
) -> StudyParent:
    """Find the study's parent run (protocol hash + code fingerprint) or create it, and hold it.

    Dead executions' runs of this protocol hash are marked KILLED first and their records
    closed. A parent left half-made by a killed execution gets its protocol files now. On a
    local store, executions starting together take turns (``store_lock``); on a server, two
    executions creating the parent at once keep the first one (``tracking.record.create_once``).
    ``record_run``: the parent run a cell queue names (``experiment_id_for``).
    """
    study = RecordedProtocol.of(protocol)
    exp_id = experiment_id_for(study.name, record_run)
    client, key = MlflowClient(), study_key(study)
    tags = {
        RUN_NAME: f"{study.name}@{study.short_hash}",
        PROTOCOL_NAME: study.name,
        PROTOCOL_HASH: study.hash,
        STUDY_KEY: key,
        "code_fingerprint": current_code_fingerprint(),
        "protocol_file": str(protocol_file),
        ALLOW_DIRTY: flag(allow_dirty),
        PARENT: TRUE,
        USER: run_user(),
        EXPECTED_TAG: str(study.cells),
        "mlflow.note.content": parent_note(
            study,
            f"`workbench report --protocol {study.name}` logs it to "
            "this run's artifacts (report/report.html)",
        ),
        **git_state(),
        **(extra_tags or {}),
    }
    launcher = os.environ.get("MLFLOW_RUN_ID")
    if launcher:
        tags["launcher_run_id"] = launcher  # the run `mlflow run` created around this execution
    own, started_ms = new_token(), int(time.time() * 1000)  # this execution's own lease token
    with store_lock(configure_tracking()):
        try:
            reap_expired(client, exp_id, tag_is(PROTOCOL_HASH, study.hash), log=log)
            sink, token, previous_end = _find_or_create_parent(
                client, exp_id, study, tags, own, log
            )
        except MlflowException as err:
            if is_permission_denied(err):
                raise no_edit_grant(client, exp_id) from None
            raise
        try:
            HEARTBEATS.hold(sink.run_id, sink.uri, token, execution_tag(own))
            _log_protocol_files(sink, study, protocol_file)
            parent = StudyParent(
                sink.run_id,
                sink,
                study.name,
                study.cells,
                own,
                new_record(own, tags["git_commit"]),
                previous_end,
                started_ms,
            )
            write_record(sink, parent.execution)
        except BaseException:
            _let_go(sink, own)
            raise
    url = None if sink.offline else ui_links.experiment_url(sink.uri, exp_id)
    if url:
        log(f"MLflow UI (runs of this study): {url}")
    if launcher and not sink.offline:
        try:
            MlflowClient().set_tag(launcher, "protocol_parent_run_id", sink.run_id)
        except Exception as err:  # a cross-reference only: never worth stopping the study for
            if not is_unreachable(err):
                raise
    return parent


def no_edit_grant(client: MlflowClient, exp_id: str) -> TrackingAuthError:
    """The error for HTTP 403 on a study's runs: this account may read the experiment, not write to it.

    It never advises granting oneself access: an experiment of the protocol's name can be made
    by any account before its owner runs it, and a study put there is the stranger's to manage.
    """
    name, account = client.get_experiment(exp_id).name, run_user()
    return TrackingAuthError(
        f"MLflow tracking server {redact_uri(tracking_uri())} does not let account {account!r} write to experiment "
        f"{name!r} (id {exp_id}), which another account created (HTTP 403). If it is your team's study, the "
        "account that created it has it shared with you (docs/server.md, section 2); otherwise give your "
        "protocol another name: an experiment another account holds is not yours to use"
    )


def _find_or_create_parent(
    client: MlflowClient, exp_id: str, study: RecordedProtocol, tags: dict, own: str, log
) -> tuple[RunSink, str, int | None]:
    """(the parent's sink, the lease token this execution renews, the parent's earlier end time)."""
    keys, uri, token = study_keys(study), configure_tracking(), new_token()
    found = _parents(client, exp_id, keys)
    offline_parent = _unsynced_fallback_parent(study.name, keys) if uri != fallback_uri() else None
    if offline_parent is not None:
        # Made while the server was away and not synced yet: the study goes on in that one
        # parent (and its cells where they are), one timeline that `workbench sync` merges,
        # instead of a second parent on the server.
        found, uri = [offline_parent], fallback_uri()
        log(
            f"study {study.name}@{study.short_hash}: its parent run {offline_parent.info.run_id} is in the local "
            f"fallback store (logged while the server was away): continuing there; `workbench sync` copies it"
        )
    if not found:
        sink = RunSink.create(
            study.name,
            {**tags, **lease_tags(token), execution_tag(own): execution_value()},
            uri=uri,
            experiment_id=exp_id,
        )
        first = (
            None
            if sink.offline
            else create_once.resolve_new(
                client, sink.run_id, lambda: _parents(client, exp_id, keys)
            )
        )
        if first is None or first.info.run_id == sink.run_id:
            log(f"study {study.name}@{study.short_hash}: parent run {sink.run_id} created")
            return sink, token, None
        # Another execution made it at the same moment and it sorts first (``tracking.record.create_once``):
        # this one is withdrawn (no lease tag left, KILLED, deleted) and the first is shared.
        create_once.withdraw(
            client,
            sink.run_id,
            first.info.run_id,
            "another execution created this study's parent at the same moment",
        )
        found = [first]
    run = found[0]
    shared = run.info.status == "RUNNING" and lease_state(run).alive and TOKEN_TAG in run.data.tags
    previous_end = None if run.info.status == "RUNNING" else run.info.end_time
    sink = RunSink.attach(run, uri, study.name)
    close_dead_records(sink, run)
    # Executions alive at once share the parent's lease: each renews a tag of its own
    # (``execution_tag``) and the parent is alive while any of them is.
    token = run.data.tags[TOKEN_TAG] if shared else token
    # Its name and its creator (mlflow.user, the UI's "Created by") stay those of the execution
    # that made it: a worker of another account reattaching it is not its owner.
    # The last report's results stay at the top of its description (tracking/record/report_summary.py).
    note = {
        "mlflow.note.content": report_summary.kept_results(
            run.data.tags.get("mlflow.note.content", ""), tags["mlflow.note.content"]
        )
    }
    sink.set_tags(
        {
            **{k: v for k, v in tags.items() if k not in (RUN_NAME, USER)},
            **note,
            **({} if shared else lease_tags(token)),
            execution_tag(own): execution_value(),
        }
    )
    if (
        not shared and not sink.offline
    ):  # another execution may reopen it at this moment with its own token
        token = create_once.shared_token(client, run.info.run_id, token)
    log(f"study {study.name}@{study.short_hash}: parent run {run.info.run_id} reattached")
    return sink, token, previous_end


def _let_go(sink: RunSink, own: str) -> None:
    """An execution that fails while opening the parent stops renewing it and removes its own tag."""
    HEARTBEATS.release(sink.run_id)
    with contextlib.suppress(Exception):
        MlflowClient(fallback_uri() if sink.mirror_id else sink.uri).delete_tag(
            sink.local_run_id, execution_tag(own)
        )


def start_parent_run(
    protocol,
    protocol_file: Path,
    allow_dirty: bool,
    extra_tags: dict | None = None,
    log=lambda _: None,
) -> str:
    """The study's parent run id (held by this execution); see ``open_study_parent``."""
    return open_study_parent(protocol, protocol_file, allow_dirty, extra_tags, log=log).run_id


def experiment_exists(protocol_name: str) -> bool:
    """Whether the protocol has an experiment: of its name, or renamed and found by its runs' tags."""
    return bool(_study_experiments(MlflowClient(), protocol_name))


def recorded_protocol_files(protocol_name: str) -> list[str]:
    """The ``protocol_file`` its parent runs record (as each execution was given it), newest first."""
    client = MlflowClient()
    runs = [
        r
        for i in _study_experiments(client, protocol_name)
        for r in client.search_runs([i], parent_filter(protocol_name), max_results=1000)
    ]
    runs.sort(key=lambda r: r.info.start_time or 0, reverse=True)
    files = (r.data.tags.get("protocol_file", "") for r in runs)
    return list(dict.fromkeys(f for f in files if f))


def study_runs(protocol) -> list[Run]:
    """The parent run(s) of this study (normally one), oldest first; none when never run.

    Found as ``ablate`` finds them: in the experiment holding the protocol's runs, renamed or not.
    """
    client = MlflowClient()
    keys = study_keys(protocol)
    return [r for i in _study_experiments(client, protocol.name) for r in _parents(client, i, keys)]


def _unsynced_fallback_parent(experiment: str, keys: list[str]) -> Run | None:
    """The study's parent in the local fallback store when it is not on the server yet (not synced)."""
    if not (is_remote(tracking_uri()) and fallback_exists()):
        return None
    local = fallback_client()
    exp = local.get_experiment_by_name(experiment)
    found = (
        [r for r in _parents(local, exp.experiment_id, keys) if SYNC_SYNCED not in r.data.tags]
        if exp
        else []
    )
    return found[0] if found else None


def _parents(client: MlflowClient, exp_id: str, keys: list[str]) -> list[Run]:
    return create_once.ordered(
        [
            run
            for key in keys
            for run in client.search_runs(
                [exp_id],
                filter_string=all_of(tag_is(STUDY_KEY, key), tag_is(PARENT, TRUE)),
                max_results=100,
            )
        ]
    )


def _log_protocol_files(sink: RunSink, study: RecordedProtocol, protocol_file: Path) -> None:
    """The protocol as run (file and canonical JSON); a parent reattached after a kill may lack them."""
    with contextlib.suppress(Exception):
        have = {
            a.path for a in MlflowClient(sink.uri).list_artifacts(sink.local_run_id, "protocol")
        }
        if {"protocol/canonical.json", f"protocol/{Path(protocol_file).name}"} <= have:
            return
    sink.log_artifact(protocol_file, artifact_path="protocol")
    with tempfile.TemporaryDirectory() as tmp:
        canonical = Path(tmp) / "canonical.json"
        canonical.write_text(study.canonical_json)
        sink.log_artifact(canonical, artifact_path="protocol")
    sink.log_params({"protocol_description": study.description[:500]})


def _fallback_children(parent: StudyParent) -> list[Run]:
    with contextlib.suppress(Exception):
        if fallback_exists():
            local = fallback_client()
            exp = local.get_experiment_by_name(parent.experiment)
            return children(local, parent.run_id, exp.experiment_id) if exp else []
    return []


def close_study_parent(parent: StudyParent, outcome: str, why: str = "") -> str:
    """Release the parent with a truthful status (``tracking.record.executions.study_status``); returns it.

    ``outcome``: "completed" (the execution went through every cell), "interrupted"
    (Ctrl-C, SIGTERM), "failed" (an error outside the cells), "queued" (cells handed to
    workers) or "worker" (a worker took cells from the queue; ``parent.work`` says which).
    While another execution still holds the parent or cells of this study, it
    stays RUNNING. With the server away, only the children in the local fallback store can
    be counted: cells not seen there are not called missing (``workbench sync`` recounts).
    """
    HEARTBEATS.release(parent.run_id)
    sink = parent.sink
    if parent.execution_token:  # this execution no longer keeps the parent alive
        with contextlib.suppress(Exception):
            store = fallback_uri() if sink.mirror_id else sink.uri
            MlflowClient(store).delete_tag(sink.local_run_id, execution_tag(parent.execution_token))
    runs, others, partial = [], False, False
    try:
        client = MlflowClient(sink.uri)
        exp_id = client.get_run(parent.run_id).info.experiment_id
        reap_expired(client, exp_id, f"tags.mlflow.parentRunId = '{parent.run_id}'")
        runs = children(client, parent.run_id, exp_id)
        others = any(
            state.alive for state, _ in execution_states(client.get_run(parent.run_id)).values()
        )
    except Exception:  # noqa: BLE001 - the server went away: the children logged locally meanwhile are all we see
        partial = True
    if (
        sink.uri != fallback_uri()
    ):  # cells continued locally during an outage count too (one per run key)
        runs += _fallback_children(parent)
    counts = counts_of(runs, parent.expected_cells)
    if not partial or not counts["missing"]:  # a partial count that found every cell is complete
        sink.log_metrics({f"cells_{k}": v for k, v in counts.items()}, step=_execution_step(parent))
    status = study_status(outcome, {**counts, "missing": 0} if partial else counts, others)
    parent.status = status
    if parent.work is not None:  # the worker's own tally, beside the study's counts
        parent.execution["work"] = dict(parent.work)
    parent.execution.update(
        end=iso(),
        outcome=outcome + (f": {why}" if why else ""),
        cells=counts,
        status=status,
        **({"counted": "local fallback store only (server unreachable)"} if partial else {}),
    )
    write_record(sink, parent.execution)
    if status == "RUNNING":  # other executions are still at work on its cells; the last one ends it
        return status
    sink.set_tags({"last_execution_outcome": parent.execution["outcome"][:500]})
    sink.end(
        status,
        end_time=end_time_for(parent.previous_end, parent.started_ms, runs)
        if not partial
        else None,
    )
    return status


def _execution_step(parent: StudyParent) -> int:
    with contextlib.suppress(Exception):
        return execution_step(
            MlflowClient(parent.sink.uri), parent.sink.local_run_id, parent.execution
        )
    return 0


def end_parent_run(run_id: str, counts: dict[str, int], experiment: str | None = None) -> None:
    """Cell counts and the final status; a server gone meanwhile gets them through a local mirror."""
    HEARTBEATS.release(run_id)
    sink = RunSink.for_run(run_id, experiment)
    sink.log_metrics({f"cells_{status}": n for status, n in counts.items()})
    sink.end("FAILED" if counts.get("failed") else "FINISHED")


def parent_status(run_id: str) -> str | None:
    """The parent's status in its store, or None when the server cannot be asked now."""
    uri = fallback_uri() if fallback_run_exists(run_id) else tracking_uri()
    try:
        return MlflowClient(uri).get_run(run_id).info.status
    except Exception as err:
        if is_unreachable(err):
            return None
        raise
