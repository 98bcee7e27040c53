"""Published sentences checked against the published evidence: ``docs/results/claims.yaml``.

Each claim is a sentence as it stands in README.md or docs/results/README.md, the numbers it
shows (as shown), the evidence files under ``docs/results/<study>/evidence/`` they come from,
and a named computation here (``COMPUTATIONS``) that recomputes them from those files alone.
``check_claims`` recomputes every claim, rounds each value as the sentence shows it (the
digits after the point, a sign where the text has one) and returns the mismatches; it also
returns every number of the checked text that no claim's sentence accounts for.

The checked text: README.md's ``## Results`` section and, in docs/results/README.md, the part
between ``<!-- claims -->`` and ``<!-- /claims -->``. Code spans, link targets and the names
in ``NOT_NUMBERS`` (CIFAR-10, a citation's year, the 95% confidence level every study uses) are
not numbers.

Each claim also states its relations (``relations``): what the sentence says of its numbers, in a
closed vocabulary (``RELATIONS``: ``above``, ``below``, ``ahead``, ``behind``, ``settled``,
``not settled``, ``holds in k of n``, ``still improving``, ``flattened``, ``agree``, ...), each
recomputed from the results it names (``of``) and each with its wording (``words``), a span of
the sentence that must say that relation and no other (``not settled`` cannot read "below").
Every relation word of a sentence (``RELATION_WORDS``) must lie in a stated relation's words. So a
sentence that says "rank below" over an interval touching zero fails as a wrong digit does.

Computations (all from ``docs/results/<study>/evidence/``):

- ``accuracy``: the mean over seeds of an arm's accuracy in percent, from its predictions
  files (``predictions/<arm>.seed<s>.<split>.csv.gz``).
- ``accuracy_difference``: a - b in points, paired by seed (``workbench.stats.paired_seed_comparison``):
  ``mean``, ``low``, ``high`` (the t-interval), ``wins`` (seeds with a - b > 0), ``n``.
- ``difference_between_studies``: (a - b in ``study``) - (a - b in ``other``), paired by seed,
  for two studies whose cells pair by seed (the same arms and seeds, one field changed): ``mean``,
  ``low``, ``high``, ``wins``, ``losses``, ``n``.
- ``qwk`` and ``qwk_difference``: the same with quadratic weighted kappa.
- ``intervention``: an intervention's change in accuracy (points) against the intact model,
  from ``outcomes/<arm>.seed<s>.csv.gz``, paired by seed: ``mean``, ``low``, ``high``, ``lower_in``.
- ``heads_costing_less``: per seed, the heads whose ablation lowers accuracy by less than
  ``threshold`` points (a head that raises it costs nothing), ``seed<s>``; each seed's costliest
  head (``costliest_seed<s>``) and their range over seeds (``costliest_min``, ``costliest_max``).
  The range of the per-index mean drops (``smallest_drop``, ``largest_drop``) is computed but no
  sentence may show it: a head index names a different head in each seed's model.
- ``faithfulness_pair``: method a minus method b in one arm, paired by seed (the report's pairs).
- ``random_draws``: the mean of an arm's random draws (``mean``), the one order the report's
  ``random`` row shows (``draw0``), a single order's spread (``sd``).
- ``patching_agreement``: the seeds' Spearman agreement on the patching map over the places not
  fixed by construction (or one block's free patch positions): ``mean``, ``min``, ``max``.
- ``differences_settled``: of several arms against one, how many intervals exclude zero.
- ``faithfulness_all``: over every method but random, the random order's ``random`` mean and
  ``fewest_better``, the fewest seeds in which any method beats it.
- ``calibration_difference``: a - b of one calibration score (``ece``, ``nll`` or ``brier``,
  ``stage`` "before" or "after" temperature scaling; ``workbench.calibration.calibrate``: T
  fitted on validation, scored on test) from ``predictions/<arm>.seed<s>.<split>.probs.csv.gz``
  beside the labels of ``<arm>.seed<s>.<split>.csv.gz``, paired by seed: ``mean``, ``low``,
  ``high``, ``wins``, ``losses`` (seeds where a's score is lower, i.e. a better calibrated),
  ``n``; and ``a_mean`` and ``b_mean``, each arm's mean over seeds.
- ``token_norms``: the largest share (%) of high-norm patch tokens in any block (mean over seeds)
  and the largest norm over its block's median, from ``arrays/<arm>.seed<s>.npz``.
- ``faithfulness_difference``: arm a minus arm b of one method's measure, paired by seed:
  ``mean``, ``low``, ``high``, ``wins``, ``n``.
- ``attribution_patching``: an estimate's agreement with exact patching (AtP, AtP-IG, the
  shuffled-gradient control, random scores; Spearman rho, top-10 overlap or sign agreement) from
  ``patching/<arm>.seed<s>.npz.gz``, as the report computes it: ``mean``, ``low``, ``high``,
  ``seed<s>``; ``attribution_patching_difference``: two of them paired by seed;
  ``atp_class_token_share``: the share of an estimate's ten worst locations at the class token,
  beside its ``chance`` share of the scored locations.
- ``data_size_gap``, ``data_size_slope``, ``data_size_interaction``: a data-size study's reading
  (``reports.content.data_size``: arms grouped into families by everything but
  ``dataset.train_subset``, N from ``runs.json``): family a minus b at one N, in points, paired
  by seed; the slope of a - b against log10 N (per seed by least squares, then mean and
  t-interval over seeds: points per tenfold N); and, for two families sharing two sizes, (a - b
  at the smaller N) - (a - b at the larger N). Their relations are the report's: settled where
  the t-interval excludes zero.
- ``faithfulness``: an attribution method's mean over seeds of a measure from
  ``arrays/<arm>.seed<s>.npz``: ``mean``, ``low``, ``high`` (rho: Fisher z; AUCs: t), and
  ``better_than_random`` (seeds where it beats the random order).
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

from reports.attribution.controls import draw_means
from reports.common.convergence import convergence as read_curve
from reports.interventions.edge_report import restored as edge_restored
from reports.interventions.edge_report import seed_agreement
from reports.interventions.patch_localisation import localisation
from reports.interventions.atp_report import (
    class_token_share,
    mean_interval,
    scored_class_token_share,
    seed_scores,
    worst_locations,
)
from reports.interventions.patching_report import effect_maps, fixed_locations, spearman_pairs
from workbench import stats
from workbench.attribution import auc
from workbench.calibration import calibrate
from workbench.interventions.patching import restored_fraction
from workbench.protocol.common import read_yaml
from reports.content import data_size
from reports.content.rounding import fmt

RESULTS = Path("docs/results")
NUMBER = re.compile(r"[+−-]?\d+(?:,\d{3})*(?:\.\d+)?")  # a comma only between thousands
NOT_NUMBERS = re.compile(
    r"CIFAR-10|Fashion-MNIST|ImageNet-21k|ViT-B/16|\b(?:fp|bf)(?:16|32)\b|\b(19|20)\d\d\b|`[^`]*`|\]\([^)]*\)|\b95%"
)
BEGIN, END = "<!-- claims -->", "<!-- /claims -->"
# A result's keys whose value no sentence may show, each with why (see ``heads_costing_less``).
UNMATCHED = "unmatched"
HEADS_UNMATCHED = (
    "a range over head indices averaged across seeds, but a head index names a different head in "
    "each separately trained model (the heads report); show the costliest head per seed instead"
)


class ClaimError(ValueError):
    """A claims file or a claim is malformed; the message names the claim."""


def _seeds_files(root: Path, study: str, folder: str, arm: str, suffix: str) -> dict[int, Path]:
    files = sorted((root / study / "evidence" / folder).glob(f"{arm}.seed*{suffix}"))
    out = {}
    for f in files:
        seed = re.match(rf"{re.escape(arm)}\.seed(\d+){re.escape(suffix)}$", f.name)
        if seed:
            out[int(seed.group(1))] = f
    if not out:
        raise ClaimError(f"{root / study / 'evidence' / folder}: no {arm}.seed*{suffix}")
    return out


def _predictions(root: Path, study: str, arm: str, split: str) -> dict[int, pd.DataFrame]:
    files = _seeds_files(root, study, "predictions", arm, f".{split}.csv.gz")
    return {s: pd.read_csv(io.BytesIO(gzip.decompress(f.read_bytes()))) for s, f in files.items()}


def _per_seed(root, study, arm, split, metric) -> dict[int, float]:
    return {s: metric(d) for s, d in _predictions(root, study, arm, split).items()}


def _accuracy(d: pd.DataFrame) -> float:
    return 100.0 * float((d["label"] == d["predicted"]).mean())


def _qwk(d: pd.DataFrame, classes: int = 5) -> float:
    return stats.quadratic_weighted_kappa(d["label"], d["predicted"], classes)


def _paired(a: dict[int, float], b: dict[int, float]) -> dict[str, float]:
    c = stats.paired_seed_comparison(a, b, 0.95)
    return {
        "mean": c.mean_difference,
        "low": c.ci_low,
        "high": c.ci_high,
        "wins": c.wins,
        "losses": c.losses,
        "ties": c.n - c.wins - c.losses,
        "n": c.n,
    }


def accuracy(root: Path, study: str, arm: str, split: str) -> dict[str, float]:
    """Mean over seeds and the sample std (n - 1) of the per-seed accuracies, in %."""
    values = list(_per_seed(root, study, arm, split, _accuracy).values())
    std = float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
    return {"mean": float(np.mean(values)), "std": std}


def accuracy_difference(root: Path, study: str, a: str, b: str, split: str) -> dict[str, float]:
    return _paired(
        _per_seed(root, study, a, split, _accuracy), _per_seed(root, study, b, split, _accuracy)
    )


def _differences(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    """a - b per seed, for the seeds both have."""
    return {s: a[s] - b[s] for s in sorted(set(a) & set(b))}


def difference_between_studies(
    root: Path, study: str, other: str, a: str, b: str, split: str
) -> dict[str, float]:
    """(a - b in ``study``) - (a - b in ``other``) in points, paired by seed: how much a
    difference moved between two studies whose cells pair by seed (one recipe, one field
    changed, such as the epochs)."""
    here, there = (
        _differences(
            _per_seed(root, name, a, split, _accuracy), _per_seed(root, name, b, split, _accuracy)
        )
        for name in (study, other)
    )
    return _paired(here, there)


def qwk(root: Path, study: str, arm: str, split: str) -> dict[str, float]:
    return {"mean": float(np.mean(list(_per_seed(root, study, arm, split, _qwk).values())))}


def qwk_difference(root: Path, study: str, a: str, b: str, split: str) -> dict[str, float]:
    return _paired(_per_seed(root, study, a, split, _qwk), _per_seed(root, study, b, split, _qwk))


def _labelled_probs(root: Path, study: str, arm: str, split: str) -> dict[int, tuple]:
    """Per seed: (probabilities (N, K), labels (N,)), rows in example-index order."""
    labels = _predictions(root, study, arm, split)
    files = _seeds_files(root, study, "predictions", arm, f".{split}.probs.csv.gz")
    out = {}
    for seed, f in files.items():
        probs = pd.read_csv(io.BytesIO(gzip.decompress(f.read_bytes())))
        table = labels[seed][["index", "label"]].merge(probs, on="index", validate="one_to_one")
        table = table.sort_values("index", kind="stable")
        columns = sorted((c for c in table if c.startswith("prob_")), key=lambda c: int(c[5:]))
        out[seed] = (table[columns].to_numpy(np.float64), table["label"].to_numpy(np.int64))
    return out


def _calibration_scores(root: Path, study: str, arm: str, metric: str, stage: str) -> dict:
    """Scored on test where the study has it; otherwise on validation, cross-fitted, as the report does."""
    val = _labelled_probs(root, study, arm, "val")
    has_test = any(
        (root / study / "evidence" / "predictions").glob(f"{arm}.seed*.test.probs.csv.gz")
    )
    test = _labelled_probs(root, study, arm, "test") if has_test else {}
    return {
        s: getattr(calibrate(*val[s], *test.get(s, (None, None))), stage)[metric]
        for s in sorted(val)
    }


def calibration_difference(
    root: Path, study: str, a: str, b: str, metric: str, stage: str
) -> dict[str, float]:
    if metric not in ("ece", "nll", "brier") or stage not in ("before", "after"):
        raise ClaimError(f"calibration_difference: metric {metric!r} / stage {stage!r}")
    va = _calibration_scores(root, study, a, metric, stage)
    vb = _calibration_scores(root, study, b, metric, stage)
    paired = _paired(va, vb)
    return {
        **paired,
        "a_mean": float(np.mean(list(va.values()))),
        "b_mean": float(np.mean(list(vb.values()))),
    }


def _outcomes(root: Path, study: str, arm: str) -> dict[int, pd.DataFrame]:
    files = _seeds_files(root, study, "outcomes", arm, ".csv.gz")
    return {s: pd.read_csv(io.BytesIO(gzip.decompress(f.read_bytes()))) for s, f in files.items()}


def _change(d: pd.DataFrame, column: str) -> float:
    """Accuracy change in points of one intervention against the intact model."""
    return 100.0 * float((d[column] == d["label"]).mean() - (d["intact"] == d["label"]).mean())


def intervention(root: Path, study: str, arm: str, column: str) -> dict[str, float]:
    changes = {s: _change(d, column) for s, d in _outcomes(root, study, arm).items()}
    c = stats.paired_seed_comparison(changes, dict.fromkeys(changes, 0.0), 0.95)
    return {
        "mean": c.mean_difference,
        "low": c.ci_low,
        "high": c.ci_high,
        "lower_in": c.losses,
        "wins": c.wins,
        "losses": c.losses,
        "n": c.n,
    }


def heads_costing_less(
    root: Path, study: str, arm: str, ablation: str, threshold: float
) -> dict[str, object]:
    per_seed, changes = {}, []
    for seed, d in sorted(_outcomes(root, study, arm).items()):
        heads = [
            c for c in d.columns if re.fullmatch(rf"blocks\.\d+\.attn\.head\d+\.{ablation}", c)
        ]
        change = np.array([_change(d, h) for h in heads])
        per_seed[f"seed{seed}"] = int((change > -threshold).sum())
        changes.append(change)
    means = np.mean(changes, axis=0)  # per head index, over seeds: heads do not correspond
    # the largest single-head drop of each seed's model
    costliest = {f"costliest_{name}": float(-c.min()) for name, c in zip(per_seed, changes)}
    return {
        **per_seed,
        **costliest,
        "threshold": threshold,
        "heads": len(means),
        "costliest_min": min(costliest.values()),
        "costliest_max": max(costliest.values()),
        "over_seeds": ("costliest_min", "costliest_max"),
        "smallest_drop": float(-means.max()),
        "largest_drop": float(-means.min()),
        UNMATCHED: {
            "smallest_drop": HEADS_UNMATCHED,
            "largest_drop": HEADS_UNMATCHED,
        },
    }


@lru_cache(maxsize=8)  # one study's arrays are read by several claims; nothing writes them
def _arrays(root: Path, study: str, arm: str) -> dict[int, dict[str, np.ndarray]]:
    files = _seeds_files(root, study, "arrays", arm, ".npz")
    out = {}
    for s, f in files.items():
        with np.load(f, allow_pickle=False) as z:
            out[s] = {k: z[k] for k in z.files}
    return out


def _measure(a: dict[str, np.ndarray], method: str, measure: str) -> float:
    if measure == "rho":
        r = a[f"rho/{method}"]
        return float(r[np.isfinite(r)].mean())
    curve = a[("deletion_prob/" if measure == "deletion_auc" else "insertion_prob/") + method]
    return float(auc(a["fractions"], curve).mean())


def faithfulness(root: Path, study: str, arm: str, method: str, measure: str) -> dict[str, float]:
    cells = _arrays(root, study, arm)
    values = {s: _measure(a, method, measure) for s, a in cells.items()}
    base = {s: _measure(a, "random", measure) for s, a in cells.items()}
    if measure == "rho":
        low, high = stats.fisher_z_interval(list(values.values()), 0.95)
    else:
        c = stats.paired_seed_comparison(values, dict.fromkeys(values, 0.0), 0.95)
        low, high = c.ci_low, c.ci_high
    better = sum(
        (values[s] - base[s]) * (-1.0 if measure == "deletion_auc" else 1.0) > 0 for s in values
    )
    return {
        "mean": float(np.mean(list(values.values()))),
        "low": low,
        "high": high,
        "better_than_random": better,
        "random": float(np.mean(list(base.values()))),
        "n": len(values),
    }


def faithfulness_all(root: Path, study: str, arm: str, measure: str) -> dict[str, float]:
    """Every method but random: the random order's mean and the fewest seeds any method beats it in."""
    cells = _arrays(root, study, arm)
    methods = [str(m) for m in next(iter(cells.values()))["methods"] if str(m) != "random"]
    results = [faithfulness(root, study, arm, m, measure) for m in methods]
    return {
        "random": results[0]["random"],
        "fewest_better": min(r["better_than_random"] for r in results),
        "n": results[0]["n"],
    }


