"""Inspect a timm ViT on any image through its glass-box twin.

The timm model's weights are mapped onto the glass-box ViT (``glassbox_from_timm``, the
same function at every stage), whose analysis mode gives the attention maps. Images are
prepared the way the checkpoint expects: timm's pretrained data config (resize, centre
crop, mean/std) from ``timm.data.resolve_data_config``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from matplotlib.figure import Figure

from workbench.analysis import attention_figures, panels
from workbench.analysis.embeddings import position_similarity
from workbench.convert.timm_vit import glassbox_from_timm
from workbench.convert.timm_weights import TimmWeights
from workbench.data.transforms import NormStats

CAPTIONS = {
    "attention_rollout": "Last-layer attention and attention rollout on each image, with the background-artifact check "
    "per map. A diagnostic, not an explanation.",
    "attention_heads": "Per-head attention of one block on each image, with the background-artifact check per map.",
    "patch": "The image as the model sees it (pretrained eval transform), cut into numbered patches.",
    "positional_embeddings": "Cosine similarity of the learned positional embeddings between patch positions.",
}


@dataclass
class TimmInspection:
    """Figures by file name, with what the background-artifact check found."""

    figures: dict[str, Figure]
    flagged: dict[str, tuple[int, int]]
    messages: list[str] = field(default_factory=list)
    captions: dict[str, str] = field(default_factory=dict)


def load_images(
    paths: Sequence[str | Path], model: torch.nn.Module
) -> tuple[torch.Tensor, NormStats, dict]:
    """Read images and apply the model's pretrained eval transform.

    Returns:
        (inputs ``(B, 3, S, S)`` normalised, the normalisation, the resolved data config).
    """
    from PIL import Image
    from timm.data import create_transform, resolve_data_config

    config = resolve_data_config(model=model)
    # The model's own input size wins over its pretrained config's (they differ only for a
    # model built at another size, e.g. a reduced test model).
    config["input_size"] = (config["input_size"][0], *model.patch_embed.img_size)
    transform = create_transform(**config)
    batch = []
    for path in paths:
        try:
            with Image.open(path) as img:
                batch.append(transform(img.convert("RGB")))
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read image {path}: {err}") from err
    return torch.stack(batch), NormStats(tuple(config["mean"]), tuple(config["std"])), config


def _row_labels(logits: torch.Tensor, names: list[str], num_classes: int) -> list[str]:
    """File name and top-1 prediction (ImageNet class names for 1000-class heads).

    A model without a classifier returns features, not class scores: its rows say so."""
    if num_classes == 0:
        return [f"{name}\nfeatures (no classifier)" for name in names]
    probs = logits.float().softmax(-1)
    info = None
    if num_classes == 1000:
        from timm.data import ImageNetInfo

        info = ImageNetInfo()
    out = []
    for name, p in zip(names, probs):
        k = int(p.argmax())
        cls = info.index_to_description(k).split(",")[0] if info else f"class {k}"
        out.append(f"{name}\npred {cls} ({p[k]:.2f})")
    return out


def inspect_timm(
    weights: TimmWeights, image_paths: Sequence[str | Path], block: int = -1
) -> TimmInspection:
    """Rollout, per-head, patch-grid and positional-embedding figures for some images.

    Args:
        weights: A loaded timm ViT (``workbench.convert.timm_weights.load_timm_weights``).
        image_paths: Image files (any format PIL reads).
        block: Block of the per-head figure (negative counts from the end).
    """
    if not image_paths:
        raise ValueError("inspect_timm needs at least one image")
    glass, audit = glassbox_from_timm(weights.model)
    glass = glass.float().eval()
    x, norm, config = load_images(image_paths, weights.model)
    names = [Path(p).name for p in image_paths]
    label = weights.label()
    where = label if label.startswith(weights.architecture) else f"{weights.architecture}, {label}"
    attn = panels.attention_figures(
        glass,
        x,
        norm,
        where,
        lambda logits: _row_labels(logits, names, glass.cfg.num_classes),
        block,
    )
    figs = {"attention_rollout.png": attn.rollout, "attention_heads.png": attn.heads}
    shown = attn.shown
    for i, name in enumerate(names):
        key = f"patch_grid_{Path(name).stem}.png"
        # same name in two folders
        key = key if key not in figs else f"patch_grid_{Path(name).stem}_{i}.png"
        figs[key] = attention_figures.patch_grid_figure(
            shown[i],
            glass.cfg.patch_size,
            glass.cfg.num_prefix_tokens,
            f"{name}, {weights.architecture}",
        )
    messages = [
        (
            f"{weights.architecture}: {audit.summary()}; input {tuple(config['input_size'])}, "
            f"mean {tuple(round(m, 4) for m in norm.mean)}, std {tuple(round(s, 4) for s in norm.std)}, "
            f"{config['interpolation']} resize, crop_pct {config['crop_pct']}"
        )
    ]
    if glass.pos_embed is not None:
        figs["positional_embeddings.png"] = attention_figures.position_similarity_figure(
            position_similarity(glass).numpy(), where
        )
    else:
        messages.append("no learned positional embedding: positional-embedding figure skipped")
    if attn.analysis.statement:
        messages.append(f"{weights.architecture}: {attn.analysis.statement}")
    flagged = {
        "attention_rollout.png": attn.flagged("rollout"),
        "attention_heads.png": attn.flagged("heads"),
    }
    captions = {
        name: CAPTIONS[
            name.split("_")[0] if name.startswith("patch_grid") else name.removesuffix(".png")
        ]
        for name in figs
    }
    return TimmInspection(figs, flagged, messages, captions)
