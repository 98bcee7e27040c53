"""`workbench reproduce`: a tiny study trained, published as evidence, re-trained and judged.

One real ablate run (2 arms x 2 seeds, 1 epoch) is published with ``report --evidence``; then one
cell is re-trained by ``reproduce`` into a store of its own and judged at the three levels against
the untouched evidence (bitwise: same machine, same kernels) and against copies of it edited to
force each level to fail (a history point moved by 1e-9: numerical but not bitwise; the
published predictions and accuracies replaced so the study's verdict is settled and the
re-trained cell unsettles it: the conclusion moves).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil

import pytest
from click.testing import CliRunner
from data_fixtures import make_image_folder
from test_ablate import PROTOCOL

from reports.build import build_from_evidence, build_report
from reports.reproduction.judge import CellCheck, VerdictCheck, at_least, level_reached
from studies.ablation.ablate import open_protocol, run_protocol
from studies.cli import main
from studies.runtime.options import StudyOptions


def _rewrite_predictions(evidence, entry, correct: bool) -> None:
    """Every published prediction of the cell right (or wrong), its sha256 updated in runs.json."""
    for info in entry["predictions"].values():
        path = evidence / info["file"]
        lines = gzip.decompress(path.read_bytes()).decode().splitlines()
        rows = [lines[0]]
        for line in lines[1:]:
            index, label, _ = line.split(",")
            predicted = label if correct else str((int(label) + 1) % 3)
            rows.append(f"{index},{label},{predicted}")
        data = ("\n".join(rows) + "\n").encode()
        path.write_bytes(gzip.compress(data, mtime=0))
        info["sha256"] = hashlib.sha256(data).hexdigest()
    for key in ("best_val_accuracy", "val_accuracy", "test_accuracy"):
        entry["metrics"][key] = 1.0 if correct else 0.0


@pytest.mark.slow  # 12-21 s on 2 busy cores: keeps the default tier under 5 minutes (docs/testing.md)
def test_reproduce_judges_a_retrained_cell_at_three_levels(tmp_path, mlflow_store, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    # reproduce points MLFLOW_TRACKING_URI at its own store: restored after the test
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store)
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    path = tmp_path / "tiny.yaml"
    path.write_text(PROTOCOL.format(name="tiny", epochs=1))
    protocol = open_protocol(str(path), allow_dirty=True)
    options = StudyOptions(
        output_dir=tmp_path / "train", device="cpu", data_path=str(folder), allow_dirty=True
    )
    outcomes = run_protocol(protocol, path, options)
    assert [o.status for o in outcomes] == ["finished"] * 4, [o.message for o in outcomes]
    result = build_report(str(path), tmp_path / "published", evidence=True)
    evidence = result.folder / "evidence"

    # The kernel identity is in every cell's params, so in the evidence and the runs table.
    runs = json.loads((evidence / "runs.json").read_text())
    params = runs["cells"][0]["params"]
    assert params["kernel.threads"] == params["threads"] and params["kernel.torch"]
    assert {"kernel.onednn_isa", "kernel.aten_capability", "kernel.mkl_cbwr"} <= set(params)
    md = result.markdown.read_text()
    header = next(line for line in md.splitlines() if "| run id " in line)
    assert header.rstrip(" |").endswith("kernels"), header
    assert f"ATen {params['kernel.aten_capability']}" in md

    # Calibration: computed from the logged probabilities, exported with the evidence, and the
    # same section rebuilt from the export alone.
    assert sorted(p.name for p in (evidence / "predictions").glob("*.probs.csv.gz"))[:2] == [
        "cnn.seed0.test.probs.csv.gz",
        "cnn.seed0.val.probs.csv.gz",
    ]
    section = md.split("## Calibration")[1].split("\n## ")[0]
    assert "| vit " in section and "| cnn - vit " in section and "Not computed" not in section
    rebuilt = build_from_evidence(evidence, tmp_path / "rebuilt").markdown.read_text()
    assert rebuilt.split("## Calibration")[1].split("\n## ")[0] == section

    def reproduce(evidence_dir, *extra):
        return CliRunner().invoke(
            main,
            [
                "reproduce",
                "--protocol",
                str(path),
                "--cells",
                "vit/seed0",
                "--evidence",
                str(evidence_dir),
                "--store-dir",
                str(tmp_path / "again"),
                "--output-dir",
                str(tmp_path / "retrain"),
                "--data-path",
                str(folder),
                "--device",
                "cpu",
                "--allow-dirty",
                *extra,
            ],
        )

    # 1. Untouched evidence, same machine: bitwise, and the kernel identity says it was expected.
    res = reproduce(evidence)
    assert res.exit_code == 0, res.output
    assert "kernel identity equal: bitwise equality expected" in res.output, res.output
    assert "level reached: bitwise (asked: bitwise)" in res.output, res.output
    line = next(x for x in res.output.splitlines() if x.strip().startswith("bitwise:"))
    assert "equal (max |diff| 0)" in line and line.endswith(": equal"), line

    # 2. One published history point moved by 1e-9: numerical, not bitwise (the re-trained
    # cell is reused from the store: nothing is trained again).
    nudged = tmp_path / "nudged" / "evidence"
    shutil.copytree(evidence, nudged)
    doc = json.loads((nudged / "runs.json").read_text())
    entry = next(
        c
        for c in doc["cells"]
        if c["tags"]["arm"] == "vit" and c["tags"]["seed"] == "0" and "predictions" in c
    )
    entry["metric_history"]["val_loss"][0][2] += 1e-9
    (nudged / "runs.json").write_text(json.dumps(doc))
    res = reproduce(nudged)
    assert res.exit_code == 1, res.output
    assert "level reached: numerical (asked: bitwise)" in res.output, res.output
    assert "history" in res.output and "max |diff| 1e-09" in res.output, res.output
    assert reproduce(nudged, "--level", "numerical").exit_code == 0

    # The real vit/seed0 (published and re-trained alike) is right on some test examples: what
    # unsettles the forced verdict below (two seeds: the t-interval's half-width is 12.7 x half
    # the spread of the differences).
    real = next(c for c in runs["cells"] if c["tags"]["arm"] == "vit" and c["tags"]["seed"] == "0")
    assert real["metrics"]["test_accuracy"] > 0.2, real["metrics"]

    # 3. Published predictions replaced: cnn right on every example, vit wrong on every one, so
    # the published verdict is settled (cnn ahead); the re-trained vit/seed0 unsettles it.
    forced = tmp_path / "forced" / "evidence"
    shutil.copytree(evidence, forced)
    doc = json.loads((forced / "runs.json").read_text())
    for c in doc["cells"]:
        if "predictions" in c:
            _rewrite_predictions(forced, c, correct=c["tags"]["arm"] == "cnn")
    (forced / "runs.json").write_text(json.dumps(doc))
    res = reproduce(forced, "--level", "conclusion")
    assert res.exit_code == 1, res.output
    assert "verdict 'cnn ahead' MOVES to not settled" in res.output, res.output
    assert "level reached: none (asked: conclusion)" in res.output, res.output
    assert "outside the seed-to-seed spread" in res.output, res.output


def test_bad_cells_are_refused_in_one_line_before_any_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "reproduce",
            "--protocol",
            str(_repo_protocol("fmnist_seed_recipe")),
            "--cells",
            "vit/0",
            "--evidence",
            str(_repo_evidence("fmnist_seed_recipe")),
        ],
    )
    assert res.exit_code == 2 and "expected ARM/seedN" in res.output, res.output
    res = runner.invoke(
        main,
        [
            "reproduce",
            "--protocol",
            str(_repo_protocol("fmnist_seed_recipe")),
            "--cells",
            "nosuch/seed0",
            "--evidence",
            str(_repo_evidence("fmnist_seed_recipe")),
        ],
    )
    assert res.exit_code == 2 and "not a cell of fmnist_seed_recipe" in res.output, res.output
    res = runner.invoke(
        main,
        [
            "reproduce",
            "--protocol",
            str(_repo_protocol("fmnist_seed_recipe")),
            "--cells",
            "vit/seed0",
            "--evidence",
            str(_repo_evidence("cifar10_recipe_and_baselines")),
        ],
    )
    assert res.exit_code == 1 and "is not the evidence's" in res.output, res.output
    assert not (tmp_path / "outputs").exists()  # refused before any store was made


def _repo_protocol(name: str):
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "studies" / "protocols" / f"{name}.yaml"


def _repo_evidence(name: str):
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "docs" / "results" / name / "evidence"


def test_the_level_reached_is_the_finest_that_holds_with_every_coarser_one():
    same = CellCheck(
        "a", 0, "r1", "r2", metrics=2, metrics_equal=2, accuracy={"val": (0.5, 0.5, 0.01)}
    )
    close = CellCheck(
        "a", 0, "r1", "r2", metrics=2, metrics_equal=1, accuracy={"val": (0.5, 0.505, 0.01)}
    )
    far = CellCheck(
        "a", 0, "r1", "r2", metrics=2, metrics_equal=1, accuracy={"val": (0.5, 0.6, 0.01)}
    )
    stands = VerdictCheck("a", "b", "val", "a ahead", "a ahead", 1.0, 1.1)
    moves = VerdictCheck("a", "b", "val", "a ahead", "not settled", 1.0, 0.2)
    assert level_reached([same], [stands]) == "bitwise"
    assert level_reached([close], [stands]) == "numerical"
    assert level_reached([far], [stands]) == "conclusion"
    assert level_reached([same], [moves]) == "none"  # bits equal cannot move a verdict; if the
    # published verdicts were not the evidence's own, nothing finer is claimed
    assert at_least("numerical", "conclusion") and not at_least("numerical", "bitwise")
    assert at_least("bitwise", "bitwise") and not at_least("none", "conclusion")


def test_the_default_evidence_is_the_protocols_repository_s_from_any_folder(tmp_path, monkeypatch):
    """Before, ``docs/results/<study>/evidence`` was read relative to the current folder: from any
    other folder reproduce failed on a runs.json it could not find."""
    from click.testing import CliRunner

    from studies.cli import main
    from studies.tools.reproduce import REPOSITORY, published_evidence

    protocol = REPOSITORY / "studies" / "protocols" / "fmnist_seed_recipe.yaml"
    published = REPOSITORY / "docs" / "results" / "fmnist_seed_recipe" / "evidence"
    monkeypatch.chdir(tmp_path)
    assert published_evidence(protocol, "fmnist_seed_recipe") == published
    # a protocol in another repository: that repository's published folder, found from its file up
    other = tmp_path / "other" / "studies" / "protocols" / "x.yaml"
    other.parent.mkdir(parents=True)
    (tmp_path / "other" / "docs" / "results" / "x" / "evidence").mkdir(parents=True)
    assert published_evidence(other, "x") == tmp_path / "other" / "docs/results/x/evidence"
    # the command, run from tmp_path: the evidence is found, the hash checked, the cells next
    result = CliRunner().invoke(
        main, ["reproduce", "--protocol", str(protocol), "--cells", "nosuch/seed0"]
    )
    assert result.exit_code != 0 and "runs.json" not in result.output, result.output
    assert "nosuch/seed0: not a cell of fmnist_seed_recipe" in result.output, result.output
