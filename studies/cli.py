"""The `workbench` command. Each subcommand mirrors an MLproject entry point.

Subcommands are imported only when they run (click's LazyGroup pattern), so
`workbench --help` and `workbench sync --help` never import torch. Errors from any
subcommand reach one handler here, which prints them as one line; `workbench --debug CMD`
(or WORKBENCH_DEBUG=1) shows the traceback instead.
"""

from __future__ import annotations

import copy
import errno
import functools
import importlib
import logging
import os
import sys
import traceback

import click

from workbench.kinds import PROTOCOL_KINDS

# name -> (module, attribute, short help shown by `workbench --help` without importing it): the
# commands that run a protocol come from the table of kinds, the others are listed here.
# tests/test_cli.py checks every short help against the command's own docstring.
TOOL_COMMANDS: dict[str, tuple[str, str, str]] = {
    "equivalence": (
        "studies.tools.equivalence_check",
        "equivalence",
        "Compare glass-box and timm ViTs at every stage; exit 1 if any stage exceeds the tolerance.",
    ),
    "figures": (
        "studies.tools.figures",
        "figures",
        "Analysis figures: a finished protocol's study figures, or a timm ViT's attention on images.",
    ),
    "models": (
        "studies.tools.models_cli",
        "models",
        "Model names for arms and `train --model`: the study models, and any timm model as timm/<name>.",
    ),
    "protocol": (
        "studies.tools.protocol_cli",
        "protocol",
        "Protocol files: the key reference of every kind, generated from the schema.",
    ),
    "report": (
        "studies.tools.report",
        "report",
        "Build reports/<protocol>/report.md and report.html from the protocol's finished MLflow runs.",
    ),
    "reproduce": (
        "studies.tools.reproduce",
        "reproduce",
        "Re-train chosen cells of a published study and judge them against its evidence: bitwise, numerical, conclusion.",
    ),
    "server": (
        "studies.tools.server",
        "server",
        "Run and administer the shared MLflow tracking server (PostgreSQL, proxied artifacts, basic-auth).",
    ),
    "status": (
        "studies.ablation.status",
        "status",
        "Each cell's state (finished, running on host/pid, stale, failed, missing) and the next `ablate`'s plan.",
    ),
    "sweep": (
        "studies.ablation.sweep",
        "sweep",
        "Tune fields of one protocol arm with TPE and median pruning; every trial is an MLflow run.",
    ),
    "sync": (
        "studies.tools.sync",
        "sync",
        "Copy offline runs to the server: params, metric histories, tags, artifacts, models, parents; exactly once.",
    ),
    "train": (
        "studies.ablation.train",
        "train",
        "Train one model; re-running the same command resumes or skips it.",
    ),
    "worker": (
        "studies.ablation.worker",
        "worker",
        "Pop queued protocol cells and train them until the queue is empty.",
    ),
}
# Every command, by name, sorted as `workbench --help` lists them.
LAZY_COMMANDS: dict[str, tuple[str, str, str]] = dict(
    sorted(
        {
            **TOOL_COMMANDS,
            **{k.command: (*k.runner.split(":"), k.help) for k in PROTOCOL_KINDS},
        }.items()
    )
)

