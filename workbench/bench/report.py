"""Speed goals checked against measured figures, and the Markdown summary.

Goals (time ratios, so below 1 is faster; each ratio is the median of per-round ratios):

- glass-box fast path / timm fused <= 1.05 at batch 1 and 32;
- glass-box hand-written path / timm unfused <= 1.10 at batch 1 and 32;
- training step of each study ViT <= 1.05 of the equivalent timm model, like for like
  (hand-written / unfused and fast / fused);
- data loader images/s >= 10x the training step's images/s (the study ViT as the
  training loop runs it: hand-written attention);
- on a device with native bf16: the ``cifar_vit`` training step at batch 128 under bf16
  autocast at least 1.8x as fast as in fp32 (speedup = fp32 time / bf16 time, median of
  per-round ratios, so here higher is better).

A goal is met when the median ratio is within the target. A miss is labelled "no (within
noise)" when at least a quarter of the rounds met the target (its first quartile does):
on a shared machine that is not evidence of a real difference; "best / best" (the ratio
of the two fastest samples) is shown beside it for the same reason.

The goals are stated for CPU; on another device they are evaluated the same way and
labelled with the device. They are measured and reported, never asserted in tests.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import pandas as pd

from workbench.text import markdown
from workbench.bench.machine import MatmulPeak
from workbench.bench.profiling import Profile
from workbench.bench.suite import select
from workbench.bench.timing import Decision

GOAL_BATCHES = (1, 32)
INFERENCE_GOALS = (("glass_fast", "timm_fused", 1.05), ("glass_written", "timm_unfused", 1.10))
TRAIN_GOALS = (("glass_written", "timm_unfused", 1.05), ("glass_fast", "timm_fused", 1.05))
LOADER_GOAL = 10.0
PRECISION_GOALS = (("cifar_vit", 128, 1.8),)  # (model, batch, bf16 speedup over fp32 at least)


@dataclass(frozen=True)
class Goal:
    """One goal with its measured value.

    Attributes:
        key: Metric-safe identifier, e.g. ``inference/vit_base_patch16_224/b1/glass_fast_vs_timm_fused``.
        description: What is compared, in words.
        measured: The measured ratio (median of per-round ratios for timings).
        op: "<=" or ">=".
        target: The goal.
        q1: First quartile of the per-round ratios (NaN when not a timing ratio).
        q3: Third quartile of the per-round ratios.
        best: Ratio of the two sides' fastest samples (see ``workbench.bench.suite``).
    """

    key: str
    description: str
    measured: float
    op: str
    target: float
    q1: float = math.nan
    q3: float = math.nan
    best: float = math.nan

    def _holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return value <= self.target if self.op == "<=" else value >= self.target

    @property
    def met(self) -> bool:
        """The goal statistic (the median ratio) is within the target."""
        return self._holds(self.measured)

    @property
    def verdict(self) -> str:
        """ "yes", "no", or "no (within noise)" when a quarter or more of the rounds met it."""
        if self.met:
            return "yes"
        edge = self.q1 if self.op == "<=" else self.q3
        return "no (within noise)" if self._holds(edge) else "no"

    @property
    def spread(self) -> str:
        return f"{self.q1:.3f}-{self.q3:.3f}" if math.isfinite(self.q1) else ""

    def to_row(self) -> dict:
        return {
            **asdict(self),
            "spread": self.spread,
            "met": "yes" if self.met else "no",
            "verdict": self.verdict,
        }


def _pair_goals(table: pd.DataFrame, section: str, pairs, batches, device: str) -> list[Goal]:
    goals = []
    if table.empty:
        return goals
    for model in dict.fromkeys(table["model"]):
        for batch in dict.fromkeys(select(table, model=model)["batch"]):
            if batches is not None and batch not in batches:
                continue
            for ours, theirs, target in pairs:
                row = select(table, model=model, batch=batch, variant=ours)
                column = f"ratio_to_{theirs}"
                if row.empty or column not in row or pd.isna(row[column].iloc[0]):
                    continue  # no timm counterpart (CNN)
                r = row.iloc[0]
                goals.append(Goal(
                    key=f"{section}/{model}/b{batch}/{ours}_vs_{theirs}",
                    description=f"{section} {model} batch {batch} ({device}): {ours} / {theirs}",
                    measured=float(r[column]), op="<=", target=target,
                    q1=float(r[column + "_q1"]), q3=float(r[column + "_q3"]), best=float(r[column + "_best"]),
                ))  # fmt: skip
    return goals


def _precision_goals(precision: pd.DataFrame | None, device: str) -> list[Goal]:
    goals = []
    if precision is None or precision.empty:
        return goals
    for model, batch, target in PRECISION_GOALS:
        row = select(precision, model=model, batch=batch, variant="bf16")
        if row.empty:
            continue
        r = row.iloc[0]
        goals.append(Goal(
            key=f"train_precision/{model}/b{batch}/bf16_speedup_vs_fp32",
            description=f"training step {model} batch {batch} ({device}): fp32 time / bf16 autocast time",
            measured=float(r["speedup_vs_fp32"]), op=">=", target=target, q1=float(r["speedup_vs_fp32_q1"]),
            q3=float(r["speedup_vs_fp32_q3"]), best=float(r["speedup_vs_fp32_best"]),
        ))  # fmt: skip
    return goals


def evaluate_goals(
    inference: pd.DataFrame,
    train: pd.DataFrame,
    loader: dict | None,
    device: str,
    precision: pd.DataFrame | None = None,
) -> list[Goal]:
    """Every goal that the measured tables allow checking.

    Args:
        inference: ``run_inference`` rows.
        train: ``run_training`` rows.
        loader: ``studies.benchmarks.data_benchmark.run_loader_benchmark`` result, or None.
        device: Device the figures were measured on (goals are stated for CPU).
        precision: ``run_precision`` rows (fp32 vs bf16 training step), or None.
    """
    goals = _pair_goals(inference, "inference", INFERENCE_GOALS, GOAL_BATCHES, device)
    goals += _pair_goals(train, "train", TRAIN_GOALS, None, device)
    if loader is not None and not train.empty:
        first = train.iloc[0]
        step = select(train, model=first["model"], batch=first["batch"], variant="glass_written")
        if not step.empty:
            step_rate = float(step["images_per_s"].iloc[0])
            goals.append(Goal(
                key=f"loader/vs_train_{first['model']}_b{first['batch']}",
                description=(f"TensorLoader images/s ({loader['ours_images_per_s']:,.0f}) / training step "
                             f"images/s of {first['model']} batch {first['batch']}, hand-written path "
                             f"({step_rate:,.0f}) ({device})"),
                measured=loader["ours_images_per_s"] / step_rate, op=">=", target=LOADER_GOAL,
            ))  # fmt: skip
    return goals + _precision_goals(precision, device)


def markdown_table(
    rows: list[dict], columns: dict[str, str], formats: dict[str, str] | None = None
) -> str:
    """A GitHub Markdown table of ``rows``; ``columns`` maps keys to headers."""
    formats = formats or {}

    def cell(row: dict, key: str) -> str:
        value = row.get(key, "")
        if isinstance(value, float) and math.isnan(value):
            return "-"
        return format(value, formats[key]) if key in formats and value != "" else str(value)

    return markdown.table(
        list(columns.values()), [[cell(r, k) for k in columns] for r in rows], pad=False
    )


def _timing_rows(table: pd.DataFrame) -> list[dict]:
    rows = []
    for r in table.to_dict("records"):
        r = dict(r)
        r["median_ms"] = r["median_s"] * 1e3
        r["iqr_ms"] = f"{r['q1_s'] * 1e3:.3g}-{r['q3_s'] * 1e3:.3g}"
        r["peak_pct"] = 100 * r["fraction_of_fp32_peak"]
        q1, q3 = (
            r.get("ratio_to_timm_fused_q1", float("nan")),
            r.get("ratio_to_timm_fused_q3", float("nan")),
        )
        r["ratio_iqr"] = "-" if pd.isna(q1) else f"{q1:.2f}-{q3:.2f}"
        rows.append(r)
    return rows


# fmt: skip
TIMING_COLUMNS = {
    "model": "model",
    "batch": "batch",
    "label": "variant",
    "repeats": "rounds",
    "median_ms": "median ms",
    "iqr_ms": "IQR ms",
    "images_per_s": "images/s",
    "achieved_gflops": "GFLOP/s",
    "peak_pct": "% of fp32 matmul",
    "ratio_to_timm_fused": "time / timm fused",
    "ratio_iqr": "ratio IQR",
    "ratio_to_timm_fused_best": "best / best",
}
TIMING_FORMATS = {"median_ms": ".3g", "images_per_s": ",.0f", "achieved_gflops": ".1f", "peak_pct": ".0f",
                  "ratio_to_timm_fused": ".3f", "ratio_to_timm_fused_best": ".3f"}  # fmt: skip


# fmt: skip
PRECISION_COLUMNS = {
    "model": "model",
    "batch": "batch",
    "label": "precision",
    "repeats": "rounds",
    "median_ms": "median ms",
    "iqr_ms": "IQR ms",
    "images_per_s": "images/s",
    "achieved_gflops": "GFLOP/s",
    "own_peak_dtype": "peak dtype",
    "own_pct": "% of own matmul peak",
    "peak_pct": "% of fp32 matmul",
    "speedup_vs_fp32": "speedup vs fp32",
    "speedup_iqr": "speedup IQR",
    "speedup_vs_fp32_best": "best / best",
}
PRECISION_FORMATS = {"median_ms": ".3g", "images_per_s": ",.0f", "achieved_gflops": ".1f", "own_pct": ".0f",
                     "peak_pct": ".0f", "speedup_vs_fp32": ".2f", "speedup_vs_fp32_best": ".2f"}  # fmt: skip


def _precision_rows(table: pd.DataFrame) -> list[dict]:
    rows = []
    for r in _timing_rows(table):
        r["own_pct"] = 100 * r["fraction_of_own_peak"]
        r["speedup_iqr"] = (
            "-"
            if r["variant"] == "fp32"
            else f"{r['speedup_vs_fp32_q1']:.2f}-{r['speedup_vs_fp32_q3']:.2f}"
        )
        rows.append(r)
    return rows


def decisions(*tables: pd.DataFrame) -> list[Decision]:
    """One decision per (section, model, batch) of the timing tables, in their order."""
    out = []
    for table in tables:
        if table is None or table.empty or "verdict" not in table:
            continue
        for (section, model, batch), group in table.groupby(
            ["section", "model", "batch"], sort=False
        ):
            out.append(Decision.from_rows(f"{section}/{model}/b{batch}", group.to_dict("records")))
    return out


def verdicts_markdown(found: list[Decision], loader: dict | None, info: dict) -> str:
    """Every comparison's verdict and the ``use:`` line, under the load they were measured at."""
    lines = [
        f"Measured at load average {info.get('load_average_1m', '?')} at the start and "
        f"{info.get('load_average_1m_end', '?')} at the end, on {info.get('cpu_count', '?')} CPUs. "
        "A verdict is resolved when the 95 % sign-test interval of the per-round time ratio "
        'excludes 1 (6 rounds at least); "use" chooses between the glass-box paths '
        "(hand-written or fast attention; fp32 or bf16), timm's being references.",
        "",
    ]
    for d in found:
        lines += [f"- {line}" for line in d.lines]
    if loader is not None and "verdicts" in loader:
        lines += [f"- {line}" for line in loader["verdicts"]]
    return "\n".join(lines)


