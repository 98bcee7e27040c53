"""Entry point: what kernel caps cost per training step (`workbench benchmark kernel-caps`).

    workbench benchmark kernel-caps --protocol studies/protocols/cifar10_seed_table.yaml \\
        --arm base --caps avx2 --rounds 6 --steps 8

A cell taken over on a newer CPU stays bitwise only under caps (``worker --match-kernels``,
``reproduce --match-kernels``: ``workbench.kernel_caps``), and the caps act only when set before
torch starts. So each round runs two fresh processes, one with the caps in its environment and
one with none, one after the other (the order alternating from round to round, so drift in the
machine's load hits both alike); each times ``--steps`` training steps of the arm on random
inputs (``workbench.bench.cells.measure_arm``: the protocol's batch size, model and ``amp``,
``--threads`` threads) and reports the median step and the kernels it ran (ATen's capability and
oneDNN's ISA, read in that process). The verdict is the median of the rounds' time ratios
(capped / uncapped) with its sign interval (``workbench.bench.timing.decide``: 6 rounds for a 95 %
interval); the load before and after is printed, and everything is logged to MLflow
(experiment ``kernel-caps-benchmark``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import click

from studies.runtime.study_protocol import ProtocolError, load_protocol
from workbench.bench.timing import Load, decide
from workbench.kernel_caps import CAP_VARIABLES

# --caps names -> the three variables (what a record of such a CPU's kernels caps to)
NAMED_CAPS = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
}
EXPERIMENT = "kernel-caps-benchmark"


def child_measure(protocol_path: str, arm: str, steps: int, threads: int) -> dict:
    """In a fresh process: the arm's median training step and the kernels this process runs."""
    from workbench.bench.cells import measure_arm
    from workbench.kernel_identity import kernel_identity
    from workbench.precision import set_threads

    set_threads(threads)
    protocol = load_protocol(protocol_path)
    cell = next(c for c in protocol.cells() if c.arm == arm)
    speed = measure_arm(arm, cell.train_config(device="cpu"), steps=steps)
    identity = kernel_identity("cpu")
    return {
        "step_seconds": statistics.median(speed.train_step_seconds),
        "aten": identity["kernel.aten_capability"],
        "onednn": identity["kernel.onednn_isa"],
    }


def run_child(env: dict, protocol_path: str, arm: str, steps: int, threads: int) -> dict:
    args = [sys.executable, "-m", __name__, protocol_path, arm, str(steps), str(threads)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise click.ClickException(f"a timing process failed: {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@click.command("kernel-caps")
@click.option(
    "--protocol", "protocol_path", required=True, type=click.Path(exists=True, dir_okay=False)
)
@click.option("--arm", default=None, help="The arm to time (default: the reference arm).")
@click.option(
    "--caps",
    "caps_name",
    type=click.Choice(sorted(NAMED_CAPS)),
    default="avx2",
    show_default=True,
    help="The caps to time against none.",
)
@click.option("--rounds", type=click.IntRange(min=1), default=6, show_default=True)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Training steps timed per process.",
)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True)
def benchmark_kernel_caps(protocol_path, arm, caps_name, rounds, steps, threads):
    """Time an arm's training step with and without kernel caps, in alternating fresh processes."""
    try:
        protocol = load_protocol(protocol_path)
    except ProtocolError as err:
        raise click.ClickException(str(err)) from err
    arm = arm or protocol.reference.name
    if arm not in {a.name for a in protocol.arms}:
        raise click.BadParameter(
            f"{arm!r} is not an arm of {protocol.name}: {', '.join(a.name for a in protocol.arms)}",
            param_hint="'--arm'",
        )
    caps = NAMED_CAPS[caps_name]
    bare = {k: v for k, v in os.environ.items() if k not in CAP_VARIABLES}
    envs = {caps_name: bare | caps, "uncapped": bare}
    load = Load.begin()
    seconds: dict[str, list[float]] = {caps_name: [], "uncapped": []}
    kernels: dict[str, set[str]] = {caps_name: set(), "uncapped": set()}
    click.echo(
        f"{protocol.name} arm {arm}: {steps} training steps per process, {threads} thread(s), "
        f"batch {protocol.run.batch_size}, amp {protocol.run.amp}; {rounds} rounds"
    )
    for r in range(rounds):
        order = [caps_name, "uncapped"] if r % 2 == 0 else ["uncapped", caps_name]
        for name in order:
            got = run_child(envs[name], protocol_path, arm, steps, threads)
            seconds[name].append(got["step_seconds"])
            kernels[name].add(f"ATen {got['aten']}, oneDNN {got['onednn']}")
        click.echo(
            f"round {r + 1}: {caps_name} {seconds[caps_name][-1] * 1e3:.1f} ms/step, "
            f"uncapped {seconds['uncapped'][-1] * 1e3:.1f} ms/step"
        )
    for name, seen in kernels.items():
        click.echo(f"{name}: {'; '.join(sorted(seen))}")
    if kernels[caps_name] == kernels["uncapped"]:
        click.echo(f"note: the caps changed no kernel on this CPU: {caps_name} is its own level")
    finished = load.finish()
    decision = decide(seconds, "uncapped", scope=arm)
    for line in decision.lines[
        :-1
    ]:  # no `use:` line: caps are taken for bitwise takeovers, not speed
        click.echo(line)
    click.echo(finished.line)
    log_result(protocol, arm, caps_name, steps, threads, seconds, kernels, decision, finished)


def log_result(protocol, arm, caps_name, steps, threads, seconds, kernels, decision, load) -> None:
    from tracking.kinds.benchmark_runs import log_kernel_caps_benchmark

    params = {
        "protocol": protocol.name,
        "protocol_hash": protocol.hash,
        "arm": arm,
        "caps_name": caps_name,
        "caps": " ".join(f"{k}={v}" for k, v in NAMED_CAPS[caps_name].items()),
        "steps": steps,
        "threads": threads,
        "rounds": len(seconds["uncapped"]),
    }
    run_id = log_kernel_caps_benchmark(params, seconds, kernels, decision, load.as_dict())
    click.echo(f"logged to MLflow: experiment {EXPERIMENT}, run {run_id}")


if __name__ == "__main__":  # one timing process: protocol arm steps threads -> one JSON line
    path, arm_name, n_steps, n_threads = sys.argv[1:5]
    print(json.dumps(child_measure(path, arm_name, int(n_steps), int(n_threads))))
