"""Attention rollout and per-patch attention maps, always from the analysis mode.

Rollout (Abnar & Zuidema, 2020) models the residual stream as half attention, half
identity: with ``Â_l = rownorm(0.5 · mean_heads(A_l) + 0.5 · I)`` the token-to-token
relevance after ``L`` blocks is ``R = Â_L ··· Â_1`` (block 1 is applied to the input
first, so it sits rightmost). Public implementations often get three things wrong, each
handled here: rows are renormalised after adding the identity, every batch element is
kept (batched matrix products, no ``[0]``), and the maps come from
``forward_analysis``, which runs the written-out attention whatever the fast-path setting,
so a model usually run with fused attention still yields maps.

Reading maps off a token-to-token matrix depends on how the model pools: a CLS model's
head reads the class token, so its map is the CLS row over the patch columns; a model
that mean-pools patch tokens has no single query, so its map is the mean over the
patch-token rows. ``TokenLayout`` records which one applies so figures can say so.

A model with an attention-pool head (SigLIP, ``pooling="map"``) reads one learned latent
query: what the head reads is that query's attention over the tokens, shown instead of
the last block's map. Rollout follows a token through the residual stream, so it is
drawn where a class token exists; without one (SigLIP) there is no token whose row
carries the prediction and the analysis says so (``AttentionAnalysis.statement``)
instead of drawing a map that would mean something else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from workbench.models.vit import VisionTransformer, ViTConfig


@dataclass(frozen=True)
class TokenLayout:
    """Where the patch tokens sit in the sequence and which query the head reads.

    Attributes:
        prefix: Tokens before the patches (class token and register tokens).
        grid: Patches per side, (rows, columns).
        query: ``"cls"``: the class-token row; ``"mean"``: the mean over patch-token rows.
        head: What the classifier reads: ``"cls"``, ``"mean"`` or ``"pool"`` (an
            attention-pool latent query).
        class_token: Whether there is a class token (rollout needs one, or mean pooling).
        pool_prefix: The attention pool also attends to the prefix tokens.
    """

    prefix: int
    grid: tuple[int, int]
    query: Literal["cls", "mean"]
    head: Literal["cls", "mean", "pool"] = "cls"
    class_token: bool = True
    pool_prefix: bool = False

    @classmethod
    def from_config(cls, cfg: ViTConfig) -> TokenLayout:
        # Mean pooling reads every patch token, so no single row stands for the prediction,
        # even when a class token exists but is not used by the head.
        query = "cls" if cfg.class_token and cfg.pooling != "mean" else "mean"
        head = {"cls": "cls", "mean": "mean", "map": "pool"}[cfg.pooling]
        return cls(
            prefix=cfg.num_prefix_tokens,
            grid=cfg.grid,
            query=query,
            head=head,
            class_token=cfg.class_token,
            pool_prefix=cfg.pool_include_prefix,
        )

    @property
    def has_rollout(self) -> bool:
        """Rollout follows the class token, or the patch tokens a mean-pooling head averages."""
        return self.class_token or self.head == "mean"

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def query_label(self) -> str:
        """Words for figure titles."""
        if self.head == "pool":
            return "attention-pool latent query (what the head reads)"
        if self.query == "cls":
            return "CLS token row"
        return "mean over patch-token rows (model has no class token / mean-pools)"


def attention_rollout(attentions: Sequence[torch.Tensor], residual: float = 0.5) -> torch.Tensor:
    """Abnar & Zuidema rollout, heads averaged, rows renormalised, every batch element.

    Args:
        attentions: One ``(B, heads, N, N)`` attention map per block, block 1 first (as
            ``Analysis.attentions`` holds them).
        residual: Weight of the identity (the residual connection); 0.5 in the paper.

    Returns:
        ``(B, N, N)`` float64 rollout ``R = Â_L ··· Â_1``; every row sums to 1.
    """
    if not attentions:
        raise ValueError("attention_rollout needs at least one attention map")
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual={residual!r}: must be in [0, 1]")
    result: torch.Tensor | None = None
    for i, attn in enumerate(attentions):
        if attn.dim() != 4 or attn.shape[-1] != attn.shape[-2]:
            raise ValueError(
                f"attention map {i} has shape {tuple(attn.shape)}; expected (B, heads, N, N)"
            )
        # float64: a product of L row-stochastic matrices should stay row-stochastic to ~1e-15
        a = attn.detach().to(torch.float64).mean(dim=1)  # (B, N, N): heads averaged
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        a = (1.0 - residual) * a + residual * eye
        a = a / a.sum(dim=-1, keepdim=True)  # renormalise rows
        # the newer block multiplies from the left: R_l = Â_l R_{l-1}
        result = a if result is None else a @ result  # (B, N, N)
    assert result is not None
    return result


@dataclass
class PatchMaps:
    """Per-patch maps read off token-to-token matrices.

    Attributes:
        maps: ``(..., rows, cols)`` float64, each map renormalised to sum to 1 over patches.
        patch_mass: ``(...,)`` share of the query's mass that fell on patch tokens before
            renormalising (the rest went to the class/register tokens).
    """

    maps: torch.Tensor
    patch_mass: torch.Tensor


def patch_maps(matrix: torch.Tensor, layout: TokenLayout) -> PatchMaps:
    """What the pooled query attends to, as a map over the patch grid.

    Args:
        matrix: ``(..., N, N)`` row-stochastic token matrix (an attention map or a rollout).
        layout: Token layout of the model.

    Returns:
        Maps of shape ``(..., rows, cols)``.
    """
    p = layout.prefix
    if matrix.shape[-1] != p + layout.num_patches:
        raise ValueError(
            f"matrix has {matrix.shape[-1]} tokens; layout expects {p} prefix + {layout.num_patches} patches"
        )
    m = matrix.detach().to(torch.float64)
    if layout.query == "cls":
        full = m[..., 0, :]  # (..., N): the class token's row
    else:
        full = m[..., p:, :].mean(dim=-2)  # (..., N): mean over patch-token rows
    rows = full[..., p:]  # (..., n_patches)
    mass = rows.sum(dim=-1)
    maps = rows / mass.clamp_min(1e-300).unsqueeze(-1)
    return PatchMaps(maps.reshape(*rows.shape[:-1], *layout.grid), mass / full.sum(dim=-1))


def pool_maps(pool_attention: torch.Tensor, layout: TokenLayout) -> PatchMaps:
    """The attention-pool query's map over the patches, heads averaged.

    Args:
        pool_attention: ``(B, heads, 1, N_pooled)`` from ``Analysis.pool_attention``.
        layout: Token layout; with ``pool_prefix`` the first ``prefix`` columns are tokens.
    """
    full = pool_attention.detach().to(torch.float64).mean(dim=1)[:, 0]  # (B, N_pooled)
    rows = full[:, layout.prefix :] if layout.pool_prefix else full  # (B, n_patches)
    mass = rows.sum(dim=-1)
    maps = rows / mass.clamp_min(1e-300).unsqueeze(-1)
    return PatchMaps(maps.reshape(-1, *layout.grid), mass / full.sum(dim=-1))


NO_ROLLOUT = (
    "no class token and an attention-pool head: rollout is not drawn, because no token's row carries "
    "the prediction; the map shown is the attention-pool query's attention over the patches"
)


@dataclass
class AttentionAnalysis:
    """Everything the attention figures need for one batch of images.

    Attributes:
        layout: Token layout of the model.
        logits: ``(B, classes)``.
        attentions: One ``(B, heads, N, N)`` map per block (float32, as the model ran).
        rollout: ``(B, N, N)`` float64 rollout, or None where it is not defined.
        last_layer: What the head reads, heads averaged, ``(B, rows, cols)``: the last
            block's map, or the attention-pool map for an attention-pool head.
        rollout_maps: Rollout maps ``(B, rows, cols)``, or None.
        statement: Why there is no rollout, where there is none.
    """

    layout: TokenLayout
    logits: torch.Tensor
    attentions: list[torch.Tensor]
    rollout: torch.Tensor | None
    last_layer: PatchMaps
    rollout_maps: PatchMaps | None
    statement: str = ""

    def head_maps(self, block: int) -> PatchMaps:
        """Per-head maps of one block, ``(B, heads, rows, cols)``."""
        if not -len(self.attentions) <= block < len(self.attentions):
            raise IndexError(
                f"block {block} out of range: the model has {len(self.attentions)} blocks"
            )
        return patch_maps(self.attentions[block], self.layout)


@torch.no_grad()
def analyse_attention(
    model: VisionTransformer, images: torch.Tensor, residual: float = 0.5
) -> AttentionAnalysis:
    """Run the analysis mode in eval mode and compute rollout and per-patch maps.

    Args:
        model: A glass-box ViT (its fast-path setting does not matter).
        images: Normalised model inputs ``(B, C, H, W)``.
        residual: Identity weight of the rollout.
    """
    was_training = model.training
    model.eval()  # dropout would make the maps random
    try:
        out = model.forward_analysis(images)
    finally:
        model.train(was_training)
    layout = TokenLayout.from_config(model.cfg)
    if layout.head == "pool":
        last = pool_maps(out.pool_attention, layout)
    else:
        # heads averaged
        last = patch_maps(out.attentions[-1].to(torch.float64).mean(dim=1), layout)
    if not layout.has_rollout:
        return AttentionAnalysis(layout, out.logits, out.attentions, None, last, None, NO_ROLLOUT)
    rollout = attention_rollout(out.attentions, residual)
    return AttentionAnalysis(
        layout, out.logits, out.attentions, rollout, last, patch_maps(rollout, layout)
    )
