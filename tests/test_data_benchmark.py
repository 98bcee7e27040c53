"""Smoke test of the loader benchmark entry point (tiny sizes; it measures, never asserts speed)."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from studies.benchmarks.data_benchmark import benchmark_loader, format_table, run_loader_benchmark


def test_run_loader_benchmark_returns_figures():
    threads = torch.get_num_threads()
    result = run_loader_benchmark(
        n_images=64, batch_size=32, repeats=1, device="cpu", torch_threads=1
    )
    assert torch.get_num_threads() == threads, "thread setting must be restored"
    assert result["ours_images_per_s"] > 0 and result["torchvision_images_per_s"] > 0
    assert (
        abs(result["ratio"] - result["ours_images_per_s"] / result["torchvision_images_per_s"])
        < 1e-9
    )
    assert "ratio ours / torchvision" in format_table(result)
    assert "randaugment_images_per_s" not in result, "RandAugment is timed only when asked for"


def test_randaugment_is_timed_beside_the_plain_loader_in_the_same_rounds():
    result = run_loader_benchmark(
        n_images=32, batch_size=16, repeats=1, device="cpu", torch_threads=1, randaugment_ops=2
    )
    assert len(result["randaugment_seconds"]) == len(result["ours_seconds"]) == 1
    expected = result["ours_images_per_s"] / result["randaugment_images_per_s"]
    assert abs(result["randaugment_slowdown"] - expected) < 1e-9, (
        result["randaugment_slowdown"],
        expected,
    )
    assert "RandAugment cost" in format_table(result)


def test_benchmark_command_prints_table():
    out = CliRunner().invoke(benchmark_loader, ["--n-images", "32", "--batch-size", "16", "--repeats", "1",
                                                "--device", "cpu"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "workbench TensorLoader" in out.output and "torchvision v2" in out.output
    assert "+ RandAugment (2 ops, magnitude 9" in out.output, out.output


def test_benchmark_module_does_not_import_mlflow():
    from studies.benchmarks import data_benchmark

    assert "mlflow" not in open(data_benchmark.__file__).read()


def test_benchmark_command_takes_threads_and_prints_load_verdicts_and_use():
    args = ["--n-images", "32", "--batch-size", "16", "--repeats", "1", "--device", "cpu",
            "--randaugment-ops", "0"]  # fmt: skip
    before = torch.get_num_threads()
    try:
        out = CliRunner().invoke(benchmark_loader, [*args, "--threads", "1"])
        assert out.exit_code == 0, out.output
        assert "load average" in out.output and "at the end" in out.output, out.output
        # One round: nothing is resolved, and the use line says so.
        assert "torchvision vs TensorLoader: not resolved at this noise" in out.output, out.output
        assert "loader: use: either (not resolved)" in out.output, out.output
        old = CliRunner().invoke(benchmark_loader, [*args, "--torch-threads", "1"])
        assert old.exit_code == 0, old.output
        assert "--torch-threads is now --threads" in old.output, old.output
    finally:
        torch.set_num_threads(before)
