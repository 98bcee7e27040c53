"""Entry point: time an attribution protocol's scoring before (or without) running it.

    workbench benchmark attribute --protocol studies/protocols/fmnist_seed_recipe_faithfulness.yaml --threads 1,2

The cost of ``score_cell`` does not depend on the weights or the pixel values (no
data-dependent control flow: every method, every single-token drop and every curve point is
computed for every image), so one seeded random-weight model of the acted-on architecture per
cell and random images of the model's shape measure it without data, checkpoints or an MLflow
store. Each cell is the call ``workbench attribute`` makes (``score_cell`` with the protocol's
methods, norm threshold, random seed and batch size, on its image count, the full curve grid,
and its controls: the random draws' curves and the model-randomisation check; in
cifar10_registers_faithfulness the randomisation check took about 11 of a patch-4 cell's 33
minutes on one core).

Per thread count: wall time, process CPU time (all threads; on a shared machine the cost,
where the wall time also holds the waiting), sequences through the blocks (the forward passes
``score_cell`` counts), images, and wall time over the goal (the fmnist study, 5 cells x
800 images, in under 300 s on 2 cores); the load before and after, and each thread count's
verdict against the first with the ``use:`` line (``workbench.bench.timing.decide``; cell i of
every count is the same workload, so the cells are the rounds, but the counts run one after
another, not interleaved). Printed, and written as JSON to ``<output-dir>/<protocol name>.json``
(atomically; a rerun replaces it).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch

from studies.benchmarks.acted_options import acted_options, cells_of, chosen_arm, load_or_fail
from workbench.atomic import atomic_write_bytes
from workbench.attribution import score_cell
from workbench.attribution.controls import Controls
from workbench.bench.timing import Load, decide, goal_verdict
from workbench.models.vit import ViTConfig, VisionTransformer
from workbench.precision import cpu_name, set_threads
from workbench.protocol import load_attribution_protocol

GOAL_SECONDS = 300.0
# protocol, cells, images, threads
GOAL_CONFIGURATION = (
    "fmnist_seed_recipe_faithfulness",
    5,
    800,
    2,
)


@dataclass(frozen=True)
class Timing:
    """One thread count's run of ``cells`` cells."""

    threads: int
    cells: int
    images: int  # over all cells
    wall_seconds: float
    cpu_seconds: float  # process CPU time, every thread
    forwards: int  # sequences through the blocks, over all cells
    cell_wall_seconds: list[float]
    goal_ratio: float  # wall_seconds / GOAL_SECONDS


def thread_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise click.BadParameter(
            f"{text!r}: give thread counts >= 1, comma-separated (e.g. 1,2)",
            param_hint="'--threads'",
        )
    return counts


def time_cells(
    cfg: ViTConfig, settings, cells: int, images: int, threads: int, say=lambda _: None
) -> Timing:
    """``cells`` calls of ``score_cell`` as the study makes them, on ``threads`` intra-op threads."""
    used = set_threads(threads)
    wall, cpu, forwards, per_cell = 0.0, 0.0, 0, []
    for seed in range(cells):
        gen = torch.Generator().manual_seed(seed)
        # the model's own init, seeded: the timing does not depend on the values
        torch.manual_seed(seed)
        model = VisionTransformer(cfg).eval()
        x = torch.randn(images, cfg.in_channels, *cfg.image_hw, generator=gen)
        y = torch.randint(0, cfg.num_classes, (images,), generator=gen)
        started, cpu_started = time.perf_counter(), time.process_time()
        cell = score_cell(
            model,
            x,
            y,
            settings.methods,
            settings.random_seed,
            settings.norm_threshold,
            batch_size=settings.batch_size,
            controls=Controls(settings.random_draws, settings.sanity_check, seed),
        )
        per_cell.append(time.perf_counter() - started)
        wall, cpu = wall + per_cell[-1], cpu + time.process_time() - cpu_started
        forwards += cell.forwards
        say(
            f"  {used} thread(s), cell {seed + 1} of {cells}: {per_cell[-1]:.1f} s wall, {cell.forwards:,} sequences"
        )
    return Timing(
        threads=used,
        cells=cells,
        images=cells * images,
        wall_seconds=wall,
        cpu_seconds=cpu,
        forwards=forwards,
        cell_wall_seconds=per_cell,
        goal_ratio=wall / GOAL_SECONDS,
    )


