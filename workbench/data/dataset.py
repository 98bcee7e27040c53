"""In-memory dataset containers and the data fingerprint.

A dataset is held as uint8 image tensors ``(N, C, H, W)`` plus int64 labels ``(N,)`` per
official split. Everything downstream (splits, loaders, run identity) works from these.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from workbench.data.errors import Place

# Bump when the fingerprint definition changes, so old and new fingerprints never collide.
_FINGERPRINT_VERSION = b"glassbox-workbench/data-fingerprint/v1"


@dataclass(frozen=True, eq=False)
class SplitTensors:
    """Images and labels of one split.

    Attributes:
        images: uint8 tensor ``(N, C, H, W)``.
        labels: int64 tensor ``(N,)``.
    """

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4:
            raise ValueError(
                f"images must be uint8 (N, C, H, W), got {self.images.dtype} {tuple(self.images.shape)}"
            )
        if self.labels.dtype != torch.int64 or self.labels.ndim != 1:
            raise ValueError(
                f"labels must be int64 (N,), got {self.labels.dtype} {tuple(self.labels.shape)}"
            )
        if len(self.images) != len(self.labels):
            raise ValueError(f"{len(self.images)} images but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class Resolution:
    """Where a dataset was looked for and which place was used.

    Attributes:
        places: Every place looked, in order (for logging and for error messages).
        used: The place the data came from.
    """

    places: tuple[Place, ...]
    used: Place

    def describe(self) -> list[str]:
        """One line per place looked, the used one marked with ``*``."""
        return [("* " if p is self.used else "  ") + p.describe() for p in self.places]


@dataclass(frozen=True, eq=False)
class ImageDataset:
    """A decoded dataset with its official splits.

    Attributes:
        name: Registry name, one of ``DATASET_NAMES`` (``"cifar10"`` for both CIFAR-10
            formats; ``display_name`` tells them apart).
        display_name: Human name used in logs and reports, e.g. ``"CIFAR-10 (JPEG copy)"``.
        splits: Official splits by name (``"train"``, optionally ``"val"``, ``"test"``).
        class_names: Class names in label order.
        source: Where the data came from: format, path, checksum status.
        fingerprint: sha256 over the decoded tensors, labels and class names.
        resolution: Places looked and the one used.
        from_cache: Whether the tensors were read from the decoded-data cache.
    """

    name: str
    display_name: str
    splits: Mapping[str, SplitTensors]
    class_names: tuple[str, ...]
    source: str
    fingerprint: str
    resolution: Resolution | None = None
    from_cache: bool = False
    cache_file: str | None = field(default=None, repr=False)

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.class_names)

    def summary(self) -> str:
        """One line, e.g. ``Fashion-MNIST: train 60000, test 10000, 10 classes, 1x28x28``."""
        sizes = ", ".join(f"{k} {len(v)}" for k, v in self.splits.items())
        c, h, w = next(iter(self.splits.values())).images.shape[1:]
        return f"{self.display_name}: {sizes}, {self.num_classes} classes, {c}x{h}x{w}"


def data_fingerprint(
    splits: Mapping[str, tuple[np.ndarray, np.ndarray]], class_names: tuple[str, ...]
) -> str:
    """sha256 over decoded images, labels and class names.

    The fingerprint depends on pixel values only, not on where the files came from, so
    the same data reached by two paths gets the same run identity.

    Args:
        splits: Split name to ``(images uint8 (N, C, H, W), labels int64 (N,))`` arrays.
        class_names: Class names in label order.

    Returns:
        Hex digest.
    """
    h = hashlib.sha256(_FINGERPRINT_VERSION)
    for name in sorted(splits):
        images, labels = splits[name]
        images = np.ascontiguousarray(images, dtype=np.uint8)
        labels = np.ascontiguousarray(labels, dtype="<i8")
        h.update(f"|split={name}|images={images.shape}|labels={labels.shape}|".encode())
        h.update(memoryview(images).cast("B"))
        h.update(memoryview(labels).cast("B"))
    h.update(("|classes=" + "\x1f".join(class_names)).encode())
    return h.hexdigest()


def make_image_dataset(
    *,
    name: str,
    display_name: str,
    arrays: Mapping[str, tuple[np.ndarray, np.ndarray]],
    class_names: tuple[str, ...],
    source: str,
    fingerprint: str | None = None,
    resolution: Resolution | None = None,
    from_cache: bool = False,
    cache_file: str | None = None,
) -> ImageDataset:
    """Wrap numpy arrays (shared, not copied) into an ``ImageDataset``."""
    if fingerprint is None:
        fingerprint = data_fingerprint(arrays, class_names)
    splits = {
        k: SplitTensors(
            torch.from_numpy(np.ascontiguousarray(im)),
            torch.from_numpy(lb.astype(np.int64, copy=False)),
        )
        for k, (im, lb) in arrays.items()
    }
    return ImageDataset(
        name=name,
        display_name=display_name,
        splits=splits,
        class_names=tuple(class_names),
        source=source,
        fingerprint=fingerprint,
        resolution=resolution,
        from_cache=from_cache,
        cache_file=cache_file,
    )
