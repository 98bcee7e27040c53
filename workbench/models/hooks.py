"""Hook points: the named places of the glass-box ViT's one forward where a hook can read or replace.

Every stage of the analysis vocabulary (``patch_embed``, ``blocks.3.attn.probs``,
``blocks.3.resid1``, ``head``, ...) is a ``HookPoint``: an identity module the forward
calls on that activation (the pattern of TransformerLens's ``HookPoint``). With nothing
attached, a hook point returns its input tensor itself, so the default path computes
exactly what it computed before hook points existed. Recording (analysis mode),
interventions, probes and patching are hooks attached for one call with ``attached``;
nothing writes a second forward.

A hook point's stage name is its parent module's path plus its local name: the point
``hook_resid1`` of ``blocks.3`` (local name ``resid1``) is ``blocks.3.resid1``; the point
``hook_probs`` inside ``blocks.3.attn`` is ``blocks.3.attn.probs``. The model lists its
stages from its hook points, in the order the forward runs them (the order they are
registered, which a test checks against a recorded forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping  # noqa: F401 (see ruff note in pyproject)

import torch
from torch import nn

# fn(activation) -> replacement, or None to leave the activation as it is
StageHook = Callable[[torch.Tensor], "torch.Tensor | None"]


class HookPoint(nn.Module):
    """The identity at one stage of the forward; ``name`` is the full stage name.

    ``stage=False`` makes a finer hook point: addressable by name like a stage (``attached``,
    ``hook_points``) but not in the model's stage list (``stage_names``), which analysis mode
    records whole and which stays fixed for a family (a plain ViT-B/16 has 100 stages). The
    finer points are each head's output before the output projection (``attn.z``) and the
    position term added to the tokens (``pos_embed``).
    """

    def __init__(self, local_name: str, stage: bool = True) -> None:
        super().__init__()
        self.local_name = local_name
        self.stage = stage
        self.name = local_name  # the full name is set by name_hook_points once the model is built

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return repr(self.name)


def name_hook_points(model: nn.Module) -> None:
    """Give every hook point of ``model`` its stage name: the parent's path plus its local name."""
    for path, module in model.named_modules():
        if isinstance(module, HookPoint):
            parent = path.rpartition(".")[0]
            module.name = f"{parent}.{module.local_name}" if parent else module.local_name


def hook_points(model: nn.Module, stages_only: bool = False) -> dict[str, HookPoint]:
    """Name -> hook point, stages and finer points (only stages with ``stages_only``), in module order.

    For stages the module order is the order the forward runs them; a finer point sits beside
    the stage it refines (``attn.z`` after ``attn.probs``, ``pos_embed`` before ``pos_add``).
    """
    return {
        m.name: m
        for m in model.modules()
        if isinstance(m, HookPoint) and (m.stage or not stages_only)
    }


def _owner_of_probs(model: nn.Module, point: HookPoint) -> nn.Module | None:
    """The attention module whose map ``point`` is: the map exists only on its written-out path."""
    for module in model.modules():
        if getattr(module, "hook_probs", None) is point:
            return module
    return None


@contextlib.contextmanager
def attached(model: nn.Module, hooks: Iterable[tuple[str, StageHook]]) -> Iterator[None]:
    """Attach ``(stage, fn)`` hooks to the hook points of ``model`` for the ``with`` block.

    Hooks on one stage run in the order given, each seeing what the previous one returned
    (so a recorder listed first reads the computed value, before an edit replaces it). A
    hook on an attention map (``*.probs``) switches its attention module to the written-out
    path for the block, since the fused kernel never materialises the map.

    Raises:
        KeyError: A stage the model does not have (the message lists the valid ones).
    """
    points = hook_points(model)
    handles, fast = [], []
    try:
        for stage, fn in hooks:
            point = points.get(stage)
            if point is None:
                finer = [n for n, p in points.items() if not p.stage]
                raise KeyError(
                    f"no hook point {stage!r}; the model's stages: "
                    f"{', '.join(n for n, p in points.items() if p.stage)}"
                    + (f"; finer hook points: {', '.join(finer)}" if finer else "")
                )
            handles.append(point.register_forward_hook(lambda _m, _args, out, fn=fn: fn(out)))
            owner = _owner_of_probs(model, point) if stage.endswith("probs") else None
            if owner is not None and getattr(owner, "fast", False):
                fast.append(owner)
                owner.fast = False
        yield
    finally:
        for handle in handles:
            handle.remove()
        for owner in fast:
            owner.fast = True


def recorder(store: dict[str, torch.Tensor], stage: str) -> StageHook:
    """A hook that keeps the stage's activation in ``store`` and leaves it unchanged."""

    def keep(x: torch.Tensor) -> None:
        store[stage] = x

    return keep


