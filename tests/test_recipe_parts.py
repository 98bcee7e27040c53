"""timm's recipe parts (mixup / CutMix, RandAugment, weight EMA): off by default and bit-identical then,
validated and hashed as protocol keys, deterministic and resumable when on."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from synthetic import synthetic_data, tiny_config
from workbench.data import AugmentConfig, TensorLoader
from workbench.data.augment import apply_randaugment, randaugment, sample_randaugment
from workbench.protocol import ProtocolError
from workbench.protocol.ablation import parse_protocol
from workbench.train.checkpoint import load_checkpoint
from workbench.train.config import RecipeConfig
from workbench.train.evaluate import predict, read_predictions
from workbench.train.loop import StopTraining, Trainer, TrainingObserver, config_hash

# config_hash(tiny_config(epochs=1)) computed with main's code before the recipe existed (fab295d):
# a config without recipe parts keeps its hash, so its run key and checkpoints stay valid.
MAIN_TINY_CONFIG_HASH = "5e8153d290fd646dbc48660991d456e0a1ba34e5faf41da4018dad883411c82b"


def small_data():
    return synthetic_data(n_train=64, n_val=32, n_test=8)


def cfg_with(recipe: RecipeConfig | None = None, epochs: int = 1, **run):
    cfg = tiny_config(epochs=epochs, **run)
    return cfg if recipe is None else replace(cfg, recipe=recipe)


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b), f"{what}: different keys"
    for key in a:
        diff = (a[key].double() - b[key].double()).abs().max().item() if a[key].numel() else 0.0
        assert torch.equal(a[key], b[key]), (
            f"{what} {key}: max |difference| {diff:.3g} (must be bit-identical)"
        )


# ---- off: the config, the hash and the training are what they were ---------------------------


def test_a_config_without_parts_has_the_dict_and_hash_it_had_before_the_recipe():
    cfg = tiny_config(epochs=1)
    assert "recipe" not in cfg.to_dict()
    assert config_hash(cfg) == MAIN_TINY_CONFIG_HASH, (
        "the config hash of a config without recipe parts changed"
    )
    on = cfg_with(RecipeConfig(ema_decay=0.9))
    assert on.to_dict()["recipe"] == {"ema_decay": 0.9}
    assert config_hash(on) != MAIN_TINY_CONFIG_HASH


@pytest.mark.slow  # trains (a few steps of a tiny ViT, more than 2 s on a loaded 2-core machine)
def test_parts_written_at_their_off_values_train_bit_identically_to_a_config_that_never_names_them(
    tmp_path,
):
    data = small_data()
    written = RecipeConfig(mixup_alpha=0.0, cutmix_alpha=0.0, randaugment_ops=0, ema_decay=None)
    # One trainer at a time, as a cell runs: a Trainer seeds the global RNG that dropout then draws from.
    a = Trainer(cfg_with(epochs=1), data, tmp_path / "a")
    assert a.mixup is None and a.ema is None and a.train_loader.augment.randaugment_ops == 0
    a.fit()
    b = Trainer(cfg_with(written, epochs=1), data, tmp_path / "b")
    b.fit()
    assert_same_tensors(a.model.state_dict(), b.model.state_dict(), "weights")
    pa, pb = (read_predictions(t.run_dir / "predictions" / "val.csv") for t in (a, b))
    assert pa.equals(pb), "validation predictions differ"
    assert "ema" not in load_checkpoint(a.last_path), (
        "a checkpoint without EMA gained an 'ema' entry"
    )


# ---- protocol keys ------------------------------------------------------------------------------


def protocol(recipe=None, arms=None, batch_size=32):
    content = {
        "name": "t",
        "description": "d",
        "dataset": {"name": "fashion_mnist", "train_size": 64, "val_size": 32},
        "model": {"name": "fmnist_vit"},
        "run": {"batch_size": batch_size},
        "arms": arms or [{"name": "a", "reference": True}],
        "seeds": [0],
    }
    if recipe is not None:
        content["recipe"] = recipe
    return parse_protocol(content, "t.yaml")


def test_recipe_keys_are_hashed_only_when_a_part_is_on():
    bare = protocol()
    assert "recipe" not in bare.canonical
    assert protocol({"mixup_alpha": 0.0, "ema_decay": None, "randaugment_ops": 0}).hash == bare.hash
    on = protocol({"mixup_alpha": 0.8})
    assert on.canonical["recipe"] == {"mixup_alpha": 0.8} and on.hash != bare.hash
    assert on.cells()[0].config.recipe.mixup_alpha == 0.8
    arms = [
        {"name": "bare", "reference": True},
        {"name": "ema", "overrides": {"recipe": {"ema_decay": 0.99}}},
        {"name": "dp", "overrides": {"model": {"drop_path_rate": 0.1}}},
    ]
    p = protocol(arms=arms)
    configs = {c.arm: c.config for c in p.cells()}
    assert configs["ema"].recipe.ema_decay == 0.99 and configs["bare"].recipe == RecipeConfig()
    assert configs["dp"].model.overrides == {"drop_path_rate": 0.1}


@pytest.mark.parametrize(
    "recipe, batch, message",
    [
        (
            {"mixup_alpah": 0.8},
            32,
            r"t.yaml: unknown key 'recipe.mixup_alpah'; valid keys here: mixup_alpha",
        ),
        (
            {"mixup_prob": 0.0},
            32,
            r"t.yaml: bad value in 'recipe': recipe.mixup_prob=0.0: must be in \(0, 1\]",
        ),
        ({"ema_decay": 1.5}, 32, r"t.yaml: bad value in 'recipe': recipe.ema_decay=1.5"),
        ({"randaugment_ops": 2.5}, 32, r"t.yaml: recipe.randaugment_ops=2.5: expected int"),
        (
            {"mixup_mode": "image"},
            32,
            r"t.yaml: recipe.mixup_mode='image': expected 'batch' or 'pair' or 'elem'",
        ),
        (
            {"cutmix_alpha": 1.0},
            31,
            r"t.yaml: run.batch_size=31: mixup and CutMix .* need an even batch size",
        ),
    ],
)
def test_bad_recipe_values_are_refused_naming_file_and_key(recipe, batch, message):
    with pytest.raises(ProtocolError, match=message):
        protocol(recipe, batch_size=batch)


def test_stochastic_depth_on_the_cnn_is_refused_by_key():
    arms = [
        {"name": "a", "reference": True},
        {"name": "cnn", "overrides": {"model": {"name": "fmnist_cnn", "drop_path_rate": 0.1}}},
    ]
    with pytest.raises(
        ProtocolError, match=r"unknown key 'arms\[1\].overrides.model.drop_path_rate'"
    ):
        protocol(arms=arms)


# ---- mixup / CutMix -----------------------------------------------------------------------------


@pytest.mark.slow  # trains (a few steps of a tiny ViT, more than 2 s on a loaded 2-core machine)
def test_mixup_and_cutmix_train_on_soft_targets_deterministically(tmp_path):
    data = small_data()
    recipe = RecipeConfig(mixup_alpha=0.8, cutmix_alpha=1.0, mixup_mode="elem")
    runs, results = [], []
    for name in ("a", "b"):  # one at a time, as cells run
        runs.append(Trainer(cfg_with(recipe), data, tmp_path / name))
        results.append(runs[-1].fit())
    assert len(runs[0].train_loader) == 64 // 32 and runs[0].train_loader.drop_last
    assert_same_tensors(runs[0].model.state_dict(), runs[1].model.state_dict(), "mixup runs")
    plain = Trainer(cfg_with(), data, tmp_path / "plain")
    h_mix, h_plain = results[0].history[0], plain.fit().history[0]
    assert h_mix["train_loss"] != h_plain["train_loss"], "mixup changed nothing"
    assert 0.0 <= h_mix["train_accuracy"] <= 1.0


def test_mixed_batch_targets_are_timms_and_the_batch_is_restored_rng_neutral():
    import numpy as np

    trainer = Trainer(
        cfg_with(RecipeConfig(mixup_alpha=1.0, cutmix_alpha=0.0)),
        small_data(),
        "/nonexistent-unused",
    )
    images, labels, _ = next(trainer.train_loader.iter_epoch(0))
    before = np.random.get_state()[1].copy()
    x1, t1 = trainer._mix(images.clone(), labels, 0, 0)
    x2, t2 = trainer._mix(images.clone(), labels, 0, 0)
    assert torch.equal(x1, x2) and torch.equal(t1, t2), "the same batch mixed twice differs"
    assert (np.random.get_state()[1] == before).all(), "mixing moved NumPy's global RNG"
    assert torch.allclose(t1.sum(-1), torch.ones(len(labels))), "soft targets do not sum to 1"
    n = len(labels)
    i = next(k for k in range(n) if labels[k] != labels[n - 1 - k])  # a pair of two classes
    lam = t1[i, labels[i]].item()  # batch mode: image i is lam * image i + (1 - lam) * image B-1-i
    expected = images[i] * lam + images[n - 1 - i] * (1 - lam)
    diff = (x1[i] - expected).abs().max().item()
    assert 0.0 < lam < 1.0 and diff < 1e-5, (
        f"lam {lam}; mixed image differs from the lam-weighted pair by {diff}"
    )


# ---- weight EMA ---------------------------------------------------------------------------------


class StopAtStep(TrainingObserver):
    def __init__(self, step: int) -> None:
        self.calls, self.step = 0, step

    def check(self, sync: bool = False) -> None:
        if not sync:
            self.calls += 1
            if self.calls == self.step:
                raise StopTraining("test interrupt")


@pytest.mark.slow  # trains (a few steps of a tiny ViT, more than 2 s on a loaded 2-core machine)
def test_ema_resumed_mid_epoch_equals_an_uninterrupted_run_bitwise(tmp_path):
    data = small_data()
    cfg = cfg_with(RecipeConfig(ema_decay=0.9), epochs=2, checkpoint_every_steps=1)
    straight = Trainer(cfg, data, tmp_path / "straight")
    straight.fit()
    with pytest.raises(StopTraining):
        Trainer(
            cfg, data, tmp_path / "cut", observer=StopAtStep(4)
        ).fit()  # stopped in epoch 2, batch 2
    state = load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.pt")
    assert (state["epoch"], state["batch"]) == (1, 1) and "ema" in state
    resumed = Trainer(cfg, data, tmp_path / "cut")
    resumed.fit()
    a, b = load_checkpoint(straight.last_path), load_checkpoint(resumed.last_path)
    assert_same_tensors(a["ema"], b["ema"], "EMA weights")
    assert_same_tensors(a["model"], b["model"], "raw weights")
    best_a, best_b = load_checkpoint(straight.best_path), load_checkpoint(resumed.best_path)
    assert_same_tensors(best_a["model"], best_b["model"], "best (EMA) weights")


@pytest.mark.slow  # trains (a few steps of a tiny ViT, more than 2 s on a loaded 2-core machine)
def test_with_ema_the_ema_model_is_evaluated_selected_saved_and_reload_proven(tmp_path):
    data = small_data()
    # one epoch: it is the best
    trainer = Trainer(cfg_with(RecipeConfig(ema_decay=0.5), epochs=1), data, tmp_path)
    result = trainer.fit()
    assert {"raw_val_loss", "raw_val_accuracy"} <= set(result.history[0])
    best = load_checkpoint(trainer.best_path)
    assert_same_tensors(
        best["model"], trainer.ema.module.state_dict(), "best.pt vs the EMA weights"
    )
    raw = trainer.model.state_dict()
    assert any(not torch.equal(raw[k], best["model"][k]) for k in raw), (
        "best.pt holds the raw weights"
    )
    saved = read_predictions(trainer.run_dir / "predictions" / "val.csv")
    ema_now = predict(trainer.ema.module, trainer.eval_loaders["val"], trainer.device)
    diff = (saved["loss"] - ema_now["loss"]).abs().max()
    assert diff == 0.0, (
        f"saved validation predictions are not the EMA model's (max loss difference {diff})"
    )
    assert result.reload_proof.passed and result.reload_proof.max_abs_prob_diff == 0.0, (
        result.reload_proof.summary()
    )
    assert result.history[0]["val_loss"] != result.history[0]["raw_val_loss"], (
        "raw and EMA numbers are the same"
    )


def test_ema_is_timms_model_ema_v3_and_copies_the_model_at_the_first_update():
    from timm.utils import ModelEmaV3

    trainer = Trainer(cfg_with(RecipeConfig(ema_decay=0.9)), small_data(), "/nonexistent-unused")
    assert isinstance(trainer.ema, ModelEmaV3) and trainer.evaluated_model is trainer.ema.module
    model = copy.deepcopy(trainer.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    trainer.ema.update(model, step=1)  # timm: decay 0 at the first step, the EMA is the model
    assert_same_tensors(trainer.ema.module.state_dict(), model.state_dict(), "EMA after step 1")


# ---- RandAugment --------------------------------------------------------------------------------


def test_randaugment_in_groups_equals_each_image_alone():
    cfg = AugmentConfig(randaugment_ops=2, randaugment_magnitude=9)
    x = torch.randint(
        0, 256, (32, 3, 12, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    drawn = sample_randaugment(cfg, len(x), torch.Generator().manual_seed(1))
    assert len({tuple(drawn["ops"][:, i].tolist()) for i in range(len(x))}) > 10, (
        "images share one op set"
    )
    out = apply_randaugment(x, cfg, drawn)
    ra = randaugment(2, 9)
    names = list(ra._AUGMENTATION_SPACE)
    for i in range(len(x)):
        image = x[i : i + 1]
        for step in range(2):
            name = names[int(drawn["ops"][step, i])]
            magnitudes_fn, signed = ra._AUGMENTATION_SPACE[name]
            magnitudes = magnitudes_fn(ra.num_magnitude_bins, 12, 12)
            m = 0.0 if magnitudes is None else float(magnitudes[9])
            if signed and magnitudes is not None and drawn["negate"][step, i]:
                m = -m
            image = ra._apply_image_or_video_transform(
                image, name, m, interpolation=ra.interpolation, fill=ra._fill
            )
        diff = (image[0].int() - out[i].int()).abs().max().item()
        assert diff == 0, f"image {i}: grouped RandAugment differs from the image alone by {diff}"


def test_randaugment_batches_are_seeded_and_resume_mid_epoch():
    data = synthetic_data(n_train=32, n_val=8, n_test=8)
    kwargs = dict(batch_size=8, norm=data.norm, seed=3, device="cpu")
    on = TensorLoader.from_split(
        data.train, augment=AugmentConfig(hflip=True, randaugment_ops=2), **kwargs
    )
    off = TensorLoader.from_split(data.train, augment=AugmentConfig(hflip=True), **kwargs)
    full = [b.images for b in on.iter_epoch(1)]
    tail = [b.images for b in on.iter_epoch(1, start_batch=2)]
    assert all(torch.equal(a, b) for a, b in zip(full[2:], tail)), "a resumed epoch differs"
    assert all(torch.equal(a, b) for a, b in zip(full, [b.images for b in on.iter_epoch(1)])), (
        "not repeatable"
    )
    plain = [b.images for b in off.iter_epoch(1)]
    assert not torch.equal(full[0], plain[0]), "RandAugment changed nothing"


def test_the_configuration_table_shows_recipe_parts_only_where_an_arm_uses_one():
    from reports.content.config_table import ARM_COLUMNS, config_table

    assert config_table(protocol().canonical).columns == ARM_COLUMNS, (
        "a protocol without recipe parts renders anew"
    )
    arms = [
        {"name": "bare", "reference": True},
        {
            "name": "full",
            "overrides": {
                "model": {"drop_path_rate": 0.1},
                "recipe": {
                    "mixup_alpha": 0.8,
                    "cutmix_alpha": 1.0,
                    "randaugment_ops": 2,
                    "ema_decay": 0.999,
                },
            },
        },
    ]
    table = config_table(protocol(arms=arms).canonical)
    assert table.columns == ARM_COLUMNS + ("recipe",)
    bare, full = table.rows
    assert bare["recipe"] == "none"
    assert full["recipe"] == (
        "mixup alpha 0.8 + CutMix alpha 1 (mode batch, CutMix share 0.5; soft-target loss); "
        "RandAugment 2 ops, magnitude 9; weight EMA decay 0.999 (the EMA model is evaluated "
        "and reported)"
    ), full["recipe"]
    assert "drop_path_rate 0.1" in full["model"], full["model"]


def test_train_recipe_option_builds_the_recipe_section():
    from studies.ablation.train import parse_recipe
    from workbench.train.config import RecipeConfig

    got = parse_recipe(
        (
            "mixup_alpha=0.8",
            "cutmix_alpha=1.0",
            "randaugment_ops=2",
            "ema_decay=0.999",
            "ema_warmup=true",
        )
    )
    assert got == RecipeConfig(
        mixup_alpha=0.8, cutmix_alpha=1.0, randaugment_ops=2, ema_decay=0.999, ema_warmup=True
    ), got
    assert parse_recipe(()) == RecipeConfig() and parse_recipe(()).changed() == {}
