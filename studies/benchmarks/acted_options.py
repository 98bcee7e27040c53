"""What the benchmarks of the kinds that act on trained models (``attribute``, ``intervene``) share:
the options naming the protocol, the cells and the arm to time, and how the protocol and arm are read.

Both time one seeded random-weight model of the acted-on architecture per cell, so they choose
the cells and the arm the same way and say the same errors.
"""

from __future__ import annotations

from collections.abc import Callable

import click

from workbench.protocol.common import ProtocolError

CELLS_HELP = "Cells to time [default: the protocol's, e.g. 5 seeds of one arm]."
ARM_HELP = "The acted-on arm whose architecture is timed [default: the first]."


def acted_options(kind: str, count: str, least: int, count_help: str):
    """``--protocol`` (a ``kind`` protocol YAML file), ``--cells``, the images per cell (``count``,
    at least ``least``) and ``--arm``, in that order in the help."""
    options = [
        click.option(
            "--protocol",
            "protocol_path",
            required=True,
            type=click.Path(exists=True, dir_okay=False),
            help=f"{kind} protocol YAML file.",
        ),
        click.option("--cells", type=click.IntRange(min=1), default=None, help=CELLS_HELP),
        click.option(count, type=click.IntRange(min=least), default=None, help=count_help),
        click.option("--arm", default=None, help=ARM_HELP),
    ]

    def decorate(command):
        for option in reversed(options):  # click lists the last applied first
            command = option(command)
        return command

    return decorate


def load_or_fail(load: Callable[[str], object], protocol_path: str):
    """The protocol ``load`` reads, its error said as the command's error."""
    try:
        return load(protocol_path)
    except ProtocolError as err:
        raise click.ClickException(str(err)) from err


def chosen_arm(protocol, arm: str | None) -> str:
    """``--arm``, or the protocol's first acted-on arm; an arm it does not act on is refused."""
    arm = arm or protocol.arms[0]
    if arm not in protocol.arms:
        raise click.BadParameter(
            f"{arm!r}: the protocol acts on {', '.join(protocol.arms)}", param_hint="'--arm'"
        )
    return arm


def cells_of(protocol, arm: str, cells: int | None) -> int:
    """``--cells``, or as many as the protocol has of ``arm`` (one per seed)."""
    return cells or len([c for c in protocol.cells() if c.arm == arm])