def record_hooks(
    store: dict[str, torch.Tensor], stages: Iterable[str]
) -> list[tuple[str, StageHook]]:
    return [(stage, recorder(store, stage)) for stage in stages]


# ---- hooks as a user writes them: fn(activation, hook), names or module paths -------------
# fn(activation, hook point) -> replacement, or None to leave the activation as it is;
# a backward hook gets the gradient at the hook point instead of the activation.
UserHook = Callable[[torch.Tensor, HookPoint], "torch.Tensor | None"]


class HookError(ValueError):
    """A hook point that does not exist, or a hook that returned something the forward cannot take; one line."""


def hook_paths(model: nn.Module) -> dict[str, str]:
    """Hook-point name -> module path, for every hook point (in module order)."""
    return {
        module.name: path for path, module in model.named_modules() if isinstance(module, HookPoint)
    }


def resolve_hook(model: nn.Module, name_or_path: str) -> tuple[str, str]:
    """(name, module path) of a hook point given either form.

    Raises:
        HookError: No such hook point (the message lists the model's hook points).
    """
    paths = hook_paths(model)
    if name_or_path in paths:
        return name_or_path, paths[name_or_path]
    for name, path in paths.items():
        if path == name_or_path:
            return name, path
    raise HookError(
        f"no hook point {name_or_path!r} (a name like 'blocks.0.resid1' or a module path like "
        f"'blocks.0.hook_resid1'); the model's hook points: {', '.join(paths)}"
    )


def check_return(point: HookPoint, received: torch.Tensor, returned, what: str = "activation"):
    """``returned`` if it can stand in for ``received`` (same shape and dtype), else a one-line error.

    A replacement of another shape or dtype would fail later in the forward with a message
    naming an op, or worse broadcast silently; the hook point is the place to say so.
    """
    if returned is None:
        return None
    if not isinstance(returned, torch.Tensor):
        raise HookError(
            f"hook on {point.name!r} returned {type(returned).__name__}, not a tensor or None"
        )
    if returned.shape != received.shape or returned.dtype != received.dtype:
        raise HookError(
            f"hook on {point.name!r} returned shape {tuple(returned.shape)} {returned.dtype}; the "
            f"{what} is {tuple(received.shape)} {received.dtype} (return the same shape and dtype, or None)"
        )
    return returned


def _forward_hook(fn: UserHook, point: HookPoint) -> StageHook:
    return lambda a: check_return(point, a, fn(a, point))


def _grad_hook(fn: UserHook, point: HookPoint) -> Callable[[torch.Tensor], "torch.Tensor | None"]:
    return lambda g: check_return(point, g, fn(g, point), "gradient")


@contextlib.contextmanager
def user_hooks(
    model: nn.Module,
    fwd_hooks: Iterable[tuple[str, UserHook]] = (),
    bwd_hooks: Iterable[tuple[str, UserHook]] = (),
    record: Iterable[str] = (),
    store: dict[str, torch.Tensor] | None = None,
) -> Iterator[list[torch.Tensor]]:
    """Attach TransformerLens-style hooks for the ``with`` block; yields the backward-hooked tensors.

    Forward hooks run first (in the order given), then the recorders of ``record`` (so a
    recorded activation is what the rest of the forward saw), then the backward hooks are
    put on the resulting tensors: a backward hook ``fn(grad, hook)`` runs when a backward
    pass inside the block reaches that activation and may return a replacement gradient.
    Every hook, tensor hooks included, is removed when the block ends or raises. Replacements
    are checked: another shape or dtype is refused in one line naming the hook point.
    """
    points = hook_points(model)
    fwd = [(resolve_hook(model, n)[0], fn) for n, fn in fwd_hooks]
    bwd = [(resolve_hook(model, n)[0], fn) for n, fn in bwd_hooks]
    staged = [(name, _forward_hook(fn, points[name])) for name, fn in fwd]
    if store is not None:
        staged += record_hooks(store, record)
    tensor_handles: list = []
    hooked: list[torch.Tensor] = []

    def on_grad(name: str, fn: UserHook) -> StageHook:
        def put(a: torch.Tensor) -> None:
            if a.requires_grad:  # no graph through this point (frozen, or no_grad): nothing to hook
                tensor_handles.append(a.register_hook(_grad_hook(fn, points[name])))
                hooked.append(a)

        return put

    staged += [(name, on_grad(name, fn)) for name, fn in bwd]
    try:
        with attached(model, staged):
            yield hooked
    finally:
        for handle in tensor_handles:
            handle.remove()