@lru_cache(maxsize=8)
def _patching_cells(root: Path, study: str, arm: str) -> dict[int, dict[str, np.ndarray]]:
    """Per seed, every array of the cell's patching evidence."""
    out = {}
    for s, f in _seeds_files(root, study, "patching", arm, ".npz.gz").items():
        with np.load(io.BytesIO(gzip.decompress(f.read_bytes())), allow_pickle=False) as z:
            out[s] = {k: z[k] for k in z.files}
    return out


def _patching_maps(root: Path, study: str, arm: str) -> dict[int, np.ndarray]:
    """Per seed, the fraction of the logit difference restored by each (block, token position)."""
    return {
        s: restored_fraction(z["resid_ld"], z["clean_ld"], z["corrupted_ld"])
        for s, z in _patching_cells(root, study, arm).items()
    }


def patching(root: Path, study: str, arm: str, block: int, position: int) -> dict[str, float]:
    """One block's residual at one token position: mean restored fraction, t-interval over seeds."""
    values = {s: float(m[block, position]) for s, m in _patching_maps(root, study, arm).items()}
    c = stats.paired_seed_comparison(values, dict.fromkeys(values, 0.0), 0.95)
    return {"mean": c.mean_difference, "low": c.ci_low, "high": c.ci_high, "n": c.n}


