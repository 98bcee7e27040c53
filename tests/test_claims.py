"""Every number of README.md's Results and of docs/results/README.md's checked sentences is a
claim recomputed from the published evidence (docs/results/claims.yaml, reports/published/claims.py);
an edited number, an unclaimed number or edited evidence fails the check."""

from __future__ import annotations

import gzip
import io
import shutil
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from reports.published.claims import (
    BEGIN,
    ClaimError,
    calibration_difference,
    check_claims,
    load_claims,
    numbers_in,
    recompute,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
CLAIMS = RESULTS / "claims.yaml"


def texts() -> tuple[str, str]:
    return (ROOT / "README.md").read_text(), (RESULTS / "README.md").read_text()


def test_every_published_number_is_a_claim_recomputed_from_the_evidence():
    claims = load_claims(CLAIMS)
    readme, results = texts()
    assert BEGIN in results and len(claims) >= 7
    problems = check_claims(claims, readme, results, RESULTS)
    assert problems == [], "\n".join(problems)


def test_a_number_changed_in_the_text_and_its_claim_fails(tmp_path):
    readme, results = texts()
    edited = tmp_path / "claims.yaml"
    edited.write_text(CLAIMS.read_text().replace('2.mean: "+4.52"', '2.mean: "+4.53"'))
    assert edited.read_text() != CLAIMS.read_text()
    # fmt: skip
    claims = [
        c
        if c.id != "fmnist_seed_recipe.headline"
        else replace(c, sentence=c.sentence.replace("+4.52", "+4.53"))
        for c in load_claims(edited)
    ]
    problems = check_claims(claims, readme.replace("+4.52", "+4.53"), results, RESULTS)
    assert problems == [
        "fmnist_seed_recipe.headline: 2.mean is shown as +4.53 but the evidence gives +4.52"
    ], problems


def test_a_number_without_a_claim_fails():
    readme, results = texts()
    added = readme.replace(
        "| [report](docs/results/retina_transfer_local/report.md) |",
        "| [report](docs/results/retina_transfer_local/report.md) |\n\nThe ViT took 42.5 minutes.",
        1,
    )
    assert added != readme
    problems = check_claims(load_claims(CLAIMS), added, results, RESULTS)
    assert problems == ["numbers in the checked text that no claim accounts for: ['42.5']"], (
        problems
    )


def test_edited_evidence_fails(tmp_path):
    root = tmp_path / "results"
    shutil.copytree(
        RESULTS / "fmnist_seed_recipe" / "evidence", root / "fmnist_seed_recipe" / "evidence"
    )
    path = root / "fmnist_seed_recipe" / "evidence" / "predictions" / "cnn.seed0.test.csv.gz"
    table = pd.read_csv(io.BytesIO(gzip.decompress(path.read_bytes())))
    wrong = table["predicted"] != table["label"]
    table.loc[wrong[wrong].index[:200], "predicted"] = table["label"]  # 200 more right: +2 points
    path.write_bytes(gzip.compress(table.to_csv(index=False).encode()))
    claim = next(c for c in load_claims(CLAIMS) if c.id == "fmnist_seed_recipe.headline")
    problems = recompute(claim, root)
    assert any("0.mean is shown as 80.86 but the evidence gives 81.26" in p for p in problems), (
        problems
    )
    assert recompute(claim, RESULTS) == []


def test_names_and_code_are_not_numbers_and_a_bad_claim_is_named(tmp_path):
    assert numbers_in(
        "CIFAR-10 `p4_w96` [report](docs/x2.md) Fashion-MNIST (2019) fp32 bf16 1,080 / 3.5"
    ) == ["1,080", "3.5"]
    bad = tmp_path / "claims.yaml"
    bad.write_text("claims:\n  - {id: x, sentence: s, numbers: {}, compute: {name: nope}}\n")
    with pytest.raises(ClaimError, match=r"claims\[0\] \(x\): compute name 'nope'"):
        load_claims(bad)


def test_calibration_without_a_test_split_is_scored_cross_fitted_on_validation_as_the_report():
    """cifar10_recipe_20ep has no test split: the claim's computation must give the report's row."""
    got = calibration_difference(
        RESULTS, "cifar10_recipe_20ep", "full_recipe", "base", "ece", "before"
    )
    report = (RESULTS / "cifar10_recipe_20ep" / "report.md").read_text()
    row = f"| full_recipe - base | before  | ECE   |       {got['mean']:+.4f} [{got['low']:+.4f}, {got['high']:+.4f}] |"
    assert row in report, f"{row!r} not in the report's calibration table"


def test_a_difference_between_studies_is_the_seed_paired_difference_of_their_differences():
    """Independent: each study's a - b per seed from its prediction files, then the t-interval
    of their seed-paired difference with scipy."""
    from scipy import stats as sps

    from reports.published.claims import difference_between_studies

    def per_seed(study, arm):
        out = {}
        for f in sorted(
            (RESULTS / study / "evidence" / "predictions").glob(f"{arm}.seed*.val.csv.gz")
        ):
            d = pd.read_csv(io.BytesIO(gzip.decompress(f.read_bytes())))
            out[int(f.name.split(".seed")[1].split(".")[0])] = 100 * (d.label == d.predicted).mean()
        return out

    diffs = []
    for study in ("cifar10_seed_table", "cifar10_registers"):
        a, b = per_seed(study, "p4_w96"), per_seed(study, "base")
        diffs.append({s: a[s] - b[s] for s in b})
    d = [diffs[0][s] - diffs[1][s] for s in sorted(diffs[0])]
    half = sps.t.ppf(0.975, len(d) - 1) * sps.tstd(d) / len(d) ** 0.5
    expected = {"mean": sum(d) / len(d), "n": len(d)}
    expected |= {"low": expected["mean"] - half, "high": expected["mean"] + half}
    got = difference_between_studies(
        RESULTS, "cifar10_seed_table", "cifar10_registers", "p4_w96", "base", "val"
    )
    worst = max(abs(got[k] - v) for k, v in expected.items())
    assert worst < 1e-9, f"max |diff| {worst:.3g} (tolerance 1e-9): {got} vs {expected}"
    assert got["wins"] == sum(x > 0 for x in d) and got["losses"] == sum(x < 0 for x in d)
