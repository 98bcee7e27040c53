"""Calibrate a protocol before running it: each arm's step speed here, and the wall time implied.

    workbench benchmark calibrate --protocol studies/protocols/cifar10_ablations.yaml --threads 1,2
    workbench benchmark calibrate --protocol P --train-size 8000 --epochs 10   # what-if sizing

Prints one row per (arm, threads): training and evaluation images/s (median of timed
steps on random inputs, the protocol's batch sizes and ``amp``), and the projected wall
time of one cell and of all seeds, for the protocol's sizes or the ones given. Data loading
is not included: add a margin, and measure on the machine that will run the study.
With several thread counts, each arm's counts are compared (``workbench.bench.timing.decide``:
the training steps are the rounds, paired by their order, the counts timed one after another)
and a ``use:`` line names the thread count to run the arm with; the load before and after is
printed.
"""

from __future__ import annotations

import click

from studies.runtime.study_protocol import ProtocolError, load_protocol
from workbench.bench.cells import measure_arm, project_seconds
from workbench.bench.timing import Load, decide
from workbench.precision import AmpUnsupported, set_threads


@click.command("calibrate")
@click.option(
    "--protocol", "protocol_path", required=True, type=click.Path(exists=True, dir_okay=False)
)
@click.option(
    "--threads",
    "thread_list",
    default="1",
    show_default=True,
    help="Comma-separated thread counts.",
)
@click.option("--arm", "arms", multiple=True, help="Arms to time (default: all).")
@click.option(
    "--train-size",
    type=int,
    default=None,
    help="Training images per epoch (default: the protocol's).",
)
@click.option(
    "--val-size",
    type=int,
    default=None,
    help="Validation images per epoch (default: the protocol's).",
)
@click.option("--epochs", type=int, default=None, help="Epochs (default: the protocol's).")
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=6,
    show_default=True,
    help="Timed steps per arm (a verdict between thread counts needs 6).",
)
def calibrate(protocol_path, thread_list, arms, train_size, val_size, epochs, steps):
    """Time every arm's training step and project the protocol's wall time on this machine."""
    try:
        protocol = load_protocol(protocol_path)
    except ProtocolError as err:
        raise click.ClickException(str(err)) from err
    first_seed = protocol.seeds[0]
    cells = {
        c.arm: c for c in protocol.cells() if c.seed == first_seed and (not arms or c.arm in arms)
    }
    n_train = train_size or protocol.dataset.train_size
    n_val = val_size or protocol.dataset.val_size
    n_epochs = epochs or protocol.run.epochs
    if not n_train or not n_val:
        raise click.UsageError(
            "the protocol leaves train_size/val_size open: pass --train-size and --val-size"
        )
    load = Load.begin()
    click.echo(
        f"{protocol.name}: {len(cells)} arms x {len(protocol.seeds)} seeds, {n_train} train / {n_val} val "
        f"images, {n_epochs} epochs, batch {protocol.run.batch_size}, amp {protocol.run.amp}"
    )
    click.echo("arm,threads,train_images_per_s,eval_images_per_s,cell_minutes,all_seeds_minutes")
    totals: dict[int, float] = {}
    steps_by_arm: dict[str, dict[str, list[float]]] = {}
    for threads in (int(t) for t in thread_list.split(",") if t.strip()):
        set_threads(threads)
        for arm, cell in cells.items():
            try:
                speed = measure_arm(arm, cell.train_config(device="cpu"), steps=steps)
            except AmpUnsupported as err:
                raise click.UsageError(str(err)) from err
            steps_by_arm.setdefault(arm, {})[f"{threads} thread(s)"] = list(
                speed.train_step_seconds
            )
            cell_s = project_seconds(speed, n_train, n_val, n_epochs)
            totals[threads] = totals.get(threads, 0.0) + cell_s * len(protocol.seeds)
            click.echo(
                f"{arm},{threads},{speed.train_images_per_s:.1f},{speed.eval_images_per_s:.1f},"
                f"{cell_s / 60:.2f},{cell_s * len(protocol.seeds) / 60:.1f}"
            )
    for threads, total in totals.items():
        click.echo(f"total with {threads} thread(s): {total / 60:.1f} minutes (steps only)")
    click.echo(load.finish().line)
    for arm, seconds in steps_by_arm.items():
        for line in decide(seconds, next(iter(seconds)), scope=arm).lines:
            click.echo(line)


if __name__ == "__main__":
    calibrate()
