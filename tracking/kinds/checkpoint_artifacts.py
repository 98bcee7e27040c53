"""A cell's resumable checkpoint in its run's artifact store: uploaded each epoch, fetched by whoever continues it.

A worker on another machine that takes a cell over has an empty ``--output-dir``: without this
it would train the cell again from epoch 0. So each epoch's full-state checkpoint (``last.pt``:
model, optimizer, scheduler, scaler, EMA and RNG states, position and history) goes to the
run's own artifact store (a local store, a server's proxied ``mlflow-artifacts:`` store, or
whatever artifact location the store gives the run), in a background thread while the next epoch
trains (``CheckpointUploader``), with what a resumed run needs besides it: ``best.pt`` and the validation predictions the
best weights made (the reload proof at the end compares the two).

Layout: ``resume/step-<global step, 9 digits>/`` holds ``last.pt``, ``best.pt``, ``val.csv`` and,
written last, ``manifest.json`` (epoch, step, batch, each file's sha256). A folder without a
manifest is an upload cut short and is never used; a file whose sha256 differs is refused.

Policy: only the latest checkpoint is kept. Once a folder's manifest is up, every folder of an
earlier step is deleted (a folder of a later step, which a faster holder of the cell may have
written, is never touched); once the cell finished, its summary's ``checkpoints/`` hold the final
``last.pt`` and ``best.pt`` and the ``resume/`` folder is deleted. A store that refuses deletes
keeps the older folders (said once); the newest complete one is still the one fetched.

The run's ``checkpoint.*`` tags (``tracking.record.schema``) say where the latest is, its epoch
and step, and how long its upload took: ``workbench status`` shows them for a resumable cell.
Checkpoints are read back with ``torch.load(weights_only=True)`` only (``load_checkpoint``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.entities import RunTag
from mlflow.tracking import MlflowClient

from tracking.record.schema import (
    CHECKPOINT_EPOCH,
    CHECKPOINT_STEP,
    CHECKPOINT_UPLOAD_SECONDS,
    CHECKPOINT_URI,
    CONTINUES_TAG,
)
from tracking.record.sink import RunSink, log_batch
from tracking.store import offline_store
from tracking.store.redact import redact_text
from workbench.atomic import atomic_write
from workbench.train.loop import TrainingObserver

RESUME_FOLDER = "resume"
MANIFEST = "manifest.json"
FORMAT = "glassbox-resume-checkpoint-v1"
# Local place of each file in a run directory (``workbench.train.loop.Trainer``), by upload name.
LOCAL_FILES = {
    "last.pt": "checkpoints/last.pt",
    "best.pt": "checkpoints/best.pt",
    "val.csv": "predictions/val.csv",
}
# Checkpoints written at these moments go up: each epoch's end, and a preempted worker's last step.
UPLOADED_KINDS = ("epoch", "preempt")
MAX_CONTINUED_RUNS = 20  # how far back a chain of continued runs is followed for a checkpoint


@dataclass(frozen=True)
class Manifest:
    """One uploaded checkpoint: where it is and the position it holds."""

    run_id: str
    folder: str  # artifact path, "resume/step-000000123"
    uri: str  # the folder's full artifact URI
    epoch: int  # epochs completed
    step: int  # global optimizer steps
    batch: int  # batches done of the current epoch (0 at an epoch's end)
    files: dict[str, str]  # upload name -> sha256


def folder_for(step: int) -> str:
    return f"{RESUME_FOLDER}/step-{step:09d}"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def position(last: Path) -> tuple[int, int, int]:
    """(epoch, step, batch) of a ``last.pt``, read without loading its tensors into memory (mmap)."""
    state = torch.load(last, map_location="cpu", weights_only=True, mmap=True)
    return int(state["epoch"]), int(state["step"]), int(state["batch"])


def _store_of(sink: RunSink) -> tuple[MlflowClient, str]:
    """The client of the store the sink writes to now, and the run id there."""
    uri = offline_store.fallback_uri() if sink.mirror_id else sink.uri
    return MlflowClient(uri), sink.local_run_id


def _folders(client: MlflowClient, run_id: str) -> list[tuple[int, str]]:
    """(step, artifact path) of each ``resume/step-*`` folder of a run, newest first."""
    found = []
    for info in client.list_artifacts(run_id, RESUME_FOLDER):
        name = info.path.rsplit("/", 1)[-1]
        if info.is_dir and name.startswith("step-") and name[5:].isdigit():
            found.append((int(name[5:]), info.path))
    return sorted(found, reverse=True)


def _delete(client: MlflowClient, run_id: str, artifact_path: str) -> None:
    """Delete a run's artifact folder through the repository of its artifact URI (MLflow's client has
    no delete): a local folder, an HTTP DELETE to a server's proxied store, an object store's delete."""
    run = client.get_run(run_id)
    repo = get_artifact_repository(run.info.artifact_uri, tracking_uri=client.tracking_uri)
    repo.delete_artifacts(artifact_path)


def settle_finished(client: MlflowClient, run_id: str) -> str:
    """A finished cell's run in ``client``'s store: its ``resume/`` folder deleted (the policy in the
    module docstring); the URI of its final ``checkpoints/``, where ``checkpoint.uri`` points then.
    Also run by ``workbench sync`` on the server copy of a cell that finished while the server was
    away (its earlier epochs' folders went up before the outage)."""
    if _folders(client, run_id):
        _delete(client, run_id, RESUME_FOLDER)
    return f"{client.get_run(run_id).info.artifact_uri}/checkpoints"


@dataclass
class _Staged:
    """A checkpoint's files hard-linked under their upload names: a fixed copy that the next epoch's
    writes (which replace the files, never change them in place) leave alone while it uploads."""

    epoch: int
    step: int
    batch: int
    folder: str  # artifact path
    path: Path  # local folder holding the files
    files: dict[str, str]  # upload name -> sha256


class CheckpointUploader(TrainingObserver):
    """Uploads each epoch's checkpoint (and a preempted worker's last step) into the run, then prunes.

    An epoch's upload runs in a background thread while the next epoch trains (training waits only
    when an epoch is shorter than an upload: ``waited``), with its own client of the run's store; a
    preemption's upload, and every upload while the run logs to the local fallback store, go through
    the run's sink and are done before training goes on. ``check`` is the run's fence
    (``MlflowTrainingObserver.check``): no manifest goes up once another execution holds the run.
    ``log`` gets one line per upload with its time.
    """

    def __init__(self, sink: RunSink, run_dir: Path, check, log, background: bool = True) -> None:
        self.sink, self.run_dir, self.check, self.log = sink, Path(run_dir), check, log
        self.background = background
        self.prune_refused: str | None = None
        self.seconds: list[float] = []  # each upload's duration
        self.waited = 0.0  # seconds training waited for a background upload
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None  # the background upload's error, said by ``wait``

    def on_checkpoint(self, path: Path, kind: str) -> None:
        if kind not in UPLOADED_KINDS:
            return
        self.wait()  # one upload at a time, in order
        staged = self._stage()
        if kind == "preempt" or not self.background or self.sink.offline:
            self._said(self._upload(staged, through_sink=True))
            return
        self._thread = threading.Thread(
            target=self._in_background, args=(staged,), name="checkpoint-upload", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Wait for the upload under way, if any, and say how it went."""
        if self._thread is None:
            return
        started = time.perf_counter()
        self._thread.join()
        self.waited += time.perf_counter() - started
        self._thread = None
        failed, self._failed = self._failed, None
        if failed is not None:
            self.log(
                f"a checkpoint upload failed ({type(failed).__name__}: {failed}); the next one is "
                "tried at the next epoch's end"
            )

    def finish(self, final_epoch: int, final_step: int) -> None:
        """A finished cell: its ``resume/`` folder goes (the summary's ``checkpoints/`` hold the final
        ``last.pt`` and ``best.pt``) and the ``checkpoint.*`` tags point there; one line says what the
        uploads cost (how long each took, how long training waited for them)."""
        self.wait()
        if self.seconds:
            self.log(
                f"checkpoint uploads: {len(self.seconds)}, {statistics.median(self.seconds):.2f} s "
                f"each (median), training waited {self.waited:.2f} s for them in all"
            )
        client, run_id = _store_of(self.sink)
        try:  # a store refusing deletes, or gone a moment: the cell is finished all the same
            where = settle_finished(client, run_id)
        except Exception:  # noqa: BLE001 - the summary is logged; the tags are only a pointer
            return
        self.sink.set_tags(
            {
                CHECKPOINT_URI: where,
                CHECKPOINT_EPOCH: str(final_epoch),
                CHECKPOINT_STEP: str(final_step),
            }
        )

    def _stage(self) -> _Staged:
        epoch, step, batch = position(self.run_dir / LOCAL_FILES["last.pt"])
        folder = folder_for(step)
        path = self.run_dir / ".upload" / folder.rsplit("/", 1)[-1]
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        files = {}
        for name, local in LOCAL_FILES.items():
            source = self.run_dir / local
            if not source.exists():  # best.pt and val.csv appear with the first validated epoch
                continue
            try:
                (path / name).hardlink_to(source)
            except OSError:  # a file system without hard links: a copy
                shutil.copyfile(source, path / name)
            files[name] = sha256(path / name)
        return _Staged(epoch, step, batch, folder, path, files)

    def _in_background(self, staged: _Staged) -> None:
        try:
            done = self._upload(staged, through_sink=False)
        except BaseException as err:  # noqa: BLE001 - said by ``wait``, in the training thread
            self._failed = err
            return
        self._said(done)  # as soon as it is up: a console line says what a takeover would find

    def _upload(self, staged: _Staged, through_sink: bool) -> tuple[Manifest, float]:
        """The files, then the manifest (the folder counts from then on), then the pruning and the tags."""
        started = time.perf_counter()
        client, run_id = _store_of(self.sink)

        def put(path: Path) -> None:
            if through_sink:
                self.sink.log_artifact(path, artifact_path=staged.folder)
            else:
                client.log_artifact(run_id, str(path), staged.folder)

        try:
            for name in staged.files:
                put(staged.path / name)
            # taken over meanwhile: no manifest, nobody uses the folder
            self.check(sync=through_sink)
            manifest = {
                "format": FORMAT,
                "epoch": staged.epoch,
                "step": staged.step,
                "batch": staged.batch,
                "files": staged.files,
            }
            (staged.path / MANIFEST).write_text(json.dumps(manifest, indent=1))
            put(staged.path / MANIFEST)
            self._prune(client, run_id, keep=staged.step)
            uri = f"{client.get_run(run_id).info.artifact_uri}/{staged.folder}"
            seconds = time.perf_counter() - started
            tags = {
                CHECKPOINT_URI: uri,
                CHECKPOINT_EPOCH: str(staged.epoch),
                CHECKPOINT_STEP: str(staged.step),
                CHECKPOINT_UPLOAD_SECONDS: f"{seconds:.3f}",
            }
            if through_sink:
                self.sink.set_tags(tags)
            else:  # at once, not at the next wait: `status` reads them while the next epoch trains
                log_batch(client, run_id, tags=[RunTag(k, redact_text(v)) for k, v in tags.items()])
        finally:
            shutil.rmtree(staged.path, ignore_errors=True)
        found = Manifest(
            run_id, staged.folder, uri, staged.epoch, staged.step, staged.batch, staged.files
        )
        return found, seconds

    def _said(self, done: tuple[Manifest, float]) -> None:
        manifest, seconds = done
        self.seconds.append(seconds)
        where = f"epoch {manifest.epoch}" + (f" batch {manifest.batch}" if manifest.batch else "")
        self.log(
            f"checkpoint of {where} (step {manifest.step}) uploaded in {seconds:.2f} s to {manifest.uri}"
        )

    def _prune(self, client: MlflowClient, run_id: str, keep: int) -> None:
        """Delete the folders of steps before ``keep`` (the policy in the module docstring)."""
        for step, path in _folders(client, run_id):
            if step >= keep:
                continue
            try:
                _delete(client, run_id, path)
            except Exception as err:  # noqa: BLE001 - a store that refuses deletes keeps them, said once
                if self.prune_refused is None:
                    self.prune_refused = f"{type(err).__name__}: {err}"[:300]
                    self.log(
                        f"older checkpoints are kept: the artifact store refused to delete {path} "
                        f"({self.prune_refused})"
                    )
                return


def _chain(client: MlflowClient, run_id: str) -> list[str]:
    """The run and the runs it continues (``continues_run``), newest first."""
    chain = [run_id]
    while len(chain) < MAX_CONTINUED_RUNS:
        older = client.get_run(chain[-1]).data.tags.get(CONTINUES_TAG)
        if not older or older in chain:
            break
        chain.append(older.split()[0])
    return chain


def read_manifest(client: MlflowClient, run_id: str, folder: str, into: Path) -> Manifest | None:
    """The manifest of an uploaded folder, or None when the upload never completed."""
    names = {info.path.rsplit("/", 1)[-1] for info in client.list_artifacts(run_id, folder)}
    if MANIFEST not in names:
        return None
    local = Path(client.download_artifacts(run_id, f"{folder}/{MANIFEST}", str(into)))
    data = json.loads(local.read_text())
    if data.get("format") != FORMAT or not set(data.get("files", {})) <= names:
        return None
    uri = f"{client.get_run(run_id).info.artifact_uri}/{folder}"
    return Manifest(
        run_id,
        folder,
        uri,
        int(data["epoch"]),
        int(data["step"]),
        int(data["batch"]),
        data["files"],
    )


def latest_uploaded(client: MlflowClient, run_id: str, into: Path) -> Manifest | None:
    """The newest complete checkpoint of the run or of the runs it continues."""
    for rid in _chain(client, run_id):
        for _step, folder in _folders(client, rid):
            found = read_manifest(client, rid, folder, into)
            if found is not None:
                return found
    return None


def fetch_checkpoint(sink: RunSink, run_dir: Path, log) -> Manifest | None:
    """Put the run's latest uploaded checkpoint into ``run_dir`` when it is ahead of what is there.

    Nothing is fetched when ``run_dir`` holds a checkpoint at least as far on (this machine trained
    the cell last). Files are downloaded to a temporary folder beside them, checked against the
    manifest's sha256, and moved into place atomically, ``last.pt`` last: an interrupted fetch
    leaves no ``last.pt`` newer than its ``best.pt``. Returns the manifest fetched, or None.
    """
    client, run_id = _store_of(sink)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=run_dir, prefix=".fetch-") as tmp:
        manifest = latest_uploaded(client, run_id, Path(tmp))
        if manifest is None:
            return None
        last = run_dir / LOCAL_FILES["last.pt"]
        if last.exists() and position(last)[1] >= manifest.step:
            return None
        started = time.perf_counter()
        fetched = {}
        for name, digest in manifest.files.items():
            local = Path(
                client.download_artifacts(manifest.run_id, f"{manifest.folder}/{name}", tmp)
            )
            if sha256(local) != digest:
                raise ValueError(
                    f"{manifest.uri}/{name}: sha256 {sha256(local)[:12]} is not the manifest's "
                    f"{digest[:12]}: the uploaded checkpoint is damaged"
                )
            fetched[name] = local
        for name in sorted(fetched, key=lambda n: n == "last.pt"):  # last.pt moved in last
            dest = run_dir / LOCAL_FILES[name]
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(fetched[name], "rb") as source:
                atomic_write(dest, lambda f, source=source: shutil.copyfileobj(source, f))
    log(
        f"fetched the checkpoint of epoch {manifest.epoch} (step {manifest.step}) from {manifest.uri} "
        f"in {time.perf_counter() - started:.2f} s"
    )
    return manifest
