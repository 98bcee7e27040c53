"""Checkpoints follow the cell: a worker on another output folder resumes a taken-over or preempted cell
from the checkpoint uploaded to its run, and the cell equals an uninterrupted run's bit for bit.

Real processes: an MLflow tracking server on 127.0.0.1 with proxied artifacts (``mlflow-artifacts:``),
a journal-file cell queue, two ``workbench worker`` processes with separate ``--output-dir``s, and a
reference cell trained uninterrupted by ``ablate`` into a local store. One worker is SIGKILLed mid-epoch
(the other takes the cell over once its lease is found dead) or SIGTERMed mid-epoch (it checkpoints
the step it reached, uploads it, hands the cell back to the queue and exits 75).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from data_fixtures import make_image_folder
from servers import mlflow_server
from studies.ablation.cell_queue import HANDED_BACK_ATTR, RETRY_ATTR, open_storage
from test_distributed import STARTED, no_worker_left_behind, tail, wait_for  # noqa: F401
from workbench.kernel_identity import cpu_info
from workbench.train.checkpoint import load_checkpoint
from workbench.train.evaluate import read_predictions

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # servers, three trainings, kills
ROOT = Path(__file__).resolve().parent.parent
EPOCHS = 3
PER_CLASS = {"train": 40, "test": 4}  # 114 training images in batches of 4: 29 steps an epoch
TIMING = {"epoch_seconds", "images_per_second"}
AVX2_CAPS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
# One cell, with weight EMA (its state must travel too) and augmentation.
PROTOCOL = """\
name: takeover
description: one tiny cell, taken over mid-epoch by a worker with another output folder
dataset: {name: image_folder, val_size: 6, split_seed: 3, hflip: true}
model: {name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 1, heads: 2, mlp_hidden: 32}
optim: {lr: 0.003}
recipe: {ema_decay: 0.9}
run: {epochs: 3, batch_size: 4, evaluate_test: true}
arms:
  - {name: vit, reference: true}
seeds: [0]
"""


def start(args: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    """A worker through ``tests/paced_cli.py``: each training batch waits ``PACE_SECONDS`` first, so
    an epoch lasts long enough on any machine for the test to see it mid-way and stop it there."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "paced_cli.py"), *args],
        env={**env, "PACE_SECONDS": "0.1"},
        cwd=cwd,
        text=True,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    STARTED.append(proc)
    return proc


def cli(args: list[str], env: dict, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "studies.cli", *args],
        env=env,
        cwd=cwd,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def environment(tmp_path: Path, uri: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MLFLOW_TRACKING_URI": uri,
        "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"),
        "WORKBENCH_OFFLINE_DIR": str(tmp_path / "offline"),
        "OMP_NUM_THREADS": "1",  # every execution of the cell at one thread: the same bits
    }
    env.pop("MLFLOW_RUN_ID", None)
    return env


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The cell trained once, uninterrupted, into a local store: (its output folder, its store URI)."""
    return train_reference(tmp_path_factory.mktemp("reference"), {})


@pytest.fixture(scope="module")
def reference_avx2(tmp_path_factory):
    """The same, under the AVX2 kernel caps (``AVX2_CAPS``)."""
    return train_reference(tmp_path_factory.mktemp("reference_avx2"), AVX2_CAPS)


def train_reference(root: Path, caps: dict[str, str]) -> tuple[Path, str]:
    folder = root / "images"
    make_image_folder(folder, per_class=PER_CLASS)
    protocol = root / "takeover.yaml"
    protocol.write_text(PROTOCOL)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    done = cli(
        [
            "ablate",
            "--protocol",
            str(protocol),
            "--allow-dirty",
            "--device",
            "cpu",
            "--data-path",
            str(folder),
            "--output-dir",
            str(root / "out"),
        ],
        environment(root, uri) | caps,
        root,
    )
    assert done.returncode == 0 and "[finished]" in done.stdout, (done.stdout + done.stderr)[-4000:]
    return root, uri


def upload_lines(log: Path) -> list[tuple[int, int, int]]:
    """(epoch, batch, step) of each checkpoint a worker uploaded."""
    text = log.read_text() if log.exists() else ""
    return [
        (int(e), int(b or 0), int(s))
        for e, b, s in re.findall(
            r"checkpoint of epoch (\d+)(?: batch (\d+))? \(step (\d+)\) uploaded", text
        )
    ]


def bar(log: Path) -> tuple[int, int, int] | None:
    """(epoch, steps done, steps in the epoch) of the worker's latest progress bar line."""
    text = log.read_text().replace("\r", "\n") if log.exists() else ""
    found = re.findall(rf"epoch (\d+)/{EPOCHS}:\s+\d+%\|[^|]*\| (\d+)/(\d+) ", text)
    return tuple(map(int, found[-1])) if found else None


