"""Options shared by the training entry points (train, ablate, worker, sweep, transfer, intervene, attribute), and their checks.

``study_options`` is the one stack of options every study command takes (``ablate``, ``transfer``,
``intervene``); the command receives them as one ``StudyOptions``, which travels on as it is.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import click

from studies.runtime.preflight import check_writable_folder
from workbench.precision import AmpUnsupported, resolve_amp, set_threads


class FiniteFloat(click.FloatRange):
    """A float option that refuses ``inf`` and ``nan`` (click's FLOAT and FloatRange accept both).

    ``--lr inf`` passed every range check and failed at the first training step; ``nan``
    compares false with any bound, so a range never catches it.
    """

    name = "float"

    def _describe_range(self) -> str:
        # No bounds: nothing to show (click would print "x<=None"); with bounds, click's own text.
        return super()._describe_range() if self.min is not None or self.max is not None else ""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if isinstance(number, float) and not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number (inf and nan are refused)", param, ctx)
        return number


FINITE = FiniteFloat()


def _apply_threads(ctx: click.Context, param: click.Parameter, value: int) -> int:
    # Set at parse time, before any data or model is touched: every entry point that takes
    # the option trains under it, and train_one records the count in effect on each run.
    # The command also receives the value (and ignores it): it is applied here already.
    set_threads(value)
    return value


threads_option = click.option(
    "--threads",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    callback=_apply_threads,
    help="torch intra-op threads (0: torch's default, one per core; on a shared machine set it to the free cores).",
)


@dataclass(frozen=True)
class StudyOptions:
    """What every execution of a study passes on to its cells, built once from the command line."""

    # checkpoints, predictions, downloaded sources (each command's own default)
    output_dir: Path = Path("outputs")
    device: str = "auto"
    data_path: str | None = None  # where this machine keeps the dataset, if not in the usual places
    # a protocol file with uncommitted changes may run (recorded on the runs)
    allow_dirty: bool = False
    download: bool = False  # a dataset download is allowed
    threads: int = 0  # the --threads asked for (0: none); applied when the option was parsed


STUDY_OPTION_NAMES = ("allow_dirty", "device", "data_path", "download", "output_dir", "threads")


def study_options(output_dir: str, output_help: str):
    """The options of a study command (``--allow-dirty``, ``--device``, ``--data-path``, ``--download``,
    ``--output-dir`` with this command's default and help, ``--threads``), given to it as ``options``;
    ``--output-dir`` is checked writable before the command starts (``check_writable_folder``)."""

    def decorate(command):
        @functools.wraps(command)
        def with_options(*args, **kwargs):
            values = {name: kwargs.pop(name) for name in STUDY_OPTION_NAMES}
            values["output_dir"] = Path(values["output_dir"])
            # a read-only folder would otherwise fail every cell at its first write, after the runs opened
            check_writable_folder(values["output_dir"], create=False)
            return command(*args, options=StudyOptions(**values), **kwargs)

        stack = [
            click.option(
                "--allow-dirty",
                is_flag=True,
                help="Run a protocol file with uncommitted changes (recorded on the runs).",
            ),
            click.option("--device", default="auto", show_default=True),
            click.option(
                "--data-path",
                default=None,
                help="Where this machine keeps the dataset, if not in the usual places.",
            ),
            click.option("--download/--no-download", default=False, show_default=True),
            click.option(
                "--output-dir",
                type=click.Path(file_okay=False),
                default=output_dir,
                show_default=True,
                help=output_help,
            ),
            threads_option,
        ]
        for option in reversed(stack):  # listed in --help in this order
            with_options = option(with_options)
        return with_options

    return decorate


def check_amp(amp: str, device: str) -> None:
    """Refuse an autocast precision the device cannot run, as a usage error, before any data is loaded."""
    from workbench.train.loop import resolve_device

    try:
        resolve_amp(amp, resolve_device(device))
    except AmpUnsupported as err:
        raise click.UsageError(str(err)) from err


def check_protocol_amp(protocol, device: str) -> None:
    """``check_amp`` for every arm of a protocol (an arm may override ``run.amp``)."""
    for amp in dict.fromkeys(cell.train_config(device=device).run.amp for cell in protocol.cells()):
        check_amp(amp, device)


def check_storage_option(storage: str) -> None:
    """The Optuna storage guard (``tracking.store.storage_guard``) as a ``--storage`` usage error (exit 2),
    before any MLflow run exists."""
    from tracking.store.storage_guard import check_optuna_storage

    try:
        check_optuna_storage(storage)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--storage") from err
