"""One transfer cell in two phases: selection on validation, then a single test evaluation.

``split_off_test`` puts the test split behind a ``TestSplitGuard`` before anything trains;
``select_cell`` gets data without a test split; the guard hands the split out only after
``release()``, which the caller invokes once every cell's selection is finished.
``evaluate_on_test`` then evaluates the selected checkpoint once, saves the predictions, reads the
file back and recomputes every metric from it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from workbench.convert.checkpoints import atomic_write_bytes
from workbench.data import NormStats, PreparedData, PreparedSplit, TensorLoader
from workbench.train.checkpoint import load_checkpoint
from workbench.train.config import DataSpec, ModelSpec, RunConfig, TrainConfig
from workbench.train.evaluate import (
    ReloadProof,
    compare_predictions,
    predict,
    read_predictions,
    save_predictions,
)
from workbench.train.loop import TrainingObserver
from workbench.transfer.evaluate import metric_cis, metrics_agree, table_metrics
from workbench.transfer.features import CachedSplit, FeatureCache, head_forward, tail_forward
from workbench.protocol.transfer import Evaluation, Regime, TransferCell
from workbench.transfer.any_model import (
    AnyQWKTrainer,
    classifier,
    freeze_for,
    scratch_copy,
    transfer_copy,
)
from workbench.transfer.cached_training import (
    AnyCachedQWKTrainer,
    CachedQWKTrainer,
    ForwardFactory,
)
from workbench.transfer.regimes import QWKTrainer, freeze
from workbench.transfer.source_model import SourceModel, adapt_split, scratch_model, transfer_model

# Cached path vs a forward pass of the assembled model on the same images: the same
# operations on different batch compositions, so equal up to float rounding.
ASSEMBLY_TOLERANCE = {None: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


class TestSplitLocked(RuntimeError):
    """The test split was asked for before model selection finished."""

    __test__ = False  # not a pytest class


class TestSplitGuard:
    """Holds the test split; hands it out only after ``release()`` (selection finished)."""

    __test__ = False  # not a pytest class

    def __init__(self, split: PreparedSplit | None) -> None:
        self._split, self._released = split, False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        self._released = True

    def split(self) -> PreparedSplit:
        if not self._released:
            raise TestSplitLocked(
                "the test split is locked until model selection on validation has finished"
            )
        if self._split is None:
            raise TestSplitLocked("this dataset has no test split")
        return self._split


def split_off_test(data: PreparedData, in_channels: int) -> tuple[PreparedData, TestSplitGuard]:
    """Data for selection (train and val, channels matched to the source) and the guarded test split."""
    guard = TestSplitGuard(data.test)
    selection_data = replace(
        data,
        train=adapt_split(data.train, in_channels),
        val=adapt_split(data.val, in_channels),
        test=None,
    )
    return selection_data, guard


@dataclass(frozen=True)
class TransferContext:
    """What every cell of an execution shares: device, numerics, batching and inputs."""

    device: torch.device
    amp_dtype: torch.dtype | None
    batch_size: int
    eval_batch_size: int
    norm: NormStats
    resize_to: int | None
    num_classes: int
    deterministic: bool = True

    def eval_loader(self, split: PreparedSplit) -> TensorLoader:
        return TensorLoader.from_split(
            split,
            batch_size=self.eval_batch_size,
            norm=self.norm,
            shuffle=False,
            device=self.device,
            resize_to=self.resize_to,
        )


@dataclass
class Selection:
    """What selection on validation produced for one cell (saved as ``selection.json``)."""

    regime: str
    kind: str
    seed: int
    best_epoch: int
    best_val: dict[str, float]
    history: list[dict]
    checkpoint: str
    val_predictions: str
    proof: dict  # passed, max_abs_prob_diff, tolerance, what
    stopped_early: bool
    seconds: float
    trainable_parameters: int

    def save(self, run_dir: Path) -> Path:
        path = Path(run_dir) / "selection.json"
        atomic_write_bytes(path, json.dumps(asdict(self), indent=1).encode())
        return path

    @classmethod
    def load(cls, run_dir: Path) -> "Selection | None":
        path = Path(run_dir) / "selection.json"
        if not path.is_file():
            return None
        selection = cls(**json.loads(path.read_text()))
        return selection if Path(selection.checkpoint).is_file() else None


@dataclass
class TestResult:
    """The single test evaluation of a selected cell."""

    __test__ = False

    metrics: dict[str, float]  # computed from the predictions in memory
    metrics_from_file: dict[str, float]  # recomputed from the saved predictions file
    agree: bool
    max_abs_diff: float
    cis: dict[str, object] = field(default_factory=dict)  # metric -> workbench.stats.CI
    predictions: str = ""
    seconds: float = 0.0


def _model_from_checkpoint(source: SourceModel, path: Path, num_classes: int, device) -> nn.Module:
    # structure only: the checkpoint replaces every tensor
    model = (
        transfer_model(source, num_classes, seed=0)
        if source.is_vit
        else transfer_copy(source.model, num_classes, 0)
    )
    model.load_state_dict(load_checkpoint(path, map_location="cpu")["model"], strict=True)
    return model.to(device).eval()


def _cell_model(cell: TransferCell, source: SourceModel, ctx: TransferContext):
    """The cell's model (the source's weights, or its architecture from a seeded init for
    scratch) with a new head, and the names of the parameters its regime trains."""
    regime, scratch = cell.regime, cell.regime.kind == "scratch"
    if source.is_vit:
        model = (scratch_model if scratch else transfer_model)(source, ctx.num_classes, cell.seed)
        return model, freeze(model, regime)
    # any other model: timm's generic interfaces (workbench.transfer.any_model)
    model = (scratch_copy if scratch else transfer_copy)(source.model, ctx.num_classes, cell.seed)
    return model, freeze_for(model, regime, f"regime {regime.name}")


@dataclass(frozen=True)
class CachedInputs:
    """What a cached regime trains on, how its model reads it, and its name in the config."""

    splits: dict[str, CachedSplit]
    forward_of: ForwardFactory
    what: str


def _cached_inputs(
    regime: Regime, source: SourceModel, model: nn.Module, cache: FeatureCache | None
) -> CachedInputs | None:
    """None for a regime that trains on images (full, scratch, and partial of a non-ViT source)."""
    if regime.kind in ("full", "scratch") or (regime.kind == "partial" and not source.is_vit):
        return None
    if cache is None:
        raise ValueError(
            f"regime {regime.name} ({regime.kind}) trains on cached features: pass them"
        )
    if not source.is_vit:  # the linear probe of any model: its classifier on pre-logit features
        return CachedInputs(cache.pooled, classifier, "pre-logit features")
    if regime.kind == "linear":
        return CachedInputs(cache.pooled, head_forward, "pooled features")
    start = model.cfg.depth - regime.blocks
    return CachedInputs(
        cache.tokens[start], lambda m: tail_forward(m, start), f"tokens entering block {start}"
    )


def _cell_config(
    cell: TransferCell,
    source: SourceModel,
    data: PreparedData,
    ctx: TransferContext,
    trainable: list[str],
    cached: CachedInputs | None,
) -> TrainConfig:
    """The cell's training configuration; its hash names what is trained (a resume checks it)."""
    regime = cell.regime
    spec = {
        "source": source.info.sha256 or source.info.uri,
        "regime": regime.name,
        "num_classes": ctx.num_classes,
        "layer_decay": regime.layer_decay,
    }
    # an image regime's spec is as it was, so its cells keep their config hash (and resume)
    spec |= {"init": f"scratch, seed {cell.seed}"} if regime.kind == "scratch" else {}
    spec |= {} if source.is_vit else {"blocks": regime.blocks, "trainable": len(trainable)}
    spec |= {} if cached is None else {"inputs": f"cached {cached.what}"}
    return TrainConfig(
        model=ModelSpec("transfer", spec),
        data=DataSpec(data.name, split_seed=data.split_seed, resize_to=ctx.resize_to),
        optim=regime.optim,
        run=RunConfig(
            epochs=regime.epochs,
            batch_size=ctx.batch_size,
            eval_batch_size=ctx.eval_batch_size,
            seed=cell.seed,
            patience=regime.patience,
            device=str(ctx.device),
            amp={None: "off", torch.bfloat16: "bf16", torch.float16: "fp16"}[ctx.amp_dtype],
            deterministic=ctx.deterministic,
        ),
    )


