"""Token norms per block: high-norm outlier tokens, where they sit, the CLS attention they get, their effect.

For block ``l`` the residual stream after the block (the ``blocks.l.resid2`` hook point)
gives every patch token ``i`` of image ``b`` a norm ``n[b, l, i] = ||x_{b,l,i}||_2``. A token
is an outlier at block ``l`` when ``n[b, l, i] > k * median_l``, where ``median_l`` is the
median of ``n[:, l, :]`` over every patch token of every image given (one number per block).

Darcet et al. (2024, "Vision Transformers Need Registers") call tokens "high-norm" by an
absolute cut-off read off a bimodal norm histogram (norm above 150 at the output of DINOv2
ViT-g); an absolute number does not carry to a small model of another width, so the
criterion here is relative to the block's median, with ``k = 10`` by default (a conservative
cut; the absolute norms are kept, so a histogram gap or any other cut can be applied later).

CLS attention: the last block's class-token row, heads averaged, over the patch columns
(``methods.cls_attention``). For an image, the outliers' attention share is their part of
that row's mass on patches, beside their token share (outliers / patches): a share far above
the token share means CLS attends to them. The causal effect is ``causal.single_token_effects``.

Positive control (``planted_control``): a detector that never fires says nothing until it is
shown to fire. The control plants one high-norm token per image: at block ``l`` (the middle
block) it sets patch token ``i`` of the residual stream to ``r x`` the block's median patch-token
norm of the unplanted images (same direction as the token it replaces), for a ladder of ratios
``r`` around ``k``, and runs the same detector on the planted stream. It must flag the planted
token in every image once ``r`` clears ``k`` (the median itself moves a little with the plant, so
the smallest ratio flagged is ``k`` times that shift, a few percent above ``k``), and nothing
below it; with nothing planted it reports how many tokens it flags on its own (the negative
side). docs/attribution.md states the threshold measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workbench.attribution.concentration import AttentionConcentration, concentration
from workbench.attribution.glassbox import PatchLayout, as_glassbox, evaluating, layout_of
from workbench.models.hooks import attached, record_hooks

DEFAULT_K = 10.0
# The planted token's norm as a multiple of k x the unplanted median: below, near and above the cut.
PLANTED_STEPS = (0.2, 0.5, 0.8, 0.9, 0.95, 0.99, 1.01, 1.05, 1.1, 1.2, 1.5, 2.0, 5.0)
PLANTED_IMAGES = 32  # images the control plants in (the first of the scored ones)


@dataclass
class TokenNorms:
    """Norms and outliers of one set of images.

    Attributes:
        norms: ``(B, L, P)`` float64 L2 norm of each patch token after each block.
        prefix_norms: ``(B, L, prefix)`` the class and register tokens' norms (never outliers).
        median: ``(L,)`` each block's median patch-token norm.
        k: The cut-off factor; ``outlier = norms > k * median``.
        outlier: ``(B, L, P)`` bool.
        layout: Where patch ``i`` sits (``layout.row_col``).
        cls_attention: ``(B, P)`` last-block CLS attention over the patches (heads averaged).
        concentration: Per block, how concentrated CLS attention is (``concentration.concentration``).
    """

    norms: np.ndarray
    prefix_norms: np.ndarray
    median: np.ndarray
    k: float
    outlier: np.ndarray
    layout: PatchLayout
    cls_attention: np.ndarray
    concentration: AttentionConcentration

    @property
    def outlier_fraction(self) -> np.ndarray:
        """``(L,)`` share of patch tokens above ``k x`` the block's median."""
        return self.outlier.mean(axis=(0, 2))

    def outlier_grid(self) -> np.ndarray:
        """``(L, rows, cols)`` how many images have an outlier at each patch position."""
        return self.outlier.sum(axis=0).reshape(self.outlier.shape[1], *self.layout.grid)

    def outlier_positions(self, block: int) -> np.ndarray:
        """``(n, 3)`` ``(image, row, col)`` of every outlier at ``block``."""
        image, patch = np.nonzero(self.outlier[:, block])
        row, col = self.layout.row_col(patch)
        return np.stack([image, row, col], axis=1)

    def attention_share(self) -> tuple[np.ndarray, np.ndarray]:
        """Per image and block, ``(B, L)`` pairs: the outliers' share of CLS patch attention, their token share.

        NaN where an image has no outlier at that block.
        """
        # (B, P) over patches
        attn = self.cls_attention / self.cls_attention.sum(axis=1, keepdims=True)
        mass = (self.outlier * attn[:, None, :]).sum(axis=2)  # (B, L)
        tokens = self.outlier.mean(axis=2)
        none = ~self.outlier.any(axis=2)
        return np.where(none, np.nan, mass), np.where(none, np.nan, tokens)

    def effect_of_outliers(self, effects: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(L,)`` mean causal effect of the outlier tokens and of the other tokens, per block (NaN: none)."""
        e = np.asarray(effects, dtype=np.float64)[:, None, :]  # (B, 1, P)
        inside = np.where(self.outlier, e, np.nan)
        outside = np.where(~self.outlier, e, np.nan)
        with np.errstate(invalid="ignore"):
            return _nanmean(inside), _nanmean(outside)


def _nanmean(values: np.ndarray) -> np.ndarray:
    count = np.isfinite(values).sum(axis=(0, 2))
    total = np.nansum(values, axis=(0, 2))
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _class_row(store: dict[str, torch.Tensor], stage: str):
    """A hook keeping only the class token's row ``(B, H, N)`` of an attention map (not the ``N x N`` map)."""

    def keep(x: torch.Tensor) -> None:
        store[stage] = x[:, :, 0].detach().to(torch.float64).cpu()

    return keep


@torch.no_grad()
def token_norms(
    model,
    images: torch.Tensor,
    *,
    k: float = DEFAULT_K,
    batch_size: int = 200,
    hooks: Sequence[tuple[str, Callable]] = (),
) -> TokenNorms:
    """Record every block's ``resid2`` and class-token attention row, one call per batch (hooks only).

    Args:
        hooks: ``(stage, hook)`` attached before the recording hooks (``planted_control`` plants
            a token with one: the norms are then those of the edited stream).
    """
    glass = as_glassbox(model)
    if not k > 0:
        raise ValueError(f"k={k!r}: the norm cut-off factor must be > 0")
    layout = layout_of(glass)
    depth, p = glass.cfg.depth, layout.prefix
    stages = [f"blocks.{i}.resid2" for i in range(depth)]
    probs = [f"blocks.{i}.attn.probs" for i in range(depth)]
    norms, rows = [], []
    with evaluating(glass):
        for start in range(0, images.shape[0], batch_size):
            record: dict[str, torch.Tensor] = {}
            recording = record_hooks(record, stages) + [(s, _class_row(record, s)) for s in probs]
            with attached(glass, [*hooks, *recording]):
                glass(images[start : start + batch_size])
            norms.append(
                torch.stack([record[s].to(torch.float64).norm(dim=-1) for s in stages], dim=1).cpu()
            )
            rows.append(torch.stack([record[s] for s in probs], dim=1))  # (b, L, H, N)
    all_norms = torch.cat(norms).numpy()  # (B, L, N)
    cls_rows = torch.cat(rows).numpy()
    patch = all_norms[:, :, p:]
    median = np.median(patch.transpose(1, 0, 2).reshape(depth, -1), axis=1)
    return TokenNorms(
        norms=patch,
        prefix_norms=all_norms[:, :, :p],
        median=median,
        k=float(k),
        outlier=patch > k * median[None, :, None],
        layout=layout,
        cls_attention=cls_rows[:, -1].mean(axis=1)[:, p:],
        concentration=concentration(cls_rows, p),
    )


@dataclass(frozen=True)
class PlantedControl:
    """The detector's positive control: one token per image planted at a known norm, flagged or not.

    Attributes:
        block: The block whose residual stream holds the planted token.
        position: The planted patch token (index among the patch tokens).
        k: The detector's cut (a multiple of the block's median).
        ratios: ``(R,)`` the planted token's norm over the block's unplanted median patch-token norm.
        flagged: ``(R,)`` share of the images whose planted token the detector flags at ``block``.
        others_flagged: ``(R,)`` share of the other patch tokens flagged at ``block`` with the plant.
        clean_flagged: Share of the patch tokens flagged at ``block`` with nothing planted.
        images: How many images the control planted in.
    """

    block: int
    position: int
    k: float
    ratios: np.ndarray
    flagged: np.ndarray
    others_flagged: np.ndarray
    clean_flagged: float
    images: int

    @property
    def threshold(self) -> float:
        """The smallest planted ratio flagged in every image, above which every ratio is (NaN: none)."""
        always = self.flagged == 1.0
        if not always[-1]:
            return float("nan")
        first = len(always) - int(np.argmin(always[::-1])) if not always.all() else 0
        return float(self.ratios[first])

    @property
    def detects(self) -> bool:
        """Every image's planted token flagged at every ratio from ``2 k`` up, none below ``k``."""
        above, below = self.ratios >= 2 * self.k, self.ratios < self.k
        return bool(
            above.any() and (self.flagged[above] == 1.0).all() and (self.flagged[below] == 0).all()
        )

    def arrays(self) -> dict[str, np.ndarray]:
        """As a cell's ``per_image.npz`` holds it (``norm_control/<name>``)."""
        return {
            "norm_control/block": np.int64(self.block),
            "norm_control/position": np.int64(self.position),
            "norm_control/ratios": self.ratios,
            "norm_control/flagged": self.flagged,
            "norm_control/others_flagged": self.others_flagged,
            "norm_control/clean_flagged": np.float64(self.clean_flagged),
            "norm_control/images": np.int64(self.images),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], k: float) -> PlantedControl | None:
        """The control a cell's arrays hold (``arrays()``), None when they hold none."""
        c = {name: arrays.get(f"norm_control/{name}") for name in ("block", "position", "images")}
        if any(v is None for v in c.values()):
            return None
        return cls(
            block=int(c["block"]),
            position=int(c["position"]),
            k=float(k),
            ratios=np.asarray(arrays["norm_control/ratios"], dtype=np.float64),
            flagged=np.asarray(arrays["norm_control/flagged"], dtype=np.float64),
            others_flagged=np.asarray(arrays["norm_control/others_flagged"], dtype=np.float64),
            clean_flagged=float(arrays["norm_control/clean_flagged"]),
            images=int(c["images"]),
        )


