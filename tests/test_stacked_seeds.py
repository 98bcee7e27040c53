"""``workbench benchmark stacked-seeds``: the stacked step is the same training as one seed at a
time (so the benchmark times equal work), and the command decides between them."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch
from click.testing import CliRunner

from studies.benchmarks.stacked_seeds_benchmark import (
    benchmark_stacked_seeds,
    one_by_one_step,
    seeded_models,
    stacked_step,
)
from studies.runtime.study_protocol import load_protocol
from workbench.models.registry import model_config

SMOKE = Path(__file__).resolve().parents[1] / "studies" / "protocols" / "smoke.yaml"
TOLERANCE = 1e-5  # float32 through batched against plain matmuls, after two AdamW steps


def test_a_stacked_step_trains_each_seed_as_its_own_step_does():
    cell = next(c for c in load_protocol(SMOKE).cells() if c.arm == "vit")
    base = cell.train_config(device="cpu")
    # a clip small enough to act on every step, so each seed's own norm is what is checked
    cfg = replace(base, optim=replace(base.optim, grad_clip=0.05, label_smoothing=0.1))
    # without dropout both paths draw nothing, so they must agree to float rounding
    mcfg = model_config("fmnist_vit", dropout=0.0, attn_dropout=0.0)
    models = seeded_models(mcfg, 3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 8, 1, 28, 28, generator=g), torch.randint(0, 10, (3, 8), generator=g)
    stacked, params = stacked_step([copy.deepcopy(m) for m in models], cfg, None, x, y)
    plain = one_by_one_step(models, cfg, None, x, y)
    for _ in range(2):
        stacked()
        plain()
    worst = 0.0
    for name, p in params.items():
        for seed, model in enumerate(models):
            own = dict(model.named_parameters())[name].detach()
            worst = max(worst, float((p[seed] - own).abs().max()))
    assert worst <= TOLERANCE, f"stacked and one-by-one parameters differ by {worst:.3g}"
    moved = float((params["head.weight"][0] - params["head.weight"][1]).abs().max())
    assert moved > 0, "the seeds were trained alike: the stack lost their own initialisations"


def test_the_command_prints_a_verdict_and_a_use_line_and_refuses_batch_norm(mlflow_store):
    runner = CliRunner()
    args = ["--protocol", str(SMOKE), "--seeds", "2", "--rounds", "2", "--steps", "1"]
    done = runner.invoke(benchmark_stacked_seeds, [*args, "--arm", "vit", "--threads", "1"])
    assert done.exit_code == 0, done.output
    assert "stacked vs one_by_one:" in done.output and "use: " in done.output, done.output
    assert "load average" in done.output and "stacked-seeds-benchmark" in done.output
    refused = runner.invoke(benchmark_stacked_seeds, [*args, "--arm", "cnn"])
    assert refused.exit_code == 1 and "batch-norm" in refused.output, refused.output
