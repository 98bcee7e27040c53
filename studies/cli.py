"""The `workbench` command. Each subcommand mirrors an MLproject entry point."""

from __future__ import annotations

import click

from studies.ablate import ablate
from studies.benchmark import benchmark
from studies.data_benchmark import benchmark_loader
from studies.equivalence import equivalence
from studies.figures import figures
from studies.recipe_benchmark import benchmark_recipe
from studies.report import report
from studies.server import server
from studies.sweep import sweep
from studies.sync import sync
from studies.train import train
from studies.transfer import transfer
from studies.worker import worker
from workbench.convert.checkpoints import CheckpointError


@click.group()
def main() -> None:
    """Glass-Box ViT Workbench."""


@main.command("pin")
@click.argument("name")
def pin(name: str) -> None:
    """Resolve a lock-file checkpoint's hub revision, size and sha256 and record them (needs internet)."""
    from workbench.convert.checkpoints import pin_checkpoint

    try:
        entry = pin_checkpoint(name)
    except CheckpointError as err:
        raise click.ClickException(str(err)) from err
    click.echo(f"pinned {entry.name}: {entry.hub_repo}@{entry.revision} {entry.filename} {entry.size_bytes} bytes sha256 {entry.sha256}")


main.add_command(ablate)
main.add_command(benchmark)
main.add_command(benchmark_loader)
main.add_command(benchmark_recipe)
main.add_command(equivalence)
main.add_command(figures)
main.add_command(report)
main.add_command(server)
main.add_command(sweep)
main.add_command(sync)
main.add_command(train)
main.add_command(transfer)
main.add_command(worker)


if __name__ == "__main__":
    main()
