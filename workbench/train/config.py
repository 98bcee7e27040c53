"""Typed, frozen training configs, split by concern and validated on construction."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal


def _positive(owner: str, key: str, value: Any, allow_zero: bool = False) -> None:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        raise ValueError(f"{owner}.{key}={value!r}: must be {'>= 0' if allow_zero else '> 0'}")


def _finite(owner: str, config: Any) -> None:
    """Refuse inf and nan in any number field: ``lr=inf`` passes ``> 0`` and fails only at the first step."""
    for f in fields(config):
        values = getattr(config, f.name)
        for value in values if isinstance(values, (tuple, list)) else (values,):
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(
                    f"{owner}.{f.name}={values!r}: must be a finite number (not inf or nan)"
                )


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
        train_subset: Train on this many images of the training split, a nested, seeded,
            class-stratified subset (the first images of one order, so a smaller subset lies
            inside every larger one; seeded by ``split_seed``, the same for every run seed),
            while an epoch still draws as many images as the whole training split, as
            consecutive shuffled passes over the subset: the images seen, the schedule and the
            evaluations stay those of the full split. The validation split is unchanged, so arms
            that train on different sizes are still paired by seed; null: the whole split.
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
    train_subset: int | None = None  # data-size studies: train on a nested subset, same epoch size
    crop_padding: int = 0
    hflip: bool = False
    rotate_degrees: float = 0.0
    translate_fraction: float = 0.0
    resize_to: int | None = None  # batched resize (e.g. 28 px -> 224 px for pretrained models)

    def __post_init__(self) -> None:
        _finite("data", self)
        for key in ("train_size", "val_size", "subset", "train_subset", "resize_to"):
            value = getattr(self, key)
            if value is not None:
                _positive("data", key, value)
        _positive("data", "crop_padding", self.crop_padding, allow_zero=True)
        if not 0 <= self.rotate_degrees <= 180:
            raise ValueError(f"data.rotate_degrees={self.rotate_degrees!r}: must be in [0, 180]")
        if not 0 <= self.translate_fraction < 0.5:
            raise ValueError(
                f"data.translate_fraction={self.translate_fraction!r}: must be in [0, 0.5)"
            )


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
    # autocast; see workbench.precision (bf16 on CPU too)
    amp: Literal["off", "bf16", "fp16"] = "off"
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
class RecipeConfig:
    """timm's training-recipe parts, each off by default (stochastic depth is ``model.drop_path_rate``).

    Attributes:
        mixup_alpha: Mixup (timm's ``Mixup``): images and targets mixed with weight ~ Beta(a, a); 0: off.
            With mixup or CutMix on, the loss is timm's ``SoftTargetCrossEntropy`` on the mixed,
            label-smoothed (`optim.label_smoothing`) targets, and `train_accuracy` is measured against
            each mixed image's dominant target; `run.batch_size` must be even (timm's rule).
        cutmix_alpha: CutMix (timm's ``Mixup``): a box of the paired image pasted in, its area ~ Beta(a, a); 0: off.
        mixup_prob: Probability that a batch (or element) is mixed at all, in (0, 1].
        mixup_switch_prob: With both mixup and CutMix on: probability of CutMix instead of mixup, in [0, 1].
        mixup_mode: How mixing parameters are drawn: one per batch, per pair of images, or per image (timm's modes).
        randaugment_ops: RandAugment (torchvision v2's ``RandAugment``, per image on the uint8 batch): this
            many random ops per image, after crop and flip; 0: off.
        randaugment_magnitude: RandAugment's magnitude, 0 to 30 (of its 31 bins; 9 as in the paper and DeiT).
        ema_decay: Weight EMA (timm's ``ModelEmaV3``), updated after every optimiser step; when set, the EMA
            model is the one evaluated, selected, checkpointed as best and reported (the raw model's
            validation metrics are logged as `raw_val_loss` / `raw_val_accuracy`); null: off.
        ema_warmup: EMA decay warmup (timm's ``use_warmup``: decay grows as 1 - (1 + step)^(-2/3) up to
            `ema_decay`).
    """

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: Literal["batch", "pair", "elem"] = "batch"
    randaugment_ops: int = 0
    randaugment_magnitude: int = 9
    ema_decay: float | None = None
    ema_warmup: bool = False

    def __post_init__(self) -> None:
        _finite("recipe", self)
        _positive("recipe", "mixup_alpha", self.mixup_alpha, allow_zero=True)
        _positive("recipe", "cutmix_alpha", self.cutmix_alpha, allow_zero=True)
        if not 0 < self.mixup_prob <= 1:
            raise ValueError(f"recipe.mixup_prob={self.mixup_prob!r}: must be in (0, 1]")
        if not 0 <= self.mixup_switch_prob <= 1:
            raise ValueError(
                f"recipe.mixup_switch_prob={self.mixup_switch_prob!r}: must be in [0, 1]"
            )
        if self.mixup_mode not in ("batch", "pair", "elem"):
            raise ValueError(
                f"recipe.mixup_mode={self.mixup_mode!r}: must be 'batch', 'pair' or 'elem'"
            )
        for key, top in (("randaugment_ops", 16), ("randaugment_magnitude", 30)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
                raise ValueError(f"recipe.{key}={value!r}: must be an integer in [0, {top}]")
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise ValueError(
                f"recipe.ema_decay={self.ema_decay!r}: must be in (0, 1), or null for no EMA"
            )
        if not isinstance(self.ema_warmup, bool):
            raise ValueError(f"recipe.ema_warmup={self.ema_warmup!r}: must be true or false")
        if self.ema_warmup and self.ema_decay is None:
            raise ValueError("recipe.ema_warmup=True: needs recipe.ema_decay (the EMA is off)")

    @property
    def mixes(self) -> bool:
        """Whether mixup or CutMix is on (soft targets, an even batch)."""
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their off default: what a protocol hashes and a config records.

        A recipe left at its defaults is absent from every hash, so the hashes of configs and
        protocols written before these fields existed stay what they were.
        """
        off = RecipeConfig()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(off, f.name)
        }


FUSED_ATTENTION = ("off", "on", "auto")


@dataclass(frozen=True)
class FastPathConfig:
    """How the training step runs, each part off by default (all off: the step as it always ran).

    Attributes:
        compile: torch.compile the model for the training step (its forward and backward);
            evaluation stays eager. The first step's time, compile included, is logged as
            `compile_seconds`; where the compiler is unavailable or fails at its first compile,
            one line says so and the step runs eagerly (tag `fast_path.compiled`).
        fused_attention: The glass-box ViT's attention in training and in the run's own
            evaluations: off, the written-out softmax(QK^T/sqrt(d))V that analysis uses; on,
            torch's fused scaled_dot_product_attention; auto, fused on CUDA and written-out
            elsewhere (on CPU the fused kernel measured no faster: docs/training.md). timm arms
            keep timm's own attention; models without attention ignore it.
        fused_adamw: AdamW's fused kernel (``fused=True``) instead of its default multi-tensor
            (foreach) implementation.
    """

    compile: bool = False
    fused_attention: Literal["off", "on", "auto"] = "off"
    fused_adamw: bool = False

    def __post_init__(self) -> None:
        for key in ("compile", "fused_adamw"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"fast_path.{key}={getattr(self, key)!r}: must be true or false")
        if self.fused_attention not in FUSED_ATTENTION:
            raise ValueError(
                f"fast_path.fused_attention={self.fused_attention!r}: must be 'off', 'on' or 'auto'"
            )

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their off default: what a protocol hashes and a config records.

        All off is absent from every hash, so configs and protocols written before the fast
        path existed keep their hashes.
        """
        off = FastPathConfig()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(off, f.name)
        }


@dataclass(frozen=True)
class TrainConfig:
    model: ModelSpec
    data: DataSpec
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    fast_path: FastPathConfig = field(default_factory=FastPathConfig)

    def __post_init__(self) -> None:
        if self.recipe.mixes and self.run.batch_size % 2:
            raise ValueError(
                f"run.batch_size={self.run.batch_size}: mixup and CutMix pair each image with another "
                "(timm's Mixup): the batch size must be even"
            )

    def to_dict(self) -> dict:
        """The config as plain data; ``recipe`` and ``fast_path`` only when a part is on, and then
        only their changed fields.

        So a config without recipe or fast-path parts has the dict (and the ``config_hash``,
        params and ``config.json``) it had before those sections existed; ``data.train_subset``
        is left out when null for the same reason.
        """
        content = asdict(self)
        if content["data"]["train_subset"] is None:
            del content["data"]["train_subset"]
        for key in ("recipe", "fast_path"):
            changed = getattr(self, key).changed()
            if changed:
                content[key] = changed
            else:
                del content[key]
        return content
