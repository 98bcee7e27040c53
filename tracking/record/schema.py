"""The study record's tag and filter schema: every tag the record writes and searches by, named once.

A run's kind is a marker tag set to ``TRUE`` (``cell``, ``parent``, ``transfer``,
``intervention``, ``sweep_parent``); a cell's identity is ``protocol_name``,
``protocol_hash``, ``arm``, ``seed`` (``cell_tags`` builds them); a run is found again by
``run_key`` (a cell) or ``study_key`` (a parent); a RUNNING run's holder is in the
``lease.*`` tags (``tracking.record.lease``); how a run ended is in ``killed_reason``,
``superseded_by``, ``continues_run`` and ``lease.released``.

MLflow filter strings are built here too (``tag_is``, ``cell_filter``, ``parent_filter``),
with the one quoting rule (``quoted``): MLflow's filter grammar has no escape inside a
string, so a value is written in single quotes, or in double quotes when it holds a single
quote; a value with both cannot be searched for and is refused by name.
"""

from __future__ import annotations

TRUE, FALSE = "true", "false"

# Kind markers (value TRUE).
CELL, PARENT, TRANSFER, INTERVENTION = "cell", "parent", "transfer", "intervention"
# an attribution study's parent and cells (tracking/kinds/attribution_runs.py)
ATTRIBUTION = "attribution"
SWEEP, SWEEP_PARENT, FIGURES = "sweep", "sweep_parent", "figures"

# A cell's identity and what it was made with.
PROTOCOL_NAME, PROTOCOL_HASH, ARM, SEED = "protocol_name", "protocol_hash", "arm", "seed"
IS_REFERENCE, ALLOW_DIRTY = "is_reference", "allow_dirty"
SOURCE_IDENTITY, SOURCE_RUN_ID = "source_identity", "source_run_id"

# An arm's summary run, written by a report (tracking.record.report_summary): the study parent
# it summarises, its arm, the arm its differences are taken against. It is no cell and no
# parent: no lookup of cells or parents matches it.
SUMMARY_OF, SUMMARY_ARM, SUMMARY_REFERENCE = "summary_of", "summary_arm", "reference"

# How a run is found again.
RUN_KEY, STUDY_KEY = "run_key", "study_key"
RUN_NAME, USER, PARENT_RUN_ID = "mlflow.runName", "mlflow.user", "mlflow.parentRunId"

# The lease of a RUNNING run (tracking.record.lease) and how a run ended.
LEASE_PREFIX = "lease."
HOST_TAG, PID_TAG, TOKEN_TAG, HEARTBEAT_TAG = (
    "lease.host",
    "lease.pid",
    "lease.token",
    "lease.heartbeat",
)
LEASE_TAGS = (HOST_TAG, PID_TAG, TOKEN_TAG, HEARTBEAT_TAG)
# A run several executions share (a study's parent): each renews a tag of its own,
# "lease.exec.<token>" = "<host> <pid> <heartbeat time>", and the run is alive while any is.
EXEC_PREFIX = "lease.exec."
# Set to the holder's token when the holder ended the run itself (it will not write again).
RELEASED_TAG = "lease.released"
REASON_TAG = "killed_reason"
SUPERSEDED_TAG, CONTINUES_TAG = "superseded_by", "continues_run"
# On a cell run once its work began (the first epoch, selection or evaluation may follow);
# RESUMED: whether that work continued from a checkpoint.
STARTED_TAG, RESUMED = "work_started", "resumed"
# Where a cell's latest resumable checkpoint is (tracking.kinds.checkpoint_artifacts): the artifact
# URI of its folder, the epochs and steps it holds, and how long its upload took (seconds).
CHECKPOINT_URI, CHECKPOINT_EPOCH, CHECKPOINT_STEP, CHECKPOINT_UPLOAD_SECONDS = (
    "checkpoint.uri",
    "checkpoint.epoch",
    "checkpoint.step",
    "checkpoint.upload_seconds",
)

FINISHED, RUNNING = "FINISHED", "RUNNING"


def flag(value: bool) -> str:
    """A boolean as the record writes it: ``true`` or ``false``."""
    return TRUE if value else FALSE


def quoted(value) -> str:
    """``value`` as a string literal of an MLflow filter (the one quoting rule, see the module)."""
    text = str(value)
    if "'" not in text:
        return f"'{text}'"
    if '"' not in text:
        return f'"{text}"'
    raise ValueError(
        f"tag value {text!r} holds both quote characters: MLflow's filter strings cannot match it"
    )


def tag_is(key: str, value) -> str:
    """``tags.<key> = <value>``, quoted."""
    return f"tags.{key} = {quoted(value)}"


def status_is(status: str) -> str:
    return f"attributes.status = {quoted(status)}"


def all_of(*clauses: str) -> str:
    """The clauses joined with ``and`` (empty ones left out)."""
    return " and ".join(c for c in clauses if c)


def cell_filter(
    protocol_hash: str | None = None,
    *,
    protocol_name: str | None = None,
    arm: str | None = None,
    seed: int | str | None = None,
    status: str | None = None,
    **tags,
) -> str:
    """The cell runs of a protocol hash (or name), optionally of one arm, seed, status or further tags."""
    clauses = [
        tag_is(PROTOCOL_HASH, protocol_hash) if protocol_hash else "",
        tag_is(PROTOCOL_NAME, protocol_name) if protocol_name else "",
        tag_is(ARM, arm) if arm is not None else "",
        tag_is(SEED, seed) if seed is not None else "",
        *(tag_is(k, v) for k, v in tags.items()),
        tag_is(CELL, TRUE),
        status_is(status) if status else "",
    ]
    return all_of(*clauses)


def parent_filter(
    protocol_name: str | None = None, protocol_hash: str | None = None, *, kind: str | None = None
) -> str:
    """The study parents (of a protocol name, a hash, a kind marker such as ``TRANSFER``)."""
    return all_of(
        tag_is(kind, TRUE) if kind else "",
        tag_is(PROTOCOL_NAME, protocol_name) if protocol_name else "",
        tag_is(PARENT, TRUE),
        tag_is(PROTOCOL_HASH, protocol_hash) if protocol_hash else "",
    )


def cell_tags(
    *,
    protocol_name: str,
    protocol_hash: str,
    arm: str,
    seed: int,
    allow_dirty: bool,
    is_reference: bool | None = None,
    kind: str | None = None,
    **more: str,
) -> dict[str, str]:
    """A cell run's identity tags: the marker, the protocol, arm and seed, how it was made.

    ``kind``: a second marker (``TRANSFER``, ``INTERVENTION``); ``more``: tags of that kind
    (``source_identity=...``), written as given.
    """
    tags = {
        CELL: TRUE,
        **({kind: TRUE} if kind else {}),
        PROTOCOL_NAME: protocol_name,
        PROTOCOL_HASH: protocol_hash,
        ARM: arm,
        SEED: str(seed),
    }
    if is_reference is not None:
        tags[IS_REFERENCE] = flag(is_reference)
    return {**tags, **more, ALLOW_DIRTY: flag(allow_dirty)}
