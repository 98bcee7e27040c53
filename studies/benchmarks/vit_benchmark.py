"""Entry point: glass-box ViT vs timm speed, training step and loader, against the matmul peak.

    workbench benchmark                                  # ViT-Ti/S/B at 224 + study models, CPU
    workbench benchmark vit --quick                          # tiny configuration (seconds)
    workbench benchmark vit --model vit_base_patch16_224 --batch-size 1,32,64 --device cuda
    workbench benchmark vit --model cifar_vit --train-model "" --no-loader --threads 2   # fp32 vs bf16 step
    mlflow run . -e benchmark --env-manager local -P threads=1

Everything is measured in one run and logged to one MLflow run (experiment ``benchmark``):
metrics, ``benchmark/results.csv``, ``matmul.csv``, ``goals.csv``, ``summary.md``,
``benchmark.png``, ``machine.json``. The summary is also printed. Goals are reported,
never enforced: the command exits 0 whether they are met or not.
"""

from __future__ import annotations

from pathlib import Path

import click

from studies.runtime.options import FiniteFloat
from workbench.bench.suite import DEFAULT_MODELS

# --quick: a configuration that exercises every code path in seconds. It replaces the
# options left at their default values (by value, not by source: `mlflow run` passes every
# parameter explicitly), so `--quick --model vit_tiny_patch16_224` still works.
# fmt: skip
QUICK = {
    "models": "fmnist_vit,fmnist_cnn",
    "batch_sizes": "1,4",
    "study_batch_sizes": "1,8",
    "train_models": "fmnist_vit",
    "train_batch_sizes": "8",
    "precision_models": "fmnist_vit",
    "precision_batch_sizes": "8",
    "repeats": 2,
    "warmup": 1,
    "min_sample_ms": 1.0,
    "matmul_size": 256,
    "loader_images": 256,
    "loader_batch": 64,
    "loader_repeats": 1,
}


def _names(values: tuple[str, ...] | list[str] | str) -> tuple[str, ...]:
    """Names from repeated options and/or comma-separated lists (MLflow passes one string)."""
    values = (values,) if isinstance(values, str) else values
    return tuple(n.strip() for v in values for n in v.split(",") if n.strip())


