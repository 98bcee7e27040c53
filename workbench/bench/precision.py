"""Training step in fp32 and under bf16 autocast, side by side, each against its own matmul peak.

bf16 is what ``amp: bf16`` gives a training run (``workbench.precision``): autocast per op,
fp32 master weights, fp32 optimizer. Both precisions train their own copy of the same
initial weights with the study optimizer, timed interleaved in the same rounds as two
square-matmul probes (fp32 and bf16), so each row's "fraction of peak" divides by the
limit of its own dtype measured under the same machine state, and the speedup is the
median of per-round ratios (fp32 time / bf16 time), which cancels load drift.

Speed is reported, not assumed to come free: whether bf16 trains as well as fp32 is for
the studies to show, not this benchmark.
"""

from __future__ import annotations

import copy
from typing import Callable

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from workbench.bench.machine import matmul_fn
from workbench.bench.models import build_bench_model
from workbench.bench.suite import BenchConfig, bench_input
from workbench.bench.timing import Samples, Spread, decide, rounds_needed, time_interleaved
from workbench.precision import bf16_supported

SECTION = "train_precision"
VARIANT = "glass_written"  # the path the training loop runs (hand-written attention)
PROBES = {"fp32": "matmul_fp32", "bf16": "matmul_bf16"}
LABELS = {"fp32": "fp32", "bf16": "bf16 autocast (fp32 master weights)"}


def _step_fn(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None
) -> Callable[[], None]:
    # The training loop's step: autocast around forward and loss, backward and AdamW outside.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    device_type = x.device.type

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()

    return step


def _rows(
    name: str, batch: int, samples: Samples, flops_per_image: int, probe_n: int
) -> list[dict]:
    limits = {p: 2 * probe_n**3 / min(samples.seconds[PROBES[p]]) for p in PROBES}
    ratios = Spread.of(samples.ratios("fp32", "bf16"))  # >1: bf16 faster
    best = min(samples.seconds["fp32"]) / min(samples.seconds["bf16"])
    timed = {p: samples.seconds[p] for p in PROBES}
    decision = decide(timed, "fp32", list(PROBES), f"{SECTION}/{name}/b{batch}")
    rows = []
    for precision in ("fp32", "bf16"):
        s = samples.spread(precision)
        achieved = flops_per_image * batch / s.median
        rows.append({
            "section": SECTION, "model": name, "kind": "vit", "batch": batch, "variant": precision,
            "label": LABELS[precision], "repeats": len(samples.seconds[precision]),
            "calls_per_sample": samples.inner[precision], "median_s": s.median, "q1_s": s.q1, "q3_s": s.q3,
            "min_s": s.min, "max_s": s.max, "images_per_s": batch / s.median, "gflop_per_image": flops_per_image / 1e9,
            "achieved_gflops": achieved / 1e9, "fraction_of_fp32_peak": achieved / limits["fp32"],
            "probe_gflops": limits["fp32"] / 1e9, "own_peak_dtype": precision,
            "own_probe_gflops": limits[precision] / 1e9, "fraction_of_own_peak": achieved / limits[precision],
            "speedup_vs_fp32": 1.0 if precision == "fp32" else ratios.median,
            "speedup_vs_fp32_q1": 1.0 if precision == "fp32" else ratios.q1,
            "speedup_vs_fp32_q3": 1.0 if precision == "fp32" else ratios.q3,
            "speedup_vs_fp32_best": 1.0 if precision == "fp32" else best,
            **decision.columns(precision),
        })  # fmt: skip
    return rows


def run_precision(
    cfg: BenchConfig, probe_n: int, progress: Callable[[str], None] | None = None
) -> pd.DataFrame:
    """Time the training step of each ``cfg.precision_models`` model in fp32 and bf16 autocast.

    Returns an empty table where the device has no native bf16 (the step would be
    emulated, and the comparison would say nothing about the machine's bf16 units).
    """
    device = torch.device(cfg.device)
    if not cfg.precision_models or not bf16_supported(device):
        return pd.DataFrame()
    rows: list[dict] = []
    for name in cfg.precision_models:
        bench = build_bench_model(name, device, cfg.seed)
        if bench.kind != "vit":
            raise ValueError(f"precision benchmark: {name!r} is not a ViT study model")
        base = bench.variants[VARIANT].train()
        for batch in cfg.precision_batch_sizes:
            if progress:
                progress(f"training step {name} batch {batch}: fp32 vs bf16 autocast")
            x = bench_input(bench, batch, device, cfg.seed)
            g = torch.Generator().manual_seed(cfg.seed)
            y = torch.randint(0, bench.num_classes, (batch,), generator=g).to(device)
            fns = {
                "fp32": _step_fn(copy.deepcopy(base), x, y, None),
                "bf16": _step_fn(copy.deepcopy(base), x, y, torch.bfloat16),
                PROBES["fp32"]: matmul_fn(device, probe_n, "float32", cfg.seed),
                PROBES["bf16"]: matmul_fn(device, probe_n, "bfloat16", cfg.seed),
            }
            samples = time_interleaved(
                fns,
                device,
                cfg.repeats,
                cfg.warmup,
                cfg.min_sample_s,
                max_seconds=cfg.max_seconds,
                min_repeats=rounds_needed(),
                separate=tuple(PROBES.values()),
            )
            rows += _rows(name, batch, samples, bench.train_flops, probe_n)
        del bench
    return pd.DataFrame(rows)