def patching_patch_max(root: Path, study: str, arm: str, prefix: int = 1) -> dict[str, float]:
    """The largest mean restored fraction of any single patch position (prefix tokens left out)."""
    maps = _patching_maps(root, study, arm)
    mean = np.mean([maps[s] for s in sorted(maps)], axis=0)  # (blocks, positions)
    return {"largest": float(np.max(mean[:, prefix:]))}


def _place_values(
    root: Path, study: str, arm: str, block: int, place: str, key: str, direction: str, part, prefix
) -> dict[int, float]:
    """Per seed, one block's fraction at one place of a ``patches`` corruption
    (``reports.interventions.patch_localisation``); ``part`` picks a branch (0 attention, 1 MLP),
    ``prefix`` is the model's prefix tokens (the class token and any registers)."""
    out = {}
    for s, z in _patching_cells(root, study, arm).items():
        value = localisation(z, prefix, key, direction)[place][block]
        out[s] = float(value if part is None else value[part])
    return out


def patching_place(
    root: Path,
    study: str,
    arm: str,
    block: int,
    place: str,
    key: str = "resid",
    direction: str = "denoising",
    part: int | None = None,
    prefix: int = 1,
) -> dict[str, float]:
    """Fraction restored (removed) at a place (class token, a replaced or an untouched patch):
    mean over seeds and its t-interval."""
    values = _place_values(root, study, arm, block, place, key, direction, part, prefix)
    c = stats.paired_seed_comparison(values, dict.fromkeys(values, 0.0), 0.95)
    return {"mean": c.mean_difference, "low": c.ci_low, "high": c.ci_high, "n": c.n}


def patching_place_difference(
    root: Path,
    study: str,
    arm: str,
    block: int,
    a: str,
    b: str,
    key: str = "resid",
    direction: str = "denoising",
    part: int | None = None,
    prefix: int = 1,
) -> dict[str, float]:
    """Place ``a`` minus place ``b`` of one block, paired by seed."""
    return _paired(
        _place_values(root, study, arm, block, a, key, direction, part, prefix),
        _place_values(root, study, arm, block, b, key, direction, part, prefix),
    )


def edge_patching(root: Path, study: str, arm: str, measure: str = "edges_rho") -> dict[str, float]:
    """Edge AtP against exact path patching over a cell's edges (``edges_rho``,
    ``edges_sign_agreement``, ``edges_top10_overlap``), over seeds as the report shows it:
    ``mean``, ``low``, ``high`` (rho: Fisher's z; shares: Student-t clipped to [0, 1]),
    ``edges`` (per cell), ``n``."""
    cells = _patching_cells(root, study, arm)
    values = seed_agreement(cells)[measure]
    mean, low, high = mean_interval(values, "rho" if measure == "edges_rho" else "share", 0.95)
    edges = len(next(iter(cells.values()))["edge_labels"])
    return {"mean": mean, "low": low, "high": high, "edges": edges, "n": len(values)}


