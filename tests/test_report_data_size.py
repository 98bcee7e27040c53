"""The Data size section of the ablation report, on a synthetic study with a planted slope.

Arms vary ``dataset.train_subset``: a ``vit`` and a ``cnn`` family at N = 20, 40, 80 and the
whole split (160 images, read from the logged ``data.train_images``), and ``vit_recipe`` at the
smallest and the largest N. Each cell's predictions are made so its accuracy is a planted
value: cnn − vit = planted slope x log10 N + seed noise. The section's slope, its interval and
its words are checked against an independent recomputation (scipy's linregress per seed, the
t-interval from scipy.stats.t), the claims computations against the same numbers from the
exported evidence, and the report against its rebuild from that evidence.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.stats

from reports import tables
from reports.build import build_from_evidence, render_study
from reports.data_size.size_blocks import data_size_section
from reports.data_size.size_reading import size_reading
from reports.render import Quote, Table
from reports.collect import CellData, ProtocolSpec, StudyData
from reports.evidence import export_evidence
from reports.provenance import BuildInputs
from reports.published.claims import Claim, COMPUTATIONS, recompute
from studies.runtime.study_protocol import load_protocol
from tracking.export import run_export
from tracking.record import queries
from tracking.record.queries import CellRecord
from reports.content.rounding import fmt
from reports.content.data_size import arm_size, family_name, group_families

VAL = 400  # validation examples: accuracies are multiples of 0.25 points
LABELS = np.arange(VAL) % 3
SIZES = (20, 40, 80, 160)  # 160: the whole training split (no train_subset)
SEEDS = (0, 1, 2)
PROTOCOL = """\
name: sizestudy
description: synthetic runs for the data-size section
dataset: {name: image_folder, val_size: 400, split_seed: 3}
model: {name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 1, heads: 2, mlp_hidden: 32}
run: {epochs: 3, batch_size: 8}
arms:
  - {name: vit_160, reference: true}
  - {name: cnn_160, overrides: {model: {name: fmnist_cnn, in_channels: 3, num_classes: 3}}}
  - {name: vit_20, overrides: {dataset: {train_subset: 20}}}
  - {name: cnn_20, overrides: {model: {name: fmnist_cnn, in_channels: 3, num_classes: 3}, dataset: {train_subset: 20}}}
  - {name: vit_40, overrides: {dataset: {train_subset: 40}}}
  - {name: cnn_40, overrides: {model: {name: fmnist_cnn, in_channels: 3, num_classes: 3}, dataset: {train_subset: 40}}}
  - {name: vit_80, overrides: {dataset: {train_subset: 80}}}
  - {name: cnn_80, overrides: {model: {name: fmnist_cnn, in_channels: 3, num_classes: 3}, dataset: {train_subset: 80}}}
  - {name: vit_recipe_160, overrides: {optim: {label_smoothing: 0.1}}}
  - {name: vit_recipe_20, overrides: {optim: {label_smoothing: 0.1}, dataset: {train_subset: 20}}}
