"""The attribution study kind, quickly: what a cell logs, the report's numbers recomputed from the per-image
arrays by other means, and the evidence arrays' round trip (no MLflow store, no training).

The end to end path (trained cells, ``attribute``, rerun, report, offline rebuild) is
``tests/test_attribute.py`` (slow tier).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch
from scipy import stats as sps

from reports.attribution import attribution_report
from reports.attribution.attribution_evidence import exported_cell, npz_bytes
from reports.attribution.faithfulness import (
    attention_on_effects,
    block_concentration,
    block_norms,
    faithfulness_rows,
    has_concentration,
    value_bootstrap,
)
from reports.collect import ReportError
from reports.render import to_markdown
from tracking.kinds import attribution_runs
from tracking.record.queries import CellRecord
from workbench.attribution import score_cell
from workbench.models.vit import ViTConfig, VisionTransformer
from reports.content.rounding import fmt

METHODS = ("cls_attention", "rollout", "chefer", "grad_x_input", "random")
TOL = 1e-12


def _trapezoid(fractions: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The AUC by hand, independent of workbench.attribution.auc: sum of (f1 - f0) (v0 + v1) / 2."""
    return sum(
        (fractions[j + 1] - fractions[j]) * (values[..., j] + values[..., j + 1]) / 2
        for j in range(len(fractions) - 1)
    )


@pytest.fixture(scope="module")
def scored():
    torch.manual_seed(0)
    cfg = ViTConfig(
        image_size=8,
        patch_size=4,
        in_channels=1,
        num_classes=3,
        dim=16,
        depth=2,
        heads=2,
        mlp_hidden=32,
    )
    model = VisionTransformer(cfg).eval()
    images = torch.randn(5, 1, 8, 8)
    labels = torch.tensor([0, 1, 2, 0, 1])
    cell = score_cell(model, images, labels, METHODS, seed=3, k=1.5, image_index=np.arange(10, 15))
    return cell, np.arange(2 * 64, dtype=np.uint8).reshape(2, 1, 8, 8)  # the dataset's uint8 pixels


def test_a_cells_metrics_and_arrays_are_what_the_module_says(scored):
    cell, examples = scored
    arrays = attribution_runs.per_image_arrays(cell, examples)
    n, p, depth = 5, 4, 2
    # the insertion start is logged by every cell; the other controls only when asked for
    expected = (
        set(attribution_runs.PER_IMAGE_KEYS)
        | set(attribution_runs.CONTROL_KEYS)
        | {f"{k}/{m}" for k in attribution_runs.METHOD_ARRAYS for m in METHODS}
    )
    assert set(arrays) == expected, sorted(set(arrays) ^ expected)
    f = len(arrays["fractions"])
    shapes = {
        "effects": (n, p),
        "cls_attention": (n, p),
        "norms": (depth, n, p),
        "labels": (n,),
        "example_images": (2, 1, 8, 8),
        **{f"scores/{m}": (n, p) for m in METHODS},
        **{f"rho/{m}": (n,) for m in METHODS},
        **{f"deletion_prob/{m}": (n, f) for m in METHODS},
    }
    wrong = {k: arrays[k].shape for k, shape in shapes.items() if arrays[k].shape != shape}
    assert not wrong, wrong
    assert arrays["fractions"][0] == 0.0 and arrays["fractions"][-1] == 1.0
    assert np.array_equal(arrays["indices"], np.arange(10, 15))
    metrics = attribution_runs.cell_metrics(cell)
    assert all(math.isfinite(v) for v in metrics.values())
    diffs = {}
    for m in METHODS:
        rho = arrays[f"rho/{m}"]
        # Spearman rho again with scipy on the logged arrays: the logged per-image rho and the metric
        for b in range(n):
            if np.ptp(arrays[f"scores/{m}"][b]) > 0 and np.ptp(arrays["effects"][b]) > 0:
                again = sps.spearmanr(arrays[f"scores/{m}"][b], arrays["effects"][b]).statistic
                diffs[f"rho/{m}[{b}]"] = abs(again - rho[b])
        diffs[f"rho/{m}"] = abs(metrics[f"rho/{m}"] - np.nanmean(rho))
        for kind in ("deletion", "insertion"):
            area = _trapezoid(arrays["fractions"], arrays[f"{kind}_prob/{m}"]).mean()
            diffs[f"{kind}_auc/{m}"] = abs(metrics[f"{kind}_auc/{m}"] - area)
    for block in range(depth):
        high = arrays["norms"][block] > 1.5 * np.median(arrays["norms"][block])
        diffs[f"high_norm_fraction/block{block}"] = abs(
            metrics[f"high_norm_fraction/block{block}"] - high.mean()
        )
    diffs["intact_accuracy"] = abs(
        metrics["intact_accuracy"] - (arrays["predicted"] == arrays["labels"]).mean()
    )
    diffs["cls_attention_on_top_effects"] = abs(
        metrics["cls_attention_on_top_effects"]
        - _share_on_top(arrays["cls_attention"], arrays["effects"], 4).mean()
    )
    for block in range(
        depth
    ):  # how concentrated CLS attention is: the metric is the mean of the logged array
        for key in ("entropy", "top1", "topk", "on_self"):
            diffs[f"cls_attention_{key}/block{block}"] = abs(
                metrics[f"cls_attention_{key}/block{block}"]
                - arrays[f"cls_attention_{key}"][block].mean()
            )
    heads = arrays["cls_attention_entropy_heads"]
    assert arrays["cls_attention_entropy"].shape == (depth, n) and heads.shape == (depth, n, 2)
    # ceil(4 / 10)
    assert int(arrays["attention_top_k"]) == 1 == metrics["attention_concentration_k"]
    # no registers
    assert not any(k.startswith(("cls_attention_on_registers", "register_norm")) for k in metrics)
    assert np.array_equal(arrays["cls_attention_on_registers"], np.zeros((depth, n)))
    bad = {k: v for k, v in diffs.items() if not v <= TOL}
    assert not bad, f"max difference {max(diffs.values()):.3g}: {bad}"