def _same(value: object, default: object) -> bool:
    """Whether an option still has its default value (lists compared as names)."""
    if isinstance(default, (str, list, tuple)):
        return isinstance(value, (str, list, tuple)) and _names(value) == _names(default)
    return value == default


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in _names(text))
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: expected comma-separated integers", param_hint=option
        ) from None
    if not values or any(v < 1 for v in values):
        raise click.BadParameter(f"{text!r}: expected positive integers", param_hint=option)
    return values


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@click.command("vit")
@click.option(
    "--model",
    "models",
    multiple=True,
    default=[",".join(DEFAULT_MODELS)],
    show_default=True,
    help="Models for inference: timm ViT names and study models; repeat or comma-separate.",
)
@click.option(
    "--batch-size",
    "batch_sizes",
    default="1,32",
    show_default=True,
    help="Inference batches, 224 px models.",
)
@click.option(
    "--study-batch-size",
    "study_batch_sizes",
    default="1,32,256",
    show_default=True,
    help="Inference batches, small study models.",
)
@click.option(
    "--train-model",
    "train_models",
    default="fmnist_vit",
    show_default=True,
    help="Models whose training step is timed (comma-separated; empty for none).",
)
@click.option("--train-batch-size", "train_batch_sizes", default="128", show_default=True)
@click.option(
    "--precision-model",
    "precision_models",
    default="cifar_vit",
    show_default=True,
    help="Models whose training step is timed in fp32 and bf16 autocast side by side (empty for none; "
    "skipped where the device has no native bf16).",
)
@click.option("--precision-batch-size", "precision_batch_sizes", default="128", show_default=True)
@click.option(
    "--repeats",
    default=30,
    show_default=True,
    type=click.IntRange(min=1),
    help="Interleaved timed rounds (at most: see --max-seconds).",
)
@click.option(
    "--warmup",
    default=2,
    show_default=True,
    type=click.IntRange(min=0),
    help="Untimed calls per variant.",
)
@click.option(
    "--min-sample-ms",
    default=50.0,
    show_default=True,
    type=FiniteFloat(min=0.0),
    help="Shortest timed sample; faster calls are repeated within it.",
)
@click.option(
    "--max-seconds",
    default=60.0,
    show_default=True,
    type=FiniteFloat(min=0.0),
    help="Time budget of one comparison's timed rounds; at least 6 rounds run, the fewest a verdict needs (0: no budget).",
)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N or auto.")
@click.option(
    "--threads",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="torch intra-op threads (0: leave torch's default).",
)
@click.option(
    "--matmul-size",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Side of the square matmuls for the peak (0: 2048 on CPU, 8192 on GPU).",
)
@click.option(
    "--loader/--no-loader",
    default=True,
    show_default=True,
    help="Also run the data loader benchmark.",
)
@click.option("--loader-images", default=10_000, show_default=True, type=click.IntRange(min=1))
@click.option("--loader-batch", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--loader-repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--profile", is_flag=True, help="Also log torch.profiler tables of every variant at batch 1."
)
@click.option(
    "--quick", is_flag=True, help="Tiny configuration: study models, small batches, 2 repeats."
)
@click.option("--experiment", default="benchmark", show_default=True)
@click.option(
    "--output-dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Also write the CSVs, plot and summary here.",
)
@click.pass_context
def benchmark(ctx: click.Context, **opts) -> None:
    """Time glass-box and timm ViTs (and a training step and the loader) against the machine's limit."""
    from tracking.kinds.benchmark_runs import log_benchmark, write_benchmark_files
    from tracking.store.session import environment_tags, start_run
    from workbench.bench.run import run_benchmark
    from workbench.bench.suite import BenchConfig

    if opts["quick"]:
        defaults = {p.name: p.default for p in ctx.command.params}
        for key, value in QUICK.items():
            if _same(opts[key], defaults[key]):
                opts[key] = value
    device = _resolve_device(opts["device"])
    try:
        # fmt: skip
        cfg = BenchConfig(
            models=_names(opts["models"]),
            batch_sizes=_ints(opts["batch_sizes"], "--batch-size"),
            study_batch_sizes=_ints(opts["study_batch_sizes"], "--study-batch-size"),
            train_models=_names(opts["train_models"]),
            train_batch_sizes=_ints(opts["train_batch_sizes"], "--train-batch-size"),
            precision_models=_names(opts["precision_models"]),
            precision_batch_sizes=_ints(opts["precision_batch_sizes"], "--precision-batch-size"),
            repeats=opts["repeats"],
            warmup=opts["warmup"],
            min_sample_s=opts["min_sample_ms"] / 1e3,
            max_seconds=opts["max_seconds"] or None,
            device=device,
            seed=opts["seed"],
        )
    except ValueError as err:
        raise click.UsageError(str(err)) from err

    loader = None
    if opts["loader"]:
        from studies.benchmarks.data_benchmark import run_loader_benchmark

        def loader() -> dict:
            # Threads are already set for the whole run; the loader uses the same setting.
            return run_loader_benchmark(opts["loader_images"], opts["loader_batch"], opts["loader_repeats"],
                                        num_workers=0, device=device, seed=opts["seed"])  # fmt: skip

    result = run_benchmark(cfg, threads=opts["threads"] or None, matmul_n=opts["matmul_size"] or None,
                           loader=loader, progress=click.echo, profile=opts["profile"])  # fmt: skip
    # fmt: skip
    params = {
        "threads_requested": opts["threads"] or "default",
        "torch_threads": result.info["torch_threads"],
        "matmul_size": result.peaks[0].n if result.peaks else 0,
        "quick": opts["quick"],
        "profile": opts["profile"],
        "loader": opts["loader"],
        "loader_images": opts["loader_images"],
        "loader_batch": opts["loader_batch"],
        "loader_repeats": opts["loader_repeats"],
        "weights": "seeded random init (timing does not depend on values)",
        "reference": "timm fused_attn=True, measured in the same interleaved rounds",
    }
    # The thread count measured under, not torch's setting before or after the run.
    tags = {**environment_tags(device), "cpu_threads": result.info["torch_threads"]}
    with start_run(opts["experiment"], run_name=f"benchmark-{device}", tags=tags):
        log_benchmark(result, params)
    if opts["output_dir"]:
        write_benchmark_files(result, opts["output_dir"])
    click.echo("")
    click.echo(result.markdown)


if __name__ == "__main__":
    benchmark()
