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
patching: {{pairs: 4, corruption: patches, replaced_patches: 2, positions: true, edges: true, seed: 5}}
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
            # each branch and head at one position too (positions: true)
            assert z["branch_pos_ld"].shape == (4, depth, 2, tokens)
            assert z["noising_head_pos_ld"].shape == (4, depth, heads, tokens)
            # each head into each later reader of the class token (edges: true), exact and AtP
            assert z["edge_exact_ld"].shape == (4, 12) and z["edge_atp_ld"].shape == (4, 12)
            assert z["edge_labels"][0] == "L0H0->mlp.0" and z["edge_labels"][-1] == "L1H1->readout"
            assert z["edge_passes"].tolist() == [14, 3, 1]
            assert -1.0 <= m["edges_rho"] <= 1.0 and m["edges"] == 12.0
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
    # read at each pair's own replaced patches, and per position for branches and heads
    assert "### Where the corruption sits (vit)" in md and "a replaced patch" in md, md[-4000:]
    assert "### Branches and heads per position (vit)" in md, md[-4000:]
    assert "### Edges: heads into the class token's readers (vit)" in md, md[-4000:]
    assert "12 edges" in md and "largest head, exact: fraction restored" in md, md[-4000:]
    assert {
        "patching_resid_vit.png",
        "patching_heads_vit.png",
        "patching_noising_resid_vit.png",
        "patching_denoising_positions_vit.png",
        "patching_noising_positions_vit.png",
        "edges_vit.png",
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
    both = "patching: {positions: true, attribution_patching: true}\n"
    with pytest.raises(Exception, match="patching.positions with patching.attribution_patching"):
        parse_intervention_protocol(
            __import__("yaml").safe_load(base + both), str(tmp_path / "p.yaml")
        )
    # positions: false is the default and left out of the hash; true enters it
    off, on = (
        parse_intervention_protocol(
            __import__("yaml").safe_load(base + f"patching: {{positions: {v}}}\n"),
            str(tmp_path / "p.yaml"),
        )
        for v in ("false", "true")
    )
    assert "positions" not in off.canonical["patching"] and on.canonical["patching"]["positions"]
    assert off.hash != on.hash


def test_attribution_patching_is_logged_beside_the_exact_grid_and_scored_against_it(
    trained,  # noqa: F811
):
    from workbench.interventions.attribution_patching import agreement, read_locations

    tmp_path, folder, ablation = trained
    path = tmp_path / "tiny_atp.yaml"
    text = PATCHING.format(hash=ablation.hash).replace("tiny_patching", "tiny_atp")
    text = text.replace("positions: true, edges: true, ", "")  # positions: not with AtP (refused)
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


# ---- the attribution-patching section: recomputed independently, rebuilt offline ------------


def _fractions(z: dict, prefix: str, direction: str) -> np.ndarray:
    """Every location's fraction in location order (residuals, branches, heads), recomputed here."""
    gap = z["clean_ld"].mean(dtype=np.float64) - z["corrupted_ld"].mean(dtype=np.float64)
    noising = "noising_" if direction == "noising" else ""
    parts = []
    for kind in ("resid", "branch", "head"):
        patched = z[f"{prefix}{noising}{kind}_ld"].mean(axis=0, dtype=np.float64)
        restored = (patched - z["corrupted_ld"].mean(dtype=np.float64)) / gap
        parts.append((restored if direction == "denoising" else 1.0 - restored).ravel())
    return np.concatenate(parts)


def _recomputed(z: dict, scores: np.ndarray, direction: str) -> dict[str, float]:
    """rho (scipy), top-10 overlap and sign agreement over the read locations, from scratch."""
    from scipy.stats import spearmanr

    exact = _fractions(z, "", direction)
    depth, heads = z["resid_ld"].shape[1], z["head_ld"].shape[2]
    keep = np.concatenate([z["resid_reads"].ravel(), np.ones(depth * (2 + heads), dtype=bool)])
    e, a = exact[keep], scores[keep]
    top = min(10, len(e))
    big = lambda v: set(np.argsort(-np.abs(v), kind="stable")[:top])  # noqa: E731
    return {
        "rho": float(spearmanr(e, a).statistic),
        "top10_overlap": len(big(e) & big(a)) / top,
        "sign_agreement": float(np.mean(np.sign(e) == np.sign(a))),
    }


def _section(md: str, heading: str) -> str:
    start = md.index(heading)
    end = md.find("\n##", start + 1)
    return md[start : end if end > 0 else len(md)]


def _row(section: str, first: str, table: int = 0) -> list[str]:
    """The cells of the row whose first cell is ``first`` in the section's ``table``-th table."""
    tables = [[]]
    for line in section.splitlines():
        if line.startswith("|"):
            tables[-1].append([c.strip() for c in line.strip().strip("|").split("|")])
        elif tables[-1]:
            tables.append([])
    return next(r for r in tables[table] if r[0] == first)


def _worst_rows(section: str) -> list[list[str]]:
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]


def _shown(name: str) -> str:
    """A location as the section names it: ``blocks.1.resid2[3]`` is ``blocks.1.resid2 at p2``."""
    m = re.match(r"(blocks\.\d+\.resid2)\[(\d+)\]$", name)
    if not m:
        return name
    return f"{m[1]} at {'cls' if m[2] == '0' else f'p{int(m[2]) - 1}'}"


