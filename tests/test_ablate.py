"""ablate: seed-paired child runs, skip-finished resumption (also after SIGKILL), frozen hashes, isolated failures."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from studies.ablation import ablate
from data_fixtures import make_image_folder
from studies.ablation.ablate import open_protocol, run_protocol
from studies.runtime.options import StudyOptions
from studies.runtime.study_protocol import ProtocolDirtyError, ProtocolFrozenError

PROTOCOL = """\
name: {name}
description: tiny image-folder protocol for tests
dataset: {{name: image_folder, val_size: 6, split_seed: 3, hflip: true}}
model: {{name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 1, heads: 2, mlp_hidden: 32}}
optim: {{lr: 0.003}}
run: {{epochs: {epochs}, batch_size: 8, checkpoint_every_steps: 2, evaluate_test: true}}
arms:
  - {{name: vit, reference: true}}
  - {{name: cnn, overrides: {{model: {{name: fmnist_cnn, in_channels: 3, num_classes: 3}}}}}}
seeds: [0, 1]
"""


def options_for(tmp_path: Path, folder: Path) -> StudyOptions:
    """What the tests' ablate executions pass on: CPU, the test's image folder, a dirty protocol file."""
    return StudyOptions(
        output_dir=tmp_path / "out", device="cpu", data_path=str(folder), allow_dirty=True
    )


@pytest.fixture
def setup(tmp_path, mlflow_store, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    return tmp_path, folder


def write_protocol(tmp_path: Path, name: str = "tiny", epochs: int = 2) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(PROTOCOL.format(name=name, epochs=epochs))
    return path


def cell_runs(client: MlflowClient, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], filter_string="tags.cell = 'true'")


def test_cells_are_paired_child_runs_and_a_rerun_skips_them(setup):
    tmp_path, folder = setup
    path = write_protocol(tmp_path)
    protocol = open_protocol(str(path), allow_dirty=True)
    outcomes = run_protocol(protocol, path, options_for(tmp_path, folder))
    assert [o.status for o in outcomes] == ["finished"] * 4, [o.message for o in outcomes]
    client = MlflowClient()
    runs = cell_runs(client, "tiny")
    assert len(runs) == 4
    parents = {r.data.tags["mlflow.parentRunId"] for r in runs}
    (parent_id,) = parents
    parent = client.get_run(parent_id)
    assert parent.data.tags["protocol_hash"] == protocol.hash and parent.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent_id, "protocol")} == {
        "protocol/tiny.yaml",
        "protocol/canonical.json",
    }
    for r in runs:
        assert r.data.tags["allow_dirty"] == "true" and r.info.status == "FINISHED"
    # pairing: every arm of a seed saw the same split and data
    by_seed = {}
    for r in runs:
        by_seed.setdefault(r.data.tags["seed"], set()).add(
            (
                r.data.params["data.split_fingerprint"],
                r.data.params["data.fingerprint"],
                r.data.params["run.seed"],
            )
        )
    assert all(len(v) == 1 for v in by_seed.values()), by_seed
    assert {r.data.tags["arm"] for r in runs} == {"vit", "cnn"}

    again = run_protocol(protocol, path, options_for(tmp_path, folder))
    assert [o.status for o in again] == ["skipped"] * 4
    assert len(cell_runs(client, "tiny")) == 4


def test_cells_of_other_code_are_named_in_one_line_by_ablate_and_status(setup, capsys):
    """A store whose cells finished with other code (as after the result library changed): one line, no training."""
    from click.testing import CliRunner
    from mlflow.entities import Param, RunStatus, RunTag

    from studies.cli import main

    tmp_path, _ = setup
    path = write_protocol(tmp_path, epochs=1)
    protocol = open_protocol(str(path), allow_dirty=True)
    assert "other code" not in capsys.readouterr().out  # a new store: nothing to say
    client = MlflowClient()
    experiment = client.get_experiment_by_name("tiny").experiment_id
    for cell in protocol.cells():
        run = client.create_run(
            experiment,
            tags={
                "cell": "true",
                "protocol_name": "tiny",
                "protocol_hash": protocol.hash,
                "arm": cell.arm,
                "seed": str(cell.seed),
                "git_commit": "abc123" * 7,
            },
        )
        client.log_batch(
            run.info.run_id, params=[Param("code_fingerprint", "e" * 16)], tags=[RunTag("x", "y")]
        )
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FINISHED))
    open_protocol(str(path), allow_dirty=True)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "other code" in x]
    assert (
        f"4 of 4 cells finished here with other code (code {'e' * 16}, commit abc123abc123)" in line
    ), line
    assert "trains them again" in line and "git worktree add ../old-code abc123abc123" in line, line
    result = CliRunner().invoke(main, ["status", "--protocol", str(path)])
    assert result.exit_code == 0, result.output
    assert (
        sum("4 of 4 cells finished here with other code" in x for x in result.output.splitlines())
        == 1
    ), result.output


def test_status_finds_a_study_whose_experiment_was_renamed_as_ablate_does(setup):
    """ablate finds a study by its tags after the experiment is renamed in the UI; so does status."""
    from click.testing import CliRunner
    from mlflow.entities import Param, RunStatus

    from studies.cli import main
    from tracking.record.protocol_runs import study_key
    from workbench.train.fingerprint import current_code_fingerprint

    tmp_path, _ = setup
    path = write_protocol(tmp_path, epochs=1)
    protocol = open_protocol(str(path), allow_dirty=True)
    client = MlflowClient()
    experiment = client.get_experiment_by_name("tiny").experiment_id
    parent = client.create_run(
        experiment,
        tags={
            "parent": "true",
            "protocol_name": "tiny",
            "protocol_hash": protocol.hash,
            "study_key": study_key(protocol),
        },
    ).info.run_id
    for cell in protocol.cells():
        run = client.create_run(
            experiment,
            tags={
                "cell": "true",
                "protocol_name": "tiny",
                "protocol_hash": protocol.hash,
                "arm": cell.arm,
                "seed": str(cell.seed),
                "mlflow.parentRunId": parent,
            },
        )
        client.log_batch(
            run.info.run_id, params=[Param("code_fingerprint", current_code_fingerprint())]
        )
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FINISHED))
    client.set_terminated(parent, RunStatus.to_string(RunStatus.FINISHED))
    client.rename_experiment(experiment, "tiny (renamed in the UI)")
    result = CliRunner().invoke(main, ["status", "--protocol", str(path)])
    assert result.exit_code == 0, result.output
    assert "never run here" not in result.output, result.output
    assert f"parent run {parent}: FINISHED" in result.output, result.output
    assert "next ablate: skip it x4" in result.output, result.output
    assert client.get_experiment_by_name("tiny") is None, "status created an experiment"


@pytest.mark.parametrize("mapped", [True, False], ids=["re-pinned", "other code"])
def test_a_study_stored_under_an_older_fingerprint_of_the_same_code_still_counts(
    setup, monkeypatch, mapped
):
    """A parent and finished cells stored under a fingerprint ``SAME_CODE`` maps to this code's are
    this study's: status skips the cells and finds the parent, ablate queues none of them, and a
    keyed kind's cell finds its finished run by its old key. Unmapped, the same runs are other code."""
    from click.testing import CliRunner
    from mlflow.entities import Param, RunStatus

    from studies.cli import main
    from studies.runtime.study_execution import finished_cells
    from tracking.record.cell_runs import same_code_key
    from tracking.record.protocol_runs import study_key, study_runs
    from workbench import code_history
    from workbench.train.fingerprint import current_code_fingerprint

    old, current = "0123456789abcdef", current_code_fingerprint()
    if mapped:
        monkeypatch.setitem(code_history._NEWER, old, current)
    tmp_path, _ = setup
    path = write_protocol(tmp_path, epochs=1)
    protocol = open_protocol(str(path), allow_dirty=True)
    client = MlflowClient()
    experiment = client.get_experiment_by_name("tiny").experiment_id
    parent = client.create_run(
        experiment,
        tags={
            "parent": "true",
            "protocol_name": "tiny",
            "protocol_hash": protocol.hash,
            "study_key": study_key(protocol, old),
        },
    ).info.run_id
    for cell in protocol.cells():
        run = client.create_run(
            experiment,
            tags={
                "cell": "true",
                "protocol_name": "tiny",
                "protocol_hash": protocol.hash,
                "arm": cell.arm,
                "seed": str(cell.seed),
                "mlflow.parentRunId": parent,
                "run_key": f"{cell.key}|{old}",
            },
        )
        client.log_batch(run.info.run_id, params=[Param("code_fingerprint", old)])
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FINISHED))
    client.set_terminated(parent, RunStatus.to_string(RunStatus.FINISHED))
    result = CliRunner().invoke(main, ["status", "--protocol", str(path)])
    assert result.exit_code == 0, result.output
    cells = {(c.arm, c.seed) for c in protocol.cells()}
    key_for = lambda code: f"{protocol.cells()[0].key}|{code}"  # noqa: E731
    if mapped:
        assert "next ablate: skip it x4" in result.output, result.output
        assert f"parent run {parent}: FINISHED" in result.output, result.output
        assert finished_cells(protocol) == cells
        assert [r.info.run_id for r in study_runs(protocol)] == [parent]
        assert same_code_key("tiny", key_for, current) == key_for(old)
    else:
        assert "skip it x4" not in result.output, result.output
        assert finished_cells(protocol) == set() and study_runs(protocol) == []
        assert same_code_key("tiny", key_for, current) == key_for(current)


