"""Normalisation statistics, normalisation and batched resizing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class NormStats:
    """Per-channel mean and std of pixel values scaled to [0, 1].

    Attributes:
        mean: One value per channel.
        std: One value per channel, all positive.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.mean) != len(self.std) or not self.mean:
            raise ValueError(f"mean {self.mean} and std {self.std} need the same, non-zero length")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std must be positive, got {self.std}")


# Mean/std of the official training split of each dataset, pixels in [0, 1].
# CIFAR-10: the standard figures of the official training pixels (the JPEG copy measures
# mean 0.4913/0.4821/0.4465, std 0.2452/0.2428/0.2606: within 0.002, so one entry serves
# both). Fashion-MNIST and RetinaMNIST were measured on the official training files.
NORM_STATS: dict[str, NormStats] = {
    "fashion_mnist": NormStats((0.2860,), (0.3530,)),
    "cifar10": NormStats((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "retinamnist": NormStats((0.3984, 0.2447, 0.1558), (0.2983, 0.2005, 0.1507)),
}
# For ImageNet-pretrained models, which expect their training statistics.
IMAGENET_STATS = NormStats((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def compute_norm_stats(images: torch.Tensor) -> NormStats:
    """Per-channel mean and std of uint8 images ``(N, C, H, W)``, scaled to [0, 1]."""
    x = images.double() / 255.0
    std = x.std(dim=(0, 2, 3)).clamp_min(1e-6)  # a constant channel must not divide by zero
    return NormStats(tuple(x.mean(dim=(0, 2, 3)).tolist()), tuple(std.tolist()))


def normalize(x: torch.Tensor, stats: NormStats) -> torch.Tensor:
    """``(x - mean) / std`` per channel for float images in [0, 1], ``(B, C, H, W)``."""
    if x.shape[1] != len(stats.mean):
        raise ValueError(
            f"images have {x.shape[1]} channels but the statistics have {len(stats.mean)}"
        )
    mean = torch.tensor(stats.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    std = torch.tensor(stats.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - mean).div_(std)


def resize_batch(images: torch.Tensor, size: int | tuple[int, int]) -> torch.Tensor:
    """Resize a batch on its device, e.g. 28 px RetinaMNIST to a ViT's 224 px.

    Bilinear interpolation; anti-aliasing only when shrinking (it has no effect when
    enlarging and costs time). uint8 input is converted to float in [0, 1] first.

    Args:
        images: ``(B, C, H, W)`` uint8 or float.
        size: Output side, or ``(height, width)``.

    Returns:
        Float tensor ``(B, C, size, size)``.
    """
    out_hw = (size, size) if isinstance(size, int) else tuple(size)
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images
    if tuple(x.shape[-2:]) == out_hw:
        return x
    shrink = out_hw[0] < x.shape[-2] or out_hw[1] < x.shape[-1]
    return F.interpolate(x, size=out_hw, mode="bilinear", align_corners=False, antialias=shrink)