# `workbench benchmark <name>`: the speed commands, loaded as lazily as the top level's.
BENCHMARKS: dict[str, tuple[str, str, str]] = {
    "attribute": (
        "studies.benchmarks.attribute_benchmark",
        "benchmark_attribute",
        "Time an attribution protocol's scoring on random-weight models of its architecture (no data, no MLflow store).",
    ),
    "calibrate": (
        "studies.benchmarks.calibrate",
        "calibrate",
        "Time every arm's training step and project the protocol's wall time on this machine.",
    ),
    "intervene": (
        "studies.benchmarks.intervene_benchmark",
        "benchmark_intervene",
        "Time an intervention protocol's grid on random-weight models of its architecture (no data, no MLflow store).",
    ),
    "stacked-seeds": (
        "studies.benchmarks.stacked_seeds_benchmark",
        "benchmark_stacked_seeds",
        "Time an arm's seeds trained stacked in one step against one after another, on the CPU.",
    ),
    "kernel-caps": (
        "studies.benchmarks.kernel_caps_benchmark",
        "benchmark_kernel_caps",
        "Time an arm's training step with and without kernel caps, in alternating fresh processes.",
    ),
    "jobs": (
        "studies.benchmarks.jobs_benchmark",
        "benchmark_jobs",
        "Cells per hour of `ablate --jobs` layouts (two single-thread jobs against one two-thread job).",
    ),
    "loader": (
        "studies.benchmarks.data_benchmark",
        "benchmark_loader",
        "Compare TensorLoader with a per-image torchvision pipeline and print a table.",
    ),
    "recipe": (
        "studies.benchmarks.recipe_benchmark",
        "benchmark_recipe",
        "Time a protocol's cells: the workbench's training against a plain PyTorch loop of the same recipe.",
    ),
    "train": (
        "studies.benchmarks.train_benchmark",
        "benchmark_train",
        "Training images/s of today's path, each fast-path option, all of them, and plain timm loops.",
    ),
    "vit": (
        "studies.benchmarks.vit_benchmark",
        "benchmark",
        "Time glass-box and timm ViTs (and a training step and the loader) against the machine's limit.",
    ),
}
# The top-level names the benchmarks had before they were one group: hidden, kept for one release.
OLD_BENCHMARK_NAMES = {
    "benchmark-loader": "loader",
    "benchmark-jobs": "jobs",
    "benchmark-recipe": "recipe",
    "benchmark-intervene": "intervene",
    "benchmark-attribute": "attribute",
    "benchmark-train": "train",
}

# Error types whose message is written for the user: shown as is. Anything else is shown
# with its type name and a pointer to --debug, since it is more likely a bug than bad input.
_USER_ERRORS = (ValueError, LookupError, OSError, ArithmeticError)
_OUR_PACKAGES = ("workbench", "tracking", "studies", "reports")
# Libraries whose own errors are written for users (matched by name: importing them here would slow --help)
_USER_ERROR_NAMES = {"MlflowException", "OptunaError", "SafetensorError", "YAMLError"}


def one_line(err: BaseException) -> str:
    """The exception's message as one line (KeyError's quotes removed, CUDA errors explained, secrets masked)."""
    # MLflow's messages quote the tracking URL as given, password and all
    from tracking.store.redact import (
        redact_text,
    )

    if isinstance(err, KeyError) and type(err).__str__ is KeyError.__str__ and len(err.args) == 1:
        text = str(err.args[0])
    else:
        text = str(err)
    text = (
        " ".join(line.strip() for line in redact_text(text).splitlines() if line.strip())
        or type(err).__name__
    )
    # a store that is read-only, full or not a database
    from tracking.store.store_errors import (
        explain,
    )

    store_problem = explain(err)
    if store_problem:
        return store_problem
    if isinstance(err, OSError) and err.errno == errno.ENOSPC and err.filename:
        return f"no space left on device writing {err.filename}"
    if "CUDA" in text and any(
        s in text for s in ("not compiled", "not available", "no NVIDIA driver", "No CUDA GPUs")
    ):
        return f"CUDA is not available on this machine ({text}); use --device cpu or --device auto"
    ours = type(err).__module__.split(".")[0] in _OUR_PACKAGES
    named = any(cls.__name__ in _USER_ERROR_NAMES for cls in type(err).__mro__)
    if ours or named or isinstance(err, _USER_ERRORS):
        return text
    return f"{type(err).__name__}: {text} (`workbench --debug ...` shows the traceback)"


