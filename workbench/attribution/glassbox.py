"""The model every attribution method, drop and probe acts on: a checked glass-box ViT in eval mode.

Attribution here is defined on the glass-box ``VisionTransformer`` (``workbench.models.vit``),
whose patch tokens can be removed exactly. A timm ``VisionTransformer`` (pretrained or not)
is first converted through the exact mapping (``workbench.convert.timm_vit.glassbox_from_timm``:
the same function, difference 0.0), then treated the same way.

Only models whose head reads the class token (``pooling="cls"``) are accepted: every method
here reads the class token's row (its attention, its rollout, its relevance), and with CLS
pooling a model with no patch token at all is still defined (the insertion curve's 0 point).
A mean-pooling or attention-pool head is refused with one line naming the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from workbench.models.vit import VisionTransformer


class AttributionError(ValueError):
    """A model or an input the attribution methods do not apply to (one line, says why)."""


@dataclass(frozen=True)
class PatchLayout:
    """Token layout: ``[class token] [register tokens] [patches, row-major over the grid]``.

    Attributes:
        prefix: Class and register tokens before the patches (never scored, never dropped).
        grid: Patches per side, (rows, cols); patch index ``i`` sits at ``divmod(i, cols)``.
    """

    prefix: int
    grid: tuple[int, int]

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    def row_col(self, index):
        """Patch index (int or array) -> (row, col) on the grid."""
        return divmod(index, self.grid[1])


def as_glassbox(model: nn.Module) -> VisionTransformer:
    """The glass-box ViT itself, or a timm ViT converted exactly; anything else is refused in one line."""
    if isinstance(model, VisionTransformer):
        glass = model
    elif type(model).__module__.startswith("timm.") and type(model).__name__ == "VisionTransformer":
        from workbench.convert.timm_vit import glassbox_from_timm

        glass, _ = glassbox_from_timm(model)
    else:
        raise AttributionError(
            f"attribution acts on the glass-box VisionTransformer (or a timm VisionTransformer, "
            f"converted exactly), not {type(model).__name__}"
        )
    cfg = glass.cfg
    if cfg.pooling != "cls":
        raise AttributionError(
            f"pooling={cfg.pooling!r}: the attribution methods read the class token's row, which "
            "only a CLS-pooling head reads (a mean or attention-pool head has no such row)"
        )
    if not cfg.num_classes:
        raise AttributionError(
            "num_classes=0: the model has no classifier, so there is no true-class logit to explain"
        )
    return glass


def layout_of(model: VisionTransformer) -> PatchLayout:
    return PatchLayout(prefix=model.cfg.num_prefix_tokens, grid=model.cfg.grid)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode for the block (dropout would make every score random), the previous mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def fused_attention(model: VisionTransformer) -> Iterator[None]:
    """The fused attention kernel for the block (logits only: no map is read), each module's flag restored after.

    The token drops and curves read nothing but logits, so they may run the fused kernel
    (``set_fast_attention``), which differs from the written-out path by float rounding only.
    """
    modules = [m for m in model.modules() if hasattr(m, "fast")]
    before = [m.fast for m in modules]
    model.set_fast_attention(True)
    try:
        yield
    finally:
        for module, flag in zip(modules, before):
            module.fast = flag
