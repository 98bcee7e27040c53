"""Entry point: cells per hour of `ablate --jobs J --threads T` layouts, side by side on this machine.

    workbench benchmark jobs --protocol studies/protocols/cifar10_seed_table.yaml \\
        --data-path $DATA/cifar10-jpg.tar.gz --train-size 10000 --val-size 2000 --epochs 1

Every layout (default ``2x1``: two jobs of one thread, against ``1x2``: one job of two
threads) runs the same cells: the protocol's arms at the given seeds, with the training and
validation sizes and epochs given (a quick version of the protocol: the protocol file itself
is never changed). Each layout is a real `workbench ablate --jobs J --threads T` in a
subprocess, with a fresh MLflow store and output folder of its own, so every cell trains
(nothing is "already finished") and the timing includes everything a study pays: process
starts, logging, checkpoints, proofs. The data is decoded and cached before any timing.
Layouts run one after another; with ``--rounds 2`` or more the order alternates from round
to round, so that drift in the machine's load hits every layout alike.

Reported (and logged to MLflow, experiment ``jobs-benchmark``): wall seconds and cells per
hour of each layout, the ratio of each layout's cells per hour to the reference layout's
(the last of ``--layouts``), and whether the cells' best validation accuracies agree between
layouts with the same thread count (they must: a cell's numbers depend on its thread count,
not on how many jobs ran); the load before and after, and each layout's verdict against the
reference from the rounds' seconds per cell with the ``use:`` line
(``workbench.bench.timing.decide``: a verdict needs 6 rounds).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import click
import pandas as pd
import yaml

from studies.benchmarks.recipe_benchmark import parse_seeds
from studies.runtime.preflight import check_writable_folder
from studies.runtime.study_execution import prepare_protocol_data
from studies.runtime.study_protocol import ProtocolError, load_protocol
from workbench.bench.timing import Decision, Load, decide

GOAL = 1.25  # cells per hour of two single-thread jobs against one two-thread job, on 2 cores


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``"2x1,1x2"`` -> [(2, 1), (1, 2)]: jobs x threads per job."""
    layouts = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        jobs, _, threads = part.partition("x")
        if not (jobs.isdigit() and threads.isdigit() and int(jobs) > 0 and int(threads) > 0):
            raise click.BadParameter(
                f"{part!r}: give JOBSxTHREADS, e.g. 2x1", param_hint="'--layouts'"
            )
        layouts.append((int(jobs), int(threads)))
    if len(layouts) < 2:
        raise click.BadParameter(
            "give at least two layouts to compare, e.g. 2x1,1x2", param_hint="'--layouts'"
        )
    return layouts


def quick_protocol(
    path: Path, out: Path, train_size: int, val_size: int, epochs: int, seeds: list[int]
) -> Path:
    """A copy of the protocol with other sizes, epochs and seeds, under a name of its own."""
    data = yaml.safe_load(path.read_text())
    data["name"] = f"{data['name']}_jobs_benchmark"
    data["description"] = (
        f"{data['name']}: the arms of {path.name} for `workbench benchmark jobs` "
        f"({train_size} / {val_size} images, {epochs} epoch(s), seeds {seeds})."
    )
    data["dataset"].update(train_size=train_size, val_size=val_size)
    data["run"]["epochs"] = epochs
    data["optim"]["warmup_epochs"] = min(
        float(data["optim"].get("warmup_epochs") or 0), epochs / 10
    )
    data["seeds"] = seeds
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{data['name']}.yaml"
    target.write_text(yaml.safe_dump(data, sort_keys=False))
    return target


