"""`ablate --jobs N`: several cells at once on one machine, through the cell queue.

There is no second scheduler here. The coordinator (the `ablate` process) opens the
study's parent, puts the cells without a finished run into a cell queue of its own (an
Optuna journal file under the output folder, one per execution) and starts N local
`workbench worker` processes on it: the same queue, leases, fencing and record rules as
remote workers. It relays their console lines, prefixed with the job, under one overall
progress bar, and closes the parent when they are done. Which cell each job holds and how
each cell ended it reads from the queue's record (the lease naming the worker's process, the
trial's outcome: ``studies.ablation.cell_queue``), never from the workers' console lines,
which it only relays.

Threads: every job runs with a fixed number of torch threads (``--threads``, default 1 per
job), so a cell's numbers do not depend on how many jobs ran the study (the thread count
changes floating-point reduction order; docs/precision.md).

A worker that dies (killed by a signal, the OOM killer, an exit code) while cells are left
is named with how it ended, and a replacement worker starts in its place (at most
``max(2, N)`` in one execution); the dead worker's cell goes back to the queue (its lease
names a process that is gone) and continues from its checkpoint. The study's exit status
is its cells': 0 when every cell finished, whatever happened to the workers on the way.

The workers' environment is an allow-list (``tracking.store.child_env.worker_env``) and their
queue URL comes as ``WORKBENCH_STORAGE``: nothing secret is in their argv.

Stopping: Ctrl-C or SIGTERM reaches the coordinator only (the workers run in sessions of
their own, so a terminal's Ctrl-C is not delivered twice); it forwards one SIGINT (SIGTERM)
to every worker, which ends its cell's run KILLED as an in-process `ablate` does, and the
parent is closed as interrupted. If the coordinator is SIGKILLed, the kernel sends its
workers SIGTERM (PR_SET_PDEATHSIG), so no orphan goes on training; the next `ablate`
reaps what is left and resumes every cell from its checkpoint with a fresh queue.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import click
from tqdm.auto import tqdm

from studies.runtime.options import StudyOptions
from studies.runtime.outcome import Status, tally_line
from studies.runtime.study_protocol import Protocol
from tracking.record.lease_rule import HOST, Lease, pid_alive

DEFAULT_THREADS_PER_JOB = 1
STOP_WAIT_SECONDS = 120  # a worker ends its cell's run within this after SIGINT, or is killed
# under the output folder: one sub-folder (queue file, owner pid) per execution
JOBS_FOLDER = ".jobs"


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the coordinator dies, even by SIGKILL (Linux).

    Also SIGINT back to its default: a coordinator started in the background by a shell
    ignores SIGINT and would pass that on, so the one SIGINT it forwards would be lost.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Job:
    index: int
    process: subprocess.Popen
    current: str = ""  # the cell it holds (its key), read from the queue's record
    held: int | None = None  # the number of that cell's trial


def queue_folder(output_dir: Path) -> Path:
    """A fresh folder for this execution's queue; folders of coordinators that are gone are removed."""
    root = output_dir / JOBS_FOLDER
    root.mkdir(parents=True, exist_ok=True)
    for old in root.iterdir():
        owner = old / "owner"
        with contextlib.suppress(ValueError, OSError):
            if not pid_alive(int(owner.read_text().strip())):
                shutil.rmtree(old, ignore_errors=True)
    folder = root / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    (folder / "owner").write_text(str(os.getpid()))
    return folder


def worker_command(
    study: str,
    threads: int,
    device: str,
    output_dir: Path,
    data_path: str | None,
    debug: bool = False,
) -> list[str]:
    """The worker of one job (its queue comes through ``worker_environment``, not argv). ``threads``
    0: none asked for, so each job gets the fixed default (``--default-threads``: new cells start
    with it, a resumed cell keeps the count it started with)."""
    command = [
        sys.executable,
        "-m",
        "studies.cli",
        *(["--debug"] if debug else []),
        "worker",
        "--study",
        study,
        "--device",
        device,
        "--output-dir",
        str(output_dir),
    ]
    command += (
        ["--threads", str(threads)]
        if threads
        else ["--default-threads", str(DEFAULT_THREADS_PER_JOB)]
    )
    return command + (["--data-path", data_path] if data_path else [])


