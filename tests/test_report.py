"""Report builder on runs made directly in a real local MLflow store, with hand-chosen predictions.

The runs look like what ``ablate`` logs (tags, params, per-epoch and final metrics,
prediction CSVs, a parent run with the protocol artifacts) but take no training, so every
expected number can be worked out by hand.
"""

from __future__ import annotations

import math
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from reports.build import build_report
from reports.collect import ReportError
from studies.runtime.study_protocol import load_protocol
from studies.tools.report import report as report_command
from tracking.record.protocol_runs import end_parent_run, start_parent_run
from workbench.models.registry import build_model, model_config
from workbench.estimates import decimals_for_error
from reports.content.rounding import fmt

PROTOCOL = """\
name: {name}
description: {description}
dataset: {{name: image_folder, val_size: 10, split_seed: 3}}
model: {{name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 1, heads: 2, mlp_hidden: 32}}
run: {{epochs: 3, batch_size: 8, evaluate_test: true}}
arms:
  - {{name: vit, reference: true}}
  - {{name: cnn, overrides: {{model: {{name: fmnist_cnn, in_channels: 3, num_classes: 3}}}}}}
  - {{name: wide, overrides: {{model: {{dim: 32}}}}}}
seeds: [0, 1, 2]
"""
VAL_LABELS = [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
TEST_LABELS = [0, 0, 1, 1, 2, 2]
# Correct predictions out of 10 (validation) and 6 (test), per arm and seed.
VAL_CORRECT = {"vit": {0: 8, 1: 7, 2: 9}, "cnn": {0: 6, 1: 7, 2: 5}, "wide": {0: 9, 1: 8, 2: 9}}
TEST_CORRECT = {"vit": {0: 5, 1: 4, 2: 5}, "cnn": {0: 3, 1: 4, 2: 4}, "wide": {0: 6, 1: 5, 2: 5}}
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
CODE_FINGERPRINT = "c0de" * 16
VIT_FIELDS = dict(
    image_size=8,
    patch_size=4,
    in_channels=3,
    num_classes=3,
    dim=16,
    depth=1,
    heads=2,
    mlp_hidden=32,
)
UMASK = 0o022
# Student-t 97.5% quantile, 2 degrees of freedom: 4.3027 in printed tables
T_975_DF2 = 4.302652729749462


def predictions_csv(labels: list[int], correct: int, seed: int) -> str:
    """The first ``correct`` examples right, the rest predicted as the next class; rows shuffled.

    Rows are written in a seed-dependent order (as a loader might) to check that the
    report lines arms up by example index, not by row.
    """
    rows = []
    for i, y in enumerate(labels):
        p = y if i < correct else (y + 1) % 3
        probs = [0.1, 0.1, 0.1]
        probs[p] = 0.8
        rows.append(f"{i},{y},{p},{-math.log(probs[y]):.9g}," + ",".join(f"{q:.9g}" for q in probs))
    order = np.random.default_rng(seed).permutation(len(rows))
    return (
        "index,label,predicted,loss,prob_0,prob_1,prob_2\n"
        + "\n".join(rows[i] for i in order)
        + "\n"
    )


@dataclass
class Store:
    """Handles on the runs a test made."""

    protocol_path: Path
    protocol: object
    parents: list[str] = field(default_factory=list)
    cells: dict[tuple[str, int], str] = field(default_factory=dict)  # (arm, seed) -> newest run id


def write_protocol(
    folder: Path, name: str = "study", description: str = "hand-made runs for report tests"
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(PROTOCOL.format(name=name, description=description))
    return path


def log_cell(
    client: MlflowClient,
    protocol,
    parent: str,
    arm: str,
    seed: int,
    val_correct: int,
    test_correct: int,
    commit: str = COMMIT_A,
    status: str = "FINISHED",
    end_time: int | None = None,
    with_test: bool = True,
) -> str:
    """One cell run as ablate makes it: tags, flattened params, per-epoch + final metrics, predictions."""
    exp_id = client.get_run(parent).info.experiment_id
    tags = {
        "cell": "true",
        "protocol_name": protocol.name,
        "protocol_hash": protocol.hash,
        "arm": arm,
        "seed": str(seed),
        "is_reference": str(arm == protocol.reference.name).lower(),
        "allow_dirty": "false",
        "run_key": f"{arm}-{seed}-{commit[:6]}",
        "mlflow.parentRunId": parent,
        "mlflow.runName": f"{arm}-seed{seed}",
        "git_commit": commit,
        "git_dirty": "false",
        "device": "cpu",
    }
    run_id = client.create_run(exp_id, tags=tags).info.run_id
    params = {
        "run.seed": seed,
        "model.name": "fmnist_cnn" if arm == "cnn" else "fmnist_vit",
        "data.name": "image_folder",
        "data.fingerprint": "f" * 64,
        "data.split_fingerprint": "e" * 64,
        "run.epochs": 3,
        "run.evaluate_test": True,
        "data.source": "hand-made image folder",
        "data.train_images": 40,
        "run.amp": "off",
        "code_fingerprint": CODE_FINGERPRINT,
    }
    val_acc, test_acc = val_correct / len(VAL_LABELS), test_correct / len(TEST_LABELS)
    metrics = [
        Metric(key, value, 0, epoch)
        for epoch in (1, 2, 3)  # curves that end at the best accuracy, best epoch 3
        for key, value in {
            "val_accuracy": val_acc - 0.1 * (3 - epoch),
            "val_loss": 1.0 / epoch,
            "train_accuracy": 0.5 + 0.1 * epoch,
            "train_loss": 1.2 / epoch,
            "best_epoch": epoch,
            "epoch_seconds": 2.0,
        }.items()
    ]
    metrics += [
        Metric(key, value, 1, 0)
        for key, value in {  # final metrics, logged without a step as ablate does
            "best_val_accuracy": val_acc,
            "best_val_loss": 0.5,
            "best_epoch": 3,
            "reload_proof_passed": 1.0,
            **({"test_accuracy": test_acc, "test_loss": 0.6} if with_test else {}),
        }.items()
    ]
    # One batch instead of ~30 single calls: SQLite commits each call, which is what makes tests slow.
    client.log_batch(run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()])
    if status == "FINISHED":
        with tempfile.TemporaryDirectory() as tmp:
            for split, labels, correct in (
                ("val", VAL_LABELS, val_correct),
                ("test", TEST_LABELS, test_correct),
            )[: 1 + with_test]:
                path = Path(tmp) / f"{split}.csv"
                path.write_text(predictions_csv(labels, correct, seed))
                client.log_artifact(run_id, str(path), artifact_path="predictions")
    client.set_terminated(run_id, status, end_time=end_time)
    return run_id


def make_store(
    folder: Path,
    skip: tuple = (),
    name: str = "study",
    description: str | None = None,
    commit: str = COMMIT_A,
    end_time: int | None = None,
) -> Store:
    """A parent run and every cell (minus ``skip``) with the hand-chosen predictions."""
    path = write_protocol(folder, name, description or "hand-made runs for report tests")
    protocol = load_protocol(path)
    store = Store(path, protocol)
    client = MlflowClient()
    parent = start_parent_run(protocol, path, allow_dirty=True)
    store.parents.append(parent)
    for cell in protocol.cells():
        if (cell.arm, cell.seed) in skip:
            continue
        store.cells[(cell.arm, cell.seed)] = log_cell(
            client,
            protocol,
            parent,
            cell.arm,
            cell.seed,
            VAL_CORRECT[cell.arm][cell.seed],
            TEST_CORRECT[cell.arm][cell.seed],
            commit=commit,
            end_time=end_time,
        )
    end_parent_run(parent, {"finished": len(store.cells), "skipped": 0, "failed": 0})
    return store


@pytest.fixture
def store(tmp_path, mlflow_store) -> Store:
    # report files are 0666 masked by the umask: pin it so the mode check is exact
    previous = os.umask(UMASK)
    try:
        yield make_store(tmp_path)
    finally:
        os.umask(previous)


def fresh_uri() -> str:
    import mlflow

    return mlflow.get_tracking_uri()


def table_rows(md: str, *header: str) -> list[dict[str, list[str]]]:
    """Every Markdown table whose header starts with ``header``: first cell -> the other cells (stripped)."""
    tables, current = [], None
    for line in md.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if current is None:
            current = {} if cells[: len(header)] == list(header) else False
            if current is not False:
                tables.append(current)
        elif current is not False and not set(line) <= set("|:- "):
            current[cells[0]] = cells[1:]
    return tables


def hand_t_interval(d: list[float]) -> tuple[float, float, float]:
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = T_975_DF2 * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def test_numbers_equal_hand_computed_values(store, tmp_path):
    result = build_report(str(store.protocol_path), tmp_path / "out", log=False)
    val = {s.arm: s for s in result.summaries["val"]}
    assert val["vit"].values == {0: 0.8, 1: 0.7, 2: 0.9}
    assert val["vit"].mean == pytest.approx(0.8, abs=1e-12) and val["vit"].std == pytest.approx(
        0.1, abs=1e-12
    )
    assert val["cnn"].mean == pytest.approx(0.6, abs=1e-12) and val["cnn"].std == pytest.approx(
        0.1, abs=1e-12
    )
    test = {s.arm: s for s in result.summaries["test"]}
    assert test["wide"].mean == pytest.approx((1 + 5 / 6 + 5 / 6) / 3, abs=1e-12)

    (cnn_vs_vit, wide_vs_vit) = result.comparisons["val"]
    assert (cnn_vs_vit.a, cnn_vs_vit.b, wide_vs_vit.a) == ("cnn", "vit", "wide")
    p = cnn_vs_vit.paired
    assert p.seeds == [0, 1, 2] and np.allclose(p.differences, [-0.2, 0.0, -0.4], atol=1e-12), (
        p.differences
    )
    mean, low, high = hand_t_interval([-0.2, 0.0, -0.4])
    assert (p.mean_difference, p.ci_low, p.ci_high) == pytest.approx((mean, low, high), abs=1e-12)
    assert (p.n, p.wins, p.ties, p.losses) == (3, 0, 1, 2)
    t_stat = mean / (0.2 / math.sqrt(3))  # sd of the differences is 0.2
    from scipy.stats import t as student_t

    assert p.p_value == pytest.approx(2 * student_t.sf(abs(t_stat), 2), abs=1e-12)
    boot = cnn_vs_vit.bootstrap
    assert (
        boot.estimate == pytest.approx(-0.2, abs=1e-12)
        and boot.low <= -0.2 <= boot.high
        and boot.n_resamples == 2000
    )

    md = result.markdown.read_text()
    acc = table_rows(md, "arm", "n seeds")  # validation, then test
    assert acc[0]["vit (reference)"][:5] == [
        "3 of 3",
        "80.00",
        "[55.16, 104.84]",
        "10.00",
        "80.00",
    ], acc[0]
    half = T_975_DF2 * 0.1 / math.sqrt(3)  # the arm's own t-interval: 0.8 +- t * sd / sqrt(n)
    assert acc[0]["vit (reference)"][2] == f"[{100 * (0.8 - half):.2f}, {100 * (0.8 + half):.2f}]"
    comp = table_rows(md, "a − b", "n")
    row = comp[0]["cnn − vit"]
    assert row[:6] == ["3 of 3", "-20.00", "0.00", "-40.00", "-20.00", "[-69.68, +29.68]"], row
    assert row[7].startswith("-1.00 [") and row[8] == "0 of 3 (1 tied)", row  # d_z = -0.2 / 0.2
    assert row[9] == f"{p.p_value:.3f}" and row[10] == f"{p.wilcoxon_p_value:.3f}", row
    # The bootstrap shows only the decimals its Monte-Carlo error supports, and says what that error is.
    se = 100 * max(boot.mc_error_low, boot.mc_error_high)
    d = decimals_for_error(se, 3)
    assert row[6] == f"[{fmt(100 * boot.low, d, True)}, {fmt(100 * boot.high, d, True)}]", (
        row[6],
        se,
    )
    assert (
        f"cnn − vit: bootstrap endpoints shown to {d} decimal" in md
        and f"standard error is {se:.2g} points" in md
    )
    # Every displayed per-seed difference is the difference of the displayed per-seed values.
    for split, (acc_split, comp_split) in enumerate(zip(acc, comp)):
        for name, cells in comp_split.items():
            a, b = name.split(" − ")
            label = {"vit": "vit (reference)"}
            va, vb = acc_split[label.get(a, a)], acc_split[label.get(b, b)]
            for i in range(3):  # seed columns: after n seeds, mean, interval, std
                shown = Decimal(va[4 + i]) - Decimal(vb[4 + i])
                assert Decimal(cells[1 + i]) == shown, (
                    split,
                    name,
                    i,
                    cells[1 + i],
                    va[4 + i],
                    vb[4 + i],
                )
    assert acc[1]["vit (reference)"][4:7] == ["83.333", "66.667", "83.333"], (
        "test values at 3 decimals (5/6)"
    )
    # A stated result per comparison with both intervals, the seed-level resolution once per section; no verdict word.
    assert (
        "> On validation, cnn minus vit is -20.00 points of accuracy (95% t-interval -69.68 to +29.68; bootstrap "
        in md
    )
    assert "with vit ahead in 2 of 3 seeds, 1 tied;" in md and "significant" not in md.replace(
        "no difference is called significant", ""
    )
    results = md.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    for split in ("Validation", "Test"):
        part = results.split(f"### {split}\n", 1)[1].split("\n### ", 1)[0]
        assert (
            part.count("Wilcoxon signed-rank p is 0.25") == 1
            and part.count("only 10 distinct seed sets") == 1
        ), part
        summary = table_rows(part, "a − b", "mean")[0]
        assert part.count("\n> On ") == len(summary), part
        # The Results table repeats the Seed-paired comparisons' numbers, not numbers of its own.
        paired = comp[0 if split == "Validation" else 1]
        for name, cells in summary.items():
            assert cells[:3] == [paired[name][4], paired[name][5], paired[name][6]], (
                split,
                name,
                cells,
                paired[name],
            )
    assert "![" in md and "figures/forest_val.png" in md and "figures/forest_test.png" in md
    # per class (validation, vit): the wrong examples are the last ones, all of class 2
    # seed 0: 2 of 4 right, seed 1: 1 of 4, seed 2: 3 of 4 -> mean 50.00, std 25.00
    assert table_rows(md, "class", "vit (reference)")[0]["class 2"][0] == "50.00 ± 25.00"
    # Degenerate predictions: counts per run, and every never-predicted class named.
    counts = table_rows(md, "run", "class 0")
    assert (
        counts[0]["cnn/seed0"] == ["7", "3", "0", "class 2"]
        and counts[1]["vit/seed1"][-1] == "class 2"
    )
    assert (
        "test: class 2: 3 of 9 runs never predict it (vit/seed1, cnn/seed1, cnn/seed2) (2 examples of it in the "
        "evaluated data)"
    ) in md
    assert table_rows(md, "class", "vit (reference)")[1]["class 2"][1] == "0.00 ± 0.00 ⚠", (
        "zero width without a warning"
    )
    # Configuration from the hashed protocol, with parameters per arm.
    config = table_rows(md, "arm", "model")[0]
    vit_params = sum(
        t.numel() for t in build_model(model_config("fmnist_vit", **VIT_FIELDS)).parameters()
    )
    assert config["vit (reference)"][1] == f"{vit_params:,}" and config["cnn"][5] == "3", config
    # Compute cost: 3 epochs x 2.0 s per run, 40 training images per epoch; run time from MLflow's start and end.
    cost = table_rows(md, "arm", "runs")[0]
    assert cost["vit"][:3] == ["3", "6.0 s", "18.0 s"] and cost["vit"][4:6] == [
        "3 / 3 / 3",
        "20",
    ], cost
    assert cost["vit"][6:8] == ["cpu", "fp32"], cost
    vit_runs = [
        MlflowClient().get_run(run_id).info
        for (arm, _), run_id in store.cells.items()
        if arm == "vit"
    ]
    mean_span = sum((r.end_time - r.start_time) / 1000 for r in vit_runs) / len(vit_runs)
    assert cost["vit"][3] == f"{mean_span:.1f} s", (cost["vit"][3], mean_span)
    assert (
        "(9 runs, one after another: the study's wall time when one execution ran them all)" in md
    )
    # Provenance: every run, its code, data and split fingerprints (16 hex), source, device, start time.
    lines = [
        line for line in md.splitlines() if line.startswith("| ") and "`ffffffffffffffff`" in line
    ]
    assert len(lines) == 9, lines
    for (
        arm,
        seed,
    ), run_id in store.cells.items():  # traceability: every run id is listed with its provenance
        line = next(line for line in lines if f"`{run_id}`" in line)
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:2] == [arm, str(seed)] and cells[4:] == [
            f"`{COMMIT_A[:10]}`",
            "false",
            f"`{CODE_FINGERPRINT[:16]}`",
            f"`{'f' * 16}`",
            f"`{'e' * 16}`",
            "hand-made image folder",
            "cpu",
            "n/a",
        ], cells  # threads: n/a, the hand-made run logged none
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", cells[3]), cells[3]
    # The store was given by absolute path (sqlite:////tmp/.../mlflow.db); the page names it relative to the
    # folder the report was built from (the test's cwd), with no absolute path of this machine.
    assert fresh_uri().startswith("sqlite:////") and str(tmp_path) not in md
    assert (
        "Tracking store `sqlite:///mlflow.db`" in md
        and f"Built from: protocol hash `{store.protocol.hash}`" in md
    )
    assert "Warnings" in md and "test: class 2" in md and result.problems == []
    # Report files are group-readable: 0644 under umask 022 (the test process's umask is set below).
    for path in [result.markdown, result.html, *result.figures]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~UMASK, (path, oct(path.stat().st_mode))


