"""Entry point: the workbench's own training of a protocol's cells against a plain PyTorch loop.

    workbench benchmark recipe --protocol studies/protocols/fmnist_seed_recipe.yaml --threads 1
    workbench benchmark recipe --protocol P --seeds 0,1 --arms vit --epochs 2 --subset 500   # quick look

For every cell (arm x seed) the same config is trained twice, back to back: once by
``workbench.bench.recipe.plain_fit`` (no logging, checkpoints, predictions files or proofs)
and once by ``studies.ablation.train.train_one`` (an MLflow run with everything the studies log),
the order alternating from cell to cell so that load drift hits both alike. Both see the
same prepared data (loaded once, outside the timing) and, being seeded the same way,
reach the same validation accuracy, which the table shows. Goal: total workbench time
at most 1.1x the plain loop's (reported, not enforced). The summary adds the load before and
after and the verdict of the workbench against the plain loop, each cell one round
(``workbench.bench.timing.decide``: 6 cells at least for a resolved verdict).

The workbench's runs go to experiment ``recipe-benchmark`` with a fresh identity each
invocation, so they always train (never "already finished") and never mix with the study.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import click
import pandas as pd

from studies.ablation.train import train_one
from studies.runtime.options import check_protocol_amp, threads_option
from studies.runtime.preflight import check_writable_folder
from studies.runtime.study_execution import prepare_protocol_data
from studies.runtime.study_protocol import ProtocolError, load_protocol
from workbench.bench.recipe import plain_fit
from workbench.bench.timing import Decision, Load, decide
from workbench.data import PreparedData
from workbench.train.config import TrainConfig

GOAL = 1.1


def compare_cells(
    cells: list[tuple[str, int, TrainConfig]],
    data: PreparedData,
    experiment: str,
    output_dir: Path,
    say=print,
) -> pd.DataFrame:
    """Train each (arm, seed, config) with the plain loop and with ``train_one``; one row per cell."""
    nonce = time.strftime("%Y%m%dT%H%M%S")
    rows = []
    for i, (arm, seed, cfg) in enumerate(cells):
        row: dict = {"arm": arm, "seed": seed}
        for which in ("plain", "workbench") if i % 2 == 0 else ("workbench", "plain"):
            say(f"{arm} seed {seed}: {which}")
            started = time.perf_counter()
            if which == "plain":
                r = plain_fit(cfg, data)
                row |= {
                    "plain_s": time.perf_counter() - started,
                    "plain_best_val_accuracy": r.best_val_accuracy,
                    "plain_best_epoch": r.best_epoch,
                    "plain_test_accuracy": r.test_accuracy,
                }
            else:
                out = train_one(
                    cfg,
                    data,
                    experiment=experiment,
                    output_dir=output_dir,
                    run_name=f"{arm}-seed{seed}",
                    identity={"recipe_benchmark": nonce, "arm": arm, "seed": seed},
                    tags={"recipe_benchmark": nonce},
                )
                if out.status != "finished":
                    raise click.ClickException(
                        f"workbench run {arm} seed {seed} {out.status}: {out.message}"
                    )
                row |= {
                    "workbench_s": time.perf_counter() - started,
                    "run_id": out.run_id,
                    "workbench_best_val_accuracy": out.metrics.get("best_val_accuracy"),
                    "workbench_best_epoch": out.metrics.get("best_epoch"),
                    "workbench_test_accuracy": out.metrics.get("test_accuracy"),
                }
        row["ratio"] = row["workbench_s"] / row["plain_s"]
        row["same_best_val_accuracy"] = (
            row["plain_best_val_accuracy"] == row["workbench_best_val_accuracy"]
        )
        rows.append(row)
    return pd.DataFrame(rows)


def cell_decision(table: pd.DataFrame) -> Decision:
    """The workbench against the plain loop, each cell one round (the pair ran back to back)."""
    seconds = {"workbench": list(table["workbench_s"]), "plain loop": list(table["plain_s"])}
    return decide(seconds, "plain loop", scope="cells")


def summary(table: pd.DataFrame, title: str, load: Load | None = None) -> str:
    total_plain, total_wb = table["plain_s"].sum(), table["workbench_s"].sum()
    ratio = total_wb / total_plain
    lines = [
        f"# {title}",
        "",
        "| arm | seed | plain s | workbench s | ratio | best val plain | best val workbench | same |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples():
        lines.append(
            f"| {r.arm} | {r.seed} | {r.plain_s:.1f} | {r.workbench_s:.1f} | {r.ratio:.3f} | "
            f"{r.plain_best_val_accuracy:.4f} | {r.workbench_best_val_accuracy:.4f} | "
            f"{'yes' if r.same_best_val_accuracy else 'no'} |"
        )
    verdict = "met" if ratio <= GOAL else "not met"
    lines += [
        "",
        f"Total: plain {total_plain:.1f} s, workbench {total_wb:.1f} s, ratio {ratio:.3f} "
        f"(goal <= {GOAL}: {verdict}); per-cell ratio median {table['ratio'].median():.3f}.",
        "",
        *cell_decision(table).lines,
    ]
    if load is not None:
        lines += ["", f"{load.line}."]
    return "\n".join(lines) + "\n"


def parse_seeds(text: str) -> set[int]:
    """``"0,1"`` -> {0, 1}; anything that is not a comma-separated list of integers is refused."""
    parts = [p.strip() for p in text.split(",")]
    bad = [p for p in parts if not p.lstrip("-").isdigit()]
    if bad:
        raise click.BadParameter(
            f"{text!r}: {bad[0]!r} is not an integer seed; give comma-separated integers, e.g. 0,1",
            param_hint="'--seeds'",
        )
    return {int(p) for p in parts}


@click.command("recipe")
@click.option(
    "--protocol", "protocol_path", required=True, type=click.Path(exists=True, dir_okay=False)
)
@click.option("--seeds", default=None, help="Comma-separated seeds (default: the protocol's).")
@click.option("--arms", default=None, help="Comma-separated arms (default: all).")
@click.option(
    "--epochs",
    type=click.IntRange(min=1),
    default=None,
    help="Override the epoch budget (quick looks).",
)
@click.option(
    "--subset", type=click.IntRange(min=1), default=None, help="At most this many images per split."
)
@click.option("--device", default="auto", show_default=True)
@click.option("--data-path", default=None)
@click.option("--experiment", default="recipe-benchmark", show_default=True)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("outputs/recipe_benchmark"),
    show_default=True,
    help="Checkpoints of the workbench runs, results.csv and summary.md.",
)
@threads_option
def benchmark_recipe(
    protocol_path, seeds, arms, epochs, subset, device, data_path, experiment, output_dir, threads
):
    """Time a protocol's cells: the workbench's training against a plain PyTorch loop of the same recipe."""
    try:
        protocol = load_protocol(protocol_path)
    except ProtocolError as err:
        raise click.ClickException(str(err)) from err
    check_writable_folder(output_dir)
    wanted_seeds = parse_seeds(seeds) if seeds else set(protocol.seeds)
    missing = wanted_seeds - set(protocol.seeds)
    if missing:
        raise click.BadParameter(
            f"no seed {', '.join(map(str, sorted(missing)))} in {protocol.name} "
            f"(its seeds: {', '.join(map(str, protocol.seeds))})",
            param_hint="'--seeds'",
        )
    wanted_arms = set(arms.split(",")) if arms else {a.name for a in protocol.arms}
    unknown = wanted_arms - {a.name for a in protocol.arms}
    if unknown:
        raise click.BadParameter(
            f"no arm {', '.join(sorted(unknown))} in {protocol.name}", param_hint="--arms"
        )
    check_protocol_amp(protocol, device)
    if subset:
        protocol = replace(protocol, dataset=replace(protocol.dataset, subset=subset))
    cells = []
    for cell in protocol.cells():
        if cell.arm in wanted_arms and cell.seed in wanted_seeds:
            cfg = cell.train_config(device=device, data_path=data_path)
            if subset:
                cfg = replace(cfg, data=replace(cfg.data, subset=subset))
            if epochs:
                cfg = replace(cfg, run=replace(cfg.run, epochs=epochs))
            cells.append((cell.arm, cell.seed, cfg))
    data = prepare_protocol_data(protocol, data_path, download=False)
    load = Load.begin()
    table = compare_cells(cells, data, experiment, output_dir / protocol.name, say=click.echo)
    text = summary(table, f"Plain PyTorch loop vs workbench: {protocol.name}", load.finish())
    output_dir.mkdir(parents=True, exist_ok=True)
    table.to_csv(output_dir / f"{protocol.name}_results.csv", index=False)
    (output_dir / f"{protocol.name}_summary.md").write_text(text)
    click.echo(text)


if __name__ == "__main__":
    benchmark_recipe()
