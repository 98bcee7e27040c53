"""The training recipe as a plain PyTorch loop: the yardstick for the workbench's overhead.

``plain_fit`` trains a ``TrainConfig`` the way a short hand-written script would: same
model and initialisation seed, same data order and augmentation (the same ``TensorLoader``),
same AdamW, warmup-cosine schedule, label smoothing, clipping, autocast, deterministic
kernels on CPU, early stopping and best-epoch test evaluation, but no checkpoints, no
predictions files, no reload proof, no progress bar and no logging. The best weights are
kept in memory.

Because every source of randomness is seeded as ``workbench.train.loop.Trainer`` seeds it,
the plain loop reaches the same validation accuracies as the workbench on the same cell:
the timing comparison compares the same work.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workbench.data import AugmentConfig, PreparedData, TensorLoader, derive_seed
from workbench.models.registry import build_model, model_config
from workbench.precision import resolve_amp
from workbench.train.config import TrainConfig
from workbench.train.loop import cosine_with_warmup, resolve_device


@dataclass(frozen=True)
class PlainResult:
    """What the plain loop measured."""

    best_val_accuracy: float
    best_epoch: int
    epochs_run: int
    test_accuracy: float | None
    seconds: float


@torch.no_grad()
def _accuracy(
    model: nn.Module, loader: TensorLoader, device_type: str, amp: torch.dtype | None
) -> float:
    model.eval()
    correct = seen = 0
    for images, labels, _ in loader:
        with torch.autocast(device_type, dtype=amp, enabled=amp is not None):
            logits = model(images)
        correct += int((logits.float().argmax(-1) == labels).sum())
        seen += len(labels)
    model.train()
    return correct / max(1, seen)


def plain_fit(cfg: TrainConfig, data: PreparedData) -> PlainResult:
    """Train ``cfg`` on ``data`` with a plain loop; returns accuracies and wall seconds."""
    if cfg.run.monitor != "val_accuracy":
        raise ValueError(
            f"run.monitor={cfg.run.monitor!r}: the plain loop selects on val_accuracy only"
        )
    started = time.perf_counter()
    device = resolve_device(cfg.run.device)
    amp = resolve_amp(cfg.run.amp, device)
    run, d, o = cfg.run, cfg.data, cfg.optim
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms((run.deterministic and device.type == "cpu") or previous)
    try:
        torch.manual_seed(derive_seed(run.seed, "init"))
        model = build_model(model_config(cfg.model.name, **cfg.model.overrides)).to(device)
        augment = AugmentConfig(
            crop_padding=d.crop_padding,
            hflip=d.hflip,
            rotate_degrees=d.rotate_degrees,
            translate_fraction=d.translate_fraction,
        )
        common = dict(norm=data.norm, device=device, resize_to=d.resize_to)
        train = TensorLoader.from_split(
            data.train,
            batch_size=run.batch_size,
            seed=run.seed,
            augment=augment,
            shuffle=True,
            **common,
        )
        val = TensorLoader.from_split(
            data.val, batch_size=run.eval_batch_size, shuffle=False, **common
        )
        opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=o.lr,
            betas=o.betas,
            weight_decay=o.weight_decay,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            cosine_with_warmup(
                run.epochs * len(train), round(o.warmup_epochs * len(train)), o.min_lr_ratio
            ),
        )
        best, best_epoch, bad, best_state, epoch = -1.0, 0, 0, None, 0
        for epoch in range(1, run.epochs + 1):
            model.train()
            for images, labels, _ in train.iter_epoch(epoch - 1):
                with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                    loss = F.cross_entropy(
                        model(images).float(), labels, label_smoothing=o.label_smoothing
                    )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if o.grad_clip is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
                opt.step()
                sched.step()
            acc = _accuracy(model, val, device.type, amp)
            if acc > best:
                best, best_epoch, bad, best_state = acc, epoch, 0, copy.deepcopy(model.state_dict())
            else:
                bad += 1
                if run.patience is not None and bad >= run.patience:
                    break
        test_acc = None
        if run.evaluate_test and data.test is not None:
            model.load_state_dict(best_state)
            test = TensorLoader.from_split(
                data.test, batch_size=run.eval_batch_size, shuffle=False, **common
            )
            test_acc = _accuracy(model, test, device.type, amp)
    finally:
        torch.use_deterministic_algorithms(previous)
    return PlainResult(best, best_epoch, epoch, test_acc, time.perf_counter() - started)
