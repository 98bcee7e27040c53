"""Train-time augmentation on whole batches with batched tensor ops.

Random crop with zero padding, horizontal flip, and a small affine (rotation, translation)
through one ``affine_grid`` + ``grid_sample`` call. The random numbers for a batch come
from a CPU ``torch.Generator`` that the loader seeds from (seed, epoch, batch index): the
same batch gets the same augmentation on any device and after a resume.

RandAugment (optional, after crop and flip, on the uint8 batch) is torchvision v2's: its op
table, magnitudes and op implementations (``RandAugment``), with the ops and signs drawn per
image from the batch's own generator (torchvision's ``forward`` draws one op set per call,
from the global RNG). Images that drew the same op and sign go through that op together, so a
batch costs at most (ops x 23) batched calls instead of one transform call per image, and
gives exactly what applying each image's ops to it alone gives (tests/test_recipe_parts.py).
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
        randaugment_ops: RandAugment ops per image (torchvision v2's); 0 disables it.
        randaugment_magnitude: RandAugment's magnitude bin, 0 to 30 (of 31).
    """

    crop_padding: int = 0
    hflip: bool = False
    rotate_degrees: float = 0.0
    translate_fraction: float = 0.0
    randaugment_ops: int = 0
    randaugment_magnitude: int = 9

    def __post_init__(self) -> None:
        if (
            not isinstance(self.crop_padding, int)
            or isinstance(self.crop_padding, bool)
            or self.crop_padding < 0
        ):
            raise ValueError(f"crop_padding must be an int >= 0, got {self.crop_padding!r}")
        if not isinstance(self.hflip, bool):
            raise ValueError(f"hflip must be a bool, got {self.hflip!r}")
        if not 0 <= self.rotate_degrees <= 180:
            raise ValueError(f"rotate_degrees must be in [0, 180], got {self.rotate_degrees!r}")
        if not 0 <= self.translate_fraction < 0.5:
            raise ValueError(
                f"translate_fraction must be in [0, 0.5), got {self.translate_fraction!r}"
            )
        if not isinstance(self.randaugment_ops, int) or self.randaugment_ops < 0:
            raise ValueError(f"randaugment_ops must be an int >= 0, got {self.randaugment_ops!r}")
        if (
            not isinstance(self.randaugment_magnitude, int)
            or not 0 <= self.randaugment_magnitude <= 30
        ):
            raise ValueError(
                f"randaugment_magnitude must be an int in [0, 30], got {self.randaugment_magnitude!r}"
            )

    @property
    def enabled(self) -> bool:
        """Whether any augmentation is switched on."""
        return bool(
            self.crop_padding
            or self.hflip
            or self.rotate_degrees
            or self.translate_fraction
            or self.randaugment_ops
        )

    @property
    def uses_affine(self) -> bool:
        """Whether the resampling (``grid_sample``) step runs."""
        return bool(self.rotate_degrees or self.translate_fraction)