def _edge_largest_values(
    root: Path, study: str, arm: str, block: int, reader: str
) -> tuple[dict[int, float], dict[int, float]]:
    """Per seed, the exact fraction restored by the head of ``block`` that restores most into
    ``reader``, and that edge's AtP."""
    exact, atp = {}, {}
    for s, z in _patching_cells(root, study, arm).items():
        idx = [
            k
            for k, lab in enumerate(z["edge_labels"])
            if str(lab).startswith(f"L{block}H") and str(lab).endswith(f"->{reader}")
        ]
        e, a = edge_restored(z, "edge_exact_ld")[idx], edge_restored(z, "edge_atp_ld")[idx]
        k = int(np.argmax(e))
        exact[s], atp[s] = float(e[k]), float(a[k])
    return exact, atp


def edge_largest(root: Path, study: str, arm: str, block: int, reader: str) -> dict[str, float]:
    """The head of ``block`` that restores most into ``reader`` in each seed (exact path
    patching), and its edge AtP: ``mean``, ``low``, ``high`` (exact) and ``atp_mean``,
    ``atp_low``, ``atp_high``, Student-t over seeds, as the report's edge table."""
    out = {}
    for prefix, values in zip(("", "atp_"), _edge_largest_values(root, study, arm, block, reader)):
        c = stats.paired_seed_comparison(values, dict.fromkeys(values, 0.0), 0.95)
        out |= {
            f"{prefix}mean": c.mean_difference,
            f"{prefix}low": c.ci_low,
            f"{prefix}high": c.ci_high,
        }
    return out | {"n": len(values)}


def edge_largest_gap(root: Path, study: str, arm: str, block: int, reader: str) -> dict:
    """That edge's AtP minus its exact fraction restored, paired by seed (``_paired``'s keys)."""
    exact, atp = _edge_largest_values(root, study, arm, block, reader)
    return _paired(atp, exact)


def _val_curves(root: Path, study: str, arm: str) -> dict[int, dict[int, float]]:
    """Per seed, the cell's logged validation accuracy per epoch (evidence/runs.json)."""
    runs = json.loads((root / study / "evidence" / "runs.json").read_text())
    out = {}
    for cell in runs["cells"]:
        if cell["tags"].get("arm") == arm:
            history = cell["metric_history"].get("val_accuracy", [])
            out[int(cell["params"]["seed"])] = {int(step): value for step, _, value in history}
    if not out:
        raise ClaimError(f"{root / study / 'evidence' / 'runs.json'}: no cell of arm {arm!r}")
    return out


def convergence(root: Path, study: str, arm: str) -> dict[str, float]:
    """Over an arm's seeds: how many cells still improve (the report's convergence table's rule),
    how many peaked at their last epoch, and the range of their late slopes (points per epoch)."""
    read = [read_curve(c) for _, c in sorted(_val_curves(root, study, arm).items())]
    if any(r is None for r in read):
        raise ClaimError(f"{study}/{arm}: a validation curve shorter than 2 epochs")
    slopes = [r.late_slope for r in read]
    return {
        "still_improving": sum(r.still_improving for r in read),
        "best_at_last": sum(r.best_epoch == r.epochs for r in read),
        "n": len(read),
        "epochs": max(r.epochs for r in read),
        "slope_min": min(slopes),
        "slope_max": max(slopes),
        "slope_mean": float(np.mean(slopes)),
        "last_mean": float(np.mean([r.last for r in read])),
        "best_mean": float(np.mean([r.best for r in read])),
    }


def token_norms(root: Path, study: str, arm: str) -> dict[str, float]:
    """Over an arm's seeds, blocks and scored images: the share of patch tokens (%) whose L2 norm
    exceeds the study's threshold x the block's median (``largest_share``, the largest over blocks
    of the per-seed mean), and the largest norm over its block's median (``largest_ratio``)."""
    cells = _arrays(root, study, arm)
    shares, ratios = [], []
    for a in cells.values():
        median = a["median_norm"][:, None, None]  # (L, 1, 1)
        shares.append((a["norms"] > float(a["norm_threshold"]) * median).mean(axis=(1, 2)))
        ratios.append(float((a["norms"] / median).max()))
    return {
        "largest_share": float(100 * np.max(np.mean(shares, axis=0))),
        "largest_ratio": max(ratios),
        "threshold": float(next(iter(cells.values()))["norm_threshold"]),
        "n": len(cells),
    }


def norm_control(root: Path, study: str, arm: str) -> dict[str, float]:
    """The high-norm detector's planted positive control over an arm's seeds (``norm_control/*``
    arrays): ``detects_from``, the smallest planted ratio (x the block's median norm) flagged in
    every image of every seed; ``none_below``, the largest flagged in no image of any seed;
    ``clean_share``, the largest share (%) of patch tokens flagged with nothing planted."""
    cells = _arrays(root, study, arm)
    ratios = next(iter(cells.values()))["norm_control/ratios"].astype(np.float64)
    flagged = np.stack([a["norm_control/flagged"].astype(np.float64) for a in cells.values()])
    every, none = np.all(flagged == 1.0, axis=0), np.all(flagged == 0.0, axis=0)
    if not every.any() or not none.any():
        raise ClaimError(
            f"{study}/{arm}: the planted control has no ratio flagged everywhere or nowhere"
        )
    return {
        "detects_from": float(ratios[np.argmax(every)]),
        "none_below": float(ratios[none].max()),
        "clean_share": float(
            100 * max(float(a["norm_control/clean_flagged"]) for a in cells.values())
        ),
        "n": len(cells),
    }


def scored_sample(root: Path, study: str, arm: str) -> dict[str, float]:
    """The scored images per class (``class_counts``), the same in every seed of the arm:
    ``images``, ``classes`` (with at least one image), ``fewest`` and ``most`` per class."""
    counts = {tuple(a["class_counts"].tolist()) for a in _arrays(root, study, arm).values()}
    if len(counts) != 1:
        raise ClaimError(f"{study}/{arm}: the seeds scored different class counts {sorted(counts)}")
    (c,) = counts
    return {
        "images": float(sum(c)),
        "classes": float(sum(1 for x in c if x)),
        "fewest": float(min(c)),
        "most": float(max(c)),
    }


def _beyond_draws(a: dict[str, np.ndarray], method: str, measure: str) -> float:
    """A seed's mean over images of the method's measure minus the mean of that image's random
    draws (images where either is undefined left out)."""
    if measure == "rho":
        values = a[f"rho/{method}"].astype(np.float64)
    else:
        curve = ("deletion_prob/" if measure == "deletion_auc" else "insertion_prob/") + method
        values = auc(a["fractions"], a[curve]).astype(np.float64)
    with np.errstate(all="ignore"):
        per_image = values - np.nanmean(a[f"random_draws/{measure}"].astype(np.float64), axis=0)
    return float(per_image[np.isfinite(per_image)].mean())