def run_layout(
    protocol_file: Path,
    folder: Path,
    jobs: int,
    threads: int,
    device: str,
    data_path: str | None,
    say,
) -> dict:
    """One `ablate --jobs` in a subprocess with a fresh store; its wall time and each cell's result."""
    folder.mkdir(parents=True, exist_ok=True)
    store = f"sqlite:///{(folder / 'mlflow.db').resolve()}"
    command = [
        sys.executable,
        "-m",
        "studies.cli",
        "ablate",
        "--protocol",
        str(protocol_file.resolve()),
        "--allow-dirty",
        "--jobs",
        str(jobs),
        "--threads",
        str(threads),
        "--device",
        device,
        "--output-dir",
        str((folder / "outputs").resolve()),
    ]
    command += ["--data-path", data_path] if data_path else []
    env = {**os.environ, "MLFLOW_TRACKING_URI": store}
    say(
        f"layout {jobs}x{threads}: workbench ablate --jobs {jobs} --threads {threads} (store {folder / 'mlflow.db'})"
    )
    started = time.perf_counter()
    with open(folder / "console.log", "w") as log:
        done = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path.cwd()
        )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise click.ClickException(
            f"layout {jobs}x{threads} failed (exit {done.returncode}); see {folder / 'console.log'}"
        )
    from tracking.kinds.benchmark_runs import finished_cell_results

    return {
        "jobs": jobs,
        "threads": threads,
        "wall_s": wall,
        "cells": finished_cell_results(store, protocol_file.stem),
    }


def agreement(rows: list[dict]) -> list[str]:
    """For each thread count run by several layouts: do their cells' best validation accuracies agree?"""
    lines = []
    for threads in sorted({r["threads"] for r in rows}):
        same = [r for r in rows if r["threads"] == threads]
        layouts = sorted({f"{r['jobs']}x{r['threads']}" for r in same})
        if len(layouts) < 2:
            continue
        first = same[0]["cells"]
        equal = all(r["cells"] == first for r in same[1:])
        lines.append(
            f"{threads} thread(s): layouts {', '.join(layouts)} gave "
            + (
                "the same best validation accuracy in every cell"
                if equal
                else "DIFFERENT accuracies"
            )
        )
    return lines


def layout_decision(rows: list[dict], reference: tuple[int, int]) -> Decision:
    """Each layout against the reference from the rounds' seconds per cell, and which to use."""
    seconds: dict[str, list[float]] = {}
    for r in sorted(rows, key=lambda r: r["round"]):
        seconds.setdefault(f"{r['jobs']}x{r['threads']}", []).append(r["wall_s"] / len(r["cells"]))
    return decide(seconds, f"{reference[0]}x{reference[1]}", scope="layouts")


def summarize(
    rows: list[dict], reference: tuple[int, int], title: str, load: Load | None = None
) -> tuple[pd.DataFrame, str]:
    table = pd.DataFrame(
        [
            {
                "round": r["round"],
                "layout": f"{r['jobs']}x{r['threads']}",
                "jobs": r["jobs"],
                "threads": r["threads"],
                "cells": len(r["cells"]),
                "wall_s": r["wall_s"],
                "cells_per_hour": len(r["cells"]) / r["wall_s"] * 3600,
            }
            for r in rows
        ]
    )
    per_layout = table.groupby("layout", sort=False).agg(
        cells=("cells", "sum"), wall_s=("wall_s", "sum")
    )
    per_layout["cells_per_hour"] = per_layout["cells"] / per_layout["wall_s"] * 3600
    ref = per_layout.loc[f"{reference[0]}x{reference[1]}", "cells_per_hour"]
    per_layout["ratio"] = per_layout["cells_per_hour"] / ref
    lines = [
        f"# {title}",
        "",
        "| layout (jobs x threads) | cells | wall s | cells per hour | ratio to "
        f"{reference[0]}x{reference[1]} |",
        "|---|---|---|---|---|",
    ]
    for layout, r in per_layout.iterrows():
        lines.append(
            f"| {layout} | {int(r.cells)} | {r.wall_s:.1f} | {r.cells_per_hour:.1f} | {r.ratio:.3f} |"
        )
    lines += ["", "Rounds (in the order they ran):", ""]
    lines += [
        f"- round {r['round']}: {r['layout']} {r['wall_s']:.1f} s" for r in table.to_dict("records")
    ]
    best = per_layout.drop(index=f"{reference[0]}x{reference[1]}")["ratio"].max()
    lines += [
        "",
        f"Best ratio {best:.3f} (goal at least {GOAL} for 2x1 against 1x2 on 2 cores: "
        f"{'met' if best >= GOAL else 'not met'}).",
        "",
    ] + [f"- {line}" for line in agreement(rows)]
    lines += ["", *layout_decision(rows, reference).lines]
    load = load or Load(math.nan).finish()
    lines += ["", f"{load.line}."]
    return per_layout.reset_index(), "\n".join(lines) + "\n"


