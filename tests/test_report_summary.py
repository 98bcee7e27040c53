"""The study's answer in the MLflow UI: a report's comparisons as its parent run's metrics, its Results as the description."""

from __future__ import annotations

import json
import math

import pytest
from mlflow.tracking import MlflowClient

from reports.build import build_report
from reports.render import Figure, Heading, Para, Quote, Table
from reports.output import BUDGET, results_text
from test_report import make_store
from tracking.record import report_summary
from tracking.record.protocol_runs import end_parent_run, start_parent_run
from tracking.record.schema import cell_filter, parent_filter
from tracking.store import ui_links
from workbench.estimates import mean_interval


def test_the_results_block_replaces_the_last_one_and_fits_mlflows_limit():
    note = "Protocol description.\n\n| | |\n|---|---|\n| seeds | 0, 1 |"
    first = report_summary.with_results(note, report_summary.HEAD + ": A")
    assert (
        first == report_summary.HEAD + ": A" + report_summary.SEPARATOR + note
        and report_summary.results_block(first) == report_summary.HEAD + ": A"
    )
    second = report_summary.with_results(first, report_summary.HEAD + ": B")
    assert (
        second == report_summary.HEAD + ": B" + report_summary.SEPARATOR + note
        and second.count(report_summary.HEAD) == 1
    )
    assert (
        report_summary.results_block(note) == ""
        and report_summary.with_results(report_summary.HEAD + ": A", report_summary.HEAD + ": C")
        == report_summary.HEAD + ": C"
    )
    # A description too long for MLflow's 8,000 characters keeps the block whole and shortens the rest, once.
    long_note = "word " * 3000
    block = report_summary.HEAD + "\n\n" + "x" * 5000
    fitted = report_summary.with_results(long_note, block)
    assert (
        len(fitted) <= report_summary.LIMIT
        and fitted.startswith(block)
        and fitted.endswith(report_summary.CUT)
    ), len(fitted)
    again = report_summary.with_results(fitted, block)
    assert again == fitted and again.count(report_summary.CUT) == 1
    # An execution reattaching the parent writes the protocol's description again: the block stays on top.
    assert (
        report_summary.kept_results(second, note) == second
        and report_summary.kept_results(note, note) == note
    )
    metrics = report_summary.comparison_metrics(
        "cnn",
        "vit",
        "val",
        mean_diff=1 / 3,
        t_low=0,
        t_high=2,
        boot_low=0.5,
        boot_high=26.375000000000004,
        wins=3,
        n=3,
    )
    assert set(metrics) == {f"cmp.cnn_vs_vit.val.{s}" for s in report_summary.STATS}
    assert (
        metrics["cmp.cnn_vs_vit.val.boot_high"] == 26.375
        and metrics["cmp.cnn_vs_vit.val.mean_diff"] == 0.333333
    )


def test_the_description_is_the_reports_results_section():
    blocks = [
        Heading(2, "Configuration"),
        Para("not this"),
        Heading(2, "Results"),
        Heading(3, "Validation"),
        Table(["a"], [["1"]]),
        Quote("On validation, a minus b is +1.00 points."),
        Para("With 3 seeds ..."),
        Figure("forest_val.png", "caption", b""),
        Heading(2, "Accuracy"),
        Para("nor this"),
    ]
    text = results_text(blocks, ": x@1, 6 of 6 cells", "points")
    assert text.split("\n\n")[:4] == [
        "### Results of the report: x@1, 6 of 6 cells",
        "**Validation**",
        "- On validation, a minus b is +1.00 points.",
        "With 3 seeds ...",
    ], text
    assert (
        "not this" not in text
        and "nor this" not in text
        and "cmp.<a>_vs_<b>.<split>.<stat>" in text
    )
    # Too many results for MLflow's description: whole sentences up to the budget, and how many were left out.
    many = [Heading(2, "Results")] + [Quote(f"Result {i}: " + "x" * 300) for i in range(40)]
    short = results_text(many, ": R", "points")
    assert (
        len(short) <= BUDGET
        and short.count("- Result ") < 40
        and "more results and the caveats are in the report" in short
    )
    left = int(short.split("- … ", 1)[1].split(" ", 1)[0])
    assert short.count("- Result ") + left == 40, short[-300:]