@pytest.mark.slow  # 12-21 s on 2 busy cores: keeps the default tier under 5 minutes (docs/testing.md)
def test_a_changed_protocol_with_the_same_name_is_refused(setup):
    tmp_path, folder = setup
    path = write_protocol(tmp_path, epochs=1)
    protocol = open_protocol(str(path), allow_dirty=True)
    run_protocol(protocol, path, options_for(tmp_path, folder))
    path.write_text(PROTOCOL.format(name="tiny", epochs=2))
    with pytest.raises(
        ProtocolFrozenError, match=f"already run with hash {protocol.short_hash}.*new protocol file"
    ):
        open_protocol(str(path), allow_dirty=True)


def test_an_uncommitted_protocol_is_refused_without_allow_dirty(setup):
    tmp_path, _ = setup
    path = write_protocol(tmp_path)
    with pytest.raises(ProtocolDirtyError, match="tiny.yaml") as info:
        open_protocol(str(path), allow_dirty=False)
    assert "--allow-dirty" in str(info.value), str(info.value)  # the option, by its name


def test_ablate_ends_with_each_cells_test_accuracy_and_the_report_command(setup):
    """What `make run` shows last: the test accuracy of each cell, then the command of the report."""
    from click.testing import CliRunner

    from studies.cli import main

    tmp_path, folder = setup
    path = write_protocol(tmp_path, epochs=1)
    path.write_text(path.read_text().replace("seeds: [0, 1]", "seeds: [0]"))
    result = CliRunner().invoke(
        main,
        [
            "ablate",
            "--protocol",
            str(path),
            "--allow-dirty",
            "--device",
            "cpu",
            "--data-path",
            str(folder),
            "--output-dir",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 0, result.output[-2000:]
    lines = [x for x in result.output.splitlines() if x.strip()]
    finished = [x for x in lines if "best val accuracy" in x]
    assert len(finished) == 2 and all(
        re.search(r"; test accuracy \d\.\d{4}", x) for x in finished
    ), finished
    assert lines[-1] == "report: workbench report --protocol tiny", lines[-3:]


@pytest.mark.slow  # two ablate executions (about 15 s idle): moved when the default tier passed 5 minutes
def test_one_failing_cell_loses_nothing_and_the_rerun_runs_only_it(setup, monkeypatch):
    tmp_path, folder = setup
    path = write_protocol(tmp_path)
    protocol = open_protocol(str(path), allow_dirty=True)
    real = ablate.train_one

    def flaky(cfg, data, **kw):
        if kw["run_name"] == "cnn-seed0":
            raise RuntimeError("CUDA error: an illegal memory access (simulated)")
        return real(cfg, data, **kw)

    monkeypatch.setattr(ablate, "train_one", flaky)
    first = run_protocol(protocol, path, options_for(tmp_path, folder))
    assert [o.status for o in first] == ["finished", "failed", "finished", "finished"]
    assert "illegal memory access" in first[1].message
    monkeypatch.setattr(ablate, "train_one", real)
    second = run_protocol(protocol, path, options_for(tmp_path, folder))
    assert [o.status for o in second] == ["skipped", "finished", "skipped", "skipped"]


def ablate_cmd(tmp_path: Path, path: Path, folder: Path) -> tuple[list[str], dict]:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "studies.cli",
        "ablate",
        "--protocol",
        str(path),
        "--allow-dirty",
        "--data-path",
        str(folder),
        "--device",
        "cpu",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    return cmd, env


def kill_when(cmd: list[str], env: dict, cwd: Path, ready, what: str) -> None:
    """Start ``cmd``, SIGKILL it as soon as ``ready()`` is true."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not ready():
        time.sleep(0.05)
    assert proc.poll() is None, f"ablate ended before {what}:\n" + proc.stdout.read()[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def one_cell_done_one_under_way(client: MlflowClient):
    exp = client.get_experiment_by_name("tiny")
    runs = cell_runs(client, "tiny") if exp else []
    return any(r.info.status == "FINISHED" for r in runs) and len(runs) >= 2


@pytest.mark.slow  # kill-and-resume in the default tier: test_train, test_train_mlflow and test_ablate_record
def test_sigkilled_ablate_resumes_only_what_is_missing(setup):
    from test_ablate_record import assert_clean

    tmp_path, folder = setup
    path = write_protocol(tmp_path, epochs=3)
    cmd, env = ablate_cmd(tmp_path, path, folder)
    client = MlflowClient()
    kill_when(
        cmd, env, tmp_path, lambda: one_cell_done_one_under_way(client), "a cell was under way"
    )
    before = {r.info.run_id: r.info.status for r in cell_runs(client, "tiny")}
    assert "RUNNING" in before.values() and "FINISHED" in before.values(), before

    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finished_before = sum(s == "FINISHED" for s in before.values())
    assert f"{finished_before} already finished (skipped)" in done.stdout
    killed = [rid for rid, s in before.items() if s == "RUNNING"]
    # (killed before its first checkpoint, a cell restarts from scratch, in its own run all the same)
    assert re.search(
        rf"(resumed from epoch \d step \d+|restarted from scratch) in run {killed[0]}",
        done.stdout + done.stderr,
    ), done.stdout[-3000:]
    # the dead execution's runs: KILLED first
    assert f"marked run {killed[0]}" in done.stdout + done.stderr
    after = cell_runs(client, "tiny")
    assert len(after) == 4 and all(r.info.status == "FINISHED" for r in after)
    assert set(before) <= {r.info.run_id for r in after}, (
        "the interrupted cell continued in its own run"
    )
    for r in after:
        steps = [m.step for m in client.get_metric_history(r.info.run_id, "val_accuracy")]
        assert steps == [1, 2, 3], f"{r.data.tags['mlflow.runName']}: epochs logged {steps}"
    assert_clean(client, "tiny", 4)


def _summary_under_way(client: MlflowClient, epochs: int) -> bool:
    exp = client.get_experiment_by_name("tiny")
    for r in cell_runs(client, "tiny") if exp else []:
        if r.info.status == "RUNNING" and r.data.metrics.get("val_accuracy") is not None:
            if len(client.get_metric_history(r.info.run_id, "val_accuracy")) == epochs:
                return True
    return False


def _parent_exists(client: MlflowClient) -> bool:
    exp = client.get_experiment_by_name("tiny")
    return bool(exp and client.search_runs([exp.experiment_id], "tags.parent = 'true'"))


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["training", "summary", "parent"])
def test_sigkill_at_any_moment_then_rerun_leaves_a_clean_record(setup, moment):
    """Killed during training, during a cell's summary, during parent creation: the rerun cleans up."""
    from reports.build import build_report
    from test_ablate_record import assert_clean

    tmp_path, folder = setup
    path = write_protocol(tmp_path, epochs=3)
    cmd, env = ablate_cmd(tmp_path, path, folder)
    client = MlflowClient()
    ready = {
        "training": lambda: one_cell_done_one_under_way(client),
        "summary": lambda: _summary_under_way(client, 3),
        "parent": lambda: _parent_exists(client),
    }[moment]
    kill_when(cmd, env, tmp_path, ready, f"the {moment} kill point")
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_clean(client, "tiny", 4)
    result = build_report(str(path), tmp_path / "reports")
    (parent,) = [
        r
        for r in client.search_runs(
            [client.get_experiment_by_name("tiny").experiment_id], "tags.parent = 'true'"
        )
    ]
    assert result.logged_to == [parent.info.run_id]
    assert {"report/report.md", "report/report.html"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id, "report")
    }


@pytest.mark.slow
def test_sigterm_ends_the_parent_and_the_cell_killed_nothing_left_running(setup):
    tmp_path, folder = setup
    path = write_protocol(tmp_path, epochs=3)
    cmd, env = ablate_cmd(tmp_path, path, folder)
    client = MlflowClient()
    proc = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 300
    while (
        time.monotonic() < deadline
        and proc.poll() is None
        and not one_cell_done_one_under_way(client)
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]
    assert "interrupted: parent run" in out and "ended KILLED" in out, out[-3000:]
    exp = client.get_experiment_by_name("tiny")
    everything = client.search_runs([exp.experiment_id], "")
    assert not [r for r in everything if r.info.status == "RUNNING"], [
        (r.info.run_name, r.info.status) for r in everything
    ]
    assert sorted(r.info.status for r in everything if r.data.tags.get("parent") == "true") == [
        "KILLED"
    ]
    assert "KILLED" in {r.info.status for r in cell_runs(client, "tiny")}


def _arms_command(tmp_path: Path, folder: Path) -> list[str]:
    path = write_protocol(tmp_path, epochs=1)
    common = ["--protocol", str(path), "--allow-dirty", "--device", "cpu"]
    return [*common, "--data-path", str(folder), "--output-dir", str(tmp_path / "out")]


def test_an_unknown_arm_is_refused_in_one_line_before_any_run_opens(setup):
    from click.testing import CliRunner

    tmp_path, folder = setup
    refused = CliRunner().invoke(
        ablate.ablate, [*_arms_command(tmp_path, folder), "--arms", "cnn,nope"]
    )
    assert refused.exit_code == 2 and "has no arm 'nope' (its arms: vit, cnn)" in refused.output, (
        refused.output
    )
    exp = MlflowClient().get_experiment_by_name("tiny")
    assert exp is None or not MlflowClient().search_runs([exp.experiment_id]), (
        "a refused --arms opened a run"
    )


@pytest.mark.slow  # three ablate executions of 2 cells each (about 40 s on 2 busy cores)
def test_arms_runs_only_those_cells_and_leaves_the_study_scheduled_for_the_rest(setup):
    """``ablate --arms``: the named arms' cells only, under the study's one parent, which ends
    SCHEDULED (not FAILED) since the other cells were left on purpose; a later full ablate runs
    only the rest and ends FINISHED."""
    from click.testing import CliRunner

    tmp_path, folder = setup
    common = _arms_command(tmp_path, folder)
    done = CliRunner().invoke(ablate.ablate, [*common, "--arms", "cnn"])
    assert done.exit_code == 0, done.output
    client = MlflowClient()
    runs = cell_runs(client, "tiny")
    assert sorted((r.data.tags["arm"], r.data.tags["seed"]) for r in runs) == [
        ("cnn", "0"),
        ("cnn", "1"),
    ]
    (parent_id,) = {r.data.tags["mlflow.parentRunId"] for r in runs}
    assert client.get_run(parent_id).info.status == "SCHEDULED"

    rest = CliRunner().invoke(ablate.ablate, common)
    assert rest.exit_code == 0 and "2 already finished (skipped)" in rest.output, rest.output
    runs = cell_runs(client, "tiny")
    assert len(runs) == 4 and {r.data.tags["mlflow.parentRunId"] for r in runs} == {parent_id}
    assert client.get_run(parent_id).info.status == "FINISHED"