@pytest.mark.slow  # 5 to 7 s: the default tier reached 4 min 59 s on a fresh clone (docs/testing.md)
def test_other_hashes_of_the_name_are_named_and_never_mixed(tmp_path, mlflow_store):
    older = make_store(tmp_path / "v1", description="first version")
    newer = make_store(tmp_path / "v2", description="second version, same name, new hash")
    assert older.protocol.hash != newer.protocol.hash
    result = build_report(str(newer.protocol_path), tmp_path / "out", log=False)
    used = {c.record.run_id for c in result.study.cells.values()}
    assert used == set(newer.cells.values()), "only the file's hash"
    assert any(
        m.startswith("warning: runs with another hash") and older.protocol.hash[:12] in m
        for m in result.messages
    ), result.messages
    md = result.markdown.read_text()
    assert (
        f"runs with another hash of `study` exist and are not used: `{older.protocol.hash[:12]}` (9 cell runs)"
        in md
    )

    again = build_report(
        str(newer.protocol_path),
        tmp_path / "out-old",
        hash_prefix=older.protocol.hash[:10],
        log=False,
    )
    assert {c.record.run_id for c in again.study.cells.values()} == set(older.cells.values())
    assert again.study.spec.source == f"protocol/canonical.json of parent run {older.parents[0]}"
    assert again.study.spec.description == "first version"
    with pytest.raises(ReportError, match="matches 0 recorded hashes"):
        build_report(str(newer.protocol_path), tmp_path / "x", hash_prefix="0000", log=False)
    # By name, without a file: two hashes recorded, so the name alone is ambiguous.
    with pytest.raises(ReportError, match="no file and 2 recorded hashes; pick one with --hash"):
        build_report("study", tmp_path / "x", log=False)
    by_name = build_report(
        "study", tmp_path / "by-name", hash_prefix=newer.protocol.hash[:12], log=False
    )
    assert by_name.study.spec.arms == ("vit", "cnn", "wide") and by_name.study.spec.seeds == (
        0,
        1,
        2,
    )
    assert [s.mean for s in by_name.summaries["val"]] == [s.mean for s in result.summaries["val"]]


