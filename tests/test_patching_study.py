"""Activation patching as an intervention mode, end to end on two tiny trained cells: run, record, rerun, report."""

from __future__ import annotations

import re

from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from acted_kinds import cell_runs
from test_intervene import intervene, trained, trained_store  # noqa: F401 (fixtures)
from reports.build import build_report
from workbench.protocol.intervention import parse_intervention_protocol

pytestmark = pytest.mark.e2e

PATCHING = """\
name: tiny_patching
description: activation patching on the tiny cells, patch corruption
acts_on: {{protocol: tiny, hash: {hash}}}
interventions: {{heads: none, branches: none, position_embedding: false}}
evaluation: {{batch_size: 4, mean_images: 0}}
patching: {{pairs: 4, corruption: patches, replaced_patches: 2, seed: 5}}
"""


def test_patching_is_logged_per_cell_rerun_skips_and_the_report_shows_the_maps(
    trained,  # noqa: F811
):
    tmp_path, folder, ablation = trained
    path = tmp_path / "tiny_patching.yaml"
    path.write_text(PATCHING.format(hash=ablation.hash))
    protocol, outcomes = intervene(tmp_path, folder, path)
    assert [o.status for o in outcomes] == ["finished"] * 2, [o.message for o in outcomes]
    assert "patching: 4 pairs in" in outcomes[0].message
    assert "reload proof: reproduced 6 saved predictions" in outcomes[0].message
    client = MlflowClient()
    cells = cell_runs("tiny_patching")
    assert len(cells) == 2 and len({r.data.tags["mlflow.parentRunId"] for r in cells}) == 1
    for cell in cells:
        local = (
            Path(urlparse(client.get_run(cell.info.run_id).info.artifact_uri).path)
            / "interventions"
        )
        with np.load(local / "per_example.npz") as z:  # the whole evaluated split per class
            per_class = [int(np.sum(z["labels"] == c)) for c in z["sample_classes"]]
            assert z["class_counts"].tolist() == per_class and sum(per_class) == len(z["labels"])
        with np.load(local / "patching.npz") as z:
            depth, tokens, heads = 2, 1 + 4, 2  # image 8 px, patch 4: 4 patches and the class token
            assert z["resid_ld"].shape == (4, depth, tokens)
            assert z["branch_ld"].shape == (4, depth, 2) and z["head_ld"].shape == (4, depth, heads)
            assert np.all(z["clean_label"] != z["contrast_label"]) and z["replaced"].shape == (4, 2)
            # the clean images per class of the split, as the report's "Scored images" reads them
            per_class = [int(np.sum(z["clean_label"] == c)) for c in z["sample_classes"]]
            assert z["class_counts"].tolist() == per_class and sum(per_class) == 4, per_class
            # the class token at the last block's output carries the whole clean answer
            diff = float(np.abs(z["resid_ld"][:, -1, 0] - z["clean_ld"]).max())
            assert diff <= 1e-5, diff
            gap = z["clean_ld"].mean(dtype=np.float64) - z["corrupted_ld"].mean(dtype=np.float64)
            m = cell.data.metrics
            expected = (
                z["branch_ld"][:, 0, 1].mean(dtype=np.float64)
                - z["corrupted_ld"].mean(dtype=np.float64)
            ) / gap
            assert abs(m["restored/blocks.0.mlp"] - expected) <= 1e-9
            assert m["patching_pairs"] == 4.0
            # noising beside denoising: the clean run with the corrupted activation patched in
            assert z["noising_resid_ld"].shape == (4, depth, tokens)
            removed = (
                z["clean_ld"].mean(dtype=np.float64)
                - z["noising_branch_ld"][:, 0, 1].mean(dtype=np.float64)
            ) / gap
            assert abs(m["removed/blocks.0.mlp"] - removed) <= 1e-9
            # the model names what its class-token head reads after the last block: the class token
            assert z["resid_reads"].tolist() == [[True] * tokens, [True] + [False] * (tokens - 1)]
    # the same pairs in both seeds (they depend on the split and the seed only)
    arrays = []
    for cell in cells:
        local = Path(urlparse(client.get_run(cell.info.run_id).info.artifact_uri).path)
        with np.load(local / "interventions" / "patching.npz") as z:
            arrays.append((z["clean_index"].copy(), z["source_index"].copy()))
    assert all(np.array_equal(a, b) for a, b in zip(arrays[0], arrays[1]))

    _, again = intervene(tmp_path, folder, path)
    assert [o.status for o in again] == ["skipped"] * 2, [o.message for o in again]

    result = build_report(str(path), tmp_path / "reports", log=False)
    md = result.markdown.read_text()
    assert "## Activation patching (vit)" in md and "4 pairs (seed 5" in md, md[:2000]
    assert "## Scored images" in md and "Evaluated images per class" in md, md[:3000]
    assert "Clean images of the patching pairs" in md, md[:3000]
    assert "class-stratified sample of 4 (seed 5" in md, md[:3000]
    assert "Seed agreement on the blocks x positions map" in md
    assert "named by the models themselves" in md
    assert re.search(r"\|\s*1\s*\|\s*0 of 5\s*\|", md), "the last block: every position fixed"
    assert "predates noising" not in md and "Noising (Heimersheim and Nanda 2024)" in md
    assert {
        "patching_resid_vit.png",
        "patching_heads_vit.png",
        "patching_noising_resid_vit.png",
    } <= {p.name for p in result.figures}


