"""intervene end to end: two tiny trained cells in a real SQLite MLflow store, every intervention, rerun, failures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import acted_kinds as kinds

from reports.build import build_report
from studies.ablation.ablate import open_protocol
from studies.interventions.intervene import InterventionStudy, run_intervention_protocol
from studies.runtime.study_kind import open_study
from workbench.interventions import InterventionError

pytestmark = pytest.mark.e2e  # a real MLflow store (the module's own, trained once)

INTERVENTION = """\
name: {name}
description: every head, branch, the positions, a patch and a set of the tiny cells
acts_on: {{protocol: tiny, hash: {hash}}}
interventions:
  heads: all
  head_modes: [zero, mean]
  branches: all
  position_embedding: true
  patches: [blocks.1.resid2]
  sets: [{{name: first_block, items: [blocks.0.attn.skip, blocks.0.mlp.skip]}}]
evaluation: {{batch_size: 4, mean_images: 8}}
"""


trained_store, trained = kinds.tiny_store_fixtures("intervention")


def write_intervention(tmp_path: Path, protocol, name: str = "tiny_heads") -> Path:
    return kinds.write_protocol(tmp_path, INTERVENTION, name, protocol)


def intervene(tmp_path: Path, folder: Path, path: Path):
    protocol = open_study(InterventionStudy, str(path), allow_dirty=True)
    return protocol, run_intervention_protocol(
        protocol, path, kinds.cpu_options(tmp_path / "iv", folder)
    )


def test_every_intervention_is_logged_per_cell_and_a_rerun_recomputes_nothing(trained, monkeypatch):
    tmp_path, folder, ablation = trained
    protocol, outcomes = intervene(tmp_path, folder, write_intervention(tmp_path, ablation))
    kinds.assert_finished(outcomes, 2)
    assert "reload proof: reproduced 6 saved predictions" in outcomes[0].message
    names = [i.name for i in protocol.grid.expand(protocol.model_config("vit"))]
    assert len(names) == 2 * 2 * 2 + 2 * 2 + 1 + 1 + 1
    checked = kinds.checked_cells("tiny_heads", "intervention")
    for cell, source in checked:
        m = cell.data.metrics
        local = kinds.artifacts(cell) / "interventions"
        with np.load(local / "per_example.npz") as z:
            assert [str(n) for n in z["names"]] == names and z["correct"].shape == (len(names), 6)
            assert np.array_equal(z["correct"], z["predicted"] == z["labels"][None, :])
            assert np.array_equal(np.sort(z["indices"]), kinds.saved_indices(source))
            for k, name in enumerate(names):
                acc = float(z["correct"][k].mean())
                assert abs(m[f"accuracy/{name}"] - acc) <= 1e-12, name
                assert abs(m[f"accuracy_change/{name}"] - (acc - m["intact_accuracy"])) <= 1e-12, (
                    name
                )
            assert 0.0 <= m["source_agreement/blocks.1.resid2.patch"] <= 1.0
            # a patch source is never the example itself
            assert np.all(z["patch_source/blocks.1.resid2.patch"] != np.arange(6))
        with np.load(local / "attention.npz") as z:
            # (depth, heads, rows, cols): each CLS map over patches sums to at most 1
            maps = z["maps"]
            assert (
                maps.shape == (2, 2, 2, 2)
                and np.all(maps >= 0)
                and np.all(maps.sum(axis=(2, 3)) <= 1 + 1e-6)
            )

    rerun = kinds.rerun_skipping(
        monkeypatch, "intervene", write_intervention(tmp_path, ablation), folder, tmp_path / "iv"
    )
    assert rerun.output.count("[skipped] ") == 2, rerun.output
    assert (
        "cells: 0 run, 2 already finished (skipped), 0 failed\ntime: 0.0 s evaluating interventions"
        in rerun.output
    ), rerun.output
    assert len(kinds.cell_runs("tiny_heads")) == 2

    result = build_report(str(tmp_path / "tiny_heads.yaml"), tmp_path / "reports", log=False)
    md = result.markdown.read_text()
    assert md.startswith(f"# Report: tiny_heads@{protocol.short_hash}\n") and "**2 of 2**" in md, (
        md[:600]
    )
    for part in (
        "## Heads (vit)",
        "## Every intervention, ranked (vit)",
        "## Branches, positions and tokens (vit)",
        "## Seed consistency (vit)",
        "## Attention maps beside the effects (vit)",
        "## Runs",
        "`blocks.1.resid2.patch`",
        "`set.first_block`",
        "Zero-ablating one head at a time: ",
    ):
        assert part in md, part
    assert sorted(p.name for p in result.figures) == [
        "attention_vit.png",
        "branches_vit.png",
        "heads_vit.png",
    ]
    table = md[md.index("## Every intervention, ranked (vit)") :]
    first = next(line for line in table.splitlines() if line.replace(" ", "").startswith("|1|"))
    cells = [cell for cell, _ in checked]
    worst = min(
        names, key=lambda n: (np.mean([c.data.metrics[f"accuracy_change/{n}"] for c in cells]), n)
    )
    assert f"`{worst}`" in first, (first, worst)


def test_a_checkpoint_that_does_not_reproduce_its_predictions_fails_its_cell_only(
    trained, monkeypatch
):
    tmp_path, folder, ablation = trained
    kinds.first_seed_off_by_a_millionth(monkeypatch)
    _, outcomes = intervene(tmp_path, folder, write_intervention(tmp_path, ablation, "tiny_proof"))
    kinds.assert_first_cell_failed_its_proof(outcomes, "nothing evaluated")


def test_cells_without_a_finished_trained_run_fail_with_what_to_run(
    tmp_path, mlflow_store, monkeypatch
):
    folder = kinds.image_folder(tmp_path, monkeypatch)
    (tmp_path / "tiny.yaml").write_text(kinds.TINY_ABLATION.format(kind="intervention"))
    ablation = open_protocol(str(tmp_path / "tiny.yaml"), allow_dirty=True)
    _, outcomes = intervene(tmp_path, folder, write_intervention(tmp_path, ablation))
    assert [o.status for o in outcomes] == ["failed"] * 2
    assert "no finished cell" in outcomes[0].message and "workbench ablate" in outcomes[0].message


PRETRAINED = f"""\
name: tiny_timm_heads
description: a randomly initialised reduced timm ViT with a register token, on an image folder
{kinds.PRETRAINED_SOURCE}interventions:
  heads: all
  head_modes: [zero]
  branches: none
  position_embedding: true
  tokens: [registers]