def test_log_summary_sets_metrics_marks_dropped_comparisons_and_keeps_one_block(mlflow_store):
    client = MlflowClient()
    exp = client.create_experiment("summary")
    run_id = client.create_run(
        exp, tags={report_summary.NOTE_TAG: "The protocol's description."}
    ).info.run_id
    client.set_terminated(run_id, "FINISHED")
    both = {
        **report_summary.comparison_metrics(
            "a",
            "ref",
            "val",
            mean_diff=2.5,
            t_low=1,
            t_high=4,
            boot_low=1.5,
            boot_high=3.5,
            wins=3,
            n=3,
        ),
        **report_summary.comparison_metrics(
            "b",
            "ref",
            "val",
            mean_diff=-1,
            t_low=-3,
            t_high=1,
            boot_low=math.nan,
            boot_high=math.nan,
            wins=1,
            n=3,
        ),
    }
    # a local store: no UI address
    assert report_summary.log_summary(run_id, both, report_summary.HEAD + " one", client) == (
        0,
        None,
    )
    run = client.get_run(run_id)
    assert {k: run.data.metrics[k] for k in both if math.isfinite(both[k])} == {
        k: v for k, v in both.items() if math.isfinite(v)
    }
    assert (
        run.data.tags[report_summary.NOTE_TAG]
        == report_summary.HEAD + " one" + report_summary.SEPARATOR + "The protocol's description."
    )
    assert run.info.status == "FINISHED"
    only_a = {k: v for k, v in both.items() if k.startswith("cmp.a_")}
    assert report_summary.log_summary(run_id, only_a, report_summary.HEAD + " two", client) == (
        1,
        None,
    )
    run = client.get_run(run_id)
    assert all(math.isnan(run.data.metrics[k]) for k in both if k.startswith("cmp.b_")), (
        run.data.metrics
    )
    assert run.data.metrics["cmp.a_vs_ref.val.mean_diff"] == 2.5
    assert (
        run.data.tags[report_summary.NOTE_TAG]
        == report_summary.HEAD + " two" + report_summary.SEPARATOR + "The protocol's description."
    )


