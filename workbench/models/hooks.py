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
