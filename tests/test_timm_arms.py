"""timm models as study arms (``model: {name: timm/<architecture>, kwargs}``): validation at load
time, canonical hashing, seeded init, counted FLOPs, data checks, the glass-box check of a trained
timm ViT, a timm ViT arm as a transfer source, and `train --model` / `workbench models`."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.utils.flop_counter import FlopCounterMode

from synthetic import TIMM_ARM, synthetic_data, tiny_config
from workbench.bench.flops import vit_forward_flops, vit_train_flops
from workbench.convert.arm_check import glassbox_check
from workbench.convert.timm_vit import config_from_timm
from workbench.data import derive_seed
from workbench.models.registry import UnknownModel, build_model, model_config
from workbench.models.timm_arm import TimmModelConfig
from workbench.protocol import ProtocolError
from workbench.protocol.ablation import parse_protocol
from workbench.bench.cost import model_cost
from workbench.train.checkpoint import FORMAT, atomic_torch_save
from workbench.train.fits import DataShape, misfits
from workbench.transfer.source_model import load_workbench_checkpoint

VIT_KWARGS = {
    "num_classes": 10,
    "img_size": 32,
    "patch_size": 4,
    "embed_dim": 32,
    "depth": 2,
    "num_heads": 2,
}


def protocol(model: dict, arm_model: dict | None = None) -> dict:
    """A two-arm CIFAR-10 protocol whose second arm switches to ``arm_model`` (or overrides the base)."""
    return {
        "name": "t",
        "description": "d",
        "dataset": {"name": "cifar10", "subset": 200},
        "model": model,
        "run": {"batch_size": 50},
        "arms": [
            {"name": "a", "reference": True},
            {"name": "b", "overrides": {"model": arm_model or {"name": "cifar_cnn"}}},
        ],
        "seeds": [0],
    }


def refusal(data: dict) -> str:
    with pytest.raises(ProtocolError) as err:
        parse_protocol(data, "t.yaml")
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_an_unknown_timm_name_is_one_line_naming_the_key_and_the_listing():
    message = refusal(protocol({"name": "cifar_vit"}, {"name": "timm/resnet1800"}))
    assert (
        message.startswith("t.yaml: arms[1].overrides.model.name='timm/resnet1800': ")
        and "no architecture" in message
    )
    assert "workbench models --timm PATTERN" in message, message


def test_a_keyword_argument_the_model_does_not_take_is_named():
    message = refusal(protocol({"name": "timm/resnet10t", "num_classes": 10, "drop_path": 0.1}))
    assert message.startswith(
        "t.yaml: model.drop_path=0.1: timm resnet10t does not take this keyword argument"
    ), message
    message = refusal(
        protocol({"name": "cifar_vit"}, {"name": "timm/resnet10t", "pretrained": True})
    )
    assert message.startswith(
        "t.yaml: arms[1].overrides.model.pretrained=True: an arm trains from scratch"
    ), message


def test_a_timm_name_without_the_marker_is_told_the_marker():
    message = refusal(protocol({"name": "cifar_vit"}, {"name": "resnet18"}))
    assert "timm has resnet18: write timm/resnet18" in message, message
    with pytest.raises(UnknownModel) as err:  # what `train --model` says
        model_config("vit_base_patch16_224")
    assert "write timm/vit_base_patch16_224" in str(err.value)
    model_config("timm/vit_base_patch16_224")  # ... and the name it suggests is taken


def test_timm_kwargs_hash_canonically_and_arms_override_them():
    base = {"name": "timm/resnet10t", "num_classes": 10, "drop_path_rate": 0.1}
    a = parse_protocol(protocol(base, {"drop_rate": 0.2}), "t.yaml")
    b = parse_protocol(protocol(dict(reversed(list(base.items()))), {"drop_rate": 0.2}), "t.yaml")
    c = parse_protocol(protocol(base | {"drop_path_rate": 0.05}, {"drop_rate": 0.2}), "t.yaml")
    assert a.hash == b.hash != c.hash
    assert a.arms[1].config.model.overrides == {
        "num_classes": 10,
        "drop_path_rate": 0.1,
        "drop_rate": 0.2,
    }
    switched = parse_protocol(protocol({"name": "cifar_vit"}, base), "t.yaml").arms[1].config.model
    assert (switched.name, switched.overrides) == (
        "timm/resnet10t",
        {"num_classes": 10, "drop_path_rate": 0.1},
    )
    assert model_config("timm/resnet10t", num_classes=10) == TimmModelConfig(
        "resnet10t", {"num_classes": 10}
    )


def test_a_timm_arm_is_initialised_from_the_cells_seed():
    cfg = model_config("timm/resnet10t", num_classes=3)

    def init(seed: int) -> dict:
        torch.manual_seed(derive_seed(seed, "init"))  # what Trainer does before it builds the model
        return build_model(cfg).state_dict()

    a, b, c = init(0), init(0), init(1)
    for key, tensor in a.items():
        assert torch.equal(tensor, b[key]), (
            f"{key}: same seed, max |difference| {(tensor - b[key]).abs().max()}"
        )
    differ = [k for k in a if a[k].is_floating_point() and not torch.equal(a[k], c[k])]
    assert "conv1.0.weight" in differ and "fc.weight" in differ, differ


def test_a_timm_cnns_flops_are_counted_by_the_flop_counter():
    cost = model_cost("timm/resnet10t", {"num_classes": 10}, image_size=32)
    model = build_model(model_config("timm/resnet10t", num_classes=10)).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, 3, 32, 32))
    assert cost.forward_flops == counter.get_total_flops() > 0, (
        cost.forward_flops,
        counter.get_total_flops(),
    )
    assert cost.parameters == sum(p.numel() for p in model.parameters())
    # backward: about twice the forward
    assert 2.9 * cost.forward_flops < cost.train_flops < 3 * cost.forward_flops


def test_a_timm_vits_counted_flops_equal_the_analytic_count_of_its_glass_box_config():
    vit = model_cost("timm/vit_tiny_patch16_224", VIT_KWARGS, image_size=32)
    with torch.device("meta"):
        glass_cfg = config_from_timm(
            build_model(model_config("timm/vit_tiny_patch16_224", **VIT_KWARGS))
        )
    assert (vit.forward_flops, vit.train_flops) == (
        vit_forward_flops(glass_cfg)["total"],
        vit_train_flops(glass_cfg),
    )
    with pytest.raises(ValueError, match="takes 32 x 32 px"):
        model_cost("timm/vit_tiny_patch16_224", VIT_KWARGS, image_size=28)


def test_misfits_of_a_timm_arm_use_timms_keyword_names():
    shape = DataShape(tuple(f"c{i}" for i in range(3)), 1, 28, 28, "grey data")
    found = {m.field: m for m in misfits("timm/vit_tiny_patch16_224", VIT_KWARGS, shape)}
    assert set(found) == {"num_classes", "in_chans", "img_size"}, found
    assert found["img_size"].line("model.img_size") == (
        "model.img_size=32: the images are 28 x 28 px, and the model's "
        "patch embedding takes one size only; set img_size: 28"
    )
    assert misfits("timm/resnet10t", {"num_classes": 3, "in_chans": 1}, shape) == []
    # LeViT's attention biases are sized for 224 px and no patch embedding says so: the meta forward finds it.
    (refused,) = misfits(
        "timm/levit_128s", {"num_classes": 3}, replace(shape, channels=3, height=32, width=32)
    )
    assert (
        refused.field == "name"
        and refused.wanted is None
        and "forward on an image of 3 x 32 x 32 fails" in refused.why
    )
    assert refused.line("model.name").startswith("model.name='timm/levit_128s': a forward"), (
        refused.line("model.name")
    )


def test_the_glass_box_check_of_a_timm_vit_is_exact_and_says_nothing_of_a_cnn():
    torch.manual_seed(0)
    vit = build_model(model_config("timm/vit_tiny_patch16_224", **VIT_KWARGS)).train()
    x = torch.randn(4, 3, 32, 32)
    assert glassbox_check(vit, x) == {
        "glassbox_converted": 1.0,
        "glassbox_max_abs_logit_diff": 0.0,
        "glassbox_exact": 1.0,
    }
    # left as it was
    assert vit.training and all(m.fused_attn for m in vit.modules() if hasattr(m, "fused_attn"))
    assert glassbox_check(build_model(model_config("timm/resnet10t", num_classes=10)), x) == {}
    assert glassbox_check(build_model(model_config("cifar_cnn")), x) == {}


def test_a_timm_vit_arm_checkpoint_is_a_transfer_source(tmp_path):
    cfg = replace(tiny_config(), model=TIMM_ARM)
    torch.manual_seed(1)
    timm_model = build_model(model_config(cfg.model.name, **cfg.model.overrides)).eval()
    atomic_torch_save(
        {
            "format": FORMAT,
            "model": timm_model.state_dict(),
            "epoch": 3,
            "metrics": {"val_accuracy": 0.5},
        },
        tmp_path / "checkpoints" / "best.pt",
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    source = load_workbench_checkpoint(tmp_path / "checkpoints" / "best.pt")
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        for m in timm_model.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = False
        diff = (timm_model(x) - source.model.set_fast_attention(False)(x)).abs().max().item()
    assert diff == 0.0, f"max |logit difference| {diff} (the mapping is exact)"
    assert (
        source.info.kind == "workbench-checkpoint"
        and not source.info.pretrained
        and source.info.mapping
    )
    cnn = replace(
        cfg,
        model=replace(
            TIMM_ARM, name="timm/resnet10t", overrides={"num_classes": 10, "in_chans": 1}
        ),
    )
    (tmp_path / "config.json").write_text(json.dumps(cnn.to_dict()))
    atomic_torch_save(
        {
            "format": FORMAT,
            "model": build_model(model_config(cnn.model.name, **cnn.model.overrides)).state_dict(),
        },
        tmp_path / "checkpoints" / "best.pt",
    )
    # kept as timm builds it, no mapping
    cnn_source = load_workbench_checkpoint(tmp_path / "checkpoints" / "best.pt")
    assert (
        not cnn_source.is_vit
        and cnn_source.info.mapping == ""
        and cnn_source.info.architecture == "timm/resnet10t"
    )


def test_train_and_models_commands_name_only_what_they_take():
    from studies.cli import main

    result = CliRunner().invoke(main, ["train", "--model", "vit_base_patch16_224"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = result.output.strip().splitlines()[-1]
    assert "write timm/vit_base_patch16_224" in line and "timm/<name>" in line, result.output
    result = CliRunner().invoke(main, ["train", "--model", "timm/resnet10t", "--set", "bogus=3"])
    assert (
        "Error: --set bogus=3: timm resnet10t does not take this keyword argument" in result.output
    ), result.output
    listed = CliRunner().invoke(main, ["models", "--timm", "resnet1*t"])
    assert listed.exit_code == 0 and "timm/resnet10t" in listed.output.split(), listed.output
    names = [n for n in listed.output.split() if n.startswith("timm/")]
    assert names and all(isinstance(model_config(n), TimmModelConfig) for n in names)


def test_unknown_names_elsewhere_suggest_only_what_is_taken():
    data = protocol({"name": "cifar_vit"}, {"name": "vit_base_patch16_224"})
    message = refusal(copy.deepcopy(data))
    assert "fmnist_vit" in message and "write timm/vit_base_patch16_224" in message, message


@pytest.mark.slow  # trains a timm ViT arm for 2 epochs (a few seconds), then reloads it
def test_a_timm_vit_arm_trains_with_the_reload_proof_and_the_glass_box_check(tmp_path):
    from workbench.train.loop import Trainer

    cfg = replace(tiny_config(epochs=2), model=TIMM_ARM)
    result = Trainer(cfg, synthetic_data(), tmp_path).fit()
    assert result.reload_proof.passed and result.reload_proof.max_abs_prob_diff == 0.0, (
        result.reload_proof.summary()
    )
    final = result.final_metrics
    assert final["glassbox_exact"] == 1.0 and final["glassbox_max_abs_logit_diff"] == 0.0, final


@pytest.mark.slow  # two training subprocesses and a SIGKILL, as test_train's glass-box version
def test_a_timm_arm_killed_mid_epoch_resumes_bit_identically(tmp_path, monkeypatch):
    from test_train import kill_child_mid_epoch, run_child
    from workbench.train.checkpoint import load_checkpoint

    monkeypatch.setenv("WB_TIMM_ARM", "1")  # tests/scripts/train_child.py trains synthetic.TIMM_ARM
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run_child(straight).returncode == 0
    kill_child_mid_epoch(killed)
    assert run_child(killed).returncode == 0
    a, b = (
        load_checkpoint(straight / "checkpoints" / "last.pt"),
        load_checkpoint(killed / "checkpoints" / "last.pt"),
    )
    assert a["finished"] and b["finished"] and a["step"] == b["step"]
    assert set(a["model"]) == set(
        build_model(model_config(TIMM_ARM.name, **TIMM_ARM.overrides)).state_dict()
    )
    for key, tensor in a["model"].items():
        diff = (tensor.double() - b["model"][key].double()).abs().max().item()
        assert torch.equal(tensor, b["model"][key]), (
            f"{key}: max |difference| {diff:.3g} (must be bit-identical)"
        )


def test_jobs_hand_out_the_timm_cnn_first_by_its_counted_training_flops():
    from studies.ablation.cell_order import longest_first
    from workbench.protocol import load_protocol

    smoke = load_protocol(
        Path(__file__).resolve().parent.parent / "studies" / "protocols" / "smoke_timm_arms.yaml"
    )
    order, line = longest_first(smoke, 32)
    cells = smoke.cells()
    # The timm ViT has the glass-box ViT's shape: its counted work equals the analytic count, a tie kept in
    # protocol order (seed-major); timm's resnet10t has 4x the work and goes first.
    assert [cells[i].key for i in order] == [
        "resnet10t/seed0",
        "resnet10t/seed1",
        "vit/seed0",
        "timm_vit/seed0",
        "vit/seed1",
        "timm_vit/seed1",
    ], line
    assert "resnet10t first, timm_vit last" in line, line
