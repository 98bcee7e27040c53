"""reports.content.wording: a stated result says what the numbers say, no more; the caveats once."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from workbench import stats
from reports.content.wording import results_paragraph, section_caveats


def comparison(mean, low, high, n=3, wins=3, ties=0, p=0.06, w=0.25, note=""):
    return SimpleNamespace(
        mean_difference=mean,
        ci_low=low,
        ci_high=high,
        confidence=0.95,
        n=n,
        wins=wins,
        ties=ties,
        losses=n - wins - ties,
        p_value=p,
        wilcoxon_p_value=w,
        note=note,
    )


def boot(low, high, se=0.0005, r=2000):
    return SimpleNamespace(
        low=low,
        high=high,
        estimate=(low + high) / 2,
        n_resamples=r,
        mc_error_low=se,
        mc_error_high=se,
    )


def test_issue_example_wording():
    par = results_paragraph(
        comparison(0.0413, -0.0042, 0.0868), boot(0.0220, 0.0554), a_label="CNN", b_label="ViT"
    )
    assert par.text == (
        "On test, CNN minus ViT is +4.13 points of accuracy (95% t-interval -0.42 to +8.68; bootstrap +2.2 to +5.5), "
        "with CNN ahead in 3 of 3 seeds; the wider of the two intervals, the t-interval, includes zero, so these 3 seeds "
        "do not settle which arm is ahead."
    ), par.text
    assert (
        par.driving_interval == "t-interval" and par.sign_settled is False and par.settled_for == ""
    )
    # The seed level's resolution is not repeated in each result: the section states it once.
    assert par.caveats == (
        "With 3 seeds the t-interval is wide (t quantile 4.30 on 2 degrees of freedom) and the smallest attainable "
        "two-sided Wilcoxon signed-rank p is 0.25.",
        "The bootstrap resamples seeds and then examples; from 3 seeds it can draw only 10 distinct seed sets, so its "
        "seed level is coarse.",
        "No test was stated in advance, so no difference is called significant; p-values, where shown, are descriptive.",
    )
    assert "significant" not in par.text and "Wilcoxon" not in par.text
    assert "Monte-Carlo standard error is 0.05 points at 2,000 resamples" in par.footnotes[0]


def test_a_section_states_each_caveat_once():
    three = [
        results_paragraph(
            comparison(m, m - 0.01, m + 0.01),
            boot(m - 0.02, m + 0.02),
            a_label=f"A{i}",
            b_label="B",
        )
        for i, m in enumerate((0.02, -0.03, 0.001))
    ]
    two = results_paragraph(
        comparison(0.01, -0.05, 0.07, n=2, wins=2), a_label="C", b_label="B", expected_n=3
    )
    text = section_caveats([*three, two])
    for phrase, times in (
        ("smallest attainable two-sided Wilcoxon", 2),
        ("t quantile 4.30", 1),
        ("t quantile 12.71", 1),
        ("only 10 distinct seed sets", 1),
        ("distinct seed sets", 1),
        ("No test was stated", 1),
        ("the wider of the two decides", 1),
    ):
        assert text.count(phrase) == times, (phrase, text)
    # Seed levels first, then the bootstrap, then the tests, then the rule.
    assert (
        text.index("12.71")
        < text.index("The bootstrap")
        < text.index("No test")
        < text.index("Each result")
    )
    assert section_caveats([]) == ""
    assert "Only 2 of the protocol's 3 seeds" in two.text and two.exceptions == (
        "Only 2 of the protocol's 3 seeds have finished runs of both arms.",
    )


def test_the_wider_interval_drives_the_wording():
    # Tight t-interval above zero, but the bootstrap (test-set noise) crosses zero: not settled.
    par = results_paragraph(
        comparison(0.02, 0.015, 0.025), boot(-0.01, 0.05), a_label="A", b_label="B"
    )
    assert par.driving_interval == "bootstrap" and par.sign_settled is False
    assert "the bootstrap, includes zero" in par.text
    # Both above zero: settled, named by the wider one, and still no "significant".
    par = results_paragraph(
        comparison(0.02, 0.005, 0.035), boot(0.01, 0.03), a_label="A", b_label="B"
    )
    assert (
        par.driving_interval == "t-interval" and par.sign_settled is True and par.settled_for == "A"
    )
    assert (
        "; even the wider of the two intervals, the t-interval, lies entirely above zero: A is ahead over the whole "
        "interval."
        in par.text
        and "significant" not in par.text
    )
    # Only a t-interval, below zero: B is ahead; split seeds name both sides.
    par = results_paragraph(
        comparison(-0.02, -0.03, -0.01, wins=1, ties=0), a_label="A", b_label="B"
    )
    assert "the only interval, the t-interval, lies entirely below zero: B is ahead" in par.text
    assert "with A ahead in 1 of 3 seeds and B in 2;" in par.text and par.settled_for == "B"


def test_two_seeds_state_three_seed_sets_and_the_losing_side_leads():
    par = results_paragraph(
        comparison(-0.01, -0.05, 0.03, n=2, wins=0),
        boot(-0.02, -0.001),
        a_label="partial",
        b_label="linear",
        metric="QWK",
        scale=1.0,
        unit="",
        decimals=3,
    )
    assert "with linear ahead in 2 of 2 seeds" in par.text
    assert "only 3 distinct seed sets" in par.caveats[1] and "p is 0.5." in par.caveats[0]


def test_significant_only_with_a_stated_test():
    strong = comparison(0.05, 0.04, 0.06, n=8, wins=8, p=1e-5, w=0.0078)
    plain = results_paragraph(strong, boot(0.03, 0.07), a_label="A", b_label="B")
    caveats = " ".join(plain.caveats)
    assert (
        "significant" not in plain.text
        and "its seed level draws from 6,435 distinct seed sets" in caveats
    )
    assert (
        "t-interval is wide" not in caveats
        and "smallest attainable two-sided Wilcoxon signed-rank p is 0.00781" in caveats
    )
    said = results_paragraph(strong, a_label="A", b_label="B", stated_test="wilcoxon")
    assert (
        "By the stated test (Wilcoxon signed-rank test, p = 0.008) the difference is significant at the 0.05 level"
        in said.text
        and said.caveats[2]
        == "The test stated in advance is the Wilcoxon signed-rank test; other p-values "
        "are descriptive."
    )
    weak = results_paragraph(
        comparison(0.05, -0.04, 0.14), a_label="A", b_label="B", stated_test="paired_t"
    ).text
    assert "is not significant at the 0.05 level" in weak
    with pytest.raises(ValueError, match="stated_test"):
        results_paragraph(strong, stated_test="anova")


def test_paragraph_numbers_equal_the_statistics():
    rng = np.random.default_rng(0)
    seeds = [0, 1, 2]
    per_a, per_b, acc_a, acc_b = {}, {}, {}, {}
    for s in seeds:
        y = rng.integers(0, 3, 400)
        pa, pb = (
            np.where(rng.random(400) < 0.8, y, (y + 1) % 3),
            np.where(rng.random(400) < 0.75, y, (y + 1) % 3),
        )
        per_a[s], per_b[s] = (y, pa), (y, pb)
        acc_a[s], acc_b[s] = float((pa == y).mean()), float((pb == y).mean())
    pc = stats.paired_seed_comparison(acc_a, acc_b, names=("cnn", "vit"))
    ci = stats.paired_hierarchical_bootstrap(per_a, per_b, "accuracy", n_resamples=2000, seed=0)
    par = results_paragraph(pc, ci, a_label="cnn", b_label="vit", expected_n=4)
    shown = [float(x) for x in re.findall(r"[-+]?\d+\.\d+", par.text.split(").")[0])]
    mean, t_low, t_high, b_low, b_high = shown
    assert abs(mean - pc.mean_difference * 100) <= 0.005 + 1e-9
    assert max(abs(t_low - pc.ci_low * 100), abs(t_high - pc.ci_high * 100)) <= 0.005 + 1e-9
    assert max(abs(b_low - ci.low * 100), abs(b_high - ci.high * 100)) <= 0.05 + 1e-9
    assert f"ahead in {max(pc.wins, pc.losses)} of 3 seeds" in par.text
    assert "Only 3 of the protocol's 4 seeds" in par.text


def test_zero_width_and_missing_intervals_are_named():
    same = results_paragraph(
        comparison(
            0.01,
            0.01,
            0.01,
            note="every seed has the same difference: zero-width interval, t-test undefined",
            p=float("nan"),
        ),
        a_label="A",
        b_label="B",
    )
    assert "not certainty" in same.text and "Every seed has the same difference" in same.text
    one = results_paragraph(
        comparison(0.01, float("nan"), float("nan"), n=1, wins=1, p=float("nan"), w=float("nan")),
        a_label="A",
        b_label="B",
    )
    assert (
        one.driving_interval == "none" and one.sign_settled is None and "no t-interval" in one.text
    )
