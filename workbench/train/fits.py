"""Does a model config fit the data it is about to train on? Checked before any run opens.

Everything here is known once the dataset is loaded (classes, channels, image size) and
before a model is built or a step is taken, so an entry point can refuse a misfit in one
line per problem instead of failing every cell after its run was opened. The trainer asks
the same question (``workbench.train.loop.Trainer``), so a caller that skips the check
still gets the same message, only later.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.models.registry import model_config
from workbench.models.timm_arm import TimmModelConfig, refuses_input
from workbench.models.vit_config import ViTConfig


@dataclass(frozen=True)
class DataShape:
    """What a model must agree with: the dataset's classes and its images' shape.

    Attributes:
        classes: Class names in label order.
        channels: 1 (grey) or 3 (RGB).
        height, width: Image size in pixels, as stored.
        what: The dataset for messages, e.g. ``"image folder shapes"``.
    """

    classes: tuple[str, ...]
    channels: int
    height: int
    width: int
    what: str

    @classmethod
    def of(cls, data) -> "DataShape":
        """From ``workbench.data.PreparedData``: its training images ``(N, C, H, W)`` and class names."""
        _, c, h, w = data.train.images.shape
        return cls(tuple(data.class_names), int(c), int(h), int(w), data.display_name)

    def describe(self) -> str:
        names = ", ".join(self.classes[:6]) + (", ..." if len(self.classes) > 6 else "")
        n = len(self.classes)
        return (
            f"{self.what}: {n} class{'' if n == 1 else 'es'} ({names}), {self.channels} channel(s), "
            f"{self.height} x {self.width} px"
        )


@dataclass(frozen=True)
class Misfit:
    """One disagreement between a model field and the data, with the value that fixes it."""

    field: str  # a model config field (a timm keyword argument), ``resize_to`` (a dataset field), or ``name``
    value: object
    wanted: object  # None: no one value fixes it (a timm model that refuses the images)
    why: str

    def line(self, key: str) -> str:
        """The message with the protocol key (or option) that holds the field (and its fix, when one value fixes it)."""
        fix = "" if self.wanted is None else f"; set {key.rsplit('.', 1)[-1]}: {self.wanted!r}"
        return f"{key}={self.value!r}: {self.why}{fix}"


def misfits(
    model_name: str, overrides: dict, shape: DataShape, resize_to: int | None = None
) -> list[Misfit]:
    """Every way the named model (with field overrides) cannot train on data of ``shape``.

    Classes and channels for any model; for a ViT with learned positions also the image
    size its position embedding is built for (after ``resize_to``, the batched resize): a CNN
    with global pooling, or a ViT without position embedding, takes any size, but a learned
    position embedding fixes the token count.
    """
    cfg = model_config(model_name, **overrides)
    if isinstance(cfg, TimmModelConfig):
        return _timm_misfits(cfg, shape, resize_to)
    found = []
    if cfg.num_classes != len(shape.classes):
        found.append(
            Misfit(
                "num_classes",
                cfg.num_classes,
                len(shape.classes),
                f"the data has {len(shape.classes)} classes",
            )
        )
    if cfg.in_channels != shape.channels:
        found.append(
            Misfit(
                "in_channels",
                cfg.in_channels,
                shape.channels,
                f"the images have {shape.channels} channel(s)",
            )
        )
    if isinstance(cfg, ViTConfig) and cfg.pos_embed != "none":
        hw = (resize_to, resize_to) if resize_to else (shape.height, shape.width)
        if tuple(cfg.image_hw) != hw:
            size = (
                f"resized to {hw[0]} px (dataset.resize_to)"
                if resize_to
                else f"{hw[0]} x {hw[1]} px"
            )
            wanted = hw[0] if hw[0] == hw[1] else list(hw)
            found.append(
                Misfit(
                    "image_size",
                    cfg.image_size,
                    wanted,
                    f"the images are {size}, and a learned position embedding fixes the size",
                )
            )
    return found


def _timm_misfits(cfg: TimmModelConfig, shape: DataShape, resize_to: int | None) -> list[Misfit]:
    """A timm arm's misfits, under timm's keyword names (``num_classes``, ``in_chans``, ``img_size``).

    Beyond classes, channels and a fixed input size, one forward on the meta device asks the
    model itself whether it takes an image of the data's shape (a CNN whose stem shrinks a
    small image to nothing fails there).
    """
    found = []
    if cfg.num_classes != len(shape.classes):
        found.append(
            Misfit(
                "num_classes",
                cfg.num_classes,
                len(shape.classes),
                f"the data has {len(shape.classes)} classes",
            )
        )
    if cfg.in_channels != shape.channels:
        found.append(
            Misfit(
                "in_chans",
                cfg.in_channels,
                shape.channels,
                f"the images have {shape.channels} channel(s)",
            )
        )
    hw = (resize_to, resize_to) if resize_to else (shape.height, shape.width)
    fixed = cfg.fixed_image_hw
    if fixed is not None and fixed != hw:
        size = (
            f"resized to {hw[0]} px (dataset.resize_to)" if resize_to else f"{hw[0]} x {hw[1]} px"
        )
        found.append(
            Misfit(
                "img_size",
                cfg.kwargs.get("img_size", fixed[0] if fixed[0] == fixed[1] else list(fixed)),
                hw[0] if hw[0] == hw[1] else list(hw),
                f"the images are {size}, and the model's patch embedding takes one size only",
            )
        )
    if not found:
        why = refuses_input(cfg, (shape.channels, *hw))
        if why:
            found.append(
                Misfit(
                    "name",
                    cfg.name,
                    None,
                    f"a forward on an image of {shape.channels} x {hw[0]} x {hw[1]} fails: {why}",
                )
            )
    return found


def patch_note(model_name: str, overrides: dict) -> str | None:
    """A ViT whose patch does not divide its image size leaves the last rows/columns unseen (as timm does)."""
    cfg = model_config(model_name, **overrides)
    if not isinstance(cfg, ViTConfig):
        return None
    (h, w), (ph, pw) = cfg.image_hw, cfg.patch_hw
    if h % ph or w % pw:
        return (
            f"patch_size {cfg.patch_size} does not divide image_size {cfg.image_size}: the last "
            f"{h % ph} row(s) and {w % pw} column(s) of pixels are never seen"
        )
    return None
