"""Stratified, deterministic splits; prepare(); fingerprints."""

from __future__ import annotations

import numpy as np
import pytest
from data_fixtures import (
    make_fashion_mnist,
    make_image_folder,
    make_retinamnist,
    trust_fashion_mnist,
)

from workbench.data import make_split, prepare, split_fingerprint, stratified_subset
from workbench.data.splits import allocate

LABELS = np.repeat(np.arange(10), 600)  # 6,000 images, 600 per class, like a 1/10 Fashion-MNIST
np.random.default_rng(0).shuffle(LABELS)


def test_allocate_largest_remainder():
    assert allocate(np.array([600] * 10), 3200).tolist() == [320] * 10
    assert allocate(np.array([5, 3, 2]), 5).tolist() == [3, 1, 1]  # quotas 2.5, 1.5, 1.0
    assert allocate(np.array([1, 1, 1]), 2).tolist() == [1, 1, 0]  # ties -> lower class
    with pytest.raises(ValueError, match="cannot take 11 images from 10"):
        allocate(np.array([5, 5]), 11)


def test_make_split_is_stratified_and_disjoint():
    split = make_split(LABELS, 3200, 800, seed=0)
    assert np.bincount(LABELS[split.train]).tolist() == [320] * 10
    assert np.bincount(LABELS[split.val]).tolist() == [80] * 10
    assert len(np.intersect1d(split.train, split.val)) == 0
    assert np.all(np.diff(split.train) > 0) and split.train.dtype == np.int64


def test_make_split_deterministic_and_seed_dependent():
    a, b, c = (
        make_split(LABELS, 3200, 800, 0),
        make_split(LABELS, 3200, 800, 0),
        make_split(LABELS, 3200, 800, 1),
    )
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert not np.array_equal(a.val, c.val) and not np.array_equal(a.train, c.train)


def test_make_split_pinned_values():
    """Golden values: the same (labels, sizes, seed) must give these indices on any machine
    and numpy version; a change here changes every study's split."""
    labels = np.arange(40) % 4
    split = make_split(labels, 12, 8, seed=7)
    fp = split_fingerprint({"train": ("train", split.train), "val": ("train", split.val)})
    assert split.val.tolist() == [5, 11, 12, 13, 19, 24, 26, 34], split.val.tolist()
    assert split.train.tolist() == [0, 2, 9, 15, 16, 18, 22, 23, 29, 31, 33, 36], (
        split.train.tolist()
    )
    assert fp == "eb1ead1879bab9ae094f6d3c5d3994be6cefcf3a422053278aec92f7108f5d0a", fp


def test_val_unchanged_when_train_size_changes():
    small, large = make_split(LABELS, 1000, 800, 3), make_split(LABELS, 5000, 800, 3)
    assert np.array_equal(small.val, large.val)
    assert np.isin(small.train, large.train).all()


def test_make_split_errors():
    with pytest.raises(ValueError, match="exceeds the 6000 images"):
        make_split(LABELS, 6000, 1, 0)
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        make_split(LABELS, 10, 10, -1)


def test_stratified_subset():
    idx = stratified_subset(LABELS, 50, seed=0)
    assert np.bincount(LABELS[idx]).tolist() == [5] * 10
    assert np.array_equal(idx, stratified_subset(LABELS, 50, seed=0))
    assert len(stratified_subset(LABELS, 10**6, seed=0)) == len(LABELS)


# ---------------------------------------------------------------- prepare


def test_prepare_fashion_mnist(isolated, monkeypatch):
    folder = isolated / "fm"
    make_fashion_mnist(folder, n_train=500, n_test=30)
    trust_fashion_mnist(monkeypatch, folder)
    data = prepare("fashion_mnist", path=folder, split_seed=0, train_size=320, val_size=80)
    assert (len(data.train), len(data.val), len(data.test)) == (320, 80, 30)
    assert np.bincount(data.train.labels.numpy()).tolist() == [32] * 10
    assert (
        data.train.source_split == data.val.source_split == "train"
        and data.test.source_split == "test"
    )
    # same seed: same data
    official = make_fashion_mnist(isolated / "again", n_train=500, n_test=30)
    idx = data.train.indices.numpy()  # positions in the official training split
    assert np.array_equal(data.train.images.numpy(), official["train"][0][idx])
    again = prepare("fashion_mnist", path=folder, split_seed=0, train_size=320, val_size=80)
    other = prepare("fashion_mnist", path=folder, split_seed=1, train_size=320, val_size=80)
    assert again.split_fingerprint == data.split_fingerprint != other.split_fingerprint
    assert again.data_fingerprint == data.data_fingerprint == other.data_fingerprint
    params = data.log_params()
    assert params["data.n_train"] == 320 and params["data.fingerprint"] == data.data_fingerprint
    assert data.norm.mean == (0.2860,)


def test_prepare_data_fingerprint_changes_with_data(isolated, monkeypatch):
    a, b = isolated / "a", isolated / "b"
    make_fashion_mnist(a, seed=0)
    make_fashion_mnist(b, seed=1)
    fa = prepare(
        "fashion_mnist", path=a, verify=False, train_size=100, val_size=50
    ).data_fingerprint
    fb = prepare(
        "fashion_mnist", path=b, verify=False, train_size=100, val_size=50
    ).data_fingerprint
    assert fa != fb


def test_prepare_retinamnist_keeps_official_splits(isolated):
    path = isolated / "retinamnist.npz"
    make_retinamnist(path)
    data = prepare("retinamnist", path=path, verify=False)
    assert (len(data.train), len(data.val), len(data.test)) == (40, 10, 20)
    assert data.val.source_split == "val" and data.val.indices.tolist() == list(range(10))
    with pytest.raises(
        ValueError, match=r"train_size=30: RetinaMNIST.* has its own validation split \(10 images\)"
    ):
        prepare("retinamnist", path=path, verify=False, train_size=30)


def test_prepare_subset_is_stratified_per_split(isolated):
    path = isolated / "retinamnist.npz"
    make_retinamnist(path)
    data = prepare("retinamnist", path=path, verify=False, subset=10)
    assert (len(data.train), len(data.val), len(data.test)) == (10, 10, 10)
    assert np.bincount(data.train.labels.numpy()).tolist() == [2] * 5
    assert (
        data.split_fingerprint != prepare("retinamnist", path=path, verify=False).split_fingerprint
    )


def test_prepare_image_folder_carves_val_and_computes_norm(isolated):
    root = isolated / "imgs"
    make_image_folder(root, per_class={"train": 10})
    data = prepare("image_folder", path=root)
    assert (len(data.train), len(data.val), data.test) == (27, 3, None)
    x = data.train.images.double() / 255
    assert abs(data.norm.mean[0] - x[:, 0].mean().item()) < 1e-9, "norm from the train split"
