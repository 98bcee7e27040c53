"""Benchmarks: glass-box ViT vs timm, timed interleaved, against the machine's matmul limit.

Usage::

    from workbench.bench import BenchConfig, run_benchmark

    result = run_benchmark(BenchConfig(models=("vit_tiny_patch16_224", "fmnist_vit")), threads=2)
    print(result.markdown)                 # tables, goals met or not
    result.timings()                       # one row per (section, model, batch, variant)

Pieces: ``timing`` (interleaved rounds, CUDA events or perf_counter), ``flops`` (analytic
counts from the config), ``machine`` (square-matmul throughput, device description),
``models`` (one set of weights in four variants), ``suite`` (inference and training
step), ``profiling`` (torch.profiler tables), ``report`` (goals, Markdown). The library
never logs; ``tracking.kinds.benchmark_runs`` does.
"""

from workbench.bench.flops import (
    cnn_forward_flops,
    cnn_train_flops,
    vit_forward_flops,
    vit_train_flops,
)
from workbench.bench.machine import MatmulPeak, bf16_supported, machine_info, matmul_peak
from workbench.bench.models import (
    LABELS,
    REFERENCE,
    VARIANTS,
    BenchModel,
    build_bench_model,
    timm_from_config,
)
from workbench.bench.profiling import Profile, profile_forward, profile_models
from workbench.bench.report import Goal, evaluate_goals, markdown_summary
from workbench.bench.run import BenchmarkResult, run_benchmark
from workbench.bench.suite import DEFAULT_MODELS, BenchConfig, run_inference, run_training
from workbench.bench.timing import Samples, Spread, time_interleaved

__all__ = [
    "DEFAULT_MODELS",
    "LABELS",
    "REFERENCE",
    "VARIANTS",
    "BenchConfig",
    "BenchModel",
    "BenchmarkResult",
    "Goal",
    "MatmulPeak",
    "Profile",
    "Samples",
    "Spread",
    "bf16_supported",
    "build_bench_model",
    "cnn_forward_flops",
    "cnn_train_flops",
    "evaluate_goals",
    "machine_info",
    "markdown_summary",
    "matmul_peak",
    "profile_forward",
    "profile_models",
    "run_benchmark",
    "run_inference",
    "run_training",
    "time_interleaved",
    "timm_from_config",
    "vit_forward_flops",
    "vit_train_flops",
]
