"""Data-size arms: nested class-stratified training subsets with full-size epochs (issue [AE] 53)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from synthetic import synthetic_data, tiny_config
from workbench.data import NormStats, TensorLoader
from workbench.data.splits import nested_stratified_order, nested_subset
from workbench.protocol import ProtocolError, load_protocol
from workbench.train.loop import Trainer, config_hash

SIZES = (2500, 5000, 10000, 20000, 45000)  # the data-size study's subsets of CIFAR-10's 45,000


def _cifar_like_labels(seed: int = 3) -> np.ndarray:
    """45,000 labels, 4,500 per class, in a shuffled order (as a stratified split leaves them)."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(10), 4500))


def test_the_study_sizes_are_nested_and_exactly_stratified():
    labels = _cifar_like_labels()
    subsets = [nested_subset(labels, n, seed=42) for n in SIZES]
    for n, idx in zip(SIZES, subsets):
        counts = np.bincount(labels[idx], minlength=10)
        assert len(np.unique(idx)) == n and (counts == n // 10).all(), (n, counts)
    for small, large in zip(subsets, subsets[1:]):
        missing = np.setdiff1d(small, large)
        assert missing.size == 0, f"{len(missing)} images of the smaller subset not in the larger"


def test_every_prefix_of_uneven_classes_holds_each_share_rounded_down_or_up():
    labels = np.random.default_rng(0).choice(7, size=2000, p=[0.4, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05])
    per_class = np.bincount(labels, minlength=7)
    order = nested_stratified_order(labels, seed=1)
    assert sorted(order.tolist()) == list(range(len(labels)))
    taken = np.cumsum(np.eye(7, dtype=np.int64)[labels[order]], axis=0)  # (prefix, class)
    share = np.arange(1, len(labels) + 1)[:, None] * per_class / len(labels)
    off = np.maximum(np.floor(share + 1e-9) - taken, taken - np.ceil(share - 1e-9))
    assert off.max() <= 0, f"a prefix is {off.max():.0f} image(s) outside a class's rounded share"
    within = [labels[order[labels[order] == c]] for c in range(7)]  # class order: seeded
    assert all((w == c).all() for c, w in enumerate(within))


def test_the_largest_remainder_rule_per_size_breaks_the_nesting_the_order_keeps():
    """The control: Hamilton's rule per size (``allocate``) can take an image from a class as
    the total grows (the Alabama paradox); the quota order never does."""
    from workbench.data.splits import allocate

    counts = np.array([5, 5, 1])  # an Alabama-paradox instance: 5 -> 6 images takes class 2's one
    hamilton = [allocate(counts, n) for n in (5, 6)]
    assert (hamilton[1] < hamilton[0]).any(), hamilton
    labels = np.repeat(np.arange(3), counts)
    order = nested_stratified_order(labels, seed=0)
    for n in range(1, len(labels)):
        assert set(order[:n]) <= set(order[: n + 1])


def test_the_order_is_seeded_and_depends_on_nothing_else():
    labels = _cifar_like_labels()
    a, b = nested_subset(labels, 5000, 42), nested_subset(labels, 5000, 42)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, nested_subset(labels, 5000, 7))
    with pytest.raises(ValueError, match="45001"):
        nested_subset(labels, 45001, 42)


