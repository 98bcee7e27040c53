"""Entry point: training images/s of today's path, each fast-path option, all of them, and plain timm.

    workbench benchmark train --threads 1 --rounds 6 --steps 3
    workbench benchmark train --arms base,p4_w96 --variants today,fused_attention,timm_fused

Per arm (every arm of ``cifar10_seed_table``, the ViT and CNN of ``fmnist_seed_recipe``, and
two timm arms: ``timm/resnet10t`` and a timm ``VisionTransformer`` of the base arm's shape)
each variant gets its own model (same seeded init) and optimizer, and one training step
runs exactly as the trainer's does: autocast at the arm's precision, forward, cross-entropy
with the arm's label smoothing, ``loss.item()``, backward, gradient clipping where the arm
clips, AdamW, the scheduler. Variants:

- ``today``: the trainer's path (eager, written-out attention, hook points, foreach AdamW);
- ``compile``, ``fused_attention``, ``fused_adamw``: one ``fast_path`` option alone, through
  the trainer's own code (``workbench.train.fast_path``);
- ``skip_hooks``: every hook point bypassed (a measurement only: no such option is kept
  unless it pays);
- ``all``: compile, fused attention and fused AdamW together;
- ``timm_fused`` / ``timm_written``: a plain timm + PyTorch loop of the same model (timm's
  ``VisionTransformer`` with its fused attention on / off; for a CNN arm the model itself
  in a plain loop).

Variants are timed interleaved in rounds in one process (``workbench.bench.timing``), on
one fixed random batch of the arm's shape: the loader and its augmentation are left out of
every variant alike (``workbench benchmark loader`` times them). The compile warm-up (the
first two steps) is measured and shown. Output: a table per arm with min / median / max
images/s over rounds and ratios to today and to the faster plain timm loop, logged to
MLflow (experiment ``train-benchmark``) with the CPU named, the load before and after, each
variant's verdict against today's path and the ``use:`` line per arm
(``workbench.bench.timing.decide``).
"""

from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import click
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from studies.runtime.options import threads_option
from studies.runtime.study_protocol import load_protocol
from workbench.bench.cells import STORED_SIDE
from workbench.bench.models import timm_from_config
from workbench.bench.timing import Decision, Load, Spread, decide, time_interleaved
from workbench.models.hooks import HookPoint
from workbench.models.registry import build_model, model_config
from workbench.models.vit_config import ViTConfig
from workbench.precision import AmpUnsupported, cpu_name, resolve_amp
from workbench.train.config import FastPathConfig, ModelSpec, TrainConfig
from workbench.train.fast_path import TrainingForward, adamw, set_attention
from workbench.train.loop import cosine_with_warmup

PROTOCOLS = Path(__file__).resolve().parents[1] / "protocols"
OPTIONS = {
    "compile": FastPathConfig(compile=True),
    "fused_attention": FastPathConfig(fused_attention="on"),
    "fused_adamw": FastPathConfig(fused_adamw=True),
    "all": FastPathConfig(compile=True, fused_attention="on", fused_adamw=True),
}
VARIANTS = (
    "today",
    "compile",
    "fused_attention",
    "fused_adamw",
    "skip_hooks",
    "all",
    "timm_fused",
    "timm_written",
)
# The variants a user can choose (the trainer's fast_path options); the others are measurements.
CHOICES = ("today", "compile", "fused_attention", "fused_adamw", "all")


def benchmark_arms() -> dict[str, TrainConfig]:
    """Arm name -> the config a cell of that arm trains (seed 0), in the order of the table."""
    table = load_protocol(PROTOCOLS / "cifar10_seed_table.yaml")
    arms = {c.arm: c.config for c in table.cells() if c.seed == table.seeds[0]}
    fmnist = load_protocol(PROTOCOLS / "fmnist_seed_recipe.yaml")
    arms |= {f"fmnist_{c.arm}": c.config for c in fmnist.cells() if c.seed == fmnist.seeds[0]}
    base = arms["base"]
    vit = model_config(base.model.name, **base.model.overrides)
    timm_vit = {  # a timm VisionTransformer of the base arm's shape, as a timm arm is written
        "img_size": vit.image_size,
        "patch_size": vit.patch_size,
        "embed_dim": vit.dim,
        "depth": vit.depth,
        "num_heads": vit.heads,
        "mlp_ratio": vit.hidden_dim / vit.dim,
        "num_classes": vit.num_classes,
    }
    arms["timm_vit_base"] = replace(base, model=ModelSpec("timm/vit_tiny_patch16_224", timm_vit))
    arms["timm_resnet10t"] = replace(base, model=ModelSpec("timm/resnet10t", {"num_classes": 10}))
    return arms


