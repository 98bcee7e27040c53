"""The transfer report through the same pipeline as the ablation report, on hand-made runs.

The runs look like what ``workbench transfer`` logs (a parent run tagged ``transfer=true``
with the source's params, one FINISHED cell run per regime and seed with its test metrics,
per-epoch curves and ``predictions/test.csv``) but take no training, so every number can be
checked against scikit-learn on the same predictions.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from sklearn.metrics import cohen_kappa_score
from test_report import table_rows

from reports.build import build_report
from reports.collect import ReportError
from studies.tools.report import report as report_command
from tracking.record.protocol_runs import end_parent_run, start_parent_run
from workbench.protocol import load_transfer_protocol
from workbench.estimates import decimals_for_error
from reports.content.rounding import fmt

PROTOCOL = """\
name: tiny_transfer
description: hand-made transfer runs for report tests
source: {weights: random, model: vit_tiny_patch16_224}
dataset: {name: retinamnist}
evaluation: {n_resamples: 1000}
regimes:
  - {name: linear_probe, kind: linear, reference: true, epochs: 3, lr: 1.0e-3}
  - {name: full_ft, kind: full, epochs: 3, lr: 1.0e-4}
seeds: [0, 1]
"""
K = 5
LABELS = np.repeat(np.arange(K), 8)  # 40 test images, 8 per grade
CORRECT = {("linear_probe", 0): 20, ("linear_probe", 1): 24, ("full_ft", 0): 30, ("full_ft", 1): 32}
SOURCE = {
    "source.label": "vit_tiny (random init)",
    "source.kind": "timm-random",
    "source.uri": "random",
    "source.sha256": "",
    "source.pretrained": "False",
    "source.norm_from": "timm pretrained config",
}


def predictions(regime: str, seed: int) -> np.ndarray:
    """The first ``CORRECT`` images right (in a seeded order), the rest one grade too high (mod K)."""
    order = np.random.default_rng(seed).permutation(len(LABELS))
    pred = LABELS.copy()
    wrong = order[CORRECT[(regime, seed)] :]
    pred[wrong] = (LABELS[wrong] + 1) % K
    if (regime, seed) == ("linear_probe", 1):  # a degenerate classifier: never predicts grade 4
        pred[pred == 4] = 3
    return pred


def log_transfer_store(folder: Path) -> dict:
    path = folder / "tiny_transfer.yaml"
    path.write_text(PROTOCOL)
    protocol = load_transfer_protocol(path)
    client = MlflowClient()
    parent = start_parent_run(
        protocol, path, allow_dirty=True, extra_tags={"transfer": "true", "source_identity": "s1"}
    )
    client.log_batch(
        parent,
        params=[
            Param(k, str(v))
            for k, v in {
                **SOURCE,
                "transfer.regimes": "linear_probe,full_ft",
                "transfer.reference": "linear_probe",
                "transfer.num_classes": K,
                "evaluation.n_resamples": 1000,
                "evaluation.confidence": 0.95,
                "evaluation.seed": 0,
            }.items()
        ],
    )
    exp_id = client.get_run(parent).info.experiment_id
    cells = {}
    for cell in protocol.cells():
        regime, seed = cell.regime.name, cell.seed
        tags = {
            "cell": "true",
            "protocol_name": protocol.name,
            "protocol_hash": protocol.hash,
            "arm": regime,
            "seed": str(seed),
            "source_identity": "s1",
            "mlflow.parentRunId": parent,
            "regime_kind": cell.regime.kind,
            "git_commit": "c" * 40,
            "git_dirty": "false",
            "device": "cuda",
            "device_name": "NVIDIA H200",
            "code_fingerprint": "d" * 64,
        }
        run_id = client.create_run(exp_id, tags=tags).info.run_id
        pred = predictions(regime, seed)
        qwk = cohen_kappa_score(LABELS, pred, weights="quadratic")
        metrics = [
            Metric(k, v, 0, e)
            for e in (1, 2, 3)
            for k, v in {
                "val_qwk": qwk - 0.1 * (3 - e),
                "val_loss": 1.0 / e,
                "train_loss": 1.2 / e,
                "val_accuracy": 0.2 * e,
            }.items()
        ]
        metrics += [
            Metric(k, v, 1, 0)
            for k, v in {
                "test_qwk": qwk,
                "test_accuracy": float((pred == LABELS).mean()),
                "best_epoch": 3,
                "best_val_qwk": qwk,
                "selection_seconds": 10.0 + seed,
            }.items()
        ]
        client.log_batch(
            run_id,
            metrics=metrics,
            params=[
                Param(k, v)
                for k, v in {
                    "data.fingerprint": "1" * 64,
                    "data.split_fingerprint": "2" * 64,
                    "data.n_train": "100",
                    "amp": "torch.bfloat16",
                    "data.display_name": "RetinaMNIST 28 px",
                }.items()
            ],
        )
        with tempfile.TemporaryDirectory() as tmp:
            csv = Path(tmp) / "test.csv"
            rows = [
                f"{i},{y},{p},0.5," + ",".join("0.9" if j == p else "0.025" for j in range(K))
                for i, (y, p) in enumerate(zip(LABELS, pred))
            ]
            csv.write_text(
                "index,label,predicted,loss,"
                + ",".join(f"prob_{j}" for j in range(K))
                + "\n"
                + "\n".join(rows)
                + "\n"
            )
            client.log_artifact(run_id, str(csv), artifact_path="predictions")
        client.set_terminated(run_id, "FINISHED")
        cells[(regime, seed)] = run_id
    end_parent_run(parent, {"finished": len(cells), "skipped": 0, "failed": 0})
    return {"path": path, "protocol": protocol, "parent": parent, "cells": cells}


@pytest.fixture
def transfer_store(tmp_path, mlflow_store) -> dict:
    return log_transfer_store(tmp_path)


def test_transfer_report_numbers_files_and_logging(transfer_store, tmp_path):
    result = build_report(str(transfer_store["path"]), tmp_path / "out", n_resamples=1000)
    kappa = result.section.kappa_table
    for (regime, seed), run_id in transfer_store["cells"].items():
        row = kappa[(kappa.regime == regime) & (kappa.seed == seed)].iloc[0]
        expected = cohen_kappa_score(LABELS, predictions(regime, seed), weights="quadratic")
        assert abs(row["qwk"] - expected) <= 1e-12, (regime, seed, row["qwk"], expected)
        assert row["run_id"] == run_id and row["logged_equals_file"]
    cm = result.section.confusion["full_ft"]
    assert cm.sum() == 2 * len(LABELS) and np.trace(cm) == 30 + 32, cm

    md = result.markdown.read_text()
    assert md.startswith(f"# Report: tiny_transfer@{transfer_store['protocol'].short_hash}\n"), md[
        :200
    ]
    for part in (
        "## Confusion matrices",
        "## Training curves",
        "## Runs",
        "full_ft − linear_probe",
        "weights: a seeded random init, **NOT PRETRAINED**",
        "Cells with a finished run: **4 of 4**",
    ):
        assert part in md, f"{part!r} missing from report.md"
    for run_id in transfer_store["cells"].values():
        assert f"`{run_id}`" in md
    assert sorted(p.name for p in result.figures) == [
        "confusion_test.png",
        "curves.png",
        "forest_test.png",
    ]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in result.figures)
    # Regime differences over seeds: the between-seed t-interval AND the bootstrap, both in the table and the paragraph.
    qwk = {k: cohen_kappa_score(LABELS, predictions(*k), weights="quadratic") for k in CORRECT}
    d = [qwk[("full_ft", s)] - qwk[("linear_probe", s)] for s in (0, 1)]
    # t quantile 0.975, 1 degree of freedom
    half = 12.706204736174707 * np.std(d, ddof=1) / np.sqrt(2)
    t_text = f"[{np.mean(d) - half:+.3f}, {np.mean(d) + half:+.3f}]"
    row = [r for r in md.splitlines() if r.startswith("| full_ft − linear_probe | QWK    |  all |")]
    assert len(row) == 1 and t_text in row[0] and "won in 2 of 2 seeds" in row[0], (row, t_text)
    boot = result.section.paired[("full_ft", "linear_probe", "qwk")][1]
    # Monte-Carlo precision
    places = min(3, decimals_for_error(max(boot.mc_error_low, boot.mc_error_high), 3))
    assert f"[{fmt(boot.low, places, True)}, {fmt(boot.high, places, True)}]" in row[0], (row, boot)
    assert f"On test, full_ft minus linear_probe is {np.mean(d):+.2f} of QWK (95% t-interval" in md
    assert md.count("from 2 seeds it can draw only 3 distinct seed sets") == 1, (
        "the caveats once, not per pair"
    )
    assert "significant" not in md.replace("no difference is called significant", "")
    # Configuration from the hashed protocol: lr, epochs, blocks, layer decay per regime.
    config = table_rows(md, "regime", "trains")[0]
    assert (
        config["linear_probe (reference)"][0] == "head only"
        and "lr 0.001" in config["linear_probe (reference)"][2]
    )
    assert config["full_ft"][0] == "every parameter" and config["full_ft"][4] == "3", config
    # Degenerate classifier: counted, named, and its zero-width recall interval explained.
    assert (
        "class 4: 1 of 4 runs never predict it (linear_probe/seed1) (8 examples of it in the evaluated data)"
        in md
    )
    recall = table_rows(md, "regime", "seed", "class 0")[0]
    assert recall["linear_probe"] and "0.000 [0.000, 0.000] ⚠ never predicted" in md, recall
    assert table_rows(md, "run", "class 0")[0]["linear_probe/seed1"][-1] == "class 4"
    # Provenance and cost from the cells' own records.
    runs = [r for r in md.splitlines() if r.startswith("| linear_probe |    0 |")]
    assert any(
        f"`{'c' * 10}`" in r
        and f"`{'d' * 16}`" in r
        and f"`{'1' * 16}`" in r
        and f"`{'2' * 16}`" in r
        and "cuda (NVIDIA H200)" in r
        for r in runs
    ), runs
    cost = table_rows(md, "regime", "runs")[0]
    # selection_seconds 10 and 11; 100 training images x 3 epochs -> 30.0 and 27.27 images/s, mean 28.6
    assert cost["full_ft"][:7] == [
        "2",
        "10.5 s",
        "21.0 s",
        "3 / 3",
        "29",
        "cuda (NVIDIA H200)",
        "bfloat16 autocast",
    ], cost
    # vit_tiny: ~1.3 G
    assert cost["full_ft"][7] == config["full_ft"][1] and cost["full_ft"][8].endswith("GFLOPs"), (
        cost
    )
    html = result.html.read_text()
    assert "<pre>" not in html and html.count("data:image/png;base64,") == 3
    assert result.logged_to == [transfer_store["parent"]]
    logged = {a.path for a in MlflowClient().list_artifacts(transfer_store["parent"], "report")}
    assert {"report/report.md", "report/report.html"} <= logged, logged

    again = build_report(str(transfer_store["path"]), tmp_path / "out", n_resamples=1000, log=False)
    assert again.markdown.read_bytes() == result.markdown.read_bytes(), (
        "rebuilding changed report.md"
    )
    assert again.figures[0].read_bytes() == result.figures[0].read_bytes(), (
        "rebuilding changed a figure"
    )


@pytest.mark.slow  # 5 to 7 s: the default tier reached 4 min 59 s on a fresh clone (docs/testing.md)
def test_transfer_report_options(transfer_store, tmp_path):
    protocol = transfer_store["protocol"]
    with pytest.raises(ReportError, match="--hash ffff: matches 0 recorded hashes"):
        build_report("tiny_transfer.yaml", tmp_path / "out", hash_prefix="ffff", log=False)
    runner = CliRunner()
    for args, message in (
        (["--commit", "abc"], "--commit abc: not supported for transfer protocols"),
        (["--compare", "full_ft:linear_probe"], "--compare: not needed for transfer protocols"),
    ):
        out = runner.invoke(report_command, ["--protocol", "tiny_transfer.yaml", "--no-log", *args])
        assert out.exit_code == 1 and message in out.output and "Traceback" not in out.output, (
            out.output
        )
    out = runner.invoke(
        report_command,
        [
            "--protocol",
            "tiny_transfer.yaml",
            "--no-log",
            "--hash",
            protocol.hash[:6],
            "--resamples",
            "1000",
            "--out-dir",
            str(tmp_path / "cli"),
        ],
    )
    assert out.exit_code == 0 and "4 of 4 cells" in out.output, out.output
    assert (
        f"hash `{protocol.hash}`" in (tmp_path / "cli" / "tiny_transfer" / "report.md").read_text()
    )
    # By name only (no file here): --all finds it in the store and reports it with the file its parent logged.
    out = runner.invoke(
        report_command,
        ["--all", "--no-log", "--resamples", "1000", "--out-dir", str(tmp_path / "all")],
    )
    assert out.exit_code == 0 and f"tiny_transfer@{protocol.short_hash}: built" in out.output, (
        out.output
    )
    assert (
        '<a href="tiny_transfer/report.html">report</a>'
        in (tmp_path / "all" / "index.html").read_text()
    )
    md = (tmp_path / "all" / "tiny_transfer" / "report.md").read_text()
    assert (
        "(from protocol/tiny_transfer.yaml logged on its parent run)" in md
        and "## Configuration" in md
    )
    # A newer attempt of a reported cell still running: listed, and --strict exits 1 (after writing the report).
    client = MlflowClient()
    parent = client.get_run(transfer_store["parent"])
    running = client.create_run(
        parent.info.experiment_id,
        tags={
            "cell": "true",
            "protocol_name": protocol.name,
            "protocol_hash": protocol.hash,
            "arm": "full_ft",
            "seed": "1",
            "source_identity": "s1",
            "mlflow.parentRunId": transfer_store["parent"],
        },
    ).info.run_id
    strict = runner.invoke(
        report_command,
        [
            "--protocol",
            "tiny_transfer.yaml",
            "--no-log",
            "--strict",
            "--resamples",
            "1000",
            "--out-dir",
            str(tmp_path / "strict"),
        ],
    )
    assert (
        strict.exit_code == 1
        and f"strict: stale: full_ft/seed1 has a newer RUNNING run {running}" in strict.output
    ), strict.output
    md = (tmp_path / "strict" / "tiny_transfer" / "report.md").read_text()
    assert "### Newer attempts of reported cells (not used)" in md and f"`{running}`" in md


def test_reports_never_import_studies():
    """reports/ sits below studies/ (studies -> reports -> tracking -> workbench): an import the
    other way would be a cycle. Checking every layer below studies/ covers indirect imports too."""
    root = Path(__file__).resolve().parents[1]
    offenders = [
        f"{p.relative_to(root)}:{i}"
        for folder in ("reports", "tracking", "workbench")
        for p in sorted((root / folder).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if line.lstrip().startswith(("import studies", "from studies"))
    ]
    assert not offenders, f"a layer below studies/ imports studies/ at {offenders}"
    reports_up = [
        f"{p.name}:{i}"
        for p in sorted((root / "tracking").rglob("*.py"))
        + sorted((root / "workbench").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if line.lstrip().startswith(("import reports", "from reports"))
    ]
    assert not reports_up, f"tracking/ or workbench/ imports reports/ at {reports_up}"


def test_one_protocol_parser():
    """The schema is library code: only workbench/protocol reads protocol YAML; reports read no YAML at all."""
    root = Path(__file__).resolve().parents[1]
    sources = {
        str(p.relative_to(root)): p.read_text()
        for folder in ("studies", "reports", "tracking", "workbench")
        for p in sorted((root / folder).rglob("*.py"))
    }
    assert [f for f, text in sources.items() if "yaml.load(" in text] == [
        "workbench/protocol/common.py"
    ]
    assert not [
        f
        for f, text in sources.items()
        if f.startswith("reports/") or f == "studies/tools/report.py"
        if "import yaml" in text
    ], "a report module reads YAML itself"
