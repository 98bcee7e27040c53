"""End to end: studies/protocols/smoke_timm_arms.yaml (the glass-box ViT, timm's resnet10t and a timm
ViT arm on real CIFAR-10) through `workbench ablate --threads 1` into a fresh store, then `workbench report`,
then a transfer protocol whose source is the timm ViT arm's cell (RetinaMNIST, where a copy is here), with a
linear probe, full fine-tuning and a scratch regime."""

from __future__ import annotations

from pathlib import Path

import shutil

import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from studies.cli import main
from workbench.data.locate import resolve

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = ROOT / "studies" / "protocols" / "smoke_timm_arms.yaml"
SHARED_CIFAR = Path("/work/shared/data/cifar10-jpg.tar.gz")
SHARED_RETINA = Path("/work/shared/data/retinamnist.npz")
TRANSFER = """name: from_timm_vit
description: A timm ViT arm's cell as a transfer source (a test, not a result).
source: {weights: protocol:smoke_timm_arms/timm_vit/seed0}
dataset: {name: retinamnist, size: auto, subset: 100}
run: {batch_size: 32, eval_batch_size: 100, log_checkpoints: false}
evaluation: {n_resamples: 1000}
regimes:
  - {name: linear_probe, kind: linear, reference: true, epochs: 2, lr: 3.0e-3}
  - {name: full_ft, kind: full, epochs: 1, lr: 5.0e-4}
  - {name: scratch, kind: scratch, epochs: 1, lr: 1.0e-3}
seeds: [0]
"""
# The timm CNN arm's cell as a source: every regime, partial through timm's group_matcher (issue 30 [U] item 1).
CNN_TRANSFER = """name: from_resnet10t
description: A timm resnet10t arm's cell as a transfer source (a test, not a result).
source: {weights: protocol:smoke_timm_arms/resnet10t/seed0}
dataset: {name: retinamnist, size: auto, subset: 100}
run: {batch_size: 32, eval_batch_size: 100, log_checkpoints: false}
evaluation: {n_resamples: 1000}
regimes:
  - {name: linear_probe, kind: linear, reference: true, epochs: 2, lr: 3.0e-3}
  - {name: partial_ft, kind: partial, blocks: 1, epochs: 1, lr: 1.0e-3}
  - {name: full_ft, kind: full, epochs: 1, lr: 5.0e-4, layer_decay: 0.75}
  - {name: scratch, kind: scratch, epochs: 1, lr: 1.0e-3}
seeds: [0]
"""


def cifar_path() -> str | None:
    """A CIFAR-10 copy: the project machine's shared one, or wherever the data layer finds one (never a download)."""
    if SHARED_CIFAR.exists():
        return str(SHARED_CIFAR)
    try:
        resolve("cifar10", None, download=False)
    except Exception:  # noqa: BLE001 - no copy here: the test cannot run on real data
        pytest.skip(
            "no CIFAR-10 copy on this machine (--data-path, $WORKBENCH_DATA_DIR or the cache)"
        )
    return None