@click.command("attribute")
@acted_options(
    "Attribution", "--images", 1, "Images per cell [default: the protocol's image count]."
)
@click.option(
    "--threads",
    "threads_text",
    default="1,2",
    show_default=True,
    help="torch intra-op thread counts to time, comma-separated, one run each.",
)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("outputs/attribution_benchmark"),
    show_default=True,
    help="Folder of the JSON result (<protocol name>.json).",
)
def benchmark_attribute(protocol_path, cells, images, arm, threads_text, output_dir):
    """Time an attribution protocol's scoring on random-weight models of its architecture (no data, no MLflow store)."""
    counts = thread_counts(threads_text)
    protocol = load_or_fail(load_attribution_protocol, protocol_path)
    if protocol.acts_on is None:
        raise click.UsageError(
            f"{protocol_path}: acts on a pretrained timm ViT; this benchmark times the acted-on "
            "cells of an ablation protocol"
        )
    arm = chosen_arm(protocol, arm)
    cfg = protocol.model_config(arm)
    s = protocol.settings
    cells = cells_of(protocol, arm, cells)
    images = images or s.images
    click.echo(
        f"{protocol.name}: {cells} cells x {images} images, methods {', '.join(s.methods)}, batch "
        f"{s.batch_size}, every curve point; random weights of arm {arm} ({cfg.num_patches} patch tokens, "
        f"{cfg.depth} blocks x {cfg.heads} heads, dim {cfg.dim}); {cpu_name()}"
    )
    timings = []
    load = Load.begin()
    for threads in counts:
        t = time_cells(cfg, s, cells, images, threads, click.echo)
        timings.append(t)
        click.echo(
            f"{t.threads} thread(s): {t.wall_seconds:.1f} s wall, {t.cpu_seconds:.1f} s process CPU, "
            f"{t.forwards:,} sequences through the blocks, {t.images:,} images; "
            f"{t.wall_seconds / GOAL_SECONDS:.2f} x the {GOAL_SECONDS:.0f}-s goal"
        )
    load = load.finish()
    for t in timings:
        if (protocol.name, cells, images, t.threads) == GOAL_CONFIGURATION:
            click.echo(
                f"goal (under {GOAL_SECONDS:.0f} s on {t.threads} threads): "
                f"{'met' if t.wall_seconds < GOAL_SECONDS else 'NOT met'} in wall time; "
                f"from the cells' spread: {goal_verdict(t.cell_wall_seconds, cells, GOAL_SECONDS)}"
            )
    # Thread counts ran one after another, not interleaved: cell i of each count is the same
    # workload (seed i), so the pairs are the rounds; load drift between the runs is not cancelled.
    per_cell = {f"{t.threads} thread(s)": t.cell_wall_seconds for t in timings}
    decision = decide(per_cell, next(iter(per_cell)), scope="threads")
    for line in [load.line, *decision.lines]:
        click.echo(line)
    record = {
        "protocol": protocol.name,
        "protocol_hash": protocol.hash,
        "arm": arm,
        "cells": cells,
        "images_per_cell": images,
        "methods": list(s.methods),
        "batch_size": s.batch_size,
        "cpu": cpu_name(),
        **load.as_dict(),
        "verdicts": decision.lines,
        "use": decision.use,
        "goal_seconds": GOAL_SECONDS,
        "timings": [asdict(t) for t in timings],
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / f"{protocol.name}.json"
    atomic_write_bytes(path, (json.dumps(record, indent=2) + "\n").encode())
    click.echo(f"written: {path}")
