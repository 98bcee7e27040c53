"""attribute end to end: two tiny trained cells in a real SQLite MLflow store, every method scored, rerun, report,
evidence rebuilt offline, a checkpoint that fails its reload proof.

Slow tier: it trains (two 1-epoch cells of an 8 px image-folder protocol, the path the smoke
protocol takes with Fashion-MNIST) and draws the report's figures twice.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import acted_kinds as kinds
from mlflow.tracking import MlflowClient
from rebuild_checks import forbid_store, number_differences, without_rebuilt_line

from reports.build import build_from_evidence, build_report
from studies.attribution.attribute import open_attribution_protocol, run_attribution_protocol
from tracking.kinds import attribution_runs

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ATTRIBUTION = """\
name: {name}
description: every attribution method on the tiny cells
acts_on: {{protocol: tiny, hash: {hash}}}
attribution: {{split: val, images: 6, batch_size: 4, norm_threshold: 2.0, examples: 2}}
"""
METHODS = ["cls_attention", "rollout", "chefer", "grad_x_input", "random"]


trained_store, trained = kinds.tiny_store_fixtures("attribution")


def attribute(tmp: Path, folder: Path, path: Path):
    protocol = open_attribution_protocol(str(path), allow_dirty=True)
    return protocol, run_attribution_protocol(
        protocol, path, kinds.cpu_options(tmp / "attr", folder)
    )


def test_attribute_logs_every_method_a_rerun_computes_nothing_and_the_report_rebuilds_offline(
    trained, monkeypatch
):
    tmp, folder, ablation = trained
    path = kinds.write_protocol(tmp, ATTRIBUTION, "tiny_faithfulness", ablation)
    protocol, outcomes = attribute(tmp, folder, path)
    kinds.assert_finished(outcomes, 2)
    assert "reload proof: reproduced 6 saved predictions" in outcomes[0].message
    client = MlflowClient()
    # All 6 validation images are scored, by the trained cell's best checkpoint (kinds.checked_cells).
    for cell, source in kinds.checked_cells("tiny_faithfulness", "attribution"):
        assert (
            cell.data.params["code_fingerprint"] == attribution_runs.attribution_code_fingerprint()
        )
        m = cell.data.metrics
        assert m["images"] == 6 and m["patches"] == 4
        for method in METHODS:
            for key in ("deletion_auc", "insertion_auc"):
                assert 0.0 <= m[f"{key}/{method}"] <= 1.0, (key, method)
        assert {f"high_norm_fraction/block{b}" for b in (0, 1)} <= set(m)
        local = kinds.artifacts(cell) / "attribution"
        with np.load(local / "per_image.npz") as z:
            assert set(attribution_runs.PER_IMAGE_KEYS) <= set(z.files)
            assert np.array_equal(np.sort(z["indices"]), kinds.saved_indices(source))
            assert z["effects"].shape == (6, 4) and z["norms"].shape == (2, 6, 4)
            assert z["example_images"].shape == (2, 3, 8, 8)
            for method in METHODS:
                assert abs(m[f"rho/{method}"] - np.nanmean(z[f"rho/{method}"])) <= 1e-12, method
                history = client.get_metric_history(cell.info.run_id, f"deletion_curve/{method}")
                mean = z[f"deletion_prob/{method}"].mean(axis=0)  # (F,) over counts 0..4
                assert sorted(p.step for p in history) == list(range(5)), history
                worst = max(abs(p.value - mean[p.step]) for p in history)
                assert worst <= 1e-6, f"max |logged - mean curve| {worst:.3g}"
        assert (local / "summary.json").is_file()

    kinds.rerun_skipping(monkeypatch, "attribute", path, folder, tmp / "attr")
    assert len(kinds.cell_runs("tiny_faithfulness")) == 2

    result = build_report(str(path), tmp / "reports", n_resamples=200, evidence=True)
    md = result.markdown.read_text()
    assert (
        md.startswith(f"# Report: tiny_faithfulness@{protocol.short_hash}\n") and "**2 of 2**" in md
    ), md[:600]
    for part in (
        "## Results",
        "## Faithfulness (vit)",
        "### Against the random baseline (vit)",
        "## Deletion and insertion curves (vit)",
        "## Examples (vit)",
        "## Token norms (vit)",
        "## Runs",
        "### Acted-on models",
        "`chefer`",
        "`random` (baseline)",
        "## Does CLS attend to the tokens that matter? (vit)",
    ):
        assert part in md, part
    assert (
        "## Attention concentration per block (vit)" in md
        and "The model has no register tokens." in md
    )
    # issue 48 [AA]: the scored images per class (6 of a tiny split: too thin, so --strict refuses),
    # and the high-norm detector's planted positive control, run in every cell
    assert "## Scored images" in md and "a class-stratified sample of 6" in md, md[:2000]
    assert any(p.startswith("sample: vit: ") for p in result.problems), result.problems
    assert "Positive control of the high-norm detector" in md and "shown to detect" in md
    for cell, _ in kinds.checked_cells("tiny_faithfulness", "attribution"):
        assert cell.data.metrics["norm_control/detects"] == 1.0, cell.data.metrics
    assert sorted(p.name for p in result.figures) == [
        "concentration_vit.png",
        "curves_vit.png",
        "examples_vit.png",
        "norms_vit_seed0.png",
        "norms_vit_seed1.png",
        "per_class_rho_vit.png",
    ]

    forbid_store(monkeypatch, tmp)
    rebuilt = build_from_evidence(result.folder / "evidence", tmp / "rebuilt")
    b = rebuilt.markdown.read_text()
    compared, diffs = number_differences(md, b)
    assert compared > 50 and not diffs, f"{len(diffs)} places differ: {diffs[:10]}"
    assert without_rebuilt_line(b) == md
    different = [
        p.name
        for p, q in zip(sorted(result.figures), sorted(rebuilt.figures))
        if p.read_bytes() != q.read_bytes()
    ]
    assert not different, f"figures differ: {different}"


CONTROLS = """\
name: {name}
description: every attribution method and every control on the tiny cells
acts_on: {{protocol: tiny, hash: {hash}}}
attribution:
  methods: [cls_attention, rollout, chefer, grad_x_input, random, intensity, centre, oracle]
  split: val
  images: 6
  batch_size: 4
  norm_threshold: 2.0
  examples: 1
  random_draws: 3
  sanity_check: true