@pytest.mark.slow  # builds a report twice on 9 hand-made runs: 6 s idle, more under load
def test_a_built_report_puts_every_comparison_and_its_results_on_the_parent_run(
    tmp_path, mlflow_store
):
    store = make_store(tmp_path)
    client = MlflowClient()
    parent = store.parents[0]
    result = build_report(
        str(store.protocol_path), tmp_path / "out", n_resamples=200, compare=[("wide", "cnn")]
    )
    run = client.get_run(parent)
    metrics, note = run.data.metrics, run.data.tags[report_summary.NOTE_TAG]
    # Every comparison of the report, on both splits, with the numbers the report computed (in points).
    pairs = [(c.a, c.b, split) for split, comps in result.comparisons.items() for c in comps]
    assert sorted(pairs) == sorted(
        [
            ("cnn", "vit", "val"),
            ("wide", "vit", "val"),
            ("wide", "cnn", "val"),
            ("cnn", "vit", "test"),
            ("wide", "vit", "test"),
            ("wide", "cnn", "test"),
        ]
    ), pairs
    worst = 0.0
    for split, comps in result.comparisons.items():
        for c in comps:
            key = f"cmp.{c.a}_vs_{c.b}.{split}."
            p = c.paired
            expected = {
                "mean_diff": 100 * p.mean_difference,
                "t_low": 100 * p.ci_low,
                "t_high": 100 * p.ci_high,
                "boot_low": 100 * c.bootstrap.low,
                "boot_high": 100 * c.bootstrap.high,
                "wins": p.wins,
                "n": p.n,
            }
            for stat, value in expected.items():
                worst = max(worst, abs(metrics[key + stat] - value))
    assert worst <= 5e-7, (
        f"metrics differ from the report's numbers by up to {worst} (rounded to 6 decimals)"
    )
    # The description starts with the report's Results: every stated result of report.md, then the protocol's text.
    md = result.markdown.read_text()
    stated = [
        line[2:]
        for line in md.split("\n## Results\n", 1)[1].split("\n## ", 1)[0].splitlines()
        if line.startswith("> ")
    ]
    assert len(stated) == 6 and all(s in note for s in stated), note[:2000]
    assert (
        note.startswith("### Results of the report: study@")
        and note.count("smallest attainable") == 1
    ), note[:500]  # both splits: 3 seeds, said once
    assert "hand-made runs for report tests" in note.split(report_summary.SEPARATOR, 1)[1], note[
        -1000:
    ]
    assert any("6 comparisons as metrics (cmp.*)" in m for m in result.messages), result.messages
    # One summary run per arm: the Accuracy table's mean and t-interval, the Results' difference to vit (2 decimals).
    rows = arm_rows(client, run)
    assert sorted(rows) == ["cnn", "vit", "wide"], rows
    worst = 0.0
    for split, summaries in result.summaries.items():
        diffs = {c.a: c.paired for c in result.comparisons[split] if c.b == "vit"}
        for s in summaries:
            mi, p, m = mean_interval(s.values), diffs.get(s.arm), rows[s.arm].data.metrics
            expected = {"n": s.n, "acc": 100 * s.mean, "acc.low": 100 * mi.low}
            expected["acc.high"] = 100 * mi.high
            if s.arm != "vit":
                expected |= {"diff": 100 * p.mean_difference, "diff.low": 100 * p.ci_low}
                expected["diff.high"] = 100 * p.ci_high
            assert {k for k in m if k.startswith(split)} == {f"{split}.{k}" for k in expected}, m
            for key, value in expected.items():
                worst = max(worst, abs(m[f"{split}.{key}"] - value))
    assert worst <= 0.005 + 1e-9, f"rows differ from the report's numbers by up to {worst}"
    assert any("one summary run per arm (3: mean, 95% interval" in m for m in result.messages)

    # Built again without the extra pair: its metrics go NaN (no stale number), one results block on top.
    again = build_report(str(store.protocol_path), tmp_path / "out", n_resamples=200)
    run = client.get_run(parent)
    assert all(
        math.isnan(run.data.metrics[f"cmp.wide_vs_cnn.{s}.{stat}"])
        for s in ("val", "test")
        for stat in report_summary.STATS
    )
    assert math.isfinite(run.data.metrics["cmp.cnn_vs_vit.val.mean_diff"])
    # the same rows, updated
    assert {a: r.info.run_id for a, r in arm_rows(client, run).items()} == {
        a: r.info.run_id for a, r in rows.items()
    }
    assert run.data.tags[report_summary.NOTE_TAG].count("### Results of the report") == 1
    assert any("2 comparison(s) no longer made set to NaN" in m for m in again.messages), (
        again.messages
    )
    # A later execution of the study reattaches its parent: the description keeps the report's results on top.
    rerun = start_parent_run(store.protocol, store.protocol_path, allow_dirty=True)
    end_parent_run(rerun, {"finished": 0, "skipped": 9, "failed": 0})
    assert rerun == parent
    assert len(client.search_runs([run.info.experiment_id], "tags.cell = 'true'")) == 9
    assert (
        client.get_run(parent).data.tags[report_summary.NOTE_TAG]
        == run.data.tags[report_summary.NOTE_TAG]
    )


def arm_rows(client: MlflowClient, parent) -> dict:
    """The arms' summary runs of a parent run, by arm."""
    found = client.search_runs(
        [parent.info.experiment_id], f"tags.summary_of = '{parent.info.run_id}'"
    )
    return {r.data.tags["summary_arm"]: r for r in found}