@pytest.mark.slow  # 6 cells of 2 epochs on 500 images, one thread, the report, then 7 transfer cells (309 s under load)
def test_smoke_timm_arms_trains_every_arm_and_reports(mlflow_store, tmp_path):
    data = cifar_path()
    args = [
        "ablate",
        "--protocol",
        str(PROTOCOL),
        "--threads",
        "1",
        "--allow-dirty",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    result = CliRunner().invoke(main, args + (["--data-path", data] if data else []))
    assert result.exit_code == 0, result.output[-3000:]
    assert "cells: 6 run, 0 already finished (skipped), 0 failed" in result.output, result.output[
        -2000:
    ]

    client = MlflowClient()
    (experiment,) = [e for e in client.search_experiments() if e.name == "smoke_timm_arms"]
    cells = [r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("arm")]
    assert sorted(r.data.tags["arm"] for r in cells) == [
        "resnet10t",
        "resnet10t",
        "timm_vit",
        "timm_vit",
        "vit",
        "vit",
    ]
    for run in cells:
        m = run.data.metrics
        assert run.info.status == "FINISHED" and m["reload_proof_passed"] == 1.0, (
            run.data.tags["arm"],
            m,
        )
        if (
            run.data.tags["arm"] == "timm_vit"
        ):  # read across to the glass box on its trained weights, at 0.0
            assert m["glassbox_exact"] == 1.0 and m["glassbox_max_abs_logit_diff"] == 0.0, m
        else:
            assert "glassbox_converted" not in m, m

    out = tmp_path / "reports"
    result = CliRunner().invoke(
        main, ["report", "--protocol", str(PROTOCOL), "--out-dir", str(out)]
    )
    assert result.exit_code == 0, result.output[-3000:]
    report = (out / "smoke_timm_arms" / "report.md").read_text()
    assert "| resnet10t       | timm/resnet10t (num_classes 10)" in report, report[:3000]
    assert "4,927,618" in report and "44.8 MFLOPs" in report  # counted on the meta device

    if not SHARED_RETINA.exists():
        return  # the transfer part needs the RetinaMNIST copy of the project machine
    folder = tmp_path / "transfer"
    folder.mkdir()
    # the source protocol sits beside the transfer protocol
    shutil.copy(PROTOCOL, folder / PROTOCOL.name)
    (folder / "from_timm_vit.yaml").write_text(TRANSFER)
    result = CliRunner().invoke(
        main,
        [
            "transfer",
            "--protocol",
            str(folder / "from_timm_vit.yaml"),
            "--allow-dirty",
            "--threads",
            "1",
            "--output-dir",
            str(tmp_path / "tout"),
            "--data-path",
            str(SHARED_RETINA),
        ],
    )
    assert (
        result.exit_code == 0
        and "cells: 3 run, 0 already finished (skipped), 0 failed" in result.output
    ), result.output[-3000:]
    (transfer,) = [e for e in client.search_experiments() if e.name == "from_timm_vit"]
    for run in client.search_runs([transfer.experiment_id]):
        params = run.data.params
        assert params["source.architecture"] == "timm/vit_tiny_patch16_224", params
        assert params["source.mapping"].startswith("32 of 32 source tensors used"), params[
            "source.mapping"
        ]
        assert (
            params["source.pretrained"] == "False"
            and "trained with this workbench" in params["source.provenance"]
        )
        if (
            params.get("regime.kind") == "scratch"
        ):  # the timm ViT's glass-box architecture, from a seeded init
            assert (
                params["regime.pretrained"] == "False" and "NOT PRETRAINED" in params["regime.init"]
            ), params
            assert run.data.metrics["selection_proof_passed"] == 1.0, run.data.metrics

    (folder / "from_resnet10t.yaml").write_text(CNN_TRANSFER)
    result = CliRunner().invoke(
        main,
        [
            "transfer",
            "--protocol",
            str(folder / "from_resnet10t.yaml"),
            "--allow-dirty",
            "--threads",
            "1",
            "--output-dir",
            str(tmp_path / "tout"),
            "--data-path",
            str(SHARED_RETINA),
        ],
    )
    assert (
        result.exit_code == 0
        and "cells: 4 run, 0 already finished (skipped), 0 failed" in result.output
    ), result.output[-3000:]
    assert "28 px images at their own size (the model takes any size)" in result.output, (
        result.output[-3000:]
    )
    import timm

    resnet = timm.create_model("resnet10t", num_classes=5)
    last_group = sum(
        p.numel() for n, p in resnet.named_parameters() if n.startswith(("layer4.", "fc."))
    )
    (cnn,) = [e for e in client.search_experiments() if e.name == "from_resnet10t"]
    kinds = set()
    for run in client.search_runs([cnn.experiment_id], "tags.cell = 'true'"):
        params, m = run.data.params, run.data.metrics
        kinds.add(params["regime.kind"])
        assert run.info.status == "FINISHED" and m["selection_proof_passed"] == 1.0, (
            params["regime.kind"],
            m,
        )
        assert (
            params["source.architecture"] == "timm/resnet10t"
            and params["source.kind"] == "workbench-checkpoint"
        )
        assert params["source.mapping"] == "" and params["source.pretrained"] == "False", params
        assert (
            params["source.norm_from"] == "the source run's normalisation (NORM_STATS['cifar10'])"
        ), params
        expected = {
            "linear": 512 * 5 + 5,
            "partial": last_group,
            "full": sum(p.numel() for p in resnet.parameters()),
        }
        if params["regime.kind"] in expected:
            assert m["trainable_parameters"] == expected[params["regime.kind"]], (
                params["regime.kind"],
                m,
            )
    assert kinds == {"linear", "partial", "full", "scratch"}, kinds
    result = CliRunner().invoke(
        main, ["report", "--protocol", str(folder / "from_resnet10t.yaml"), "--out-dir", str(out)]
    )
    assert result.exit_code == 0, result.output[-3000:]
    report = (out / "from_resnet10t" / "report.md").read_text()
    assert (
        "timm/resnet10t" in report
        and "not a published one" in report
        and "pretrained checkpoint" not in report
    )
