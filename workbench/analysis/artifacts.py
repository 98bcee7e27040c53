"""A simple, documented check for the background-patch artifact of ViT attention maps.

Trained ViTs often park much of the class token's attention on a handful of
low-information patches (flat background), which then carry global rather than local
information (Darcet et al., 2024, "Vision Transformers Need Registers"). A map like that
says nothing about which object parts drove the prediction, so figures must not present
it as if it did.

Criterion (all thresholds are module constants so reports can quote them):

- A patch is *background* when its pixels, on the [0, 1] display scale, deviate from
  the image's background value by at most ``BACKGROUND_TOLERANCE`` on average; the
  background value is the per-channel median of the image's one-pixel border.
- A map is *flagged* when its ``TOP_K`` largest patches hold at least
  ``CONCENTRATION`` of the map's mass **and** at least ``BACKGROUND_SHARE`` of that
  top-k mass sits on background patches: attention concentrated on a few background
  patches. Maps over fewer than ``MIN_PATCHES`` patches are never flagged: three
  patches are not "a few" of four.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BACKGROUND_TOLERANCE = 0.1  # mean |pixel - background| on the [0, 1] scale
TOP_K = 3  # "a few" patches
CONCENTRATION = 0.5  # share of the map's mass in the top-k patches
BACKGROUND_SHARE = 0.5  # share of the top-k mass on background patches
MIN_PATCHES = 16  # smaller grids are never flagged

CRITERION = (
    f"flagged when the top {TOP_K} patches hold >= {CONCENTRATION:.0%} of the map and >= {BACKGROUND_SHARE:.0%} "
    f"of that sits on background patches (mean |pixel - border median| <= {BACKGROUND_TOLERANCE} on a 0-1 scale; "
    f"grids of fewer than {MIN_PATCHES} patches are not checked)"
)


def background_patches(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Which patches are background.

    Args:
        images: Display images ``(B, C, H, W)`` in [0, 1] (not normalised).
        patch_size: Side of a square patch; must divide H and W.

    Returns:
        Bool ``(B, H // patch_size, W // patch_size)``.
    """
    if images.dim() != 4 or images.shape[-1] % patch_size or images.shape[-2] % patch_size:
        raise ValueError(
            f"images {tuple(images.shape)} do not tile into {patch_size}-pixel patches"
        )
    x = images.detach().to(torch.float64)
    # (B, C, 2H + 2W)
    border = torch.cat([x[..., 0, :], x[..., -1, :], x[..., :, 0], x[..., :, -1]], dim=-1)
    background = border.median(dim=-1).values  # (B, C): median resists an object touching the edge
    deviation = (x - background[..., None, None]).abs().mean(dim=1, keepdim=True)  # (B, 1, H, W)
    per_patch = F.avg_pool2d(deviation, patch_size).squeeze(1)  # (B, rows, cols)
    return per_patch <= BACKGROUND_TOLERANCE


@dataclass(frozen=True)
class ArtifactCheck:
    """Outcome of the criterion for one map.

    Attributes:
        flagged: The map concentrates on a few background patches.
        topk_share: Share of the map's mass in its ``TOP_K`` largest patches.
        topk_background_share: Share of that top-k mass on background patches.
        background_mass: Share of the whole map on background patches.
        background_area: Share of patches that are background.
    """

    flagged: bool
    topk_share: float
    topk_background_share: float
    background_mass: float
    background_area: float

    def short(self) -> str:
        """One line for a panel: what the numbers are, and the verdict."""
        verdict = "BACKGROUND ARTIFACT" if self.flagged else "ok"
        return f"top{TOP_K} {self.topk_share:.0%}, bg {self.background_mass:.0%} (area {self.background_area:.0%}): {verdict}"


def check_maps(maps: torch.Tensor, background: torch.Tensor) -> list[ArtifactCheck]:
    """Apply the criterion to each map.

    Args:
        maps: ``(B, rows, cols)`` non-negative maps (need not be normalised).
        background: Bool ``(B, rows, cols)`` from ``background_patches``.

    Returns:
        One check per map, in batch order.
    """
    if maps.shape != background.shape:
        raise ValueError(
            f"maps {tuple(maps.shape)} and background {tuple(background.shape)} differ in shape"
        )
    m = maps.detach().to(torch.float64).flatten(1)  # (B, P)
    m = m / m.sum(dim=1, keepdim=True).clamp_min(1e-300)
    bg = background.flatten(1).to(torch.float64)  # (B, P)
    k = min(TOP_K, m.shape[1])
    top_values, top_index = m.topk(k, dim=1)  # (B, k)
    top_share = top_values.sum(dim=1)
    top_bg = (top_values * bg.gather(1, top_index)).sum(dim=1) / top_share.clamp_min(1e-300)
    checks = []
    for i in range(m.shape[0]):
        flagged = bool(
            m.shape[1] >= MIN_PATCHES
            and top_share[i] >= CONCENTRATION
            and top_bg[i] >= BACKGROUND_SHARE
        )
        checks.append(
            ArtifactCheck(
                flagged,
                float(top_share[i]),
                float(top_bg[i]),
                float((m[i] * bg[i]).sum()),
                float(bg[i].mean()),
            )
        )
    return checks
