"""Entry point: time an intervention protocol's grid before (or without) running it.

    workbench benchmark intervene --protocol studies/protocols/fmnist_seed_recipe_heads.yaml --threads 2

One seeded random-weight model of the acted-on architecture per cell, random images of the
evaluation split's size, the protocol's batch size, mean reference and attention maps: the
same library calls ``workbench intervene`` makes per cell (``workbench.interventions.benchmark``),
without data, checkpoints or an MLflow run per cell. Prints each cell, the total against the
goal (every head and branch of ``fmnist_seed_recipe``'s ViT over 5 seeds on 800 images in under
120 s on 2 cores) with the verdict the cells' spread allows (``workbench.bench.timing``), the
load before and after and the ``use:`` line, and logs them with the timings to the MLflow
experiment ``benchmark-intervene``.
"""

from __future__ import annotations

import statistics

import click

from studies.benchmarks.acted_options import acted_options, cells_of, chosen_arm, load_or_fail
from studies.runtime.options import threads_option
from workbench.bench.timing import Load, decide, goal_verdict
from workbench.data import DEFAULT_SIZES
from workbench.interventions.benchmark import time_grid
from workbench.protocol import InterventionProtocol, load_intervention_protocol
from workbench.protocol.intervention import check_against_model

GOAL_SECONDS = 120.0
GOAL_CONFIGURATION = ("fmnist_seed_recipe_heads", 5, 800, 2)  # protocol, cells, images, threads


def split_size(protocol: InterventionProtocol) -> int | None:
    """Images of the evaluation split when the protocol fixes them (carved validation sizes), else None."""
    if protocol.acts_on is None or protocol.evaluation.split != "val":
        return None
    dataset = protocol.source.dataset
    return dataset.val_size or DEFAULT_SIZES.get(dataset.name, (None, None))[1]


@click.command("intervene")
@acted_options(
    "Intervention",
    "--examples",
    2,
    "Images per cell [default: the protocol's validation size when it fixes one].",
)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--log/--no-log",
    default=True,
    show_default=True,
    help="Log the timings to the MLflow experiment benchmark-intervene.",
)
@threads_option
def benchmark_intervene(protocol_path, cells, examples, arm, device, log, threads):
    """Time an intervention protocol's grid on random-weight models of its architecture (no data, no MLflow store)."""
    protocol = load_or_fail(load_intervention_protocol, protocol_path)
    if protocol.acts_on is not None:
        arm = chosen_arm(protocol, arm)
        cfg = protocol.model_config(arm)
    else:
        from workbench.interventions.sources import pretrained_model

        spec = protocol.pretrained
        cfg = pretrained_model(spec.model, "random", spec.seed, spec.timm_kwargs).model.cfg
        arm = "pretrained"
    cells = cells_of(protocol, arm, cells)
    examples = examples or split_size(protocol)
    if examples is None:
        raise click.UsageError("the protocol does not fix its split's size: give --examples N")
    grid = check_against_model(protocol, cfg, f"arm {arm}")
    e = protocol.evaluation
    click.echo(
        f"{protocol.name}: {len(grid)} interventions x {cells} cells x {examples} images, batch {e.batch_size}, "
        f"mean reference {e.mean_images} images, attention maps {'on' if e.attention_maps else 'off'}; "
        f"random weights of arm {arm} ({cfg.depth} blocks x {cfg.heads} heads, dim {cfg.dim})"
    )
    load = Load.begin()
    timing = time_grid(
        cfg,
        grid,
        cells,
        examples,
        e.batch_size,
        e.mean_images,
        e.attention_maps,
        device,
        click.echo,
    )
    spread = f"{min(timing.cell_seconds):.2f} to {max(timing.cell_seconds):.2f} s"
    click.echo(
        f"total {timing.total:.1f} s on {timing.threads} thread(s); per cell median "
        f"{statistics.median(timing.cell_seconds):.2f} s ({spread}), {timing.forward_equivalents:.1f} intact "
        "forward passes each"
    )
    load = load.finish()
    goal_run = (protocol.name, cells, examples, timing.threads) == GOAL_CONFIGURATION
    goal = goal_verdict(timing.cell_seconds, cells, GOAL_SECONDS)
    if goal_run:
        click.echo(
            f"goal: under {GOAL_SECONDS:.0f} s: {'met' if timing.total < GOAL_SECONDS else 'NOT met'}"
            f"; from the cells' spread: {goal}"
        )
    else:
        click.echo(
            f"goal (under {GOAL_SECONDS:.0f} s) applies to fmnist_seed_recipe_heads, 5 cells x 800 images, "
            "--threads 2: not this configuration"
        )
    # One thread count per run: the use line names it; run again with another --threads to compare.
    decision = decide({f"{timing.threads} thread(s)": timing.cell_seconds}, f"{timing.threads} thread(s)",
                      scope="threads")  # fmt: skip
    for line in [load.line, *decision.lines]:
        click.echo(line)
    if log:
        from tracking.kinds.intervention_runs import log_benchmark

        run_id = log_benchmark(
            protocol.name,
            timing,
            {
                "arm": arm,
                "cells": cells,
                "examples": examples,
                "batch_size": e.batch_size,
                "device": device,
                "interventions": len(grid),
                "goal_seconds": GOAL_SECONDS if goal_run else 0,
            },
            decision,
            load.as_dict(),
            goal if goal_run else None,
        )
        click.echo(f"logged to run {run_id} (experiment benchmark-intervene)")
