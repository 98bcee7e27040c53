"""The README's Results and docs/results/README.md's tables beside the seed study say what the published reports say."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def paired(report: Path, split: str) -> dict[tuple[str, str], tuple[float, float, float, int, int]]:
    """(a, b) -> (mean, t-interval low, high, seeds won by a, ties) from a report's seed-paired table of ``split``."""
    text = report.read_text()
    section = text.split("## Seed-paired comparisons", 1)[1].split("\n## ", 1)[0]
    block = section.split(f"### {split}", 1)[1].split("\n### ", 1)[0]
    out = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 5 and " − " in cells[0] and re.fullmatch(r"\d+ of \d+", cells[1]):
            a, b = cells[0].split(" − ")
            n = int(cells[1].split(" of ")[1])
            mean = float(cells[2 + n])
            low, high = (float(v) for v in cells[3 + n].strip("[]").split(","))
            won = int(cells[-3].split(" of ")[0])
            ties = (
                int(re.search(r"\((\d+) tied\)", cells[-3]).group(1)) if "tied" in cells[-3] else 0
            )
            out[(a, b)] = (mean, low, high, won, ties)
    return out


def shown(
    mean: float, low: float, high: float, won: int, ties: int, seeds: int, invert: bool = False
) -> str:
    """The README's form: '+0.70 [−0.73, +2.13], 3 of 3' (Unicode minus), optionally as b − a (b's seeds ahead)."""
    if invert:
        mean, low, high, won = -mean, -high, -low, seeds - won - ties
    tied = f" ({ties} tied)" if ties else ""
    return f"{mean:+.2f} [{low:+.2f}, {high:+.2f}], {won} of {seeds}{tied}".replace("-", "−")


# The README's Results table and the sentences that moved from it to docs/results/README.md;
# line breaks of the source are not the text's.
README = " ".join(
    (
        (ROOT / "README.md").read_text()
        + "\n"
        + ((RESULTS / "README.md").read_text() if RESULTS.exists() else "")
    ).split()
)
# docs/results: beside the seed study
SEED_TABLES = (RESULTS / "README.md").read_text() if RESULTS.exists() else ""


def in_readme(text: str, what: str) -> None:
    if text not in README:  # not an assert: pytest would print the whole README
        pytest.fail(f"{what}: README lacks {text!r}")


def in_seed_tables(text: str, what: str) -> None:
    if text not in SEED_TABLES:
        pytest.fail(f"{what}: docs/results/README.md lacks {text!r}")


@pytest.mark.skipif(not RESULTS.exists(), reason="no published results")
def test_the_fashion_mnist_numbers_in_the_readme_are_the_reports():
    report = RESULTS / "fmnist_seed_recipe" / "report.md"
    mean, low, high, won, ties = paired(report, "Test")[("cnn", "vit")]
    difference = shown(mean, low, high, won, ties, 5).rsplit(",", 1)[0]
    in_seed_tables(
        f"| CNN − ViT | +8.51 | {difference}, CNN ahead in {won} of 5 seeds |", "CNN − ViT on test"
    )
    in_readme(f"CNN − ViT {difference}, CNN ahead in {won} of 5 seeds", "CNN − ViT on test")
    accuracy = report.read_text().split("## Accuracy", 1)[1].split("### Test", 1)[1]
    for arm, label in (("cnn", "CNN"), ("vit (reference)", "ViT")):
        row = next(line for line in accuracy.splitlines() if line.startswith(f"| {arm} "))
        cells = [c.strip() for c in row.strip("|").split("|")]
        in_seed_tables(f" | {cells[2]} {cells[3]} |", f"{label} test accuracy")
        in_readme(f"{label} {cells[2]}% {cells[3]}", f"{label} test accuracy")