def _with_concentration(
    cell: attribution_runs.AttributionCellResult,
    rng: np.random.Generator,
    registers: int = 2,
    heads: int = 3,
) -> attribution_runs.AttributionCellResult:
    """The cell's arrays with random concentration arrays and ``registers`` register tokens' norms."""
    a = dict(cell.arrays)
    depth, n, _ = a["norms"].shape
    a |= {
        "prefix": np.int64(1 + registers),
        "prefix_norms": rng.gamma(2.0, size=(depth, n, 1 + registers)),
        "attention_top_k": np.int64(2),
    }
    for key in attribution_runs.CONCENTRATION_ARRAYS:
        a[key] = rng.random((depth, n, heads) if key.endswith("_heads") else (depth, n))
    return attribution_runs.AttributionCellResult(cell.record, a)


def test_concentration_numbers_are_the_arrays_recomputed_and_old_cells_have_none():
    rng = np.random.default_rng(11)
    old = {s: _cell(rng, s) for s in (0, 1)}
    # evidence exported before the arrays existed: the report leaves them out
    assert not has_concentration(old)
    cells = {s: _with_concentration(c, rng) for s, c in old.items()}
    assert has_concentration(cells)
    blocks = block_concentration(cells)
    diffs = {}
    for b in blocks:
        for s, c in cells.items():
            a = c.arrays
            diffs[f"{b.block}/{s}/entropy"] = abs(
                b.entropy[s] - a["cls_attention_entropy"][b.block].mean()
            )
            lowest = min(a["cls_attention_entropy_heads"][b.block][:, h].mean() for h in range(3))
            diffs[f"{b.block}/{s}/head"] = abs(b.lowest_head_entropy[s] - lowest)
            diffs[f"{b.block}/{s}/registers"] = abs(
                b.registers[s] - a["cls_attention_on_registers"][b.block].mean()
            )
            ratio = a["prefix_norms"][b.block, :, 1:].mean() / a["median_norm"][b.block]
            diffs[f"{b.block}/{s}/norm"] = abs(b.register_norm_ratio[s] - ratio)
    bad = {k: v for k, v in diffs.items() if not v <= TOL}
    assert not bad, f"max difference {max(diffs.values()):.3g}: {bad}"
    md = to_markdown([attribution_report.concentration_table(blocks)])
    assert (
        "on the 2 registers, %" in md
        and "register norm / patch median" in md
        and "top 2 patches, %" in md
    )
    block1 = next(
        cols
        for cols in (line.split("|")[1:-1] for line in md.splitlines())
        if cols and cols[0].strip() == "1"
    )
    assert block1[1].strip() == fmt(np.mean([blocks[1].entropy[s] for s in cells]), 3), block1
    assert block1[4].strip() == fmt(100 * np.mean([blocks[1].topk[s] for s in cells]), 1), block1


def _share_on_top(attention: np.ndarray, ranked: np.ndarray, top: int) -> np.ndarray:
    """By hand: per image, the attention share on the ``top`` patches of largest ``ranked`` value."""
    out = []
    for a, r in zip(attention, ranked):
        chosen = sorted(range(len(r)), key=lambda i: (-r[i], i))[:top]
        out.append(a[chosen].sum() / a.sum())
    return np.array(out)


