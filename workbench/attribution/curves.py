"""Deletion and insertion curves in each method's order, and the one AUC definition.

Order: a method's scores sorted descending (most important first); ties keep the lower
patch index first (a stable sort), so a constant score vector gives the index order.

With ``P`` patch tokens and ``k`` in the grid of counts (default every ``k = 0, 1, ..., P``),
the fraction is ``k / P`` and

- deletion at ``k``: the model without the method's top ``k`` patch tokens (the exact drop,
  ``token_drop``); ``k = 0`` is the intact model, ``k = P`` the class and register tokens alone;
- insertion at ``k``: the model with only the top ``k`` patch tokens kept; ``k = 0`` is the class
  and register tokens alone (a CLS-pooling model is defined on that sequence: the head reads
  the class token after the blocks), ``k = P`` the intact model.

At each point every image's true-class probability and correctness (the argmax is the true
class) are recorded. The two ends are the same for every method and computed once.

AUC (``auc``): the trapezoid rule over the fractions, from 0 to 1 with both ends included,
``sum_j (f_{j+1} - f_j) (v_j + v_{j+1}) / 2``. A grid must start at 0 and end at 1. Lower
deletion AUC and higher insertion AUC mean a more faithful order. The AUC of the mean curve is
the mean of the per-image AUCs (the rule is linear), which are kept for pairing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workbench.attribution.causal import true_log_prob
from workbench.attribution.glassbox import (
    AttributionError,
    as_glassbox,
    evaluating,
    fused_attention,
)
from workbench.attribution.token_drop import logits_keeping


def auc(fractions, values) -> np.ndarray:
    """Trapezoid area under ``values`` over ``fractions`` (last axis), both ends included.

    Args:
        fractions: ``(K,)`` increasing, ``fractions[0] == 0`` and ``fractions[-1] == 1``.
        values: ``(..., K)``.

    Returns:
        ``(...)`` float64 areas.
    """
    f = np.asarray(fractions, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if f.ndim != 1 or f.size < 2 or f[0] != 0.0 or f[-1] != 1.0 or np.any(np.diff(f) <= 0):
        raise AttributionError(
            f"AUC fractions must increase from 0 to 1 inclusive, got {f.tolist()}"
        )
    if v.shape[-1] != f.size:
        raise AttributionError(f"AUC values have {v.shape[-1]} points, the fractions {f.size}")
    return (np.diff(f) * (v[..., 1:] + v[..., :-1]) / 2.0).sum(axis=-1)


def order_of(scores: torch.Tensor) -> torch.Tensor:
    """``(B, P)`` patch indices, most important first (ties: lower index first)."""
    return torch.argsort(torch.as_tensor(scores), dim=-1, descending=True, stable=True)


def even_counts(num_patches: int, points: int) -> list[int]:
    """``points`` token counts spread evenly over ``0..P`` (rounded, both ends held): a coarser, cheaper curve."""
    if points < 2:
        raise AttributionError(f"points={points!r}: a curve needs at least its two ends")
    return sorted({round(j * num_patches / (points - 1)) for j in range(points)})


def count_grid(num_patches: int, counts: Sequence[int] | None = None) -> np.ndarray:
    """Token counts ``k`` of the curve: every ``0..P`` by default; a given grid must hold 0 and ``P``."""
    if counts is None:
        return np.arange(num_patches + 1)
    grid = np.asarray(sorted(set(int(k) for k in counts)))
    if grid[0] != 0 or grid[-1] != num_patches:
        raise AttributionError(
            f"curve counts must include 0 and {num_patches} (the AUC's two ends), "
            f"got {grid.tolist()}"
        )
    return grid


@dataclass
class Curves:
    """Deletion and insertion curves of every method, per image.

    Attributes:
        fractions: ``(K,)`` ``k / P`` from 0 to 1.
        deletion_prob, insertion_prob: method -> ``(B, K)`` true-class probability.
        deletion_correct, insertion_correct: method -> ``(B, K)`` bool, prediction = true class.
        forwards: Sequences run through the blocks for these curves.
    """

    fractions: np.ndarray
    deletion_prob: dict[str, np.ndarray]
    insertion_prob: dict[str, np.ndarray]
    deletion_correct: dict[str, np.ndarray]
    insertion_correct: dict[str, np.ndarray]
    forwards: int

    @classmethod
    def joined(cls, parts: list[Curves]) -> Curves:
        """The curves of consecutive image batches (the same grid) as one, images in the order given."""
        fractions = parts[0].fractions
        if any(not np.array_equal(c.fractions, fractions) for c in parts):
            raise AttributionError("curves of different grids cannot be joined")

        def cat(name: str) -> dict[str, np.ndarray]:
            return {
                m: np.concatenate([getattr(c, name)[m] for c in parts])
                for m in getattr(parts[0], name)
            }

        return cls(
            fractions=fractions,
            deletion_prob=cat("deletion_prob"),
            insertion_prob=cat("insertion_prob"),
            deletion_correct=cat("deletion_correct"),
            insertion_correct=cat("insertion_correct"),
            forwards=sum(c.forwards for c in parts),
        )

    def deletion_auc(self, method: str, of: str = "prob") -> np.ndarray:
        """Per-image deletion AUC ``(B,)`` of the probability (``of="prob"``) or the accuracy (``"correct"``)."""
        curve = self.deletion_prob if of == "prob" else self.deletion_correct
        return auc(self.fractions, curve[method].astype(np.float64))

    def insertion_auc(self, method: str, of: str = "prob") -> np.ndarray:
        curve = self.insertion_prob if of == "prob" else self.insertion_correct
        return auc(self.fractions, curve[method].astype(np.float64))


def _kept(order: torch.Tensor, k: int, kind: str) -> torch.Tensor:
    """``(..., M)`` the kept patch indices, ascending: all but the top ``k`` (deletion) or the top ``k``."""
    kept = order[..., k:] if kind == "deletion" else order[..., :k]
    return kept.sort(dim=-1).values


@torch.inference_mode()
def perturbation_curves(
    model,
    images: torch.Tensor,
    labels: torch.Tensor,
    scores: Mapping[str, torch.Tensor],
    *,
    counts: Sequence[int] | None = None,
    max_sequences: int = 4096,
) -> Curves:
    """Deletion and insertion curves of every method's order (see the module docstring)."""
    glass = as_glassbox(model)
    P = glass.cfg.num_patches
    names = list(scores)
    grid = count_grid(P, counts)
    orders = torch.stack([order_of(scores[m]) for m in names], dim=1)  # (B, S, P)
    B, S = images.shape[0], len(names)
    prob = {kind: np.empty((S, B, grid.size)) for kind in ("deletion", "insertion")}
    correct = {kind: np.empty((S, B, grid.size), dtype=bool) for kind in ("deletion", "insertion")}
    chunk = max(1, max_sequences // S)
    forwards = 0
    with evaluating(glass), fused_attention(glass):
        for start in range(0, B, chunk):
            x, y = images[start : start + chunk], labels[start : start + chunk]
            b, rows = x.shape[0], slice(start, start + x.shape[0])
            o = orders[rows]
            ends = {}  # k -> (b, 1, classes): the full and the empty sequence, the same for every method
            for end, kept in ((P, torch.arange(P)), (0, torch.arange(0))):
                ends[end] = logits_keeping(glass, x, kept.expand(b, 1, kept.numel()))
                forwards += b
            for kind in ("deletion", "insertion"):
                for j, k in enumerate(grid):
                    present = P - k if kind == "deletion" else k
                    if present in ends:
                        logits = ends[present].expand(b, S, -1)
                    else:
                        logits = logits_keeping(glass, x, _kept(o, int(k), kind))  # (b, S, classes)
                        forwards += b * S
                    p = true_log_prob(logits, y.view(-1, 1)).exp()  # (b, S)
                    hit = logits.argmax(dim=-1) == y.to(logits.device).view(-1, 1)
                    prob[kind][:, rows, j] = p.T.cpu().numpy()
                    correct[kind][:, rows, j] = hit.T.cpu().numpy()
    fractions = grid / P
    return Curves(
        fractions=fractions,
        deletion_prob={m: prob["deletion"][i] for i, m in enumerate(names)},
        insertion_prob={m: prob["insertion"][i] for i, m in enumerate(names)},
        deletion_correct={m: correct["deletion"][i] for i, m in enumerate(names)},
        insertion_correct={m: correct["insertion"][i] for i, m in enumerate(names)},
        forwards=forwards,
    )
