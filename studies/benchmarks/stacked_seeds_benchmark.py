"""Entry point: several seeds of one arm trained together in one step, against one after another.

    workbench benchmark stacked-seeds --protocol studies/protocols/fmnist_seed_recipe.yaml \\
        --arm vit --seeds 5 --rounds 6 --steps 2 --threads 1

A small model leaves a core idle between its small matmuls, so training the seeds of an arm
together (their parameters stacked, one batched step: ``torch.func.functional_call`` under
``torch.func.vmap``, each seed its own dropout draws, its own gradient clipping and its own
AdamW state) might train more images per second than the trainer's path, which trains one seed
at a time. Both options here train the same seeds on the same random batches of the arm's shape
and batch size (the loader is left out alike): ``one_by_one`` takes one training step of each
seed in turn, as the trainer does (autocast at the arm's precision, cross-entropy with its label
smoothing, ``loss.item()``, backward, clipping, AdamW, the scheduler); ``stacked`` takes the one
batched step of them all. The options are timed interleaved in rounds
(``workbench.bench.timing``), and the verdict is the median of the rounds' time ratios with its
sign interval (6 rounds for a 95 % interval), then one ``use:`` line; the load before and after
is printed, and everything is logged to MLflow (experiment ``stacked-seeds-benchmark``). The
trainer gains a stacked path only where this resolves it faster (docs/benchmarks.md has what it
measured). An arm whose model keeps running statistics (batch norm) cannot be stacked this way
and is refused in one line.
"""

from __future__ import annotations

import copy

import click
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, stack_module_state, vmap

from studies.runtime.options import threads_option
from studies.benchmarks.train_benchmark import repeat_step
from studies.runtime.study_protocol import ProtocolError, load_protocol
from workbench.bench.cells import STORED_SIDE
from workbench.bench.timing import Load, Spread, decide, time_interleaved
from workbench.models.registry import build_model, model_config
from workbench.precision import resolve_amp
from workbench.train.loop import cosine_with_warmup

EXPERIMENT = "stacked-seeds-benchmark"
OPTIONS = ("one_by_one", "stacked")


class CannotStack(ValueError):
    """An arm whose model cannot be trained stacked (in-place running statistics)."""


def seeded_models(mcfg, seeds: int) -> list[nn.Module]:
    """The arm's model at seeds 0..seeds-1, each built after ``torch.manual_seed(seed)``."""
    models = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        models.append(build_model(mcfg).train())
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in models[0].modules()):
        raise CannotStack(
            f"{type(models[0]).__name__} keeps batch-norm running statistics, which a stacked "
            "step cannot update in place"
        )
    return models


def one_by_one_step(models, cfg, amp, x, y):
    """One training step of each seed in turn, as the trainer takes it."""
    opts = [
        torch.optim.AdamW(
            m.parameters(),
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            weight_decay=cfg.optim.weight_decay,
        )
        for m in models
    ]
    scheds = [
        torch.optim.lr_scheduler.LambdaLR(o, cosine_with_warmup(10_000, 0, 0.0)) for o in opts
    ]
    smoothing, clip = cfg.optim.label_smoothing, cfg.optim.grad_clip

    def step() -> None:
        for model, opt, sched, xs, ys in zip(models, opts, scheds, x, y):
            with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
                loss = F.cross_entropy(model(xs).float(), ys, label_smoothing=smoothing)
            loss.item()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()

    return step


def stacked_step(models, cfg, amp, x, y):
    """One batched step of every seed: stacked parameters, per-seed clipping and AdamW state.

    Returns the step and the stacked parameters (name -> (seeds, ...)), which it updates.
    """
    base = copy.deepcopy(models[0]).to("meta")
    params, buffers = stack_module_state(models)
    params = {k: v.detach().clone() for k, v in params.items()}
    smoothing, clip, seeds = cfg.optim.label_smoothing, cfg.optim.grad_clip, len(models)

    def loss_of(p, b, xs, ys):
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            logits = functional_call(base, (p, b), (xs,))
        return F.cross_entropy(logits.float(), ys, label_smoothing=smoothing)

    grads_and_losses = vmap(grad_and_value(loss_of), randomness="different")
    # AdamW is elementwise, so one optimizer over the stacked tensors is each seed's own AdamW
    opt = torch.optim.AdamW(
        list(params.values()),
        lr=cfg.optim.lr,
        betas=cfg.optim.betas,
        weight_decay=cfg.optim.weight_decay,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(10_000, 0, 0.0))

    def step() -> None:
        grads, losses = grads_and_losses(params, buffers, x, y)
        losses.sum().item()
        if clip is not None:  # each seed's global norm, as clip_grad_norm_ takes it
            norms = torch.stack([g.reshape(seeds, -1).pow(2).sum(1) for g in grads.values()])
            scale = (clip / (norms.sum(0).sqrt() + 1e-6)).clamp(max=1.0)
        for name, p in params.items():
            g = grads[name]
            p.grad = g * scale.view(-1, *[1] * (g.dim() - 1)) if clip is not None else g
        opt.step()
        sched.step()

    return step, params


