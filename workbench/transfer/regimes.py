"""The four regimes: what is trainable, how the optimizer sees it, and the two training paths.

- linear: only the head; trained on cached pooled features (``fit_cached``).
- partial: the last k blocks, the final norm (``norm`` or ``fc_norm``) and the head; trained
  on cached tokens entering block ``depth - k`` (``fit_cached``).
- full: everything, optionally with layer-wise lr decay; trained on images by the
  workbench's resumable ``Trainer`` (``QWKTrainer``), which selects epochs by validation QWK.
- scratch: everything, of the source's architecture from a seeded random init
  (``source_model.scratch_model``), no layer decay; the same ``QWKTrainer`` path as full.

Both paths draw the epoch order from (seed, epoch) exactly as ``TensorLoader`` does, so every
regime of a seed sees the same data order, and both select the first epoch with the highest
validation QWK.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from workbench.data import derive_seed
from workbench.models.vit import VisionTransformer
from workbench.train.loop import Trainer, TrainingObserver, cosine_with_warmup
from workbench.transfer.evaluate import val_metrics
from workbench.transfer.features import CachedSplit
from workbench.protocol.transfer import Regime

# Not decayed: biases, norm gains, position embeddings and prefix tokens (the usual ViT recipe).
NO_DECAY_NAMES = ("pos_embed", "cls_token", "register_tokens")


def trainable_prefixes(model: VisionTransformer, regime: Regime) -> tuple[str, ...]:
    """State-dict key prefixes the regime trains ("" = everything)."""
    if regime.kind in ("full", "scratch"):
        return ("",)
    if regime.kind == "linear":
        return ("head.",)
    depth = model.cfg.depth
    if regime.blocks > depth:
        raise ValueError(
            f"regime {regime.name}: blocks={regime.blocks} but the source has {depth} blocks"
        )
    return tuple(f"blocks.{i}." for i in range(depth - regime.blocks, depth)) + (
        "norm.",
        "fc_norm.",
        "head.",
    )


def freeze(model: VisionTransformer, regime: Regime) -> list[str]:
    """Set ``requires_grad`` for the regime; returns the trainable parameter names."""
    prefixes = trainable_prefixes(model, regime)
    names = []
    for name, p in model.named_parameters():
        p.requires_grad_(any(name.startswith(pre) for pre in prefixes))
        if p.requires_grad:
            names.append(name)
    return names


def layer_id(name: str, depth: int) -> int:
    """0 for the embedding (patches, positions, prefix tokens), i + 1 for block i, depth + 1 after."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    if name.startswith(("patch_proj.", "pos_embed", "cls_token", "register_tokens")):
        return 0
    return depth + 1


def param_groups(
    model: VisionTransformer, lr: float, weight_decay: float, layer_decay: float | None
) -> list[dict]:
    """Trainable parameters grouped by (layer, decayed or not); deepest layer first.

    With ``layer_decay`` d, layer l gets ``lr * d ** (depth + 1 - l)``: the head keeps the
    base lr and the patch embedding gets the smallest. The head's group comes first so the
    logged ``lr`` (group 0) is the base lr.
    """
    depth = model.cfg.depth
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        layer = layer_id(name, depth)
        scale = 1.0 if layer_decay is None else layer_decay ** (depth + 1 - layer)
        no_decay = p.ndim <= 1 or name in NO_DECAY_NAMES
        group = groups.setdefault(
            (layer, no_decay),
            {
                "params": [],
                "lr": lr * scale,
                "weight_decay": 0.0 if no_decay else weight_decay,
                "layer": layer,
                "lr_scale": scale,
            },
        )
        group["params"].append(p)
    return [groups[k] for k in sorted(groups, key=lambda k: (-k[0], k[1]))]


def epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The epoch's permutation of n positions: ``TensorLoader(seed=seed).order(epoch)``."""
    generator = torch.Generator(device="cpu").manual_seed(derive_seed(seed, epoch, "order"))
    return torch.randperm(n, generator=generator)


def predictions_table(
    logits: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor
) -> pd.DataFrame:
    """The predictions table of ``workbench.train.evaluate.predict`` from logits."""
    logits = logits.float()
    probs = logits.softmax(-1)
    losses = F.cross_entropy(logits, labels, reduction="none")
    table = pd.DataFrame(
        {
            "index": indices.cpu().numpy(),
            "label": labels.cpu().numpy(),
            "predicted": probs.argmax(-1).cpu().numpy(),
            "loss": losses.cpu().numpy(),
        }
    )
    cols = pd.DataFrame(probs.cpu().numpy(), columns=[f"prob_{k}" for k in range(probs.shape[1])])
    return pd.concat([table, cols], axis=1)


@dataclass
class CachedFit:
    """Outcome of ``fit_cached``: the best epoch's trainable tensors and validation predictions."""

    history: list[dict]
    best_epoch: int
    best_state: dict[str, torch.Tensor]
    val_table: pd.DataFrame
    stopped_early: bool