seeds: [0, 1, 2]
"""
NOISE = {0: 0.0, 1: 0.01, 2: -0.01}  # per-seed offsets of the gap (fractions)
SLOPE_NOISE = {0: 0.005, 1: -0.01, 2: 0.004}  # per-seed slopes -9.5, -11 and -9.6 points per decade
RECIPE = {20: {0: 0.03, 1: 0.02, 2: 0.045}, 160: {0: -0.05, 1: -0.06, 2: -0.04}}  # recipe − vit


def planted(slope: float, wobble: dict[int, float] | None = None) -> dict[str, dict[int, float]]:
    """Arm -> seed -> accuracy: vit rises with log10 N, cnn − vit = slope x log10 N + noise."""
    out = {}
    for n in SIZES:
        x = math.log10(n)
        vit = {s: 0.40 + 0.08 * x + 0.005 * s for s in SEEDS}
        gap = {s: 0.30 + slope * x + NOISE[s] + (wobble or {}).get(s, 0.0) * x for s in SEEDS}
        out[f"vit_{n}"] = vit
        out[f"cnn_{n}"] = {s: vit[s] + gap[s] for s in SEEDS}
        if n in RECIPE:
            out[f"vit_recipe_{n}"] = {s: vit[s] + RECIPE[n][s] for s in SEEDS}
    # Whole examples only: the accuracy a prediction file can give.
    return {arm: {s: round(v * VAL) / VAL for s, v in seeds.items()} for arm, seeds in out.items()}


def _predictions(accuracy: float) -> pd.DataFrame:
    correct = round(accuracy * VAL)
    predicted = np.where(np.arange(VAL) < correct, LABELS, (LABELS + 1) % 3)
    return pd.DataFrame({"index": np.arange(VAL), "label": LABELS, "predicted": predicted})


def synthetic_study(folder: Path, values: dict[str, dict[int, float]], text=PROTOCOL) -> StudyData:
    """The StudyData the report sees, made without a store (as tests/test_report_interaction.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sizestudy.yaml"
    path.write_text(text)
    loaded = load_protocol(path)
    arms = tuple(a["name"] for a in loaded.canonical["arms"])
    spec = ProtocolSpec(
        loaded.name,
        loaded.hash,
        loaded.description,
        arms,
        arms[0],
        SEEDS,
        False,
        "synthetic",
        loaded.canonical,
    )
    cells = {}
    for arm in arms:
        subset = next(
            a["overrides"].get("dataset", {}).get("train_subset")
            for a in loaded.canonical["arms"]
            if a["name"] == arm
        )
        params = {"data.train_images": "160", "run.seed": "0"}
        if subset is not None:
            params["data.train_subset"] = str(subset)
        for seed, acc in values[arm].items():
            record = CellRecord(
                run_id=f"{arm}s{seed}",
                arm=arm,
                seed=seed,
                status="FINISHED",
                commit="a" * 40,
                dirty="false",
                start_time=1,
                end_time=2,
                parent_run_id="p",
                params=params | {"run.seed": str(seed)},
                metrics={"best_val_accuracy": acc},
                tags={"arm": arm, "seed": str(seed), "git_commit": "a" * 40, "git_dirty": "false"},
                experiment_id="0",
            )
            cells[(arm, seed)] = CellData(record, {"val": _predictions(acc)})
    return StudyData(
        spec,
        "sqlite:///mlflow.db",
        cells,
        [],
        [],
        {},
        [],
        None,
        None,
        num_classes=3,
        records=[c.record for c in cells.values()],
    )


def inputs_for(study: StudyData) -> BuildInputs:
    return BuildInputs(
        study.spec.source,
        study.spec.hash,
        None,
        None,
        [],
        200,
        tables.BOOTSTRAP_SEED,
        tables.CONFIDENCE,
        False,
        [],
    )


def independent_slope(values: dict[str, dict[int, float]]) -> tuple[dict[int, float], tuple]:
    """Per seed scipy's linregress of cnn − vit (points) on log10 N; mean and t-interval over seeds."""
    x = np.log10(SIZES)
    per_seed = {
        s: scipy.stats.linregress(
            x, [100 * (values[f"cnn_{n}"][s] - values[f"vit_{n}"][s]) for n in SIZES]
        ).slope
        for s in SEEDS
    }
    v = np.array(list(per_seed.values()))
    mean, sem = v.mean(), v.std(ddof=1) / math.sqrt(v.size)
    half = scipy.stats.t.ppf(0.975, v.size - 1) * sem
    return per_seed, (mean, mean - half, mean + half)


def _rendered(tmp_path: Path, values) -> tuple:
    study = synthetic_study(tmp_path / "protocol", values)
    result = render_study(study, inputs_for(study), tmp_path / "out", [], [])
    return study, result, result.markdown.read_text()


@pytest.fixture(scope="module")
def planted_report(tmp_path_factory) -> tuple:
    """The report of a study whose cnn − vit falls about 10 points per tenfold N (built once)."""
    values = planted(-0.10, SLOPE_NOISE)
    return (values, *_rendered(tmp_path_factory.mktemp("planted"), values))


def cells(md: str, first: str) -> list[str]:
    """The cells of the Markdown table row whose first cell is ``first``."""
    for line in md.splitlines():
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if row and row[0] == first:
            return row
    raise AssertionError(f"no table row starting with {first!r}")


@pytest.fixture
def no_store(monkeypatch):
    """The export reads metric histories and parents from the store; this study has none."""
    monkeypatch.setattr(run_export, "metric_histories", lambda run_id: {})
    monkeypatch.setattr(queries, "parent_runs", lambda name, digest: [])


def test_a_planted_slope_equals_an_independent_recomputation_and_reads_settled(planted_report):
    values, study, result, md = planted_report
    reading = result.data_size["val"]
    assert [f.name for f in reading.families] == ["vit", "cnn", "vit_recipe"]
    assert reading.families[0].arms == {20: "vit_20", 40: "vit_40", 80: "vit_80", 160: "vit_160"}
    (cnn, recipe) = reading.pairs
    per_seed, (mean, low, high) = independent_slope(values)
    got = {s: 100 * v for s, v in cnn.slope.per_seed.items()}
    diff = max(abs(got[s] - per_seed[s]) for s in SEEDS)
    assert diff < 1e-9, f"per-seed slopes differ from linregress by {diff:.3g}: {got} {per_seed}"
    o = cnn.slope.over_seeds
    ours = (100 * o.mean_difference, 100 * o.ci_low, 100 * o.ci_high)
    diff = max(abs(a - b) for a, b in zip(ours, (mean, low, high)))
    assert diff < 1e-9, f"mean and t-interval differ by {diff:.3g}: {ours} vs {(mean, low, high)}"
    assert abs(mean + 10) < 1.0 and high < 0, (mean, high)  # the planted -10, settled below zero
    # The section: heading, the table's slope row, the sentence with its words.
    assert "## Data size" in md and "figures/data_size_val.png" in md
    assert (result.folder / "figures" / "data_size_val.png").read_bytes()[:4] == b"\x89PNG"
    row = cells(md, "slope")
    shown = [fmt(per_seed[s], 2, True) for s in SEEDS] + [
        fmt(mean, 2, True),
        f"[{fmt(low, 2, True)}, {fmt(high, 2, True)}]",
    ]
    assert row[2:7] == shown and row[7] == "settled: falls with N (t-interval excludes 0)", row
    assert (
        f"changes by {fmt(mean, 2, True)} points per tenfold N from N = 20 to 160 (mean over 3 seeds"
        in md
    )
    assert "the interval excludes zero: settled, cnn − vit falls as N grows" in md
    assert "With 3 seeds the interval spans ±4.30 standard errors of the mean slope" in md
    # Each gap per N equals the paired comparison of the two arms.
    for gap in cnn.gaps:
        hand = [values[f"cnn_{gap.n}"][s] - values[f"vit_{gap.n}"][s] for s in SEEDS]
        m, sem = np.mean(hand), np.std(hand, ddof=1) / math.sqrt(3)
        half = scipy.stats.t.ppf(0.975, 2) * sem
        got = (gap.paired.mean_difference, gap.paired.ci_low, gap.paired.ci_high)
        diff = max(abs(a - b) for a, b in zip(got, (m, m - half, m + half)))
        assert diff < 1e-12, (gap.n, diff)
    # The recipe family shares two sizes: the interaction (diff at 20) - (diff at 160).
    assert recipe.sizes == (20, 160) and recipe.slope is None
    hand = [
        (values["vit_recipe_20"][s] - values["vit_20"][s])
        - (values["vit_recipe_160"][s] - values["vit_160"][s])
        for s in SEEDS
    ]
    ix = recipe.interaction.paired
    diff = max(abs(a - b) for a, b in zip(ix.differences, hand))
    assert diff < 1e-12 and ix.mean_difference == pytest.approx(np.mean(hand), abs=1e-12), diff
    row = cells(md, "N 20 − N 160")
    assert row[1:6] == ["interaction", "+8.00", "+8.00", "+8.50", "+8.17"], row
    assert "On validation, (vit_recipe_20 − vit_20) − (vit_recipe_160 − vit_160) is" in md


def test_a_planted_zero_slope_reads_not_settled(tmp_path):
    # Per-seed slopes of +2, -3 and +1 points per tenfold N around a zero trend.
    values = planted(0.0, wobble={0: 0.02, 1: -0.03, 2: 0.01})
    study = synthetic_study(tmp_path, values)
    reading = size_reading(study, "val", n_resamples=50)  # the section alone: no whole report
    o = reading.pairs[0].slope.over_seeds
    per_seed, (mean, low, high) = independent_slope(values)
    assert low < 0 < high, (low, high)
    ours = (100 * o.mean_difference, 100 * o.ci_low, 100 * o.ci_high)
    diff = max(abs(a - b) for a, b in zip(ours, (mean, low, high)))
    assert diff < 1e-9, f"max difference {diff:.3g}: {ours} vs {(mean, low, high)}"
    blocks = data_size_section({"val": reading}, {"val": 2}, SEEDS)
    (slope_row,) = [r for b in blocks if isinstance(b, Table) for r in b.rows if r[0] == "slope"]
    assert slope_row[-1] == "not settled (t-interval includes 0)", slope_row
    (said,) = [b.text for b in blocks if isinstance(b, Quote) and "per tenfold N" in b.text]
    assert "the interval includes zero: not settled, these 3 seeds do not say whether" in said, said
    assert "settled, cnn − vit" not in said, said


def test_claims_recompute_the_section_from_its_evidence_and_the_rebuild_is_identical(
    planted_report, tmp_path, no_store
):
    values, study, result, md = planted_report
    root = tmp_path / "results"
    evidence = root / "sizestudy" / "evidence"
    export_evidence(evidence, study, inputs_for(study), [], [])
    reading = result.data_size["val"]
    cnn, recipe = reading.pairs
    slope = COMPUTATIONS["data_size_slope"](root, "sizestudy", a="cnn", b="vit", split="val")
    o = cnn.slope.over_seeds
    ours = (100 * o.mean_difference, 100 * o.ci_low, 100 * o.ci_high, o.losses, o.n)
    theirs = (slope["mean"], slope["low"], slope["high"], slope["losses"], slope["n"])
    diff = max(abs(a - b) for a, b in zip(ours, theirs))
    assert diff < 1e-9 and slope["sizes"] == 4, (ours, theirs)
    for gap in cnn.gaps:
        claim = COMPUTATIONS["data_size_gap"](
            root, "sizestudy", a="cnn", b="vit", size=gap.n, split="val"
        )
        p = gap.paired
        diff = max(
            abs(100 * x - y)
            for x, y in zip(
                (p.mean_difference, p.ci_low, p.ci_high),
                (claim["mean"], claim["low"], claim["high"]),
            )
        )
        assert diff < 1e-9, (gap.n, diff)
    ix = COMPUTATIONS["data_size_interaction"](
        root, "sizestudy", a="vit_recipe", b="vit", split="val"
    )
    p = recipe.interaction.paired
    diff = max(
        abs(100 * x - y)
        for x, y in zip(
            (p.mean_difference, p.ci_low, p.ci_high), (ix["mean"], ix["low"], ix["high"])
        )
    )
    assert diff < 1e-9, diff
    # A README sentence checked by the claims machinery: "settled" holds, "not settled" fails.
    shown = {k: fmt(slope[k], 2, True).replace("-", "−") for k in ("mean", "low", "high")}
    sentence = (
        f"cnn − vit {shown['mean']} points per tenfold N [{shown['low']}, {shown['high']}], settled"
    )
    compute = [
        {"name": "data_size_slope", "study": "sizestudy", "a": "cnn", "b": "vit", "split": "val"}
    ]
    numbers = {"mean": shown["mean"], "low": shown["low"], "high": shown["high"]}
    good = Claim("s", sentence, numbers, compute, ({"is": "settled", "words": "settled"},))
    assert recompute(good, root) == [], recompute(good, root)
    wrong = Claim(
        "s",
        sentence.replace("settled", "not settled"),
        numbers,
        compute,
        ({"is": "not settled", "words": "not settled"},),
    )
    problems = recompute(wrong, root)
    assert problems and "excludes zero: it is settled" in problems[0], problems
    # The report rebuilds from the evidence alone: the same Data size section and figures.
    # (The whole document differs in one line: the calibration section says that an export
    # holding no probabilities cannot compute it, where the store-less study above had none.)
    rebuilt = build_from_evidence(evidence, tmp_path / "rebuilt")
    text = rebuilt.markdown.read_text()
    assert section(text) == section(md), "\n".join(
        difflib.unified_diff(section(md), section(text), lineterm="")
    )
    assert len(section(md)) > 40, section(md)
    for figure in result.figures:
        assert (rebuilt.folder / "figures" / figure.name).read_bytes() == figure.read_bytes(), (
            figure.name
        )
    assert "data_size_val.png" in [f.name for f in result.figures]


def section(md: str) -> list[str]:
    """The lines of the report's Data size section."""
    lines = md.split("\n")
    start = lines.index("## Data size")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    return lines[start:end]


def test_the_section_is_absent_without_train_subset(tmp_path):
    # the same study without the data-size arms
    plain = "\n".join(line for line in PROTOCOL.splitlines() if "train_subset" not in line)
    values = planted(-0.10)
    study = synthetic_study(tmp_path / "protocol", values, plain)
    result = render_study(study, inputs_for(study), tmp_path / "out", [], [])
    md = result.markdown.read_text()
    assert result.data_size == {} and "## Data size" not in md and "data_size_" not in md


def test_sizes_come_from_the_logged_params_and_a_mismatch_is_said():
    assert arm_size(20, [{"data.train_subset": "20"}], None) == (20, "")
    assert arm_size(None, [{"data.train_images": "160"}, {"data.train_images": "160"}], 10) == (
        160,
        "",
    )
    assert arm_size(None, [], 45000) == (45000, "")
    n, why = arm_size(20, [{"data.train_subset": "40"}], None)
    assert n is None and "logged data.train_subset = 40, not 20" in why, why
    n, why = arm_size(None, [{"data.train_images": "160"}, {"data.train_images": "150"}], None)
    assert n is None and "different data.train_images: 150, 160" in why, why
    canonical = {
        "dataset": {},
        "arms": [
            {"name": "base", "reference": True, "overrides": {}},
            {"name": "small", "overrides": {"dataset": {"train_subset": 20}}},
            {"name": "bad", "overrides": {"dataset": {"train_subset": 20}, "model": {"dim": 8}}},
        ],
    }
    families, notes = group_families(
        canonical, {"base": [{"data.train_images": "160"}], "bad": [{"data.train_subset": "40"}]}
    )
    assert [(f.name, f.arms) for f in families] == [("base", {20: "small", 160: "base"})], families
    assert notes == ["bad left out: its cells logged data.train_subset = 40, not 20"], notes
    assert family_name({20: "vit_20", 160: "vit_160"}) == "vit"
    assert family_name({20: "small", 160: "base"}) == "base"  # no shared stem: the largest N's arm


SMOKE = """\
name: sizesmoke
description: two families at three training-set sizes on a tiny image folder (tests only)
dataset: {name: image_folder, val_size: 6, split_seed: 3}
model: {name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 1, heads: 2, mlp_hidden: 32}
optim: {lr: 0.003}
run: {epochs: 1, batch_size: 6}
arms:
  - {name: vit_36, reference: true}
  - {name: cnn_36, overrides: {model: {name: fmnist_cnn, in_channels: 3, num_classes: 3}}}
  - {name: vit_12, overrides: {dataset: {train_subset: 12}}}
  - {name: cnn_12, overrides: {model: {name: fmnist_cnn, in_channels: 3, num_classes: 3}, dataset: {train_subset: 12}}}
  - {name: vit_24, overrides: {dataset: {train_subset: 24}}}
  - {name: cnn_24, overrides: {model: {name: fmnist_cnn, in_channels: 3, num_classes: 3}, dataset: {train_subset: 24}}}
seeds: [0, 1]
"""


@pytest.mark.slow  # 12 trained cells and two report builds: minutes on the shared 2-core machine
def test_ablate_then_report_and_its_evidence_rebuild_carry_the_section(
    tmp_path, mlflow_store, monkeypatch
):
    """End to end: ablate trains 2 families x 3 sizes (the largest is the whole 36-image split),
    the report from the store has the section with N read from the runs, and its evidence rebuilds it."""
    from data_fixtures import make_image_folder

    from reports.build import build_report
    from studies.ablation.ablate import open_protocol, run_protocol
    from studies.runtime.options import StudyOptions

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})  # 42 images: 36 train, 6 val
    path = tmp_path / "sizesmoke.yaml"
    path.write_text(SMOKE)
    options = StudyOptions(
        output_dir=tmp_path / "out", device="cpu", data_path=str(folder), allow_dirty=True
    )
    outcomes = run_protocol(open_protocol(str(path), allow_dirty=True), path, options)
    assert [o.status for o in outcomes] == ["finished"] * 12, [o.message for o in outcomes]
    result = build_report(str(path), tmp_path / "docs", log=False, n_resamples=50, evidence=True)
    (reading,) = result.data_size.values()
    assert [(f.name, f.sizes) for f in reading.families] == [
        ("vit", (12, 24, 36)),
        ("cnn", (12, 24, 36)),
    ], reading.families
    (pair,) = reading.pairs
    assert pair.slope is not None and pair.slope.over_seeds.n == 2, pair
    md = result.markdown.read_text()
    assert cells(md, "slope")[1] == "per tenfold N"
    rebuilt = build_from_evidence(result.folder / "evidence", tmp_path / "rebuilt")
    assert section(rebuilt.markdown.read_text()) == section(md)
    png = "figures/data_size_val.png"
    assert (rebuilt.folder / png).read_bytes() == (result.folder / png).read_bytes()
