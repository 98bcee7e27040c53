"""`workbench benchmark-train` on a tiny arm for one round: its table, ratios and files (no timing asserts)."""

from __future__ import annotations

import math

import mlflow
import pytest
import torch

from studies.benchmarks import train_benchmark
from synthetic import tiny_config
from workbench.bench.timing import Load


@pytest.mark.slow  # 12-21 s on 2 busy cores: keeps the default tier under 5 minutes (docs/testing.md)
def test_bench_arm_gives_one_row_per_variant_with_spreads_and_ratios(monkeypatch):
    def broken_compile(module, **_):  # the compile variants take the eager fallback here
        def call(_images):
            raise RuntimeError("compiler unavailable in this test")

        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    variants = ("today", "compile", "fused_attention", "skip_hooks", "all", "timm_fused")
    table = train_benchmark.bench_arm(
        "tiny", tiny_config(epochs=1), variants, rounds=1, steps=1, say=lambda _m: None
    )
    assert list(table["variant"]) == list(variants)
    assert set(table["path"]) >= {"compile (compiled: failed)", "all (compiled: failed)"}
    assert (table["tokens"] == 17).all() and (
        table["batch"] == 32
    ).all()  # 28 px / patch 7: 16 + CLS
    for r in table.to_dict("records"):
        assert 0 < r["images_per_s_min"] <= r["images_per_s_median"] <= r["images_per_s_max"], r
        assert math.isfinite(r["x_today"]) and math.isfinite(r["x_plain_timm"]), r
        assert r["rounds"] == 1 and r["plain_reference"] == "timm_fused"
    today = table.set_index("variant").loc["today"]
    assert today["x_today"] == 1.0, today["x_today"]


def test_skip_hooks_leaves_the_model_output_bitwise_unchanged():
    from workbench.models.registry import build_model, model_config

    torch.manual_seed(0)
    model = build_model(model_config("fmnist_vit", dim=32, depth=2, heads=2, mlp_hidden=64)).eval()
    x = torch.randn(3, 1, 28, 28)
    before = model(x)
    after = train_benchmark._skip_hooks(model)(x)
    diff = (before - after).abs().max().item()
    assert torch.equal(before, after), f"max |difference| {diff:.3g}"


def test_the_arms_are_the_seed_table_the_fmnist_cells_and_two_timm_arms():
    arms = train_benchmark.benchmark_arms()
    assert {"base", "p4_w96", "p16_w96", "p8_w192", "fmnist_vit", "fmnist_cnn"} <= set(arms)
    assert arms["timm_resnet10t"].model.name == "timm/resnet10t"
    assert arms["timm_vit_base"].model.overrides["embed_dim"] == 96


def test_the_cpu_is_named_and_the_run_is_logged(mlflow_store, tmp_path):
    machine = train_benchmark.cpu_description()
    assert machine["cpu_model"] and "lacks" not in machine["cpu_units"]
    # fmt: skip
    table = train_benchmark.bench_arm(
        "tiny",
        tiny_config(epochs=1),
        ("today", "fused_adamw"),
        rounds=1,
        steps=1,
        say=lambda _m: None,
    )
    load = Load(1.0, 2.0, 2)
    text = train_benchmark.markdown(table, machine, load)
    assert "| tiny | 17 | fp32 | fused_adamw |" in text, text
    assert "load average 1.00 at the start, 2.00 at the end, on 2 cores" in text, text
    # One round resolves nothing: each verdict and the use line say so.
    assert "- tiny: fused_adamw vs today: not resolved at this noise" in text, text
    assert "- tiny: use: either (not resolved)" in text, text
    (tmp_path / "results.csv").write_text(table.to_csv(index=False))
    (tmp_path / "summary.md").write_text(text)
    from tracking.kinds.benchmark_runs import log_train_benchmark

    decisions = train_benchmark.arm_decisions(table)
    run_id = log_train_benchmark(
        table, tmp_path, {"arms": "tiny"}, machine, decisions=decisions, load=load.as_dict()
    )
    run = mlflow.get_run(run_id)
    assert run.data.metrics["tiny/fused_adamw/images_per_s_median"] > 0
    assert run.data.metrics["load/start"] == 1.0 and run.data.metrics["load/end"] == 2.0
    assert run.data.metrics["verdict/tiny/fused_adamw_vs_today/resolved"] == 0.0
    assert run.data.tags["verdict.tiny.fused_adamw_vs_today"] == "not resolved"
    assert run.data.tags["use.tiny"] == "either (not resolved)"
    assert run.data.tags["machine.cpu_model"] == machine["cpu_model"]


def test_an_unknown_arm_or_variant_is_refused_in_one_line():
    from click.testing import CliRunner

    for option, value in (("--arms", "base,p5_w96"), ("--variants", "today,fast")):
        result = CliRunner().invoke(train_benchmark.benchmark_train, [option, value])
        assert result.exit_code == 2, result.output
        bad = value.split(",")[1]
        assert f"Invalid value for {option}: {bad!r} is not one of" in result.output, result.output
