"""Any model as a transfer source (workbench.transfer.any_model): a timm ResNet cell, timm by name, the study CNN.

Default tier: a ResNet-10-T reduced to 80k parameters on a 28 px RetinaMNIST-format file of
a few dozen images, one epoch per regime.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import assert_close
from test_transfer import learnable_retina, regime
from workbench.data import NORM_STATS, prepare
from workbench.models.registry import build_model, model_config
from workbench.protocol import parse_transfer_protocol
from workbench.train.checkpoint import FORMAT, atomic_torch_save, load_checkpoint
from workbench.transfer.any_model import (
    RegimeRefused,
    check_regimes,
    classifier,
    compute_pooled,
    freeze_for,
    param_groups_any,
    pooled_features,
    transfer_copy,
)
from workbench.transfer.runner import TransferContext, select_cell, split_off_test
from workbench.transfer.source_model import SourceError, load_timm_source, load_workbench_checkpoint

# timm/resnet10t, 80k parameters
ARM = {
    "num_classes": 10,
    "channels": [8, 16, 32, 64],
    "stem_width": 8,
}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def resnet_cell(folder: Path, name: str = "timm/resnet10t", overrides: dict = ARM) -> Path:
    """A trained cell's checkpoint and config.json, as a timm arm of an ablation writes them."""
    torch.manual_seed(0)
    model = build_model(model_config(name, **overrides))
    path = folder / "checkpoints" / "best.pt"
    atomic_torch_save(
        {
            "format": FORMAT,
            "model": model.state_dict(),
            "epoch": 2,
            "metrics": {"val_accuracy": 0.4},
        },
        path,
    )
    (folder / "config.json").write_text(
        json.dumps({"model": {"name": name, "overrides": overrides}, "data": {"name": "cifar10"}})
    )
    return path


def tiny_protocol(*regimes):
    return parse_transfer_protocol(
        {
            "name": "tiny_any",
            "description": "tiny",
            "source": {"weights": "runs:/abc"},
            "dataset": {"name": "retinamnist"},
            "run": {"batch_size": 16, "eval_batch_size": 64},
            "evaluation": {"n_resamples": 1000},
            "regimes": list(regimes),
            "seeds": [0],
        }
    )


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    learnable_retina(tmp_path / "retinamnist.npz", counts=(32, 16, 16))
    data = prepare("retinamnist", path=tmp_path / "retinamnist.npz", verify=False)
    source = load_workbench_checkpoint(resnet_cell(tmp_path / "source"))
    ctx = TransferContext(torch.device("cpu"), None, 16, 64, source.norm, source.image_size, 5)
    selection_data, _ = split_off_test(data, source.in_channels)
    return tmp_path, source, ctx, selection_data


def test_a_timm_resnet_cell_is_a_source_with_features_of_its_width(setup):
    _, source, ctx, data = setup
    info = source.info
    assert not source.is_vit and source.image_size is None and ctx.resize_to is None, (
        "a CNN keeps the data's size"
    )
    assert (info.kind, info.architecture, info.pretrained, info.mapping) == (
        "workbench-checkpoint",
        "timm/resnet10t",
        False,
        "",
    )
    assert source.norm == NORM_STATS["cifar10"] and "not a published one" in info.label()
    x = torch.randn(3, 3, 28, 28)
    with torch.no_grad():
        feats = pooled_features(source.model, x)
        assert feats.shape == (3, source.model.num_features) == (3, 64), feats.shape
        assert_close(
            classifier(source.model)(feats),
            source.model(x),
            1e-6,
            "head(pre-logit features) vs forward",
        )
    cache = compute_pooled(source.model, {"train": data.train}, ctx.norm, None, ctx.device, 64)
    assert cache.pooled["train"].inputs.shape == (len(data.train), 64)


@pytest.mark.parametrize("kind", ["linear", "full", "scratch"])
def test_linear_full_and_scratch_train_and_resume(setup, kind):
    tmp_path, source, ctx, data = setup
    extra = {"layer_decay": 0.75} if kind == "full" else {}
    cell = tiny_protocol(regime(kind, reference=True, epochs=1, **extra)).cells()[0]
    cache = compute_pooled(
        source.model, {"train": data.train, "val": data.val}, ctx.norm, None, ctx.device, 64
    )
    before = {k: v.clone() for k, v in source.model.state_dict().items()}
    selection = select_cell(
        cell, source, data, cache if kind == "linear" else None, ctx, tmp_path / kind
    )
    assert selection.proof["passed"], selection.proof
    trained = load_checkpoint(selection.checkpoint)["model"]
    moved = {
        k for k in before if not k.startswith("fc.") and not torch.equal(before[k], trained[k])
    }
    if kind == "linear":
        # the frozen body is the source's
        assert selection.trainable_parameters == 64 * 5 + 5 and not moved, moved
    else:
        assert "layer1.0.conv1.weight" in moved and "conv1.0.weight" in moved, sorted(moved)[:5]
        # resumes the Trainer's finished state
        again = select_cell(cell, source, data, None, ctx, tmp_path / kind)
        assert (again.best_epoch, again.best_val, again.history) == (
            selection.best_epoch,
            selection.best_val,
            selection.history,
        )
    assert all(torch.equal(v, source.model.state_dict()[k]) for k, v in before.items()), (
        "the source is not modified"
    )