def _cell(
    rng: np.random.Generator, seed: int, n: int = 20, p: int = 9, shift: float = 0.0
) -> attribution_runs.AttributionCellResult:
    """A cell's arrays with random numbers (no model): the report computes from these alone."""
    fractions = np.linspace(0, 1, p + 1)
    arrays = {
        "methods": np.array(METHODS),
        "labels": rng.integers(0, 3, n),
        "predicted": rng.integers(0, 3, n),
        "fractions": fractions,
        "effects": rng.normal(size=(n, p)),
        "norms": rng.gamma(2.0, size=(2, n, p)),
        "cls_attention": rng.random((n, p)),
        "grid": np.array([3, 3]),
        "norm_threshold": np.float64(2.5),
        "example_images": np.zeros((0, 1, 6, 6), np.uint8),
    }
    arrays["norms"][1, 0, 4] = 40.0  # one high-norm token in block 1
    arrays["median_norm"] = np.median(arrays["norms"].reshape(2, -1), axis=1)
    for m in METHODS:
        arrays[f"rho/{m}"] = np.clip(
            rng.normal(0.3 if m == "chefer" else 0.0, 0.2, n) + shift, -1, 1
        )
        arrays[f"deletion_prob/{m}"] = rng.random((n, p + 1))
        arrays[f"insertion_prob/{m}"] = rng.random((n, p + 1))
        arrays[f"scores/{m}"] = rng.random((n, p))
    arrays["rho/rollout"][3] = np.nan  # an image where rho is undefined
    record = CellRecord(f"run{seed}", "vit", seed, "FINISHED", "c" * 40, "false", 0, 1, "", {}, {})
    return attribution_runs.AttributionCellResult(record, arrays)


def test_the_report_numbers_are_the_per_image_arrays_recomputed():
    rng = np.random.default_rng(7)
    cells = {s: _cell(rng, s) for s in (0, 1, 2)}
    rows = faithfulness_rows(cells, 400, 0.95, 0)
    assert [(r.method, r.measure) for r in rows[:3]] == [
        ("cls_attention", m) for m in ("rho", "deletion_auc", "insertion_auc")
    ]
    diffs = {}
    for r in rows:
        key = "rho" if r.measure == "rho" else r.measure.replace("_auc", "_prob")

        def value(cell, method, key=key, measure=r.measure):
            a = cell.arrays[f"{key}/{method}"]
            return (
                np.nanmean(a)
                if measure == "rho"
                else _trapezoid(cell.arrays["fractions"], a).mean()
            )

        mine = {s: value(c, r.method) for s, c in cells.items()}
        for s in cells:
            diffs[f"{r.method}/{r.measure}/seed{s}"] = abs(r.per_seed[s] - mine[s])
        v = np.array([mine[s] for s in sorted(mine)])
        half = sps.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))
        diffs[f"{r.method}/{r.measure}/t"] = max(
            abs(r.over_seeds.ci_low - (v.mean() - half)),
            abs(r.over_seeds.ci_high - (v.mean() + half)),
        )
        if r.method == "random":
            assert r.vs_random is None and r.bootstrap is None
            continue
        d = np.array([mine[s] - value(cells[s], "random") for s in sorted(cells)])
        diffs[f"{r.method}/{r.measure}/diff"] = abs(r.vs_random.mean_difference - d.mean())
        diffs[f"{r.method}/{r.measure}/bootstrap estimate"] = abs(r.bootstrap.estimate - d.mean())
        assert r.bootstrap.low <= r.bootstrap.estimate <= r.bootstrap.high, (
            r.method,
            r.measure,
            r.bootstrap,
        )
        sign = 1 if r.measure != "deletion_auc" else -1
        assert r.better_in() == int((sign * d > 0).sum())
    assert sum(rows[3].undefined.values()) == 3, "rollout's rho is undefined on one image per seed"
    bad = {k: v for k, v in diffs.items() if not v <= 1e-9}
    assert not bad, f"max difference {max(diffs.values()):.3g}: {bad}"
    # The table shows these numbers: chefer's mean rho, rounded to three decimals, signed.
    md = to_markdown([attribution_report.faithfulness_table(rows, 0.95)])
    chefer = next(line for line in md.splitlines() if line.startswith("| `chefer`"))
    assert (
        f"{next(r for r in rows if (r.method, r.measure) == ('chefer', 'rho')).mean:+.3f}" in chefer
    ), chefer


def test_the_bootstrap_of_a_constant_difference_is_that_difference():
    rng = np.random.default_rng(1)
    a = {s: rng.normal(size=30) for s in (0, 1, 2)}
    ci = value_bootstrap(a, {s: v - 0.25 for s, v in a.items()}, 300, 0.95, 0)
    assert max(abs(ci.low - 0.25), abs(ci.high - 0.25), abs(ci.estimate - 0.25)) <= 1e-12, ci


