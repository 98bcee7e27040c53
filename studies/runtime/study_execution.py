"""What every execution of a study does around its cells: the data prepared once, the parent run held.

Shared by ``ablate`` (in process and with ``--jobs``), ``worker``, ``transfer``, ``intervene`` and ``attribute``:
each execution prepares the protocol's data once (one split, the pairing every cell shares), holds
the study's one parent run for as long as it runs and closes it with a truthful status however it
ends, and skips the cells that already have a finished run of this code.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from studies.runtime.preflight import check_protocol_fits, remove_abandoned_cache_files
from studies.runtime.stop_signals import Terminated
from studies.runtime.study_protocol import Protocol, ProtocolError
from tracking.record.executions import work_line
from tracking.record.protocol_runs import cell_runs, close_study_parent, open_study_parent
from tracking.store.store_errors import explain
from workbench.data import PreparedData, SplitSizeError, prepare
from workbench.code_history import same_code
from workbench.train.config import DataSpec
from workbench.train.fingerprint import current_code_fingerprint


def prepare_data(spec: DataSpec, download: bool = False) -> PreparedData:
    """Load the dataset ``spec`` names and make its split (any training: a cell, ``train``, a sweep)."""
    remove_abandoned_cache_files()
    return prepare(
        spec.name,
        path=spec.path,
        download=download,
        split_seed=spec.split_seed,
        train_size=spec.train_size,
        val_size=spec.val_size,
        subset=spec.subset,
    )


def prepare_protocol_data(
    protocol: Protocol, data_path: str | None, download: bool
) -> PreparedData:
    """Load the dataset once and make the split every cell shares (the pairing).

    Raises:
        ProtocolError: The protocol's split sizes do not fit the dataset (naming the file and keys).
    """
    spec = protocol.dataset if data_path is None else replace(protocol.dataset, path=data_path)
    try:
        return prepare_data(spec, download)
    except SplitSizeError as err:
        raise ProtocolError(f"{protocol.source}: dataset: {err}") from err


def prepare_checked_data(protocol: Protocol, data_path: str | None, download: bool) -> PreparedData:
    """``prepare_protocol_data``, then refuse arms that do not fit it: every check before the parent opens."""
    data = prepare_protocol_data(protocol, data_path, download)
    check_protocol_fits(protocol, data, tqdm.write)
    return data


@contextlib.contextmanager
def held_parent(
    protocol: Protocol,
    protocol_file: Path,
    allow_dirty: bool,
    extra_tags: dict | None = None,
    queued: bool = False,
    subset: bool = False,
    record_run: str | None = None,
):
    """The study's parent run for one execution, closed with a truthful status however it ends.

    ``subset``: the execution runs only some of the study's cells on purpose (``ablate --arms``), so
    the cells it leaves are not missing: the parent ends SCHEDULED until a later execution runs them.
    ``record_run``: a worker's queue names the study's parent run; its experiment is the record.
    """
    parent = open_study_parent(
        protocol, protocol_file, allow_dirty, extra_tags, log=tqdm.write, record_run=record_run
    )
    try:
        yield parent
    except (KeyboardInterrupt, Terminated) as err:
        status = close_study_parent(parent, "interrupted", f"{type(err).__name__} {err}".strip())
        tqdm.write(f"interrupted: parent run {parent.run_id} ended {status}")
        raise
    except BaseException as err:
        try:
            close_study_parent(parent, "failed", f"{type(err).__name__}: {err}")
        except (
            Exception
        ) as close_err:  # a full store may refuse this too: the first error is the one to say
            if not explain(close_err):
                raise
            tqdm.write(
                f"parent run {parent.run_id} left open ({explain(close_err)}); the next execution ends it"
            )
        raise
    else:
        if parent.work is not None:  # a worker: its record says what it trained, not "queued"
            status = close_study_parent(parent, "worker", work_line(parent.work))
        else:
            outcome = "queued" if queued else "subset" if subset else "completed"
            status = close_study_parent(parent, outcome)
        tqdm.write(f"parent run {parent.run_id}: {status}")


def finished_cells(protocol: Protocol) -> set[tuple[str, int]]:
    """(arm, seed) of the cells that have a finished run of this code (never queued again)."""
    fingerprint = current_code_fingerprint()
    return {
        (r.data.tags.get("arm"), int(r.data.tags.get("seed", -1)))
        for r in cell_runs(protocol.name, protocol.hash)
        if r.info.status == "FINISHED"
        and same_code(r.data.params.get("code_fingerprint"), fingerprint)
    }
