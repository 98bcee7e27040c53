"""timm's ``forward_intermediates`` for the glass-box ViT: the blocks' outputs, read by hooks.

The block outputs are the ``blocks.i.resid2`` hook points of the one forward; this module
only chooses which to read and lays them out as timm does (prefix tokens split off, NCHW or
NLC), so a model's intermediates compare with timm's at 0.0 (tests/test_intermediates.py).
"""

from __future__ import annotations

import torch

from workbench.models.hooks import attached, record_hooks


def take_indices(depth: int, indices: int | list[int] | None) -> tuple[list[int], int]:
    """timm's rule (its private ``feature_take_indices``): None all blocks, n the last n, a list those (negative from the end)."""
    if indices is None:
        indices = depth
    if isinstance(indices, int):
        if not 0 < indices <= depth:
            raise ValueError(f"indices={indices}: the last n blocks, n from 1 to {depth}")
        take = list(range(depth - indices, depth))
    else:
        take = [depth + i if i < 0 else i for i in indices]
        bad = [i for i, t in zip(indices, take) if not 0 <= t < depth]
        if bad:
            raise ValueError(
                f"indices {bad}: block indices are 0 to {depth - 1} (or -{depth} to -1)"
            )
    return take, max(take)


def forward_intermediates(
    model,
    x: torch.Tensor,
    *,
    indices: int | list[int] | None = None,
    return_prefix_tokens: bool = False,
    norm: bool = False,
    stop_early: bool = False,
    output_fmt: str = "NCHW",
    intermediates_only: bool = False,
    output_dict: bool = False,
):
    """Arguments and outputs as timm's ``VisionTransformer.forward_intermediates``.

    Returns:
        ``(final normalised tokens, intermediates)``, only the intermediates with
        ``intermediates_only``, or a dict with ``image_intermediates`` (and
        ``image_intermediates_prefix``, ``image_features``) with ``output_dict``. With
        ``return_prefix_tokens`` each intermediate is a ``(spatial, prefix)`` pair.
    """
    if output_fmt not in ("NCHW", "NLC"):
        raise ValueError(f"output_fmt {output_fmt!r}: must be 'NCHW' or 'NLC'")
    take, max_index = take_indices(len(model.blocks), indices)
    B = x.shape[0]
    states: dict[str, torch.Tensor] = {}
    with attached(model, record_hooks(states, [f"blocks.{i}.resid2" for i in sorted(set(take))])):
        tokens = model.embed(x)  # (B, N, D)
        for block in model.blocks[: max_index + 1] if stop_early else model.blocks:
            tokens = block(tokens)
    found = [states[f"blocks.{i}.resid2"] for i in take]
    found = [model.norm(y) if norm else y for y in found]
    n_prefix = model.num_prefix_tokens
    prefix = [y[:, :n_prefix] for y in found] if n_prefix else None
    spatial = [y[:, n_prefix:] for y in found]  # (B, h*w, D)
    if output_fmt == "NCHW":
        h, w = model.cfg.grid
        # (B, D, h, w)
        spatial = [y.reshape(B, h, w, -1).permute(0, 3, 1, 2).contiguous() for y in spatial]
    if output_dict:
        out = {"image_intermediates": spatial}
        if prefix is not None and return_prefix_tokens:
            out["image_intermediates_prefix"] = prefix
        if not intermediates_only:
            out["image_features"] = model.norm(tokens)
        return out
    if return_prefix_tokens and prefix is not None:
        spatial = list(zip(spatial, prefix))
    if intermediates_only:
        return spatial
    return model.norm(tokens), spatial