def test_token_norm_numbers_are_the_norms_recomputed():
    rng = np.random.default_rng(3)
    cells = {s: _cell(rng, s) for s in (0, 1)}
    b1 = block_norms(cells)[1]
    for s, c in cells.items():
        a = c.arrays
        high = a["norms"][1] > 2.5 * a["median_norm"][1]
        assert b1.fraction[s] == pytest.approx(high.mean(), abs=TOL)
        attn = a["cls_attention"] / a["cls_attention"].sum(axis=1, keepdims=True)
        rows = high.any(axis=1)
        assert b1.attention_share[s] == pytest.approx(
            (attn * high).sum(axis=1)[rows].mean(), abs=TOL
        )
        assert b1.effect_high[s] == pytest.approx(a["effects"][high].mean(), abs=TOL)
    # the planted token at patch 4 = row 1, col 1, both seeds
    assert b1.positions.get((1, 1), 0) >= 2, b1.positions
    attention = attention_on_effects(cells)
    assert attention.top == 5 and attention.chance == pytest.approx(5 / 9, abs=TOL)
    for s, c in cells.items():
        a = c.arrays
        assert attention.on_top_effects[s] == pytest.approx(
            _share_on_top(a["cls_attention"], a["effects"], 5).mean(), abs=TOL
        )
        assert attention.concentration[s] == pytest.approx(
            _share_on_top(a["cls_attention"], a["cls_attention"], 5).mean(), abs=TOL
        )


def test_exported_arrays_read_back_the_same_and_a_changed_file_is_refused(tmp_path):
    cell = _cell(np.random.default_rng(5), 0)
    data = npz_bytes(cell.arrays)
    assert data == npz_bytes(dict(reversed(list(cell.arrays.items())))), (
        "the same arrays must give the same bytes"
    )
    (tmp_path / "arrays").mkdir()
    (tmp_path / "arrays" / "vit.seed0.npz").write_bytes(data)
    entry = {
        "arrays": {
            "file": "arrays/vit.seed0.npz",
            "sha256": hashlib.sha256(data).hexdigest(),
            "shapes": {k: list(np.shape(v)) for k, v in sorted(cell.arrays.items())},
        }
    }
    back = exported_cell(tmp_path, cell.record, entry)
    differ = [
        k
        for k in cell.arrays
        if not np.array_equal(
            cell.arrays[k], back.arrays[k], equal_nan=cell.arrays[k].dtype.kind == "f"
        )
    ]
    assert set(back.arrays) == set(cell.arrays) and not differ, differ
    (tmp_path / "arrays" / "vit.seed0.npz").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ReportError, match=r"vit.seed0.npz: sha256 differs"):
        exported_cell(tmp_path, cell.record, entry)


def test_the_attribution_fingerprint_covers_rollout_and_the_libraries_but_not_figures(tmp_path):
    from workbench.train.fingerprint import LIBRARY_ROOT, PROJECT_ROOT

    root = tmp_path / "repo"
    for path in LIBRARY_ROOT.rglob("*.py"):
        if "__pycache__" not in path.parts:
            target = root / path.relative_to(PROJECT_ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    versions = {"torch": "1", "timm": "2"}
    here = attribution_runs.attribution_fingerprint(PROJECT_ROOT, versions)
    # a copy is the same code
    assert attribution_runs.attribution_fingerprint(root, versions) == here
    changed = {}
    for name in (
        "analysis/rollout.py",
        "sample.py",
        "attribution/cell.py",
        "interventions/forward.py",
        "models/vit.py",
        "precision.py",
        "transfer/source_model.py",
        "analysis/attention_figures.py",
        "attribution/attribution_figures.py",
        "stats.py",
    ):
        path = root / "workbench" / name
        before = path.read_bytes()
        path.write_bytes(before + b"\n_EDITED = 1\n")  # a statement: comments are not code
        changed[name] = attribution_runs.attribution_fingerprint(root, versions) != here
        path.write_bytes(before)
    want = {
        "analysis/rollout.py": True,
        "sample.py": True,
        "attribution/cell.py": True,
        "interventions/forward.py": True,
        "models/vit.py": True,
        "precision.py": True,  # imported by the training loop and the acting kinds' inputs
        "transfer/source_model.py": True,  # the acted-on cell's adapter, imported
        "analysis/attention_figures.py": False,
        "stats.py": False,
        "attribution/attribution_figures.py": False,  # figures: read side, imported by no result code
    }
    assert changed == want, {k: v for k, v in changed.items() if want[k] != v}
    assert attribution_runs.attribution_fingerprint(root, {"torch": "3", "timm": "2"}) != here
