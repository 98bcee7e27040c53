"""Calibration of a protocol's cells: training-step and evaluation speed of each arm, and the
wall time they imply, for sizing a protocol to a budget before running it.

Each arm's model is built from its config and timed on random inputs of the dataset's
shape: one training step (autocast as the run's ``amp`` says, cross-entropy with the
protocol's label smoothing, backward, AdamW) at the run's batch size, and one evaluation
forward at the eval batch size. Data loading and augmentation are left out (the loader
benchmark shows they cost a small fraction of a ViT step), so the projection is a lower
bound on a quiet machine; ``project_seconds`` adds the per-epoch evaluation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workbench.models.registry import build_model, model_config
from workbench.precision import resolve_amp
from workbench.train.config import TrainConfig


@dataclass(frozen=True)
class CellSpeed:
    """Measured speed of one arm: images per second (median of the timed steps)."""

    arm: str
    threads: int
    train_images_per_s: float
    eval_images_per_s: float
    steps: int
    train_step_seconds: tuple[float, ...] = ()  # every timed step, for the verdicts


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


# The side of the images each dataset stores (the loader hands them on at that side unless
# ``data.resize_to`` is set); a model whose config has no image size (the CNN, timm CNNs) is
# timed at it, so a CIFAR-10 arm is timed at 32 px, not at 28.
STORED_SIDE = {"fashion_mnist": 28, "cifar10": 32, "retinamnist": 28}


def measure_arm(
    arm: str,
    cfg: TrainConfig,
    image_size: int | None = None,
    steps: int = 5,
    warmup: int = 2,
    seed: int = 0,
) -> CellSpeed:
    """Time ``steps`` training steps and ``steps`` evaluation batches of ``cfg``'s model on CPU.

    ``image_size`` is used only for models whose config has none (the CNN, timm CNNs); by
    default ``data.resize_to`` or the side the dataset stores (28 for an image folder).
    """
    if image_size is None:
        image_size = cfg.data.resize_to or STORED_SIDE.get(cfg.data.name, 28)
    device = torch.device("cpu")
    amp = resolve_amp(cfg.run.amp, device)
    torch.manual_seed(seed)
    mcfg = model_config(cfg.model.name, **cfg.model.overrides)
    model = build_model(mcfg).train()
    in_channels, size = mcfg.in_channels, getattr(mcfg, "image_size", image_size)
    image_size = size if isinstance(size, int) else size[0]
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay
    )
    g = torch.Generator().manual_seed(seed)
    b, eb = cfg.run.batch_size, cfg.run.eval_batch_size
    x = torch.randn(b, in_channels, image_size, image_size, generator=g)  # (B, C, H, W)
    y = torch.randint(0, model.cfg.num_classes, (b,), generator=g)
    xe = torch.randn(eb, in_channels, image_size, image_size, generator=g)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            loss = F.cross_entropy(model(x).float(), y, label_smoothing=cfg.optim.label_smoothing)
        loss.backward()
        if cfg.optim.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()

    @torch.no_grad()
    def eval_step() -> None:
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            model(xe)

    def timed(fn) -> list[float]:
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    train_s = timed(train_step)
    model.eval()
    eval_s = timed(eval_step)
    # fmt: skip
    return CellSpeed(
        arm,
        torch.get_num_threads(),
        b / _median(train_s),
        eb / _median(eval_s),
        steps,
        tuple(train_s),
    )


def project_seconds(speed: CellSpeed, train_images: int, val_images: int, epochs: int) -> float:
    """Wall seconds of one cell: every epoch trains on ``train_images`` and evaluates ``val_images``."""
    return epochs * (train_images / speed.train_images_per_s + val_images / speed.eval_images_per_s)
