"""How concentrated the class token's attention is, per block: on few patch tokens, and on the registers.

The question, per block: does CLS attention concentrate on few tokens (Darcet
et al. 2024: in large ViTs CLS attends to a few high-norm background tokens, and register
tokens take that role over). For block ``l`` let ``a = A_l[0, :]`` be the class token's row of
the attention map (softmax probabilities over all ``N = p + P`` keys: the class token, the
``p - 1`` register tokens, then the ``P`` patches), either the mean over heads (``E_h``, as
``methods.cls_attention``) or one head's row. Over the patches, renormalised,
``q_i = a[p + i] / sum_j a[p + j]``; then

- ``top1 = max_i q_i`` and ``topk``: the sum of the ``k`` largest ``q_i``, with
  ``k = top_count(P) = ceil(P / 10)`` (10 % of the patch tokens: 2 of 16, 5 of 49, 7 of 64);
  uniform attention gives ``1 / P`` and ``k / P``;
- ``entropy = -sum_i q_i log q_i / log P``: 1 for uniform attention, 0 when it all falls on one
  patch token (``q_i = 0`` contributes 0; undefined, NaN, for ``P = 1``);
- ``registers = sum_{r=1}^{p-1} a[r]``: the share of the whole row the register tokens receive
  (0 without registers), and ``self = a[0]``: the share the class token gives itself; the
  patches get ``1 - self - registers``.

Every number is per image, block and (for the per-head arrays) head, computed from the rows
``token_norms`` records in its one pass (the ``blocks.l.attn.probs`` hook points), no new forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def top_count(num_patches: int) -> int:
    """``ceil(P / 10)`` (integer arithmetic, so no float rounding moves it), at least 1."""
    return max(1, -(-int(num_patches) // 10))


@dataclass
class AttentionConcentration:
    """The class token's attention per image and block (heads averaged) and per head.

    Attributes:
        top_k: ``k`` of ``topk`` (``top_count(P)``).
        top1, topk, entropy: ``(B, L)`` of the heads-averaged row over the patches (see the module docstring).
        registers, self_share: ``(B, L)`` share of the heads-averaged row on the register tokens, on CLS itself.
        top1_heads, topk_heads, entropy_heads, registers_heads: ``(B, L, H)`` the same per head.
    """

    top_k: int
    top1: np.ndarray
    topk: np.ndarray
    entropy: np.ndarray
    registers: np.ndarray
    self_share: np.ndarray
    top1_heads: np.ndarray
    topk_heads: np.ndarray
    entropy_heads: np.ndarray
    registers_heads: np.ndarray


def _measures(rows: np.ndarray, prefix: int, k: int) -> tuple[np.ndarray, ...]:
    """(top1, topk, entropy, registers, self) over the last axis of ``rows`` ``(..., N)``."""
    patches = rows[..., prefix:]
    P = patches.shape[-1]
    with np.errstate(invalid="ignore", divide="ignore"):
        q = patches / patches.sum(axis=-1, keepdims=True)
        ordered = -np.sort(-q, axis=-1)
        plogp = np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0)), 0.0)
        entropy = -plogp.sum(axis=-1) / math.log(P) if P > 1 else np.full(q.shape[:-1], np.nan)
    return (
        ordered[..., 0],
        ordered[..., :k].sum(axis=-1),
        entropy,
        rows[..., 1:prefix].sum(axis=-1),
        rows[..., 0],
    )


def concentration(cls_rows, prefix: int, top_k: int | None = None) -> AttentionConcentration:
    """Concentration numbers of the class token's attention rows.

    Args:
        cls_rows: ``(B, L, H, N)`` each block's and head's class-token row (probabilities over all tokens).
        prefix: Class and register tokens before the patches (``p``; patch ``i`` is token ``p + i``).
        top_k: ``k`` of ``topk`` (default ``top_count(P)``).
    """
    rows = np.asarray(cls_rows, dtype=np.float64)
    if rows.ndim != 4 or not 1 <= prefix < rows.shape[-1]:
        raise ValueError(
            f"cls_rows {rows.shape} with prefix {prefix}: expected (B, L, H, N) with 1 <= prefix < N"
        )
    P = rows.shape[-1] - prefix
    k = top_count(P) if top_k is None else int(top_k)
    if not 1 <= k <= P:
        raise ValueError(f"top_k={top_k!r}: must be in 1..{P}")
    mean = _measures(rows.mean(axis=2), prefix, k)
    heads = _measures(rows, prefix, k)
    return AttentionConcentration(
        top_k=k,
        top1=mean[0],
        topk=mean[1],
        entropy=mean[2],
        registers=mean[3],
        self_share=mean[4],
        top1_heads=heads[0],
        topk_heads=heads[1],
        entropy_heads=heads[2],
        registers_heads=heads[3],
    )
