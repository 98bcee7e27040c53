"""A timm ViT trained as a study arm, read across to the glass-box model and checked on its trained weights.

The exact mapping (``workbench.convert.timm_vit``) is proven on random weights by the
equivalence check; a trained arm gets the same proof on the weights it ended with, so that
everything that acts on the glass-box model (interventions, attributions) acts on the model
the study trained. The check is one batch of validation images through both models with the
same kernels (timm's written-out attention against the glass-box written-out path), in fp32 on
the CPU, where the two are expected to agree at 0.0.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.convert.timm_vit import UnsupportedTimmModel, glassbox_from_timm
from workbench.models.timm_arm import TimmModelConfig, create

CHECK_IMAGES = 64  # enough to cover every class of a small validation batch; cheap on a CPU


def is_timm_vit(model: nn.Module) -> bool:
    """Whether the model is a timm arm of timm's VisionTransformer class (the family the mapping implements)."""
    if not isinstance(getattr(model, "cfg", None), TimmModelConfig):
        return False  # a glass-box model: timm (a slow import) is not needed
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    return isinstance(model, TimmViT)


def glassbox_check(model: nn.Module, images: torch.Tensor) -> dict[str, float]:
    """Summary metrics of the trained model's glass-box copy: ``{}`` for a model that is not a timm ViT.

    Returns:
        ``glassbox_converted`` (1.0, or 0.0 when the mapping refuses an option of this ViT),
        and when converted ``glassbox_max_abs_logit_diff`` over ``images`` and
        ``glassbox_exact`` (1.0 when that difference is 0.0).
    """
    if not is_timm_vit(model):
        return {}
    timm_model = eval_twin(_cpu_copy(model))
    try:
        glass, _ = glassbox_from_timm(timm_model)
    except UnsupportedTimmModel:
        return {"glassbox_converted": 0.0}
    fused = {m: m.fused_attn for m in timm_model.modules() if hasattr(m, "fused_attn")}
    for (
        m
    ) in fused:  # the written-out attention on both sides: the same operations in the same order
        m.fused_attn = False
    x = images[:CHECK_IMAGES].detach().to("cpu", torch.float32)
    with torch.no_grad():
        diff = (timm_model(x) - glass.eval().set_fast_attention(False)(x)).abs().max().item()
    return {
        "glassbox_converted": 1.0,
        "glassbox_max_abs_logit_diff": float(diff),
        "glassbox_exact": float(diff == 0.0),
    }


def eval_twin(model: nn.Module) -> nn.Module:
    """The same trained weights in a model without stochastic depth: the same function in eval mode.

    timm's ``DropPath`` is the identity in eval mode, so a ViT trained with ``drop_path_rate``
    and its twin built without it compute the same logits from the same weights; the strict
    mapping refuses the rate because training with it is not yet implemented in the glass box.
    """
    cfg = model.cfg
    if not cfg.kwargs.get("drop_path_rate"):
        return model
    with torch.device("meta"):
        twin = create(TimmModelConfig(cfg.architecture, cfg.kwargs | {"drop_path_rate": 0.0}))
    twin.load_state_dict(model.state_dict(), strict=True, assign=True)
    twin.cfg = cfg  # the arm as trained
    return twin.eval()


def _cpu_copy(model: nn.Module) -> nn.Module:
    """The model in fp32 on the CPU, in eval mode, without touching the trainer's copy."""
    import copy

    return copy.deepcopy(model).to("cpu", torch.float32).eval()