def faithfulness_difference(
    root: Path, study: str, a: str, b: str, method: str, measure: str, beyond_draws: bool = False
) -> dict[str, float]:
    """Arm a minus arm b of one method's measure (the seed means, as the report's arm against
    arm): ``mean``, ``low``, ``high`` (t-interval over seeds), ``wins`` (seeds with a - b > 0), ``n``.
    With ``beyond_draws`` each arm's value is first taken relative to its own random orders, per
    image (the report's "beyond the random draws" column), so what the change of model does to
    every token order drops out."""
    value = _beyond_draws if beyond_draws else _measure
    va = {s: value(x, method, measure) for s, x in _arrays(root, study, a).items()}
    vb = {s: value(x, method, measure) for s, x in _arrays(root, study, b).items()}
    return _paired(va, vb)


def faithfulness_pair(
    root: Path, study: str, arm: str, a: str, b: str, measure: str
) -> dict[str, float]:
    """Method a minus method b of one measure in one arm, paired by seed (the report's method
    pairs: t-interval over the per-seed differences): ``mean``, ``low``, ``high``, ``wins``, ``n``."""
    cells = _arrays(root, study, arm)
    return _paired(
        {s: _measure(x, a, measure) for s, x in cells.items()},
        {s: _measure(x, b, measure) for s, x in cells.items()},
    )


def random_draws(root: Path, study: str, arm: str, measure: str) -> dict[str, float]:
    """The random orders of an arm (``random_draws/<measure>``, D draws per image): ``mean``, the
    mean over seeds of each seed's mean over its D draws (the report's "draws' mean per seed");
    ``draw0``, the one order the report's ``random`` row shows; ``sd``, the mean over seeds of the
    standard deviation of the D draws' means (the spread of a single random order)."""
    cells = _arrays(root, study, arm)
    means = [draw_means(SimpleNamespace(arrays=x), measure) for x in cells.values()]
    return {
        "mean": float(np.mean([m.mean() for m in means])),
        "draws": len(means[0]),
        "draw0": float(np.mean([_measure(x, "random", measure) for x in cells.values()])),
        "sd": float(np.mean([m.std(ddof=1) for m in means])),
        "n": len(cells),
    }


def patching_agreement(
    root: Path, study: str, arm: str, block: int | None = None, prefix: int = 1
) -> dict[str, float]:
    """Spearman correlation between every two seeds' blocks x positions maps, over the places not
    fixed by construction (the report's rule, ``patching_report.fixed_locations``); with ``block``,
    over that block's free patch positions alone (the first ``prefix`` positions are not patches):
    ``mean``, ``min``, ``max`` over the pairs, ``pairs``, ``places`` (how many places)."""
    cells = _patching_cells(root, study, arm)
    maps = effect_maps(cells, "resid")
    free = ~fixed_locations(cells)[0]
    if block is not None:
        keep = np.zeros_like(free)
        keep[block, prefix:] = free[block, prefix:]
        free = keep
    rho = spearman_pairs(maps, free)
    if not rho:
        raise ClaimError(f"{study}/{arm}: no two seeds' maps vary over the chosen places")
    return {
        "mean": float(np.mean(rho)),
        "min": min(rho),
        "max": max(rho),
        "pairs": len(rho),
        "places": int(free.sum()),
        "all_places": int(free.size),
    }


@lru_cache(maxsize=8)
def _atp_scores(root: Path, study: str, arm: str, direction: str) -> dict:
    """``atp_report.seed_scores`` of a study's cells, once per process: every AtP claim reads them
    (each scoring runs thousands of rank correlations against the random-score draws)."""
    return seed_scores(_patching_cells(root, study, arm), direction)


def attribution_patching(
    root: Path, study: str, arm: str, method: str, measure: str, direction: str = "denoising"
) -> dict[str, float]:
    """An estimate's agreement with exact patching (``atp_report.seed_scores``: ``atp``,
    ``atp_ig``, ``atp_shuffled`` or ``random``; ``measure`` rho, top10_overlap or
    sign_agreement) over seeds, as the report shows it: ``mean``, ``low``, ``high`` (rho:
    Fisher's z; shares: Student-t clipped to [0, 1]), ``seed<s>``, ``min``, ``max``, ``n``."""
    values = _atp_scores(root, study, arm, direction)[method][measure]
    mean, low, high = mean_interval(values, measure, 0.95)
    per = {f"seed{s}": v for s, v in values.items()}
    return {"mean": mean, "low": low, "high": high, **per, "min": min(values.values()),
            "max": max(values.values()), "n": len(values)}  # fmt: skip


def attribution_patching_difference(
    root: Path, study: str, arm: str, a: str, b: str, measure: str, direction: str = "denoising"
) -> dict[str, float]:
    """Estimate ``a`` minus ``b`` (``attribution_patching``'s names) in one measure, paired by
    seed: ``mean``, ``low``, ``high``, ``wins``, ``losses``, ``ties``, ``n``."""
    scores = _atp_scores(root, study, arm, direction)
    return _paired(scores[a][measure], scores[b][measure])


def atp_class_token_share(root: Path, study: str, arm: str, method: str) -> dict[str, float]:
    """Of the ``WORST`` locations where ``method`` differs most from exact patching (denoising),
    the share at the class token's residual, per seed and over seeds (``mean``, ``low``,
    ``high``: Student-t clipped to [0, 1]); ``chance``: the class token's share of the scored
    locations (mean over seeds)."""
    cells = _patching_cells(root, study, arm)
    shares = class_token_share(worst_locations(cells, method))
    mean, low, high = mean_interval(shares, "share", 0.95)
    chance = float(np.mean([scored_class_token_share(z) for z in cells.values()]))
    return {"mean": mean, "low": low, "high": high, "chance": chance,
            **{f"seed{s}": v for s, v in shares.items()}}  # fmt: skip


def differences_settled(
    root: Path, study: str, arms: list[str], b: str, split: str
) -> dict[str, float]:
    """Each arm minus ``b`` in accuracy, paired by seed: how many intervals exclude zero
    (``settled``), how many do not (``not_settled``), of ``n`` arms."""
    settled = 0
    for a in arms:
        d = accuracy_difference(root, study, a, b, split)
        settled += d["low"] > 0 or d["high"] < 0
    return {"settled": settled, "not_settled": len(arms) - settled, "n": len(arms)}


def _size_families(root: Path, study: str) -> dict[str, data_size.Family]:
    """The study's data-size families as its report groups them: the hashed protocol of
    ``runs.json`` and the logged params of its reported cells (those with predictions)."""
    runs = json.loads((root / study / "evidence" / "runs.json").read_text())
    params: dict[str, list] = {}
    for cell in sorted(runs["cells"], key=lambda c: int(c["tags"].get("seed", 0))):
        if "predictions" in cell:
            params.setdefault(cell["tags"]["arm"], []).append(cell["params"])
    families, _ = data_size.group_families(runs["protocol"]["canonical"], params)
    return {f.name: f for f in families}


