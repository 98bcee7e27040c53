"""`workbench benchmark <name>`: one group of speed commands, lazy, with the old names kept a release."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from click import Context
from click.testing import CliRunner

from studies.cli import BENCHMARKS, OLD_BENCHMARK_NAMES, LAZY_COMMANDS, benchmark, main

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_help_lists_every_benchmark_and_imports_no_torch():
    code = """
import sys
from studies.cli import main
try:
    main(["benchmark", "--help"])
except SystemExit as e:
    assert e.code == 0, e.code
print("HEAVY", sorted(m for m in ("torch", "torchvision", "timm") if m in sys.modules))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "WORKBENCH_DEBUG": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HEAVY []" in proc.stdout, proc.stdout[-500:]
    listing = proc.stdout.split("Commands:")[1]
    for name in BENCHMARKS:
        assert f"  {name} " in listing, f"{name} missing from `workbench benchmark --help`"


def test_each_benchmarks_short_help_is_its_own_and_none_is_at_the_top_level():
    for name, (_, _, short) in BENCHMARKS.items():
        command = benchmark.get_command(Context(benchmark), name)
        assert command.get_short_help_str(limit=1000) == short, f"BENCHMARKS[{name!r}] drifted"
    assert not [n for n in LAZY_COMMANDS if n.startswith("benchmark-")]
    assert "benchmark" not in LAZY_COMMANDS  # a group, no longer the ViT timing itself


def test_the_old_names_run_the_same_command_with_a_note():
    for old, new in OLD_BENCHMARK_NAMES.items():
        result = CliRunner().invoke(main, [old, "--help"])
        assert result.exit_code == 0, result.output
        assert f"`workbench {old}` is now `workbench benchmark {new}`" in result.output
        command = benchmark.get_command(Context(benchmark), new)
        assert command.help.split("\n")[0][:40] in result.output
    result = CliRunner().invoke(main, ["benchmark", "--batch-size", "x"])
    assert result.exit_code != 0 and "is now `workbench benchmark vit [OPTIONS]`" in result.output
    assert "'x'" in result.output, result.output
