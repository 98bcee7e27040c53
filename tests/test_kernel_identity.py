"""A cell's kernel identity: each field read the way the module says, and differences named."""

from __future__ import annotations

import os

import torch

from workbench import kernel_identity

CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: not the first processor
flags\t\t: fpu
"""

CONFIG = """\
PyTorch built with:
  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605 for Intel(R) 64
  - Intel(R) MKL-DNN v3.12.0 (Git Hash 80afa71049cd69a3df32adcccb623b12cd7baa22)
"""


def test_cpuinfo_is_read_from_the_first_processor(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    info = kernel_identity.cpu_info(path)
    assert info["vendor_id"] == "GenuineIntel"
    assert info["model name"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"avx2", "avx512f", "avx512_bf16", "amx_bf16"} <= set(info["flags"].split())
    assert kernel_identity.cpu_info(tmp_path / "absent") == {
        "vendor_id": "",
        "model name": "",
        "cpu family": "",
        "model": "",
        "stepping": "",
        "flags": "",
    }


def test_library_versions_come_from_the_build_description():
    assert kernel_identity.build_versions(CONFIG) == {
        "onednn_version": "3.12.0",
        "mkl_version": "2024.2 (build 20240605)",
    }
    assert kernel_identity.build_versions("PyTorch built with:\n  - GCC 13\n") == {
        "onednn_version": "not built",
        "mkl_version": "not built",
    }


def test_the_onednn_isa_is_read_from_its_verbose_header():
    header = (
        "onednn_verbose,v1,info,oneDNN v3.12.0 (commit 80afa710)\n"
        "onednn_verbose,v1,info,cpu,runtime:OpenMP,nthr:1\n"
        "onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions\n"
    )
    assert kernel_identity.isa_from_verbose(header) == (
        "Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions"
    )
    assert kernel_identity.isa_from_verbose("nothing printed") == "unknown"


def test_this_process_identity_matches_torch_and_draws_no_random_number(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    kernel_identity.onednn_isa.cache_clear()
    state = torch.random.get_rng_state()
    identity = kernel_identity.kernel_identity("cpu")
    assert torch.equal(torch.random.get_rng_state(), state), "the oneDNN probe drew a random number"
    assert all(k.startswith("kernel.") and isinstance(v, str) for k, v in identity.items())
    assert identity["kernel.torch"] == torch.__version__
    assert identity["kernel.aten_capability"] == torch.backends.cpu.get_cpu_capability()
    assert identity["kernel.threads"] == str(torch.get_num_threads())
    assert identity["kernel.mkl_cbwr"] == "COMPATIBLE"
    assert identity["kernel.onednn_max_isa"] == "AVX2"
    assert identity["kernel.mkl_enable_instructions"] == os.environ.get(
        "MKL_ENABLE_INSTRUCTIONS", "unset"
    )
    for flag in kernel_identity.CPU_FLAGS:
        assert identity[f"kernel.cpu_{flag}"] in ("true", "false")
    if torch.backends.mkldnn.is_available():
        # The probe really saw oneDNN's header: an instruction set name, not "unknown".
        assert identity["kernel.onednn_isa"] not in ("unknown", "not built"), identity
    assert "kernel.gpu_name" not in identity  # a CPU run names no GPU
    assert (
        kernel_identity.kernel_identity("cpu")["kernel.onednn_isa"] == identity["kernel.onednn_isa"]
    )


def test_differences_name_each_field_with_both_values():
    a = {"kernel.cpu_model": "AMD EPYC", "kernel.onednn_isa": "AVX-512", "kernel.threads": "1"}
    b = {
        "kernel.cpu_model": "Intel Xeon",
        "kernel.onednn_isa": "AVX-512",
        "kernel.mkl_cbwr": "AVX2",
    }
    assert kernel_identity.kernel_differences(a, b) == [
        "cpu_model: AMD EPYC -> Intel Xeon",
        "mkl_cbwr: absent -> AVX2",
        "threads: 1 -> absent",
    ]
    assert kernel_identity.kernel_differences(a, dict(a)) == []
    assert kernel_identity.recorded_identity({"kernel.threads": "1", "threads": "1"}) == {
        "kernel.threads": "1"
    }
    assert (
        "AMD EPYC" in kernel_identity.kernel_summary(a)
        and kernel_identity.kernel_summary({}) == "n/a"
    )
