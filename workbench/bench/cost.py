"""Compute cost per arm: parameters, FLOPs per image, training time and throughput.

Parameters are counted on a built model: on PyTorch's ``meta`` device for large ViTs
(shapes only, no memory), on the CPU for the small study models. FLOPs per image come from the analytic counts in
``workbench.bench.flops`` (multiply-accumulates x 2, the convention of
``torch.utils.flop_counter``, which the benchmark tests hold them to); a model those
formulas do not cover is counted by ``FlopCounterMode`` on the meta device. A timm arm
(``timm/<architecture>``) is counted that way, forward and forward + backward alike: the
glass-box models keep their analytic counts (the published Configuration and Compute cost
tables were made with them; the tests hold them to the counter).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from workbench.bench.flops import (
    cnn_forward_flops,
    cnn_train_flops,
    vit_forward_flops,
    vit_train_flops,
)
from workbench.models.cnn import CNNConfig
from workbench.models.registry import build_model, model_config
from workbench.models.timm_arm import TIMM_PREFIX, TimmModelConfig, shape_model
from workbench.models.vit import ViTConfig

ANALYTIC = "analytic multiply-accumulate count x 2 (workbench.bench.flops; LayerNorm, softmax, GELU, adds excluded)"
COUNTED_TIMM = "torch.utils.flop_counter.FlopCounterMode on the meta device (timm model: forward, and forward + backward)"


@dataclass(frozen=True)
class ModelCost:
    """Size and work of one model per image.

    ``forward_flops``: one image's forward pass. ``train_flops``: forward + backward of one
    image when every parameter trains (None when unknown or not applicable).
    """

    parameters: int
    trainable_parameters: int
    forward_flops: int | None
    train_flops: int | None
    image_size: int | None
    method: str


# parameters (estimated by a ViT's d^2 terms) above which a model is built on meta
META_ABOVE = 20_000_000


def _shape_model(cfg: ViTConfig | CNNConfig) -> nn.Module:
    """The model for counting only. Large ViTs go on the meta device (no memory, no init);
    small models are built on the CPU, which is faster than the meta device's one-time
    setup (importing its op registrations takes seconds)."""
    big = isinstance(cfg, ViTConfig) and 12 * cfg.depth * cfg.dim**2 > META_ABOVE
    with torch.device("meta" if big else "cpu"):
        return build_model(cfg)


def counted_flops(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Forward FLOPs of one input of ``input_shape`` (C, H, W), counted by ``FlopCounterMode``.

    Runs where the model's parameters are: build a large model on the meta device first
    (``with torch.device("meta")``) to count it without memory or compute.
    """
    device = next(model.parameters()).device
    x = torch.zeros((1, *input_shape), device=device)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x)
    return int(counter.get_total_flops())