@pytest.mark.slow  # moved from the default tier to keep it under 5 min (docs/testing.md)
def test_missing_cells_are_listed_and_flagged_not_silently_averaged(tmp_path, mlflow_store):
    store = make_store(tmp_path, skip=(("cnn", 2), ("wide", 1)))
    failed = log_cell(
        MlflowClient(), store.protocol, store.parents[0], "wide", 1, 8, 5, status="FAILED"
    )
    # A newer run of cnn/seed1 without a test result (a dataset without a test split): missing in test only.
    no_test = log_cell(
        MlflowClient(), store.protocol, store.parents[0], "cnn", 1, 7, 0, with_test=False
    )
    result = build_report(str(store.protocol_path), tmp_path / "out", log=False)
    cnn_test = next(s for s in result.summaries["test"] if s.arm == "cnn")
    assert cnn_test.values == {0: 0.5} and cnn_test.missing_seeds == [1, 2]
    assert result.comparisons["test"][0].paired.n == 1
    assert any(f"cnn/seed1 (run {no_test}) has no test result" in m for m in result.messages), (
        result.messages
    )
    cnn = next(s for s in result.summaries["val"] if s.arm == "cnn")
    assert cnn.n == 2 and cnn.missing_seeds == [2] and cnn.mean == pytest.approx(0.65, abs=1e-12)
    assert result.study.missing == [("wide", 1, f"FAILED run {failed}"), ("cnn", 2, "no run")]
    cnn_vs_vit = result.comparisons["val"][0]
    assert cnn_vs_vit.paired.n == 2 and cnn_vs_vit.paired.missing_in_a == [2]
    assert cnn_vs_vit.bootstrap.estimate == pytest.approx((-0.2 + 0.0) / 2, abs=1e-12)
    md = result.markdown.read_text()
    acc = table_rows(md, "arm", "n seeds")[0]
    assert acc["cnn"][:2] == ["2 of 3 ⚠", "65.00"] and acc["cnn"][3:] == [
        "7.07",
        "60.00",
        "70.00",
        "missing",
        "3 / 3 / –",
    ]
    assert "⚠ cnn: mean over 2 of 3 seeds; missing seed(s) 2" in md
    assert table_rows(md, "a − b", "n")[0]["cnn − vit"][:5] == [
        "2 of 3 ⚠",
        "-20.00",
        "0.00",
        "missing",
        "-10.00",
    ]
    assert "Only 2 of the protocol's 3 seeds have finished runs of both arms." in md
    assert result.problems == ["missing cell wide/seed1", "missing cell cnn/seed2"]
    strict = CliRunner().invoke(
        report_command,
        [
            "--protocol",
            str(store.protocol_path),
            "--out-dir",
            str(tmp_path / "s"),
            "--no-log",
            "--resamples",
            "200",
            "--strict",
        ],
    )
    assert strict.exit_code == 1 and "strict: missing cell cnn/seed2" in strict.output, (
        strict.output
    )
    assert (tmp_path / "s" / "study" / "report.html").is_file(), "--strict still writes the report"
    assert (
        "### Missing cells" in md
        and f"| wide |    1 | FAILED run {failed} |" in md
        and "| cnn  |    2 | no run" in md
    )
    assert "Cells with a finished run: **7 of 9** ⚠" in md
    assert any("missing: cnn/seed2 (no run)" == m for m in result.messages)