evaluation: {{batch_size: 4, mean_images: 0}}
"""


def test_a_pretrained_timm_vit_on_an_image_folder(tmp_path, mlflow_store, monkeypatch):
    folder, _, cell = kinds.run_pretrained(
        tmp_path, monkeypatch, "tiny_timm_heads", PRETRAINED, intervene
    )
    local = kinds.artifacts(cell) / "interventions"
    with np.load(local / "per_example.npz") as z:
        assert set(np.unique(z["labels"])) <= {4, 0, 2}, (
            "labels are the model's output indices of the classes"
        )
        assert [str(n) for n in z["names"]] == [
            "blocks.0.attn.head0.zero",
            "blocks.0.attn.head1.zero",
            "blocks.1.attn.head0.zero",
            "blocks.1.attn.head1.zero",
            "pos_embed.zero",
            "tokens.registers.drop",
        ]
    bad = tmp_path / "tiny_timm_bad.yaml"
    bad.write_text(
        PRETRAINED.replace("emu: 2", "emu: 7").replace(
            "name: tiny_timm_heads", "name: tiny_timm_bad"
        )
    )
    with pytest.raises(InterventionError, match="class_index.emu=7: the model has only 5 outputs"):
        intervene(tmp_path, folder, bad)


def test_benchmark_intervene_times_the_grid_and_logs_it(trained):
    from click.testing import CliRunner

    from studies.cli import main

    tmp_path, _, ablation = trained
    path = write_intervention(tmp_path, ablation, "tiny_bench")
    result = CliRunner().invoke(
        main, ["benchmark-intervene", "--protocol", str(path), "--examples", "6"]
    )
    assert result.exit_code == 0, result.output
    assert (
        "15 interventions x 2 cells x 6 images" in result.output and "cell 2 of 2:" in result.output
    )
    assert (
        "applies to fmnist_seed_recipe_heads, 5 cells x 800 images, --threads 2: not this configuration"
        in result.output
    )
    assert "threads: use: " in result.output and "at the start" in result.output, result.output
    (run,) = kinds.cell_runs("benchmark-intervene", "tags.benchmark = 'intervene'")
    m = run.data.metrics
    assert "load/start" in m and "load/end" in m and "use.threads" in run.data.tags, run.data
    assert (
        m["total_seconds"] > 0 and "goal_met" not in m and run.data.params["interventions"] == "15"
    )