def test_the_atp_section_equals_an_independent_recomputation_and_rebuilds_offline(
    trained,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    import gzip
    import io

    from rebuild_checks import forbid_store, number_differences, without_rebuilt_line
    from reports.build import build_from_evidence
    from reports.interventions.atp_report import seed_scores
    from reports.content.rounding import fmt
    from workbench.stats import fisher_z_interval

    root, folder, ablation = trained
    path = root / "tiny_atp.yaml"
    text = PATCHING.format(hash=ablation.hash).replace("tiny_patching", "tiny_atp")
    text = text.replace("positions: true, edges: true, ", "")  # positions: not with AtP (refused)
    path.write_text(text.replace("seed: 5}", "seed: 5, attribution_patching: true, ig_steps: 3}"))
    _, outcomes = intervene(root, folder, path)  # run, or skipped when the test above ran it
    assert {o.status for o in outcomes} <= {"finished", "skipped"}, [o.message for o in outcomes]
    result = build_report(str(path), tmp_path / "reports", log=False, evidence=True)
    md = result.markdown.read_text()
    evidence = result.folder / "evidence"
    cells = {}
    for f in sorted((evidence / "patching").glob("vit.seed*.npz.gz")):
        with np.load(io.BytesIO(gzip.decompress(f.read_bytes()))) as z:
            cells[int(f.name.split(".seed")[1].split(".")[0])] = {k: z[k] for k in z.files}
    assert sorted(cells) == [0, 1], sorted(cells)

    worst = 0.0
    for direction in ("denoising", "noising"):
        section = _section(md, f"### AtP against exact patching, {direction} (vit)")
        shown = seed_scores(cells, direction)
        for method, label in (
            ("atp", "AtP"),
            ("atp_ig", "AtP-IG"),
            ("atp_shuffled", "AtP, shuffled gradients"),
        ):
            per_seed = {}
            for s, z in cells.items():
                again = _recomputed(z, _fractions(z, f"{method}_", direction), direction)
                per_seed[s] = again["rho"]
                for k, v in again.items():
                    worst = max(worst, abs(shown[method][k][s] - v))
            row = _row(section, label)
            assert row[1] == " / ".join(fmt(per_seed[s], 2, True) for s in sorted(per_seed)), row
            low, high = fisher_z_interval(list(per_seed.values()))
            mean = float(np.mean(list(per_seed.values())))
            band = f"{fmt(mean, 2, True)} [{fmt(low, 2, True)}, {fmt(high, 2, True)}]"
            assert row[2] == band, (band, row)
        for s, z in cells.items():  # the random control: the mean over its draws
            draws = [_recomputed(z, d, direction) for d in z["random_scores"]]
            for k in ("rho", "top10_overlap", "sign_agreement"):
                v = float(np.mean([d[k] for d in draws]))
                worst = max(worst, abs(shown["random"][k][s] - v))
    assert worst <= 1e-12, f"section vs recomputation: max |diff| {worst:.3g}"
    # the claims computations read the same numbers from the export alone
    from reports.published import claims

    got = claims.attribution_patching(tmp_path / "reports", "tiny_atp", "vit", "atp", "rho")
    again = {
        s: _recomputed(z, _fractions(z, "atp_", "denoising"), "denoising") for s, z in cells.items()
    }
    diff = max(abs(got[f"seed{s}"] - again[s]["rho"]) for s in cells)
    assert diff <= 1e-12, f"claims vs recomputation: max |diff| {diff:.3g}"
    paired = claims.attribution_patching_difference(
        tmp_path / "reports", "tiny_atp", "vit", "atp", "random", "rho"
    )
    assert paired["n"] == 2 and paired["wins"] + paired["losses"] + paired["ties"] == 2, paired

    # the worst locations and their class-token share, from scratch
    from workbench.interventions.attribution_patching import location_names

    section = _section(md, "### Where AtP fails most (vit)")
    shares = []
    for s, z in sorted(cells.items()):
        depth, tokens = z["resid_ld"].shape[1:]
        names = np.array(location_names(depth, tokens, z["head_ld"].shape[2]))
        keep = np.concatenate([z["resid_reads"].ravel(), np.ones(depth * 4, dtype=bool)])
        e, a = _fractions(z, "", "denoising")[keep], _fractions(z, "atp_", "denoising")[keep]
        order = np.argsort(-np.abs(a - e), kind="stable")[:10]
        shares.append(
            np.mean(
                [n.startswith("blocks.") and n.endswith("resid2[0]") for n in names[keep][order]]
            )
        )
        top = _shown(str(names[keep][order[0]]))
        first = next(r for r in _worst_rows(section) if r[:2] == [str(s), "1"])
        assert first[2] == f"`{top}`", (first, top)
    row = _row(section, "AtP", table=1)
    assert row[1] == " / ".join(fmt(v, 2) for v in shares), (shares, row)

    # the cost: exact patching's passes over AtP's (2 blocks, 5 tokens, 2 heads; IG 3 steps)
    cost = _section(md, "### Cost (vit)")
    exact = 2 + 2 * 2 * (5 + 2 + 2)
    for label, f, b in (("exact patching", exact, 0), ("AtP", 2, 2), ("AtP-IG", 6, 6)):
        row = _row(cost, label)
        assert row[1:5] == [str(f), str(b), str(f + b), fmt(exact / (f + b), 1)], row
    assert {
        "atp_resid_vit.png",
        "atp_heads_branches_vit.png",
        "atp_branch_positions_vit.png",
        "atp_head_positions_vit.png",
    } <= {p.name for p in result.figures}

    # offline: the same report from the evidence export alone
    forbid_store(monkeypatch, tmp_path)
    rebuilt = build_from_evidence(evidence, tmp_path / "rebuilt")
    a, b = md, rebuilt.markdown.read_text()
    compared, diffs = number_differences(a, b)
    assert compared > 100 and not diffs, f"{len(diffs)} places differ: {diffs[:10]}"
    assert without_rebuilt_line(b) == a
    assert "Attribution patching against exact patching (vit)" in b