@pytest.mark.slow  # moved from the default tier to keep it under 5 min (docs/testing.md)
def test_rebuilding_gives_byte_identical_files(store, tmp_path):
    first = build_report(str(store.protocol_path), tmp_path / "one", log=False)
    files = {
        p.relative_to(first.folder): p.read_bytes()
        for p in sorted(first.folder.rglob("*"))
        if p.is_file()
    }
    # elsewhere: paths are not content
    second = build_report(str(store.protocol_path), tmp_path / "two", log=False)
    again = {
        p.relative_to(second.folder): p.read_bytes()
        for p in sorted(second.folder.rglob("*"))
        if p.is_file()
    }
    # md, html, 7 figures (seeds, forest, confusion x 2, curves)
    assert sorted(files) == sorted(again) and len(files) == 9
    different = [str(k) for k in files if files[k] != again[k]]
    assert not different, f"differ between builds: {different}"


def test_report_is_logged_on_the_newest_parent_run(store, tmp_path):
    client = MlflowClient()
    # A second execution of the same protocol (everything already finished) reattaches the study's one parent.
    rerun = start_parent_run(store.protocol, store.protocol_path, allow_dirty=True)
    end_parent_run(rerun, {"finished": 0, "skipped": 9, "failed": 0})
    result = build_report(str(store.protocol_path), tmp_path / "out")
    assert result.logged_to == [rerun] and rerun == store.parents[-1]
    logged = {a.path for a in client.list_artifacts(rerun, "report")}
    assert logged == {"report/report.md", "report/report.html", "report/figures"}
    assert len(client.list_artifacts(rerun, "report/figures")) == 7
    assert all(not client.list_artifacts(p, "report") for p in store.parents if p != rerun)
    local = client.download_artifacts(rerun, "report/report.md", str(tmp_path))
    assert Path(local).read_bytes() == result.markdown.read_bytes()
    assert (
        f"This report is logged as an artifact (`report/`) of run(s) `{rerun}`."
        in result.markdown.read_text()
    )


