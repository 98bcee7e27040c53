"""The exact token drop: the same model run on a sequence without some patch tokens.

A hook on the ``pos_add`` hook point (``workbench.models.hooks.attached``) replaces the
token sequence, right after the positions are added, by the class and register tokens
followed by the kept patch tokens only (in their original order, each with its own
position). Nothing else changes: every block, the final norm and the CLS-pooling head run
on the shorter sequence, which is the model without those tokens (no grey fill, no blur).
This is the hook ``workbench.interventions.forward`` uses for ``tokens.*.drop``, here for
patch tokens and different per image; it needs no change to the prefix count, since the
prefix tokens are always kept.

The hook may also widen the batch: each image's tokens are computed once, then repeated
for ``S`` kept sets, so one call evaluates ``S`` variants of every image (``B * S``
sequences through the blocks) without embedding any image twice.

Only logits are read from these calls, and a CLS-pooling head reads the class token alone,
so ``logits_keeping`` also cuts the sequence to the class token once the last block's
attention has mixed the tokens (``class_token_only`` on that block's ``resid1``): the last
MLP, norm and residual then run on one token per sequence instead of all of them.
"""

from __future__ import annotations

import torch

from workbench.models.hooks import attached
from workbench.models.vit import VisionTransformer


def keep_patches_hook(keep: torch.Tensor, prefix: int):
    """A ``pos_add`` hook: ``(B, prefix + P, D)`` -> ``(B * S, prefix + M, D)`` keeping ``keep[b, s]``.

    Args:
        keep: ``(B, S, M)`` patch indices (0-based over the patches, not the tokens) kept in
            variant ``s`` of image ``b``; ``M`` may be 0 (the class and register tokens only).
        prefix: Number of class and register tokens, always kept.
    """

    def hook(x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        S, M = keep.shape[1], keep.shape[2]
        if keep.shape[0] != B:
            raise ValueError(f"keep has {keep.shape[0]} images, the batch has {B}")
        # One gather of rows of the flattened (B * T, D) tokens: per variant the prefix tokens,
        # then the kept patches (token index prefix + patch), offset by the image's first row.
        head = torch.arange(prefix, device=x.device).expand(B, S, prefix)
        tokens = torch.cat([head, keep.to(x.device) + prefix], dim=2)  # (B, S, prefix + M)
        rows = tokens + (torch.arange(B, device=x.device) * T).view(B, 1, 1)
        return x.reshape(B * T, D)[rows.reshape(-1)].view(B * S, prefix + M, D)

    return hook


def class_token_only(x: torch.Tensor) -> torch.Tensor:
    """A ``resid1`` hook for the last block: ``(B, N, D)`` -> ``(B, 1, D)``, the class token alone.

    After the last block's attention nothing mixes tokens: the second norm, the MLP, the
    residual and the final norm act on each token alone, and a CLS-pooling head reads the
    class token only. Cutting the other rows there leaves the logits the same function (up to
    float rounding) and skips the last MLP on every patch and register token.
    """
    return x[:, :1]


def logits_keeping(
    model: VisionTransformer, images: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """Logits ``(B, S, classes)`` of ``model`` on each image with only the patches ``keep[b, s]`` left.

    ``keep`` is ``(B, S, M)``; every variant keeps the same number ``M`` of patches.
    The call is ``model(images)`` with a hook on ``pos_add`` and, for the CLS-pooling head, one on the
    last block's ``resid1`` (``class_token_only``): no second forward body.
    """
    B, S = keep.shape[0], keep.shape[1]
    hooks = [("pos_add", keep_patches_hook(keep, model.cfg.num_prefix_tokens))]
    if model.cfg.pooling == "cls":
        hooks.append((f"blocks.{model.cfg.depth - 1}.resid1", class_token_only))
    with attached(model, hooks):
        logits = model(images)  # (B * S, classes)
    return logits.view(B, S, -1)


def all_but_one(num_patches: int) -> torch.Tensor:
    """``(P, P - 1)``: row ``i`` holds every patch index but ``i``, ascending."""
    full = torch.arange(num_patches).expand(num_patches, num_patches)
    return full[~torch.eye(num_patches, dtype=torch.bool)].view(num_patches, num_patches - 1)
