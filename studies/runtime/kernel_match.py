"""A taken-over cell runs on the kernels its first execution ran (``workbench worker --match-kernels``).

A cell resumed on another machine continues bit for bit only on the same kernels (ATen's vector
code, oneDNN's ISA, MKL's path): a newer CPU of the same vendor picks wider ones unless capped,
and the caps act only when set before torch starts (``workbench.kernel_caps``). So a worker started
with ``--match-kernels`` compares, before it trains a cell that another execution began, that
execution's recorded kernel identity with its own (``check_takeover``):

- the same dispatch (ATen capability, oneDNN ISA, the caps in force, the CPU's instruction
  sets): it trains;
- another dispatch that caps can reach: ``KernelsToMatch``; the cell is handed back to the queue
  like a preempted one (its run released, its checkpoint in its run) and the worker starts
  itself again with the caps (``restart_with``), then takes the next waiting cell, this one first
  unless another worker took it meanwhile;
- another dispatch that caps cannot reach (say AVX512 recorded, no AVX512 here), or caps in
  force that did not give the recorded dispatch: ``KernelsCannotMatch``; the cell is handed back
  and the worker stops with one line saying why, so the cell goes to a machine that can.

Without ``--match-kernels`` a takeover trains on whatever kernels it has and the run is tagged
``kernel_changed`` (``tracking.kinds.training_runs.log_kernel_identity``).
"""

from __future__ import annotations

import os
import sys

from studies.runtime.stop_signals import Preempted
from workbench.kernel_caps import CAP_VARIABLES, KernelCapsError, caps_for
from workbench.kernel_identity import PREFIX

MATCH_ENV = "WORKBENCH_MATCH_KERNELS"  # set by `worker --match-kernels`, read where a cell opens
# Set in a process started again under caps, so that it is started again at most once per caps.
CAPS_APPLIED = "WORKBENCH_KERNEL_CAPS_APPLIED"
# What decides the kernels a CPU run dispatches to: equal fields, the same kernels.
DISPATCH_FIELDS = tuple(
    PREFIX + k
    for k in (
        "device",
        "aten_capability",
        "onednn_isa",
        "onednn_max_isa",
        "mkl_enable_instructions",
        "mkl_cbwr",
        "cpu_avx2",
        "cpu_avx512f",
        "cpu_avx512_bf16",
        "cpu_amx_bf16",
    )
)
# What tells two CPUs apart (older records lack family, model number and stepping).
CPU_FIELDS = tuple(
    PREFIX + k
    for k in (
        "cpu_vendor",
        "cpu_model",
        "cpu_family",
        "cpu_model_number",
        "cpu_stepping",
        "cpu_avx2",
        "cpu_avx512f",
        "cpu_avx512_bf16",
        "cpu_amx_bf16",
    )
)
# Fields that must be equal once the caps are in force (the CPU's own flags stay what they are).
CAPPED_FIELDS = tuple(PREFIX + k for k in ("aten_capability", "onednn_isa"))


class KernelsToMatch(Preempted):
    """The cell's first execution ran other kernels that caps reach: hand it back, start again under ``caps``."""

    def __init__(self, caps: dict[str, str], cell: str) -> None:
        self.caps, self.cell = caps, cell
        super().__init__(
            f"{cell} began on other kernels: this worker starts again under {described(caps)}"
        )


class KernelsCannotMatch(Preempted):
    """The cell's first execution ran kernels this machine cannot be capped to: hand it back, stop."""


def described(caps: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in caps.items()) or "no kernel caps"


def caps_in_force(environ=os.environ) -> dict[str, str]:
    return {k: environ[k] for k in CAP_VARIABLES if environ.get(k)}


def check_takeover(recorded: dict[str, str], here: dict[str, str], cell: str) -> None:
    """Raise ``KernelsToMatch`` or ``KernelsCannotMatch`` unless this process runs ``recorded``'s kernels.

    ``recorded`` is the first execution's identity (``kernel.*`` params), ``here`` this process's.
    A record without a kernel identity (a run older than it) is left alone: nothing to match.
    """
    if not recorded or recorded.get(PREFIX + "device", "cpu") != "cpu":
        return
    if all(recorded.get(k) == here.get(k) for k in DISPATCH_FIELDS if k in recorded):
        return
    wanted = {} if native_record_of_this_cpu(recorded, here) else None
    if wanted is None:
        try:
            wanted = caps_for(recorded, here)
        except KernelCapsError as err:
            raise KernelsCannotMatch(f"{cell}: --match-kernels: {err}") from None
    if caps_in_force() != wanted:
        raise KernelsToMatch(wanted, cell)
    off = [
        f"{k.removeprefix(PREFIX)} {here.get(k)} (recorded {recorded.get(k)})"
        for k in CAPPED_FIELDS
        if recorded.get(k) != here.get(k)
    ]
    if off:
        raise KernelsCannotMatch(
            f"{cell}: --match-kernels: under {described(wanted)} this machine runs {', '.join(off)}"
        )


def native_record_of_this_cpu(recorded: dict[str, str], here: dict[str, str]) -> bool:
    """The first execution ran uncapped on a CPU like this one: its kernels are this CPU's own, so
    the match is no caps at all (caps at this CPU's top level need not pick the same MKL path)."""
    uncapped = all(
        recorded.get(PREFIX + k, "unset") == "unset"
        for k in ("onednn_max_isa", "mkl_enable_instructions")
    )
    same_cpu = all(recorded.get(k) == here.get(k) for k in CPU_FIELDS if k in recorded)
    return uncapped and same_cpu


def restart_with(caps: dict[str, str], say) -> None:
    """Start this command again (same arguments) with exactly ``caps`` in the environment (the other
    cap variables removed; ``{}``: none); never returns.

    Refused (``RuntimeError``) when this process was already started so with the same caps: they did
    not take effect, and starting again would loop.
    """
    if os.environ.get(CAPS_APPLIED) == described(caps):
        raise RuntimeError(f"{described(caps)} did not take effect in this process")
    say(f"starting again under {described(caps)}")
    sys.stdout.flush()
    sys.stderr.flush()
    env = {k: v for k, v in os.environ.items() if k not in CAP_VARIABLES}
    env |= {**caps, CAPS_APPLIED: described(caps)}
    os.execve(sys.executable, [sys.executable, "-m", "studies.cli", *sys.argv[1:]], env)
