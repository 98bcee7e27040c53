"""Figures of a ViT's inside: attention overlays, per-head maps, patch grid, position similarity.

Each function takes arrays and returns a ``Figure``; nothing is computed from a model
here (see ``rollout`` and ``embeddings``). Every attention figure carries the diagnostic
note and the background-artifact verdict of each map (``artifacts``), and panels whose
map is flagged get a red frame and say so instead of presenting the map as meaning.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from workbench.analysis.artifacts import CRITERION, ArtifactCheck
from workbench.analysis.common import DIAGNOSTIC, DPI, footer, new_figure, show_image, wrap

FLAG_COLOR = "#d62728"
PANEL_INCHES = 2.2
OUTLINE_LEVEL = 0.15  # grey level of the object outline drawn on maps of one-channel images


def _overlay(ax, image: np.ndarray, patch_map: np.ndarray, check: ArtifactCheck | None) -> None:
    """The patch map over the image; nearest interpolation keeps the patch structure honest.

    A grey image under a translucent colour map mixes into muddy tones that hide both, so
    for one-channel images the map is drawn opaque with the object's outline on top; an
    RGB photo has no clean outline and gets the usual translucent overlay.
    """
    h, w = image.shape[:2]
    extent = (-0.5, w - 0.5, h - 0.5, -0.5)
    scale = {
        "cmap": "inferno",
        "vmin": 0.0,
        "vmax": float(patch_map.max()) or 1.0,
        "interpolation": "nearest",
    }
    if image.shape[-1] == 1:
        ax.imshow(patch_map, extent=extent, **scale)
        ax.contour(image[..., 0], levels=[OUTLINE_LEVEL], colors="#00e5ff", linewidths=0.9)
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        show_image(ax, image)
        ax.imshow(patch_map, alpha=0.55, extent=extent, **scale)
    peak = f"max patch {patch_map.max() / max(patch_map.sum(), 1e-300):.1%} (uniform {1 / patch_map.size:.1%})"
    ax.set_xlabel(
        peak if check is None else f"{peak}\n{check.short()}",
        fontsize=6.5,
        color=FLAG_COLOR if check is not None and check.flagged else "0.2",
    )
    if check is not None and check.flagged:
        for spine in ax.spines.values():
            spine.set_edgecolor(FLAG_COLOR)
            spine.set_linewidth(3)


def _verdict(checks: Sequence[ArtifactCheck]) -> tuple[str, str]:
    """(footer text, colour): the diagnostic note, the criterion, and how many maps it flagged."""
    flagged = sum(c.flagged for c in checks)
    text = (
        f"{DIAGNOSTIC} Colour scale per panel, 0 to the panel's maximum (under each panel, as a share of "
        f"the map, beside a uniform map's share).\nBackground-artifact check: {CRITERION}."
    )
    if flagged:
        text += (
            f"\n{flagged} of {len(checks)} maps FLAGGED (red frame): attention concentrated on a few background "
            "patches is a known ViT artifact (global 'register' tokens), not evidence about the object."
        )
        return text, FLAG_COLOR
    return text + f"\nNone of the {len(checks)} maps is flagged.", "0.25"


def overlay_figure(
    images: np.ndarray,
    columns: dict[str, np.ndarray],
    title: str,
    row_labels: Sequence[str] | None = None,
    checks: dict[str, Sequence[ArtifactCheck]] | None = None,
    dpi: int = DPI,
) -> Figure:
    """One row per image: the image, then each map overlaid on it.

    Args:
        images: ``(B, H, W, C)`` in [0, 1].
        columns: Column title -> maps ``(B, rows, cols)``.
        title: Figure title (say which query the maps read).
        row_labels: One label per image (e.g. true and predicted class).
        checks: Column title -> artifact check per image.
        dpi: Resolution.
    """
    b, ncols = len(images), 1 + len(columns)
    # 2.4 inches for the title above and the diagnostic note and criterion below
    fig = new_figure((round(PANEL_INCHES * ncols, 2), round(PANEL_INCHES * b + 2.4, 2)), dpi)
    axes = fig.subplots(b, ncols, squeeze=False)
    checks = checks or {}
    for i in range(b):
        show_image(axes[i, 0], images[i])
        if row_labels:
            axes[i, 0].set_ylabel(row_labels[i], fontsize=7)
        for j, (name, maps) in enumerate(columns.items(), start=1):
            _overlay(axes[i, j], images[i], maps[i], checks[name][i] if name in checks else None)
            if i == 0:
                axes[i, j].set_title(name, fontsize=9)
    axes[0, 0].set_title("input", fontsize=9)
    fig.suptitle(wrap(title, fig), fontsize=10)
    text, color = _verdict([c for cs in checks.values() for c in cs])
    footer(fig, text, color)
    return fig


def head_maps_figure(
    images: np.ndarray,
    head_maps: np.ndarray,
    block: int,
    title: str,
    row_labels: Sequence[str] | None = None,
    checks: Sequence[Sequence[ArtifactCheck]] | None = None,
    dpi: int = DPI,
) -> Figure:
    """Per-head maps of one block: one row per image, one column per head.

    Args:
        images: ``(B, H, W, C)`` in [0, 1].
        head_maps: ``(B, heads, rows, cols)``.
        block: Block index shown (added to the title).
        title: Figure title.
        row_labels: One label per image.
        checks: ``checks[i][h]`` for image i, head h.
        dpi: Resolution.
    """
    b, heads = head_maps.shape[:2]
    columns = {f"head {h}": head_maps[:, h] for h in range(heads)}
    by_column = None
    if checks is not None:
        by_column = {f"head {h}": [checks[i][h] for i in range(b)] for h in range(heads)}
    return overlay_figure(images, columns, f"{title} (block {block})", row_labels, by_column, dpi)


def patch_grid_figure(
    image: np.ndarray, patch_size: int, prefix_tokens: int = 1, title: str = "", dpi: int = DPI
) -> Figure:
    """An image cut into patches: boundaries and patch numbers, then the patches as tokens.

    Args:
        image: ``(H, W, C)`` in [0, 1].
        patch_size: Patch side in pixels.
        prefix_tokens: Class/register tokens before the patches (token = patch + prefix).
        title: Extra title text.
        dpi: Resolution.
    """
    h, w = image.shape[:2]
    rows, cols = h // patch_size, w // patch_size
    fig = new_figure((11.0, 6.0), dpi)
    left, right = fig.subplots(1, 2)
    show_image(left, image)
    for k in range(1, cols):
        left.axvline(k * patch_size - 0.5, color="#1f77b4", linewidth=0.8)
    for k in range(1, rows):
        left.axhline(k * patch_size - 0.5, color="#1f77b4", linewidth=0.8)
    size = max(3.5, min(10.0, 120.0 / max(rows, cols)))
    for r in range(rows):
        for c in range(cols):
            left.text(
                (c + 0.5) * patch_size - 0.5,
                (r + 0.5) * patch_size - 0.5,
                str(r * cols + c),
                ha="center",
                va="center",
                fontsize=size,
                color="#ffdd00",
                bbox={"boxstyle": "square,pad=0.1", "fc": "black", "alpha": 0.45, "lw": 0},
            )
    left.set_title(
        f"{h}x{w} image, {rows}x{cols} = {rows * cols} patches of {patch_size}x{patch_size} px",
        fontsize=9,
    )
    # Exploded view: gaps between patches show that each is embedded on its own.
    gap = max(1, patch_size // 4)
    tile = patch_size + gap
    mosaic = np.ones((rows * tile - gap, cols * tile - gap, image.shape[2]))
    for r in range(rows):
        for c in range(cols):
            mosaic[r * tile : r * tile + patch_size, c * tile : c * tile + patch_size] = image[
                r * patch_size : (r + 1) * patch_size, c * patch_size : (c + 1) * patch_size
            ]
    show_image(right, mosaic)
    right.set_title(
        f"pulled apart: each patch becomes one token, read row by row (token = patch + {prefix_tokens})",
        fontsize=9,
    )
    fig.suptitle(f"Patch grid{': ' + title if title else ''}", fontsize=10)
    return fig


def position_similarity_figure(similarity: np.ndarray, title: str = "", dpi: int = DPI) -> Figure:
    """Grid of small maps: tile (i, j) is position (i, j)'s cosine similarity to all positions.

    Args:
        similarity: ``(rows, cols, rows, cols)`` from ``position_similarity``.
        title: Extra title text (e.g. the model and its weight source).
        dpi: Resolution.
    """
    rows, cols = similarity.shape[:2]
    gap = 1
    tile_h, tile_w = rows + gap, cols + gap
    # NaN gaps show as background
    mosaic = np.full((rows * tile_h - gap, cols * tile_w - gap), np.nan)
    for i in range(rows):
        for j in range(cols):
            mosaic[i * tile_h : i * tile_h + rows, j * tile_w : j * tile_w + cols] = similarity[
                i, j
            ]
    fig = new_figure((9.0, 8.0), dpi)
    ax = fig.subplots()
    image = ax.imshow(mosaic, cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    step = max(1, rows // 14)  # readable tick density for 14x14 and larger grids
    ax.set_xticks(
        [j * tile_w + (cols - 1) / 2 for j in range(0, cols, step)],
        [str(j) for j in range(0, cols, step)],
    )
    ax.set_yticks(
        [i * tile_h + (rows - 1) / 2 for i in range(0, rows, step)],
        [str(i) for i in range(0, rows, step)],
    )
    ax.set_xlabel("patch column of the position", fontsize=9)
    ax.set_ylabel("patch row of the position", fontsize=9)
    ax.set_facecolor("white")
    fig.colorbar(image, ax=ax, shrink=0.8, label="cosine similarity")
    fig.suptitle(
        f"Positional-embedding similarity{': ' + title if title else ''}\n"
        f"tile (row, column) = that position's similarity to each of the {rows}x{cols} positions",
        fontsize=10,
    )
    return fig
