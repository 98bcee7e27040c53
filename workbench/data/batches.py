"""Batches served straight from in-memory tensors, in a seeded, resumable order.

The whole split is moved to the target device once; each batch is then an index_select,
an optional batched augmentation, an optional resize and a normalisation, all on that
device. There are no worker processes and no per-image Python code.

Determinism: the epoch's order comes from a CPU ``torch.Generator`` seeded from
(seed, epoch), so every arm of a seed sees the same order; a batch's augmentation comes
from a generator seeded from (seed, epoch, batch index) (RandAugment's from one of its own,
seeded the same way), so ``iter_epoch(e, start_batch=k)``
yields exactly the batches k, k+1, ... of the uninterrupted epoch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

from workbench.data.augment import AugmentConfig, augment_batch, sample_params, sample_randaugment
from workbench.data.transforms import NormStats, normalize, resize_batch


class Batch(NamedTuple):
    """One batch: ``images`` float (B, C, H, W) normalised, ``labels`` int64 (B,),
    ``indices`` int64 (B,) positions in the dataset's source split."""

    images: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any tuple of values, identical on every machine and Python run.

    Python's ``hash`` is salted per process, and adding seeds (seed + epoch) makes
    neighbouring runs share streams; sha256 of the parts has neither problem.
    """
    text = "glassbox-workbench/" + "/".join(map(str, parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _generator(*parts: object) -> torch.Generator:
    g = torch.Generator(device="cpu")  # CPU: the same numbers whatever device trains
    g.manual_seed(derive_seed(*parts))
    return g


class TensorLoader:
    """Iterate over (images, labels, indices) batches of an in-memory split.

    Args:
        images: uint8 ``(N, C, H, W)``.
        labels: int64 ``(N,)``.
        indices: int64 ``(N,)`` dataset positions reported with each batch; default
            ``arange(N)``.
        batch_size: Images per batch.
        norm: Normalisation statistics (``NORM_STATS[name]``, or ``IMAGENET_STATS`` for
            pretrained models).
        seed: Run seed; with the epoch it fixes order and augmentation.
        shuffle: Shuffle each epoch (training); ``False`` keeps dataset order (evaluation).
        augment: Training augmentation; ``None`` for evaluation loaders.
        drop_last: Drop the last incomplete batch.
        device: Where the tensors live and batches are made; default CUDA if available.
        resize_to: Resize each batch to this side (e.g. 224 for a pretrained ViT).
        to_rgb: Repeat a single grey channel three times (for RGB-pretrained models).

    Example:
        >>> loader = TensorLoader.from_split(data.train, batch_size=128, norm=data.norm, seed=0,
        ...                                  augment=AugmentConfig(crop_padding=4, hflip=True))
        >>> for images, labels, indices in loader.iter_epoch(epoch=3, start_batch=10): ...
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        indices: torch.Tensor | None = None,
        *,
        batch_size: int,
        norm: NormStats,
        seed: int = 0,
        shuffle: bool = True,
        augment: AugmentConfig | None = None,
        drop_last: bool = False,
        device: str | torch.device | None = None,
        resize_to: int | None = None,
        to_rgb: bool = False,
        epoch_size: int | None = None,
    ) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(
                f"images must be uint8 (N, C, H, W), got {images.dtype} {tuple(images.shape)}"
            )
        if len(labels) != len(images):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        channels = 3 if to_rgb else images.shape[1]
        if len(norm.mean) != channels:
            raise ValueError(f"norm has {len(norm.mean)} channels but batches will have {channels}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        # Moved once; a tensor already there is not copied.
        self.images = images.to(self.device)
        self.labels = labels.to(self.device, torch.int64)
        idx = torch.arange(len(images)) if indices is None else indices
        self.indices = idx.to(self.device, torch.int64)
        self.batch_size = batch_size
        self.norm = norm
        self.seed = seed
        self.shuffle = shuffle
        self.augment = augment if augment is not None and augment.enabled else None
        self.drop_last = drop_last
        self.resize_to = resize_to
        self.to_rgb = to_rgb
        if epoch_size is not None and (not shuffle or epoch_size < 1):
            raise ValueError(f"epoch_size={epoch_size}: needs shuffle and must be >= 1")
        self.epoch_size = epoch_size
        self.epoch = 0

    @classmethod
    def from_split(cls, split, **kwargs) -> TensorLoader:
        """Build from a ``PreparedSplit`` (images, labels, indices)."""
        return cls(split.images, split.labels, split.indices, **kwargs)

    def __len__(self) -> int:
        n = self._images_per_epoch()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Epoch used by ``iter(loader)``."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_epoch(self.epoch)

    def _images_per_epoch(self) -> int:
        return len(self.labels) if self.epoch_size is None else self.epoch_size

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's sequence of positions (CPU int64), seeded by (seed, epoch).

        With ``epoch_size`` the epoch is consecutive shuffled passes over the images, each
        seeded by (seed, epoch, pass), cut at ``epoch_size``: a small training subset is
        seen as many times as the images of a full epoch allow, and its last pass of an
        epoch is a random part of it.
        """
        n = len(self.labels)
        if not self.shuffle:
            return torch.arange(n)
        if self.epoch_size is None:
            return torch.randperm(n, generator=_generator(self.seed, epoch, "order"))
        passes = -(-self.epoch_size // n)
        return torch.cat(
            [
                torch.randperm(n, generator=_generator(self.seed, epoch, "order", k))
                for k in range(passes)
            ]
        )[: self.epoch_size]

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        """Yield the epoch's batches from batch ``start_batch`` on (for mid-epoch resume).

        Args:
            epoch: Epoch number; with the seed it fixes the order.
            start_batch: First batch to yield, ``0 <= start_batch <= len(self)``.
        """
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start_batch must be in [0, {len(self)}], got {start_batch}")
        perm = self.order(epoch).to(self.device)
        for k in range(start_batch, len(self)):
            pos = perm[k * self.batch_size : (k + 1) * self.batch_size]
            yield self._make_batch(pos, epoch, k)

    def _make_batch(self, pos: torch.Tensor, epoch: int, k: int) -> Batch:
        x = self.images.index_select(0, pos)  # (B, C, H, W) uint8
        if self.augment is not None:
            params = sample_params(
                self.augment, len(pos), _generator(self.seed, epoch, k, "augment")
            )
            drawn = None
            if (
                self.augment.randaugment_ops
            ):  # a generator of its own: the other draws stay as they were
                drawn = sample_randaugment(
                    self.augment, len(pos), _generator(self.seed, epoch, k, "randaugment")
                )
            x = augment_batch(x, self.augment, params, drawn)  # float in [0, 1]
        else:
            x = x.float().div_(255.0)
        if self.to_rgb and x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)  # (B, 3, H, W)
        if self.resize_to is not None:
            x = resize_batch(x, self.resize_to)
        return Batch(
            normalize(x, self.norm),
            self.labels.index_select(0, pos),
            self.indices.index_select(0, pos),
        )