def _loader(n=100, epoch_size=None, seed=0):
    images = torch.randint(
        0, 256, (n, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    labels = torch.arange(n) % 10
    return TensorLoader(
        images,
        labels,
        torch.arange(500, 500 + n),
        batch_size=32,
        norm=NormStats((0.5,), (0.25,)),
        seed=seed,
        device="cpu",
        epoch_size=epoch_size,
    )


def test_an_epoch_of_a_subset_is_whole_shuffled_passes_cut_at_the_epoch_size():
    loader = _loader(n=100, epoch_size=450)
    order = loader.order(3)
    assert len(order) == 450 and len(loader) == -(-450 // 32)
    for k in range(4):  # four whole passes, each every image once, each its own shuffle
        assert sorted(order[100 * k : 100 * (k + 1)].tolist()) == list(range(100))
    assert not torch.equal(order[:100], order[100:200])
    assert len(set(order[400:].tolist())) == 50  # the cut pass: 50 distinct images
    assert torch.equal(order, _loader(n=100, epoch_size=450).order(3))
    assert not torch.equal(order, loader.order(4))
    seen = torch.cat([b.indices for b in loader.iter_epoch(3)])
    assert torch.equal(seen, order + 500)
    resumed = torch.cat([b.indices for b in loader.iter_epoch(3, start_batch=5)])
    assert torch.equal(resumed, seen[5 * 32 :])


def test_without_an_epoch_size_the_order_is_the_one_every_stored_cell_trained_with():
    plain = _loader(n=100).order(2)
    expected = torch.randperm(100, generator=_torch_generator(0, 2))
    assert torch.equal(plain, expected)


def _torch_generator(seed, epoch):
    from workbench.data.batches import derive_seed

    return torch.Generator().manual_seed(derive_seed(seed, epoch, "order"))


def test_a_trainer_with_a_train_subset_trains_on_it_with_full_size_epochs(tmp_path):
    data = synthetic_data(n_train=320, n_val=80)
    cfg = tiny_config(epochs=1)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_subset=80))
    trainer = Trainer(cfg, data, tmp_path)
    full = Trainer(tiny_config(epochs=1), data, tmp_path / "full")
    assert len(trainer.train_loader) == len(full.train_loader) == 10
    seen = torch.cat([b.indices for b in trainer.train_loader.iter_epoch(0)])
    expected = data.train.indices[nested_subset(data.train.labels.numpy(), 80, cfg.data.split_seed)]
    assert len(seen) == 320 and set(seen.tolist()) == set(expected.tolist())
    got = np.bincount(data.train.labels[torch.isin(data.train.indices, seen)], minlength=10)
    share = 80 * np.bincount(data.train.labels, minlength=10) / 320
    assert ((np.floor(share) <= got) & (got <= np.ceil(share))).all(), (got, share)
    assert config_hash(cfg) != config_hash(tiny_config(epochs=1))
    too_many = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_subset=321))
    with pytest.raises(ValueError, match="train_subset=321.*320"):
        Trainer(too_many, data, tmp_path / "too_many")


def test_a_config_without_the_key_keeps_its_dict_and_hash():
    cfg = tiny_config()
    assert "train_subset" not in cfg.to_dict()["data"]


ROOT = Path(__file__).resolve().parent.parent
SEED_TABLE = ROOT / "studies" / "protocols" / "cifar10_seed_table.yaml"


def _protocol_with(tmp_path, arms, **dataset):
    raw = yaml.safe_load(SEED_TABLE.read_text())
    raw["name"] = "size_test"
    raw["dataset"].update(dataset)
    raw["arms"] = arms
    path = tmp_path / "size_test.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_arms_may_train_on_different_subsets_and_a_too_large_one_is_named(tmp_path):
    arms = [
        {"name": "n45k", "reference": True},
        {"name": "n2500", "overrides": {"dataset": {"train_subset": 2500}}},
    ]
    p = load_protocol(_protocol_with(tmp_path, arms))
    assert [a.config.data.train_subset for a in p.arms] == [None, 2500]
    assert p.arms[1].config.data.val_size == p.arms[0].config.data.val_size
    arms[1]["overrides"]["dataset"]["train_subset"] = 45001
    with pytest.raises(
        ProtocolError, match=r"arms\[1\]\.overrides\.dataset\.train_subset=45001.*45000"
    ):
        load_protocol(_protocol_with(tmp_path, arms))
    arms[1]["overrides"]["dataset"] = {"train_size": 2500}  # the split itself stays refused
    with pytest.raises(ProtocolError, match="may not change the split"):
        load_protocol(_protocol_with(tmp_path, arms))