def _plant(position: int, norm: float):
    """A hook setting one token of a ``(B, N, D)`` stream to ``norm``, in its own direction."""

    def hook(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        token = x[:, position]
        x[:, position] = token / token.norm(dim=-1, keepdim=True).clamp_min(1e-12) * norm
        return x

    return hook


def planted_control(
    model,
    images: torch.Tensor,
    *,
    k: float = DEFAULT_K,
    batch_size: int = 200,
    block: int | None = None,
    position: int | None = None,
    steps: Sequence[float] = PLANTED_STEPS,
) -> PlantedControl:
    """Plant a token at ``r x`` the block's median norm for each ``r = step x k`` and run the detector.

    Args:
        images: The images to plant in (the model's inputs).
        block: Where to plant (default: the middle block); the detector is read at this block.
        position: Which patch token (default: the middle of the patch sequence).
        steps: The planted ratios as multiples of ``k``.
    """
    glass = as_glassbox(model)
    clean = token_norms(glass, images, k=k, batch_size=batch_size)
    depth, patches = clean.norms.shape[1], clean.norms.shape[2]
    block = depth // 2 if block is None else block
    position = patches // 2 if position is None else position
    median = float(clean.median[block])
    others = np.ones(patches, dtype=bool)
    others[position] = False
    ratios = np.asarray(steps, dtype=np.float64) * k
    flagged, others_flagged = [], []
    for r in ratios:
        hook = (f"blocks.{block}.resid2", _plant(clean.layout.prefix + position, r * median))
        planted = token_norms(glass, images, k=k, batch_size=batch_size, hooks=[hook])
        flagged.append(planted.outlier[:, block, position].mean())
        others_flagged.append(planted.outlier[:, block, others].mean())
    return PlantedControl(
        block=block,
        position=position,
        k=float(k),
        ratios=ratios,
        flagged=np.asarray(flagged, dtype=np.float64),
        others_flagged=np.asarray(others_flagged, dtype=np.float64),
        clean_flagged=float(clean.outlier[:, block].mean()),
        images=int(images.shape[0]),
    )