def _size_arms(root: Path, study: str, a: str, b: str) -> tuple[data_size.Family, ...]:
    families = _size_families(root, study)
    for name in (a, b):
        if name not in families:
            raise ClaimError(f"{study}: no data-size family {name!r} ({', '.join(families)})")
    return families[a], families[b]


def data_size_gap(root: Path, study: str, a: str, b: str, size: int, split: str) -> dict:
    """Family a minus family b at N = ``size`` in points, paired by seed (as ``accuracy_difference``)."""
    fa, fb = _size_arms(root, study, a, b)
    if size not in fa.arms or size not in fb.arms:
        raise ClaimError(f"{study}: families {a} and {b} do not both train on N = {size}")
    return accuracy_difference(root, study, fa.arms[size], fb.arms[size], split)


def data_size_slope(root: Path, study: str, a: str, b: str, split: str) -> dict:
    """The slope of a - b against log10 N (points per tenfold N), per seed by least squares over
    every N both families trained on, then over seeds: ``mean``, ``low``, ``high`` (t-interval),
    ``wins`` / ``losses`` (seeds with a positive / negative slope), ``n``, ``sizes``."""
    fa, fb = _size_arms(root, study, a, b)
    sizes = data_size.shared_sizes(fa, fb)
    values = {
        name: {n: _per_seed(root, study, f.arms[n], split, _accuracy) for n in sizes}
        for name, f in ((a, fa), (b, fb))
    }
    slope = data_size.gap_slope(values[a], values[b], sizes)
    return _paired(slope.per_seed, {s: 0.0 for s in slope.per_seed}) | {"sizes": len(sizes)}


def data_size_interaction(root: Path, study: str, a: str, b: str, split: str) -> dict:
    """(a - b at the smaller N) - (a - b at the larger N) in points, paired by seed, for two
    families that share exactly two sizes: ``mean``, ``low``, ``high`` (t-interval), ``wins``, ``n``."""
    fa, fb = _size_arms(root, study, a, b)
    sizes = data_size.shared_sizes(fa, fb)
    if len(sizes) != 2:
        raise ClaimError(f"{study}: {a} and {b} share {len(sizes)} sizes, not 2")
    diffs = []
    for n in sizes:
        x = _per_seed(root, study, fa.arms[n], split, _accuracy)
        y = _per_seed(root, study, fb.arms[n], split, _accuracy)
        diffs.append({s: x[s] - y[s] for s in sorted(set(x) & set(y))})
    return _paired(*diffs)


COMPUTATIONS: dict[str, Callable[..., dict]] = {
    "faithfulness_pair": faithfulness_pair,
    "random_draws": random_draws,
    "patching_agreement": patching_agreement,
    "attribution_patching": attribution_patching,
    "attribution_patching_difference": attribution_patching_difference,
    "atp_class_token_share": atp_class_token_share,
    "differences_settled": differences_settled,
    "data_size_gap": data_size_gap,
    "data_size_slope": data_size_slope,
    "data_size_interaction": data_size_interaction,
    "token_norms": token_norms,
    "norm_control": norm_control,
    "scored_sample": scored_sample,
    "faithfulness_difference": faithfulness_difference,
    "convergence": convergence,
    "patching": patching,
    "patching_patch_max": patching_patch_max,
    "patching_place": patching_place,
    "edge_patching": edge_patching,
    "edge_largest": edge_largest,
    "edge_largest_gap": edge_largest_gap,
    "patching_place_difference": patching_place_difference,
    "accuracy": accuracy,
    "accuracy_difference": accuracy_difference,
    "difference_between_studies": difference_between_studies,
    "calibration_difference": calibration_difference,
    "qwk": qwk,
    "qwk_difference": qwk_difference,
    "intervention": intervention,
    "heads_costing_less": heads_costing_less,
    "faithfulness": faithfulness,
    "faithfulness_all": faithfulness_all,
}


# ------------------------------------------------------------------------------ relations
#
# What a sentence says of its numbers, in a closed vocabulary. Each relation is recomputed from
# the results of the computations it names (``of``) and its wording (``words``, a span of the
# sentence) must carry the relation's own words, so "rank below" over an interval that touches
# zero fails as a wrong digit does. A relation function returns (why it does not hold or None,
# phrases the wording must all hold, phrases of which it must hold one, phrases it must not hold).

# A relation: (its results, the claim, their indices, its words) -> the four above. The claim and
# the words are for the relations that read which numbers the words show (at most, range over
# seeds, mean of the draws, per seed); the others take them for one signature.
Relation = Callable[[list[dict], "Claim", list[int], str], tuple]

NOT_SETTLED_WORDS = ("not settled", "neither settled", "not told apart", "includes zero")
AGREE = 0.5  # Spearman between every two seeds at least this: "agree" (a fixed convention)


def _interval(r: dict) -> str:
    return f"{r['mean']:+.4g} [{r['low']:+.4g}, {r['high']:+.4g}]"


def _side(side: int, any_of: tuple[str, ...]) -> Relation:
    """Every interval on one side of zero: ``low > 0`` (side +1) or ``high < 0`` (side -1)."""

    def relation(results: list[dict], claim: Claim, of: list[int], words: str):
        bad = [_interval(r) for r in results if not (r["low"] > 0 if side > 0 else r["high"] < 0)]
        why = f"the interval {', '.join(bad)} is not {'above' if side > 0 else 'below'} zero"
        return (why if bad else None), (), any_of, NOT_SETTLED_WORDS

    return relation


def _settled(results, claim, of, words):
    """Every interval excludes zero, on either side."""
    bad = [_interval(r) for r in results if r["low"] <= 0 <= r["high"]]
    why = f"the interval {', '.join(bad)} includes zero"
    return (why if bad else None), ("settled",), (), NOT_SETTLED_WORDS


def _not_settled(results, claim, of, words):
    """Every interval includes zero; the words say so and name no direction."""
    bad = [_interval(r) for r in results if not r["low"] <= 0 <= r["high"]]
    why = f"the interval {', '.join(bad)} excludes zero: it is settled"
    forbidden = ("above", "below", "ahead", "behind", "beats", "favours", "lower", "higher")
    return (why if bad else None), (), NOT_SETTLED_WORDS, forbidden


def _seeds(count: Callable[[dict], int | None], what: str) -> Relation:
    """A count of seeds, written "k of n": the count the relation names, recomputed."""

    def relation(results, claim, of, words):
        phrases, why = [], None
        for r in results:
            k = count(r)
            if k is None:
                why = f"the mean difference is 0: no sign to hold ({_interval(r)})"
            phrases.append(f"{k} of {r['n']}")
        return why, tuple(dict.fromkeys(phrases)), (), ()

    relation.__doc__ = f"in how many seeds {what}"
    return relation


def _sign_holds(r: dict) -> int | None:
    return None if r["mean"] == 0 else int(r["wins"] if r["mean"] > 0 else r["losses"])


