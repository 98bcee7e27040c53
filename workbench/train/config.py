"""Typed, frozen training configs, split by concern and validated on construction."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal


def _positive(owner: str, key: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"{owner}.{key}={value!r}: must be {'>= 0' if allow_zero else '> 0'}")


def _finite(owner: str, config: Any) -> None:
    """Refuse inf and nan in any number field: ``lr=inf`` passes ``> 0`` and fails only at the first step."""
    for f in fields(config):
        values = getattr(config, f.name)
        for value in values if isinstance(values, (tuple, list)) else (values,):
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{owner}.{f.name}={values!r}: must be a finite number (not inf or nan)")


@dataclass(frozen=True)
class ModelSpec:
    """A named model (see workbench.models.registry) with field overrides."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelSpec.name={self.name!r}: must be a model name")
        if not isinstance(self.overrides, dict):
            raise ValueError(f"ModelSpec.overrides={self.overrides!r}: must be a mapping")


@dataclass(frozen=True)
class DataSpec:
    """Which data, which split, and which train-only augmentation.

    Attributes:
        name: The dataset: fashion_mnist, cifar10, retinamnist or image_folder (your own
            images: ``train/<class>/*.png`` under the folder given with ``--data-path``).
        path: Where this machine keeps the data (a run-time choice, never a protocol key).
        train_size: Training images carved, stratified by class, from the official training
            split; null: the data layer's default for the dataset (docs/data.md). Not allowed
            for a dataset with its own validation split (RetinaMNIST, a folder with ``val/``).
        val_size: Validation images carved the same way; null: the dataset's default.
        split_seed: Seed of the stratified split and of ``subset``.
        subset: Keep at most this many images of every split, stratified by class (smoke
            runs); null: all.
        crop_padding: Training only: pad by this many pixels, then crop back at random; 0: off.
        hflip: Training only: flip horizontally at random.
        rotate_degrees: Training only: rotate by up to this many degrees at random.
        translate_fraction: Training only: shift by up to this fraction of the image side at random.
        resize_to: Resize every batch to this side in pixels (28 px data for a 224 px model);
            null: the images as stored.
    """

    name: str
    path: str | None = None
    train_size: int | None = None
    val_size: int | None = None
    split_seed: int = 42
    subset: int | None = None  # smoke runs: at most this many images per split, stratified by class
    crop_padding: int = 0
    hflip: bool = False
    rotate_degrees: float = 0.0
    translate_fraction: float = 0.0
    resize_to: int | None = None  # batched resize (e.g. 28 px -> 224 px for pretrained models)

    def __post_init__(self) -> None:
        _finite("data", self)
        for key in ("train_size", "val_size", "subset", "resize_to"):
            value = getattr(self, key)
            if value is not None:
                _positive("data", key, value)
        _positive("data", "crop_padding", self.crop_padding, allow_zero=True)
        if not 0 <= self.rotate_degrees <= 180:
            raise ValueError(f"data.rotate_degrees={self.rotate_degrees!r}: must be in [0, 180]")
        if not 0 <= self.translate_fraction < 0.5:
            raise ValueError(f"data.translate_fraction={self.translate_fraction!r}: must be in [0, 0.5)")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with a cosine schedule and optional linear warmup.

    Attributes:
        lr: Peak learning rate of AdamW, reached after the warmup.
        weight_decay: AdamW's (decoupled) weight decay.
        betas: AdamW's two moment coefficients, each in [0, 1).
        warmup_epochs: Linear warmup from 0 to ``lr`` over this many epochs (fractions allowed); 0: none.
        min_lr_ratio: Where the cosine schedule ends, as a fraction of ``lr``.
        label_smoothing: Label smoothing of the cross-entropy loss, in [0, 1).
        grad_clip: Clip the gradients' global norm to this value; null: no clipping.
    """

    lr: float = 1e-3
    weight_decay: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_epochs: float = 0.0
    min_lr_ratio: float = 0.0
    label_smoothing: float = 0.0
    grad_clip: float | None = None

    def __post_init__(self) -> None:
        _finite("optim", self)
        _positive("optim", "lr", self.lr)
        _positive("optim", "weight_decay", self.weight_decay, allow_zero=True)
        _positive("optim", "warmup_epochs", self.warmup_epochs, allow_zero=True)
        object.__setattr__(self, "betas", tuple(self.betas))
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas={self.betas!r}: must be two numbers in [0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio!r}: must be in [0, 1]")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"optim.label_smoothing={self.label_smoothing!r}: must be in [0, 1)")
        if self.grad_clip is not None:
            _positive("optim", "grad_clip", self.grad_clip)


@dataclass(frozen=True)
class RunConfig:
    """Budget, early stopping, checkpointing and numerics of one training run.

    Attributes:
        epochs: Training epochs (the ceiling when ``patience`` stops earlier).
        batch_size: Training batch size; at most the number of training images.
        eval_batch_size: Batch size of the validation and test evaluations.
        seed: The cell's seed (from the protocol's ``seeds``, never a protocol key).
        patience: Stop after this many epochs without a better ``monitor``; null: train every epoch.
        monitor: The validation metric that picks the best epoch (and drives early stopping).
        checkpoint_every_steps: Also checkpoint every this many optimizer steps (besides every
            epoch); null: at epoch ends only.
        device: Where to train (a run-time choice: ``--device``).
        amp: Autocast precision: off, bf16 or fp16 (docs/precision.md).
        deterministic: Deterministic kernels (a run-time choice).
        evaluate_test: Evaluate the best-validation checkpoint once on the test split; for
            every arm or none (a paired comparison needs both).
    """

    epochs: int = 10
    batch_size: int = 128
    eval_batch_size: int = 512
    seed: int = 0
    patience: int | None = None  # early stopping: epochs without improvement of `monitor`
    monitor: Literal["val_accuracy", "val_loss"] = "val_accuracy"
    checkpoint_every_steps: int | None = None  # in addition to every epoch
    device: str = "auto"  # auto -> cuda, mps, cpu
    amp: Literal["off", "bf16", "fp16"] = "off"  # autocast; see workbench.precision (bf16 on CPU too)
    deterministic: bool = True
    evaluate_test: bool = False

    def __post_init__(self) -> None:
        for key in ("epochs", "batch_size", "eval_batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"run.{key}={value!r}: must be a positive integer")
        for key in ("patience", "checkpoint_every_steps"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"run.{key}={value!r}: must be a positive integer or null")
        if self.monitor not in ("val_accuracy", "val_loss"):
            raise ValueError(f"run.monitor={self.monitor!r}: must be 'val_accuracy' or 'val_loss'")
        if self.amp not in ("off", "bf16", "fp16"):
            raise ValueError(f"run.amp={self.amp!r}: must be 'off', 'bf16' or 'fp16'")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelSpec
    data: DataSpec
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return asdict(self)
