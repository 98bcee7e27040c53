"""The intervention report from a logged study with known effects: numbers, marks, wording, files."""

from __future__ import annotations

import numpy as np
import pytest
from intervention_store import log_intervention_store

from reports.build import build_report
from reports.collect import ReportError
from workbench.interventions import HeadAblation, SkipBranch
from workbench.interventions.summary import (
    CellOutcomes,
    head_matrix,
    ranked,
    seed_consistency,
    summarize,
)
from reports.content.intervention_wording import describe, effect_caveats, effect_paragraph


@pytest.fixture
def logged(tmp_path, mlflow_store) -> dict:
    return log_intervention_store(tmp_path)


def test_report_numbers_marks_and_wording(logged, tmp_path):
    result = build_report(str(logged["path"]), tmp_path / "out", n_resamples=1000)
    md = result.markdown.read_text()
    short = logged["protocol"].short_hash
    assert md.startswith(f"# Report: tiny_logged@{short}\n") and "**3 of 3**" in md, md[:400]
    table = md[md.index("## Every intervention, ranked (vit)") : md.index("## Branches")]
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("|")
    ][2:]
    assert [r[1] for r in rows[:3]] == [
        "`blocks.1.mlp.skip`",
        "`blocks.1.attn.head0.zero`",
        "`blocks.0.attn.head1.zero`",
    ]
    assert rows[0][2:4] == ["-13.33", "[-42.02, +15.35]"] and rows[0][5:] == [
        "2 of 3",
        "-20.00 / -20.00 / 0.00",
    ]
    # excludes zero: marked
    assert rows[1][2:4] == ["-11.67", "[-18.84, -4.50]*"] and rows[1][5] == "3 of 3", rows[1]
    # the same drop in every seed: a zero-width t-interval is no spread, not certainty, and is not marked
    assert (
        rows[2][2:4] == ["-10.00", "[-10.00, -10.00]"] and rows[2][6] == "-10.00 / -10.00 / -10.00"
    ), rows[2]
    assert all(r[2] == "0.00" for r in rows[3:]), rows[3:]
    assert (
        "Zero-ablating one head at a time: 2 of 4 heads change validation accuracy by less than 1 point"
        in md
    )
    assert (
        "for 2 the wider of the two 95% intervals lies entirely below zero (a drop these seeds settle): "
        "`blocks.1.attn.head0.zero` (-11.67), `blocks.0.attn.head1.zero` (-10.00)."
    ) in md
    # model by model, no alignment of heads across seeds needed: seed 1's head 0 of block 1 costs 15 points
    assert (
        "2, 2, 2 of 4 heads cost less than 1 point when removed alone, and the largest single-head drop is "
        "10.00, 15.00, 10.00 points (seeds 0, 1, 2)."
    ) in md
    assert "> Zero-ablating head 1 of block 0 lowers validation accuracy by 10.00 points" in md
    assert "> Skipping the MLP branch of block 1 changes validation accuracy by -13.33 points" in md
    assert "these seeds do not settle whether it lowers accuracy" in md
    assert sorted(p.name for p in result.figures) == [
        "attention_vit.png",
        "branches_vit.png",
        "heads_vit.png",
    ]
    assert all(p.stat().st_size > 2000 for p in result.figures)
    html = result.html.read_text()
    assert html.count("data:image/png;base64,") == 3 and "Acted-on models" in html
    assert result.logged_to == [logged["parent"]]


def test_summary_matrix_and_seed_consistency_from_outcomes():
    labels = np.array([0, 1, 2, 0, 1, 2])
    names = [
        "blocks.0.attn.head0.zero",
        "blocks.0.attn.head1.zero",
        "blocks.1.attn.head0.zero",
        "blocks.0.mlp.skip",
    ]

    def cell(wrong: list[int]) -> CellOutcomes:
        predicted = np.tile(labels, (4, 1))
        for k, n in enumerate(wrong):
            predicted[k, :n] = (labels[:n] + 1) % 3
        return CellOutcomes(names, labels, labels.copy(), predicted)

    rows = summarize(
        {0: cell([0, 1, 3, 0]), 1: cell([0, 2, 3, 1]), 2: cell([1, 2, 3, 0])}, n_resamples=1000
    )
    assert [r.name for r in ranked(rows)][0] == "blocks.1.attn.head0.zero"
    mean, marked = head_matrix(rows, "zero", 2, 2)
    # zero spread: no t-interval
    assert abs(mean[1, 0] + 0.5) < 1e-12 and np.isnan(mean[1, 1]) and not marked[1, 0]
    assert abs(mean[0, 1] + 5 / 18) < 1e-12 and marked[0, 1] and not marked[0, 0]
    rhos = {(a.seed_a, a.seed_b): a.rho for a in seed_consistency(rows, "zero")}
    assert set(rhos) == {(0, 1), (0, 2), (1, 2)} and abs(rhos[(0, 1)] - 1.0) < 1e-12
    assert describe("blocks.0.mlp.skip") == "skipping the MLP branch of block 0"
    assert describe(HeadAblation(2, 1, "mean").name) == "mean-ablating head 1 of block 2"
    assert describe(SkipBranch(0, "attn").name) == "skipping the attention branch of block 0"
    text = effect_paragraph(rows[1], "validation")
    assert text.startswith(
        "Zero-ablating head 1 of block 0 lowers validation accuracy by 27.78 points"
    )
    # One sentence: the boilerplate of the seed level is the section's (effect_caveats), said once.
    assert (
        text.count(". ") == 0
        and "descriptive p: paired t-test" in text
        and "Wilcoxon signed-rank p is" not in text
    )
    caveats = effect_caveats(rows, "validation")
    assert (
        caveats.count("With 3 seeds") == 1 and caveats.count("only 10 distinct seed sets") == 1
    ), caveats


def test_an_intervention_protocol_named_is_reported_from_the_file_its_parent_records(
    logged, tmp_path
):
    """A protocol kept outside studies/protocols/ (a subfolder, a path): by name, as ``report --all``
    asks for it, the file its parent run records is the one reported; with that file gone, refused."""
    result = build_report("tiny_logged", tmp_path / "out", log=False, strict=True)
    md = result.markdown.read_text()
    assert f"tiny_logged@{logged['protocol'].short_hash}" in md, md[:500]
    logged["path"].unlink()
    with pytest.raises(
        ReportError,
        match="tiny_logged is an intervention protocol: report it with its protocol file",
    ):
        build_report("tiny_logged", tmp_path / "out3", log=False)


def test_cells_of_another_interventions_code_are_never_mixed_in(logged):
    import time

    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    from tracking.kinds.intervention_runs import finished_cells

    client, protocol = MlflowClient(), logged["protocol"]
    exp_id = client.get_run(logged["parent"]).info.experiment_id
    time.sleep(0.01)  # a later end time than the logged cells
    run_id = client.create_run(
        exp_id,
        tags={
            "cell": "true",
            "protocol_name": protocol.name,
            "arm": "vit",
            "seed": "0",
            "protocol_hash": protocol.hash,
        },
    ).info.run_id
    client.log_batch(run_id, params=[Param("code_fingerprint", "f" * 16)])
    client.set_terminated(run_id, "FINISHED")
    chosen, records = finished_cells(protocol.name, protocol.hash)
    assert {k: r.run_id for k, r in chosen.items()} == {("vit", 0): run_id} and len(records) == 4


def test_the_store_index_names_an_intervention_study_by_its_kind(logged):
    from tracking.record.queries import protocol_entries

    kinds = {e.name: e.kind for e in protocol_entries()}
    assert kinds.get("tiny_logged") == "intervention", kinds  # `report --all` said "ablation"
