"""An activation cache and hooks for one call, in the habits of TransformerLens.

``run_with_cache(model, x, names_filter=...)`` returns the logits and an ``ActivationCache``
keyed by hook-point names (the stage vocabulary plus the finer points ``blocks.i.attn.z``
and ``pos_embed``); ``cache.stack("resid2")`` stacks one stage over the blocks,
``(L, B, N, D)``. ``run_with_hooks(model, x, fwd_hooks=[(name, fn), ...])`` runs the model
with hooks ``fn(activation, hook) -> replacement or None`` attached for that call only: every
hook is removed when the call returns or raises.

Names and module paths. A hook point's name is its parent module's path plus its local
name; its module path is the parent's path plus its attribute, ``hook_<local name>`` with
dots turned to underscores. So ``blocks.0.resid1`` is the module ``blocks.0.hook_resid1``,
``blocks.0.attn.z`` is ``blocks.0.attn.hook_z`` and ``patch_embed.norm`` is
``hook_patch_embed_norm``. The stage names cannot be the module paths themselves:
``blocks.0.attn`` is both the attention module and the stage after it. ``hook_path`` and
``hook_name`` give the mapping both ways, from the model itself (``model.get_submodule(
hook_path(model, name))`` is the hook point); every function here accepts either form.

The model has the same calls as methods (``model.run_with_cache``, ``model.run_with_hooks``,
``model.hooks``, ``model.hook_dict``): both are ``workbench.models.activation_cache``, which
also holds the ``ActivationCache`` and its TransformerLens methods (``stack_head_results``,
``accumulated_resid``, ``decompose_resid``, ``apply_ln_to_stack``, ``logit_attrs``, ...).

Any timm ``VisionTransformer`` works too: it is first converted to a glass-box copy through
the exact weight mapping (``workbench.convert.timm_vit.glassbox_from_timm``, equal to timm at
0.0 on the written-out attention path), and the hooks act on that copy; the timm model is
not touched. Convert once with ``as_glassbox`` when calling many times.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from workbench.interventions.spec import InterventionError
from workbench.models.activation_cache import ActivationCache, Metric, NamesFilter
from workbench.models.hooks import HookError, UserHook, resolve_hook
from workbench.models.vit import VisionTransformer


def as_glassbox(model: nn.Module) -> VisionTransformer:
    """The model itself if it is a glass-box ViT, else its exact glass-box copy (a timm ViT).

    Raises:
        InterventionError: A model that is neither (the mapping's reason in the message).
    """
    if isinstance(model, VisionTransformer):
        return model
    from workbench.convert.timm_vit import UnsupportedTimmModel, glassbox_from_timm

    try:
        glass, _ = glassbox_from_timm(model)
    except UnsupportedTimmModel as exc:
        raise InterventionError(f"{type(model).__name__}: no glass-box copy: {exc}") from None
    except (AttributeError, KeyError, TypeError) as exc:
        raise InterventionError(
            f"{type(model).__name__} is neither a glass-box ViT nor a timm VisionTransformer "
            f"({exc})"
        ) from None
    return glass


def hook_path(model: nn.Module, name: str) -> str:
    """The module path of hook point ``name`` (a module path is returned as it is)."""
    return _resolve(model, name)[1]


def hook_name(model: nn.Module, path: str) -> str:
    """The hook-point name of module path ``path`` (a hook-point name is returned as it is)."""
    return _resolve(model, path)[0]


def _resolve(model: nn.Module, name_or_path: str) -> tuple[str, str]:
    try:
        return resolve_hook(model, name_or_path)
    except HookError as exc:
        raise InterventionError(str(exc)) from None


def run_with_cache(
    model: nn.Module,
    x: torch.Tensor,
    names_filter: NamesFilter = None,
    fwd_hooks: Iterable[tuple[str, UserHook]] = (),
    incl_bwd: bool = False,
    metric: Metric | None = None,
) -> tuple[torch.Tensor, ActivationCache]:
    """``model.run_with_cache`` on a glass-box ViT or a timm ViT's glass-box copy.

    Args:
        model: A glass-box ViT, or a timm ViT (run through its exact glass-box copy).
        x: Images (B, C, H, W).
        names_filter: None (every hook point), a name, a list of names (or module paths), or
            a predicate on names; one that keeps nothing is refused.
        fwd_hooks: Hooks run on the same call (``run_with_hooks``); a cached activation is
            what the rest of the forward saw at that point: after a hook on it edited it.
        incl_bwd: Also cache ``<name>_grad``, the gradient of ``metric(logits)`` there.
        metric: ``fn(logits) -> scalar``, needed with ``incl_bwd``.

    The cache holds what the forward computed: a hook on an attention map (``attn.probs``)
    runs its block on the written-out path for the call, as analysis mode does.
    """
    return as_glassbox(model).run_with_cache(x, names_filter, incl_bwd, fwd_hooks, metric)


def run_with_hooks(
    model: nn.Module,
    x: torch.Tensor,
    fwd_hooks: Iterable[tuple[str, UserHook]] = (),
    bwd_hooks: Iterable[tuple[str, UserHook]] = (),
    metric: Metric | None = None,
) -> torch.Tensor:
    """Logits of one forward with ``fwd_hooks`` attached; every hook is removed on return or error.

    ``fn(activation, hook)`` receives the activation and the hook point (``hook.name``);
    what it returns (if not None) replaces the activation for the rest of the forward: a
    tensor of the same shape and dtype, else a one-line ``HookError`` naming the point.
    Hooks on one point run in the order given. ``bwd_hooks`` run on the gradients of
    ``metric(logits)`` (``model.run_with_hooks``).
    """
    return as_glassbox(model).run_with_hooks(x, fwd_hooks, bwd_hooks, metric)


def logit_lens(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Each block's output read by the model's own final norm and head: (L, B, classes).

    On a CLS-pooled model that is the class token of each block, normed with its own
    statistics and put through the classifier; the last entry is the logits ``model(x)``.
    One forward (``ActivationCache.logit_lens``).
    """
    _, cache = run_with_cache(model, x, names_filter=lambda name: name.endswith(".resid2"))
    return cache.logit_lens()
