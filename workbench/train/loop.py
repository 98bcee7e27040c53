"""A plain, resumable PyTorch training loop.

Nothing here logs: progress and results go to a ``TrainingObserver`` (the tracking layer
implements one for MLflow). The loop writes full-state checkpoints atomically every
epoch and every N steps; ``fit`` always starts from the latest one when it exists, so an
interrupted run (even SIGKILL) continues exactly where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from workbench.data import AugmentConfig, PreparedData, TensorLoader, derive_seed
from workbench.convert.arm_check import glassbox_check
from workbench.models.registry import build_model, model_config
from workbench.models.timm_arm import TimmModelConfig
from workbench.precision import resolve_amp
from workbench.train.checkpoint import (
    FORMAT,
    atomic_torch_save,
    capture_rng,
    load_checkpoint,
    restore_rng,
)
from workbench.train.config import TrainConfig
from workbench.train.fast_path import TrainingForward, adamw, attention_is_fused, set_attention
from workbench.train.fits import DataShape, misfits
from workbench.atomic import atomic_write
from workbench.train.evaluate import (
    ReloadProof,
    compare_predictions,
    metrics_from_predictions,
    predict,
    read_predictions,
    save_predictions,
)


class NonFiniteLoss(FloatingPointError):
    def __init__(self, step: int, epoch: int, batch: int, value: float):
        super().__init__(
            f"loss became {value} at step {step} (epoch {epoch}, batch {batch}); last good checkpoint kept"
        )
        self.step, self.epoch, self.batch, self.value = step, epoch, batch, value


class StopTraining(Exception):
    """Raised by an observer to end a run early on purpose (for example a pruned sweep trial)."""


class TrainingObserver:
    """Receives what a run produces. Override what you need; every method is optional."""

    def on_start(self, info: dict) -> None: ...
    def on_resume(self, history: list[dict]) -> None: ...
    def on_epoch(self, metrics: dict) -> None: ...
    def on_checkpoint(self, path: Path, kind: str) -> None: ...

    def check(self, sync: bool = False) -> None:
        """Called at every step (``sync=False``: cheap) and before every write (``sync=True``).

        Raise to stop the run there, before anything more is written; the tracking layer
        uses this to fence a run that another execution took over.
        """


class Observers(TrainingObserver):
    """Several observers, called in order."""

    def __init__(self, *observers: TrainingObserver) -> None:
        self.observers = [o for o in observers if o is not None]

    def on_start(self, info: dict) -> None:
        for o in self.observers:
            o.on_start(info)

    def on_resume(self, history: list[dict]) -> None:
        for o in self.observers:
            o.on_resume(history)

    def on_epoch(self, metrics: dict) -> None:
        for o in self.observers:
            o.on_epoch(metrics)

    def on_checkpoint(self, path: Path, kind: str) -> None:
        for o in self.observers:
            o.on_checkpoint(path, kind)

    def check(self, sync: bool = False) -> None:
        for o in self.observers:
            o.check(sync)


@dataclass
class TrainResult:
    history: list[dict]
    best_epoch: int
    best_metric: float
    stopped_early: bool
    reload_proof: ReloadProof
    predictions: dict[str, Path] = field(default_factory=dict)
    final_metrics: dict[str, float] = field(default_factory=dict)
    checkpoints: dict[str, Path] = field(default_factory=dict)
    # Which path trained the cell (``fast_path.*`` tags), empty when every fast-path part is off.
    fast_path: dict[str, str] = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def config_hash(cfg: TrainConfig) -> str:
    """sha256 of what is trained; where (data path, device) is left out so any machine can resume."""
    content = cfg.to_dict()
    content["data"].pop("path")
    content["run"].pop("device")
    text = json.dumps(content, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def cosine_with_warmup(total_steps: int, warmup_steps: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


class Trainer:
    """Train one configuration on prepared data, checkpointing into ``run_dir``."""

    def __init__(
        self,
        cfg: TrainConfig,
        data: PreparedData,
        run_dir: Path,
        observer: TrainingObserver | None = None,
        model: nn.Module | None = None,
    ) -> None:
        self.cfg, self.data, self.run_dir = cfg, data, Path(run_dir)
        self.observer = observer or TrainingObserver()
        self.device = resolve_device(cfg.run.device)
        self.hash = config_hash(cfg)
        run = cfg.run
        # bf16 autocast on CPU too; refused where not native
        amp = resolve_amp(run.amp, self.device)
        self.amp_dtype = amp
        torch.manual_seed(derive_seed(run.seed, "init"))  # model init depends on the run seed only
        self.model = (model if model is not None else self._build_model()).to(self.device)
        fast = cfg.fast_path
        # A model without the switch (CNN, timm arm) keeps its own attention: nothing to record.
        self.fused_attention = attention_is_fused(
            fast.fused_attention, self.device.type
        ) and set_attention(self.model, True)
        self.forward = TrainingForward(self.model, fast)
        d = cfg.data
        recipe = cfg.recipe
        augment = AugmentConfig(
            crop_padding=d.crop_padding,
            hflip=d.hflip,
            rotate_degrees=d.rotate_degrees,
            translate_fraction=d.translate_fraction,
            randaugment_ops=recipe.randaugment_ops,
            randaugment_magnitude=recipe.randaugment_magnitude,
        )
        common = dict(norm=data.norm, device=self.device, resize_to=d.resize_to)
        # Mixup pairs image i with image B-1-i, so every batch must be even: as timm's training
        # loader, drop the last incomplete batch when mixing (off: every image, as before).
        # A data-size arm trains on a nested subset, with epochs as long as the full split's
        # (so the images seen, the schedule and the evaluations do not depend on the size).
        train, epoch_size = data.train, None
        if d.train_subset is not None:
            train, epoch_size = (
                data.train.nested_subset(d.train_subset, d.split_seed),
                len(data.train),
            )
        self.train_loader = TensorLoader.from_split(
            train,
            batch_size=run.batch_size,
            seed=run.seed,
            augment=augment,
            shuffle=True,
            drop_last=recipe.mixes,
            epoch_size=epoch_size,
            **common,
        )
        self.eval_loaders = {
            name: TensorLoader.from_split(
                split, batch_size=run.eval_batch_size, shuffle=False, **common
            )
            for name, split in (("val", data.val), ("test", data.test))
            if split is not None
        }
        self.optimizer = adamw(
            self._param_groups(),
            fast,
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            weight_decay=cfg.optim.weight_decay,
        )
        steps = run.epochs * len(self.train_loader)
        warmup = round(cfg.optim.warmup_epochs * len(self.train_loader))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(steps, warmup, cfg.optim.min_lr_ratio)
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=amp == torch.float16)
        self.mixup = self._build_mixup() if recipe.mixes else None
        self.ema = self._build_ema() if recipe.ema_decay is not None else None

    def _build_mixup(self):
        """timm's ``Mixup`` (mixup and/or CutMix); it smooths the mixed targets with ``optim.label_smoothing``."""
        from timm.data import Mixup

        r = self.cfg.recipe
        return Mixup(
            mixup_alpha=r.mixup_alpha,
            cutmix_alpha=r.cutmix_alpha,
            prob=r.mixup_prob,
            switch_prob=r.mixup_switch_prob,
            mode=r.mixup_mode,
            label_smoothing=self.cfg.optim.label_smoothing,
            num_classes=len(self.data.class_names),
        )

    def _build_ema(self):
        """timm's ``ModelEmaV3`` of the model as initialised (a copy on the same device, in eval mode)."""
        from timm.utils import ModelEmaV3

        r = self.cfg.recipe
        return ModelEmaV3(self.model, decay=r.ema_decay, use_warmup=r.ema_warmup)

    @property
    def evaluated_model(self) -> nn.Module:
        """The model that is evaluated, selected and saved as best: the EMA's when EMA is on (as timm's train.py)."""
        return self.model if self.ema is None else self.ema.module

    def _build_model(self) -> nn.Module:
        spec = self.cfg.model
        shape = DataShape.of(self.data)
        wrong = misfits(spec.name, spec.overrides, shape, self.cfg.data.resize_to)
        if wrong:  # entry points check this before a run opens (workbench.train.fits); this is the backstop
            raise ValueError(
                f"model {spec.name!r} does not fit {shape.describe()}: "
                + "; ".join(m.line(f"model.{m.field}") for m in wrong)
            )
        return build_model(model_config(spec.name, **spec.overrides))

    # ---- hooks for subclasses (e.g. workbench.transfer: QWK selection, layer-wise lr decay) ----
    def _param_groups(self) -> list:
        """What the optimizer updates: trainable parameters, or param groups with their own lr."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _validation_metrics(self, val: pd.DataFrame) -> dict[str, float]:
        """An epoch's validation metrics from its predictions table; must hold val_loss and val_accuracy."""
        m = metrics_from_predictions(val)
        return {"val_loss": m["loss"], "val_accuracy": m["accuracy"]}

    def _monitored(self) -> tuple[str, bool]:
        """(metric that selects the best epoch and drives early stopping, whether higher is better)."""
        return self.cfg.run.monitor, self.cfg.run.monitor == "val_accuracy"

    # ---- checkpoints ----------------------------------------------------------------
    @property
    def last_path(self) -> Path:
        return self.run_dir / "checkpoints" / "last.pt"

    @property
    def best_path(self) -> Path:
        return self.run_dir / "checkpoints" / "best.pt"

    def _save(self, pos: dict, kind: str = "last") -> None:
        self.observer.check(sync=True)
        state = {
            "format": FORMAT,
            "config_hash": self.hash,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": capture_rng(),
            **({"ema": self.ema.module.state_dict()} if self.ema is not None else {}),
            **pos,
        }
        atomic_torch_save(state, self.last_path)
        self.observer.on_checkpoint(self.last_path, kind)

    def _restore(self) -> dict | None:
        if not self.last_path.exists():
            return None
        state = load_checkpoint(self.last_path, map_location=self.device)
        if state["config_hash"] != self.hash:
            raise ValueError(
                f"{self.last_path} belongs to config {state['config_hash'][:12]}, not {self.hash[:12]}; "
                "use another run directory"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            self.ema.module.load_state_dict(state["ema"])
        restore_rng(state["rng"])
        return state

    # ---- training ----------------------------------------------------------------
    def fit(self) -> TrainResult:
        run = self.cfg.run
        deterministic = run.deterministic and self.device.type == "cpu"
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic or previous)
        # Python's and NumPy's global states are saved in every checkpoint (a library may draw
        # from them): seeded from the run's seed, so what last.pt holds is the same whether the
        # run went straight through or resumed in another process; the caller's states come back.
        outer = random.getstate(), np.random.get_state()
        random.seed(derive_seed(run.seed, "python"))
        np.random.seed(derive_seed(run.seed, "numpy") % (1 << 32))
        try:
            return self._fit(run)
        finally:
            torch.use_deterministic_algorithms(previous)
            random.setstate(outer[0])
            np.random.set_state(outer[1])

    def _fit(self, run) -> TrainResult:
        state = self._restore()
        pos = {
            "epoch": 0,
            "batch": 0,
            "step": 0,
            "history": [],
            "finished": False,
            "accum": {"loss_sum": 0.0, "correct": 0, "seen": 0, "seconds": 0.0},
            "early": {"best": None, "best_epoch": -1, "bad_epochs": 0, "stopped": False},
        }
        if state is not None:
            pos = {k: state[k] for k in pos}
            self.observer.on_resume(pos["history"])
        self.observer.on_start(
            {
                "device": str(self.device),
                "config_hash": self.hash,
                "resumed": state is not None,
                "train_batches": len(self.train_loader),
                "amp": str(self.amp_dtype),
                "epoch": pos["epoch"],
                "step": pos["step"],
                "finished": pos["finished"],
            }
        )
        while not pos["finished"] and pos["epoch"] < run.epochs and not pos["early"]["stopped"]:
            self._train_epoch(pos)
            self._end_epoch(pos)
        if not pos["finished"]:
            pos["finished"] = True
            self._save(pos)
        return self._finish(pos)

    def _train_epoch(self, pos: dict) -> None:
        self.model.train()
        epoch, accum, n_batches = pos["epoch"], pos["accum"], len(self.train_loader)
        bar = tqdm(
            total=n_batches,
            initial=pos["batch"],
            desc=f"epoch {epoch + 1}/{self.cfg.run.epochs}",
            leave=False,
        )
        for images, labels, _ in self.train_loader.iter_epoch(epoch, start_batch=pos["batch"]):
            self.observer.check()
            started = time.perf_counter()
            if self.mixup is not None:
                images, targets = self._mix(images, labels, epoch, pos["batch"])
            with torch.autocast(
                self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None
            ):
                logits = self.forward(images)
                if self.mixup is None:
                    loss = F.cross_entropy(
                        logits.float(), labels, label_smoothing=self.cfg.optim.label_smoothing
                    )
                else:  # timm's SoftTargetCrossEntropy on the mixed, smoothed targets
                    loss = torch.sum(
                        -targets * F.log_softmax(logits.float(), dim=-1), dim=-1
                    ).mean()
            value = loss.item()
            if not math.isfinite(value):
                bar.close()
                raise NonFiniteLoss(pos["step"], epoch, pos["batch"], value)
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            if self.cfg.optim.grad_clip is not None:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            self.forward.timed_first_step(started)
            if self.ema is not None:
                # timm's train.py: after the step, num_updates
                self.ema.update(self.model, step=pos["step"] + 1)
            accum["loss_sum"] += value * len(labels)
            # Under mixup / CutMix: agreement with each mixed image's dominant target (its soft target's argmax).
            hits = labels if self.mixup is None else targets.argmax(-1)
            accum["correct"] += int((logits.argmax(-1) == hits).sum())
            accum["seen"] += len(labels)
            accum["seconds"] += time.perf_counter() - started
            pos["batch"] += 1
            pos["step"] += 1
            bar.update(1)
            bar.set_postfix(loss=f"{value:.4f}")
            every = self.cfg.run.checkpoint_every_steps
            if every and pos["step"] % every == 0 and pos["batch"] < n_batches:
                self._save(pos, kind="step")
        bar.close()

    def _mix(self, images: torch.Tensor, labels: torch.Tensor, epoch: int, batch: int):
        """timm's Mixup on one batch, its NumPy draws seeded from (seed, epoch, batch): the same after a resume."""
        # timm draws from NumPy's global RNG: seed it for this batch only
        outer = np.random.get_state()
        np.random.seed(derive_seed(self.cfg.run.seed, epoch, batch, "mixup") % (1 << 32))
        try:
            return self.mixup(images, labels)
        finally:
            np.random.set_state(outer)

    def _end_epoch(self, pos: dict) -> None:
        accum, early, run = pos["accum"], pos["early"], self.cfg.run
        val = predict(self.evaluated_model, self.eval_loaders["val"], self.device, self.amp_dtype)
        metrics = {
            "epoch": pos["epoch"] + 1,
            "train_loss": accum["loss_sum"] / max(1, accum["seen"]),
            "train_accuracy": accum["correct"] / max(1, accum["seen"]),
            **self._validation_metrics(val),
            "lr": self.optimizer.param_groups[0]["lr"],
            "epoch_seconds": accum["seconds"],
            "images_per_second": accum["seen"] / max(accum["seconds"], 1e-9),
        }
        if (
            self.ema is not None
        ):  # the EMA model is the reported one; the raw model's numbers beside it
            raw = self._validation_metrics(
                predict(self.model, self.eval_loaders["val"], self.device, self.amp_dtype)
            )
            metrics.update(raw_val_loss=raw["val_loss"], raw_val_accuracy=raw["val_accuracy"])
        monitor, higher_is_better = self._monitored()
        score = metrics[monitor] if higher_is_better else -metrics[monitor]
        if early["best"] is None or score > early["best"]:
            self.observer.check(sync=True)
            early.update(best=score, best_epoch=pos["epoch"] + 1, bad_epochs=0)
            # Best weights and the predictions they made: the reload proof compares the two.
            atomic_torch_save(
                {
                    "format": FORMAT,
                    "config_hash": self.hash,
                    "model": self.evaluated_model.state_dict(),
                    "epoch": pos["epoch"] + 1,
                    "metrics": metrics,
                },
                self.best_path,
            )
            save_predictions(val, self.run_dir / "predictions" / "val.csv")
            self.observer.on_checkpoint(self.best_path, "best")
        else:
            early["bad_epochs"] += 1
            early["stopped"] = run.patience is not None and early["bad_epochs"] >= run.patience
        metrics["best_epoch"] = early["best_epoch"]
        pos["history"].append(metrics)
        pos.update(
            epoch=pos["epoch"] + 1,
            batch=0,
            accum={"loss_sum": 0.0, "correct": 0, "seen": 0, "seconds": 0.0},
        )
        self._save(pos, kind="epoch")
        self.observer.check(sync=True)  # a run taken over while this epoch ran must not log it
        self.observer.on_epoch(metrics)
        # Printed once the epoch is recorded: what the console says is done is in the run.
        tqdm.write(
            f"epoch {metrics['epoch']}: train loss {metrics['train_loss']:.4f} acc {metrics['train_accuracy']:.4f} | "
            f"val loss {metrics['val_loss']:.4f} acc {metrics['val_accuracy']:.4f} | {metrics['images_per_second']:.0f} img/s"
        )

    @property
    def summary_path(self) -> Path:
        return self.run_dir / "summary.json"

    def _finish(self, pos: dict) -> TrainResult:
        """The summary, computed once: a resume after it was written reads it back (no second test pass)."""
        if self.summary_path.exists():
            saved = json.loads(self.summary_path.read_text())
            if saved.get("config_hash") == self.hash:
                return self._result(
                    pos,
                    ReloadProof(**saved["reload_proof"]),
                    {k: Path(v) for k, v in saved["predictions"].items()},
                    saved["final_metrics"],
                    saved.get("fast_path", {}),
                )
        result = self._summarize(pos)
        proof = result.reload_proof
        summary = {
            "config_hash": self.hash,
            "final_metrics": result.final_metrics,
            "predictions": {k: str(v) for k, v in result.predictions.items()},
            "reload_proof": {
                "passed": proof.passed,
                "predictions_equal": proof.predictions_equal,
                "max_abs_prob_diff": proof.max_abs_prob_diff,
                "tolerance": proof.tolerance,
                "examples": proof.examples,
            },
            **({"fast_path": result.fast_path} if result.fast_path else {}),
        }
        self.observer.check(sync=True)
        atomic_write(self.summary_path, lambda f: f.write(json.dumps(summary, indent=1).encode()))
        return result

    def _summarize(self, pos: dict) -> TrainResult:
        """Reload the best checkpoint into a fresh model: it must reproduce its saved predictions."""
        best = load_checkpoint(self.best_path, map_location=self.device)
        fresh = self._fresh_model()
        fresh.load_state_dict(best["model"])
        set_attention(fresh, self.fused_attention)  # the path the saved predictions came through
        saved_val = read_predictions(self.run_dir / "predictions" / "val.csv")
        now_val = predict(fresh, self.eval_loaders["val"], self.device, self.amp_dtype)
        # CPU (fp32 or bf16 autocast): same kernels, same inputs, same process -> bitwise equal.
        tolerance = 0.0 if self.device.type == "cpu" else 1e-5
        proof = compare_predictions(saved_val, now_val, tolerance)
        predictions = {"val": self.run_dir / "predictions" / "val.csv"}
        final = {f"best_val_{k}": v for k, v in metrics_from_predictions(saved_val).items()}
        if self.cfg.run.evaluate_test and "test" in self.eval_loaders:
            # The test split is touched once, after selection on validation, with the best weights.
            test = predict(fresh, self.eval_loaders["test"], self.device, self.amp_dtype)
            predictions["test"] = save_predictions(test, self.run_dir / "predictions" / "test.csv")
            final.update({f"test_{k}": v for k, v in metrics_from_predictions(test).items()})
        # A timm ViT arm: its best weights read across to the glass-box model, checked at 0.0.
        final.update(glassbox_check(fresh, next(iter(self.eval_loaders["val"])).images))
        if self.forward.compile_seconds is not None:
            final["compile_seconds"] = self.forward.compile_seconds
        return self._result(pos, proof, predictions, final, self._fast_path_tags())

    def _fast_path_tags(self) -> dict[str, str]:
        """Which path trained the cell, as ``fast_path.*`` tags; none when every part is off."""
        if not self.cfg.fast_path.changed():
            return {}
        attention = "fused" if self.fused_attention else "written_out"
        return {"attention": attention, **self.forward.tags()}

    def _result(
        self,
        pos: dict,
        proof: ReloadProof,
        predictions: dict[str, Path],
        final: dict,
        fast_path: dict[str, str] | None = None,
    ) -> TrainResult:
        early = pos["early"]
        best_metric = early["best"] if self._monitored()[1] else -early["best"]
        return TrainResult(
            history=pos["history"],
            best_epoch=early["best_epoch"],
            best_metric=best_metric,
            stopped_early=early["stopped"],
            reload_proof=proof,
            predictions=predictions,
            final_metrics=final,
            checkpoints={"best": self.best_path, "last": self.last_path},
            fast_path=dict(fast_path or {}),
        )

    def _fresh_model(self) -> nn.Module:
        """A new instance of the same architecture, so nothing is carried over but the checkpoint."""
        cfg = getattr(self.model, "cfg", None)
        if isinstance(
            cfg, TimmModelConfig
        ):  # a timm model's non-persistent buffers need a real build
            with torch.random.fork_rng(devices=[]):
                return build_model(cfg).to(self.device).eval()
        with torch.device("meta"):
            fresh = build_model(cfg) if cfg is not None else None
        if fresh is None:
            raise TypeError("reload proof needs a model with a .cfg (glass-box ViT or CNN)")
        return fresh.to_empty(device=self.device).eval()