@pytest.mark.slow  # moved from the default tier to keep it under 5 min (docs/testing.md)
def test_newest_finished_run_per_cell_unless_a_commit_is_given(store, tmp_path):
    client = MlflowClient()
    newer = log_cell(client, store.protocol, store.parents[0], "vit", 0, 10, 6, commit=COMMIT_B)
    result = build_report(str(store.protocol_path), tmp_path / "out", log=False)
    assert result.study.cells[("vit", 0)].record.run_id == newer
    assert [r.run_id for r in result.study.superseded] == [store.cells[("vit", 0)]]
    md = result.markdown.read_text()
    assert "### Superseded runs (not used)" in md
    # two commits of one code fingerprint: the same result code, no warning (the Runs table names each commit)
    assert "code commits" not in md and f"`{COMMIT_B[:10]}`" in md
    # A later attempt of a reported cell that failed: listed, flagged, and what --strict refuses.
    failed = log_cell(client, store.protocol, store.parents[0], "vit", 1, 7, 4, status="FAILED")
    result = build_report(str(store.protocol_path), tmp_path / "out", log=False)
    assert [r.run_id for r in result.study.attempts] == [failed]
    assert result.problems == [f"stale: vit/seed1 has a newer FAILED run {failed}"]
    md = result.markdown.read_text()
    assert (
        "### Newer attempts of reported cells (not used)" in md
        and f"vit/seed1 has a newer FAILED run {failed}" in md
    )

    pinned = build_report(str(store.protocol_path), tmp_path / "pinned", commit="aaaa", log=False)
    assert pinned.study.cells[("vit", 0)].record.run_id == store.cells[("vit", 0)]
    only_b = build_report(str(store.protocol_path), tmp_path / "b", commit="bbbb", log=False)
    assert set(only_b.study.cells) == {("vit", 0)} and len(only_b.study.missing) == 8
    assert (
        only_b.study.missing[0][2]
        == f"no finished run at commit bbbb (finished at {COMMIT_A[:10]})"
    )


