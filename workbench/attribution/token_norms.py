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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workbench.attribution.concentration import AttentionConcentration, concentration
from workbench.attribution.glassbox import PatchLayout, as_glassbox, evaluating, layout_of
from workbench.models.hooks import attached, record_hooks

DEFAULT_K = 10.0


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
        attn = self.cls_attention / self.cls_attention.sum(
            axis=1, keepdims=True
        )  # (B, P) over patches
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
    model, images: torch.Tensor, *, k: float = DEFAULT_K, batch_size: int = 200
) -> TokenNorms:
    """Record every block's ``resid2`` and class-token attention row, one call per batch (hooks only)."""
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
            hooks = record_hooks(record, stages) + [(s, _class_row(record, s)) for s in probs]
            with attached(glass, hooks):
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
