"""Frozen-backbone features, computed once and reused by every seed of the cheap regimes.

With the backbone frozen and no augmentation, what the frozen part computes for an image
never changes, so it is computed once per protocol execution: the pooled features the
linear probe's head reads (``forward_head(..., pre_logits=True)``), and, for partial
fine-tuning of the last k blocks, the tokens entering block ``depth - k``. Training then
runs only the trainable part on these tensors. The frozen part runs in eval mode (no
dropout), which is what makes the cache equal to a forward pass of the assembled model;
``runner.select_cell`` checks that equality on the validation images for every cell.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from workbench.data import NormStats, PreparedSplit, TensorLoader
from workbench.models.vit import VisionTransformer


@dataclass
class CachedSplit:
    """Cached inputs of one split: ``inputs`` (N, D) pooled or (N, T, D) tokens, ``labels`` and
    ``indices`` (N,), all on the training device."""

    inputs: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class FeatureCache:
    """``pooled[split]`` and ``tokens[start][split]`` (tokens entering block ``start``)."""

    pooled: dict[str, CachedSplit] = field(default_factory=dict)
    tokens: dict[int, dict[str, CachedSplit]] = field(default_factory=dict)
    seconds: float = 0.0
    images: int = 0


@torch.no_grad()
def compute_features(
    model: VisionTransformer,
    splits: dict[str, PreparedSplit],
    norm: NormStats,
    resize_to: int | None,
    device: torch.device,
    batch_size: int,
    amp_dtype: torch.dtype | None = None,
    token_starts: Iterable[int] = (),
) -> FeatureCache:
    """One eval-mode pass over each split, keeping pooled features and the requested tokens.

    Args:
        model: The source backbone (its head is not used).
        splits: E.g. ``{"train": data.train, "val": data.val}``; never the test split.
        norm: The source's input normalisation.
        resize_to: The model's input side when the images differ from it.
        device: Where the pass runs and the cache lives.
        batch_size: Images per forward pass.
        amp_dtype: Autocast dtype on CUDA, or None.
        token_starts: Block indices whose input tokens to keep (``depth - k`` per partial regime).
    """
    starts = sorted(set(token_starts))
    depth = model.cfg.depth
    if any(not 0 <= s <= depth for s in starts):
        raise ValueError(f"token starts {starts} outside 0..{depth}")
    was_training = model.training
    model.eval()
    cache, started = FeatureCache(tokens={s: {} for s in starts}), time.perf_counter()
    for name, split in splits.items():
        loader = TensorLoader.from_split(
            split,
            batch_size=batch_size,
            norm=norm,
            shuffle=False,
            device=device,
            resize_to=resize_to,
        )
        pooled, tokens, labels, indices = [], {s: [] for s in starts}, [], []
        for images, y, idx in loader:
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                x = model.embed(images)  # (B, N, D): patches, prefix tokens, positions
                for i, block in enumerate(model.blocks):
                    if i in tokens:
                        tokens[i].append(x.float())
                    x = block(x)
                if depth in tokens:
                    tokens[depth].append(x.float())
                # (B, D): norm, pool
                feats = model.forward_head(model.forward_blocks(x, start=depth), pre_logits=True)
            pooled.append(feats.float())
            labels.append(y)
            indices.append(idx)
        y, idx = torch.cat(labels), torch.cat(indices)
        cache.pooled[name] = CachedSplit(torch.cat(pooled), y, idx)
        for s in starts:
            cache.tokens[s][name] = CachedSplit(torch.cat(tokens[s]), y, idx)
        cache.images += len(split)
    model.train(was_training)
    cache.seconds = time.perf_counter() - started
    return cache


def head_forward(model: VisionTransformer) -> Callable[[torch.Tensor], torch.Tensor]:
    """Linear probe: pooled features (B, D) -> logits, exactly ``forward_head`` after pooling."""
    return lambda feats: model.head(model.head_drop(feats))


def tail_forward(model: VisionTransformer, start: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Partial fine-tuning: tokens entering block ``start`` (B, N, D) -> logits."""

    return lambda x: model.forward_head(model.forward_blocks(x, start))