@dataclass
class Candidate:
    """One variant of one arm: a zero-argument training step and what it ran on."""

    step: Callable[[], None]
    path: str  # what the variant ran, in words (e.g. compile fell back to eager)
    warmup_s: float = float("nan")  # the first two steps (compile included)


class _IdleHookPoint(HookPoint):
    """A hook point that skips nn.Module's call machinery (nothing is ever attached in a timing)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _skip_hooks(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, HookPoint):
            module.__class__ = _IdleHookPoint
    return model


def _set_timm_fused(model: nn.Module, fused: bool) -> nn.Module:
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = fused
    return model


def _plain_model(cfg: TrainConfig, built: nn.Module) -> nn.Module | None:
    """The model a plain timm + PyTorch loop would train; None where the arm has no such twin."""
    mcfg = model_config(cfg.model.name, **cfg.model.overrides)
    if isinstance(mcfg, ViTConfig):
        return timm_from_config(mcfg)
    return copy.deepcopy(built)  # a CNN or a timm arm: the model itself, in a plain loop


def candidates(
    cfg: TrainConfig, variants: tuple[str, ...], *, steps: int, seed: int = 0, say=print
) -> tuple[dict[str, Candidate], dict]:
    """Build every variant of one arm (each its own model and optimizer) and warm it up.

    Returns:
        Variant -> candidate, and the arm's description (tokens, precision, batch).
    """
    device = torch.device("cpu")
    amp = resolve_amp(cfg.run.amp, device)
    mcfg = model_config(cfg.model.name, **cfg.model.overrides)
    side = getattr(mcfg, "image_size", None) or STORED_SIDE.get(cfg.data.name, 28)
    side = side if isinstance(side, int) else side[0]
    channels = 1 if cfg.data.name == "fashion_mnist" else 3
    g = torch.Generator().manual_seed(seed)
    b = cfg.run.batch_size
    x = torch.randn(b, channels, side, side, generator=g)  # (B, C, H, W)
    y = torch.randint(0, 10, (b,), generator=g)
    is_vit = isinstance(mcfg, ViTConfig)
    info = {
        "tokens": mcfg.num_patches + mcfg.num_prefix_tokens if is_vit else 0,
        "precision": "fp32" if amp is None else str(amp).removeprefix("torch."),
        "batch": b,
    }
    out: dict[str, Candidate] = {}
    for variant in variants:
        if variant in ("fused_attention", "skip_hooks") and not is_vit:
            continue  # nothing to switch: a CNN or a timm arm keeps its own path
        if variant == "timm_written" and not (is_vit or "vit" in cfg.model.name):
            continue
        torch.manual_seed(seed)
        model = build_model(mcfg).train()
        fast = OPTIONS.get(variant, FastPathConfig())
        path = variant
        if variant.startswith("timm_"):
            torch.manual_seed(seed)
            model = _set_timm_fused(_plain_model(cfg, model).train(), variant == "timm_fused")
            forward, opt = model, torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
        else:
            if variant == "skip_hooks":
                _skip_hooks(model)
            set_attention(model, fast.fused_attention == "on")
            forward = TrainingForward(model, fast)
            opt = adamw(list(model.parameters()), fast, lr=cfg.optim.lr)
        # the arm's AdamW, as the trainer builds it
        opt.param_groups[0].update(betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(10_000, 0, 0.0))
        step = _step(model, forward, opt, sched, cfg, amp, x, y)
        started = time.perf_counter()
        for _ in range(2):
            step()
        warm = time.perf_counter() - started
        if isinstance(forward, TrainingForward) and forward.status != "off":
            path = f"{variant} (compiled: {forward.status})"
        elif variant == "timm_fused" and not (is_vit or "vit" in cfg.model.name):
            path = "plain loop (the model itself)"
        say(f"  {variant}: built, first two steps {warm:.1f} s")
        out[variant] = Candidate(repeat_step(step, steps), path, warm)
    return out, info


def _step(model, forward, opt, sched, cfg: TrainConfig, amp, x, y) -> Callable[[], None]:
    """One training step as the trainer takes it (workbench.train.loop), on a fixed batch."""
    params = [p for p in model.parameters() if p.requires_grad]
    smoothing, clip = cfg.optim.label_smoothing, cfg.optim.grad_clip

    def step() -> None:
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            logits = forward(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=smoothing)
        loss.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        sched.step()

    return step


def repeat_step(step: Callable[[], None], n: int) -> Callable[[], None]:
    def steps() -> None:
        for _ in range(n):
            step()

    return steps


def bench_arm(
    arm: str,
    cfg: TrainConfig,
    variants: tuple[str, ...],
    *,
    rounds: int,
    steps: int,
    seed: int = 0,
    say=print,
) -> pd.DataFrame:
    """One row per variant of ``arm``: images/s min / median / max over interleaved rounds."""
    built, info = candidates(cfg, variants, steps=steps, seed=seed, say=say)
    samples = time_interleaved(
        {v: c.step for v, c in built.items()},
        "cpu",
        repeats=rounds,
        warmup=1,
        min_sample_s=0.0,
        max_inner=1,
    )
    images = info["batch"] * steps
    decision = arm_decision(arm, samples.seconds)
    rows = []
    for variant, cand in built.items():
        ips = Spread.of([images / s for s in samples.seconds[variant]])
        rows.append(
            {
                "arm": arm,
                "model": cfg.model.name,
                **info,
                "variant": variant,
                "path": cand.path,
                "images_per_s_min": ips.min,
                "images_per_s_median": ips.median,
                "images_per_s_max": ips.max,
                "warmup_s": cand.warmup_s,
                "rounds": len(samples.seconds[variant]),
                "steps_per_round": steps,
                **_ratios(samples, variant),
                **decision.columns(variant),
            }
        )
    return pd.DataFrame(rows)


def arm_decision(arm: str, seconds: dict[str, list[float]]) -> Decision:
    """Every variant against today's path (or the first timed), and which option to use."""
    reference = "today" if "today" in seconds else next(iter(seconds))
    return decide(seconds, reference, [v for v in CHOICES if v in seconds] or [reference], arm)


