"""Transfer studies through MLflow: sources from runs, the whole protocol, test split untouched before selection."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch
import yaml
from click.testing import CliRunner
from mlflow.tracking import MlflowClient
from sklearn.metrics import cohen_kappa_score

from studies.cli import main
from studies.runtime.options import StudyOptions
from studies.runtime.study_kind import open_study
from studies.transfer import transfer_study
from conftest import assert_close
from data_fixtures import md5
from test_transfer import one_thread  # noqa: F401 (autouse fixture)
from test_transfer import RecordingSplit, learnable_retina, make_source_checkpoint, protocol_dict
from reports.transfer.transfer_blocks import transfer_markdown
from tracking.kinds import transfer_runs
from tracking.kinds.transfer_runs import transfer_section
from workbench.convert.checkpoints import sha256_file
from workbench.data import NORM_STATS, checksums
from workbench.protocol.transfer import SourceSpec
from workbench.transfer.runner import TestSplitGuard
from workbench.transfer.source_model import load_local_source


SOURCE_PROTOCOL = """\
name: tiny_source
description: the ablation protocol whose cell is the transfer source
dataset: {name: cifar10, train_size: 40, val_size: 10}
model: {name: cifar_vit, image_size: 16, patch_size: 8, dim: 16, depth: 2, heads: 2}
run: {batch_size: 8}
arms: [{name: vit, reference: true}]
seeds: [0]
"""


def log_source_run(
    tmp_path: Path, experiment: str = "source", tags: dict | None = None
) -> tuple[str, Path]:
    """An MLflow run holding a workbench checkpoint and config.json, as `workbench train` logs them."""
    folder = tmp_path / "source_run"
    checkpoint = make_source_checkpoint(folder)
    client = MlflowClient()
    exp = client.create_experiment(experiment)
    run_id = client.create_run(exp, tags=tags or {}).info.run_id
    client.log_param(run_id, "data.display_name", "CIFAR-10 (JPEG copy)")
    client.log_artifact(run_id, str(checkpoint), artifact_path="checkpoints")
    client.log_artifact(run_id, str(folder / "config.json"))
    client.set_terminated(run_id)
    return run_id, checkpoint


def test_source_loads_from_an_mlflow_run(mlflow_store, tmp_path):
    run_id, checkpoint = log_source_run(tmp_path)
    expected = torch.load(checkpoint, weights_only=True)["model"]
    for uri in (f"runs:/{run_id}", f"runs:/{run_id}/checkpoints/best.pt", f"runs:/{run_id}/model"):
        source = transfer_study.resolve_source(
            SourceSpec(weights="runs:/unused"), uri, tmp_path / "p.yaml", tmp_path / "dl" / uri[-5:]
        )
        state = source.model.state_dict()
        assert state.keys() == expected.keys() and all(
            torch.equal(state[k], expected[k]) for k in state
        ), uri
        info = source.info
        # trained here, not a published checkpoint: never called pretrained, described as what it is
        assert (info.kind, info.run_id, info.uri, info.pretrained) == (
            "workbench-checkpoint",
            run_id,
            uri,
            False,
        )
        assert (
            info.provenance()
            == f"a checkpoint trained with this workbench (run {run_id}), not a published one"
        )
        assert (
            "pretrained" not in info.label()
            and info.as_params()["source.provenance"] == info.provenance()
        )
        assert info.sha256 == sha256_file(checkpoint) and source.norm == NORM_STATS["cifar10"]
    assert "logged model" in info.description and "on CIFAR-10 (JPEG copy)" in info.description
    with pytest.raises(ValueError, match="no such run"):
        transfer_study.resolve_source(
            SourceSpec(weights="runs:/0123456789abcdef"),
            None,
            tmp_path / "p.yaml",
            tmp_path / "dl2",
        )


def test_source_from_a_finished_cell_of_an_ablation_protocol(mlflow_store, tmp_path):
    from studies.runtime.study_protocol import load_protocol

    (tmp_path / "tiny_source.yaml").write_text(SOURCE_PROTOCOL)
    spec = SourceSpec(weights="protocol:tiny_source/vit/seed0")
    with pytest.raises(
        ValueError,
        match="run `workbench ablate --protocol studies/protocols/tiny_source.yaml` first",
    ):
        transfer_study.resolve_source(spec, None, tmp_path / "transfer.yaml", tmp_path / "dl")
    protocol_hash = load_protocol(tmp_path / "tiny_source.yaml").hash
    run_id, checkpoint = log_source_run(
        tmp_path,
        "tiny_source",
        # as a real cell's run: the study's record is found by its runs' protocol_name tag
        {
            "protocol_name": "tiny_source",
            "protocol_hash": protocol_hash,
            "arm": "vit",
            "seed": "0",
            "cell": "true",
        },
    )
    source = transfer_study.resolve_source(spec, None, tmp_path / "transfer.yaml", tmp_path / "dl")
    assert source.info.run_id == run_id and source.info.sha256 == sha256_file(checkpoint)
    assert source.info.uri == "protocol:tiny_source/vit/seed0"


def test_a_pinned_sha256_is_checked_before_any_run_opens(mlflow_store, tmp_path):
    weights = tmp_path / "tiny.bin"
    weights.write_bytes(b"a tiny checkpoint file the pin is checked against")
    actual, wrong = sha256_file(weights), "0" * 64

    def transfer(sha256: str):
        data = protocol_dict(source={"weights": str(weights), "sha256": sha256})
        path = tmp_path / f"{data['name']}.yaml"
        path.write_text(yaml.safe_dump(data))
        return CliRunner().invoke(
            main,
            [
                "transfer",
                "--protocol",
                str(path),
                "--allow-dirty",
                "--device",
                "cpu",
                "--output-dir",
                str(tmp_path / "out"),
                "--data-path",
                str(tmp_path / "none.npz"),
            ],
        )

    refused = transfer(wrong)
    lines = refused.output.strip().splitlines()
    assert refused.exit_code == 1 and len(lines) == 1, refused.output
    assert f"source.sha256: expected {wrong}, but source.weights={str(weights)!r}" in lines[0], (
        lines[0]
    )
    assert f"has sha256 {actual}" in lines[0] and "Traceback" not in refused.output, lines[0]
    client = MlflowClient()
    assert [
        r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
    ] == []
    # The right pin passes the check: the next refusal is the file's content (not timm weights without a model).
    passed = transfer(actual)
    assert (
        passed.exit_code == 1
        and "source.sha256" not in passed.output
        and "need source.model" in passed.output
    ), passed.output

    # runs:/ sources are checked on the downloaded file
    run_id, checkpoint = log_source_run(tmp_path)
    spec = SourceSpec(weights=f"runs:/{run_id}", sha256=wrong)
    with pytest.raises(
        ValueError,
        match=f"expected {wrong}, but source.weights='runs:/{run_id}' "
        rf"\(run {run_id}, best.pt\) has sha256 {sha256_file(checkpoint)}",
    ):
        transfer_study.resolve_source(spec, None, tmp_path / "p.yaml", tmp_path / "dl")
    source = transfer_study.resolve_source(
        replace(spec, sha256=sha256_file(checkpoint)), None, tmp_path / "p.yaml", tmp_path / "dl"
    )
    assert source.info.sha256 == sha256_file(checkpoint) and source.info.run_id == run_id


def test_local_timm_safetensors_source_goes_through_the_strict_mapping(tmp_path):
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False).eval()
    path = tmp_path / "model.safetensors"
    save_file(reference.state_dict(), str(path))
    source = load_local_source(path, "vit_tiny_patch16_224")
    info = source.info
    assert info.kind == "timm-local" and info.sha256 == sha256_file(path)
    assert info.mapping.startswith(
        "152 of 152 source tensors used, 152 of 152 target tensors filled"
    )
    assert source.norm.mean == (0.5, 0.5, 0.5) and "pretrained_cfg" in info.norm_from
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert_close(source.model(x), reference(x), 1e-5, "glass-box source vs timm")


def write_protocol(tmp_path: Path, run_id: str, seeds=(0, 1)) -> Path:
    data = protocol_dict(source={"weights": f"runs:/{run_id}"}, seeds=list(seeds))
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow  # moved from the default tier to keep it under 5 min (docs/testing.md)
def test_protocol_end_to_end_selection_never_reads_the_test_split(
    mlflow_store, tmp_path, monkeypatch
):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    learnable_retina(tmp_path / "retinamnist.npz")
    # our file is 'official'
    monkeypatch.setitem(checksums.RETINAMNIST_MD5, 28, md5(tmp_path / "retinamnist.npz"))
    run_id, _ = log_source_run(tmp_path)
    path = write_protocol(tmp_path, run_id)
    events: list = []
    prepare = transfer_study.prepare_transfer_data

    def recording_prepare(*args, **kwargs):  # the test split, wrapped so every read is recorded
        data = prepare(*args, **kwargs)
        return type(data)(**{**vars(data), "test": RecordingSplit(data.test, events)})

    release, evaluate, select = (
        TestSplitGuard.release,
        transfer_study.evaluate_on_test,
        transfer_study.select_cell,
    )
    selected, interrupted = [], []

    def evaluate_failing_once(selection, *args):  # an interruption between the phases, for one cell
        if (selection.regime, selection.seed) == ("full_ft", 1) and not interrupted:
            interrupted.append(selection.regime)
            raise RuntimeError("interrupted before the test evaluation")
        return evaluate(selection, *args)

    monkeypatch.setattr(transfer_study, "prepare_transfer_data", recording_prepare)
    monkeypatch.setattr(
        TestSplitGuard,
        "release",
        lambda self: (events.append(("selection finished", "")), release(self)),
    )
    monkeypatch.setattr(transfer_study, "evaluate_on_test", evaluate_failing_once)
    monkeypatch.setattr(
        transfer_study,
        "select_cell",
        lambda cell, *a: (selected.append(cell.key), select(cell, *a))[1],
    )
    protocol = open_study(transfer_study.TransferStudy, str(path), allow_dirty=True)
    outcomes = transfer_study.run_transfer(
        protocol,
        path,
        StudyOptions(
            output_dir=tmp_path / "out",
            device="cpu",
            data_path=str(tmp_path / "retinamnist.npz"),
            allow_dirty=True,
        ),
    )
    assert [o.status for o in outcomes] == ["finished"] * 5 + ["failed"], [
        o.message for o in outcomes
    ]
    assert len(selected) == 6

    first_read = next(i for i, e in enumerate(events) if e[0] == "test split read")
    released = events.index(("selection finished", ""))
    assert released < first_read, (
        f"test split read before selection finished: {events[: first_read + 1]}"
    )

    # Rerun after a commit that touches no result code: finished cells are skipped (cells are keyed by the
    # code fingerprint, not the commit); the interrupted one keeps its selection and is only tested.
    later = lambda: {"git_commit": "a-later-docs-commit", "git_dirty": "false"}  # noqa: E731
    monkeypatch.setattr("tracking.store.session.git_state", later)
    monkeypatch.setattr("tracking.record.protocol_runs.git_state", later)
    # the command, as a user runs it
    again = CliRunner().invoke(
        main,
        [
            "transfer",
            "--protocol",
            str(path),
            "--allow-dirty",
            "--device",
            "cpu",
            "--data-path",
            str(tmp_path / "retinamnist.npz"),
            "--output-dir",
            str(tmp_path / "out"),
        ],
    )
    assert again.exit_code == 0, again.output
    assert again.output.count("[skipped] ") == 5 and again.output.count("[finished] ") == 1, (
        again.output
    )
    assert "cells: 1 run, 5 already finished (skipped), 0 failed" in again.output, again.output
    assert len(selected) == 6, f"a finished selection was retrained: {selected}"

    client = MlflowClient()
    exp = client.get_experiment_by_name("tiny_transfer").experiment_id
    cells = client.search_runs([exp], "tags.cell = 'true'")
    assert len(cells) == 6 and {r.info.status for r in cells} == {"FINISHED"}
    # The commit is recorded (the cell completed after it says so), the identity is the code fingerprint.
    assert sorted(r.data.tags["git_commit"] == "a-later-docs-commit" for r in cells) == [
        False
    ] * 5 + [True]
    assert {r.data.params["code_fingerprint"] for r in cells} == {
        transfer_runs.transfer_code_fingerprint()
    }
    assert {r.data.tags["lease.released"] == r.data.tags["lease.token"] for r in cells} == {True}
    (parent,) = client.search_runs([exp], "tags.parent = 'true'")
    assert parent.info.status == "FINISHED" and parent.data.metrics["cells_finished"] == 6, (
        parent.data.metrics
    )
    for run in cells:
        m, tags = run.data.metrics, run.data.tags
        assert m["test_metrics_agree"] == 1.0 and tags["test_metrics_agreement"].startswith("agree")
        assert m["selection_proof_passed"] == 1.0 and tags["phase"] == "tested"
        local = mlflow.artifacts.download_artifacts(
            run_id=run.info.run_id,
            artifact_path="predictions/test.csv",
            dst_path=str(tmp_path / "dl" / run.info.run_id),
        )
        table = pd.read_csv(local)
        sk = cohen_kappa_score(table["label"], table["predicted"], weights="quadratic")
        assert abs(m["test_qwk"] - sk) <= 1e-12 and m["test_qwk"] == m["test_file_qwk"], (
            m["test_qwk"],
            sk,
        )
        assert m["test_qwk_ci_low"] <= m["test_qwk"] <= m["test_qwk_ci_high"]
        assert (
            run.data.params["source.run_id"] == run_id
            and run.data.params["evaluation.n_resamples"] == "1000"
        )
        history = client.get_metric_history(run.info.run_id, "val_qwk")
        assert len(history) == {"linear": 8, "partial": 3, "full": 2}[tags["regime_kind"]]

    parent = client.search_runs(
        [exp], "tags.parent = 'true'", order_by=["attributes.start_time DESC"]
    )[0]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "transfer")}
    assert {
        "transfer/section.md",
        "transfer/kappa_table.csv",
        "transfer/comparisons.csv",
    } <= artifacts
    section = transfer_section("tiny_transfer")
    assert len(section.kappa_table) == 6 and section.kappa_table["logged_equals_file"].all()
    assert set(section.comparisons["seed"]) == {"0", "1", "all"}
    markdown = transfer_markdown(section)
    # a source trained here is described as what it is, never as a published pretrained checkpoint
    assert (
        f"runs:/{run_id}" in markdown
        and "weights: a checkpoint trained with this workbench" in markdown
    )
    assert "pretrained checkpoint" not in markdown and "NOT PRETRAINED" not in markdown
    assert list(section.summary["regime"]) == ["linear_probe", "partial_ft", "full_ft"]
    assert list(section.summary["seeds"]) == [2, 2, 2]


@pytest.mark.slow  # trains 4 tiny cells (a linear probe and a scratch regime at 2 seeds), then reruns and reports
def test_scratch_regime_beside_a_linear_probe_from_a_pinned_source(
    mlflow_store, tmp_path, monkeypatch
):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    learnable_retina(tmp_path / "retinamnist.npz")
    # our file is 'official'
    monkeypatch.setitem(checksums.RETINAMNIST_MD5, 28, md5(tmp_path / "retinamnist.npz"))
    run_id, checkpoint = log_source_run(tmp_path)
    pin = sha256_file(checkpoint)
    data = protocol_dict(
        source={"weights": f"runs:/{run_id}", "sha256": pin},
        regimes=[
            {"name": "linear_probe", "kind": "linear", "reference": True, "epochs": 3, "lr": 3e-3},
            {"name": "scratch", "kind": "scratch", "epochs": 2, "lr": 1e-3, "warmup_epochs": 1},
        ],
    )
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    args = [
        "transfer",
        "--protocol",
        str(path),
        "--allow-dirty",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--data-path",
        str(tmp_path / "retinamnist.npz"),
        "--output-dir",
        str(tmp_path / "out"),
    ]
    first = CliRunner().invoke(main, args)
    assert (
        first.exit_code == 0
        and "cells: 4 run, 0 already finished (skipped), 0 failed" in first.output
    ), first.output[-3000:]
    # a rerun skips every finished cell, the scratch ones too
    again = CliRunner().invoke(main, args)
    assert (
        again.exit_code == 0
        and "cells: 0 run, 4 already finished (skipped), 0 failed" in again.output
    ), again.output[-3000:]

    client = MlflowClient()
    exp = client.get_experiment_by_name("tiny_transfer").experiment_id
    cells = client.search_runs([exp], "tags.cell = 'true'")
    assert (
        sorted((r.data.tags["regime_kind"], r.info.status) for r in cells)
        == [("linear", "FINISHED")] * 2 + [("scratch", "FINISHED")] * 2
    )
    total = sum(
        v.numel()
        for k, v in torch.load(checkpoint, weights_only=True)["model"].items()
        if not k.startswith("head.")
    )
    for run in cells:
        params, m = run.data.params, run.data.metrics
        assert (
            params["source.sha256"] == pin == params["source.sha256_pin"]
            and params["source.run_id"] == run_id
        )
        assert m["selection_proof_passed"] == 1.0 and m["test_metrics_agree"] == 1.0, m
        if run.data.tags["regime_kind"] == "scratch":
            seed = params["seed"]
            assert (
                params["regime.pretrained"] == "False" and "NOT PRETRAINED" in params["regime.init"]
            )
            assert f"derive_seed({seed}, 'init')" in params["regime.init"], params["regime.init"]
            assert len(client.get_metric_history(run.info.run_id, "val_qwk")) == 2
            assert m["trainable_parameters"] == total + 5 * 16 + 5, (
                m["trainable_parameters"],
                total,
            )
    for parent in client.search_runs(
        [exp], "tags.parent = 'true'"
    ):  # the source as pinned and as read, on the parent
        assert parent.data.params["source.sha256_pin"] == pin == parent.data.params["source.sha256"]
        assert parent.data.params["source.run_id"] == run_id

    out = tmp_path / "reports"
    result = CliRunner().invoke(main, ["report", "--protocol", str(path), "--out-dir", str(out)])
    assert result.exit_code == 0, result.output[-3000:]
    report = (out / "tiny_transfer" / "report.md").read_text()
    assert (
        "scratch (trained from scratch: the source's architecture, seeded random init, not pretrained)"
        in report
    )
    assert "every parameter, trained from scratch" in report and f"pinned sha256 {pin}" in report, (
        report[:4000]
    )
    assert "pretrained checkpoint" not in report


def test_report_command_recognises_transfer_protocols():
    from reports.collect import protocol_file
    from workbench.protocol import load_any

    assert (
        protocol_file("studies/protocols/retina_transfer_smoke.yaml").name
        == "retina_transfer_smoke.yaml"
    )
    assert load_any(protocol_file("retina_transfer")).kind == "transfer"
    assert load_any(protocol_file("studies/protocols/smoke.yaml")).kind == "ablation"
    assert protocol_file("no_such_protocol") is None


def test_ctrl_c_ends_every_held_run_killed_and_the_rerun_only_tests_the_selected_cells(
    mlflow_store, tmp_path, monkeypatch
):
    """Ctrl-C between the phases: no run is left RUNNING, and nothing selected is trained again."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    learnable_retina(tmp_path / "retinamnist.npz")
    monkeypatch.setitem(checksums.RETINAMNIST_MD5, 28, md5(tmp_path / "retinamnist.npz"))
    run_id, _ = log_source_run(tmp_path)
    path = write_protocol(tmp_path, run_id, seeds=(0,))
    evaluate, select = transfer_study.evaluate_on_test, transfer_study.select_cell
    selected, tested = [], []

    def interrupted_at_the_second(selection, *args):
        if len(tested) == 1:
            raise KeyboardInterrupt
        tested.append(selection.regime)
        return evaluate(selection, *args)

    monkeypatch.setattr(transfer_study, "evaluate_on_test", interrupted_at_the_second)
    monkeypatch.setattr(
        transfer_study,
        "select_cell",
        lambda cell, *a: (selected.append(cell.key), select(cell, *a))[1],
    )
    protocol = open_study(transfer_study.TransferStudy, str(path), allow_dirty=True)
    args = (
        protocol,
        path,
        StudyOptions(
            output_dir=tmp_path / "out",
            device="cpu",
            data_path=str(tmp_path / "retinamnist.npz"),
            allow_dirty=True,
        ),
    )
    with pytest.raises(KeyboardInterrupt):
        transfer_study.run_transfer(*args)
    client = MlflowClient()
    exp = client.get_experiment_by_name("tiny_transfer").experiment_id
    cells = client.search_runs([exp], "tags.cell = 'true'")
    statuses = sorted((r.data.tags["phase"], r.info.status) for r in cells)
    assert statuses == [("selected", "KILLED"), ("selected", "KILLED"), ("tested", "FINISHED")], (
        statuses
    )
    assert all(
        r.data.tags.get("end_reason", "").startswith("KeyboardInterrupt")
        for r in cells
        if r.info.status == "KILLED"
    )
    (parent,) = client.search_runs([exp], "tags.parent = 'true'")
    assert (
        parent.info.status == "KILLED"
        and "KeyboardInterrupt" in parent.data.tags["last_execution_outcome"]
    )

    monkeypatch.setattr(transfer_study, "evaluate_on_test", evaluate)
    outcomes = transfer_study.run_transfer(*args)
    assert [o.status for o in outcomes] == ["skipped", "finished", "finished"], [
        o.message for o in outcomes
    ]
    assert len(selected) == 3, f"a selection was trained again: {selected}"
    cells = client.search_runs([exp], "tags.cell = 'true'")
    assert len(cells) == 3 and {r.info.status for r in cells} == {"FINISHED"}
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
