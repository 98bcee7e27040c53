"""One benchmark run: the machine's matmul limit, inference, training step, loader, goals.

Everything is measured in the same process, one after the other, with the same thread
setting, so every ratio and every fraction of peak compares figures of the same machine
state. The loader benchmark lives in ``studies.benchmarks.data_benchmark`` (it is an entry point of
its own); the caller passes it in as a function, since the library does not import
``studies``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd
import torch

from workbench.bench.machine import MatmulPeak, machine_info, matmul_peak
from workbench.bench.precision import run_precision
from workbench.bench.profiling import Profile, profile_models
from workbench.bench.report import Goal, decisions, evaluate_goals, markdown_summary
from workbench.bench.suite import BenchConfig, run_inference, run_training
from workbench.bench.timing import Decision


@dataclass
class BenchmarkResult:
    """Everything a benchmark run measured.

    Attributes:
        config: What was measured.
        info: Machine description (device name, threads, versions, load at start and end).
        peaks: Matmul throughput per dtype.
        inference: One row per (model, batch, variant); see ``workbench.bench.suite``.
        train: Training-step rows, same columns.
        precision: Training step in fp32 and bf16 autocast (``workbench.bench.precision``);
            empty without native bf16.
        loader: The loader benchmark's result dict, or None when skipped.
        profiles: torch.profiler summaries per (model, variant) at batch 1, when asked for.
        goals: The goals with measured values.
        markdown: The summary page.
    """

    config: BenchConfig
    info: dict[str, str]
    peaks: list[MatmulPeak]
    inference: pd.DataFrame
    train: pd.DataFrame
    loader: dict | None
    profiles: list[Profile] = field(default_factory=list)
    precision: pd.DataFrame = field(default_factory=pd.DataFrame)
    goals: list[Goal] = field(default_factory=list)
    markdown: str = ""

    def timings(self) -> pd.DataFrame:
        """Inference and training rows in one table (the CSV)."""
        return pd.concat(
            [t for t in (self.inference, self.train, self.precision) if not t.empty]
            or [self.train],
            ignore_index=True,
        )

    def decisions(self) -> list[Decision]:
        """Every timed comparison's verdicts and ``use:`` line (the loader's are in ``loader``)."""
        return decisions(self.inference, self.train, self.precision)

    def goals_table(self) -> pd.DataFrame:
        return pd.DataFrame([g.to_row() for g in self.goals])


def default_matmul_size(device: torch.device) -> int:
    # Big enough to be compute-bound on the device, small enough to take well under a
    # second per call (2048^3 x 2 = 17 GFLOP on CPU; 8192^3 x 2 = 1.1 TFLOP on GPU).
    return 8192 if device.type == "cuda" else 2048


def run_benchmark(
    cfg: BenchConfig,
    threads: int | None = None,
    matmul_n: int | None = None,
    loader: Callable[[], dict] | None = None,
    progress: Callable[[str], None] | None = None,
    profile: bool = False,
) -> BenchmarkResult:
    """Measure the machine's limit, then every model, then the loader; evaluate the goals.

    Args:
        cfg: Models, batch sizes, repeats, device.
        threads: torch intra-op threads for the whole run (restored afterwards); None
            keeps the current setting.
        matmul_n: Side of the square matmuls; default by device.
        loader: Zero-argument function returning the loader benchmark's dict, or None.
        progress: Called with a line before each measurement.
        profile: Also profile each inference model's variants at batch 1 (after the
            timings, so the profiler never overlaps them).
    """
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {cfg.device!r} requested but CUDA is not available")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    say = progress or (lambda line: None)
    try:
        info = machine_info(device)
        n = matmul_n or default_matmul_size(device)
        say(f"matmul peak: {n} x {n}, fp32 and bf16 where native")
        peaks = matmul_peak(
            device,
            n,
            repeats=max(3, min(cfg.repeats, 10)),
            warmup=max(1, cfg.warmup),
            seed=cfg.seed,
        )
        # The probe timed beside the models: half the side, an eighth of the work, still
        # compute-bound (1024 on CPU, 4096 on GPU).
        probe_n = max(256, n // 2)
        inference = run_inference(cfg, probe_n, say)
        train = run_training(cfg, probe_n, say)
        precision = run_precision(cfg, probe_n, say)
        loader_result = None
        if loader is not None:
            say("data loader")
            loader_result = loader()
        profiles = []
        if profile:
            say("torch.profiler: every variant at batch 1")
            profiles = profile_models(cfg.models, device, batch=1, seed=cfg.seed)
        if hasattr(os, "getloadavg"):
            info["load_average_1m_end"] = f"{os.getloadavg()[0]:.2f}"
    finally:
        torch.set_num_threads(previous)
    result = BenchmarkResult(cfg, info, peaks, inference, train, loader_result, profiles, precision)
    result.goals = evaluate_goals(inference, train, loader_result, str(device), precision)
    settings = {
        "repeats": cfg.repeats,
        "warmup": cfg.warmup,
        "max_seconds": cfg.max_seconds or "no",
    }
    result.markdown = markdown_summary(
        info, peaks, inference, train, loader_result, result.goals, settings, profiles, precision
    )
    return result