def batches(mcfg, data_name: str, seeds: int, batch: int, seed: int = 0):
    """Random inputs (seeds, batch, C, H, W) and labels (seeds, batch) of the arm's shape."""
    side = getattr(mcfg, "image_size", None) or STORED_SIDE.get(data_name, 28)
    side = side if isinstance(side, int) else side[0]
    channels = 1 if data_name == "fashion_mnist" else 3
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(seeds, batch, channels, side, side, generator=g)
    y = torch.randint(0, mcfg.num_classes, (seeds, batch), generator=g)
    return x, y


@click.command("stacked-seeds")
@click.option(
    "--protocol", "protocol_path", required=True, type=click.Path(exists=True, dir_okay=False)
)
@click.option("--arm", default=None, help="The arm to time (default: the reference arm).")
@click.option("--seeds", type=click.IntRange(min=2), default=5, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=6, show_default=True)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Training steps of every seed per round.",
)
@threads_option
def benchmark_stacked_seeds(protocol_path, arm, seeds, rounds, steps, threads):
    """Time an arm's seeds trained stacked in one step against one after another, on the CPU."""
    try:
        protocol = load_protocol(protocol_path)
    except ProtocolError as err:
        raise click.ClickException(str(err)) from err
    arm = arm or protocol.reference.name
    cell = next((c for c in protocol.cells() if c.arm == arm), None)
    if cell is None:
        raise click.BadParameter(
            f"{arm!r} is not an arm of {protocol.name}: {', '.join(a.name for a in protocol.arms)}",
            param_hint="'--arm'",
        )
    if threads:
        torch.set_num_threads(threads)
    cfg = cell.train_config(device="cpu")
    mcfg = model_config(cfg.model.name, **cfg.model.overrides)
    amp = resolve_amp(cfg.run.amp, torch.device("cpu"))
    try:
        models = seeded_models(mcfg, seeds)
    except CannotStack as err:
        raise click.ClickException(f"{protocol.name} arm {arm}: {err}") from err
    x, y = batches(mcfg, cfg.data.name, seeds, cfg.run.batch_size)
    candidates = {
        "one_by_one": repeat_step(one_by_one_step(models, cfg, amp, x, y), steps),
        "stacked": repeat_step(
            stacked_step([copy.deepcopy(m) for m in models], cfg, amp, x, y)[0], steps
        ),
    }
    images = seeds * cfg.run.batch_size * steps
    click.echo(
        f"{protocol.name} arm {arm} ({cfg.model.name}): {seeds} seeds x batch "
        f"{cfg.run.batch_size}, {steps} step(s) of each seed per round, {rounds} rounds, "
        f"{torch.get_num_threads()} thread(s), precision {'fp32' if amp is None else amp}"
    )
    load = Load.begin()
    samples = time_interleaved(
        candidates, "cpu", repeats=rounds, warmup=1, min_sample_s=0.0, max_inner=1
    )
    finished = load.finish()
    for option in OPTIONS:
        ips = Spread.of([images / s for s in samples.seconds[option]])
        click.echo(
            f"{option}: {ips.median:.0f} images/s (min {ips.min:.0f}, max {ips.max:.0f} "
            "over rounds)"
        )
    decision = decide(samples.seconds, "one_by_one", list(OPTIONS), scope=arm)
    for line in decision.lines:
        click.echo(line)
    click.echo(finished.line)
    from tracking.kinds.benchmark_runs import log_stacked_seeds_benchmark

    params = {
        "protocol": protocol.name,
        "protocol_hash": protocol.hash,
        "arm": arm,
        "model": cfg.model.name,
        "seeds": seeds,
        "batch": cfg.run.batch_size,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "rounds": len(samples.seconds["one_by_one"]),
    }
    run_id = log_stacked_seeds_benchmark(
        params, samples.seconds, images, decision, finished.as_dict()
    )
    click.echo(f"logged to MLflow: experiment {EXPERIMENT}, run {run_id}")
