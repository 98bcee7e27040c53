"""What an intervention study acts on: a trained cell's best checkpoint (proven first) or a pretrained timm ViT."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from workbench.interventions.read_across import NotGlassBoxViT, trained_glassbox
from workbench.convert.timm_vit import glassbox_from_timm
from workbench.convert.timm_weights import load_timm_weights
from workbench.data import NormStats, PreparedSplit
from workbench.interventions.evaluate import Inputs
from workbench.interventions.spec import InterventionError
from workbench.models.registry import model_config
from workbench.models.timm_arm import TimmModelConfig, is_timm_name, shape_model
from workbench.models.vit import ViTConfig, VisionTransformer
from workbench.train.evaluate import ReloadProof, compare_predictions, predict
from workbench.train.fast_path import attention_is_fused


@dataclass
class ActedModel:
    """A glass-box ViT in eval mode with the normalisation it expects and what pins its weights.

    Attributes:
        identity: The trained cell's MLflow run id, or the weights' sha256 (``random:<model>:seed<k>``
            for a seeded init): part of every intervention cell's identity.
        description: One line for logs and the report.
    """

    model: VisionTransformer
    norm: NormStats
    identity: str
    description: str
    pretrained: bool = True


def trained_cell_model(config: dict, state: dict) -> VisionTransformer:
    """The cell's architecture (its ``config.json``) with its best weights, strictly loaded, eval mode.

    A timm ViT arm's weights are read across to the glass-box ViT by the exact mapping
    (``workbench.interventions.read_across.trained_glassbox``), so everything acts on the glass box;
    the caller's reload proof then holds that glass-box copy to the cell's saved predictions.
    """
    name, overrides = config["model"]["name"], config["model"].get("overrides", {})
    cfg = model_config(name, **overrides)
    if isinstance(cfg, TimmModelConfig):
        try:
            return trained_glassbox(cfg, state)[0]
        except NotGlassBoxViT as err:
            raise InterventionError(
                f"model {name!r}: {err}; interventions act on ViT stages"
            ) from None
    if not isinstance(cfg, ViTConfig):
        raise InterventionError(f"model {name!r} is not a ViT; interventions act on ViT stages")
    model = VisionTransformer(cfg)
    model.load_state_dict(state, strict=True)
    return model.eval()


def saved_through_fused_attention(config: dict, device_type: str = "cpu") -> bool:
    """Whether a cell's saved predictions came through ``scaled_dot_product_attention``.

    True for a timm ViT arm whose attention timm fuses (``fused_attn``, its default on current
    PyTorch, as the trainer builds it): the glass-box copy is proven on that path
    (``set_fast_attention``), then acts through its written-out attention, which the run-end
    check holds to timm's written-out attention at 0.0. A glass-box arm predicts through the
    written-out path unless it trained with ``fast_path.fused_attention`` (on, or auto on
    ``device_type``, the device the cell is reproduced on): then the proof takes the fused
    path and every intervention and attribution still acts through the written-out one.
    """
    name, overrides = config["model"]["name"], config["model"].get("overrides", {})
    if not is_timm_name(name):
        setting = config.get("fast_path", {}).get("fused_attention", "off")
        return attention_is_fused(setting, device_type)
    return any(
        getattr(m, "fused_attn", False)
        for m in shape_model(model_config(name, **overrides)).modules()
    )


def read_across_note(config: dict) -> str:
    """What a cell's description adds for a timm ViT arm: its weights act through the glass-box copy."""
    name = config["model"]["name"]
    if not is_timm_name(name):
        return ""
    path = (
        "scaled_dot_product_attention, as timm computed its saved predictions"
        if saved_through_fused_attention(config)
        else "the written-out attention, as timm computed its saved predictions"
    )
    return f"; {name} read across to the glass-box ViT by the exact mapping, reload-proven through {path}"


def reload_proof(
    model: VisionTransformer,
    split: PreparedSplit,
    saved: pd.DataFrame,
    inputs: Inputs,
    *,
    fast_attention: bool = False,
) -> ReloadProof:
    """The trainer's reload proof again: the checkpoint must reproduce the cell's saved predictions.

    Same loader, batch size and autocast as the cell's own evaluation; bitwise on CPU, 1e-5
    elsewhere, as the trainer requires. ``fast_attention``: through the attention path the
    predictions were made with (``saved_through_fused_attention``); the model is left on the
    written-out path, where every intervention and attribution acts.
    """
    loader = inputs.loader(split.images, split.labels, split.indices)
    model.set_fast_attention(fast_attention)
    try:
        fresh = predict(model, loader, inputs.device, inputs.amp_dtype)
    finally:
        model.set_fast_attention(False)
    return compare_predictions(saved, fresh, 0.0 if inputs.device.type == "cpu" else 1e-5)


def pretrained_model(
    model: str, weights: str, seed: int = 0, timm_kwargs: dict | None = None
) -> ActedModel:
    """A timm ViT (pinned hub checkpoint, seeded random init or local file) mapped strictly onto the glass box."""
    from workbench.transfer.source_model import timm_norm

    tw = load_timm_weights(model, weights, seed, **(timm_kwargs or {}))
    glass, audit = glassbox_from_timm(tw.model)
    norm, norm_from = timm_norm(model, tw.model)
    identity = tw.sha256 or f"random:{tw.architecture}:seed{seed}"
    description = (
        f"timm {model}: {tw.label()}; {audit.summary()}; inputs normalised with {norm_from}"
    )
    return ActedModel(glass.eval(), norm, identity, description, tw.pretrained)


def model_labels(
    class_names: tuple[str, ...], class_index: dict[str, int] | None, num_classes: int
) -> torch.Tensor:
    """``(classes,)``: the model output index of each dataset class.

    Without ``class_index`` the dataset's label order is the model's, which needs a head
    with exactly the dataset's classes.

    Raises:
        InterventionError: A dataset class without an index, an index the head does not have,
            or a head of another size without ``class_index``.
    """
    if class_index is None:
        if num_classes != len(class_names):
            raise InterventionError(
                f"the model has {num_classes} outputs and the dataset {len(class_names)} classes "
                f"({', '.join(class_names[:5])}...): map them with pretrained.class_index"
            )
        return torch.arange(len(class_names))
    missing = [c for c in class_names if c not in class_index]
    if missing:
        raise InterventionError(
            f"pretrained.class_index has no entry for dataset class(es) {', '.join(missing)}; "
            f"the dataset's classes: {', '.join(class_names)}"
        )
    too_big = [c for c in class_names if class_index[c] >= num_classes]
    if too_big:
        raise InterventionError(
            f"pretrained.class_index.{too_big[0]}={class_index[too_big[0]]}: the model has only "
            f"{num_classes} outputs"
        )
    return torch.tensor([class_index[c] for c in class_names])
