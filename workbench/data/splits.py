"""Stratified, deterministic splits and subsets, and their fingerprint.

Indices depend only on (labels, sizes, seed) through numpy's PCG64 stream, which numpy
keeps stable across versions and platforms; torch's RNG is not used here. Per class,
the permutation is ``argsort`` of ``Generator.random`` draws (stable sort), which relies
on nothing but that bit stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

_SPLIT_FP_VERSION = b"glassbox-workbench/split-fingerprint/v1"


@dataclass(frozen=True, eq=False)
class SplitIndices:
    """Positions (sorted, int64) of the train and validation images in the source split."""

    train: np.ndarray
    val: np.ndarray


def allocate(counts: np.ndarray, total: int) -> np.ndarray:
    """Split ``total`` over classes in proportion to ``counts`` (largest remainder).

    Ties in the remainder go to the lower class index, so the result is deterministic.
    No class gets more than its count.

    Args:
        counts: Images per class.
        total: Number to allocate, at most ``counts.sum()``.

    Returns:
        Per-class numbers summing to ``total``.
    """
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    if not 0 <= total <= n:
        raise ValueError(f"cannot take {total} images from {n}")
    if n == 0:
        return np.zeros_like(counts)
    exact = counts * total  # quota * n, kept in integers to avoid float rounding
    base = exact // n
    remainder = exact - base * n
    short = total - int(base.sum())
    order = np.lexsort((np.arange(len(counts)), -remainder))  # largest remainder first
    base[order[:short]] += 1
    return base


def _class_order(class_idx: np.ndarray, seed: int, label: int) -> np.ndarray:
    """A seeded permutation of one class's positions; independent of other classes."""
    rng = np.random.default_rng([seed, int(label)])
    return class_idx[np.argsort(rng.random(len(class_idx)), kind="stable")]


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return int(seed)


def make_split(
    labels: np.ndarray, train_size: int | None, val_size: int, seed: int
) -> SplitIndices:
    """Stratified train/validation split of one labelled set.

    Validation is taken first from each class's seeded permutation, so the validation set
    does not change when only ``train_size`` changes.

    Args:
        labels: ``(N,)`` integer labels.
        train_size: Training images; ``None`` takes all that remain after validation.
        val_size: Validation images (may be 0).
        seed: Split seed, a non-negative int.

    Returns:
        Sorted, disjoint index arrays.

    Raises:
        ValueError: Sizes larger than the data or negative; bad seed.
    """
    labels = np.asarray(labels).reshape(-1)
    seed = _check_seed(seed)
    classes, counts = np.unique(labels, return_counts=True)
    if val_size < 0 or (train_size is not None and train_size < 0):
        raise ValueError(f"sizes must be >= 0, got train {train_size}, val {val_size}")
    if val_size + (train_size or 0) > len(labels):
        raise ValueError(
            f"train {train_size} + val {val_size} exceeds the {len(labels)} images available"
        )
    if len(labels) == 0:
        return SplitIndices(np.zeros(0, np.int64), np.zeros(0, np.int64))
    n_val = allocate(counts, val_size)
    rest = counts - n_val
    n_train = rest if train_size is None else allocate(rest, train_size)
    train, val = [], []
    for label, nv, nt in zip(classes, n_val, n_train):
        order = _class_order(np.flatnonzero(labels == label), seed, label)
        val.append(order[:nv])
        train.append(order[nv : nv + nt])
    return SplitIndices(
        np.sort(np.concatenate(train)).astype(np.int64),
        np.sort(np.concatenate(val)).astype(np.int64),
    )


def nested_stratified_order(labels: np.ndarray, seed: int) -> np.ndarray:
    """Every position once, ordered so that each prefix is a class-stratified sample.

    The classes take turns by Balinski and Young's quota method (1975): the next image goes
    to the class with the largest ``count / (taken + 1)`` among those still below their
    exact share of the prefix, ties to the lower class; within a class, images come in
    that class's seeded order. So every prefix of ``n`` images holds, of each class, its
    share ``n * count / total`` rounded down or up, and the prefix of N images contains
    the prefix of every smaller N: subsets of growing size are nested, which a
    largest-remainder draw per size does not promise (the Alabama paradox).

    Args:
        labels: ``(N,)`` integer labels.
        seed: Seed of the per-class orders, a non-negative int.

    Returns:
        A permutation of ``range(len(labels))`` (int64).
    """
    labels = np.asarray(labels).reshape(-1)
    seed = _check_seed(seed)
    classes, counts = np.unique(labels, return_counts=True)
    orders = [_class_order(np.flatnonzero(labels == c), seed, c) for c in classes]
    total, sizes = len(labels), [int(k) for k in counts]
    taken, turns = [0] * len(sizes), np.empty(total, np.int64)
    for n in range(1, total + 1):  # plain ints: exact at the quota, and 10x numpy's speed here
        best, best_priority = -1, -1.0
        for c, size in enumerate(sizes):
            if taken[c] * total < n * size and size / (taken[c] + 1) > best_priority:
                best, best_priority = c, size / (taken[c] + 1)  # strict >: ties to the lower class
        turns[n - 1] = best
        taken[best] += 1
    out = np.empty(total, np.int64)
    for c, order in enumerate(orders):
        out[turns == c] = order
    return out


def nested_subset(labels: np.ndarray, size: int, seed: int) -> np.ndarray:
    """Sorted positions of the first ``size`` images of ``nested_stratified_order``.

    Raises:
        ValueError: ``size`` is not in ``1..len(labels)``.
    """
    labels = np.asarray(labels).reshape(-1)
    if not 1 <= size <= len(labels):
        raise ValueError(f"a subset of {size} images: must be 1 to {len(labels)}")
    return np.sort(nested_stratified_order(labels, seed)[:size])


def stratified_subset(labels: np.ndarray, size: int, seed: int) -> np.ndarray:
    """Sorted positions of a class-stratified random subset of ``size`` images.

    Used for smoke runs; returns every position when ``size >= len(labels)``.
    """
    labels = np.asarray(labels).reshape(-1)
    if size >= len(labels):
        return np.arange(len(labels), dtype=np.int64)
    return make_split(labels, train_size=size, val_size=0, seed=seed).train


def split_fingerprint(parts: Mapping[str, tuple[str, np.ndarray]]) -> str:
    """sha256 over each split's name, source split and index array.

    Args:
        parts: Split name -> (source split name, int indices into it).
    """
    h = hashlib.sha256(_SPLIT_FP_VERSION)
    for name in sorted(parts):
        source, idx = parts[name]
        idx = np.ascontiguousarray(idx, dtype="<i8")
        h.update(f"|{name}<-{source}|n={len(idx)}|".encode())
        h.update(memoryview(idx).cast("B"))
    return h.hexdigest()
