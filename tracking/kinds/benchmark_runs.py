"""Logging of a benchmark result to MLflow: metrics, CSVs, the plot (``workbench.analysis.benchmark_figures``)
and the Markdown summary."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import mlflow

from tracking.record.schema import ARM, CELL, FINISHED, SEED, TRUE, all_of, status_is, tag_is
from workbench.analysis.benchmark_figures import plot_benchmark
from workbench.bench.run import BenchmarkResult
from workbench.bench.timing import Decision

ARTIFACT_DIR = "benchmark"
FILES = ("results.csv", "matmul.csv", "goals.csv", "summary.md", "benchmark.png", "machine.json")
# fmt: skip
_ROW_METRICS = {
    "median_s": "ms_median",
    "q1_s": "ms_q1",
    "q3_s": "ms_q3",
    "images_per_s": "images_per_s",
    "achieved_gflops": "achieved_gflops",
    "fraction_of_fp32_peak": "fraction_of_fp32_peak",
    "probe_gflops": "matmul_probe_gflops",
    "ratio_to_timm_fused": "ratio_to_timm_fused",
    "ratio_to_timm_fused_q1": "ratio_to_timm_fused_q1",
    "ratio_to_timm_fused_q3": "ratio_to_timm_fused_q3",
    "ratio_to_timm_fused_best": "ratio_to_timm_fused_best",
    "ratio_to_timm_unfused": "ratio_to_timm_unfused",
    "ratio_to_timm_unfused_best": "ratio_to_timm_unfused_best",
    "fraction_of_own_peak": "fraction_of_own_peak",
    "own_probe_gflops": "own_matmul_probe_gflops",
    "speedup_vs_fp32": "speedup_vs_fp32",
    "speedup_vs_fp32_q1": "speedup_vs_fp32_q1",
    "speedup_vs_fp32_q3": "speedup_vs_fp32_q3",
    "speedup_vs_fp32_best": "speedup_vs_fp32_best",
}


def log_verdicts(decisions: list[Decision], load: dict[str, float]) -> None:
    """Every comparison's verdict (metrics ``verdict/...``, tags ``verdict.*`` and ``use.*``) and the
    machine's load before and after (``load/start``, ``load/end``) in the active run."""
    metrics = {f"load/{k.removeprefix('load_')}": v for k, v in load.items() if math.isfinite(v)}
    tags: dict[str, str] = {}
    for d in decisions:
        metrics |= d.metrics()
        tags |= d.tags()
    items = sorted(metrics.items())
    for i in range(0, len(items), 500):  # MLflow caps a batch at 1000 metrics
        mlflow.log_metrics(dict(items[i : i + 500]))
    if tags:
        mlflow.set_tags(tags)


def _float(text: str | None) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def benchmark_metrics(result: BenchmarkResult) -> dict[str, float]:
    """Flat metric dict: ``{section}/{model}/b{batch}/{variant}/{what}``, ``matmul/...``,
    ``loader/...``, ``goal/...``. Times are logged in milliseconds; NaNs are left out."""
    metrics: dict[str, float] = {}
    for p in result.peaks:
        metrics |= {f"matmul/{p.dtype}/tflops_median": p.tflops.median, f"matmul/{p.dtype}/tflops_q1": p.tflops.q1,
                    f"matmul/{p.dtype}/tflops_q3": p.tflops.q3}  # fmt: skip
    for row in result.timings().to_dict("records"):
        prefix = f"{row['section']}/{row['model']}/b{row['batch']}/{row['variant']}"
        for column, name in _ROW_METRICS.items():
            value = row.get(column)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            metrics[f"{prefix}/{name}"] = float(value) * (1e3 if name.startswith("ms_") else 1.0)
    if result.loader is not None:
        for key in ("ours_images_per_s", "torchvision_images_per_s", "ratio"):
            metrics[f"loader/{key}"] = float(result.loader[key])
    for goal in result.goals:
        metrics[f"goal/{goal.key}/measured"] = goal.measured
        metrics[f"goal/{goal.key}/met"] = float(goal.met)
        if math.isfinite(goal.best):
            metrics[f"goal/{goal.key}/best"] = goal.best
    metrics["goals_total"] = float(len(result.goals))
    metrics["goals_met"] = float(sum(g.met for g in result.goals))
    return metrics


