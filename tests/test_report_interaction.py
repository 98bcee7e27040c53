"""Interactions in the ablation report: ``report --interaction A:B:C:D`` reports (A - B) - (C - D) per seed.

Four arms (vit, vit_r, cnn, cnn_r: a model bare and with a recipe, twice) with hand-chosen
predictions, so every number can be worked out by hand: the per-seed interactions exactly,
the t-interval to 1e-12, the hierarchical bootstrap against a direct re-implementation of its
draws (one seed draw and one example draw shared by all four arms). The end-to-end test logs
real runs to a real SQLite store, builds the report with its evidence and rebuilds it offline.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient
from test_report import T_975_DF2, VAL_LABELS, log_cell, table_rows

from reports import results, tables
from reports.build import build_from_evidence, build_report, parse_interactions, render_study
from reports.collect import CellData, ProtocolSpec, ReportError, StudyData
from reports.evidence import export_evidence, load_evidence
from reports.provenance import REBUILT_PREFIX, BuildInputs, header_bullets
from studies.runtime.study_protocol import load_protocol
from studies.tools.report import report as report_command
from tracking.record.protocol_runs import end_parent_run, start_parent_run
from tracking.export import run_export
from tracking.record import queries
from tracking.record.queries import CellRecord
from workbench import stats

ARMS = ("vit", "vit_r", "cnn", "cnn_r")
QUAD = ("vit_r", "vit", "cnn_r", "cnn")  # the recipe's gain on the ViT minus its gain on the CNN
# Correct predictions out of 10 validation examples (the first k right), per arm and seed.
CORRECT = {
    "vit": {0: 6, 1: 5, 2: 7},
    "vit_r": {0: 9, 1: 7, 2: 8},
    "cnn": {0: 5, 1: 6, 2: 6},
    "cnn_r": {0: 6, 1: 6, 2: 8},
}
# By hand, in points: seed 0 (90 - 60) - (60 - 50) = +20, seed 1 (70 - 50) - (60 - 60) = +20, seed 2 (80 - 70) - (80 - 60) = -10.
HAND_POINTS = ["+20.00", "+20.00", "-10.00"]
PROTOCOL = """\
name: ixstudy
description: hand-made runs for interaction tests
dataset: {name: image_folder, val_size: 10, split_seed: 3}
model: {name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 1, heads: 2, mlp_hidden: 32}
run: {epochs: 3, batch_size: 8}
arms:
  - {name: vit, reference: true}
  - {name: vit_r, overrides: {optim: {label_smoothing: 0.1}}}
  - {name: cnn, overrides: {model: {name: fmnist_cnn, in_channels: 3, num_classes: 3}}}
  - {name: cnn_r, overrides: {model: {name: fmnist_cnn, in_channels: 3, num_classes: 3}, optim: {label_smoothing: 0.1}}}