def goals_markdown(goals: list[Goal]) -> str:
    rows = [{**g.to_row(), "goal": f"{g.op} {g.target:g}"} for g in goals]
    columns = {"description": "goal", "measured": "measured", "spread": "ratio IQR", "best": "best / best",
               "goal": "target", "verdict": "met"}  # fmt: skip
    return markdown_table(rows, columns, {"measured": ".3f", "best": ".3f"})


def markdown_summary(
    info: dict,
    peaks: list[MatmulPeak],
    inference: pd.DataFrame,
    train: pd.DataFrame,
    loader: dict | None,
    goals: list[Goal],
    settings: dict,
    profiles: list[Profile] | None = None,
    precision: pd.DataFrame | None = None,
) -> str:
    """The whole benchmark as one Markdown page (logged as an artifact and printed)."""
    # fmt: skip
    parts = [
        "# Benchmark: glass-box ViT vs timm",
        f"Device **{info['device']}** ({info['device_name']}); torch {info['torch_version']}, timm "
        f"{info['timm_version']}; {info['torch_threads']} torch threads of {info['cpu_count']} CPUs; load average "
        f"{info.get('load_average_1m', '?')} at start, {info.get('load_average_1m_end', '?')} at end. "
        f"Up to {settings['repeats']} interleaved rounds (rotating order; fewer where a comparison's time budget "
        f"of {settings['max_seconds']} s ran out, at least 6: the fewest a verdict needs) after up to {settings['warmup']} warm-up calls; times "
        "are medians of per-call times, ratios are medians of per-round ratios. Weights: seeded random init. "
        'GFLOP/s come from the analytic count (matmuls and convolutions, 2 FLOPs per MAC); "% of fp32 matmul" '
        "divides them by the best throughput of an fp32 square matmul (half the side below) timed in the same rounds.",
        "## Matmul throughput (the machine's limit)",
        markdown_table(
            [
                {
                    "dtype": p.dtype,
                    "n": p.n,
                    "median": p.tflops.median,
                    "iqr": f"{p.tflops.q1:.3g}-{p.tflops.q3:.3g}",
                    "vs_fp32": p.tflops.median / peaks[0].tflops.median,
                }
                for p in peaks
            ],
            {
                "dtype": "dtype",
                "n": "n (square)",
                "median": "median TFLOP/s",
                "iqr": "IQR",
                "vs_fp32": "x fp32",
            },
            {"median": ".3g", "vs_fp32": ".2f"},
        ),
    ]
    if not inference.empty:
        table = markdown_table(_timing_rows(inference), TIMING_COLUMNS, TIMING_FORMATS)
        parts += ["## Inference (torch.inference_mode)", table]
    if not train.empty:
        parts += ["## Training step (forward, cross-entropy, backward, AdamW step)",
                  markdown_table(_timing_rows(train), TIMING_COLUMNS, TIMING_FORMATS)]  # fmt: skip
    if precision is not None and not precision.empty:
        parts += ["## Training step, fp32 vs bf16 autocast (glass-box, hand-written attention, as the loop trains)",
                  "Each row's \"% of own matmul peak\" divides its GFLOP/s by the best square matmul of its own dtype "
                  "(fp32 or bf16, same side as the probe above) timed in the same rounds; the speedup is the median "
                  "of per-round ratios fp32 time / bf16 time.",
                  markdown_table(_precision_rows(precision), PRECISION_COLUMNS, PRECISION_FORMATS)]  # fmt: skip
    elif precision is not None:
        parts += [
            "## Training step, fp32 vs bf16 autocast",
            "Not measured: no model given (`--precision-model`) or no native bf16 on this device.",
        ]
    if loader is not None:
        parts += ["## Data loader (studies.benchmarks.data_benchmark)", markdown_table([loader], {
            "ours_images_per_s": "TensorLoader images/s", "torchvision_images_per_s": "torchvision images/s",
            "ratio": "ratio", "n_images": "images", "batch_size": "batch", "torch_threads": "threads"},
            {"ours_images_per_s": ",.0f", "torchvision_images_per_s": ",.0f", "ratio": ".1f"})]  # fmt: skip
    if profiles:
        parts += ["## torch.profiler, batch 1 (work done per forward; tables in profiles/)", markdown_table(
            [vars(p) for p in profiles], {"model": "model", "variant": "variant", "aten_calls": "ATen calls / forward",
                                         "self_cpu_ms": "profiled self CPU ms / forward"},
            {"aten_calls": ".0f", "self_cpu_ms": ".3g"})]  # fmt: skip
    if goals:
        met = sum(g.met for g in goals)
        noisy = sum(g.verdict == "no (within noise)" for g in goals)
        note = f" ({noisy} of the misses within noise)" if met < len(goals) else ""
        parts += [f"## Goals: {met} of {len(goals)} met{note}", goals_markdown(goals)]
    found = decisions(inference, train, precision)
    if found or loader is not None:
        parts += [
            "## Verdicts: what to use on this machine",
            verdicts_markdown(found, loader, info),
        ]
    return "\n\n".join(parts) + "\n"
