"""Entry point: where a study stands, cell by cell, and what the next `ablate` would do."""

from __future__ import annotations

from pathlib import Path

import click

from studies.runtime.study_protocol import ProtocolError, load_protocol
from tracking.kinds.checkpoint_artifacts import position
from tracking.record.lease import REASON_TAG, lease_state, possible_writer
from tracking.record.protocol_runs import cell_runs, experiment_exists, reap_dead_runs, study_runs
from tracking.record.schema import CHECKPOINT_EPOCH, CHECKPOINT_STEP, CHECKPOINT_URI
from tracking.store.session import configure_tracking
from tracking.store.store_lock import sqlite_path, writable
from tracking.store.ui_links import run_url
from tracking.store.uris import process_uri
from tracking.store.uris import tracking_uri
from workbench.code_history import same_code
from workbench.train.fingerprint import current_code_fingerprint


def cell_state(runs: list, fingerprint: str) -> tuple[str, str]:
    """(state, what the next ablate does) of one cell from its MLflow runs (any code version)."""
    mine = sorted(
        (r for r in runs if same_code(r.data.params.get("code_fingerprint"), fingerprint)),
        key=lambda r: r.info.start_time or 0,
        reverse=True,
    )
    if not mine:
        older = [r for r in runs if r.info.status == "FINISHED"]
        if older:
            return (
                f"missing for this code (finished with code {older[0].data.params.get('code_fingerprint', '?')} "
                f"in run {older[0].info.run_id})",
                "start it",
            )
        return "missing", "start it"
    run = mine[0]
    rid, status = run.info.run_id, run.info.status
    if status == "FINISHED":
        return f"finished (run {rid})", "skip it"
    if status == "RUNNING":
        state = lease_state(run)
        return f"{state.why} (run {rid})", "leave it to that execution"
    why = (
        run.data.tags.get(REASON_TAG)
        or run.data.tags.get("end_reason")
        or run.data.tags.get("failure")
        or ""
    )
    label = "stale, marked KILLED" if run.data.tags.get(REASON_TAG) else status.lower()
    resumable = resumable_from(run)
    if resumable:
        label += f", {resumable}"
    writer = possible_writer(run)
    action = (
        f"continue it in a new run ({writer}: it may still write to run {rid})"
        if writer
        else f"resume it in run {rid}"
    )
    return f"{label} (run {rid}{': ' + why if why else ''})", action


def resumable_from(run) -> str | None:
    """Where an unfinished cell resumes from: the checkpoint its run uploaded (artifact URI, epoch), or
    the one its output folder holds on this machine; None when it has neither (it starts again)."""
    tags = run.data.tags
    if tags.get(CHECKPOINT_URI):
        return (
            f"resumable from epoch {tags.get(CHECKPOINT_EPOCH, '?')} (step {tags.get(CHECKPOINT_STEP, '?')}): "
            f"checkpoint {tags[CHECKPOINT_URI]}"
        )
    last = Path(tags.get("run_dir") or "/nonexistent") / "checkpoints" / "last.pt"
    if not last.is_file():
        return None
    try:
        epoch, step, _ = position(last)
    except Exception:  # noqa: BLE001 - a damaged file is no place to resume from
        return None
    return f"resumable from epoch {epoch} (step {step}): checkpoint {last} (this machine)"


def older_code_notice(protocol, runs: list, fingerprint: str) -> str | None:
    """One line when cells finished here only with other code: the next ablate trains them again.

    The code fingerprint is part of a cell's identity (``studies.ablation.ablate.cell_identity``), so
    after a change to the result library the old runs are kept but no longer count as done.
    """
    done_now = {
        (r.data.tags.get("arm"), r.data.tags.get("seed"))
        for r in runs
        if r.info.status == "FINISHED"
        and same_code(r.data.params.get("code_fingerprint"), fingerprint)
    }
    older: dict[tuple, object] = {}
    for r in runs:
        key = (r.data.tags.get("arm"), r.data.tags.get("seed"))
        if (
            r.info.status == "FINISHED"
            and not same_code(r.data.params.get("code_fingerprint"), fingerprint)
            and key not in done_now
        ):
            older.setdefault(key, r)
    if not older:
        return None
    codes = sorted({r.data.params.get("code_fingerprint", "?") for r in older.values()})
    commits = sorted({(r.data.tags.get("git_commit") or "unknown")[:12] for r in older.values()})
    return (
        f"{protocol.name}: {len(older)} of {len(protocol.cells())} cells finished here with other code "
        f"(code {', '.join(codes)}, commit {', '.join(commits)}), not with this code ({fingerprint}): the next "
        f"ablate trains them again and keeps the old runs; to reproduce the old ones, run ablate from a checkout "
        f"of that commit (git worktree add ../old-code {commits[0]})"
    )


def _never_run(protocol, read_only: bool) -> bool:
    """No parent, no run of the name to mark KILLED (a writable store only), no experiment."""
    if study_runs(protocol):
        return False
    if not read_only and reap_dead_runs(protocol.name):
        return False
    return not experiment_exists(protocol.name)


@click.command("status")
@click.option(
    "--protocol",
    "protocol_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Protocol YAML file.",
)
def status(protocol_path):
    """Each cell's state (finished, running on host/pid, stale, failed, missing) and the next `ablate`'s plan."""
    try:
        protocol = load_protocol(protocol_path)
    except ProtocolError as err:
        raise click.ClickException(str(err)) from err
    uri = tracking_uri()
    if (
        uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists()
    ):  # do not create it
        click.echo(
            f"{protocol.name}@{protocol.short_hash}: never run here (no MLflow store at {uri}); next ablate: "
            f"start all {len(protocol.cells())} cells"
        )
        return
    # A reader: an unreachable server is an error, never an answer from the local fallback store.
    configure_tracking(allow_offline=False)
    fingerprint = current_code_fingerprint()
    store = sqlite_path(uri)
    # a reader needs no lock and marks nothing
    read_only = store is not None and not writable(store)
    if _never_run(protocol, read_only):
        click.echo(
            f"{protocol.name}@{protocol.short_hash}: never run here; next ablate: start all "
            f"{len(protocol.cells())} cells"
        )
        return
    if read_only:  # runs whose lease expired are shown, not marked
        click.echo(
            f"{uri} is read-only here: runs whose holder died are shown as they are recorded (not marked KILLED)"
        )
    else:
        reap_dead_runs(protocol.name, protocol.hash, log=lambda line: click.echo(line))
    runs = cell_runs(protocol.name, protocol.hash, reader=True)
    click.echo(
        f"{protocol.name}@{protocol.short_hash}, code {fingerprint}: {len(protocol.cells())} cells"
    )
    notice = older_code_notice(protocol, runs, fingerprint)
    if notice:
        click.echo(notice)
    for parent in study_runs(protocol):
        url = run_url(process_uri(), parent.info.experiment_id, parent.info.run_id)
        click.echo(
            f"parent run {parent.info.run_id}: {parent.info.status}" + (f" ({url})" if url else "")
        )
    plan: dict[str, int] = {}
    for cell in protocol.cells():
        state, action = cell_state(
            [
                r
                for r in runs
                if (r.data.tags.get("arm"), r.data.tags.get("seed")) == (cell.arm, str(cell.seed))
            ],
            fingerprint,
        )
        plan[action] = plan.get(action, 0) + 1
        click.echo(f"  {cell.key}: {state} -> next ablate: {action}")
    click.echo("next ablate: " + ", ".join(f"{action} x{n}" for action, n in plan.items()))