def _improving(results, claim, of, words):
    """How many cells are still improving (the report's rule), at least one: "k of n"."""
    k, n = sum(r["still_improving"] for r in results), sum(r["n"] for r in results)
    why = None if k > 0 else f"no cell is still improving (0 of {n})"
    return why, ("still improving", f"{k} of {n}"), (), ("flattened",)


def _flattened(mostly: bool) -> Relation:
    """ "flattened": no cell still improving by the report's rule (``reports/common/convergence``);
    "mostly flattened": fewer than half of them."""

    def relation(results, claim, of, words):
        k, n = sum(r["still_improving"] for r in results), sum(r["n"] for r in results)
        holds = 2 * k < n if mostly else k == 0
        why = f"{k} of {n} cells are still improving (the report's convergence rule)"
        return (None if holds else why), ("flattened",), (), ("still improving",)

    return relation


def _not_settled_count(results, claim, of, words):
    """Of several differences, how many intervals include zero: "k of n ... not settled"."""
    k, n = sum(r["not_settled"] for r in results), sum(r["n"] for r in results)
    return None, ("not settled", f"{k} of {n}"), (), ()


def _agreement(level: str) -> Relation:
    """Seeds' rank agreement: "agree" every pair >= AGREE; "agree weakly" some pair below AGREE
    and the mean above 0; "disagree" the mean at or below 0."""

    def relation(results, claim, of, words):
        got = []
        for r in results:
            got.append(
                "agree" if r["min"] >= AGREE else "agree weakly" if r["mean"] > 0 else "disagree"
            )
        bad = [g for g in got if g != level]
        why = (
            f"the pairs' Spearman (mean, min) reads {', '.join(bad)} (agree: every pair >= {AGREE})"
        )
        phrases = {
            "agree": ((), ("agree",), ("weakly", "partly", "disagree", "not agree", "only")),
            "agree weakly": ((), ("weakly", "partly", "only in part"), ("disagree",)),
            "disagree": ((), ("disagree", "do not agree", "not agree"), ()),
        }[level]
        return (why if bad else None), *phrases

    return relation


AT_MOST_WORDS = ("no single", "at most", "not more than", "in every", "none", "no ")


def _at_most(results, claim, of, words):
    """The value is at most the bound the sentence shows (``key``: the result it bounds)."""
    bad = []
    for i, r in zip(of, results):
        key = claim.relation_keys.get(i)
        shown = claim.numbers.get(f"{i}.{key}", claim.numbers.get(key) if i == 0 else None)
        if key is None or shown is None:
            return f"at most: give `key`, a result the claim shows ({i})", (), (), ()
        if float(r[key]) > float(shown.replace("−", "-").replace("%", "")):
            bad.append(f"{key} {r[key]:.6g} > {shown}")
    return (f"exceeds its bound: {', '.join(bad)}" if bad else None), (), AT_MOST_WORDS, ()


def _shown_in(claim: Claim, i: int, words: str) -> list[str]:
    """The result keys of computation ``i`` whose number as shown stands in ``words``."""
    keys = []
    for key, text in claim.numbers.items():
        index, _, name = key.rpartition(".")
        if int(index or 0) == i and re.search(rf"(?<![\d.]){re.escape(text)}(?![\d])", words):
            keys.append(name)
    return keys


def _over_seeds(results, claim, of, words):
    """The numbers the words show are a range over seeds (the result's ``over_seeds`` keys)."""
    bad = []
    for i, r in zip(of, results):
        shown = _shown_in(claim, i, words)
        bad += [f"{i}.{k}" for k in shown if k not in r.get("over_seeds", ())]
        bad += [] if shown else [f"{i}: no number in the words"]
    why = f"not a range over seeds: {bad}"
    return (why if bad else None), (), ("seed by seed", "per seed", "model by model"), ()


def _draws_mean(results, claim, of, words):
    """The mean of an arm's random orders: the words name how many, and show no single draw."""
    bad = [f"{i}.{k}" for i in of for k in _shown_in(claim, i, words) if k == "draw0"]
    phrases = tuple(dict.fromkeys(f"{r['draws']} random orders" for r in results))
    why = f"shows a single draw as the draws' mean: {bad}"
    return (why if bad else None), phrases, (), ()


def _each_seed(results, claim, of, words):
    """Every seed's value shown, not a pooled one ("model by model")."""
    missing = [
        f"{i}.{k}"
        for i, r in zip(of, results)
        for k in r
        if re.fullmatch(r"seed\d+", k)
        and f"{i}.{k}" not in claim.numbers
        and not (i == 0 and k in claim.numbers)
    ]
    why = f"the seeds' values not all shown: {missing}"
    return (why if missing else None), (), ("model by model", "seed by seed", "per seed"), ()


