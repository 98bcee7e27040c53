"""A trained timm ViT arm read across to the glass-box ViT, for the studies that act on it.

``intervene`` and ``attribute`` (and a transfer from a timm ViT arm) act on the glass-box
model; a timm ViT trained as a study arm reaches it through the exact mapping
(``workbench.convert.timm_vit``). The run-end check that the mapping holds at 0.0 on the
trained weights is ``workbench.convert.arm_check``; this module lives here, outside the
packages of the training code fingerprint (``workbench/train/fingerprint.py``: data, models,
train, convert), because it changes what is computed on trained cells, not how they train:
editing it must not send every stored training cell back to train. The intervention and
attribution fingerprints cover it.
"""

from __future__ import annotations

from typing import Mapping

import torch

from workbench.convert.arm_check import is_timm_vit
from workbench.convert.timm_vit import (
    MappingAudit,
    UnsupportedTimmModel,
    config_from_timm,
    glassbox_from_timm,
)
from workbench.models.timm_arm import TimmModelConfig, create, shape_model
from workbench.models.vit import ViTConfig, VisionTransformer


class NotGlassBoxViT(ValueError):
    """A timm arm that does not read across to the glass-box ViT; the message says why, in one line."""


def eval_config(cfg: TimmModelConfig) -> TimmModelConfig:
    """The arm's config without stochastic depth: the same function in eval mode (as ``arm_check.eval_twin``)."""
    if not cfg.kwargs.get("drop_path_rate"):
        return cfg
    return TimmModelConfig(cfg.architecture, cfg.kwargs | {"drop_path_rate": 0.0})


def glassbox_config(cfg: TimmModelConfig) -> ViTConfig:
    """The glass-box config a timm arm reads across to, off its model built on the meta device (no weights).

    What ``intervene`` and ``attribute`` check a protocol's acted-on arm against when the file
    is read. The config is that of the eval twin (``eval_config``): the function the trained
    weights compute in eval mode, which is the one every intervention and attribution acts on.

    Raises:
        NotGlassBoxViT: the arm is not timm's VisionTransformer (a CNN: no attention heads or
            tokens), or the mapping refuses one of its options (named).
    """
    model = shape_model(eval_config(cfg))
    if not is_timm_vit(model):
        attention = any("attention" in type(m).__name__.lower() for m in model.modules())
        what = (
            "has attention, but only timm's VisionTransformer is read across to the glass-box ViT"
            if attention
            else "no attention heads or tokens to act on"
        )
        raise NotGlassBoxViT(
            f"{cfg.name} is a timm {type(model).__name__}, not a timm VisionTransformer: {what}"
        )
    try:
        return config_from_timm(model)
    except UnsupportedTimmModel as err:
        raise NotGlassBoxViT(
            f"{cfg.name} does not read across to the glass-box ViT: {err}"
        ) from None


def trained_glassbox(
    cfg: TimmModelConfig, state: Mapping[str, torch.Tensor]
) -> tuple[VisionTransformer, MappingAudit]:
    """A trained timm ViT arm's weights (its checkpoint's state dict) in the glass-box ViT, eval mode.

    The timm model only carries the weights across: built on the meta device (no init, no
    draw from the RNG) and filled from ``state`` strictly, then mapped by the exact mapping
    (every tensor used once). What the reloaded model computes is proven by the caller, on the
    cell's saved predictions, before anything is computed with it.

    Raises:
        NotGlassBoxViT: as ``glassbox_config``.
    """
    glassbox_config(cfg)
    with torch.device("meta"):
        timm_model = create(eval_config(cfg))
    timm_model.load_state_dict(state, strict=True, assign=True)
    glass, audit = glassbox_from_timm(timm_model.eval())
    return glass.eval(), audit