def counted_train_flops(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Forward + backward FLOPs per image in training mode, counted by ``FlopCounterMode``.

    Two images, halved: batch norm in training mode needs more than one value per channel.
    The images need no gradient, so the first layer's input gradient is not computed (as in
    a training step).
    """
    device = next(model.parameters()).device
    x = torch.zeros((2, *input_shape), device=device)
    was_training = model.training
    model.train()
    try:
        with FlopCounterMode(display=False) as counter:
            model(x).sum().backward()
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops()) // 2


def timm_cost(cfg: TimmModelConfig, image_size: int | None) -> ModelCost:
    """Parameters and counted FLOPs per image of a timm arm (its fixed input size, or ``image_size``)."""
    model = shape_model(cfg)  # the cached meta build; counted_train_flops leaves it as it found it
    n = sum(p.numel() for p in model.parameters())
    fixed = cfg.fixed_image_hw
    if fixed is not None and image_size is not None and fixed != (image_size, image_size):
        raise ValueError(
            f"{cfg.name}: image_size={image_size} but the model takes {fixed[0]} x {fixed[1]} px"
        )
    hw = fixed or ((image_size, image_size) if image_size is not None else None)
    if hw is None:
        return ModelCost(
            n, n, None, None, None, "FLOPs unknown: the timm model's input size was not given"
        )
    shape = (cfg.in_channels, *hw)
    return ModelCost(
        n, n, counted_flops(model, shape), counted_train_flops(model, shape), hw[0], COUNTED_TIMM
    )


def model_cost(
    model_name: str, overrides: Mapping[str, Any] | None = None, image_size: int | None = None
) -> ModelCost:
    """Parameters and FLOPs per image of a registry model with field overrides (a protocol arm).

    Args:
        model_name: A study model name (``workbench.models.registry.STUDY_MODELS``) or ``timm/<architecture>``.
        overrides: Field overrides, as in the protocol.
        image_size: Input side in pixels; a ViT knows its own, a CNN needs it (the dataset's
            side, or ``resize_to``). Without it a CNN's FLOPs are None.
    """
    cfg = model_config(model_name, **dict(overrides or {}))
    if isinstance(cfg, TimmModelConfig):
        return timm_cost(cfg, image_size)
    n = sum(p.numel() for p in _shape_model(cfg).parameters())
    if isinstance(cfg, ViTConfig):
        if image_size is not None and image_size != cfg.image_size:
            raise ValueError(
                f"{model_name}: image_size={image_size} but the ViT config says {cfg.image_size}"
            )
        return ModelCost(
            n, n, vit_forward_flops(cfg)["total"], vit_train_flops(cfg), cfg.image_size, ANALYTIC
        )
    if image_size is None:
        return ModelCost(
            n, n, None, None, None, "FLOPs unknown: the CNN's input size was not given"
        )
    return ModelCost(
        n,
        n,
        cnn_forward_flops(cfg, image_size)["total"],
        cnn_train_flops(cfg, image_size),
        image_size,
        ANALYTIC,
    )


def vit_regime_cost(cfg: ViTConfig, kind: str, blocks: int | None = None) -> ModelCost:
    """Parameters (total and trained) and forward FLOPs of a transfer regime on a ViT source.

    Trainable parameters follow ``workbench.transfer.regimes.trainable_prefixes``: linear =
    head; partial = last ``blocks`` blocks, final norm, head; full and scratch = everything.
    ``train_flops`` is given for ``full`` and ``scratch`` only (the cached-feature regimes do not run the
    frozen part per epoch, so a per-image training count would mislead).
    """
    # transfer imports train; only needed here
    from workbench.transfer.regimes import (
        trainable_prefixes,
    )

    model = _shape_model(cfg)
    # the fields trainable_prefixes reads
    regime = SimpleNamespace(kind=kind, blocks=blocks, name=kind)
    prefixes = trainable_prefixes(model, regime)
    params = list(model.named_parameters())
    trained = sum(p.numel() for name, p in params if any(name.startswith(pre) for pre in prefixes))
    total = sum(p.numel() for _, p in params)
    fwd = vit_forward_flops(cfg)["total"]
    # trained on images end to end, not on cached features
    every_image = kind in (
        "full",
        "scratch",
    )
    return ModelCost(
        total, trained, fwd, vit_train_flops(cfg) if every_image else None, cfg.image_size, ANALYTIC
    )


def timm_vit_config(architecture: str, num_classes: int) -> ViTConfig:
    """The glass-box config of a timm ViT architecture (built on the meta device, no weights)."""
    import timm  # slow import; only the transfer cost table needs it

    from workbench.convert.timm_vit import config_from_timm

    if architecture.startswith(
        TIMM_PREFIX
    ):  # an arm's spelling; timm itself would read it as a hub repository
        architecture = architecture[len(TIMM_PREFIX) :]
    with torch.device("meta"):
        model = timm.create_model(architecture, pretrained=False, num_classes=num_classes)
    return config_from_timm(model)


@dataclass(frozen=True)
class TrainingCost:
    """What one run cost: wall time, epochs, images seen, throughput, where and how."""

    wall_seconds: float
    epochs_run: int
    images_seen: int
    images_per_second: float
    device: str
    precision: str
    achieved_flops_per_second: float | None = None  # train FLOPs per image x images per second


def training_cost(
    wall_seconds: float,
    epochs_run: int,
    *,
    images_seen: int | None = None,
    train_size: int | None = None,
    device: str = "unknown",
    precision: str = "off",
    train_flops_per_image: int | None = None,
) -> TrainingCost:
    """Throughput of one training run.

    Args:
        wall_seconds: Training wall time (> 0).
        epochs_run: Epochs actually run (early stopping may end before the budget).
        images_seen: Training images processed; default ``epochs_run * train_size``.
        train_size: Training-set size, used when ``images_seen`` is not logged.
        device: Device in words (e.g. "cuda: NVIDIA H200").
        precision: AMP setting ("off", "bf16", "fp16").
        train_flops_per_image: Forward + backward FLOPs per image, for achieved FLOP/s.
    """
    if not (
        isinstance(wall_seconds, (int, float)) and math.isfinite(wall_seconds) and wall_seconds > 0
    ):
        raise ValueError(f"wall_seconds={wall_seconds!r}: must be a positive number")
    if images_seen is None:
        if train_size is None:
            raise ValueError("training_cost: give images_seen or train_size")
        images_seen = int(epochs_run) * int(train_size)
    if images_seen < 0 or epochs_run < 0:
        raise ValueError(f"images_seen={images_seen}, epochs_run={epochs_run}: must be >= 0")
    ips = images_seen / float(wall_seconds)
    achieved = None if train_flops_per_image is None else float(train_flops_per_image) * ips
    return TrainingCost(
        float(wall_seconds), int(epochs_run), int(images_seen), ips, device, precision, achieved
    )


@dataclass(frozen=True)
class ArmCost:
    """An arm's training cost over its seeds."""

    n_runs: int
    mean_wall_seconds: float
    total_wall_seconds: float
    epochs_run: list[int]
    mean_images_per_second: float
    devices: list[str]
    precisions: list[str]


def arm_cost(runs: Sequence[TrainingCost]) -> ArmCost:
    """Summarise the runs of one arm: mean and total wall time, epochs per run, mean throughput.

    Devices and precisions are listed (sorted, distinct): a mix means the times are not
    comparable, which the report should say.
    """
    if not runs:
        raise ValueError("arm_cost: no runs")
    walls = [r.wall_seconds for r in runs]
    return ArmCost(
        len(runs),
        statistics.fmean(walls),
        math.fsum(walls),
        [r.epochs_run for r in runs],
        statistics.fmean(r.images_per_second for r in runs),
        sorted({r.device for r in runs}),
        sorted({r.precision for r in runs}),
    )
