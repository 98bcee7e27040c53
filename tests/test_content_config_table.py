"""reports.content.config_table: rows from the hashed protocol, merged as the loader merges them."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import yaml

from workbench.protocol import kind_of, load_protocol
from workbench.models.registry import build_model, model_config
from workbench.models.vit import ViTConfig
from reports.content.config_table import (
    arm_config,
    config_table,
    description_conflicts,
    flops_text,
)
from workbench.protocol.transfer import parse_transfer_protocol

PROTOCOLS = Path(__file__).resolve().parent.parent / "studies" / "protocols"
# Every shipped ablation protocol (transfer protocols have regimes, intervention protocols a grid instead of arms).
ABLATIONS = sorted(
    p.stem for p in PROTOCOLS.glob("*.yaml") if kind_of(yaml.safe_load(p.read_text())) == "ablation"
)


@pytest.mark.parametrize("name", ABLATIONS)
def test_arm_config_equals_the_loaders_merge(name):
    protocol = load_protocol(PROTOCOLS / f"{name}.yaml")
    for raw, arm in zip(protocol.canonical["arms"], protocol.arms):
        merged = arm_config(protocol.canonical, raw)
        c = arm.config
        assert merged["model"] == {"name": c.model.name, "overrides": c.model.overrides}, arm.name
        assert merged["optim"] == {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(c.optim).items()
        }
        data = {k: v for k, v in dataclasses.asdict(c.data).items() if k != "path"}
        if (
            data["train_subset"] is None
        ):  # hashed only when set (protocols before it keep their hash)
            del data["train_subset"]
        assert merged["dataset"] == data, arm.name
        assert all(merged["run"][k] == getattr(c.run, k) for k in merged["run"]), arm.name


def test_cifar_table_rows_carry_the_real_parameter_counts():
    protocol = load_protocol(PROTOCOLS / "cifar10_ablations.yaml")
    table = config_table(protocol.canonical)
    assert table.kind == "ablation" and [r["arm"] for r in table.rows][:2] == [
        "base (reference)",
        "p4_w96",
    ]
    assert len(table.rows) == len(protocol.arms) and table.notes == []
    for row, arm in zip(table.rows, protocol.arms):
        if arm.name not in (
            "base",
            "p16_w96",
            "pool_mean",
            "heads16",
        ):  # a few independent builds suffice
            continue
        params = sum(
            p.numel()
            for p in build_model(
                model_config(arm.config.model.name, **arm.config.model.overrides)
            ).parameters()
        )
        assert row["parameters"] == f"{params:,}", (arm.name, row["parameters"], params)
    for row in table.rows:
        assert row["FLOPs / image"].endswith("FLOPs") and row["epochs"] == "20"
        assert (
            row["precision"] == "bf16 autocast (GPU, or CPU with AVX512-BF16/AMX)"
            and row["early stopping"] == "none (fixed budget)"
        )
        assert row["schedule"] == "2 warmup epochs, then cosine to 0.01 x lr"
        assert (
            row["optimiser"]
            == "AdamW lr 0.001, weight decay 0.05, label smoothing 0.1, gradient clipping 1"
        )
    common = dict(table.common)
    assert common["split"] == "train 45,000, val 5,000; split seed 42"
    assert common["augmentation (training only)"] == "random crop, 4 px padding, horizontal flip"
    assert common["seeds"] == "0, 1, 2 (3 paired seeds)" and common["test split"] == "not used"


def test_fmnist_table_matches_published_sizes():
    table = config_table(load_protocol(PROTOCOLS / "fmnist_vit_vs_cnn.yaml").canonical)
    by_arm = {r["arm"].split(" ")[0]: r for r in table.rows}
    assert by_arm["vit"]["parameters"] == "105,546" and by_arm["cnn"]["parameters"] == "117,498"
    # FlopCounterMode's count
    assert by_arm["vit"]["FLOPs / image"] == flops_text(11_852_032) == "11.9 MFLOPs"
    assert by_arm["cnn"]["FLOPs / image"] == flops_text(18_517_504)
    assert by_arm["vit"]["early stopping"] == "after 5 epochs without better val_accuracy"
    assert table.notes == [], table.notes


def test_description_that_contradicts_the_hash_is_flagged():
    canonical = copy.deepcopy(load_protocol(PROTOCOLS / "smoke.yaml").canonical)
    canonical["run"]["epochs"] = 2
    canonical["seeds"] = [0, 1, 2]
    canonical["description"] = (
        "A quick check: 3 epochs, two seeds, a 4-epoch budget; sized from a one-epoch "
        "calibration cell."
    )
    problems = description_conflicts(canonical)
    assert any("'two seeds' but the protocol has 3 seeds" in p for p in problems), problems
    assert any("'3 epochs' but no epoch setting of the protocol is 3" in p for p in problems), (
        problems
    )
    assert any(
        "'4-epoch budget' but no epoch setting of the protocol is 4" in p for p in problems
    ), problems
    assert not any("one-epoch" in p for p in problems), (
        "a measurement the description mentions is not a setting"
    )
    assert config_table(canonical).notes[-2:] == problems[-2:]
    for name in ABLATIONS:  # the committed protocols agree with their descriptions
        assert description_conflicts(load_protocol(PROTOCOLS / f"{name}.yaml").canonical) == [], (
            name
        )


def test_a_transfer_description_may_say_how_its_source_was_trained():
    """Epochs and seeds of the source's own training are not the transfer's settings; the
    transfer's own are still checked."""
    data = yaml.safe_load((PROTOCOLS / "retina_transfer.yaml").read_text())
    canonical = copy.deepcopy(parse_transfer_protocol(data).canonical)
    epochs = sorted({r["epochs"] for r in canonical["regimes"]})
    canonical["description"] = (
        "Transfer from a source ViT that was trained for 97 epochs with three seeds on CIFAR-10. "
        f"Each regime trains {epochs[0]} epochs."
    )
    assert description_conflicts(canonical) == [], description_conflicts(canonical)
    canonical["description"] += " Each regime trains 97 epochs."
    (problem,) = description_conflicts(canonical)
    assert "'97 epochs' but no epoch setting of the protocol is 97" in problem, problem