@pytest.mark.slow  # moved from the default tier to keep it under 5 min (docs/testing.md)
def test_cli_builds_compares_and_explains_errors(store, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli"
    res = runner.invoke(
        report_command,
        [
            "--protocol",
            str(store.protocol_path),
            "--out-dir",
            str(out),
            "--compare",
            "wide:cnn",
            "--no-log",
            "--resamples",
            "200",
        ],
    )
    assert res.exit_code == 0, res.output
    assert (
        "9 of 9 cells have a finished run" in res.output
        and (out / "study" / "report.html").is_file()
    )
    md = (out / "study" / "report.md").read_text()
    assert (
        "| wide − cnn |" in md
        and "200 resamples" in md
        and "options `--resamples 200 --compare wide:cnn`" in md
    )
    assert "> On validation, wide minus cnn is" in md, "every compared pair gets its paragraph"
    index = runner.invoke(
        report_command,
        ["--all", "--out-dir", str(out), "--no-log", "--resamples", "200", "--strict"],
    )
    assert index.exit_code == 0, index.output
    assert (
        f"study@{store.protocol.hash[:12]}: built" in index.output and (out / "index.md").is_file()
    ), index.output
    page = (out / "index.html").read_text()
    assert (
        '<a href="study/report.html">report</a>' in page
        and "execution finished; cells: 9 finished" in page
    )
    both = runner.invoke(report_command, ["--all", "--protocol", "study"])
    assert both.exit_code == 2 and "--protocol applies to one protocol" in both.output
    bad = runner.invoke(
        report_command,
        ["--protocol", str(store.protocol_path), "--compare", "wide:mlp", "--no-log"],
    )
    assert bad.exit_code == 1 and "arm 'mlp' is not in protocol 'study'" in bad.output
    unknown = runner.invoke(report_command, ["--protocol", "never_run", "--no-log"])
    assert (
        unknown.exit_code == 1
        and "no MLflow experiment of yours holds protocol 'never_run'" in unknown.output
    )


def test_analysis_figures_logged_on_the_parent_are_embedded(store, tmp_path):
    import base64
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [1, 0])
    figures_dir = tmp_path / "fig"
    figures_dir.mkdir()
    fig.savefig(figures_dir / "01_patches.png", dpi=50)
    plt.close(fig)
    (figures_dir / "figures.json").write_text(
        json.dumps({"figures": {"01_patches.png": {"caption": "patch grid"}}})
    )
    client = MlflowClient()
    for name in ("01_patches.png", "figures.json"):
        client.log_artifact(store.parents[0], str(figures_dir / name), artifact_path="figures")
    result = build_report(str(store.protocol_path), out_root=tmp_path / "reports", log=False)
    md = result.markdown.read_text()
    assert "## Analysis figures" in md and "patch grid" in md and store.parents[0] in md
    png = (figures_dir / "01_patches.png").read_bytes()
    assert (result.folder / "figures" / "analysis_01_patches.png").read_bytes() == png
    assert base64.b64encode(png).decode() in result.html.read_text()


