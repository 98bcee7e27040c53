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

Any timm ``VisionTransformer`` works too: it is first converted to a glass-box copy through
the exact weight mapping (``workbench.convert.timm_vit.glassbox_from_timm``, equal to timm at
0.0 on the written-out attention path), and the hooks act on that copy; the timm model is
not touched. Convert once with ``as_glassbox`` when calling many times.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from workbench.interventions.spec import InterventionError
from workbench.models.hooks import HookPoint, attached, hook_points
from workbench.models.vit import VisionTransformer

# fn(activation, hook point) -> replacement, or None to leave the activation as it is
FwdHook = Callable[[torch.Tensor, HookPoint], "torch.Tensor | None"]
NamesFilter = str | Iterable[str] | Callable[[str], bool] | None

_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


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


def hook_paths(model: nn.Module) -> dict[str, str]:
    """Hook-point name -> module path, for every hook point (stages first-to-last, finer points beside them)."""
    return {
        module.name: path for path, module in model.named_modules() if isinstance(module, HookPoint)
    }


def hook_path(model: nn.Module, name: str) -> str:
    """The module path of hook point ``name`` (a module path is returned as it is)."""
    return _resolve(model, name)[1]


def hook_name(model: nn.Module, path: str) -> str:
    """The hook-point name of module path ``path`` (a hook-point name is returned as it is)."""
    return _resolve(model, path)[0]


def _resolve(model: nn.Module, name_or_path: str) -> tuple[str, str]:
    paths = hook_paths(model)
    if name_or_path in paths:
        return name_or_path, paths[name_or_path]
    for name, path in paths.items():
        if path == name_or_path:
            return name, path
    raise InterventionError(
        f"no hook point {name_or_path!r} (a name like 'blocks.0.resid1' or a module path like "
        f"'blocks.0.hook_resid1'); the model's hook points: {', '.join(paths)}"
    )


class ActivationCache(Mapping[str, torch.Tensor]):
    """Hook-point name -> activation of one forward, in the order the forward ran them.

    Indexing also accepts a module path (``cache["blocks.0.hook_resid1"]``).
    """

    def __init__(self, activations: dict[str, torch.Tensor], paths: Mapping[str, str]) -> None:
        self._acts = activations
        self._names = {path: name for name, path in paths.items() if name in activations}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._acts:
            return self._acts[key]
        if key in self._names:
            return self._acts[self._names[key]]
        raise KeyError(f"{key!r} is not in the cache; cached: {', '.join(self._acts)}")

    def __iter__(self) -> Iterator[str]:
        return iter(self._acts)

    def __len__(self) -> int:
        return len(self._acts)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations: {', '.join(self._acts)})"

    def blocks_of(self, stage: str) -> list[int]:
        """The block indices whose ``blocks.i.<stage>`` is cached, ascending."""
        found = []
        for name in self._acts:
            match = _BLOCK.match(name)
            if match and match.group(2) == stage:
                found.append(int(match.group(1)))
        return sorted(found)

    def stack(self, stage: str) -> torch.Tensor:
        """``blocks.i.<stage>`` of every cached block stacked on a new first axis: (L, ...).

        ``stack("resid2")`` is (L, B, N, D); ``stack("attn.z")`` is (L, B, N, heads, d).

        Raises:
            KeyError: No block's ``<stage>`` is cached (the message lists what is).
        """
        blocks = self.blocks_of(stage)
        if not blocks:
            raise KeyError(f"no 'blocks.i.{stage}' in the cache; cached: {', '.join(self._acts)}")
        return torch.stack([self._acts[f"blocks.{i}.{stage}"] for i in blocks])


def _selected(model: VisionTransformer, names_filter: NamesFilter) -> list[str]:
    points = hook_points(model)
    if names_filter is None:
        return list(points)
    if callable(names_filter):
        return [n for n in points if names_filter(n)]
    wanted = [names_filter] if isinstance(names_filter, str) else list(names_filter)
    names = {_resolve(model, w)[0] for w in wanted}
    return [n for n in points if n in names]  # the forward's order


def run_with_cache(
    model: nn.Module,
    x: torch.Tensor,
    names_filter: NamesFilter = None,
    fwd_hooks: Iterable[tuple[str, FwdHook]] = (),
) -> tuple[torch.Tensor, ActivationCache]:
    """Logits and the activations of the selected hook points, for one forward.

    Args:
        model: A glass-box ViT, or a timm ViT (run through its exact glass-box copy).
        x: Images (B, C, H, W).
        names_filter: None (every hook point), a name, a list of names (or module paths), or
            a predicate on names.
        fwd_hooks: Hooks run on the same call (``run_with_hooks``); a cached activation is
            what the rest of the forward saw at that point: after a hook on it edited it.

    The cache holds what the forward computed: a hook on an attention map (``attn.probs``)
    runs its block on the written-out path for the call, as analysis mode does.
    """
    glass = as_glassbox(model)
    names = _selected(glass, names_filter)
    store: dict[str, torch.Tensor] = {}
    keep = [(n, lambda a, n=n: store.__setitem__(n, a)) for n in names]
    logits = _run(glass, x, _stage_hooks(glass, fwd_hooks) + keep)
    order = list(hook_points(glass))
    return logits, ActivationCache({n: store[n] for n in order if n in store}, hook_paths(glass))


def run_with_hooks(
    model: nn.Module, x: torch.Tensor, fwd_hooks: Iterable[tuple[str, FwdHook]] = ()
) -> torch.Tensor:
    """Logits of one forward with ``fwd_hooks`` attached; every hook is removed on return or error.

    ``fn(activation, hook)`` receives the activation and the hook point (``hook.name``);
    what it returns (if not None) replaces the activation for the rest of the forward.
    Hooks on one point run in the order given.
    """
    glass = as_glassbox(model)
    return _run(glass, x, _stage_hooks(glass, fwd_hooks))


def _stage_hooks(glass: VisionTransformer, fwd_hooks) -> list[tuple[str, Callable]]:
    points = hook_points(glass)
    out = []
    for name_or_path, fn in fwd_hooks:
        name = _resolve(glass, name_or_path)[0]
        out.append((name, lambda a, fn=fn, point=points[name]: fn(a, point)))
    return out


def _run(glass: VisionTransformer, x: torch.Tensor, hooks: list) -> torch.Tensor:
    with attached(glass, hooks):
        return glass(x)
