"""The eight figures of the Fashion-MNIST ViT vs CNN study, from in-memory runs.

``study_figures`` takes trained models, their predictions and per-epoch metrics and the
validation images (``tracking.kinds.figure_runs`` reads all of it back from MLflow) and returns the
figures by file name. The ViT figures use the protocol's reference ViT arm at its lowest
seed, so rebuilding from the same runs gives the same pictures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch
from matplotlib.figure import Figure
from torch import nn

from workbench.analysis import attention_figures, panels, result_figures
from workbench.analysis.common import display_images
from workbench.analysis.embeddings import pooled_features, position_similarity, tsne_2d
from workbench.data.transforms import NormStats, normalize, resize_batch
from workbench.models.vit import VisionTransformer, count_parameters

# File names sort in the study's reading order and differ from the report's own figures.
FIGURE_FILES = {
    "patches": "01_patches.png",
    "positional_embeddings": "02_positional_embeddings.png",
    "curves": "03_vit_vs_cnn_curves.png",
    "attention_rollout": "04_attention_rollout.png",
    "cls_tsne": "05_cls_tsne.png",
    "attention_heads": "06_attention_heads.png",
    "summary": "07_summary.png",
    "confusion_matrices": "08_confusion_matrices.png",
}

# What each figure shows, for captions (the report builder can read them from figures.json).
FIGURE_CAPTIONS = {
    "patches": "A validation image cut into the ViT's patches, numbered in token order, and the same patches as the "
    "token sequence the transformer reads.",
    "positional_embeddings": "Cosine similarity of the learned positional embeddings: each small map is one patch "
    "position's similarity to every position.",
    "curves": "Per-epoch training and validation loss and accuracy of every arm: mean over seeds with a min-max band.",
    "attention_rollout": "Last-layer attention and attention rollout (Abnar & Zuidema) of the ViT on validation images, "
    "with the background-artifact check per map. A diagnostic, not an explanation.",
    "cls_tsne": "t-SNE of the pre-logits features (the ViT's final CLS embedding; the CNN's pooled features) of "
    "validation images, coloured by true class.",
    "attention_heads": "Per-head attention of one ViT block on validation images, with the background-artifact check "
    "per map. A diagnostic, not an explanation.",
    "summary": "Headline numbers: validation and test accuracy per arm with per-seed points, parameter counts, epochs.",
    "confusion_matrices": "Confusion matrices per arm and split, counts summed over seeds, colour = share of the true class.",
}


@dataclass
class RunInputs:
    """One finished cell run, loaded.

    Attributes:
        run_id: MLflow run id (for titles).
        arm: Arm name.
        seed: Seed.
        model: The best checkpoint's model, on CPU.
        model_name: Registry name of the model.
        predictions: Split -> predictions table (index, label, predicted, loss, prob_k).
        history: Metric -> epoch -> value.
        is_reference: Whether this is the protocol's reference arm.
    """

    run_id: str
    arm: str
    seed: int
    model: nn.Module
    model_name: str
    predictions: dict[str, pd.DataFrame] = field(default_factory=dict)
    history: dict[str, dict[int, float]] = field(default_factory=dict)
    is_reference: bool = False


@dataclass
class StudyInputs:
    """Everything the study figures need.

    Attributes:
        title: E.g. ``"fmnist_vit_vs_cnn@0123456789ab"``.
        runs: The cell runs, any order.
        images: Validation images, uint8 ``(N, C, H, W)``, in predictions-table order.
        labels: ``(N,)`` labels of ``images``.
        class_names: In label order.
        norm: Normalisation the models were trained with.
        resize_to: Batched resize the models were trained with, if any.
        data_label: Dataset description for titles.
    """

    title: str
    runs: list[RunInputs]
    images: torch.Tensor
    labels: torch.Tensor
    class_names: tuple[str, ...]
    norm: NormStats
    resize_to: int | None = None
    data_label: str = ""


@dataclass
class StudyFigures:
    """The figures by file name, and what the background-artifact check found."""

    figures: dict[str, Figure]
    flagged: dict[str, tuple[int, int]]  # file name -> (maps flagged, maps checked)
    messages: list[str] = field(default_factory=list)
    captions: dict[str, str] = field(default_factory=dict)  # file name -> what the figure shows


def model_inputs(
    images: torch.Tensor, norm: NormStats, resize_to: int | None = None
) -> torch.Tensor:
    """uint8 images -> the float inputs the evaluation loader feeds (resize, normalise)."""
    x = images.float() / 255.0
    if resize_to is not None:
        x = resize_batch(x, resize_to)
    return normalize(x, norm)


def pick_examples(labels: torch.Tensor, n: int) -> list[int]:
    """The first image of each class in label order, then the next ones, up to ``n``."""
    labels = labels.tolist()
    firsts = [labels.index(k) for k in sorted(set(labels))]
    taken = set(firsts)
    return (firsts + [i for i in range(len(labels)) if i not in taken])[:n]


def _vit_run(runs: list[RunInputs]) -> RunInputs | None:
    vits = [r for r in runs if isinstance(r.model, VisionTransformer)]
    return min(vits, key=lambda r: (not r.is_reference, r.arm, r.seed)) if vits else None


def _row_labels(logits: torch.Tensor, labels: torch.Tensor, names: tuple[str, ...]) -> list[str]:
    probs = logits.float().softmax(-1)
    return [
        f"true {names[int(y)]}\npred {names[int(p)]} ({probs[i, p]:.2f})"
        for i, (y, p) in enumerate(zip(labels, probs.argmax(-1)))
    ]


def _attention(
    vit: RunInputs, inputs: StudyInputs, n_images: int, block: int
) -> panels.AttentionFigures:
    """Rollout and head figures of the chosen ViT run on a few validation images."""
    chosen = pick_examples(inputs.labels, n_images)
    x = model_inputs(inputs.images[chosen], inputs.norm, inputs.resize_to)
    where = f"{inputs.title}, arm {vit.arm} seed {vit.seed} (run {vit.run_id[:8]})"
    labels = inputs.labels[chosen]
    return panels.attention_figures(
        vit.model,
        x,
        inputs.norm,
        where,
        lambda logits: _row_labels(logits, labels, inputs.class_names),
        block,
    )


def tsne_figure(
    inputs: StudyInputs, vit: RunInputs | None, runs: list[RunInputs], points: int, seed: int
) -> Figure:
    """t-SNE of the pre-logits features of the ViT (its CLS embedding) and of a CNN of the same seed."""
    take = torch.arange(min(points, len(inputs.labels)))
    x = model_inputs(inputs.images[take], inputs.norm, inputs.resize_to)
    labels = inputs.labels[take].numpy()
    chosen = [vit] if vit else []
    others = [r for r in runs if not isinstance(r.model, VisionTransformer)]
    if vit and others:
        chosen.append(min(others, key=lambda r: (r.seed != vit.seed, r.arm, r.seed)))
    panels = {}
    for run in chosen:
        what = (
            "CLS embedding"
            if isinstance(run.model, VisionTransformer) and run.model.cfg.pooling == "cls"
            else "pooled features"
        )
        panels[f"{run.arm} seed {run.seed}: {what}"] = (
            tsne_2d(pooled_features(run.model, x), seed=seed),
            labels,
        )
    perplexity = min(30.0, max(1.0, (len(labels) - 1) / 3))
    return result_figures.tsne_figure(
        panels,
        inputs.class_names,
        f"t-SNE of pre-logits features, {len(labels)} validation images, coloured by true class: {inputs.title}",
        f"scikit-learn TSNE, perplexity {perplexity:g}, PCA init, seed {seed}. t-SNE keeps neighbourhoods, "
        "not distances or cluster sizes: read which classes mix, not how far apart clusters are.",
    )


def study_figures(
    inputs: StudyInputs, n_images: int = 6, tsne_points: int = 800, block: int = -1, seed: int = 0
) -> StudyFigures:
    """Build the study's eight figures (fewer when the protocol has no ViT arm).

    Args:
        inputs: Runs, validation images and their description.
        n_images: Validation images in the attention figures (one per class first).
        tsne_points: Validation images in the t-SNE.
        block: Block of the per-head figure (negative counts from the end).
        seed: t-SNE seed.
    """
    runs = sorted(inputs.runs, key=lambda r: (not r.is_reference, r.arm, r.seed))
    arms = list(dict.fromkeys(r.arm for r in runs))
    vit = _vit_run(runs)
    figs: dict[str, Figure] = {}
    flagged: dict[str, tuple[int, int]] = {}
    messages = []
    if vit is not None:
        cfg = vit.model.cfg
        first = model_inputs(
            inputs.images[pick_examples(inputs.labels, 1)], inputs.norm, inputs.resize_to
        )
        figs["patches"] = attention_figures.patch_grid_figure(
            display_images(first, inputs.norm)[0],
            cfg.patch_size,
            cfg.num_prefix_tokens,
            f"{inputs.data_label} validation image, {vit.arm} ({vit.model_name})",
        )
        if vit.model.pos_embed is not None:
            figs["positional_embeddings"] = attention_figures.position_similarity_figure(
                position_similarity(vit.model).numpy(),
                f"{inputs.title}, arm {vit.arm} seed {vit.seed}",
            )
        attn = _attention(vit, inputs, n_images, block)
        figs["attention_rollout"], figs["attention_heads"] = attn.rollout, attn.heads
        flagged = {
            "attention_rollout": attn.flagged("rollout"),
            "attention_heads": attn.flagged("heads"),
        }
        figs["cls_tsne"] = tsne_figure(inputs, vit, runs, tsne_points, seed)
    else:
        messages.append(
            "no ViT arm: patch, positional-embedding, attention and t-SNE figures skipped"
        )
    histories = {arm: {r.seed: r.history for r in runs if r.arm == arm} for arm in arms}
    figs["curves"] = result_figures.curves_figure(
        histories, title=f"Training curves by arm: {inputs.title}"
    )
    figs["summary"] = result_figures.summary_figure(
        _summaries(runs, arms),
        f"Summary: {inputs.title} ({inputs.data_label})",
        "Accuracy from each run's predictions tables (best-validation checkpoint).",
    )
    figs["confusion_matrices"] = _confusion(runs, arms, inputs)
    ordered = {FIGURE_FILES[k]: figs[k] for k in FIGURE_FILES if k in figs}
    return StudyFigures(
        ordered,
        {FIGURE_FILES[k]: v for k, v in flagged.items()},
        messages,
        {FIGURE_FILES[k]: FIGURE_CAPTIONS[k] for k in FIGURE_FILES if k in figs},
    )


def _summaries(runs: list[RunInputs], arms: list[str]) -> list[result_figures.ArmHeadline]:
    out = []
    for arm in arms:
        mine = [r for r in runs if r.arm == arm]
        summary = result_figures.ArmHeadline(
            arm, mine[0].model_name, count_parameters(mine[0].model)[0]
        )
        for r in mine:
            for split, table in r.predictions.items():
                summary.accuracy.setdefault(split, {})[r.seed] = float(
                    (table["label"] == table["predicted"]).mean()
                )
            summary.epochs[r.seed] = len(r.history.get("val_accuracy", {}))
        out.append(summary)
    return out


def _confusion(runs: list[RunInputs], arms: list[str], inputs: StudyInputs) -> Figure:
    k = len(inputs.class_names)
    splits = [s for s in ("val", "test") if any(s in r.predictions for r in runs)]
    matrices = {}
    for split in splits:
        for arm in arms:
            tables = [r.predictions[split] for r in runs if r.arm == arm and split in r.predictions]
            if tables:
                cm = sum(
                    result_figures.confusion_matrix(
                        t["label"].to_numpy(), t["predicted"].to_numpy(), k
                    )
                    for t in tables
                )
                matrices[f"{arm}, {split} (sum of {len(tables)} seeds)"] = cm
    # One row per split while that stays readable; many arms wrap onto rows of four.
    ncols = len(arms) if len(arms) <= 4 else 4
    return result_figures.confusion_figure(
        matrices, inputs.class_names, f"Confusion matrices: {inputs.title}", ncols=ncols
    )
