"""Shared plumbing of the analysis figures: Agg figures, exact-size PNGs, display images.

Figures are ``matplotlib.figure.Figure`` objects made without pyplot: no global backend
state, nothing kept alive by a figure manager, and the Agg renderer does the PNG. PNGs are
saved without ``bbox_inches="tight"`` so a figure of ``figsize`` inches at ``dpi`` is
exactly ``figsize * dpi`` pixels, which reports and tests rely on.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from workbench.convert.checkpoints import atomic_write_bytes
from workbench.data.transforms import NormStats

DPI = 100
# masked by the umask as open() masks it, like the report files beside the figures
FILE_MODE = 0o666
DIAGNOSTIC = (
    "Diagnostic, not an explanation: attention weights show where information flowed, "
    "not why the model predicted what it did."
)


def new_figure(figsize: tuple[float, float], dpi: int = DPI) -> Figure:
    """A constrained-layout figure of exactly ``figsize * dpi`` pixels when saved."""
    return Figure(figsize=figsize, dpi=dpi, layout="constrained")


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes at its own dpi (no tight bounding box: size stays exact)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi)
    return buf.getvalue()


def save_png(fig: Figure, path: str | Path) -> Path:
    """Write the figure atomically as a PNG (readable like the reports: 0644 under umask 022); return the path."""
    path = Path(path)
    atomic_write_bytes(path, png_bytes(fig), FILE_MODE)
    return path


def display_images(images: torch.Tensor, norm: NormStats | None = None) -> np.ndarray:
    """Model inputs or uint8 images -> ``(B, H, W, C)`` float in [0, 1] for imshow.

    Args:
        images: uint8 ``(B, C, H, W)``, or float normalised with ``norm``, or float in
            [0, 1] when ``norm`` is None.
        norm: Statistics the float images were normalised with.
    """
    x = images.detach().cpu()
    if x.dtype == torch.uint8:
        x = x.float() / 255.0
    elif norm is not None:
        mean = torch.tensor(norm.mean, dtype=x.dtype).view(1, -1, 1, 1)
        std = torch.tensor(norm.std, dtype=x.dtype).view(1, -1, 1, 1)
        x = x * std + mean
    return x.clamp(0, 1).permute(0, 2, 3, 1).numpy()


def show_image(ax, image: np.ndarray, **kwargs) -> None:
    """imshow an ``(H, W, C)`` image: grey for one channel, RGB for three; no ticks."""
    if image.shape[-1] == 1:
        ax.imshow(image[..., 0], cmap="gray", vmin=0, vmax=1, **kwargs)
    else:
        ax.imshow(image, **kwargs)
    ax.set_xticks([])
    ax.set_yticks([])


def footer(fig: Figure, text: str, color: str = "0.25") -> None:
    """A note along the bottom edge (constrained layout leaves room for suptitle, not this)."""
    fig.supxlabel(text, fontsize=8, color=color, wrap=True)


def wrap(text: str, fig: Figure, fontsize: float = 10.0) -> str:
    """Wrap each line of a title to the figure's width (constrained layout does not wrap)."""
    # ~0.63 em per character at 72 pt/inch
    chars = max(20, int(fig.get_figwidth() * 115 / fontsize))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))