def test_transfer_table_with_trained_parameter_counts():
    data = yaml.safe_load((PROTOCOLS / "retina_transfer.yaml").read_text())
    canonical = parse_transfer_protocol(data).canonical
    # ViT-B/16 defaults
    vit_b = ViTConfig(image_size=224, patch_size=16, in_channels=3, num_classes=5)
    table = config_table(canonical, source_cfg=vit_b)
    assert table.kind == "transfer" and [r["regime"] for r in table.rows] == [
        "linear_probe (reference)",
        "partial_ft",
        "full_ft",
    ]
    trained = [r["trained parameters"] for r in table.rows]
    # 85,802,501 = timm vit_base_patch16_224 with a 5-class head; head = 768 * 5 + 5.
    assert trained[0] == "3,845 of 85,802,501" and trained[2] == "85,802,501 of 85,802,501"
    d, h = 768, 3072
    # qkv, proj, fc1, fc2, 2 norms
    block = (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d) + 2 * (2 * d)
    assert trained[1] == f"{4 * block + 2 * d + 3845:,} of 85,802,501", trained[1]
    assert table.rows[2]["trains"] == "every parameter; layer-wise lr decay 0.75"
    assert (
        dict(table.common)["intervals"] == "95% bootstrap, 2,000 resamples, seed 0"
        and table.notes == []
    )
    assert table.rows[1]["schedule"] == "2 warmup epochs, then cosine to 0"
    assert table.rows[1]["optimiser"] == "AdamW lr 0.0001, weight decay 0.05"
    assert config_table(canonical).rows[0]["trained parameters"] == "n/a"