def test_arm_rows_are_one_run_per_arm_that_no_cell_or_parent_lookup_finds(mlflow_store):
    """The arms' summary runs: found again and updated by a rebuild, a dropped arm NaN, the view named on the experiment."""
    client = MlflowClient()
    exp = client.create_experiment("rows")
    parent = client.create_run(exp, tags={"parent": "true", "protocol_name": "rows"}).info.run_id
    cells = [
        client.create_run(
            exp,
            tags={
                "cell": "true",
                "protocol_name": "rows",
                "arm": arm,
                "mlflow.parentRunId": parent,
            },
        ).info.run_id
        for arm in ("a", "ref")
    ]
    rows = {
        "ref": report_summary.arm_metrics("val", n=3, acc=(81.25, 78.5, 84.0)),
        "a": report_summary.arm_metrics("val", n=3, acc=(83.5, 80.0, 87.0), diff=(2.25, -1.5, 6.0)),
    }
    notes = {"a": "row of a", "ref": "row of ref"}
    assert report_summary.log_arm_rows(parent, rows, "ref", notes, "val", client) == (0, None)
    made = client.search_runs([exp], "tags.summary_of = '" + parent + "'")
    assert sorted((r.info.run_name, r.info.status) for r in made) == [
        ("a", "FINISHED"),
        ("ref (reference)", "FINISHED"),
    ]
    by_arm = {r.data.tags["summary_arm"]: r for r in made}
    assert by_arm["a"].data.metrics == rows["a"] and by_arm["ref"].data.metrics == rows["ref"]
    assert by_arm["a"].data.tags[report_summary.NOTE_TAG] == "row of a"
    assert not any(k.startswith("lease.") for r in made for k in r.data.tags)
    # The record's lookups see what they saw before: the one parent, the two cells.
    assert [r.info.run_id for r in client.search_runs([exp], parent_filter("rows"))] == [parent]
    assert sorted(
        r.info.run_id for r in client.search_runs([exp], cell_filter(protocol_name="rows"))
    ) == sorted(cells)
    # The experiment names the view: only these rows, best mean first, their columns (no tags).
    tags = client.get_experiment(exp).tags
    key = tags[ui_links.ANSWER_VIEW]
    view = json.loads(tags[ui_links.SHARED_VIEW_PREFIX + key])
    assert view["searchFilter"] == f"tags.summary_of = '{parent}'"
    assert view["orderByKey"] == "metrics.`val.acc`" and view["orderByAsc"] is False
    assert view["selectedColumns"] == [
        f"metrics.`val.{k}`"
        for k in ("n", "acc", "acc.low", "acc.high", "diff", "diff.low", "diff.high")
    ]
    line = ui_links.experiment_lines(mlflow_store, "http://127.0.0.1:5000")
    assert line == [
        f"runs of rows (the answer: one row per arm): http://127.0.0.1:5000/#/experiments/{exp}/runs"
        f"?workflowType=machine_learning&viewStateShareKey={key}"
    ], line
    # Rebuilt without arm a and with a new mean: the same runs, a's numbers NaN, ref's new value.
    rows2 = {"ref": report_summary.arm_metrics("val", n=3, acc=(81.5, 78.5, 84.0))}
    assert report_summary.log_arm_rows(parent, rows2, "ref", notes, "val", client) == (1, None)
    again = {
        r.data.tags["summary_arm"]: r
        for r in client.search_runs([exp], "tags.summary_of = '" + parent + "'")
    }
    assert {a: r.info.run_id for a, r in again.items()} == {
        a: r.info.run_id for a, r in by_arm.items()
    }
    assert again["ref"].data.metrics["val.acc"] == 81.5
    assert all(math.isnan(v) for v in again["a"].data.metrics.values()), again["a"].data.metrics


def test_an_experiment_without_an_answer_view_gets_its_plain_runs_address(mlflow_store):
    client = MlflowClient()
    exp = client.create_experiment("plain")
    client.create_run(exp)
    client.set_experiment_tag(exp, ui_links.ANSWER_VIEW, "gone")  # a view tag whose view is absent
    assert ui_links.experiment_lines(mlflow_store, "http://127.0.0.1:5000") == [
        f"runs of plain: http://127.0.0.1:5000/#/experiments/{exp}/runs?workflowType=machine_learning"
    ]