def arm_decisions(table: pd.DataFrame) -> list[Decision]:
    """The decisions back from the table (one per arm), for the summary and the run."""
    rows = table.assign(
        repeats=table["rounds"],
        median_s=lambda t: t["steps_per_round"] * t["batch"] / t["images_per_s_median"],
        min_s=lambda t: t["steps_per_round"] * t["batch"] / t["images_per_s_max"],
        max_s=lambda t: t["steps_per_round"] * t["batch"] / t["images_per_s_min"],
    )
    # not kept; the median stands in
    rows["q1_s"], rows["q3_s"] = (
        rows["median_s"],
        rows["median_s"],
    )
    return [
        Decision.from_rows(arm, group.to_dict("records"))
        for arm, group in rows.groupby("arm", sort=False)
    ]


def _ratios(samples, variant: str) -> dict[str, float]:
    """Per-round speed ratios (median over rounds): to today's path and to the faster plain timm loop."""
    sec = samples.seconds
    out = {}
    if "today" in sec:
        out["x_today"] = Spread.of([t / s for t, s in zip(sec["today"], sec[variant])]).median
    plain = [v for v in ("timm_fused", "timm_written") if v in sec]
    if plain:
        faster = min(plain, key=lambda v: Spread.of(sec[v]).median)
        out["x_plain_timm"] = Spread.of([t / s for t, s in zip(sec[faster], sec[variant])]).median
        out["plain_reference"] = faster
    return out


def cpu_description() -> dict[str, str]:
    """Vendor, model and the vector / matrix units of this CPU, from /proc/cpuinfo."""
    vendor, flags = "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id") and vendor == "?":
                vendor = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    units = {
        "AVX2": "avx2",
        "AVX512": "avx512f",
        "AVX512-BF16": "avx512_bf16",
        "AMX": "amx_bf16",
    }
    have = [name for name, flag in units.items() if flag in flags]
    return {
        "cpu_vendor": vendor,
        "cpu_model": cpu_name(),
        "cpu_units": ", ".join(have) or "none of AVX2 / AVX512 / AVX512-BF16 / AMX",
        "cpu_lacks": ", ".join(n for n in units if n not in have) or "nothing",
        "cores": str(os.cpu_count()),
        "torch": torch.__version__,
        "torch_threads": str(torch.get_num_threads()),
    }


