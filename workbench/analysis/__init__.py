"""Analysis: attention rollout and maps, embedding views, and the figures built from them.

Pure functions returning tensors, arrays and matplotlib figures (Agg, no pyplot); nothing
here logs anywhere (``tracking.kinds.figure_runs`` logs the figures to MLflow).

Usage::

    from workbench.analysis import analyse_attention, attention_rollout, save_png
    from workbench.analysis.panels import attention_figures

    analysis = analyse_attention(model, images)          # analysis mode, any fast-path setting
    analysis.rollout                                     # (B, N, N), rows sum to 1
    analysis.rollout_maps.maps                           # (B, rows, cols) per-patch maps
    figs = attention_figures(model, images, norm, "my model", lambda logits: ["a", "b"])
    save_png(figs.rollout, "rollout.png")
"""

from workbench.analysis.artifacts import (
    CRITERION,
    ArtifactCheck,
    background_patches,
    check_maps,
)
from workbench.analysis.common import DIAGNOSTIC, display_images, png_bytes, save_png
from workbench.analysis.embeddings import pooled_features, position_similarity, tsne_2d
from workbench.analysis.rollout import (
    AttentionAnalysis,
    PatchMaps,
    TokenLayout,
    analyse_attention,
    attention_rollout,
    patch_maps,
)

__all__ = [
    "CRITERION",
    "DIAGNOSTIC",
    "ArtifactCheck",
    "AttentionAnalysis",
    "PatchMaps",
    "TokenLayout",
    "analyse_attention",
    "attention_rollout",
    "background_patches",
    "check_maps",
    "display_images",
    "patch_maps",
    "png_bytes",
    "pooled_features",
    "position_similarity",
    "save_png",
    "tsne_2d",
]
