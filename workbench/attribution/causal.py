"""Ground truth by exact intervention: each patch token's causal effect on the true-class log-probability.

For image ``x`` with true class ``y`` and patch token ``i``:

    effect_i = log p(y | x) - log p(y | x without patch token i)

where "without patch token i" is the same model run on the sequence with that one token
removed (``token_drop``: class and register tokens kept, every other token keeps its
position). Positive: the token helped the true class; negative: it hurt it; 0: removing
it changes nothing. Log-probabilities are ``log_softmax`` of the logits in float64.

The ``P`` drops of an image are one widened call: the image is embedded once and its token
sequence repeated ``P`` times inside the ``pos_add`` hook, so a chunk of ``b`` images runs
``b * P`` sequences of ``prefix + P - 1`` tokens through the blocks; ``max_sequences``
bounds ``b * P`` (memory). Only logits are read, so the calls run the fused attention kernel
(``glassbox.fused_attention``: the same function up to float rounding), and the rows after
the last block's attention are cut to the class token (``token_drop.class_token_only``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workbench.attribution.glassbox import as_glassbox, evaluating, fused_attention
from workbench.attribution.token_drop import all_but_one, logits_keeping


def true_log_prob(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log p(y)`` from logits ``(..., classes)`` and labels broadcastable to ``logits.shape[:-1]``."""
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    index = labels.to(logp.device).expand(logp.shape[:-1]).unsqueeze(-1)
    return logp.gather(-1, index).squeeze(-1)


@dataclass
class CausalEffects:
    """Per image and patch, the exact single-token drop's effect.

    Attributes:
        effects: ``(B, P)`` float64, ``log p_full(y) - log p_dropped(y)``.
        full_log_prob: ``(B,)`` ``log p(y)`` of the intact model.
        predicted: ``(B,)`` the intact model's class.
        forwards: Sequences run through the blocks (``B`` intact + ``B * P`` dropped).
    """

    effects: np.ndarray
    full_log_prob: np.ndarray
    predicted: np.ndarray
    forwards: int

    @classmethod
    def joined(cls, parts: list[CausalEffects]) -> CausalEffects:
        """The effects of consecutive image batches as one (images in the order given)."""
        return cls(
            effects=np.concatenate([c.effects for c in parts]),
            full_log_prob=np.concatenate([c.full_log_prob for c in parts]),
            predicted=np.concatenate([c.predicted for c in parts]),
            forwards=sum(c.forwards for c in parts),
        )


@torch.inference_mode()
def single_token_effects(
    model, images: torch.Tensor, labels: torch.Tensor, *, max_sequences: int = 4096
) -> CausalEffects:
    """Each patch token alone removed, per image: see the module docstring."""
    glass = as_glassbox(model)
    P = glass.cfg.num_patches
    chunk = max(1, max_sequences // P)
    effects, full, predicted = [], [], []
    keep_one = all_but_one(P)  # (P, P - 1)
    with evaluating(glass), fused_attention(glass):
        for start in range(0, images.shape[0], chunk):
            x, y = images[start : start + chunk], labels[start : start + chunk]
            logits = glass(x)
            base = true_log_prob(logits, y)  # (b,)
            keep = keep_one.unsqueeze(0).expand(x.shape[0], P, P - 1)
            dropped = true_log_prob(logits_keeping(glass, x, keep), y.view(-1, 1))  # (b, P)
            effects.append(base.unsqueeze(1) - dropped)
            full.append(base)
            predicted.append(logits.argmax(dim=-1))
    n = images.shape[0]
    return CausalEffects(
        effects=torch.cat(effects).cpu().numpy(),
        full_log_prob=torch.cat(full).cpu().numpy(),
        predicted=torch.cat(predicted).cpu().numpy(),
        forwards=n + n * P,
    )