@pytest.mark.skipif(not RESULTS.exists(), reason="no published results")
def test_the_cifar_directions_beside_the_seed_and_in_the_readme_are_the_reports():
    """The seed's table beside cifar10_seed_table, each row in the seed's direction; the README's summary of it."""
    rows = paired(RESULTS / "cifar10_seed_table" / "report.md", "Validation")
    # (pair, invert): invert where the seed's better arm is the report's b, so the row reads in the seed's direction.
    expected = [
        (("p4_w96", "base"), False),
        (("base", "p16_w96"), False),
        (("p4_w192", "p8_w192"), False),
        (("p8_w192", "p16_w192"), False),
        (("p4_w192", "p4_w96"), False),
        (("p8_w192", "base"), False),
        (("p16_w192", "p16_w96"), False),
        (("pos_none", "base"), True),
        (("pool_mean", "base"), False),
        (("heads4", "base"), False),
        (("heads12", "base"), True),
        (("heads16", "base"), True),
    ]
    for pair, invert in expected:
        in_seed_tables(
            shown(*rows[pair], 3, invert=invert), f"{' − '.join(pair[::-1] if invert else pair)}"
        )
    for label, (pair, invert) in {
        "4 − 8 heads": (("heads4", "base"), False),
        "8 − 12 heads": (("heads12", "base"), True),
        "8 − 16 heads": (("heads16", "base"), True),
    }.items():
        in_seed_tables(f"{label}: {shown(*rows[pair], 3, invert=invert)}", label)
    for pair, invert in [
        (("p4_w96", "base"), False),
        (("p4_w192", "p4_w96"), False),
        (("pos_none", "base"), True),
        (("pool_mean", "base"), False),
        (("heads4", "base"), False),
    ]:
        in_readme(
            shown(*rows[pair], 3, invert=invert), f"{' − '.join(pair[::-1] if invert else pair)}"
        )
    in_readme(f"4 − 8 heads: {shown(*rows[('heads4', 'base')], 3)}", "4 − 8 heads")
    accuracy = (RESULTS / "cifar10_seed_table" / "report.md").read_text().split("## Accuracy", 1)[1]
    for arm in ("base", "p4_w192"):
        row = next(line for line in accuracy.splitlines() if line.startswith(f"| {arm} "))
        mean = f"{row.strip('|').split('|')[2].strip()}%"
        in_readme(mean, f"{arm} mean validation accuracy")
        in_seed_tables(mean, f"{arm} mean validation accuracy")


