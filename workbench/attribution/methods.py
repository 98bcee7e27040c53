"""Attribution methods: ``(model, images, labels) -> (B, num_patches)`` scores, higher = more important.

Each method acts on a glass-box ViT in eval mode (``glassbox.as_glassbox``; the previous
mode is restored), reads the model only through its hook points (``workbench.models.hooks``),
scores every patch token and never a class or register token. ``labels`` are the true
classes: gradient methods explain the true-class logit ``z_y`` (not the predicted class).
Notation: ``A_l`` is block ``l``'s attention map ``(B, heads, N, N)`` (softmax probabilities,
query rows, key columns; token 0 is the class token, the ``p`` prefix tokens come first),
``E_h`` the mean over heads, ``[.]^+`` the positive part.

- ``cls_attention``: ``E_h A_L[0, p + i]``, the last block's class-token row over the patch
  columns, heads averaged, not renormalised (the mass on the prefix tokens is left out).
- ``rollout``: seed 003's rollout ``R = prod_l (0.5 E_h A_l + 0.5 I)`` (block 1 rightmost),
  score ``R[0, p + i]``. It is ``workbench.analysis.rollout.attention_rollout``, which
  renormalises each factor's rows after adding the identity; the rows of ``0.5 A + 0.5 I``
  already sum to 1 (``A`` is row-stochastic), so that is a no-op up to rounding and both
  definitions agree.
- ``chefer``: Chefer, Gur & Wolf, "Generic Attention-model Explainability for Interpreting
  Bi-Modal and Encoder-Decoder Transformers" (ICCV 2021), eqs. (5) and (6) for self-attention:
  ``Abar_l = E_h [(dz_y/dA_l) * A_l]^+`` (elementwise product, positive part per head, then
  the head mean), ``R = I`` then for each block in order ``R <- R + Abar_l R``; score
  ``R[0, p + i]``. It is their ViT code's ``generate_relevance`` (Transformer-MM-Explainability)
  and the simplified form of the CVPR 2021 method ("Transformer Interpretability Beyond
  Attention Visualization"), whose ``R^{(A)}`` is an LRP relevance where this rule uses ``A``
  itself. The gradients are of ``z_y`` w.r.t. each block's attention probabilities, read at
  the ``blocks.l.attn.probs`` hook points while they are in the autograd graph (a hook on a
  map switches its block to the written-out attention for the call; the fused kernel never
  forms the map).
- ``grad_x_input``: ``sum_{c, pixels of patch i} x * dz_y/dx`` (gradient times input,
  summed over the channels and pixels of each patch; pixels beyond the patch grid, which the
  model never sees, are left out).
- ``random``: ``U(0, 1)`` scores from ``torch.Generator().manual_seed(seed)``, drawn as one
  ``(B, P)`` tensor: a random order, the baseline; deterministic given the seed and the
  image's position in ``images``.
- ``intensity`` and ``centre``: trivial baselines that never run the model
  (``workbench.attribution.controls``); ``oracle``: the exact single-token effects as scores,
  computed by ``score_cell`` with the effects (a reference, not a method one could use).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workbench.analysis.rollout import attention_rollout
from workbench.attribution.controls import centre, intensity
from workbench.attribution.glassbox import AttributionError, as_glassbox, evaluating, layout_of
from workbench.models.hooks import attached, record_hooks
from workbench.models.vit import VisionTransformer


def _probs_stages(model: VisionTransformer) -> list[str]:
    return [f"blocks.{i}.attn.probs" for i in range(model.cfg.depth)]


def _checked(model, images: torch.Tensor, labels: torch.Tensor) -> VisionTransformer:
    glass = as_glassbox(model)
    if images.dim() != 4 or labels.shape != (images.shape[0],):
        raise AttributionError(
            f"images {tuple(images.shape)} and labels {tuple(labels.shape)}: expected "
            "(B, C, H, W) and (B,)"
        )
    if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < glass.cfg.num_classes:
        raise AttributionError(
            f"labels must lie in 0..{glass.cfg.num_classes - 1}, got {int(labels.min())}.."
            f"{int(labels.max())}"
        )
    return glass


def _attention_maps(
    model: VisionTransformer, images: torch.Tensor, stages: list[str]
) -> list[torch.Tensor]:
    record: dict[str, torch.Tensor] = {}
    with torch.no_grad(), attached(model, record_hooks(record, stages)):
        model(images)
    return [record[s] for s in stages]


def cls_attention(model, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Last block's class-token attention over the patches, heads averaged: ``(B, P)`` float64."""
    glass = _checked(model, images, labels)
    p = layout_of(glass).prefix
    with evaluating(glass):
        (last,) = _attention_maps(glass, images, _probs_stages(glass)[-1:])
    return last.to(torch.float64).mean(dim=1)[:, 0, p:]