@click.command("jobs")
@click.option(
    "--protocol",
    "protocol_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
)
@click.option(
    "--layouts",
    default="2x1,1x2",
    show_default=True,
    help="Comma-separated JOBSxTHREADS layouts; the last one is the reference of the ratios.",
)
@click.option("--train-size", type=click.IntRange(min=1), default=10000, show_default=True)
@click.option("--val-size", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--seeds", default="0", show_default=True, help="Comma-separated seeds of the protocol."
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run every layout this many times, alternating the order.",
)
@click.option("--device", default="cpu", show_default=True)
@click.option("--data-path", default=None)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("outputs/jobs_benchmark"),
    show_default=True,
    help="Each layout's store, outputs and console log; results.csv and summary.md.",
)
def benchmark_jobs(
    protocol_path,
    layouts,
    train_size,
    val_size,
    epochs,
    seeds,
    rounds,
    device,
    data_path,
    output_dir,
):
    """Cells per hour of `ablate --jobs` layouts (two single-thread jobs against one two-thread job)."""
    try:
        protocol = load_protocol(protocol_path)
    except ProtocolError as err:
        raise click.ClickException(str(err)) from err
    order = parse_layouts(layouts)
    wanted = sorted(parse_seeds(seeds))
    missing = set(wanted) - set(protocol.seeds)
    if missing:
        raise click.BadParameter(
            f"no seed {', '.join(map(str, sorted(missing)))} in {protocol.name} "
            f"(its seeds: {', '.join(map(str, protocol.seeds))})",
            param_hint="'--seeds'",
        )
    check_writable_folder(output_dir)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    root = output_dir / stamp
    quick = quick_protocol(protocol_path, root, train_size, val_size, epochs, wanted)
    click.echo(f"caching the data of {quick.name} before any timing")
    prepare_protocol_data(load_protocol(quick), data_path, download=False)
    rows = []
    load = Load.begin()
    for round_ in range(1, rounds + 1):
        for jobs, threads in order if round_ % 2 else order[::-1]:
            row = run_layout(
                quick,
                root / f"round{round_}_{jobs}x{threads}",
                jobs,
                threads,
                device,
                data_path,
                click.echo,
            )
            rows.append({**row, "round": round_})
            click.echo(f"  {len(row['cells'])} cells in {row['wall_s']:.1f} s")
    load = load.finish()
    per_layout, text = summarize(
        rows,
        order[-1],
        f"`ablate --jobs` layouts: {protocol.name} ({len(protocol.arms)} "
        f"arms x {len(wanted)} seed(s), {train_size} / {val_size} images, "
        f"{epochs} epoch(s))",
        load,
    )
    per_layout.to_csv(root / "results.csv", index=False)
    (root / "summary.md").write_text(text)
    from tracking.kinds.benchmark_runs import log_jobs_benchmark

    run_id = log_jobs_benchmark(
        per_layout,
        root,
        {
            "protocol": protocol.name,
            "protocol_hash": protocol.hash,
            "layouts": layouts,
            "train_size": train_size,
            "val_size": val_size,
            "epochs": epochs,
            "seeds": seeds,
            "rounds": rounds,
        },
        layout_decision(rows, order[-1]),
        load.as_dict(),
    )
    click.echo(text + f"\nfiles: {root}; MLflow run {run_id} (experiment jobs-benchmark)")


if __name__ == "__main__":
    benchmark_jobs()