seeds: [0, 1, 2]
"""


def predictions(correct: int, labels=VAL_LABELS) -> pd.DataFrame:
    y = np.asarray(labels)
    p = np.where(np.arange(y.size) < correct, y, (y + 1) % 3)
    return pd.DataFrame({"index": np.arange(y.size), "label": y, "predicted": p})


def protocol_file(folder: Path) -> Path:
    path = folder / "ixstudy.yaml"
    path.write_text(PROTOCOL)
    return path


def in_memory_study(folder: Path, correct=CORRECT, labels: dict | None = None) -> StudyData:
    """A StudyData as the report sees one, without any store: validation only."""
    loaded = load_protocol(protocol_file(folder))
    spec = ProtocolSpec(
        loaded.name,
        loaded.hash,
        loaded.description,
        ARMS,
        "vit",
        (0, 1, 2),
        False,
        "hand-made",
        loaded.canonical,
    )
    cells = {}
    for arm in ARMS:
        for seed, k in correct[arm].items():
            record = CellRecord(
                run_id=f"{arm}{seed}",
                arm=arm,
                seed=seed,
                status="FINISHED",
                commit="a" * 40,
                dirty="false",
                start_time=1,
                end_time=2,
                parent_run_id="p",
                params={},
                metrics={"best_val_accuracy": k / len(VAL_LABELS)},
                tags={"arm": arm, "seed": str(seed)},
                experiment_id="0",
            )
            table = predictions(k, (labels or {}).get((arm, seed), VAL_LABELS))
            cells[(arm, seed)] = CellData(record, {"val": table})
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


def inputs_with(study: StudyData, interactions: list) -> BuildInputs:
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
        interactions,
    )


def test_per_seed_values_t_interval_and_wording_equal_a_hand_computation(tmp_path):
    study = in_memory_study(tmp_path)
    ix = tables.interaction(study, QUAD, "val", n_resamples=300)
    acc = {arm: {s: k / 10 for s, k in seeds.items()} for arm, seeds in CORRECT.items()}
    hand = [
        (acc["vit_r"][s] - acc["vit"][s]) - (acc["cnn_r"][s] - acc["cnn"][s]) for s in (0, 1, 2)
    ]
    # exact: the same float operations
    assert ix.paired.differences == hand, (
        ix.paired.differences,
        hand,
    )
    assert np.allclose(hand, [0.2, 0.2, -0.1], atol=1e-12)
    mean = sum(hand) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in hand) / 2)
    half = T_975_DF2 * sd / math.sqrt(3)
    got = (ix.paired.mean_difference, ix.paired.ci_low, ix.paired.ci_high)
    assert got == pytest.approx((mean, mean - half, mean + half), abs=1e-12), (
        got,
        max(abs(a - b) for a, b in zip(got, (mean, mean - half, mean + half))),
    )
    assert (ix.paired.n, ix.paired.wins, ix.paired.losses) == (3, 2, 1)
    (item,) = results.interaction_contents([ix], decimals=2)
    content = item[1]
    assert content.per_seed == HAND_POINTS, content.per_seed  # from the displayed values, exactly
    assert content.text.startswith(
        "On validation, (vit_r − vit) − (cnn_r − cnn) is +10.00 points of accuracy (95% t-interval "
        f"{100 * (mean - half):.2f} to +{100 * (mean + half):.2f}; bootstrap "
    ), content.text
    assert (
        "with vit_r − vit the larger difference in 2 of 3 seeds and cnn_r − cnn in 1;"
        in content.text
    )
    assert (
        "includes zero, so these 3 seeds do not settle whether vit_r − vit is larger or smaller than cnn_r − cnn"
        in content.text
        and "significant" not in content.text
        and "descriptive p: paired t-test" in content.text
    )


def test_the_bootstrap_shares_seed_and_example_draws_across_the_four_arms(tmp_path):
    study = in_memory_study(tmp_path)
    per_seed = [
        {
            s: (np.asarray(VAL_LABELS), predictions(CORRECT[arm][s])["predicted"].to_numpy())
            for s in (0, 1, 2)
        }
        for arm in QUAD
    ]
    ci = stats.hierarchical_interaction_bootstrap(
        per_seed, "accuracy", 400, 0.95, seed=7, num_classes=3
    )
    # A direct re-implementation of the documented draws: seeds, then examples per drawn copy, one draw for all arms.
    rng, y = np.random.default_rng(7), np.asarray(VAL_LABELS)
    pick = rng.integers(0, 3, size=400 * 3)
    slot = np.empty(400 * 3)
    for j in range(3):
        where = np.flatnonzero(pick == j)
        idx = rng.integers(0, y.size, size=(where.size, y.size))
        acc = [(per_seed[a][j][1][idx] == y[idx]).mean(axis=1) for a in range(4)]
        slot[where] = (acc[0] - acc[1]) - (acc[2] - acc[3])
    low, high = np.quantile(slot.reshape(400, 3).mean(axis=1), [0.025, 0.975])
    assert (ci.low, ci.high) == pytest.approx((low, high), abs=1e-12), (
        ci.low - low,
        ci.high - high,
    )
    assert ci.estimate == pytest.approx(0.1, abs=1e-12) and ci.n_resamples == 400
    # Reproducible with its seed, and another seed draws otherwise.
    again = stats.hierarchical_interaction_bootstrap(
        per_seed, "accuracy", 400, 0.95, seed=7, num_classes=3
    )
    assert (again.low, again.high) == (ci.low, ci.high)
    other = stats.hierarchical_interaction_bootstrap(
        per_seed, "accuracy", 400, 0.95, seed=8, num_classes=3
    )
    assert (other.low, other.high) != (ci.low, ci.high)
    # Shared draws: (a - b) - (a - b) is 0 in every resample; with d = c it is the paired bootstrap of a - b.
    zero = stats.hierarchical_interaction_bootstrap(
        [per_seed[0], per_seed[1]] * 2, "accuracy", 400, seed=7
    )
    assert (zero.low, zero.high, zero.estimate) == (0.0, 0.0, 0.0)
    same = stats.hierarchical_interaction_bootstrap(
        [per_seed[0], per_seed[1], per_seed[2], per_seed[2]], "accuracy", 400, seed=7
    )
    paired = stats.paired_hierarchical_bootstrap(per_seed[0], per_seed[1], "accuracy", 400, seed=7)
    assert max(abs(same.low - paired.low), abs(same.high - paired.high)) < 1e-12, (same, paired)
    # The report's bootstrap is this one at the report's seed.
    ix = tables.interaction(study, QUAD, "val", n_resamples=400)
    at_report = stats.hierarchical_interaction_bootstrap(
        per_seed, "accuracy", 400, 0.95, tables.BOOTSTRAP_SEED, 3
    )
    assert (ix.bootstrap.low, ix.bootstrap.high) == (at_report.low, at_report.high)


def test_arms_on_other_examples_or_missing_seeds_are_said_not_hidden(tmp_path):
    # one label differs: not the same examples
    labels = {("cnn", 1): [0, 0, 0, 1, 1, 1, 2, 2, 2, 0]}
    ix = tables.interaction(in_memory_study(tmp_path, labels=labels), QUAD, "val", n_resamples=100)
    assert (
        ix.bootstrap is None
        and "seed 1: arms a and d were not evaluated on identical examples" in ix.note
    ), ix.note
    assert ix.paired.n == 3  # the t-interval over seeds stays
    partial = {arm: dict(seeds) for arm, seeds in CORRECT.items()}
    del partial["cnn_r"][2]
    ix = tables.interaction(in_memory_study(tmp_path, partial), QUAD, "val", n_resamples=100)
    assert ix.paired.seeds == [0, 1] and "missing cnn_r: seed 2" in ix.note, ix.note
    (item,) = results.interaction_contents([ix], decimals=2)
    assert "Only 2 of the protocol's 3 seeds have finished runs of all four arms." in item[1].text


def test_bad_interactions_are_one_line_naming_the_value(tmp_path):
    study = in_memory_study(tmp_path)
    for quads, expected in (
        (
            [("vit_r", "vit", "cnn_r", "resnet")],
            "--interaction vit_r:vit:cnn_r:resnet: arm 'resnet' is not in protocol 'ixstudy'",
        ),
        (
            [("vit_r", "vit", "vit_r", "cnn")],
            "--interaction vit_r:vit:vit_r:cnn: arm 'vit_r' named twice",
        ),
    ):
        with pytest.raises(ValueError, match="^" + expected.replace("(", r"\(")):
            tables.check_interactions(study, quads)
    assert tables.check_interactions(study, [QUAD, QUAD]) == [QUAD]
    for value in ("a:b:c", "a:b:c:d:e", "a::c:d"):
        with pytest.raises(ReportError, match=f"^--interaction '{value}': expected A:B:C:D"):
            parse_interactions([value])
    with pytest.raises(
        ReportError, match=r"^--interaction vit_r:vit:cnn_r:resnet: arm 'resnet' is not in protocol"
    ):
        render_study(
            study,
            inputs_with(study, [("vit_r", "vit", "cnn_r", "resnet")]),
            tmp_path / "out",
            [],
            [],
        )
    assert not (tmp_path / "out").exists(), "nothing is written for a bad interaction"
    result = CliRunner().invoke(report_command, ["--protocol", "x.yaml", "--interaction", "a:b:c"])
    assert (
        result.exit_code == 1
        and result.output
        == "Error: --interaction 'a:b:c': expected A:B:C:D, four arm names for (A - B) - (C - D)\n"
    ), result.output
    for protocol, kind in (
        ("smoke_heads", "an intervention"),
        ("retina_transfer_smoke", "a transfer"),
    ):
        result = CliRunner().invoke(
            report_command, ["--protocol", protocol, "--interaction", "a:b:c:d"]
        )
        assert (
            result.exit_code == 1
            and result.output
            == f"Error: --interaction: for ablation protocols; {protocol} is {kind} protocol\n"
        ), result.output
    result = CliRunner().invoke(
        report_command, ["--from-evidence", "ev", "--interaction", "a:b:c:d"]
    )
    assert result.exit_code == 2 and "--interaction: not with --from-evidence" in result.output, (
        result.output
    )


def test_the_interactions_travel_in_the_evidence_export(tmp_path, monkeypatch):
    """The export records the option and a rebuild reads it back (the store's reads replaced: this study has no store);
    an export without interactions has no such key, so published exports keep their bytes."""
    study = in_memory_study(tmp_path)
    monkeypatch.setattr(run_export, "metric_histories", lambda run_id: {})
    monkeypatch.setattr(queries, "parent_runs", lambda name, digest: [])
    inputs = inputs_with(study, [QUAD])
    export_evidence(tmp_path / "evidence", study, inputs, [], [])
    assert json.loads((tmp_path / "evidence" / "runs.json").read_text())["build"][
        "interactions"
    ] == [list(QUAD)]
    loaded = load_evidence(tmp_path / "evidence")
    assert loaded.inputs == inputs, (loaded.inputs, inputs)
    a, b = (tables.interaction(s, QUAD, "val", 200) for s in (study, loaded.study))
    assert (a.paired.differences, a.bootstrap.low, a.bootstrap.high) == (
        b.paired.differences,
        b.bootstrap.low,
        b.bootstrap.high,
    )
    assert (
        "`--resamples 200 --interaction vit_r:vit:cnn_r:cnn`"
        in header_bullets(inputs, "ixstudy", "newest", [], "sqlite:///mlflow.db")[1]
    )
    export_evidence(tmp_path / "plain", study, inputs_with(study, []), [], [])
    assert "interactions" not in json.loads((tmp_path / "plain" / "runs.json").read_text())["build"]
    assert load_evidence(tmp_path / "plain").inputs.interactions == []


def logged_study(folder):
    path = protocol_file(folder)
    protocol = load_protocol(path)
    client, parent = MlflowClient(), start_parent_run(protocol, path, allow_dirty=True)
    for cell in protocol.cells():
        log_cell(
            client,
            protocol,
            parent,
            cell.arm,
            cell.seed,
            CORRECT[cell.arm][cell.seed],
            0,
            with_test=False,
        )
    end_parent_run(parent, {"finished": 12, "skipped": 0, "failed": 0})
    return path


@pytest.mark.slow  # 19 s (and 9 s of store setup) on the shared 2-core machine under load: two report builds with every figure
def test_report_and_its_evidence_rebuild_carry_the_interaction(mlflow_store, tmp_path):
    path = logged_study(tmp_path)
    result = build_report(
        str(path), tmp_path / "docs", log=False, n_resamples=200, evidence=True, interactions=[QUAD]
    )
    md = result.markdown.read_text()
    assert "options `--resamples 200 --interaction vit_r:vit:cnn_r:cnn`" in md
    row = table_rows(md, "(a − b) − (c − d)", "n")[0]["(vit_r − vit) − (cnn_r − cnn)"]
    assert row[:5] == ["3 of 3", *HAND_POINTS, "+10.00"] and row[8] == "2 of 3", row
    assert (
        "figures/interactions_val.png" in md
        and (result.folder / "figures" / "interactions_val.png").is_file()
    )
    (ix,) = result.interactions["val"]
    assert ix.arms == QUAD and ix.bootstrap.n_resamples == 200
    doc = (result.folder / "evidence" / "runs.json").read_text()
    assert '"interactions": [\n   [\n    "vit_r",' in doc, (
        "the option travels in the export's build options"
    )
    rebuilt = build_from_evidence(result.folder / "evidence", tmp_path / "rebuilt")
    rebuilt_md = rebuilt.markdown.read_text()
    assert (
        "\n".join(x for x in rebuilt_md.split("\n") if not x.startswith(f"- {REBUILT_PREFIX}"))
        == md
    )
    for figure in result.figures:
        assert (rebuilt.folder / "figures" / figure.name).read_bytes() == figure.read_bytes(), (
            figure.name
        )
    (again,) = rebuilt.interactions["val"]
    assert (again.bootstrap.low, again.bootstrap.high) == (ix.bootstrap.low, ix.bootstrap.high)