def write_benchmark_files(result: BenchmarkResult, out: Path) -> list[Path]:
    """Write the CSVs, plot, Markdown summary and machine description into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    result.timings().to_csv(out / "results.csv", index=False)
    rows = [{"dtype": p.dtype, "n": p.n, "repeats": p.repeats, "tflops_median": p.tflops.median,
             "tflops_q1": p.tflops.q1, "tflops_q3": p.tflops.q3, "tflops_min": p.tflops.min,
             "tflops_max": p.tflops.max} for p in result.peaks]  # fmt: skip
    import pandas as pd

    pd.DataFrame(rows).to_csv(out / "matmul.csv", index=False)
    result.goals_table().to_csv(out / "goals.csv", index=False)
    (out / "summary.md").write_text(result.markdown)
    (out / "machine.json").write_text(json.dumps({"machine": result.info, "config": result.config.to_dict(),
                                                  "loader": result.loader}, indent=1, default=str))  # fmt: skip
    plot_benchmark(result).savefig(out / "benchmark.png", dpi=110)
    written = [out / name for name in FILES]
    if result.profiles:
        (out / "profiles").mkdir(exist_ok=True)
        for p in result.profiles:
            path = out / "profiles" / f"{p.model}_{p.variant}_b{p.batch}.txt"
            header = (
                f"{p.model} {p.variant} batch {p.batch}: {p.aten_calls:.0f} ATen calls per forward"
            )
            path.write_text(f"{header}\n\n{p.table}\n")
            written.append(path)
    return written


def log_benchmark(result: BenchmarkResult, params: dict) -> None:
    """Params, machine tags, metrics, and the files under ``benchmark/`` in the active run.

    Params are the effective settings, prefixed ``bench.``: under ``mlflow run`` the entry
    point's own parameters are already logged under their plain names, with the values as
    given (``--quick`` replaces some of them, and MLflow refuses to change a logged param).
    """
    mlflow.log_params({f"bench.{k}": v for k, v in {**result.config.to_dict(), **params}.items()})
    mlflow.set_tags({f"machine.{k}": v for k, v in result.info.items()})
    items = sorted(benchmark_metrics(result).items())
    for i in range(0, len(items), 500):  # MLflow caps a batch at 1000 metrics
        mlflow.log_metrics(dict(items[i : i + 500]))
    with tempfile.TemporaryDirectory() as tmp:
        write_benchmark_files(result, Path(tmp))
        mlflow.log_artifacts(tmp, artifact_path=ARTIFACT_DIR)
    load = {
        "load_start": _float(result.info.get("load_average_1m")),
        "load_end": _float(result.info.get("load_average_1m_end")),
        "cores": _float(result.info.get("cpu_count")),
    }
    log_verdicts(result.decisions(), load)
    if result.loader is not None and "use" in result.loader:
        mlflow.set_tag("use.loader", result.loader["use"].removeprefix("use: "))
    met, total = sum(g.met for g in result.goals), len(result.goals)
    mlflow.set_tags(
        {
            "goals": f"{met} of {total} met",
            "verdict": "goals met" if met == total else "goals missed",
        }
    )


def finished_cell_results(store: str, experiment: str) -> dict[str, float]:
    """``arm/seed`` -> best validation accuracy of every finished cell run of ``experiment`` in ``store``."""
    client = mlflow.MlflowClient(store)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    runs = client.search_runs([exp.experiment_id], all_of(tag_is(CELL, TRUE), status_is(FINISHED)))
    return {
        f"{r.data.tags[ARM]}/{r.data.tags[SEED]}": r.data.metrics.get("best_val_accuracy")
        for r in sorted(runs, key=lambda r: (r.data.tags[ARM], r.data.tags[SEED]))
    }


def log_jobs_benchmark(
    per_layout, folder: Path, params: dict, decision: Decision, load: dict[str, float]
) -> str:
    """One run in experiment ``jobs-benchmark``: settings, cells per hour and ratio per layout,
    the verdicts and load, the files."""
    mlflow.set_experiment("jobs-benchmark")
    with mlflow.start_run(run_name=f"{params['protocol']} {params['layouts']}") as run:
        mlflow.log_params({f"bench.{k}": v for k, v in params.items()})
        log_verdicts([decision], load)
        for r in per_layout.to_dict("records"):
            mlflow.log_metrics(
                {
                    f"{r['layout']}.cells_per_hour": r["cells_per_hour"],
                    f"{r['layout']}.ratio": r["ratio"],
                    f"{r['layout']}.wall_s": r["wall_s"],
                }
            )
        for name in ("results.csv", "summary.md"):
            mlflow.log_artifact(str(folder / name), artifact_path=ARTIFACT_DIR)
        return run.info.run_id


def log_train_benchmark(
    table,
    folder: Path,
    params: dict,
    machine: dict,
    experiment: str = "train-benchmark",
    decisions: list[Decision] = (),
    load: dict[str, float] | None = None,
) -> str:
    """One run: settings, the CPU as tags, images/s and ratios per arm and variant, the
    verdicts per arm and the load, the files."""
    from tracking.store.session import environment_tags, start_run

    tags = environment_tags("cpu")
    with start_run(experiment, run_name=f"train-benchmark {params['arms']}", tags=tags) as run:
        mlflow.log_params({f"bench.{k}": v for k, v in params.items()})
        mlflow.set_tags({f"machine.{k}": v for k, v in machine.items()})
        metrics = {}
        for r in table.to_dict("records"):
            prefix = f"{r['arm']}/{r['variant']}"
            for key in ("images_per_s_min", "images_per_s_median", "images_per_s_max", "warmup_s",
                        "x_today", "x_plain_timm"):  # fmt: skip
                value = r.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    metrics[f"{prefix}/{key}"] = float(value)
        mlflow.log_metrics(metrics)
        log_verdicts(list(decisions), load or {})
        for name in ("results.csv", "summary.md"):
            mlflow.log_artifact(str(folder / name), artifact_path=ARTIFACT_DIR)
        return run.info.run_id


def log_kernel_caps_benchmark(
    params: dict,
    seconds: dict[str, list[float]],
    kernels: dict[str, set[str]],
    decision: Decision,
    load: dict[str, float],
) -> str:
    """One run in experiment ``kernel-caps-benchmark``: settings, each process's median step per
    option (metric steps: the rounds), the kernels each option ran (tags), the verdict and load."""
    from tracking.store.session import start_run

    name = f"{params['protocol']}/{params['arm']} {params['caps_name']} vs uncapped"
    with start_run("kernel-caps-benchmark", run_name=name) as run:
        mlflow.log_params({f"bench.{k}": v for k, v in params.items()})
        log_verdicts([decision], load)
        for option, values in seconds.items():
            for i, value in enumerate(values):
                mlflow.log_metric(f"step_seconds/{option}", value, step=i)
        mlflow.set_tags({f"kernels.{k}": "; ".join(sorted(v)) for k, v in kernels.items()})
        return run.info.run_id


def log_stacked_seeds_benchmark(
    params: dict,
    seconds: dict[str, list[float]],
    images: int,
    decision: Decision,
    load: dict[str, float],
) -> str:
    """One run in experiment ``stacked-seeds-benchmark``: settings, each option's images/s per
    round (metric steps: the rounds), the verdict, the ``use:`` line and the load."""
    from tracking.store.session import start_run

    name = f"{params['protocol']}/{params['arm']} {params['seeds']} seeds stacked vs one by one"
    with start_run("stacked-seeds-benchmark", run_name=name) as run:
        mlflow.log_params({f"bench.{k}": v for k, v in params.items()})
        log_verdicts([decision], load)
        for option, values in seconds.items():
            for i, value in enumerate(values):
                mlflow.log_metric(f"images_per_second/{option}", images / value, step=i)
        return run.info.run_id