def markdown(table: pd.DataFrame, machine: dict[str, str], load: Load) -> str:
    """The table per arm, the machine line, and each arm's verdicts and ``use:`` line."""
    lines = [
        f"CPU: {machine['cpu_vendor']} {machine['cpu_model']} ({machine['cores']} cores; has "
        f"{machine['cpu_units']}; lacks {machine['cpu_lacks']}), torch {machine['torch']}, "
        f"{machine['torch_threads']} thread(s); {load.line}.",
        "",
        "| arm | tokens | precision | variant | images/s min / median / max | x today | "
        "x plain timm | first two steps s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table.to_dict("records"):
        x_today = r.get("x_today", float("nan"))
        x_plain = r.get("x_plain_timm", float("nan"))
        lines.append(
            f"| {r['arm']} | {r['tokens'] or '-'} | {r['precision']} | {r['path']} | "
            f"{r['images_per_s_min']:.0f} / {r['images_per_s_median']:.0f} / "
            f"{r['images_per_s_max']:.0f} | {_fmt(x_today)} | {_fmt(x_plain)} | "
            f"{r['warmup_s']:.1f} |"
        )
    lines += [
        "",
        "Verdicts (95 % sign interval of the per-round time ratio; 6 rounds at least):",
        "",
    ]
    lines += [f"- {line}" for d in arm_decisions(table) for line in d.lines[1:]]
    return "\n".join(lines) + "\n"


def _fmt(value: float) -> str:
    return (
        "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"
    )


def profile_step(cfg: TrainConfig, variant: str, *, top: int = 6) -> pd.DataFrame:
    """The ops that take the largest share of one training step's self CPU time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    built, _ = candidates(cfg, (variant,), steps=1, say=lambda _m: None)
    step = built[variant].step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return pd.DataFrame(
        [
            {"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count}
            for e in events[:top]
        ]
    )


def _names(text: str | None, valid, what: str) -> tuple[str, ...]:
    if not text:
        return tuple(valid)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise click.BadParameter(
            f"{unknown[0]!r} is not one of {', '.join(valid)}", param_hint=f"--{what}"
        )
    return names


@click.command("benchmark-train")
@click.option("--arms", default=None, help="Comma-separated arms (default: all).")
@click.option(
    "--variants", default=None, help=f"Comma-separated variants (default: {', '.join(VARIANTS)})."
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=6,
    show_default=True,
    help="Interleaved timed rounds (a verdict needs at least 6).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Training steps per variant per round.",
)
@click.option(
    "--profile",
    "profile_arms",
    default=None,
    help="Comma-separated arms whose today path and plain timm loop (fused attention) get a "
    "torch.profiler table of one step.",
)
@click.option("--experiment", default="train-benchmark", show_default=True)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("outputs/train_benchmark"),
    show_default=True,
    help="results.csv, summary.md and the profiles.",
)
@threads_option
def benchmark_train(arms, variants, rounds, steps, profile_arms, experiment, output_dir, threads):
    """Training images/s of today's path, each fast-path option, all of them, and plain timm loops."""
    all_arms = benchmark_arms()
    chosen = _names(arms, all_arms, "arms")
    wanted = _names(variants, VARIANTS, "variants")
    profiled = _names(profile_arms, all_arms, "profile") if profile_arms else ()
    load = Load.begin()
    output_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    for arm in chosen:
        cfg = all_arms[arm]
        try:
            resolve_amp(cfg.run.amp, "cpu")
        except AmpUnsupported:  # bf16 without native units: the arm runs in fp32 here
            click.echo(f"{arm}: amp {cfg.run.amp} is not native on this CPU; timed in fp32")
            cfg = replace(cfg, run=replace(cfg.run, amp="off"))
        click.echo(f"{arm}:")
        parts.append(bench_arm(arm, cfg, wanted, rounds=rounds, steps=steps, say=click.echo))
        # After every arm: a long run stopped part-way keeps the arms it finished.
        pd.concat(parts, ignore_index=True).to_csv(output_dir / "results.csv", index=False)
    table = pd.concat(parts, ignore_index=True)
    machine = cpu_description()
    load = load.finish()
    text = markdown(table, machine, load)
    for arm in profiled:
        cfg = all_arms[arm]
        if cfg.run.amp != "off":
            cfg = replace(cfg, run=replace(cfg.run, amp="off"))
        for variant in ("today", "timm_fused"):
            prof = profile_step(cfg, variant)
            text += f"\nProfile of one step, {arm} {variant} (share of self CPU time):\n\n"
            text += "\n".join(
                f"- {r.op}: {r.share:.1%} ({r.calls} calls)" for r in prof.itertuples()
            )
            text += "\n"
    (output_dir / "summary.md").write_text(text)
    from tracking.kinds.benchmark_runs import log_train_benchmark

    params = {"arms": ",".join(chosen), "variants": ",".join(wanted), "rounds": rounds,
              "steps": steps, "threads": threads}  # fmt: skip
    run_id = log_train_benchmark(
        table, output_dir, params, machine, experiment, arm_decisions(table), load.as_dict()
    )
    click.echo(text)
    click.echo(f"logged: run {run_id} in experiment {experiment}")


if __name__ == "__main__":
    benchmark_train()