def test_the_patching_section_is_optional_and_left_out_of_the_hash(trained):  # noqa: F811
    tmp_path, _folder, ablation = trained
    base = PATCHING.format(hash=ablation.hash).rsplit("patching:", 1)[0]
    (tmp_path / "p.yaml").write_text(base.replace("tiny_patching", "p"))
    without = parse_intervention_protocol(
        __import__("yaml").safe_load((tmp_path / "p.yaml").read_text()), str(tmp_path / "p.yaml")
    )
    assert without.patching is None and "patching" not in without.canonical
    with pytest.raises(Exception, match="patching.replaced_patches=0: give a positive count"):
        parse_intervention_protocol(
            __import__("yaml").safe_load(base + "patching: {corruption: patches}\n"),
            str(tmp_path / "p.yaml"),
        )


def test_attribution_patching_is_logged_beside_the_exact_grid_and_scored_against_it(
    trained,  # noqa: F811
):
    from workbench.interventions.attribution_patching import agreement, read_locations

    tmp_path, folder, ablation = trained
    path = tmp_path / "tiny_atp.yaml"
    text = PATCHING.format(hash=ablation.hash).replace("tiny_patching", "tiny_atp")
    path.write_text(text.replace("seed: 5}", "seed: 5, attribution_patching: true, ig_steps: 3}"))
    _, outcomes = intervene(tmp_path, folder, path)
    assert [o.status for o in outcomes] == ["finished"] * 2, [o.message for o in outcomes]
    client = MlflowClient()
    for cell in cell_runs("tiny_atp"):
        local = Path(urlparse(client.get_run(cell.info.run_id).info.artifact_uri).path)
        with np.load(local / "interventions" / "patching.npz") as z:
            arrays = {k: z[k] for k in z.files}
        for method in ("atp", "atp_ig"):
            for key in ("resid_ld", "branch_ld", "head_ld", "noising_head_ld"):
                assert arrays[f"{method}_{key}"].shape == arrays[key].shape, (method, key)
        m = cell.data.metrics
        keep = read_locations(arrays["resid_reads"], 2, 2)
        for method in ("atp", "atp_ig"):
            for direction in ("denoising", "noising"):
                scored = agreement(arrays, arrays, method, direction, keep).metrics()
                for name, value in scored.items():
                    logged = m[f"{method}_{name}/{direction}"]
                    assert np.isnan(value) and np.isnan(logged) or abs(logged - value) <= 1e-9, (
                        method,
                        direction,
                        name,
                        logged,
                        value,
                    )
        assert (m["atp_forwards"], m["atp_ig_forwards"], m["atp_ig_backwards"]) == (2, 6, 6)
        assert m["exact_forwards"] == 2 + 2 * 2 * (5 + 2 + 2)