def rollout(model, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Attention rollout ``prod_l (0.5 E_h A_l + 0.5 I)``, the class token's row over the patches: ``(B, P)``."""
    glass = _checked(model, images, labels)
    p = layout_of(glass).prefix
    with evaluating(glass):
        maps = _attention_maps(glass, images, _probs_stages(glass))
    return attention_rollout(maps, residual=0.5)[:, 0, p:]


def _true_logit(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Images do not interact in eval mode, so the gradient of the sum is each image's own gradient.
    return logits.gather(1, labels.to(logits.device).view(-1, 1)).sum()


def chefer(model, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Chefer et al. (ICCV 2021) gradient-weighted relevance, ``R[0, p:]`` after ``R += Abar_l R``: ``(B, P)``."""
    glass = _checked(model, images, labels)
    p = layout_of(glass).prefix
    stages = _probs_stages(glass)
    record: dict[str, torch.Tensor] = {}
    # The input needs a gradient so the maps are in the graph even when the weights are frozen.
    x = images.detach().clone().requires_grad_(True)
    with evaluating(glass), torch.enable_grad():
        with attached(
            glass, record_hooks(record, stages)
        ):  # the recorder keeps the map itself, in the graph
            logits = glass(x)
        maps = [record[s] for s in stages]
        grads = torch.autograd.grad(_true_logit(logits, labels), maps)
    n = maps[0].shape[-1]
    relevance = torch.eye(n, dtype=torch.float64, device=x.device).expand(x.shape[0], n, n)
    for a, g in zip(maps, grads):
        # (B, N, N)
        weighted = (
            (g.detach().to(torch.float64) * a.detach().to(torch.float64)).clamp(min=0).mean(dim=1)
        )
        relevance = relevance + weighted @ relevance
    return relevance[:, 0, p:]


def grad_x_input(model, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Input gradient of the true-class logit times the input, summed per patch: ``(B, P)`` float64."""
    glass = _checked(model, images, labels)
    (rows, cols), (ph, pw) = glass.cfg.grid, glass.cfg.patch_hw
    x = images.detach().clone().requires_grad_(True)
    with evaluating(glass), torch.enable_grad():
        (grad,) = torch.autograd.grad(_true_logit(glass(x), labels), [x])
    # only the pixels the model sees
    product = (grad * x.detach()).to(torch.float64)[:, :, : rows * ph, : cols * pw]
    B, C = product.shape[:2]
    per_patch = product.reshape(B, C, rows, ph, cols, pw).sum(dim=(1, 3, 5))  # (B, rows, cols)
    return per_patch.reshape(B, rows * cols)  # row-major: the patch tokens' order


def random_scores(num_images: int, num_patches: int, seed: int) -> torch.Tensor:
    """``(num_images, num_patches)`` uniform scores from a generator seeded with ``seed``: a random order."""
    generator = torch.Generator().manual_seed(int(seed))
    return torch.rand(num_images, num_patches, generator=generator, dtype=torch.float64)


def random_order(model, images: torch.Tensor, labels: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The baseline: seeded random scores ``(B, P)`` (the model is only checked, never run)."""
    glass = _checked(model, images, labels)
    return random_scores(images.shape[0], glass.cfg.num_patches, seed)


Method = Callable[[VisionTransformer, torch.Tensor, torch.Tensor], torch.Tensor]

# Method name -> function; ``random`` takes the seed as a keyword.
METHODS: dict[str, Callable[..., torch.Tensor]] = {
    "cls_attention": cls_attention,
    "rollout": rollout,
    "chefer": chefer,
    "grad_x_input": grad_x_input,
    "random": random_order,
    "intensity": intensity,
    "centre": centre,
}
# Scored by ``score_cell`` from the causal effects it computes, not by a function of the model.
ORACLE = "oracle"


def check_methods(methods) -> tuple[str, ...]:
    names = tuple(methods)
    valid = ", ".join([*METHODS, ORACLE])
    if not names:
        raise AttributionError(f"no attribution method given; valid methods: {valid}")
    unknown = [m for m in names if m not in METHODS and m != ORACLE]
    if unknown:
        raise AttributionError(f"unknown attribution method {unknown[0]!r}; valid methods: {valid}")
    if len(set(names)) != len(names):
        raise AttributionError(f"methods {list(names)}: each method once")
    return names


def attribute(
    model,
    images: torch.Tensor,
    labels: torch.Tensor,
    methods,
    *,
    seed: int = 0,
    batch_size: int = 100,
) -> dict[str, torch.Tensor]:
    """Every method's ``(B, P)`` float64 scores, in batches of ``batch_size`` images (random: one draw for all)."""
    names = check_methods(methods)
    glass = _checked(model, images, labels)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name == ORACLE:
            raise AttributionError("oracle scores are the causal effects: score_cell computes them")
        if name == "random":
            out[name] = random_order(glass, images, labels, seed=seed)
            continue
        parts = [
            METHODS[name](glass, images[i : i + batch_size], labels[i : i + batch_size])
            for i in range(0, images.shape[0], batch_size)
        ]
        out[name] = torch.cat(parts).to(torch.float64).cpu()
    return out