def test_run_ids_link_to_the_server_and_credentials_never_show(monkeypatch):
    from reports import provenance
    from reports.render import Para, to_html
    from tracking.record import queries

    record = queries.CellRecord(
        "abc123", "vit", 0, "FINISHED", COMMIT_A, "false", 0, 0, "", {}, {}, {}, "7"
    )
    monkeypatch.setattr(queries, "tracking_uri", lambda: "https://mlflow.example.org:5000")
    ref = provenance.run_ref(record)
    assert (
        ref
        == "[`abc123`](https://mlflow.example.org:5000/#/experiments/7/runs/abc123?workflowType=machine_learning)"
    )
    assert (
        '<a href="https://mlflow.example.org:5000/#/experiments/7/runs/abc123?workflowType=machine_learning"><code>abc123</code></a>'
        in to_html([Para(ref)], "t")
    )
    monkeypatch.setattr(queries, "tracking_uri", lambda: "sqlite:///mlflow.db")
    assert provenance.run_ref(record) == "`abc123`", "no link for a local store"
    monkeypatch.undo()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:s3cret@127.0.0.1:9/")
    from tracking.store import session

    monkeypatch.setattr(
        session,
        "configure_tracking",
        lambda allow_offline=False: "http://alice:s3cret@127.0.0.1:9/",
    )
    monkeypatch.setattr(
        queries,
        "configure_tracking",
        lambda allow_offline=False: "http://alice:s3cret@127.0.0.1:9/",
    )
    assert queries.tracking_uri() == "http://127.0.0.1:9/", (
        "the header names the store without its password"
    )


def test_the_wall_time_sentence_says_whether_runs_overlapped():
    """With ``ablate --jobs`` the first-to-last span is not runs back to back (it once said so for every study)."""
    from reports.configuration import run_layout

    assert run_layout([(0, 10), (10, 20), (25, 30)]).startswith("one after another")
    # inside the first
    assert run_layout([(0, 100), (150, 200), (10, 20)]).startswith("some of them at the same time")
    assert run_layout([(5, 9), (0, 6)]).startswith("some of them at the same time")
