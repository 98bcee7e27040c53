"""The two attention figures of a model on a batch of images, with their artifact checks.

Shared by the study figures and the timm inspection, so both present maps the same way:
last-layer attention and rollout side by side, per-head maps of one block, each map
checked by the background-artifact criterion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.figure import Figure

from workbench.analysis.artifacts import ArtifactCheck, background_patches, check_maps
from workbench.analysis.attention_figures import head_maps_figure, overlay_figure
from workbench.analysis.common import display_images
from workbench.analysis.rollout import AttentionAnalysis, analyse_attention
from workbench.data.transforms import NormStats
from workbench.models.vit import VisionTransformer

LAST = "last-layer attention (heads averaged)"
ROLLOUT = "attention rollout"
POOL = "attention-pool query (heads averaged)"


@dataclass
class AttentionFigures:
    """Rollout and head figures, the analysis behind them and the artifact counts.

    Attributes:
        rollout: Last-layer attention and rollout overlays.
        heads: Per-head maps of ``block``.
        block: The block shown per head (non-negative).
        analysis: Attention maps and rollout.
        shown: Display images ``(B, H, W, C)`` in [0, 1].
        checks: ``"rollout"`` / ``"heads"`` -> every map's artifact check.
    """

    rollout: Figure
    heads: Figure
    block: int
    analysis: AttentionAnalysis
    shown: np.ndarray
    checks: dict[str, list[ArtifactCheck]]

    def flagged(self, name: str) -> tuple[int, int]:
        """(maps flagged, maps checked) of ``"rollout"`` or ``"heads"``."""
        return sum(c.flagged for c in self.checks[name]), len(self.checks[name])


def check_block(block: int, depth: int) -> None:
    """Refuse a block index the model does not have (Python's negative indices allowed).

    Raises:
        ValueError: naming the index and the valid range.
    """
    if not -depth <= block < depth:
        raise ValueError(
            f"block {block} does not exist: the model has {depth} blocks "
            f"(give 0 to {depth - 1}, or -{depth} to -1 counting from the last)"
        )


def attention_figures(
    model: VisionTransformer,
    x: torch.Tensor,
    norm: NormStats,
    where: str,
    row_labels: Callable[[torch.Tensor], list[str]],
    block: int = -1,
) -> AttentionFigures:
    """Analyse ``x`` and draw the rollout and per-head figures.

    Args:
        model: Glass-box ViT.
        x: Normalised inputs ``(B, C, H, W)``.
        norm: Their normalisation (to show the images).
        where: Model/run description for the titles.
        row_labels: Logits ``(B, K)`` -> one label per image.
        block: Block of the per-head figure (negative counts from the end).
    """
    check_block(block, model.cfg.depth)
    shown = display_images(x, norm)
    analysis = analyse_attention(model, x)
    background = background_patches(
        torch.from_numpy(shown).permute(0, 3, 1, 2), model.cfg.patch_size
    )
    rows = row_labels(analysis.logits)
    last = analysis.last_layer.maps
    query = analysis.layout.query_label
    if (
        analysis.rollout_maps is None
    ):  # no token carries the prediction: say so, draw what the head reads
        checks = {POOL: check_maps(last, background)}
        rollout = overlay_figure(
            shown,
            {POOL: last.numpy()},
            f"Attention-pool map: {where}\n{analysis.statement}",
            rows,
            checks,
        )
    else:
        roll = analysis.rollout_maps.maps
        label = POOL if analysis.layout.head == "pool" else LAST
        checks = {label: check_maps(last, background), ROLLOUT: check_maps(roll, background)}
        rollout = overlay_figure(
            shown,
            {label: last.numpy(), ROLLOUT: roll.numpy()},
            f"Attention rollout and last-layer attention: {where}\nmaps read from the {query}",
            rows,
            checks,
        )
    block = block % len(analysis.attentions)
    heads = analysis.head_maps(block).maps  # (B, heads, rows, cols)
    n_heads = heads.shape[1]
    head_checks = [check_maps(heads[:, h], background) for h in range(n_heads)]  # [head][image]
    per_image = [[head_checks[h][i] for h in range(n_heads)] for i in range(len(shown))]
    block_query = (
        "CLS token row" if analysis.layout.query == "cls" else "mean over patch-token rows"
    )
    head_fig = head_maps_figure(
        shown,
        heads.numpy(),
        block,
        f"Attention per head: {where}\nmaps read from the {block_query}",
        rows,
        per_image,
    )
    return AttentionFigures(
        rollout,
        head_fig,
        block,
        analysis,
        shown,
        {
            "rollout": [c for cs in checks.values() for c in cs],
            "heads": [c for cs in head_checks for c in cs],
        },
    )
