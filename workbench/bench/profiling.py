"""Where the time goes: torch.profiler tables of each variant's forward pass.

When a ratio misses its goal, the first question is whether the two sides do different
work (more kernels, copies, another attention kernel) or the same work more slowly
(noise on a shared machine, Python overhead). The count of ATen calls per forward and the
per-operator table answer it without depending on timing noise; the tables are logged as
artifacts with ``--profile``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class Profile:
    """One variant's profiled forward passes.

    Attributes:
        model: Model name.
        variant: Variant id.
        batch: Batch size profiled.
        aten_calls: ATen operator calls per forward, nested calls included (``aten::linear``
            and the ``aten::addmm`` inside it both count).
        self_cpu_ms: Profiled self CPU time per forward, milliseconds (profiler overhead
            included: compare variants with each other, not with the timings).
        table: The profiler's per-operator table, sorted by self CPU time.
    """

    model: str
    variant: str
    batch: int
    aten_calls: float
    self_cpu_ms: float
    table: str


def profile_forward(
    model: nn.Module, x: torch.Tensor, name: str, variant: str, calls: int = 5
) -> Profile:
    """Profile ``calls`` forward passes in inference mode after two untimed ones."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    with torch.inference_mode():
        for _ in range(2):
            model(x)
        with profile(activities=activities) as prof:
            for _ in range(calls):
                model(x)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
    events = prof.key_averages()
    aten = [e for e in events if e.key.startswith("aten::")]
    # fmt: skip
    return Profile(
        model=name,
        variant=variant,
        batch=x.shape[0],
        aten_calls=sum(e.count for e in aten) / calls,
        self_cpu_ms=sum(e.self_cpu_time_total for e in events) / calls / 1e3,
        table=events.table(sort_by="self_cpu_time_total", row_limit=25),
    )


def profile_models(
    models: tuple[str, ...], device: torch.device | str, batch: int = 1, seed: int = 0
) -> list[Profile]:
    """Profile every variant of every model at one batch size (weights as in the benchmark)."""
    from workbench.bench.models import build_bench_model

    device = torch.device(device)
    out = []
    for name in models:
        bench = build_bench_model(name, device, seed)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(
            batch, bench.in_channels, bench.image_size, bench.image_size, generator=g
        ).to(device)
        out += [profile_forward(m, x, name, variant) for variant, m in bench.variants.items()]
    return out