def worker_environment(storage: str) -> dict:
    """The allow-listed environment of a job's worker, with its queue in WORKBENCH_STORAGE.

    Workers print no progress bars (TQDM_DISABLE): the coordinator draws the one bar. The
    variable the coordinator read its queue URL from (``--storage-env``, any name) is left out:
    the URL reaches a worker once, as WORKBENCH_STORAGE. ``PGPASSWORD`` and libpq's other
    settings only where the queue or the tracking store is PostgreSQL.
    """
    from studies.runtime.secret_options import STORAGE_ENV
    from tracking.store.child_env import worker_env

    env = {k: v for k, v in worker_env(storage=storage).items() if v != storage}
    return {**env, STORAGE_ENV: storage, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}


def start_job(index: int, command: list[str], env: dict) -> Job:
    return Job(
        index,
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        ),
    )


def how_it_ended(returncode: int) -> str:
    """``killed by SIGKILL`` or ``exit code 1``: a Popen return code in words."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _reader(job: Job, lines: queue.Queue) -> None:
    for line in job.process.stdout:
        lines.put((job, line.rstrip("\n")))
    lines.put((job, None))  # end of this job's output


def relay(
    jobs: list[Job], progress, lines: queue.Queue, open_streams: set[int], timeout: float = 1.0
) -> None:
    """Print the jobs' lines until ``timeout`` passes without one (progress text only: what a job
    holds comes from the queue, ``track``)."""
    deadline = time.monotonic() + timeout
    while open_streams and time.monotonic() < deadline:
        try:
            job, line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            return
        if line is None:
            open_streams.discard(job.index)
            continue
        if not line.strip():
            continue
        tqdm.write(f"[job {job.index}] {line}")
        sys.stdout.flush()  # promptly into a pipe or a log file too, not only on a terminal
        progress(jobs)


def stop_jobs(jobs: list[Job], signum: int, lines: queue.Queue, open_streams: set[int]) -> None:
    """One signal to every live worker, then wait (relaying their last lines); kill what will not end."""
    for job in jobs:
        if job.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                job.process.send_signal(signum)
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    while any(j.process.poll() is None for j in jobs) and time.monotonic() < deadline:
        with contextlib.suppress(
            KeyboardInterrupt
        ):  # a second Ctrl-C must not cut the workers' cleanup short
            relay(jobs, lambda _: None, lines, open_streams, timeout=0.5)
    for job in jobs:
        if job.process.poll() is None:
            tqdm.write(
                f"[job {job.index}] did not stop within {STOP_WAIT_SECONDS} s: killed; the next ablate reaps its run"
            )
            job.process.kill()
    with contextlib.suppress(KeyboardInterrupt):
        relay(jobs, lambda _: None, lines, open_streams, timeout=0.5)


def track(jobs: list[Job], trials) -> None:
    """Set each job's cell from the queue's record: the RUNNING trial whose lease names the job's
    process on this host and that has no outcome yet (a worker writes the outcome right before
    it tells the queue). A job whose process is gone keeps the cell it held when it died unless
    it ended that cell itself: another worker may have handed the cell on already.
    """
    from optuna.trial import TrialState

    from studies.ablation.cell_queue import KEY_ATTR, LEASE_ATTR, OUTCOME_ATTR

    by_number = {t.number: t for t in trials}
    holding = {}
    for trial in trials:
        lease = Lease.from_record(trial.user_attrs.get(LEASE_ATTR))
        if (
            trial.state == TrialState.RUNNING
            and lease
            and lease.host == HOST
            and OUTCOME_ATTR not in trial.user_attrs
        ):
            holding[lease.pid] = trial
    for job in jobs:
        trial = holding.get(job.process.pid)
        if trial is not None:
            job.held, job.current = (
                trial.number,
                str(trial.user_attrs.get(KEY_ATTR, trial.user_attrs.get("cell"))),
            )
            continue
        old = by_number.get(job.held) if job.held is not None else None
        if job.process.poll() is None or old is None or OUTCOME_ATTR in old.user_attrs:
            job.held, job.current = None, ""


def outcomes(trials) -> dict[str, int]:
    """Final outcome per queued cell (from the queue's trials): a re-queued attempt counts once, by its last state."""
    from optuna.trial import TrialState

    from studies.ablation.cell_queue import CELL_ATTR, OUTCOME_ATTR

    last: dict[int, tuple[TrialState, str]] = {}
    for trial in sorted(trials, key=lambda t: t.number):
        cell = trial.user_attrs.get(CELL_ATTR)
        if cell is not None:
            last[cell] = (trial.state, trial.user_attrs.get(OUTCOME_ATTR, ""))
    tally = {"finished": 0, "skipped": 0, "failed": 0, "busy": 0, "unfinished": 0}
    for state, outcome in last.values():
        if state == TrialState.COMPLETE:
            tally[outcome if outcome in ("skipped", "busy") else "finished"] += 1
        elif state == TrialState.FAIL:
            tally["failed"] += 1
        else:
            tally["unfinished"] += 1
    return tally


def run_jobs(
    protocol: Protocol,
    protocol_file: Path,
    options: StudyOptions,
    *,
    jobs: int,
    arms: tuple[str, ...] = (),
) -> dict[str, int]:
    """Run the protocol's unfinished cells with ``jobs`` local workers; returns the outcome tally.

    ``arms``: only these arms' cells (``ablate --arms``); the others are neither queued nor counted.

    ``options.threads``: per job, as the user asked (0: the fixed default, ``DEFAULT_THREADS_PER_JOB``).
    """
    output_dir, threads, device, data_path = (
        options.output_dir,
        options.threads,
        options.device,
        options.data_path,
    )
    allow_dirty, download = options.allow_dirty, options.download
    from studies.runtime.study_execution import finished_cells, held_parent, prepare_checked_data
    from studies.ablation.cell_order import longest_first
    from studies.ablation.cell_queue import (
        CellQueue,
        counts,
        debugging,
        enqueue_cells,
        open_storage,
    )
    from studies.runtime.stop_signals import sigterm_raises

    # Decode and cache the data once here, so the workers only read the cache.
    # every check before the parent run opens
    data = prepare_checked_data(protocol, data_path, download)
    folder = queue_folder(output_dir)
    storage_url = f"journal:{folder / 'queue.log'}"
    tqdm.write(
        f"{protocol.name}@{protocol.short_hash}: {len(protocol.cells())} cells on {data.display_name} "
        f"({len(data.train.labels)} train / {len(data.val.labels)} val), data {data.data_fingerprint[:12]}; "
        f"{jobs} jobs x {threads or DEFAULT_THREADS_PER_JOB} thread(s) each"
    )
    try:
        with (
            sigterm_raises(),
            held_parent(
                protocol, protocol_file, allow_dirty, {"queue": "jobs"}, subset=bool(arms)
            ) as parent,
        ):
            order, order_line = longest_first(protocol, data.train.images.shape[-1])
            tqdm.write(order_line)
            cells = protocol.cells()
            if arms:
                order = [i for i in order if cells[i].arm in arms]
                tqdm.write(f"--arms {','.join(arms)}: {len(order)} of {len(cells)} cells")
            storage = open_storage(storage_url)
            study_name, added = enqueue_cells(
                protocol,
                protocol_file,
                storage,
                parent.run_id,
                finished_cells(protocol),
                {"allow_dirty": allow_dirty, "download": download},
                order,
            )
            skipped = len(order) - added
            if skipped:
                tqdm.write(f"{skipped} cells already finished (skipped)")
            cell_queue = CellQueue.load(study_name, storage)
            died = {"died": 0, "replaced": 0}
            if added:
                pool = JobPool(
                    cell_queue,
                    worker_command(study_name, threads, device, output_dir, data_path, debugging()),
                    worker_environment(storage_url),
                    most=max(2, min(jobs, added)),
                )
                died = pool.drive(added, min(jobs, added))
            tally = {**outcomes(cell_queue.trials()), **died}
            tally["skipped"] += skipped
            tqdm.write(f"queue: {counts(cell_queue)}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return tally


class JobPool:
    """The coordinator's workers on one queue: started, watched through the queue's record,
    replaced when one dies while cells are left, stopped together on Ctrl-C/SIGTERM.

    ``most``: replacements at most (a worker that dies at every start must not be started forever).
    """

    def __init__(self, cell_queue, command: list[str], env: dict, most: int) -> None:
        self.queue, self.command, self.env, self.most = cell_queue, command, env, most
        self.jobs: list[Job] = []
        self.lines: queue.Queue = queue.Queue()
        self.open_streams: set[int] = set()
        self.ended: set[int] = set()
        self.tally = {"died": 0, "replaced": 0}

    def launch(self) -> Job:
        job = start_job(len(self.jobs) + 1, self.command, self.env)
        self.jobs.append(job)
        self.open_streams.add(job.index)
        threading.Thread(target=_reader, args=(job, self.lines), daemon=True).start()
        return job

    def watch(self) -> list:
        """Read the queue once: each job's cell (``track``); returns the trials."""
        trials = self.queue.trials()
        track(self.jobs, trials)
        return trials

    def replace_the_dead(self) -> None:
        from studies.ablation.cell_queue import counts

        for job in self.jobs:
            if job.index in self.ended or job.process.poll() is None:
                continue
            self.ended.add(job.index)
            if not job.process.returncode:
                continue
            self.tally["died"] += 1
            self.watch()  # the cell it held when it died, as the queue has it now
            on = f" on cell {job.current}" if job.current else ""
            state = counts(self.queue)
            left = state["waiting"] + state["running"]
            ended = how_it_ended(job.process.returncode)
            if not left:
                tqdm.write(
                    f"[job {job.index}] died ({ended}){on}; no cell is left to replace it for"
                )
            elif self.tally["replaced"] >= self.most:
                tqdm.write(
                    f"[job {job.index}] died ({ended}){on}; not replaced ({self.most} workers were replaced "
                    "already); the next ablate trains what is left"
                )
            else:
                self.tally["replaced"] += 1
                new = self.launch()
                tqdm.write(
                    f"[job {job.index}] died ({ended}){on}; started job {new.index} in its place "
                    f"({'its cell goes back to the queue, ' if on else ''}{left} cell(s) waiting or running)"
                )

    def drive(self, total: int, n_jobs: int) -> dict[str, int]:
        """Start ``n_jobs`` workers, show one bar over the ``total`` queued cells until all workers ended.

        Returns ``{"died": workers that ended with an error or a signal, "replaced": ...}``.
        """
        from studies.runtime.stop_signals import Terminated

        for _ in range(n_jobs):
            self.launch()
        # On a terminal the bar is redrawn every pass (its clock moves); into a log file it is
        # written only when a count or a job's cell changes, not twice a second for hours.
        redraw_always = sys.stderr.isatty()
        shown: list[tuple[int, str]] = []
        with tqdm(total=total, desc="cells", unit="cell") as bar:

            def progress(_=None) -> None:
                bar.set_postfix_str(
                    ", ".join(
                        f"{j.index}: {j.current}"
                        for j in self.jobs
                        if j.current and j.process.poll() is None
                    ),
                    refresh=redraw_always,
                )

            try:
                while True:
                    if not self.open_streams:
                        time.sleep(0.2)  # output closed, process not reaped yet
                    relay(self.jobs, progress, self.lines, self.open_streams)
                    self.replace_the_dead()
                    bar.n = min(total, cells_done(self.watch()))
                    progress()
                    state = (bar.n, bar.postfix or "")
                    if redraw_always or shown[-1:] != [state]:
                        shown[:] = [state]
                        bar.refresh()
                    if not self.open_streams and all(
                        j.process.poll() is not None for j in self.jobs
                    ):
                        self.replace_the_dead()  # one that ended just now: said, and replaced if cells are left
                        if not self.open_streams:
                            break
            except (KeyboardInterrupt, Terminated) as err:
                signum = signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT
                tqdm.write(
                    f"stopping {sum(j.process.poll() is None for j in self.jobs)} job(s) "
                    f"({signal.Signals(signum).name}); each ends its cell's run"
                )
                stop_jobs(self.jobs, signum, self.lines, self.open_streams)
                raise
            bar.n = min(total, cells_done(self.queue.trials()))
        return self.tally


def cells_done(trials) -> int:
    """Queued cells that reached their end (a dead worker's attempt, re-queued, does not count twice)."""
    return sum(n for what, n in outcomes(trials).items() if what != "unfinished")


def describe(tally: dict[str, int]) -> str:
    """The study's one tally line (``studies.runtime.outcome.tally_line``), plus what only ``--jobs`` has."""
    text = tally_line({status: tally.get(status.value, 0) for status in Status})
    if tally["unfinished"]:
        text += f", {tally['unfinished']} not finished"
    if tally.get("died"):
        text += f"; {tally['died']} worker(s) died ([job N] lines above say how), {tally['replaced']} replaced"
    return text


def check_jobs(jobs: int, storage: str | None) -> None:
    if jobs and storage:
        raise click.UsageError(
            "--jobs runs cells here; --storage queues them for remote workers: give one of them"
        )
