"""Embedding views: positional-embedding similarity, pooled (pre-logits) features, t-SNE."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.vit import VisionTransformer


def position_similarity(model: VisionTransformer) -> torch.Tensor:
    """Cosine similarity of every patch position's learned embedding to every other's.

    Returns:
        ``(rows, cols, rows, cols)``: entry ``[i, j]`` is the map of position (i, j)'s
        similarity to all positions.

    Raises:
        ValueError: The model has no learned positional embedding.
    """
    if model.pos_embed is None:
        raise ValueError("the model has no learned positional embedding (pos_embed='none')")
    cfg = model.cfg
    rows, cols = cfg.grid
    # With no_embed_class the table covers patches only; otherwise prefix tokens come first.
    start = 0 if cfg.no_embed_class else cfg.num_prefix_tokens
    pos = model.pos_embed.detach()[0, start:].to(torch.float64)  # (P, D)
    pos = F.normalize(pos, dim=-1)
    sim = pos @ pos.T  # (P, P)
    return sim.reshape(rows, cols, rows, cols)


@torch.no_grad()
def pooled_features(model: nn.Module, images: torch.Tensor, batch_size: int = 256) -> np.ndarray:
    """The head's input: ``forward_head(forward_features(x), pre_logits=True)``.

    For a CLS ViT that is the final class-token embedding; for a mean-pooling ViT or the
    CNN it is the pooled vector.

    Args:
        model: Any model with timm's ``forward_features`` / ``forward_head``.
        images: Normalised inputs ``(N, C, H, W)``.
        batch_size: Images per forward pass.

    Returns:
        ``(N, D)`` float32 array.
    """
    was_training = model.training
    model.eval()
    try:
        parts = [
            model.forward_head(model.forward_features(images[i : i + batch_size]), pre_logits=True)
            for i in range(0, len(images), batch_size)
        ]
    finally:
        model.train(was_training)
    return torch.cat(parts).float().cpu().numpy()


def tsne_2d(features: np.ndarray, seed: int = 0, perplexity: float = 30.0) -> np.ndarray:
    """Two-dimensional t-SNE (scikit-learn) of ``(N, D)`` features, seeded.

    The perplexity is lowered for small N (it must stay below N), so tiny test sets work.
    Runs on one OpenMP thread: on a busy machine scikit-learn's default (all cores)
    spin-waits for minutes on a few hundred points, and one thread also keeps the layout
    identical from machine to machine.
    """
    from sklearn.manifold import TSNE
    from threadpoolctl import threadpool_limits

    n = len(features)
    if n < 3:
        raise ValueError(f"t-SNE needs at least 3 points, got {n}")
    perplexity = float(min(perplexity, max(1.0, (n - 1) / 3)))
    tsne = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed)
    with threadpool_limits(limits=1):
        return tsne.fit_transform(np.asarray(features, dtype=np.float64)).astype(np.float32)
