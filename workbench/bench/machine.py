"""What the machine can do: large square matmul throughput, and a description of it.

A large square matmul is the most compute-dense operation the libraries offer (BLAS /
oneDNN on CPU, cuBLAS on GPU), so its throughput is the practical ceiling for the
matmul-bound work a ViT does. A model's achieved FLOP/s as a fraction of it says how much
room there is left, whoever's implementation runs.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Callable

import torch

from workbench.bench.timing import Spread, time_interleaved
from workbench.precision import bf16_supported as precision_bf16_supported


@dataclass(frozen=True)
class MatmulPeak:
    """Throughput of ``n x n @ n x n`` in one dtype (TFLOP/s per round)."""

    dtype: str
    n: int
    tflops: Spread
    repeats: int


def bf16_supported(device: torch.device) -> bool:
    """bf16 matmul runs natively: CUDA devices that report it, CPUs with AVX512-BF16 or AMX.

    On other CPUs bf16 matmul is emulated and far slower than fp32, so a "peak" measured
    there would mislead. The same check decides whether a training run may use
    ``amp: bf16`` (``workbench.precision``).
    """
    return precision_bf16_supported(device)


def matmul_fn(
    device: torch.device | str, n: int, dtype: str = "float32", seed: int = 0
) -> Callable[[], object]:
    """A zero-argument ``n x n @ n x n`` matmul (2 n^3 FLOPs per call) on fixed random operands."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, generator=g).to(device=device, dtype=getattr(torch, dtype))
    out = torch.empty_like(a)
    return lambda: torch.mm(a, b, out=out)  # out= keeps an allocation out of the timing


def matmul_peak(
    device: torch.device | str,
    n: int,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
) -> list[MatmulPeak]:
    """Median TFLOP/s of square matmuls, the dtypes timed interleaved.

    Args:
        device: Where to multiply.
        n: Matrix side; large enough to be compute-bound (2048 on CPU, 8192 on GPU).
        dtypes: Dtypes to try; ``bfloat16`` is skipped where not native (see
            ``bf16_supported``).
        repeats: Timed rounds.
        warmup: Untimed calls first.
        seed: Seed of the random operands.
    """
    device = torch.device(device)
    candidates = {
        name: matmul_fn(device, n, name, seed)
        for name in dtypes
        if name != "bfloat16" or bf16_supported(device)
    }
    samples = time_interleaved(candidates, device, repeats=repeats, warmup=warmup, min_sample_s=0.2)
    flops = 2 * n**3
    return [
        MatmulPeak(name, n, Spread.of([flops / s / 1e12 for s in samples.seconds[name]]), repeats)
        for name in candidates
    ]


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device | str) -> dict[str, str]:
    """Device name, threads, load and library versions, as strings (tags and params)."""
    import timm

    device = torch.device(device)
    info = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "cpu_name": _cpu_name(),
        "cpu_count": str(os.cpu_count()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": str(torch.get_num_threads()),
        "torch_interop_threads": str(torch.get_num_interop_threads()),
        "torch_version": torch.__version__,
        "timm_version": timm.__version__,
        "python_version": platform.python_version(),
        "mkldnn": str(torch.backends.mkldnn.is_available()),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if hasattr(os, "getloadavg"):
        # The machine may be shared: the load says how much to trust small differences.
        info["load_average_1m"] = f"{os.getloadavg()[0]:.2f}"
    if device.type == "cuda":
        info["cuda_version"] = str(torch.version.cuda)
        info["cudnn_version"] = str(torch.backends.cudnn.version())
        info["cudnn_allow_tf32"] = str(torch.backends.cudnn.allow_tf32)
    return info
