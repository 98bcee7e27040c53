"""reproduce --match-kernels: a recorded kernel identity turned into ATen / oneDNN / MKL caps, refused
where this CPU cannot run the recorded kernels, and applied in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from studies.runtime.kernel_match import (
    CAPS_APPLIED,
    KernelsCannotMatch,
    KernelsToMatch,
    check_takeover,
    restart_with,
)
from studies.tools import reproduce
from workbench.kernel_caps import KernelCapsError, caps_for, notes, onednn_cap
from workbench.kernel_identity import cpu_info, kernel_differences

AMD_AVX2 = {
    "kernel.device": "cpu",
    "kernel.cpu_vendor": "AuthenticAMD",
    "kernel.cpu_model": "AMD EPYC",
    "kernel.cpu_avx2": "true",
    "kernel.cpu_avx512f": "false",
    "kernel.cpu_amx_bf16": "false",
    "kernel.aten_capability": "AVX2",
    "kernel.onednn_isa": "Intel AVX2",
    "kernel.onednn_max_isa": "unset",
    "kernel.mkl_enable_instructions": "unset",
    "kernel.torch": "2.14.1+cu130",
}
INTEL_AMX = AMD_AVX2 | {
    "kernel.cpu_vendor": "GenuineIntel",
    "kernel.cpu_model": "Intel(R) Xeon(R) Processor",
    "kernel.cpu_avx512f": "true",
    "kernel.cpu_amx_bf16": "true",
    "kernel.aten_capability": "AVX512",
    "kernel.onednn_isa": "Intel AVX10.1 and Intel AMX with bfloat16 and 8-bit integer support",
}
AMD_AVX512 = AMD_AVX2 | {"kernel.cpu_avx512f": "true", "kernel.aten_capability": "AVX512"}


def test_an_older_cpus_record_caps_a_newer_cpu_of_the_same_vendor_with_nothing_to_note():
    assert caps_for(AMD_AVX2, AMD_AVX512) == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert notes(AMD_AVX2, AMD_AVX512) == []
    # across vendors the caps apply, and the note says bitwise equality is not expected
    assert caps_for(AMD_AVX2, INTEL_AMX)["ATEN_CPU_CAPABILITY"] == "avx2"
    assert notes(AMD_AVX2, INTEL_AMX) == [
        "CPU vendor differs (AuthenticAMD recorded, GenuineIntel here): bitwise equality is not expected"
    ]


def test_a_cap_cannot_add_an_instruction_set_and_unknown_kernels_are_refused():
    with pytest.raises(
        KernelCapsError, match="has no avx512f: a cap cannot add an instruction set"
    ):
        caps_for(INTEL_AMX, AMD_AVX2)
    with pytest.raises(KernelCapsError, match="this CPU has no AMX"):
        caps_for(INTEL_AMX, AMD_AVX512 | {"kernel.cpu_vendor": "GenuineIntel"})
    with pytest.raises(KernelCapsError, match="no kernel identity"):
        caps_for({}, AMD_AVX2)
    with pytest.raises(KernelCapsError, match="oneDNN ISA 'Some future ISA' has no cap"):
        caps_for(AMD_AVX2 | {"kernel.onednn_isa": "Some future ISA"}, AMD_AVX2)
    assert caps_for(INTEL_AMX, INTEL_AMX)["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_AMX"


@pytest.mark.parametrize(
    ("isa", "cap"),
    [
        ("Intel AVX2", "AVX2"),
        ("Intel AVX2 with Intel DL Boost", "AVX2_VNNI"),
        ("Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions", "AVX512_CORE"),
        ("Intel AVX-512 with Intel DL Boost", "AVX512_CORE_VNNI"),
        ("Intel AVX-512 with Intel DL Boost and bfloat16 support", "AVX512_CORE_BF16"),
        ("Intel AVX10.1 and Intel AMX with bfloat16 and 8-bit integer support", "AVX512_CORE_AMX"),
    ],
)
def test_onednn_descriptions_map_to_their_caps(isa, cap):
    assert onednn_cap(isa) == cap


def test_family_model_and_stepping_are_recorded_and_older_records_are_not_called_different(
    tmp_path,
):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
        "stepping\t: 1\nflags\t\t: avx2\n\nvendor_id\t: other\n"
    )
    got = cpu_info(info)
    assert (got["cpu family"], got["model"], got["stepping"]) == ("25", "17", "1")
    now = AMD_AVX2 | {
        "kernel.cpu_family": "25",
        "kernel.cpu_model_number": "17",
        "kernel.cpu_stepping": "1",
    }
    assert kernel_differences(AMD_AVX2, now) == []
    assert kernel_differences(now | {"kernel.cpu_stepping": "2"}, now) == ["cpu_stepping: 2 -> 1"]


def test_the_command_restarts_itself_once_under_the_caps(monkeypatch):
    here = AMD_AVX512 | {"kernel.cpu_model": "AMD EPYC 9004"}
    monkeypatch.setattr(reproduce, "kernel_identity", lambda device: here)
    for name in reproduce.CAP_VARIABLES_AND_MARK:
        monkeypatch.delenv(name, raising=False)
    started = {}

    def execve(path, argv, env):
        started.update(path=path, argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(
        sys, "argv", ["workbench", "reproduce", "--match-kernels", "--cells", "a/seed0"]
    )
    with pytest.raises(SystemExit):
        reproduce.apply_recorded_caps([AMD_AVX2])
    assert started["argv"][1:] == [
        "-m",
        "studies.cli",
        "reproduce",
        "--match-kernels",
        "--cells",
        "a/seed0",
    ]
    assert {
        k: started["env"][k]
        for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    } == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    # the restarted process: caps in force, ATen reports the recorded capability
    monkeypatch.setattr(
        reproduce, "kernel_identity", lambda device: here | {"kernel.aten_capability": "AVX2"}
    )
    for k, v in started["env"].items():
        if k in reproduce.CAP_VARIABLES_AND_MARK:
            monkeypatch.setenv(k, v)
    reproduce.apply_recorded_caps([AMD_AVX2])  # goes on, no second restart
    # caps set but not in force (ATen still AVX512): refused, no loop
    monkeypatch.setattr(reproduce, "kernel_identity", lambda device: here)
    with pytest.raises(Exception, match="ATen runs AVX512 under"):
        reproduce.apply_recorded_caps([AMD_AVX2])


@pytest.mark.skipif("avx2" not in cpu_info()["flags"].split(), reason="this CPU has no AVX2")
def test_the_caps_take_effect_in_a_fresh_process():
    code = (
        "import torch; from workbench.kernel_identity import kernel_identity as k; i = k();"
        "print(i['kernel.aten_capability'], '|', i['kernel.onednn_isa'])"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    aten, isa = (part.strip() for part in done.stdout.strip().splitlines()[-1].split("|"))
    assert aten == "AVX2" and onednn_cap(isa) == "AVX2", done.stdout


# --- worker --match-kernels: the decision on a taken-over cell (studies.runtime.kernel_match) ---

AVX2_CAPS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def without_caps(monkeypatch):
    for name in AVX2_CAPS:
        monkeypatch.delenv(name, raising=False)


def test_a_takeover_on_the_same_kernels_trains_and_one_on_wider_kernels_restarts_under_caps(
    monkeypatch,
):
    without_caps(monkeypatch)
    check_takeover(AMD_AVX2, AMD_AVX2, "vit/seed0")  # the same dispatch: nothing to do
    check_takeover({}, AMD_AVX512, "vit/seed0")  # a record older than kernel identities
    with pytest.raises(KernelsToMatch) as asked:
        check_takeover(AMD_AVX2, AMD_AVX512, "vit/seed0")
    assert asked.value.caps == AVX2_CAPS and asked.value.cell == "vit/seed0"
    # started again under them: ATen and oneDNN now run the recorded kernels, so it trains
    for name, value in AVX2_CAPS.items():
        monkeypatch.setenv(name, value)
    capped_here = AMD_AVX512 | {
        "kernel.aten_capability": "AVX2",
        "kernel.onednn_max_isa": "AVX2",
        "kernel.mkl_enable_instructions": "AVX2",
    }
    check_takeover(AMD_AVX2, capped_here, "vit/seed0")
    # caps in force that did not give the recorded dispatch: refused, not started again
    with pytest.raises(KernelsCannotMatch, match=r"runs aten_capability AVX512 \(recorded AVX2\)"):
        check_takeover(AMD_AVX2, AMD_AVX512 | {"kernel.onednn_max_isa": "AVX2"}, "vit/seed0")


def test_kernels_no_cap_reaches_are_refused_and_a_native_record_of_this_cpu_drops_the_caps(
    monkeypatch,
):
    without_caps(monkeypatch)
    with pytest.raises(KernelsCannotMatch, match="vit/seed1: --match-kernels: .*no avx512f"):
        check_takeover(INTEL_AMX, AMD_AVX2, "vit/seed1")
    # begun uncapped on a CPU like this one, taken by a worker that runs under caps: no caps at all
    for name, value in AVX2_CAPS.items():
        monkeypatch.setenv(name, value)
    capped = INTEL_AMX | {"kernel.aten_capability": "AVX2", "kernel.onednn_isa": "Intel AVX2"}
    with pytest.raises(KernelsToMatch) as asked:
        check_takeover(INTEL_AMX, capped | {"kernel.onednn_max_isa": "AVX2"}, "vit/seed1")
    assert asked.value.caps == {}


def test_a_restart_sets_exactly_the_caps_and_is_refused_when_they_did_not_take(monkeypatch):
    started = {}

    def execve(path, argv, env):
        started.update(argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(sys, "argv", ["workbench", "worker", "--match-kernels"])
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX512")  # a cap the new caps do not name
    monkeypatch.delenv(CAPS_APPLIED, raising=False)
    with pytest.raises(SystemExit):
        restart_with({"ATEN_CPU_CAPABILITY": "avx2"}, print)
    assert started["argv"][1:] == ["-m", "studies.cli", "worker", "--match-kernels"]
    assert started["env"]["ATEN_CPU_CAPABILITY"] == "avx2"
    assert "MKL_ENABLE_INSTRUCTIONS" not in started["env"]
    monkeypatch.setenv(CAPS_APPLIED, started["env"][CAPS_APPLIED])
    with pytest.raises(RuntimeError, match="did not take effect"):
        restart_with({"ATEN_CPU_CAPABILITY": "avx2"}, print)


@pytest.mark.slow  # four fresh processes that each build a model and time a step: 10 to 30 s
@pytest.mark.skipif(
    "avx512f" not in cpu_info()["flags"].split(), reason="AVX2 caps change nothing without AVX512"
)
def test_the_caps_benchmark_times_both_in_fresh_processes_and_shows_the_kernels_each_ran(
    tmp_path, monkeypatch
):
    from click.testing import CliRunner
    from mlflow.tracking import MlflowClient

    from studies.benchmarks.kernel_caps_benchmark import benchmark_kernel_caps

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("PYTHONPATH", root)
    for name in AVX2_CAPS:
        monkeypatch.delenv(name, raising=False)
    protocol = os.path.join(root, "studies", "protocols", "smoke.yaml")
    result = CliRunner().invoke(
        benchmark_kernel_caps, ["--protocol", protocol, "--rounds", "1", "--steps", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "avx2: ATen AVX2, oneDNN Intel AVX2" in result.output, result.output
    assert "uncapped: ATen AVX512" in result.output, result.output
    assert "avx2 vs uncapped: not resolved at this noise" in result.output  # 1 round: no interval
    (run,) = MlflowClient(uri).search_runs(
        [MlflowClient(uri).get_experiment_by_name("kernel-caps-benchmark").experiment_id]
    )
    ratio = run.data.metrics["verdict/vit/avx2_vs_uncapped/ratio"]
    steps = MlflowClient(uri).get_metric_history(run.info.run_id, "step_seconds/avx2")
    reference = MlflowClient(uri).get_metric_history(run.info.run_id, "step_seconds/uncapped")
    assert abs(ratio - steps[0].value / reference[0].value) < 1e-12, ratio