@torch.no_grad()
def _predict_cached(
    forward, split: CachedSplit, batch_size: int, device, amp_dtype
) -> pd.DataFrame:
    logits = []
    for start in range(0, len(split), batch_size):
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits.append(forward(split.inputs[start : start + batch_size]).float())
    return predictions_table(torch.cat(logits), split.labels, split.indices)


def fit_cached(
    model: VisionTransformer,
    regime: Regime,
    forward: Callable[[torch.Tensor], torch.Tensor],
    train: CachedSplit,
    val: CachedSplit,
    seed: int,
    batch_size: int,
    eval_batch_size: int,
    num_classes: int,
    device: torch.device,
    amp_dtype: torch.dtype | None = None,
    observer: TrainingObserver | None = None,
    groups: list[dict] | None = None,
) -> CachedFit:
    """Train the regime's trainable parameters on cached inputs; keep the best epoch by val QWK.

    Not resumable: a linear probe or a tail of a few blocks retrains in less time than a
    checkpoint round trip would save; the caller reruns an interrupted cell from scratch.
    ``groups``: the optimizer's parameter groups when the model is not the glass-box ViT
    (``workbench.transfer.any_model.param_groups_any``); None: ``param_groups``.
    """
    observer = observer or TrainingObserver()
    opt = regime.optim
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if groups is None:
        groups = param_groups(model, opt.lr, opt.weight_decay, regime.layer_decay)
    optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
    n_batches = math.ceil(len(train) / batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        cosine_with_warmup(
            regime.epochs * n_batches, round(opt.warmup_epochs * n_batches), opt.min_lr_ratio
        ),
    )
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    history, best, best_epoch, best_state, best_table, bad, stopped = (
        [],
        -math.inf,
        0,
        {},
        None,
        0,
        False,
    )
    for epoch in range(regime.epochs):
        model.train()
        started, loss_sum, correct = time.perf_counter(), 0.0, 0
        order = epoch_order(seed, epoch, len(train)).to(train.inputs.device)
        for k in range(n_batches):
            pos = order[k * batch_size : (k + 1) * batch_size]
            x, y = train.inputs.index_select(0, pos), train.labels.index_select(0, pos)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = forward(x)
                loss = F.cross_entropy(logits.float(), y, label_smoothing=opt.label_smoothing)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(
                    f"{regime.name}: loss became {loss.item()} at epoch {epoch + 1}, batch {k}"
                )
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if opt.grad_clip is not None:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(trainable.values(), opt.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_sum += loss.item() * len(y)
            correct += int((logits.argmax(-1) == y).sum())
        seconds = time.perf_counter() - started
        model.eval()
        table = _predict_cached(forward, val, eval_batch_size, device, amp_dtype)
        metrics = {
            "epoch": epoch + 1,
            "train_loss": loss_sum / len(train),
            "train_accuracy": correct / len(train),
            **val_metrics(table, num_classes),
            "lr": optimizer.param_groups[0]["lr"],
            "epoch_seconds": seconds,
            "images_per_second": len(train) / max(seconds, 1e-9),
        }
        score = metrics["val_qwk"] if math.isfinite(metrics["val_qwk"]) else -math.inf
        if best_table is None or score > best:  # strict: the first epoch reaching the maximum wins
            best, best_epoch, bad, best_table = score, epoch + 1, 0, table
            best_state = {n: p.detach().clone() for n, p in trainable.items()}
        else:
            bad += 1
            stopped = regime.patience is not None and bad >= regime.patience
        metrics["best_epoch"] = best_epoch
        history.append(metrics)
        observer.on_epoch(metrics)
        if stopped:
            break
    return CachedFit(history, best_epoch, best_state, best_table, stopped)


class QWKTrainer(Trainer):
    """The workbench Trainer, selecting epochs by validation QWK, with layer-wise lr decay.

    Everything else (resumable full-state checkpoints, AMP, the reload proof) is the
    Trainer's. Give it data without a test split: selection must not be able to see it.
    """

    def __init__(
        self,
        cfg,
        data,
        run_dir,
        observer=None,
        model=None,
        *,
        num_classes: int,
        layer_decay: float | None = None,
    ) -> None:
        if data.test is not None:
            raise ValueError(
                "QWKTrainer selects on validation only: pass the data without its test split"
            )
        # read by the hooks during __init__
        self.num_classes, self.layer_decay = (
            num_classes,
            layer_decay,
        )
        super().__init__(cfg, data, run_dir, observer, model=model)

    def _param_groups(self) -> list:
        return param_groups(
            self.model, self.cfg.optim.lr, self.cfg.optim.weight_decay, self.layer_decay
        )

    def _validation_metrics(self, val: pd.DataFrame) -> dict[str, float]:
        return val_metrics(val, self.num_classes)

    def _monitored(self) -> tuple[str, bool]:
        return "val_qwk", True
