"""Train-time augmentation on whole batches with batched tensor ops.

Random crop with zero padding, horizontal flip, and a small affine (rotation, translation)
through one ``affine_grid`` + ``grid_sample`` call. The random numbers for a batch come
from a CPU ``torch.Generator`` that the loader seeds from (seed, epoch, batch index): the
same batch gets the same augmentation on any device and after a resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AugmentConfig:
    """What augmentation the training loader applies.

    Attributes:
        crop_padding: Zero padding per side before a random crop back to the input size;
            0 disables cropping.
        hflip: Flip each image left-right with probability 0.5.
        rotate_degrees: Rotation drawn uniformly in ``[-d, d]`` degrees.
        translate_fraction: Shift drawn uniformly in ``[-f, f]`` of the width/height, per axis.
    """

    crop_padding: int = 0
    hflip: bool = False
    rotate_degrees: float = 0.0
    translate_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.crop_padding, int) or isinstance(self.crop_padding, bool) or self.crop_padding < 0:
            raise ValueError(f"crop_padding must be an int >= 0, got {self.crop_padding!r}")
        if not isinstance(self.hflip, bool):
            raise ValueError(f"hflip must be a bool, got {self.hflip!r}")
        if not 0 <= self.rotate_degrees <= 180:
            raise ValueError(f"rotate_degrees must be in [0, 180], got {self.rotate_degrees!r}")
        if not 0 <= self.translate_fraction < 0.5:
            raise ValueError(f"translate_fraction must be in [0, 0.5), got {self.translate_fraction!r}")

    @property
    def enabled(self) -> bool:
        """Whether any augmentation is switched on."""
        return bool(self.crop_padding or self.hflip or self.rotate_degrees or self.translate_fraction)

    @property
    def uses_affine(self) -> bool:
        """Whether the resampling (``grid_sample``) step runs."""
        return bool(self.rotate_degrees or self.translate_fraction)


def sample_params(cfg: AugmentConfig, batch: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Draw every random number a batch needs, on the CPU, in a fixed order.

    All four draws happen whatever ``cfg`` switches on, so two arms of a seed that differ
    in one augmentation still share the other draws (same crops, same flips).

    Returns:
        ``crop`` (B, 2) int offsets (row, col) in ``[0, 2 * padding]``, ``flip`` (B,) bool,
        ``angle`` (B,) degrees, ``shift`` (B, 2) fractions (x, y).
    """
    crop = torch.randint(0, 2 * cfg.crop_padding + 1, (batch, 2), generator=generator)
    flip = torch.rand(batch, generator=generator) < 0.5
    angle = (torch.rand(batch, generator=generator) * 2 - 1) * cfg.rotate_degrees
    shift = (torch.rand(batch, 2, generator=generator) * 2 - 1) * cfg.translate_fraction
    return {"crop": crop, "flip": flip & cfg.hflip, "angle": angle, "shift": shift}


def crop_flip(x: torch.Tensor, padding: int, offsets: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Zero-pad by ``padding``, cut each image back to its size at ``offsets``, mirror some.

    Both steps are one ``gather`` with a per-image pixel index, so they are exact
    (no resampling) and cost one pass over the batch.

    Args:
        x: ``(B, C, H, W)`` images, any dtype.
        padding: Pixels of zero padding per side (0: no crop).
        offsets: ``(B, 2)`` (row, col) of each crop's top-left corner in the padded image.
        flip: ``(B,)`` bool, mirror left-right.

    Returns:
        ``(B, C, H, W)`` tensor of the same dtype.
    """
    b, c, h, w = x.shape
    if padding:
        x = F.pad(x, (padding, padding, padding, padding))  # (B, C, H + 2p, W + 2p)
    row_len = w + 2 * padding
    offsets, flip = offsets.to(x.device), flip.to(x.device)
    ar_h, ar_w = torch.arange(h, device=x.device), torch.arange(w, device=x.device)
    rows = offsets[:, :1] + ar_h  # (B, H)
    cols = offsets[:, 1:] + torch.where(flip[:, None], w - 1 - ar_w, ar_w)  # (B, W)
    flat = (rows[:, :, None] * row_len + cols[:, None, :]).view(b, 1, h * w).expand(b, c, h * w)
    return x.reshape(b, c, -1).gather(2, flat).view(b, c, h, w)  # (B, C, H, W)


def affine_matrices(angle_deg: torch.Tensor, shift: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Per-image matrices for ``F.affine_grid`` (output -> input, normalised coordinates).

    An image is rotated by ``angle`` about its centre, then shifted by ``shift * (W, H)``
    pixels. ``affine_grid`` wants the inverse map, in coordinates scaled to [-1, 1] per
    axis, so pixel-space rotation R is conjugated with S = diag(W/2, H/2) to stay a true
    rotation on non-square images: A = S^-1 R^-1 S, b = -S^-1 R^-1 t.

    Returns:
        ``(B, 2, 3)`` float tensor.
    """
    a = angle_deg.double() * (math.pi / 180.0)
    cos, sin = torch.cos(a), torch.sin(a)
    sx, sy = width / 2.0, height / 2.0
    # R^-1 = [[cos, sin], [-sin, cos]], conjugated by S.
    a00, a01 = cos, sin * sy / sx
    a10, a11 = -sin * sx / sy, cos
    tx, ty = shift[:, 0].double() * width, shift[:, 1].double() * height  # pixels
    b0 = -(cos * tx + sin * ty) / sx
    b1 = -(-sin * tx + cos * ty) / sy
    theta = torch.stack([torch.stack([a00, a01, b0], -1), torch.stack([a10, a11, b1], -1)], 1)  # (B, 2, 3)
    return theta.float()


def affine_grid(theta: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Sampling grid ``(B, H, W, 2)``, the same as ``F.affine_grid(..., align_corners=False)``.

    Written out as broadcast multiply-adds because ``F.affine_grid`` took twice as long as
    ``grid_sample`` itself on small CPU batches.
    """
    dev = theta.device
    xs = (torch.arange(width, device=dev, dtype=theta.dtype) * 2 + 1) / width - 1  # pixel centres in [-1, 1]
    ys = (torch.arange(height, device=dev, dtype=theta.dtype) * 2 + 1) / height - 1
    t = theta[:, :, :, None, None]  # (B, 2, 3, 1, 1)
    grid = t[:, :, 0] * xs[None, None, None, :] + t[:, :, 1] * ys[None, None, :, None] + t[:, :, 2]  # (B, 2, H, W)
    return grid.permute(0, 2, 3, 1)  # (B, H, W, 2)


def augment_batch(x: torch.Tensor, cfg: AugmentConfig, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Apply crop, flip and affine, in that order, to a uint8 batch; return float in [0, 1].

    Args:
        x: ``(B, C, H, W)`` uint8 on any device (not modified).
        cfg: What to apply.
        params: From ``sample_params`` (CPU tensors; moved here).

    Returns:
        ``(B, C, H, W)`` float32 in [0, 1].
    """
    if cfg.crop_padding or cfg.hflip:
        x = crop_flip(x, cfg.crop_padding, params["crop"], params["flip"])
    x = x.float().div_(255.0)
    if cfg.uses_affine:
        b, c, h, w = x.shape
        theta = affine_matrices(params["angle"], params["shift"], h, w).to(x.device)
        x = F.grid_sample(x, affine_grid(theta, h, w), mode="bilinear", padding_mode="zeros", align_corners=False)
    return x
