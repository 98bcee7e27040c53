"""Attribution methods scored against exact causal effects, and token norms.

A pure library on the glass-box ViT's hook points (``workbench.models.hooks``): no second
forward body, nothing logged. Definitions and measured costs: docs/attribution.md.

Usage::

    from workbench.attribution import score_cell

    cell = score_cell(model, images, labels, ["cls_attention", "rollout", "chefer", "grad_x_input", "random"],
                      seed=0, k=10.0)
    cell.summary()             # per method: mean Spearman rho, deletion and insertion AUC
    cell.causal.effects        # (B, P) log p_full(y) - log p_without_token(y)
    cell.norms.outlier_fraction
    cell.norms.concentration.entropy   # (B, L) normalised entropy of each block's CLS attention over the patches
"""

from workbench.attribution.agreement import (
    attention_mass_on,
    mean_rho,
    spearman_per_image,
    top_mask,
)
from workbench.attribution.causal import CausalEffects, single_token_effects, true_log_prob
from workbench.attribution.cell import CellAttribution, MethodSummary, score_cell
from workbench.attribution.concentration import AttentionConcentration, concentration, top_count
from workbench.attribution.curves import (
    Curves,
    auc,
    count_grid,
    even_counts,
    order_of,
    perturbation_curves,
)
from workbench.attribution.glassbox import AttributionError, PatchLayout, as_glassbox, layout_of
from workbench.attribution.methods import (
    METHODS,
    attribute,
    chefer,
    cls_attention,
    grad_x_input,
    random_order,
    random_scores,
    rollout,
)
from workbench.attribution.token_drop import all_but_one, keep_patches_hook, logits_keeping
from workbench.attribution.token_norms import DEFAULT_K, TokenNorms, token_norms

__all__ = [
    "AttentionConcentration",
    "AttributionError",
    "CausalEffects",
    "CellAttribution",
    "Curves",
    "DEFAULT_K",
    "METHODS",
    "MethodSummary",
    "PatchLayout",
    "TokenNorms",
    "all_but_one",
    "as_glassbox",
    "attention_mass_on",
    "attribute",
    "auc",
    "chefer",
    "cls_attention",
    "concentration",
    "count_grid",
    "even_counts",
    "grad_x_input",
    "keep_patches_hook",
    "layout_of",
    "logits_keeping",
    "mean_rho",
    "order_of",
    "perturbation_curves",
    "random_order",
    "random_scores",
    "rollout",
    "score_cell",
    "single_token_effects",
    "spearman_per_image",
    "token_norms",
    "top_count",
    "top_mask",
    "true_log_prob",
]