def _trainer_class(source: SourceModel, cached: CachedInputs | None) -> type:
    if cached is None:
        return QWKTrainer if source.is_vit else AnyQWKTrainer
    return CachedQWKTrainer if source.is_vit else AnyCachedQWKTrainer


RELOAD_PROOF = "reload proof: best checkpoint reloaded into a fresh model reproduces its saved validation predictions"
ASSEMBLY_PROOF = "assembly proof: the checkpoint, run end to end on the validation images, reproduces the cached-feature predictions"


def _assembly_proof(
    source: SourceModel, checkpoint: Path, val_path: Path, val: PreparedSplit, ctx: TransferContext
) -> ReloadProof:
    """A cached regime's checkpoint must be the deployed model: reloaded into a fresh model and
    run end to end on the validation images, it reproduces the cached path's predictions."""
    fresh = _model_from_checkpoint(source, checkpoint, ctx.num_classes, ctx.device)
    now = predict(fresh, ctx.eval_loader(val), ctx.device, ctx.amp_dtype)
    return compare_predictions(read_predictions(val_path), now, ASSEMBLY_TOLERANCE[ctx.amp_dtype])


def select_cell(
    cell: TransferCell,
    source: SourceModel,
    data: PreparedData,
    cache: FeatureCache | None,
    ctx: TransferContext,
    run_dir: Path,
    observer: TrainingObserver | None = None,
) -> Selection:
    """Train one regime at one seed in the workbench's ``Trainer`` and select its epoch by
    validation QWK; an interrupted cell resumes from its last checkpoint.

    Args:
        cell: The regime and seed.
        source: The source model (not modified).
        data: Train and val only (``split_off_test``); a test split here is refused.
        cache: Features of the frozen backbone (linear and partial regimes).
        ctx: Shared settings.
        run_dir: Checkpoints, predictions and ``selection.json`` go here.
        observer: Receives each epoch's metrics.
    """
    if data.test is not None:
        raise ValueError("select_cell must not receive a test split; use split_off_test")
    regime, run_dir, started = cell.regime, Path(run_dir), time.perf_counter()
    model, trainable = _cell_model(cell, source, ctx)
    cached = _cached_inputs(regime, source, model, cache)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    on_cache = {} if cached is None else {"cached": cached.splits, "forward_of": cached.forward_of}
    trainer = _trainer_class(source, cached)(
        _cell_config(cell, source, data, ctx, trainable, cached),
        replace(data, norm=ctx.norm),
        run_dir,
        observer,
        model=model,
        num_classes=ctx.num_classes,
        layer_decay=regime.layer_decay,
        **on_cache,
    )
    result = trainer.fit()
    checkpoint, val_path = trainer.best_path, run_dir / "predictions" / "val.csv"
    proof, what = result.reload_proof, RELOAD_PROOF
    if cached is not None and proof.passed:
        proof, what = _assembly_proof(source, checkpoint, val_path, data.val, ctx), ASSEMBLY_PROOF
    best = result.history[result.best_epoch - 1]
    selection = Selection(
        regime=regime.name,
        kind=regime.kind,
        seed=cell.seed,
        best_epoch=result.best_epoch,
        best_val={
            k: float(best[k]) for k in ("val_qwk", "val_accuracy", "val_macro_f1", "val_loss")
        },
        history=result.history,
        checkpoint=str(checkpoint),
        val_predictions=str(val_path),
        proof={
            "passed": proof.passed,
            "max_abs_prob_diff": proof.max_abs_prob_diff,
            "tolerance": proof.tolerance,
            "predictions_equal": proof.predictions_equal,
            "what": what,
            "summary": proof.summary(),
        },
        stopped_early=result.stopped_early,
        seconds=time.perf_counter() - started,
        trainable_parameters=n_trainable,
    )
    selection.save(run_dir)
    return selection


def evaluate_on_test(
    selection: Selection,
    source: SourceModel,
    guard: TestSplitGuard,
    ctx: TransferContext,
    run_dir: Path,
    evaluation: Evaluation,
) -> TestResult:
    """Evaluate the selected checkpoint on the test split once; recompute the metrics from the saved file."""
    started = time.perf_counter()
    # raises TestSplitLocked before release()
    test = adapt_split(guard.split(), source.cfg.in_channels)
    model = _model_from_checkpoint(source, Path(selection.checkpoint), ctx.num_classes, ctx.device)
    table = predict(model, ctx.eval_loader(test), ctx.device, ctx.amp_dtype)
    path = save_predictions(table, Path(run_dir) / "predictions" / "test.csv")
    in_memory = table_metrics(table, ctx.num_classes)
    from_file = table_metrics(read_predictions(path), ctx.num_classes)
    agree, diff = metrics_agree(in_memory, from_file)
    cis = metric_cis(
        table["label"].to_numpy(),
        table["predicted"].to_numpy(),
        ctx.num_classes,
        evaluation.n_resamples,
        evaluation.confidence,
        evaluation.seed,
    )
    return TestResult(
        in_memory, from_file, agree, diff, cis, str(path), time.perf_counter() - started
    )