RELATIONS: dict[str, Relation] = {
    "above": _side(+1, ("above", "higher", "more", "restores", "beats", "raises")),
    "ahead": _side(+1, ("ahead", "beats", "favours", "better")),
    "below": _side(-1, ("below", "lower", "less", "costs", "favours")),
    "behind": _side(-1, ("behind", "lower", "favours")),
    "settled": _settled,
    "not settled": _not_settled,
    "not settled in k of n": _not_settled_count,
    "holds in k of n": _seeds(_sign_holds, "the mean difference's sign holds"),
    "ahead in k of n": _seeds(lambda r: int(r["wins"]), "a - b is above zero"),
    "behind in k of n": _seeds(lambda r: int(r["losses"]), "a - b is below zero"),
    "tied in k of n": _seeds(lambda r: int(r["ties"]), "a - b is zero"),
    "still improving": _improving,
    "flattened": _flattened(mostly=False),
    "mostly flattened": _flattened(mostly=True),
    "agree": _agreement("agree"),
    "agree weakly": _agreement("agree weakly"),
    "disagree": _agreement("disagree"),
    "at most": _at_most,
    "range over seeds": _over_seeds,
    "mean of the draws": _draws_mean,
    "per seed": _each_seed,
}
# Words that state a relation: each occurrence in a claim's sentence must lie in the wording of
# one of its relations, so a sentence cannot assert what its claim does not state.
RELATION_WORDS = re.compile(
    r"\b(above|below|ahead|behind|settled|told apart|agrees?|disagrees?|flattened|"
    r"still improving)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Claim:
    id: str
    sentence: str
    numbers: dict[str, str]  # "<computation result key>" or "<n>.<key>" -> the number as shown
    computations: list[dict]  # each: {name, study, and the computation's keyword arguments}
    relations: tuple[dict, ...] = ()  # each: {is, of (index or list), words, key (at most)}

    @property
    def relation_keys(self) -> dict[int, str]:
        return {i: r["key"] for r in self.relations if "key" in r for i in _indices(r.get("of", 0))}


def _indices(of: object) -> list[int]:
    return [int(i) for i in (of if isinstance(of, list) else [of])]


def load_claims(path: Path) -> list[Claim]:
    data = read_yaml(path)  # the schema layer's strict loader: a duplicated key is an error
    out = []
    for i, raw in enumerate(data.get("claims", [])):
        where = f"{path}: claims[{i}] ({raw.get('id', '?')})"
        missing = [k for k in ("id", "sentence", "numbers", "compute") if k not in raw]
        if missing:
            raise ClaimError(f"{where}: missing {', '.join(missing)}")
        compute = raw["compute"] if isinstance(raw["compute"], list) else [raw["compute"]]
        for c in compute:
            if c.get("name") not in COMPUTATIONS:
                raise ClaimError(
                    f"{where}: compute name {c.get('name')!r}; valid: {', '.join(COMPUTATIONS)}"
                )
        relations = raw.get("relations") or []
        for r in relations:
            if r.get("is") not in RELATIONS:
                raise ClaimError(
                    f"{where}: relation {r.get('is')!r}; valid: {', '.join(RELATIONS)}"
                )
            if not str(r.get("words", "")).strip():
                raise ClaimError(f"{where}: relation {r['is']!r} without its words")
            if any(not 0 <= i < len(compute) for i in _indices(r.get("of", 0))):
                raise ClaimError(f"{where}: relation {r['is']!r} of {r.get('of')}: no such compute")
        out.append(
            Claim(
                raw["id"],
                " ".join(raw["sentence"].split()),
                {str(k): str(v) for k, v in raw["numbers"].items()},
                compute,
                tuple({**r, "words": " ".join(str(r["words"]).split())} for r in relations),
            )
        )
    return out


def _shown(value: object, text: str) -> str:
    """``value`` written as ``text`` writes its number: the same decimals, a sign where it has one."""
    if isinstance(value, str):
        return value
    plain = text.replace("−", "-").replace(",", "")
    decimals = len(plain.split(".")[1]) if "." in plain else 0
    signed = plain[0] in "+-" and float(value) != 0
    shown = fmt(float(value), decimals, signed)
    if "," in text:
        shown = f"{float(shown):,.{decimals}f}"
    return shown.replace("-", "−") if "−" in text else shown


def wording(claim: Claim) -> list[str]:
    """The claim's wording problems: no relation stated, a relation's words not in its sentence,
    or a relation word of the sentence in no relation's words."""
    if not claim.relations:
        return [f"{claim.id}: states no relation (the claims file's ``relations``)"]
    problems, spans = [], []
    for r in claim.relations:
        at = claim.sentence.find(r["words"])
        if at < 0:
            problems.append(
                f"{claim.id}: {r['is']}: its words {r['words']!r} are not in the sentence"
            )
        else:
            spans.append((at, at + len(r["words"])))
    for m in RELATION_WORDS.finditer(claim.sentence):
        if not any(a <= m.start() and m.end() <= b for a, b in spans):
            problems.append(
                f"{claim.id}: {m.group(0)!r} ({claim.sentence[max(0, m.start() - 30) : m.end() + 10]!r})"
                " is in no relation's words: state the relation it asserts"
            )
    return problems


def relation_problems(claim: Claim, results: list[dict]) -> list[str]:
    """Each stated relation recomputed from its results, and its words checked against it."""
    problems = []
    for r in claim.relations:
        of = _indices(r.get("of", 0))
        why, all_of, any_of, none_of = RELATIONS[r["is"]](
            [results[i] for i in of], claim, of, r["words"]
        )
        words = r["words"].lower()  # "Model by model" says what "model by model" does
        name = f"{claim.id}: {r['is']} ({r['words']!r})"
        if why:
            problems.append(f"{name} does not hold: {why}")
        missing = [w for w in all_of if w not in words]
        if missing or (any_of and not any(w in words for w in any_of)):
            need = missing or [f"one of {list(any_of)}"]
            problems.append(f"{name}: its words do not say it: need {', '.join(need)}")
        said = [w for w in none_of if re.search(rf"\b{re.escape(w)}", words)]
        if said:
            problems.append(f"{name}: its words say {said}, which is not this relation")
    return problems


def recompute(claim: Claim, root: Path = RESULTS) -> list[str]:
    """The claim's mismatches, one line each (empty: every number recomputed as shown, every
    relation it states holds and is worded as it)."""
    results = []
    for c in claim.computations:
        args = {k: v for k, v in c.items() if k != "name"}
        results.append(COMPUTATIONS[c["name"]](Path(root), **args))
    problems = wording(claim) + relation_problems(claim, results)
    for key, text in claim.numbers.items():
        index, _, name = key.rpartition(".")
        result = results[int(index) if index else 0]
        if name not in result:
            problems.append(
                f"{claim.id}: {key!r} is not a result of its computation ({', '.join(result)})"
            )
            continue
        if name in result.get(UNMATCHED, {}):
            problems.append(f"{claim.id}: {key} cannot be shown: {result[UNMATCHED][name]}")
            continue
        value = result[name]
        if not isinstance(value, str) and not math.isfinite(float(value)):
            problems.append(f"{claim.id}: {key} is not finite")
            continue
        got = _shown(value, text)
        if got != text:
            problems.append(f"{claim.id}: {key} is shown as {text} but the evidence gives {got}")
    return problems


def numbers_in(text: str) -> list[str]:
    """The numbers of a text, as written, without code spans, link targets and names."""
    return NUMBER.findall(NOT_NUMBERS.sub(" ", text))


def checked_text(readme: str, results_readme: str) -> str:
    """README.md's Results section and docs/results/README.md's part between the markers."""
    section = (
        readme.split("\n## Results", 1)[1].split("\n## ", 1)[0] if "\n## Results" in readme else ""
    )
    marked = ""
    if BEGIN in results_readme:
        marked = results_readme.split(BEGIN, 1)[1].split(END, 1)[0]
    return section + "\n" + marked


def _normal(text: str) -> str:
    return " ".join(text.replace("\\|", "|").split())


def check_claims(
    claims: list[Claim], readme: str, results_readme: str, root: Path = RESULTS
) -> list[str]:
    """Every problem: a sentence not in the text, a number not as the evidence gives it, a
    relation that does not hold or is not worded as it, a number of the checked text in no
    claim's sentence, a number of a sentence the claim does not list. A claim's sentence may also
    stand in the rest of docs/results/README.md (a reading of one study, checked the same way);
    only the checked text must have every number claimed."""
    text = checked_text(readme, results_readme)
    flat = _normal(text)
    page = _normal(results_readme)
    problems = []
    covered: list[str] = []
    for claim in claims:
        if claim.sentence not in flat and claim.sentence not in page:
            problems.append(
                f"{claim.id}: sentence not found in the checked text: {claim.sentence[:80]}..."
            )
        listed = sorted(claim.numbers.values())
        unlisted = [n for n in numbers_in(claim.sentence) if n not in listed]
        if unlisted:
            problems.append(f"{claim.id}: numbers of its sentence it does not list: {unlisted}")
        problems += recompute(claim, root)
        covered.append(claim.sentence)
    rest = flat
    for sentence in covered:
        rest = rest.replace(sentence, " ")
    stray = numbers_in(rest)
    if stray:
        problems.append(f"numbers in the checked text that no claim accounts for: {stray}")
    return problems
