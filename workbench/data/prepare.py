"""``prepare``: the one entry point training code calls to get its data.

It loads a dataset, carves or keeps the splits, optionally takes a stratified subset for
smoke runs, and returns tensors plus the fingerprints that identify the run's data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from workbench.data.dataset import ImageDataset, Resolution
from workbench.data.errors import SplitSizeError
from workbench.data.load_dataset import load_dataset
from workbench.data.splits import make_split, nested_subset, split_fingerprint, stratified_subset
from workbench.data.transforms import NORM_STATS, NormStats, compute_norm_stats

# (train, val) carved from the official training split when a dataset has no official
# validation split. Fashion-MNIST: the seed study's 3,200 / 800; CIFAR-10: the usual 45k/5k.
DEFAULT_SIZES: dict[str, tuple[int, int]] = {"fashion_mnist": (3200, 800), "cifar10": (45000, 5000)}
# Image folders without val/: this fraction of train becomes validation.
DEFAULT_VAL_FRACTION = 0.1


@dataclass(frozen=True, eq=False)
class PreparedSplit:
    """One split ready for a loader.

    Attributes:
        images: uint8 ``(N, C, H, W)``.
        labels: int64 ``(N,)``.
        indices: int64 ``(N,)`` positions in ``source_split`` of the dataset, so predictions
            can be traced back to dataset images.
        source_split: The official split these images come from.
    """

    images: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor
    source_split: str

    def __len__(self) -> int:
        return len(self.labels)

    def nested_subset(self, size: int, seed: int) -> PreparedSplit:
        """The first ``size`` images of a seeded, class-stratified order of this split
        (``splits.nested_subset``): a smaller subset lies inside every larger one.

        Raises:
            ValueError: ``size`` larger than the split, naming both.
        """
        if size > len(self):
            raise ValueError(
                f"dataset.train_subset={size}: more than the {len(self)} images of the training split"
            )
        pos = torch.from_numpy(nested_subset(self.labels.numpy(), size, seed))
        return PreparedSplit(
            self.images[pos], self.labels[pos], self.indices[pos], self.source_split
        )


@dataclass(frozen=True, eq=False)
class PreparedData:
    """Everything a training run needs from the data layer, plus what to log.

    Attributes:
        name: Dataset registry name.
        display_name: E.g. ``"CIFAR-10 (JPEG copy)"``; use it in reports.
        train, val: Splits for training and model selection.
        test: Official test split, or ``None`` when the dataset has none.
        class_names: In label order.
        norm: Normalisation statistics for this dataset.
        data_fingerprint: sha256 of the decoded dataset (all official splits).
        split_fingerprint: sha256 of the index arrays of train/val/test.
        source: Where the data came from (format, path, checksum status).
        resolution: Places looked and the one used.
        split_seed: Seed the split was made with.
    """

    name: str
    display_name: str
    train: PreparedSplit
    val: PreparedSplit
    test: PreparedSplit | None
    class_names: tuple[str, ...]
    norm: NormStats
    data_fingerprint: str
    split_fingerprint: str
    source: str
    resolution: Resolution | None
    split_seed: int

    def log_params(self) -> dict[str, str | int]:
        """Flat, loggable description of the data (the tracking layer logs it)."""
        out: dict[str, str | int] = {
            "data.name": self.name,
            "data.display_name": self.display_name,
            "data.source": self.source,
            "data.fingerprint": self.data_fingerprint,
            "data.split_fingerprint": self.split_fingerprint,
            "data.split_seed": self.split_seed,
        }
        for name in ("train", "val", "test"):
            split = getattr(self, name)
            out[f"data.n_{name}"] = 0 if split is None else len(split)
        return out


def _check_sizes(
    what: str,
    available: int,
    train_n: int | None,
    train_size: int | None,
    val_n: int,
    val_size: int | None,
) -> None:
    """Refuse sizes that do not fit the training split, naming each size and where a default came from."""
    if val_n + (train_n or 0) <= available:
        return

    def said(key: str, n: int | None, given: int | None) -> str:
        return f"{key}={n}" + ("" if given is not None else " (the default)")

    sizes = " + ".join(
        said(k, n, g)
        for k, n, g in (("train_size", train_n, train_size), ("val_size", val_n, val_size))
        if n
    )
    raise SplitSizeError(
        f"{sizes}: more than the {available} images of the training split of {what}; "
        "give smaller sizes"
    )


def _take(ds: ImageDataset, source: str, idx: np.ndarray) -> PreparedSplit:
    s = ds.splits[source]
    t = torch.from_numpy(np.asarray(idx, dtype=np.int64))
    return PreparedSplit(s.images[t], s.labels[t], t, source)


def prepare(
    name: str,
    *,
    path: str | os.PathLike | None = None,
    download: bool = False,
    split_seed: int = 0,
    train_size: int | None = None,
    val_size: int | None = None,
    subset: int | None = None,
    size: int | None = None,
    verify: bool = True,
    dataset: ImageDataset | None = None,
) -> PreparedData:
    """Load a dataset and make the run's train / val / test splits.

    Datasets with an official validation split (RetinaMNIST, image folders with ``val/``)
    keep their official splits. Others get train and val carved, stratified, from the
    official training split (defaults in ``DEFAULT_SIZES``); the official test split is
    passed through untouched.

    Args:
        name: One of ``DATASET_NAMES``.
        path: Explicit file or folder (see ``load_dataset``).
        download: Allow a download into the user cache.
        split_seed: Seed of the split and of the subset.
        train_size: Training images to carve; ``None`` uses the default.
        val_size: Validation images to carve; ``None`` uses the default.
        subset: If given, keep at most this many images per split, stratified by class
            (for smoke runs).
        size: RetinaMNIST image size (see ``load_dataset``).
        verify: Check official checksums.
        dataset: An already loaded dataset to use instead of loading ``name``.

    Returns:
        The prepared data with its fingerprints.

    Raises:
        ValueError: Sizes given for a dataset with official splits, or sizes too large.
    """
    ds = (
        dataset
        if dataset is not None
        else load_dataset(name, path, download, size=size, verify=verify)
    )
    name = ds.name
    train_labels = ds.splits["train"].labels.numpy()
    if "val" in ds.splits:
        if train_size is not None or val_size is not None:
            given = ", ".join(
                f"{k}={v}"
                for k, v in (("train_size", train_size), ("val_size", val_size))
                if v is not None
            )
            raise SplitSizeError(
                f"{given}: {ds.display_name} has its own validation split ({len(ds.splits['val'])} "
                f"images), so train_size and val_size do not apply; leave them out (subset keeps fewer)"
            )
        parts = {
            "train": ("train", np.arange(len(train_labels))),
            "val": ("val", np.arange(len(ds.splits["val"]))),
        }
    else:
        default_train, default_val = DEFAULT_SIZES.get(
            name, (None, round(DEFAULT_VAL_FRACTION * len(train_labels)))
        )
        val_n = default_val if val_size is None else val_size
        train_n = default_train if train_size is None else train_size
        _check_sizes(ds.display_name, len(train_labels), train_n, train_size, val_n, val_size)
        split = make_split(train_labels, train_n, val_n, split_seed)
        parts = {"train": ("train", split.train), "val": ("train", split.val)}
    if "test" in ds.splits:
        parts["test"] = ("test", np.arange(len(ds.splits["test"])))

    if subset is not None:
        for k, (src, idx) in parts.items():
            labels = ds.splits[src].labels.numpy()[idx]
            parts[k] = (src, idx[stratified_subset(labels, subset, split_seed)])

    prepared = {k: _take(ds, src, idx) for k, (src, idx) in parts.items()}
    norm = NORM_STATS.get(name) or compute_norm_stats(prepared["train"].images)
    return PreparedData(
        name=name,
        display_name=ds.display_name,
        train=prepared["train"],
        val=prepared["val"],
        test=prepared.get("test"),
        class_names=ds.class_names,
        norm=norm,
        data_fingerprint=ds.fingerprint,
        split_fingerprint=split_fingerprint(parts),
        source=ds.source,
        resolution=ds.resolution,
        split_seed=split_seed,
    )