def check_device(value: str | None) -> None:
    """Refuse an explicit accelerator this machine does not have, before any work starts."""
    if not value or value in ("auto", "cpu"):
        return
    import torch

    try:
        device = torch.device(value)
    except RuntimeError:
        raise click.BadParameter(
            f"{value!r}: not a device (use cpu, cuda, cuda:N, mps or auto)", param_hint="'--device'"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = (
                "a CPU-only torch build"
                if torch.version.cuda is None
                else "no usable GPU or driver"
            )
            raise click.BadParameter(
                f"{value!r}: CUDA is not available on this machine ({build}); use cpu or auto",
                param_hint="'--device'",
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise click.BadParameter(
                f"{value!r}: this machine has {torch.cuda.device_count()} CUDA device(s)",
                param_hint="'--device'",
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise click.BadParameter(
            f"{value!r}: MPS is not available on this machine; use cpu or auto",
            param_hint="'--device'",
        )


def _with_device_check(cmd: click.Command) -> click.Command:
    """A copy of ``cmd`` whose callback first checks its --device value (the original stays as it was)."""
    if cmd.callback is None or not any(p.name == "device" for p in cmd.params):
        return cmd
    original = cmd.callback

    @functools.wraps(original)
    def callback(*args, **kwargs):
        check_device(kwargs.get("device"))
        return original(*args, **kwargs)

    checked = copy.copy(cmd)
    checked.callback = callback
    return checked


class LazyGroup(click.Group):
    """click's documented lazy-loading group, with short help declared up front.

    ``lazy_commands``: name -> (module, attribute, short help), imported only when the command runs
    (``LAZY_COMMANDS`` for ``workbench``, ``BENCHMARKS`` for ``workbench benchmark``).
    """

    def __init__(self, *args, lazy_commands: dict[str, tuple[str, str, str]] | None = None, **kw):
        super().__init__(*args, **kw)
        self.lazy_commands = LAZY_COMMANDS if lazy_commands is None else lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy_commands])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if self.lazy_commands is LAZY_COMMANDS and name in OLD_BENCHMARK_NAMES:
            new = OLD_BENCHMARK_NAMES[name]
            click.echo(
                f"note: `workbench {name}` is now `workbench benchmark {new}`; "
                "the old name goes in the next release",
                err=True,
            )
            return benchmark.get_command(ctx, new)
        if name not in self.lazy_commands:
            return super().get_command(ctx, name)
        module, attr, _ = self.lazy_commands[name]
        return _with_device_check(getattr(importlib.import_module(module), attr))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            if name in self.lazy_commands:
                rows.append((name, self.lazy_commands[name][2]))
            else:
                rows.append((name, self.commands[name].get_short_help_str(limit=200)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.exceptions.ClickException as err:
            if ctx.params.get("debug"):  # where it was raised, and the error it was raised from
                traceback.print_exception(err)
            else:  # a command's own multi-line message, as one line too
                err.message = " ".join(
                    line.strip() for line in err.message.splitlines() if line.strip()
                )
            raise
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except (
            BrokenPipeError
        ):  # `workbench models --timm '*' | head`: the reader has gone, say nothing
            # Python's own advice: point stdout at devnull so the interpreter's final flush does
            # not raise again, and exit as a program killed by SIGPIPE conventionally does.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(141)
        except Exception as err:  # every command's errors: one line unless --debug
            if ctx.params.get("debug"):
                raise
            raise click.ClickException(one_line(err)) from err


@click.group(cls=LazyGroup)
@click.option(
    "--debug",
    is_flag=True,
    envvar="WORKBENCH_DEBUG",
    help="Show the full traceback of an error (also: WORKBENCH_DEBUG=1).",
)
def main(debug: bool) -> None:
    """Glass-Box ViT Workbench."""
    if not debug:
        # MLflow logs every database error with its traceback before raising it again; the
        # error itself reaches the one handler above and is printed as one line.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


class BenchmarkGroup(LazyGroup):
    """``workbench benchmark <name>``; ``workbench benchmark --option ...`` (the ViT benchmark's form
    before the group) still runs ``vit``, with a note, for one release."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0].startswith("-") and args[0] not in ("--help", "-h"):
            click.echo(
                "note: `workbench benchmark [OPTIONS]` is now `workbench benchmark vit [OPTIONS]`; "
                "the old form goes in the next release",
                err=True,
            )
            args = ["vit", *args]
        return super().parse_args(ctx, args)


@main.group("benchmark", cls=BenchmarkGroup, lazy_commands=BENCHMARKS)
def benchmark() -> None:
    """Time the workbench on this machine: `workbench benchmark <name>` (vit, loader, recipe, jobs, ...)."""


@main.command("pin")
@click.argument("name")
def pin(name: str) -> None:
    """Resolve a lock-file checkpoint's hub revision, size and sha256 and record them (needs internet)."""
    from workbench.convert.checkpoints import pin_checkpoint

    entry = pin_checkpoint(name)
    click.echo(
        f"pinned {entry.name}: {entry.hub_repo}@{entry.revision} {entry.filename} {entry.size_bytes} bytes sha256 {entry.sha256}"
    )


if __name__ == "__main__":
    main()