def ranked_rows(report: Path) -> dict[str, tuple[str, str, str]]:
    """Intervention name -> (mean change, t-interval, 'lower in') from an intervention report's ranked table."""
    section = report.read_text().split("## Every intervention, ranked", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[1].startswith("`"):
            out[cells[1].strip("`")] = (cells[2], cells[3].rstrip("*"), cells[5])
    return out


@pytest.mark.skipif(not RESULTS.exists(), reason="no published results")
def test_the_intervention_numbers_in_the_readme_are_the_reports():
    """The heads paragraph: every change, interval, seed count and per-model count is the report's."""
    report = RESULTS / "fmnist_seed_recipe_heads" / "report.md"
    rows = ranked_rows(report)
    readme = " ".join(README.split())

    def interval(name: str) -> str:
        low, high = rows[name][1].strip("[]").split(", ")
        return f"{low} to {high}".replace("-", "−")

    def says(text: str, what: str) -> None:
        if text not in readme:
            pytest.fail(f"{what}: README lacks {text!r}")

    def two(
        value: str,
    ) -> str:  # the table's exact value to 2 decimals, halves away from zero as the report rounds
        return str(Decimal(value).quantize(Decimal("0.01"), ROUND_HALF_UP)).replace("-", "−")

    says(
        f"position embedding by {two(rows['pos_embed.zero'][0])[1:]} points ({interval('pos_embed.zero')}, "
        f"{rows['pos_embed.zero'][2]})",
        "position embedding",
    )
    says(
        f"block 0: {two(rows['blocks.0.attn.skip'][0])[1:]} points, 95% t-interval "
        f"{interval('blocks.0.attn.skip')}, lower in {rows['blocks.0.attn.skip'][2]} seeds",
        "attention branch 0",
    )
    for block in (0, 2):
        name = f"blocks.{block}.mlp.skip"
        says(f"({two(rows[name][0])}, {interval(name)}", f"MLP branch {block}")
    attn = sorted((rows[f"blocks.{b}.attn.skip"][0] for b in range(3)), key=float)
    says(f"{two(attn[-1])[1:]} to {two(attn[0])[1:]} points", "attention branches' range")
    # No range over head indices averaged across seeds: a head index names a different head in
    # each seed's model (issue 48); the per-model costliest head is read below instead.
    zero = sorted((rows[n][0] for n in rows if n.endswith(".zero") and ".head" in n), key=float)
    assert f"by {zero[-1][1:]} to {two(zero[0])[1:]} points over 5 seeds" not in readme
    text = " ".join(report.read_text().split())
    # The per-model counts of heads that cost less than 1 point are recomputed from the
    # evidence by tests/test_claims.py (the report's own sentence counts |change| < 1).
    worst = (
        re.search(
            r"largest single-head drop is ([\d., ]+) points",
            text.split("Zero-ablating one head at a time:", 1)[1],
        )
        .group(1)
        .split(", ")
    )
    says(
        f"costs at most {min(worst, key=float)} to {max(worst, key=float)} points, model by model",
        "largest single-head drop",
    )


@pytest.mark.skipif(not RESULTS.exists(), reason="no published results")
def test_the_cost_numbers_in_the_readme_are_the_published_ones():
    span = re.search(
        r"From the first reported run's start to the last one's end: ([\d.]+) min \((\d+) runs",
        (RESULTS / "cifar10_seed_table" / "report.md").read_text(),
    )
    in_readme(
        f"`cifar10_seed_table`: {span.group(2)} cells in {span.group(1)} minutes",
        "seed table wall time",
    )
    total = re.search(
        r"Total: plain [\d.]+ s, workbench [\d.]+ s, ratio ([\d.]+)",
        (RESULTS / "fmnist_seed_recipe" / "recipe_benchmark.md").read_text(),
    )
    in_readme(f"took {total.group(1)}x a plain PyTorch loop", "workbench against a plain loop")


def faithfulness_rows(report: Path) -> dict[str, dict[str, str]]:
    """The Faithfulness table of an attribution report: method -> column -> cell (the t columns in order)."""
    section = report.read_text().split("\n## Faithfulness (vit)", 1)[1].split("\n#", 1)[0]
    lines = [x for x in section.split("\n") if x.startswith("| `")]
    out = {}
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        method = cells[0].split("`")[1]
        out[method] = {
            "rho": cells[1],
            "rho_t": cells[2],
            "deletion": cells[3],
            "insertion": cells[5],
        }
    return out


@pytest.mark.skipif(
    not (RESULTS / "fmnist_seed_recipe_faithfulness").exists(), reason="not published"
)
def test_the_faithfulness_numbers_in_the_readmes_are_the_reports():
    """Every rho, interval and AUC the README and docs/results/README.md give is the report's Faithfulness table's."""
    rows = faithfulness_rows(RESULTS / "fmnist_seed_recipe_faithfulness" / "report.md")
    tables = " ".join(SEED_TABLES.split())

    def in_seed_tables(text: str, what: str) -> None:
        if text not in tables:
            pytest.fail(f"{what}: docs/results/README.md lacks {text!r}")

    def unicode(text: str) -> str:  # the READMEs write the minus sign
        return text.replace("-", "−")

    # rho's intervals are on Fisher's z in the sentences (the published table's are raw t):
    # tests/test_claims.py recomputes them from the evidence; the means are the table's.
    for method in ("chefer", "cls_attention", "rollout"):
        text = f"{unicode(rows[method]['rho'])} ["
        in_readme(text, f"{method} rho"), in_seed_tables(text, f"{method} rho")
    in_readme(f"gradient × input ({rows['grad_x_input']['rho']})", "grad x input rho")
    in_readme(f"random order {unicode(rows['random']['rho'])}", "random rho")
    in_readme(
        f"against {rows['random']['deletion']}, every map in 5 of 5 seeds", "random deletion AUC"
    )
    insertion = ", ".join(
        rows[m]["insertion"] for m in ("cls_attention", "rollout", "grad_x_input")
    )
    in_readme(
        f"(insertion AUC {insertion} against {rows['random']['insertion']}, 0 of 5 seeds)",
        "insertion AUCs",
    )
    in_seed_tables(
        f"{' and '.join(insertion.rsplit(', ', 1))} against {rows['random']['insertion']}",
        "insertion AUCs",
    )
    deletion = sorted(float(rows[m]["deletion"]) for m in rows if m != "random")
    in_readme(
        f"(deletion AUC {deletion[0]:.3f} to {deletion[-1]:.3f} against", "deletion AUC range"
    )