def sample_params(
    cfg: AugmentConfig, batch: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
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


def randaugment(ops: int, magnitude: int):
    """torchvision v2's ``RandAugment`` (nearest interpolation, zero fill: its defaults), one per setting."""
    key = (ops, magnitude)
    if key not in _RANDAUGMENT:
        from torchvision.transforms import v2  # only when RandAugment is on

        _RANDAUGMENT[key] = v2.RandAugment(num_ops=ops, magnitude=magnitude)
    return _RANDAUGMENT[key]


_RANDAUGMENT: dict[tuple[int, int], object] = {}


def sample_randaugment(
    cfg: AugmentConfig, batch: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Each image's RandAugment ops and signs, drawn on the CPU from the batch's generator.

    As torchvision's ``RandAugment.forward`` draws them for one call: every op uniformly from its
    op table, and a signed op's magnitude negated with probability 1/2.

    Returns:
        ``ops`` (randaugment_ops, B) indices into the op table, ``negate`` (randaugment_ops, B) bool.
    """
    space = randaugment(cfg.randaugment_ops, cfg.randaugment_magnitude)._AUGMENTATION_SPACE
    ops = torch.randint(0, len(space), (cfg.randaugment_ops, batch), generator=generator)
    negate = torch.rand(cfg.randaugment_ops, batch, generator=generator) <= 0.5
    return {"ops": ops, "negate": negate}


def apply_randaugment(
    x: torch.Tensor, cfg: AugmentConfig, drawn: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Apply each image's drawn ops, in order, to a uint8 batch ``(B, C, H, W)``; returns a new batch.

    The op implementations and magnitudes are torchvision's (``RandAugment._apply_image_or_video_transform``
    and its ``_AUGMENTATION_SPACE``, torchvision 0.29); each op runs once on the images that
    drew it with the same sign. Every op acts on each image of a batch on its own, so the
    result is the one each image gets alone.
    """
    ra = randaugment(cfg.randaugment_ops, cfg.randaugment_magnitude)
    names = list(ra._AUGMENTATION_SPACE)
    height, width = x.shape[-2:]
    out = x.clone()
    for step in range(cfg.randaugment_ops):
        ops, negate = drawn["ops"][step], drawn["negate"][step]
        for op in ops.unique().tolist():
            magnitudes_fn, signed = ra._AUGMENTATION_SPACE[names[op]]
            magnitudes = magnitudes_fn(ra.num_magnitude_bins, height, width)
            for sign in (False, True) if signed and magnitudes is not None else (None,):
                chosen = (ops == op) if sign is None else (ops == op) & (negate == sign)
                idx = chosen.nonzero().flatten().to(x.device)
                if not len(idx):
                    continue
                magnitude = 0.0 if magnitudes is None else float(magnitudes[ra.magnitude])
                if sign:
                    magnitude = -magnitude
                group = ra._apply_image_or_video_transform(
                    out.index_select(0, idx),
                    names[op],
                    magnitude,
                    interpolation=ra.interpolation,
                    fill=ra._fill,
                )
                out.index_copy_(0, idx, group)
    return out


def crop_flip(
    x: torch.Tensor, padding: int, offsets: torch.Tensor, flip: torch.Tensor
) -> torch.Tensor:
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


def affine_matrices(
    angle_deg: torch.Tensor, shift: torch.Tensor, height: int, width: int
) -> torch.Tensor:
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
    # (B, 2, 3)
    theta = torch.stack([torch.stack([a00, a01, b0], -1), torch.stack([a10, a11, b1], -1)], 1)
    return theta.float()


def affine_grid(theta: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Sampling grid ``(B, H, W, 2)``, the same as ``F.affine_grid(..., align_corners=False)``.

    Written out as broadcast multiply-adds because ``F.affine_grid`` took twice as long as
    ``grid_sample`` itself on small CPU batches.
    """
    dev = theta.device
    xs = (
        torch.arange(width, device=dev, dtype=theta.dtype) * 2 + 1
    ) / width - 1  # pixel centres in [-1, 1]
    ys = (torch.arange(height, device=dev, dtype=theta.dtype) * 2 + 1) / height - 1
    t = theta[:, :, :, None, None]  # (B, 2, 3, 1, 1)
    # (B, 2, H, W)
    grid = t[:, :, 0] * xs[None, None, None, :] + t[:, :, 1] * ys[None, None, :, None] + t[:, :, 2]
    return grid.permute(0, 2, 3, 1)  # (B, H, W, 2)


def augment_batch(
    x: torch.Tensor,
    cfg: AugmentConfig,
    params: dict[str, torch.Tensor],
    randaugment_draws: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Apply crop, flip, RandAugment and affine, in that order, to a uint8 batch; return float in [0, 1].

    Args:
        x: ``(B, C, H, W)`` uint8 on any device (not modified).
        cfg: What to apply.
        params: From ``sample_params`` (CPU tensors; moved here).
        randaugment_draws: From ``sample_randaugment``, when ``cfg.randaugment_ops``.

    Returns:
        ``(B, C, H, W)`` float32 in [0, 1].
    """
    if cfg.crop_padding or cfg.hflip:
        x = crop_flip(x, cfg.crop_padding, params["crop"], params["flip"])
    if cfg.randaugment_ops:
        x = apply_randaugment(x, cfg, randaugment_draws)
    x = x.float().div_(255.0)
    if cfg.uses_affine:
        b, c, h, w = x.shape
        theta = affine_matrices(params["angle"], params["shift"], h, w).to(x.device)
        x = F.grid_sample(
            x, affine_grid(theta, h, w), mode="bilinear", padding_mode="zeros", align_corners=False
        )
    return x