def test_partial_on_a_cnn_trains_exactly_its_last_groups(setup):
    tmp_path, source, ctx, data = setup
    for blocks, stages in ((1, ("layer4.",)), (2, ("layer3.", "layer4."))):
        model = transfer_copy(source.model, 5, 0)
        protocol = tiny_protocol(regime("partial", reference=True, blocks=blocks, epochs=1))
        freeze_for(model, protocol.regimes[0], "k")
        for name, p in model.named_parameters():
            assert p.requires_grad == name.startswith(stages + ("fc.",)), (
                blocks,
                name,
                p.requires_grad,
            )
    cell = protocol.cells()[0]
    selection = select_cell(cell, source, data, None, ctx, tmp_path / "partial")
    assert selection.proof["passed"], selection.proof
    trained, before = load_checkpoint(selection.checkpoint)["model"], source.model.state_dict()
    frozen = [k for k in before if not k.startswith(("layer3.", "layer4.", "fc."))]
    changed = [k for k in frozen if not torch.equal(before[k], trained[k])]
    assert not changed, f"frozen tensors (batch-norm statistics included) changed: {changed[:4]}"
    assert not torch.equal(before["layer4.0.conv1.weight"], trained["layer4.0.conv1.weight"])


def test_layer_decay_follows_timms_groups_and_refusals_name_the_key(setup):
    tmp_path, source, _, _ = setup
    model = transfer_copy(source.model, 5, 0)
    groups = param_groups_any(model, 1e-3, 0.05, 0.5, "k")
    scales = sorted({g["lr_scale"] for g in groups}, reverse=True)
    # stem, 4 stages, head: 6 timm groups
    assert scales == [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125], scales
    assert groups[0]["lr"] == 1e-3 and all(
        g["lr"] == pytest.approx(1e-3 * g["lr_scale"]) for g in groups
    )
    with pytest.raises(
        RegimeRefused,
        match=r"^p.yaml: regimes\[0\].blocks=6: ResNet has 5 groups .* give at most 5$",
    ):
        check_regimes(
            model, tiny_protocol(regime("partial", reference=True, blocks=6)).regimes, "p.yaml"
        )
    cnn = load_workbench_checkpoint(
        resnet_cell(tmp_path / "cnn", "cifar_cnn", {"num_classes": 10, "in_channels": 3})
    )
    assert not cnn.is_vit and cnn.info.architecture == "cifar_cnn"
    with pytest.raises(
        RegimeRefused, match=r"^p.yaml: regimes\[1\].blocks: CNN has no timm group_matcher"
    ):
        check_regimes(
            cnn.model,
            tiny_protocol(regime("linear", reference=True), regime("partial", blocks=1)).regimes,
            "p.yaml",
        )
    with pytest.raises(RegimeRefused, match=r"^p.yaml: regimes\[0\].layer_decay: CNN has no"):
        check_regimes(
            cnn.model,
            tiny_protocol(regime("full", reference=True, layer_decay=0.8)).regimes,
            "p.yaml",
        )
    head = transfer_copy(cnn.model, 5, 0)
    assert head.head.out_features == 5 and head.cfg.num_classes == 5


def test_a_timm_cnn_by_name_is_a_source_labelled_by_what_it_is():
    source = load_timm_source("resnet10t", "random", seed=3)
    info = source.info
    assert not source.is_vit and (info.kind, info.pretrained, info.sha256) == (
        "timm-random",
        False,
        "",
    )
    assert "NOT PRETRAINED" in info.label() and "pretrained_cfg" in info.norm_from
    assert source.norm.mean == pytest.approx((0.485, 0.456, 0.406))
    with pytest.raises(SourceError, match="only the pinned ViT checkpoints"):
        load_timm_source("resnet10t", "hub")
    with pytest.raises(SourceError, match="source.model='no_such_net'"):
        load_timm_source("no_such_net", "random")


def test_partial_from_the_study_cnn_is_one_line_before_any_run(mlflow_store, tmp_path, monkeypatch):
    import yaml
    from click.testing import CliRunner
    from mlflow.tracking import MlflowClient

    from studies.cli import main

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    learnable_retina(tmp_path / "retinamnist.npz", counts=(32, 16, 16))
    checkpoint = resnet_cell(tmp_path / "cnn", "cifar_cnn", {"num_classes": 10, "in_channels": 3})
    data = {
        "name": "cnn_partial",
        "description": "tiny",
        "source": {"weights": str(checkpoint)},
        "dataset": {"name": "retinamnist"},
        "run": {"batch_size": 16},
        "evaluation": {"n_resamples": 1000},
        "regimes": [regime("linear", reference=True), regime("partial", blocks=1)],
        "seeds": [0],
    }
    path = tmp_path / "cnn_partial.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(
        main,
        [
            "transfer",
            "--protocol",
            str(path),
            "--allow-dirty",
            "--device",
            "cpu",
            "--data-path",
            str(tmp_path / "retinamnist.npz"),
            "--output-dir",
            str(tmp_path / "out"),
        ],
    )
    line = result.output.strip().splitlines()[-1]
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output[-2000:]
    assert line == (
        f"Error: {path}: regimes[1].blocks: CNN has no timm group_matcher(), so its layers cannot be "
        "grouped; use kind linear, full (without layer_decay) or scratch"
    ), line
    assert not [
        r
        for e in MlflowClient().search_experiments()
        for r in MlflowClient().search_runs([e.experiment_id])
    ]