"""


def test_the_controls_are_logged_reported_and_rebuilt_offline(trained, monkeypatch):
    tmp, folder, ablation = trained
    path = tmp / "tiny_controls.yaml"
    path.write_text(CONTROLS.format(name="tiny_controls", hash=ablation.hash))
    protocol, outcomes = attribute(tmp, folder, path)
    kinds.assert_finished(outcomes, 2)
    for cell in kinds.cell_runs("tiny_controls"):
        p, m = cell.data.params, cell.data.metrics
        assert p["random_draws"] == "3" and p["sanity_check"] == "True", p
        assert m["rho/oracle"] == pytest.approx(1.0, abs=1e-12)
        for metric in ("rho", "abs_rho"):  # the positive control: every layer random, still 1
            assert m[f"sanity_all_random/{metric}/intensity"] == pytest.approx(1.0, abs=1e-12)
        assert "sanity_all_random/ssim/intensity" not in m  # a 2 x 2 grid has no SSIM interior
        assert m["sanity_all_random/rho/grad_x_input"] < 0.99  # reads the weights: moves
        assert m["random_draws_sd/rho"] > 0 and m["insertion_start_share"] == 1.0
    result = build_report(str(path), tmp / "reports", n_resamples=100, evidence=True)
    md = result.markdown.read_text()
    for part in (
        "## In one line per method",
        "## Methods, named exactly",
        "### Where the insertion curve starts (vit)",
        "### Against 3 random draws per image (vit)",
        "### Method against method (vit)",
        "### Per class (vit)",
        "### Model-randomisation sanity check (vit)",
        "Positive control (vit)",
        "| + head |",
        "⚠ survives",
        "95% Fisher z",
    ):
        assert part in md, part
    assert any(  # the model-free baseline is flagged by the randomisation check
        line.startswith("| `intensity`") and "⚠ survives" in line for line in md.splitlines()
    )
    assert "### Against the random baseline (vit)" not in md  # the draws replace the one order
    forbid_store(monkeypatch, tmp)
    rebuilt = build_from_evidence(result.folder / "evidence", tmp / "rebuilt_controls")
    assert without_rebuilt_line(rebuilt.markdown.read_text()) == md


def test_a_checkpoint_that_does_not_reproduce_its_predictions_fails_its_cell_only(
    trained, monkeypatch
):
    tmp, folder, ablation = trained
    kinds.first_seed_off_by_a_millionth(monkeypatch)
    path = kinds.write_protocol(tmp, ATTRIBUTION, "tiny_proof", ablation)
    _, outcomes = attribute(tmp, folder, path)
    kinds.assert_first_cell_failed_its_proof(outcomes, "nothing scored")


def test_a_cell_killed_after_its_lease_dropped_logs_each_metric_once_on_the_rerun(
    trained, monkeypatch
):
    """The execution dies between releasing the first cell's lease and ending its run (the run
    stays RUNNING, released): the rerun continues that run in place and, before, logged every one
    of its metrics a second time (docs/study-record.md: only what the run lacks)."""
    from tracking.record.sink import RunSink

    tmp, folder, ablation = trained
    path = kinds.write_protocol(tmp, ATTRIBUTION, "tiny_killed", ablation)
    real_end, killed = RunSink.end, []

    def killed_at_first_end(self, status="FINISHED", end_time=None):
        if not killed:  # the first cell's end, its lease just released: the process is killed
            killed.append(self.run_id)
            raise KeyboardInterrupt
        if self.run_id in killed:  # a dead process writes nothing more to it
            return None
        return real_end(self, status, end_time)

    monkeypatch.setattr(RunSink, "end", killed_at_first_end)
    with pytest.raises(KeyboardInterrupt):
        attribute(tmp, folder, path)
    monkeypatch.setattr(RunSink, "end", real_end)
    client = MlflowClient()
    dropped = client.get_run(killed[0])
    assert dropped.info.status == "RUNNING" and "lease.released" in dropped.data.tags, (
        dropped.info.status,
        sorted(dropped.data.tags),
    )
    first = {k: len(client.get_metric_history(killed[0], k)) for k in dropped.data.metrics}

    _, outcomes = attribute(tmp, folder, path)
    kinds.assert_finished(outcomes, 2)
    assert outcomes[0].run_id == killed[0]  # continued in place, not in a new run
    for cell in kinds.cell_runs("tiny_killed"):
        histories = {k: client.get_metric_history(cell.info.run_id, k) for k in cell.data.metrics}
        assert len(histories) >= 80, len(histories)  # 82 metric keys on the tiny cells
        twice = {
            k: [m.step for m in h]
            for k, h in histories.items()
            if len({m.step for m in h}) != len(h)
        }
        assert not twice, (
            f"{len(twice)} of {len(histories)} keys logged twice at a step: {sorted(twice)[:5]}"
        )
    # the killed run held every number already: the rerun added none
    after = {k: len(client.get_metric_history(killed[0], k)) for k in first}
    assert after == first, {k: (first[k], after[k]) for k in first if after[k] != first[k]}


PRETRAINED = f"""\
name: tiny_timm_faithfulness
description: a randomly initialised reduced timm ViT with a register token, on an image folder
{kinds.PRETRAINED_SOURCE}attribution: {{split: val, images: 6, batch_size: 4, norm_threshold: 2.0, examples: 1}}
"""


def test_a_pretrained_timm_vit_on_an_image_folder(tmp_path, mlflow_store, monkeypatch):
    _, path, cell = kinds.run_pretrained(
        tmp_path, monkeypatch, "tiny_timm_faithfulness", PRETRAINED, attribute
    )
    # 16 px, patch 8; the class and register tokens are never scored
    assert cell.data.metrics["patches"] == 4
    local = kinds.artifacts(cell) / "attribution"
    with np.load(local / "per_image.npz") as z:
        assert set(np.unique(z["labels"])) <= {4, 0, 2}, (
            "labels are the model's output indices of the classes"
        )
        assert int(z["prefix"]) == 2 and z["prefix_norms"].shape == (2, 6, 2)
        # (blocks, images): the one register's share of CLS attention
        on_registers = z["cls_attention_on_registers"]
        assert on_registers.shape == (2, 6) and (on_registers > 0).all()
        register_norm = z["prefix_norms"][1, :, 1].mean()
    m = cell.data.metrics
    diff = max(
        abs(m[f"cls_attention_on_registers/block{b}"] - on_registers[b].mean()) for b in range(2)
    )
    assert (
        diff <= 1e-12 and abs(m["register_norm/block1"] - register_norm) <= 1e-9 * register_norm
    ), diff
    md = build_report(str(path), tmp_path / "reports", n_resamples=50).markdown.read_text()
    assert (
        "## Attention concentration per block (pretrained)" in md and "on the 1 register, %" in md
    )


def test_the_evidence_ships_the_acted_on_weights_and_the_study_re_runs_from_them_in_an_empty_store(
    trained, monkeypatch, tmp_path
):
    """[AA] 5: ``report --evidence`` writes the acted-on cells' weights (safetensors, sha256 in a
    manifest); ``attribute --cells-from`` re-runs the study from them in a store that has no trained
    cell, keyed by the same source runs, to the same numbers bit for bit; a tampered file is refused."""
    import json

    from click.testing import CliRunner

    from studies.attribution.attribute import attribute as attribute_command

    tmp, folder, ablation = trained
    path = kinds.write_protocol(tmp, ATTRIBUTION, "tiny_weights", ablation)
    kinds.assert_finished(attribute(tmp, folder, path)[1], 2)
    original = {
        (c.data.tags["arm"], c.data.tags["seed"]): c for c in kinds.cell_runs("tiny_weights")
    }
    evidence = build_report(str(path), tmp / "reports_w", n_resamples=50, evidence=True).folder
    evidence = evidence / "evidence"
    manifest = json.loads((evidence / "weights" / "manifest.json").read_text())
    assert sorted((c["arm"], c["seed"]) for c in manifest["cells"]) == [("vit", 0), ("vit", 1)]
    assert "weights/<arm>.seed<seed>/model.safetensors" in (evidence / "README.md").read_text()
    for c in manifest["cells"]:
        assert c["source_run_id"] == original[(c["arm"], str(c["seed"]))].data.tags["source_run_id"]
        assert {Path(f).name for f in c["files"]} == {
            "config.json",
            "model.safetensors",
            "val.csv.gz",
        }

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    kinds.use_store(monkeypatch, fresh)
    args = ["--protocol", str(path), "--allow-dirty", "--device", "cpu", "--data-path", str(folder)]
    args += ["--output-dir", str(fresh / "out"), "--cells-from", str(evidence)]
    done = CliRunner().invoke(attribute_command, args)
    assert done.exit_code == 0, done.output
    again = {(c.data.tags["arm"], c.data.tags["seed"]): c for c in kinds.cell_runs("tiny_weights")}
    assert set(again) == set(original)
    for key, cell in again.items():
        before = original[key]
        assert cell.data.tags["source_run_id"] == before.data.tags["source_run_id"]
        assert cell.data.tags["run_key"] == before.data.tags["run_key"], "not keyed as the original"
        metrics = {k: v for k, v in before.data.metrics.items() if "seconds" not in k}
        differ = {
            k: (v, cell.data.metrics.get(k))
            for k, v in metrics.items()
            if cell.data.metrics.get(k) != v and not np.isnan(v)
        }
        assert not differ, (
            f"{len(differ)} metrics differ from the original study: {list(differ.items())[:5]}"
        )

    # The study acted on published weights is published in turn: its store has no trained run, so
    # its evidence copies the weights from the evidence folder that ships them, byte for byte.
    from tracking.export import acted_weights

    monkeypatch.setattr(acted_weights, "PUBLISHED", evidence.parents[1])
    republished = build_report(str(path), tmp_path / "reports_fresh", n_resamples=50, evidence=True)
    again_weights = republished.folder / "evidence" / "weights"
    shipped = {
        p.relative_to(evidence / "weights"): p.read_bytes()
        for p in (evidence / "weights").rglob("*")
        if p.is_file()
    }
    copied = {
        p.relative_to(again_weights): p.read_bytes()
        for p in again_weights.rglob("*")
        if p.is_file()
    }
    assert copied == shipped, sorted(set(copied) ^ set(shipped))
    monkeypatch.setattr(acted_weights, "PUBLISHED", tmp_path / "nowhere")
    with pytest.raises(Exception, match="no published evidence folder under"):
        build_report(str(path), tmp_path / "reports_none", n_resamples=50, evidence=True)

    # A study published before its export shipped weights gets them from rebuilt cells: the same
    # files and manifest, keyed by the acted-on run, with the rebuilt run and its proof.
    import shutil

    from tracking.export.acted_weights import attach_rebuilt_weights
    from workbench.protocol import load_any

    kinds.use_store(monkeypatch, tmp)  # the store that holds the trained runs (the "rebuilt" ones)
    bare = tmp_path / "bare_evidence"
    shutil.copytree(evidence, bare)
    shutil.rmtree(bare / "weights")
    protocol = load_any(path)
    cells = [
        (c["arm"], c["seed"], c["source_run_id"], c["source_run_id"], "rebuilt in a test")
        for c in manifest["cells"]
    ]
    attach_rebuilt_weights(bare, protocol.acts_on, cells)
    attached = json.loads((bare / "weights" / "manifest.json").read_text())
    assert [c.pop("rebuilt")["proof"] for c in attached["cells"]] == ["rebuilt in a test"] * 2
    assert attached == manifest
    for name in manifest["cells"][0]["files"]:
        assert (bare / name).read_bytes() == (evidence / name).read_bytes(), name

    weights = next((evidence / "weights").glob("vit.seed0/model.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    (tmp_path / "other").mkdir()
    kinds.use_store(monkeypatch, tmp_path / "other")  # a store where the cells are not done yet
    tampered = CliRunner().invoke(attribute_command, args)
    assert tampered.exit_code == 1 and "sha256 differs" in tampered.output, tampered.output