def mid_epoch(log: Path, epoch: int) -> bool:
    """The worker is in ``epoch`` (1-based, as its bar shows it), a step done and three to go: a
    stop now lands mid-epoch (it is taken before the next step), with steps to go after it."""
    now = bar(log)
    return now is not None and now[0] == epoch and 0 < now[1] < now[2] - 3


def cell_run(client: MlflowClient):
    exp = client.get_experiment_by_name("takeover")
    (run,) = [
        r
        for r in client.search_runs([exp.experiment_id], "tags.cell = 'true'")
        if "superseded_by" not in r.data.tags
    ]
    return run


def assert_same(a, b, what: str) -> None:
    """Equal all the way down (tensors with ``torch.equal``), naming the first difference and its size."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (what, sorted(set(a) ^ set(b or {})))
        for key in a:
            assert_same(a[key], b[key], f"{what}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (what, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, what
        diff = (
            (a.double() - b.double()).abs().max().item()
            if a.numel() and a.is_floating_point()
            else 0.0
        )
        assert torch.equal(a, b), f"{what}: max |difference| {diff:.3g} (must be 0)"
    else:
        assert a == b, (what, a, b)


def assert_cell_equals_reference(
    client: MlflowClient, run, out: Path, reference, tmp: Path
) -> None:
    """Final weights (full state), every metric point and the predictions: bit for bit."""
    ref_root, ref_uri = reference
    ref_client = MlflowClient(ref_uri)
    ref_run = cell_run(ref_client)
    assert run.data.tags["run_key"] == ref_run.data.tags["run_key"]
    key = run.data.tags["run_key"]
    for name in ("last.pt", "best.pt"):  # the artifacts the finished run holds, and the local files
        logged = Path(client.download_artifacts(run.info.run_id, f"checkpoints/{name}", str(tmp)))
        mine, ref = (
            load_checkpoint(logged),
            load_checkpoint(ref_root / "out" / "takeover" / key / "checkpoints" / name),
        )
        assert_same(
            load_checkpoint(out / "takeover" / key / "checkpoints" / name)["model"],
            mine["model"],
            name,
        )
        for part in ("model", "ema", "optimizer", "scheduler", "scaler", "rng", "epoch", "step"):
            assert (part in mine) == (part in ref), (name, part)
            if part in ref:
                assert_same(mine[part], ref[part], f"{name} {part}")
        if "history" in ref:
            strip = lambda h: [{k: v for k, v in e.items() if k not in TIMING} for e in h]  # noqa: E731
            assert strip(mine["history"]) == strip(ref["history"]), name
    for split in ("val", "test"):
        logged = read_predictions(
            Path(client.download_artifacts(run.info.run_id, f"predictions/{split}.csv", str(tmp)))
        )
        ref = read_predictions(ref_root / "out" / "takeover" / key / "predictions" / f"{split}.csv")
        probs = [c for c in ref.columns if c.startswith("prob_")]
        diff = (logged[probs] - ref[probs]).abs().to_numpy().max() if probs else 0.0
        assert logged.equals(ref), (
            f"{split} predictions: max |prob difference| {diff:.3g} (must be 0)"
        )
    keys = set(ref_run.data.metrics) - TIMING - {"compile_seconds"}
    assert keys <= set(run.data.metrics), sorted(keys - set(run.data.metrics))
    for name in sorted(keys):
        mine = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        ref = [(m.step, m.value) for m in ref_client.get_metric_history(ref_run.info.run_id, name)]
        steps = [s for s, _ in mine]
        assert len(steps) == len(set(steps)), f"{name}: a step logged twice {steps}"
        diff = max((abs(a[1] - b[1]) for a, b in zip(sorted(mine), sorted(ref))), default=0.0)
        assert sorted(mine) == sorted(ref), f"{name}: max |difference| {diff:.3g}\n{mine}\n{ref}"


def queue_up(tmp_path: Path, env: dict, folder: Path) -> tuple[Path, str, list[str]]:
    protocol = tmp_path / "takeover.yaml"
    protocol.write_text(PROTOCOL)
    storage = f"journal:{tmp_path / 'queue.log'}"
    queued = cli(
        ["ablate", "--protocol", str(protocol), "--allow-dirty", "--storage", storage],
        env,
        tmp_path,
    )
    assert queued.returncode == 0 and "queued 1 cells" in queued.stdout, (
        queued.stdout + queued.stderr
    )
    worker = ["worker", "--storage", storage, "--data-path", str(folder), "--device", "cpu"]
    return protocol, storage, worker


def the_queue(storage: str, protocol: Path) -> optuna.Study:
    from studies.runtime.study_protocol import load_protocol

    name = f"cells:takeover@{load_protocol(protocol).short_hash}"
    return optuna.load_study(study_name=name, storage=open_storage(storage, 2, 60))


def resumed_at(log: Path) -> tuple[int, int]:
    found = re.search(r"resumed from epoch (\d+) step (\d+)", log.read_text())
    assert found, tail(log)
    return int(found.group(1)), int(found.group(2))


def test_a_cell_taken_over_after_sigkill_resumes_from_its_uploaded_epoch_bit_identically(
    reference, tmp_path
):
    folder = tmp_path / "images"
    make_image_folder(folder, per_class=PER_CLASS)
    with mlflow_server(f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts") as url:
        env = environment(tmp_path, url)
        _protocol, _storage, worker = queue_up(tmp_path, env, folder)
        logs = {name: tmp_path / f"{name}.log" for name in ("killed", "taker")}
        timing = ["--heartbeat", "1", "--grace", "60"]
        killed = start(
            [*worker, "--output-dir", str(tmp_path / "out-a"), *timing],
            env,
            tmp_path,
            logs["killed"],
        )
        wait_for(
            "the first worker to take the cell",
            lambda: "took it from the queue" in logs["killed"].read_text(),
            logs=logs,
        )
        taker = start(
            [*worker, "--output-dir", str(tmp_path / "out-b"), *timing],
            env,
            tmp_path,
            logs["taker"],
        )
        wait_for(
            "two uploaded epochs",
            lambda: len(upload_lines(logs["killed"])) >= 2,
            timeout=900,
            logs=logs,
        )
        wait_for("a step of epoch 3", lambda: mid_epoch(logs["killed"], 3), timeout=600, logs=logs)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
        uploaded = upload_lines(logs["killed"])  # final now: what the killed worker got up
        assert taker.wait(timeout=900) == 0, tail(logs["taker"])
        text = logs["taker"].read_text()
        assert "Traceback" not in text and "[finished]" in text, tail(logs["taker"])
        # It started from the last uploaded epoch (2, after 2 x 29 steps), not from epoch 0.
        epoch, batch, step = uploaded[-1]
        assert [e for e, _, _ in uploaded] == [1, 2] and batch == 0 and step > 0, uploaded
        assert resumed_at(logs["taker"]) == (2, step), tail(logs["taker"])
        assert f"fetched the checkpoint of epoch 2 (step {step})" in text, tail(logs["taker"])
        client = MlflowClient(url)
        run = cell_run(client)
        assert run.info.status == "FINISHED", run.data.tags
        # Finished: the resume folder is gone; the tags point at the final checkpoints.
        assert not client.list_artifacts(run.info.run_id, "resume")
        assert run.data.tags["checkpoint.uri"].endswith("/checkpoints"), run.data.tags
        assert run.data.tags["checkpoint.uri"].startswith("mlflow-artifacts:"), run.data.tags
        assert_cell_equals_reference(client, run, tmp_path / "out-b", reference, tmp_path / "dl")


def test_a_preempted_worker_checkpoints_its_step_hands_the_cell_back_and_exits_75(
    reference, tmp_path
):
    folder = tmp_path / "images"
    make_image_folder(folder, per_class=PER_CLASS)
    with mlflow_server(f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts") as url:
        env = environment(tmp_path, url)
        protocol, storage, worker = queue_up(tmp_path, env, folder)
        logs = {name: tmp_path / f"{name}.log" for name in ("preempted", "next")}
        # A grace far longer than the test waits: the cell must come back by the hand-back alone.
        timing = ["--heartbeat", "1", "--grace", "600"]
        preempted = start(
            [*worker, "--output-dir", str(tmp_path / "out-a"), *timing],
            env,
            tmp_path,
            logs["preempted"],
        )
        wait_for(
            "an uploaded epoch", lambda: upload_lines(logs["preempted"]), timeout=900, logs=logs
        )
        wait_for(
            "a step of epoch 2", lambda: mid_epoch(logs["preempted"], 2), timeout=600, logs=logs
        )
        signalled = time.monotonic()
        os.kill(preempted.pid, signal.SIGTERM)
        code = preempted.wait(timeout=300)
        text = logs["preempted"].read_text()
        assert code == 75, f"exit {code}\n{tail(logs['preempted'])}"
        print(f"SIGTERM to exit: {time.monotonic() - signalled:.1f} s")
        assert "Traceback" not in text and "handed back to the queue" in text, tail(
            logs["preempted"]
        )
        # The step it reached was checkpointed and uploaded (mid-epoch 2: batch > 0).
        uploaded = upload_lines(logs["preempted"])
        epoch, batch, step = uploaded[-1]
        steps = uploaded[0][2]  # epoch 1's checkpoint is after its last step
        assert len(uploaded) == 2 and epoch == 1 and 0 < batch < steps, uploaded
        assert step == steps + batch, uploaded
        # Pruned: only the latest checkpoint is left in the run's artifact store.
        client = MlflowClient(url)
        folders = [f.path for f in client.list_artifacts(cell_run(client).info.run_id, "resume")]
        assert folders == [f"resume/step-{step:09d}"], folders
        # Handed back at once: the cell waits in the queue again, its old trial failed, before any other worker ran.
        trials = the_queue(storage, protocol).get_trials(deepcopy=False)
        states = sorted((t.state.name, t.user_attrs.get(HANDED_BACK_ATTR, "")[:9]) for t in trials)
        assert states == [("FAIL", ""), ("WAITING", "preempted")], [
            (t.state.name, t.user_attrs) for t in trials
        ]
        (waiting,) = [t for t in trials if t.state == TrialState.WAITING]
        assert waiting.user_attrs[RETRY_ATTR] == min(t.number for t in trials)
        # Status: resumable, with the checkpoint's artifact URI and its epoch.
        said = cli(["status", "--protocol", str(protocol)], env, tmp_path, timeout=300)
        assert said.returncode == 0, said.stdout + said.stderr
        assert re.search(
            rf"vit/seed0: killed, resumable from epoch 1 \(step {step}\): checkpoint mlflow-artifacts:/\S+/resume/step-{step:09d}",
            said.stdout,
        ), said.stdout
        # The next worker (another output folder) takes it at once and resumes at that step.
        started = time.monotonic()
        nxt = start(
            [*worker, "--output-dir", str(tmp_path / "out-b"), *timing], env, tmp_path, logs["next"]
        )
        wait_for(
            "the cell taken",
            lambda: "took it from the queue" in logs["next"].read_text(),
            timeout=300,
            logs=logs,
        )
        print(f"the next worker took the cell {time.monotonic() - started:.1f} s after it started")
        assert nxt.wait(timeout=900) == 0, tail(logs["next"])
        assert resumed_at(logs["next"]) == (1, step), tail(logs["next"])
        assert "re-queued cell" not in logs["next"].read_text()  # nothing waited out a lease
        run = cell_run(client)
        assert run.info.status == "FINISHED", run.data.tags
        assert_cell_equals_reference(client, run, tmp_path / "out-b", reference, tmp_path / "dl")


@pytest.mark.skipif("avx2" not in cpu_info()["flags"].split(), reason="this CPU has no AVX2")
def test_a_worker_matching_kernels_restarts_under_the_first_executions_caps_and_stays_bitwise(
    reference_avx2, tmp_path
):
    """A cell begun under AVX2 caps (as on an AVX2-only CPU), preempted, taken by a worker started
    without caps and with ``--match-kernels``: it hands the cell back, starts itself again under
    the recorded caps, resumes the cell and ends equal to an uninterrupted AVX2 run bit for bit."""
    folder = tmp_path / "images"
    make_image_folder(folder, per_class=PER_CLASS)
    with mlflow_server(f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts") as url:
        env = environment(tmp_path, url)
        for name in AVX2_CAPS:
            env.pop(name, None)
        _protocol, _storage, worker = queue_up(tmp_path, env, folder)
        logs = {name: tmp_path / f"{name}.log" for name in ("first", "matching")}
        timing = ["--heartbeat", "1", "--grace", "600"]
        first = start(
            [*worker, "--output-dir", str(tmp_path / "out-a"), *timing],
            env | AVX2_CAPS,
            tmp_path,
            logs["first"],
        )
        wait_for("an uploaded epoch", lambda: upload_lines(logs["first"]), timeout=900, logs=logs)
        wait_for("a step of epoch 2", lambda: mid_epoch(logs["first"], 2), timeout=600, logs=logs)
        os.kill(first.pid, signal.SIGTERM)
        assert first.wait(timeout=300) == 75, tail(logs["first"])
        matching = start(
            [*worker, "--output-dir", str(tmp_path / "out-b"), "--match-kernels", *timing],
            env,
            tmp_path,
            logs["matching"],
        )
        assert matching.wait(timeout=900) == 0, tail(logs["matching"])
        text = logs["matching"].read_text()
        caps = " ".join(f"{k}={v}" for k, v in AVX2_CAPS.items())
        assert f"starting again under {caps}" in text, tail(logs["matching"])
        assert "Traceback" not in text and "[finished]" in text, tail(logs["matching"])
        client = MlflowClient(url)
        run = cell_run(client)
        assert run.info.status == "FINISHED", run.data.tags
        assert "kernel_changed" not in run.data.tags, run.data.tags["kernel_changed"]
        assert run.data.params["kernel.onednn_max_isa"] == "AVX2", run.data.params
        assert_cell_equals_reference(
            client, run, tmp_path / "out-b", reference_avx2, tmp_path / "dl"
        )
