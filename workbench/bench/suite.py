"""The benchmark itself: inference and training-step timing of every variant, with ratios.

For each (model, batch size) the variants of ``workbench.bench.models`` are timed
interleaved (``workbench.bench.timing``), so every ratio to timm fused is measured in the
same rounds, on the same machine state. Results come back as one row per (section, model,
batch, variant) in a DataFrame; nothing here logs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from workbench.bench.machine import matmul_fn
from workbench.bench.models import LABELS, REFERENCE, BenchModel, build_bench_model
from workbench.bench.timing import Samples, Spread, decide, rounds_needed, time_interleaved

PROBE = "matmul_fp32"  # the reference matmul timed in every comparison's rounds
# The paths a user of the workbench chooses between (set_fast_attention); timm's are references.
CHOICES = ("glass_written", "glass_fast")
DEFAULT_MODELS = (
    "vit_tiny_patch16_224",
    "vit_small_patch16_224",
    "vit_base_patch16_224",
    "fmnist_vit",
    "cifar_vit",
    "fmnist_cnn",
)


@dataclass(frozen=True)
class BenchConfig:
    """What to measure and how.

    Attributes:
        models: Models timed for inference (timm ViT names, study model names).
        batch_sizes: Inference batch sizes for 224 px models (1 = latency).
        study_batch_sizes: Inference batch sizes for the small study models, whose
            per-image work is thousands of times smaller.
        train_models: Models whose training step is timed (study ViTs).
        train_batch_sizes: Training batch sizes (128 is the study's).
        precision_models: Models whose training step is timed in fp32 and bf16 autocast
            side by side (``workbench.bench.precision``; skipped without native bf16).
        precision_batch_sizes: Batch sizes of that comparison.
        repeats: Timed rounds per comparison (at most; see ``max_seconds``).
        warmup: Untimed calls per variant before timing.
        min_sample_s: Shortest timed sample; fast calls are repeated to reach it.
        max_seconds: Budget of one comparison's timed rounds (at least 6 rounds run, the
            fewest a verdict needs);
            None: always ``repeats`` rounds. Keeps ViT-B at batch 32 on a small CPU
            from taking most of an hour.
        device: "cpu" or "cuda[:i]".
        seed: Seed of weights and inputs.
    """

    models: tuple[str, ...] = DEFAULT_MODELS
    batch_sizes: tuple[int, ...] = (1, 32)
    study_batch_sizes: tuple[int, ...] = (1, 32, 256)
    train_models: tuple[str, ...] = ("fmnist_vit",)
    train_batch_sizes: tuple[int, ...] = (128,)
    precision_models: tuple[str, ...] = ("cifar_vit",)
    precision_batch_sizes: tuple[int, ...] = (128,)
    repeats: int = 30
    warmup: int = 2
    min_sample_s: float = 0.05
    max_seconds: float | None = 60.0
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        for key in (
            "batch_sizes",
            "study_batch_sizes",
            "train_batch_sizes",
            "precision_batch_sizes",
        ):
            values = tuple(getattr(self, key))
            if any(not isinstance(b, int) or b < 1 for b in values):
                raise ValueError(f"BenchConfig.{key}={values!r}: must be positive integers")
            object.__setattr__(self, key, values)
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "train_models", tuple(self.train_models))
        object.__setattr__(self, "precision_models", tuple(self.precision_models))
        if self.repeats < 1:
            raise ValueError(f"BenchConfig.repeats={self.repeats!r}: must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"BenchConfig.warmup={self.warmup!r}: must be >= 0")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"BenchConfig.max_seconds={self.max_seconds!r}: must be > 0 or None")

    def to_dict(self) -> dict:
        return {
            k: ",".join(map(str, v)) if isinstance(v, tuple) else v for k, v in asdict(self).items()
        }


def _ratio_columns(samples: Samples, name: str, reference: str, prefix: str) -> dict[str, float]:
    """Median and quartiles of the per-round ratios, and the ratio of the best samples.

    On a shared machine the noise only ever adds time, so each side's fastest sample is
    the closest to its undisturbed cost; best / best is reported beside the median as a
    check that a ratio far from 1 is not just load.
    """
    if reference not in samples.seconds:
        return {}
    r = Spread.of(samples.ratios(name, reference))
    best = min(samples.seconds[name]) / min(samples.seconds[reference])
    return {prefix: r.median, f"{prefix}_q1": r.q1, f"{prefix}_q3": r.q3, f"{prefix}_best": best}


def _peak_columns(
    samples: Samples, name: str, flops_per_call: int, probe_n: int | None
) -> dict[str, float]:
    """Median achieved FLOP/s over the best FLOP/s of the matmul probe in the same rounds.

    The probe runs in the same rounds as the models, so it sees the same machine: a peak
    measured once at the start, under other load, can make a later quiet spell look like
    "more than 100%". Its best sample is the limit (noise only ever slows a matmul down).
    """
    if not probe_n or PROBE not in samples.seconds:
        return {"fraction_of_fp32_peak": float("nan"), "probe_gflops": float("nan")}
    limit = 2 * probe_n**3 / min(samples.seconds[PROBE])
    achieved = flops_per_call / samples.spread(name).median
    return {"fraction_of_fp32_peak": achieved / limit, "probe_gflops": limit / 1e9}


def _rows(
    section: str,
    bench: BenchModel,
    batch: int,
    samples: Samples,
    flops_per_image: int,
    probe_n: int | None,
) -> list[dict]:
    rows = []
    timed = {n: v for n, v in samples.seconds.items() if n != PROBE}
    scope = f"{section}/{bench.name}/b{batch}"
    reference = REFERENCE if REFERENCE in timed else next(iter(timed))  # a CNN: one variant
    decision = decide(timed, reference, [n for n in CHOICES if n in timed] or list(timed), scope)
    for name in timed:
        s = samples.spread(name)
        rows.append({
            "section": section, "model": bench.name, "kind": bench.kind, "batch": batch, "variant": name,
            "label": LABELS[name], "repeats": len(samples.seconds[name]), "calls_per_sample": samples.inner[name],
            "median_s": s.median, "q1_s": s.q1, "q3_s": s.q3, "min_s": s.min, "max_s": s.max,
            "images_per_s": batch / s.median, "gflop_per_image": flops_per_image / 1e9,
            "achieved_gflops": flops_per_image * batch / s.median / 1e9,
            **_peak_columns(samples, name, flops_per_image * batch, probe_n),
            **_ratio_columns(samples, name, REFERENCE, "ratio_to_timm_fused"),
            **_ratio_columns(samples, name, "timm_unfused", "ratio_to_timm_unfused"),
            **decision.columns(name),
        })  # fmt: skip
    return rows


def _measure(
    section: str,
    bench: BenchModel,
    batch: int,
    fns: dict,
    flops_per_image: int,
    cfg: BenchConfig,
    probe_n: int | None,
) -> list[dict]:
    """Time ``fns`` interleaved (with the matmul probe, when asked) and build the rows."""
    device = torch.device(cfg.device)
    if probe_n:
        fns = {**fns, PROBE: matmul_fn(device, probe_n, "float32", cfg.seed)}
    samples = time_interleaved(
        fns,
        device,
        cfg.repeats,
        cfg.warmup,
        cfg.min_sample_s,
        max_seconds=cfg.max_seconds,
        min_repeats=rounds_needed(),
        separate=(PROBE,),
    )
    return _rows(section, bench, batch, samples, flops_per_image, probe_n)


def bench_input(bench: BenchModel, batch: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # (B, C, H, W)
    x = torch.randn(batch, bench.in_channels, bench.image_size, bench.image_size, generator=g)
    return x.to(device)


def _inference_fn(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model(x)

    return run


def _train_step_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    # AdamW with the study's defaults (workbench.train.config.OptimConfig): the step's
    # cost depends on the parameter count, not on the values.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _batches_for(bench: BenchModel, cfg: BenchConfig) -> tuple[int, ...]:
    return cfg.batch_sizes if bench.image_size >= 224 else cfg.study_batch_sizes


def run_inference(
    cfg: BenchConfig, probe_n: int | None = None, progress: Callable[[str], None] | None = None
) -> pd.DataFrame:
    """Time every variant of every model at every batch size, in inference mode.

    Args:
        cfg: What to measure.
        probe_n: Side of the fp32 matmul timed in the same rounds as the reference for
            the fraction-of-peak column; None leaves the column NaN.
        progress: Called with a line before each comparison.
    """
    device = torch.device(cfg.device)
    rows: list[dict] = []
    for name in cfg.models:
        bench = build_bench_model(name, device, cfg.seed)
        for batch in _batches_for(bench, cfg):
            if progress:
                progress(f"inference {name} batch {batch}: {', '.join(bench.variants)}")
            x = bench_input(bench, batch, device, cfg.seed)
            fns = {k: _inference_fn(m, x) for k, m in bench.variants.items()}
            rows += _measure("inference", bench, batch, fns, bench.forward_flops, cfg, probe_n)
        del bench
        if device.type == "cuda":
            torch.cuda.empty_cache()  # ViT-B's four copies are not needed for the next model
    return pd.DataFrame(rows)


def run_training(
    cfg: BenchConfig, probe_n: int | None = None, progress: Callable[[str], None] | None = None
) -> pd.DataFrame:
    """Time one training step (forward, cross-entropy, backward, AdamW step) per variant.

    Each variant trains its own copy of the same initial weights with its own optimizer;
    the copies drift apart over the timed steps, which changes values, not work.
    """
    device = torch.device(cfg.device)
    rows: list[dict] = []
    for name in cfg.train_models:
        bench = build_bench_model(name, device, cfg.seed)
        for batch in cfg.train_batch_sizes:
            if progress:
                progress(f"training step {name} batch {batch}: {', '.join(bench.variants)}")
            x = bench_input(bench, batch, device, cfg.seed)
            g = torch.Generator().manual_seed(cfg.seed)
            y = torch.randint(0, bench.num_classes, (batch,), generator=g).to(device)
            fns = {}
            for k, m in bench.variants.items():
                m.train()
                fns[k] = _train_step_fn(m, x, y)
            rows += _measure("train", bench, batch, fns, bench.train_flops, cfg, probe_n)
        del bench
    return pd.DataFrame(rows)


def select(table: pd.DataFrame, **where: object) -> pd.DataFrame:
    """Rows of ``table`` matching every column == value given."""
    mask = pd.Series(True, index=table.index)
    for column, value in where.items():
        mask &= table[column] == value
    return table[mask]
