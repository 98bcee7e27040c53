"""Benchmark entry point: analytic FLOP counts, interleaved timing, and what a tiny run logs.

Nothing here asserts speed: timings on a shared machine are what the benchmark reports,
not something a test can hold to a limit.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch.utils.flop_counter import FlopCounterMode

from studies.benchmarks.vit_benchmark import benchmark
from workbench.bench import (
    BenchConfig,
    Goal,
    Spread,
    bf16_supported,
    build_bench_model,
    cnn_forward_flops,
    cnn_train_flops,
    matmul_peak,
    time_interleaved,
    vit_forward_flops,
    vit_train_flops,
)
from workbench.models.cnn import CNN
from workbench.models.registry import model_config
from workbench.models.vit import VisionTransformer, ViTConfig

# The analytic count covers exactly the products FlopCounterMode counts (convolutions and
# matmuls), so it should agree to rounding; the tolerance only absorbs float formatting.
REL_TOL = 1e-9

# fmt: skip
VIT_CONFIGS = {
    "fmnist_vit": model_config("fmnist_vit"),
    "cifar_vit": model_config("cifar_vit"),
    "vit_tiny_patch16_224": ViTConfig(dim=192, heads=3, depth=12),
    "mean_pool_registers": ViTConfig(
        image_size=32,
        patch_size=8,
        dim=48,
        depth=2,
        heads=4,
        num_classes=7,
        pooling="mean",
        class_token=False,
        register_tokens=4,
        mlp_ratio=3.0,
    ),
    "siglip_attention_pool": ViTConfig(
        image_size=32,
        patch_size=8,
        dim=48,
        depth=2,
        heads=4,
        num_classes=0,
        pooling="map",
        class_token=False,
        pool_mlp_hidden=100,
    ),
    "aimv2_swiglu_non_square": ViTConfig(
        image_size=(32, 48),
        patch_size=(8, 16),
        dim=48,
        depth=2,
        heads=4,
        mlp_layer="swiglu",
        mlp_hidden=64,
        norm_layer="rmsnorm",
    ),
    "dinov2_giant_packed_glu": ViTConfig(
        image_size=28,
        patch_size=14,
        dim=48,
        depth=2,
        heads=4,
        mlp_layer="glu",
        mlp_hidden=128,
        act="silu",
        glu_gate_last=False,
        layer_scale_init=1e-5,
    ),
}


def counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def assert_count(analytic: int, measured: int, what: str) -> None:
    rel = abs(analytic - measured) / measured
    assert rel <= REL_TOL, (
        f"{what}: analytic {analytic:,} vs FlopCounterMode {measured:,} (relative {rel:.3g})"
    )


@pytest.mark.parametrize("name", VIT_CONFIGS)
def test_vit_forward_flops_match_flop_counter(name):
    cfg = VIT_CONFIGS[name]
    model = VisionTransformer(cfg).eval()  # hand-written path: every product is a visible matmul
    batch = 2
    x = torch.randn(batch, cfg.in_channels, *cfg.image_hw)
    # grad mode: FlopCounterMode's module tracker needs it for the latent query
    measured = counted(lambda: model(x))
    flops = vit_forward_flops(cfg)
    assert flops["total"] == sum(v for k, v in flops.items() if k != "total")
    assert_count(batch * flops["total"], measured, f"{name} forward")


@pytest.mark.parametrize("name", ["fmnist_vit", "mean_pool_registers"])
def test_vit_train_flops_match_flop_counter(name):
    cfg = VIT_CONFIGS[name]
    model = VisionTransformer(cfg).train()
    batch = 3
    x = torch.randn(batch, cfg.in_channels, cfg.image_size, cfg.image_size)
    y = torch.randint(0, cfg.num_classes, (batch,))
    measured = counted(lambda: F.cross_entropy(model(x), y).backward())
    assert_count(batch * vit_train_flops(cfg), measured, f"{name} forward+backward")


@pytest.mark.parametrize("name,size", [("fmnist_cnn", 28), ("cifar_cnn", 32)])
def test_cnn_flops_match_flop_counter(name, size):
    cfg = model_config(name)
    model = CNN(cfg).train()
    x = torch.randn(2, cfg.in_channels, size, size)
    with torch.no_grad():
        assert_count(
            2 * cnn_forward_flops(cfg, size)["total"], counted(lambda: model(x)), f"{name} forward"
        )
    y = torch.randint(0, cfg.num_classes, (2,))
    measured = counted(lambda: F.cross_entropy(model(x), y).backward())
    assert_count(2 * cnn_train_flops(cfg, size), measured, f"{name} forward+backward")


def test_vit_base_flops_are_the_published_figure():
    # ViT-B/16 at 224 is quoted as "17.6 GFLOPs" (DeiT, fvcore), which counts one per
    # MAC: 17.56 GMACs, so 35.13 GFLOPs at 2 FLOPs per MAC.
    total = vit_forward_flops(ViTConfig())["total"]
    assert abs(total / 2e9 - 17.56) < 0.01, total


def test_bench_model_variants_share_weights_and_outputs():
    bench = build_bench_model("fmnist_vit")
    assert set(bench.variants) == {"glass_written", "glass_fast", "timm_unfused", "timm_fused"}
    assert bench.parameters == 105_546
    assert [b.attn.fused_attn for b in bench.variants["timm_fused"].blocks] == [True] * 3
    assert [b.attn.fused_attn for b in bench.variants["timm_unfused"].blocks] == [False] * 3
    x = torch.randn(4, 1, 28, 28)
    with torch.inference_mode():
        out = {k: m(x) for k, m in bench.variants.items()}
    # Same weights, same ops: hand-written equals timm unfused, fast path equals timm fused.
    for ours, theirs in (("glass_written", "timm_unfused"), ("glass_fast", "timm_fused")):
        diff = (out[ours] - out[theirs]).abs().max().item()
        assert diff == 0.0, f"{ours} vs {theirs}: max |difference| {diff:.3g}"


def test_cnn_bench_model_has_one_variant():
    bench = build_bench_model("fmnist_cnn")
    assert (
        list(bench.variants) == ["glass"] and bench.image_size == 28 and bench.parameters == 117_498
    )


def test_time_interleaved_rounds_are_aligned():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples = time_interleaved(fns, "cpu", repeats=4, warmup=1, min_sample_s=0.0)
    assert samples.inner == {"a": 1, "b": 1, "c": 1} and all(
        len(v) == 4 for v in samples.seconds.values()
    )
    timed = calls[3:]  # after one warm-up call each
    assert timed[:3] == ["a", "b", "c"] and timed[3:6] == ["b", "c", "a"], (
        "order must rotate each round"
    )
    assert all(r > 0 for r in samples.ratios("a", "b"))
    assert samples.ratios("a", "a") == [1.0] * 4


def test_time_interleaved_budget_keeps_three_rounds():
    fns = {"a": lambda: time.sleep(0.002), "b": lambda: time.sleep(0.002)}
    samples = time_interleaved(
        fns, "cpu", repeats=50, warmup=0, min_sample_s=0.0, max_seconds=0.001
    )
    assert [len(v) for v in samples.seconds.values()] == [3, 3]


def test_spread_quartiles():
    s = Spread.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.q1, s.q3, s.min, s.max) == (3.0, 2.0, 4.0, 1.0, 5.0)
    assert Spread.of([2.0]).iqr == 0.0


def test_matmul_peak_reports_positive_throughput():
    peaks = matmul_peak("cpu", 64, dtypes=("float32",), repeats=2, warmup=1)
    assert [p.dtype for p in peaks] == ["float32"] and peaks[0].tflops.median > 0


def test_goal_verdicts():
    assert Goal("k", "d", 1.02, "<=", 1.05, q1=0.9, q3=1.1).verdict == "yes"
    assert Goal("k", "d", 1.20, "<=", 1.05, q1=1.01, q3=1.3).verdict == "no (within noise)"
    assert Goal("k", "d", 1.20, "<=", 1.05, q1=1.10, q3=1.3).verdict == "no"
    assert (
        Goal("k", "d", 12.0, ">=", 10.0).verdict == "yes"
        and not Goal("k", "d", math.nan, ">=", 10.0).met
    )


def test_bench_config_validates():
    with pytest.raises(ValueError, match="batch_sizes"):
        BenchConfig(batch_sizes=(0,))
    with pytest.raises(ValueError, match="repeats"):
        BenchConfig(repeats=0)


def test_benchmark_quick_logs_metrics_and_artifacts(mlflow_store, tmp_path):
    threads = torch.get_num_threads()
    args = ["--quick", "--threads", "1", "--profile", "--output-dir", str(tmp_path / "files")]
    out = CliRunner().invoke(benchmark, args)
    assert out.exit_code == 0, out.output + repr(out.exception)
    assert torch.get_num_threads() == threads, "the thread setting must be restored"
    assert "## Goals:" in out.output and "| met |" in out.output

    runs = mlflow.search_runs(experiment_names=["benchmark"], output_format="list")
    assert len(runs) == 1
    run = runs[0]
    metrics, params, tags = run.data.metrics, run.data.params, run.data.tags
    assert (
        params["bench.quick"] == "True"
        and params["bench.torch_threads"] == "1"
        and tags["cpu_threads"] == "1"
    )
    assert params["bench.models"] == "fmnist_vit,fmnist_cnn"
    assert tags["machine.device"] == "cpu" and tags["machine.device_name"] and tags["torch_version"]

    ratios = {k: v for k, v in metrics.items() if "/ratio_to_timm" in k}
    assert "inference/fmnist_vit/b1/glass_fast/ratio_to_timm_fused" in ratios
    assert "train/fmnist_vit/b8/glass_written/ratio_to_timm_fused" in ratios
    assert all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
    # the reference itself
    assert metrics["inference/fmnist_vit/b1/timm_fused/ratio_to_timm_fused"] == 1.0
    assert metrics["matmul/float32/tflops_median"] > 0
    assert 0 < metrics["inference/fmnist_vit/b8/glass_fast/fraction_of_fp32_peak"]
    assert metrics["inference/fmnist_cnn/b8/glass/images_per_s"] > 0
    rows = pd.read_csv(tmp_path / "files" / "results.csv").set_index(
        ["section", "model", "batch", "variant"]
    )
    row = rows.loc[("inference", "fmnist_vit", 8, "glass_fast")]
    assert metrics["inference/fmnist_vit/b8/glass_fast/images_per_s"] == pytest.approx(
        row["images_per_s"]
    )
    assert metrics["inference/fmnist_vit/b8/glass_fast/ms_median"] == pytest.approx(
        1e3 * row["median_s"]
    )
    assert metrics["loader/ours_images_per_s"] > 0
    assert metrics["goals_total"] >= 5 and 0 <= metrics["goals_met"] <= metrics["goals_total"]
    assert any(k.startswith("goal/loader/") for k in metrics)

    client = mlflow.tracking.MlflowClient()
    logged = {Path(f.path).name for f in client.list_artifacts(run.info.run_id, "benchmark")}
    assert {
        "results.csv",
        "goals.csv",
        "matmul.csv",
        "summary.md",
        "benchmark.png",
        "machine.json",
    } <= logged
    local = Path(client.download_artifacts(run.info.run_id, "benchmark", str(tmp_path / "dl")))
    table = pd.read_csv(local / "results.csv")
    bf16 = bf16_supported(torch.device("cpu"))
    assert set(table["section"]) == {"inference", "train"} | (
        {"train_precision"} if bf16 else set()
    )
    if bf16:  # fp32 and bf16 autocast side by side, each against its own matmul peak
        for precision in ("fp32", "bf16"):
            assert 0 < metrics[f"train_precision/fmnist_vit/b8/{precision}/fraction_of_own_peak"]
            assert metrics[f"train_precision/fmnist_vit/b8/{precision}/images_per_s"] > 0
        assert metrics["train_precision/fmnist_vit/b8/fp32/speedup_vs_fp32"] == 1.0
        assert math.isfinite(metrics["train_precision/fmnist_vit/b8/bf16/speedup_vs_fp32"])
        assert metrics["matmul/bfloat16/tflops_median"] > 0
        assert (
            "## Training step, fp32 vs bf16 autocast" in out.output and "| x fp32 |" in out.output
        )
    vit = table[(table["model"] == "fmnist_vit") & table["section"].isin(["inference", "train"])]
    assert (vit["ratio_to_timm_fused"] > 0).all() and vit["ratio_to_timm_fused"].map(
        math.isfinite
    ).all()
    assert "| goal | measured |" in (local / "summary.md").read_text()
    # --quick runs 2 rounds: every comparison gets a verdict, none resolved, and a use line.
    assert "## Verdicts: what to use on this machine" in out.output, out.output
    assert (
        "- inference/fmnist_vit/b1: glass_fast vs timm_fused: not resolved at this noise"
        in out.output
    ), out.output
    assert "- inference/fmnist_vit/b1: use: either (not resolved)" in out.output, out.output
    assert "- inference/fmnist_cnn/b1: use: glass (the only option timed)" in out.output
    assert "- loader: use: either (not resolved)" in out.output, out.output
    assert tags["use.inference.fmnist_vit.b1"] == "either (not resolved)", tags
    assert tags["verdict.train.fmnist_vit.b8.glass_fast_vs_timm_fused"] == "not resolved"
    assert tags["use.loader"] == "either (not resolved)"
    assert metrics["verdict/inference/fmnist_vit/b1/glass_fast_vs_timm_fused/resolved"] == 0.0
    assert metrics["load/start"] >= 0 and metrics["load/end"] >= 0 and metrics["load/cores"] >= 1
    assert {"verdict", "verdict_low", "verdict_high", "use"} <= set(table.columns)
    assert (local / "benchmark.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "files" / "summary.md").exists()
    profiles = {
        Path(f.path).name for f in client.list_artifacts(run.info.run_id, "benchmark/profiles")
    }
    assert "fmnist_vit_glass_fast_b1.txt" in profiles and "fmnist_vit_timm_fused_b1.txt" in profiles


def test_precision_goal_is_the_bf16_speedup_and_skipped_without_bf16(monkeypatch):
    from workbench.bench import precision
    from workbench.bench.report import evaluate_goals

    row = {
        "section": "train_precision",
        "model": "cifar_vit",
        "batch": 128,
        "variant": "bf16",
        "speedup_vs_fp32": 1.9,
        "speedup_vs_fp32_q1": 1.7,
        "speedup_vs_fp32_q3": 2.0,
        "speedup_vs_fp32_best": 1.95,
    }
    (goal,) = evaluate_goals(pd.DataFrame(), pd.DataFrame(), None, "cpu", pd.DataFrame([row]))
    assert (
        goal.key == "train_precision/cifar_vit/b128/bf16_speedup_vs_fp32"
        and goal.op == ">="
        and goal.target == 1.8
    )
    assert goal.met and goal.measured == 1.9
    slower = pd.DataFrame([{**row, "speedup_vs_fp32": 1.5, "speedup_vs_fp32_q3": 1.85}])
    assert (
        evaluate_goals(pd.DataFrame(), pd.DataFrame(), None, "cpu", slower)[0].verdict
        == "no (within noise)"
    )
    monkeypatch.setattr(precision, "bf16_supported", lambda device: False)
    assert precision.run_precision(BenchConfig(precision_models=("fmnist_vit",)), 64).empty


def test_library_never_imports_mlflow():
    import workbench.bench

    for path in Path(workbench.bench.__file__).parent.glob("*.py"):
        assert "mlflow" not in path.read_text(), (
            f"{path.name} mentions mlflow: the library must not log"
        )
