"""A cell's kernel identity: which library builds and instruction sets computed its numbers.

The same code at one thread gives the same bits only on the same kernels, and no single string
says which kernels ran: ATen, MKL and oneDNN each pick their own code path from the CPU they
find (and from environment variables that cap it), and a GPU run depends on the card and the
CUDA and cuDNN builds. ``kernel_identity`` collects what decides it as one flat dict of
strings (logged as ``kernel.*`` params), and ``kernel_differences`` names the fields in which
two identities differ, which is what a re-training on another machine is judged by: equal
identities, bitwise equal results expected; any difference, numerical agreement at best.

How each field is found (all in this process, nothing written anywhere):

- ``torch``, ``torch_git``, ``torch_cuda_build``: ``torch.__version__``, ``torch.version``.
- ``cpu_vendor``, ``cpu_model``, ``cpu_family``, ``cpu_model_number``, ``cpu_stepping``,
  ``cpu_<flag>``: ``/proc/cpuinfo`` (the first processor). Family, model number and stepping
  tell two CPUs apart that share a marketing name (cloud CPUs often say only "Processor").
- ``aten_capability``: ``torch.backends.cpu.get_cpu_capability()`` (ATen's own vector kernels;
  capped by ``ATEN_CPU_CAPABILITY``).
- ``onednn_version``, ``mkl_version``: the build description ``torch.__config__.show()``.
- ``onednn_isa``: the instruction set oneDNN dispatches to is not exposed by torch's Python API
  (the library's ``dnnl_get_effective_cpu_isa`` is not exported), so it is read from oneDNN's
  own verbose header: verbose mode is switched on for one tiny reorder (``to_mkldnn`` of a
  tensor of ones: no random number is drawn, nothing that training computes is touched) while
  file descriptor 1 is redirected to a temporary file, and the ``isa:`` line is read back.
  Done once per process and cached. When the header cannot be seen (oneDNN printed it earlier
  in the process because ``ONEDNN_VERBOSE`` was set) the field says ``unknown``.
- ``onednn_max_isa``, ``mkl_cbwr``, ``mkl_enable_instructions``: the environment variables that
  cap the dispatch (``ONEDNN_MAX_CPU_ISA`` or ``DNNL_MAX_CPU_ISA``, ``MKL_CBWR``,
  ``MKL_ENABLE_INSTRUCTIONS``), ``unset`` when absent. MKL's own dispatch is not queryable in
  process; with ``MKL_CBWR`` unset MKL chooses its code path per CPU.
- ``threads``: ``torch.get_num_threads()``.
- on CUDA: ``gpu_name``, ``gpu_capability``, ``cuda``, ``cudnn``.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

PREFIX = "kernel."
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
UNSET = "unset"
UNKNOWN = "unknown"


def cpu_info(path: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's ``vendor_id``, ``model name``, ``cpu family``, ``model``, ``stepping``
    and ``flags`` (empty strings when unreadable)."""
    out = {
        "vendor_id": "",
        "model name": "",
        "cpu family": "",
        "model": "",
        "stepping": "",
        "flags": "",
    }
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block ends at the first blank line
        key, _, value = line.partition(":")
        key = key.strip()
        if key in out:
            out[key] = value.strip()
    return out


def build_versions(config: str | None = None) -> dict[str, str]:
    """oneDNN's and MKL's versions as torch's build description states them."""
    config = torch.__config__.show() if config is None else config
    onednn = re.search(r"MKL-DNN v(\S+)", config) or re.search(r"oneDNN v(\S+)", config)
    mkl = re.search(r"Math Kernel Library Version ([^\s-]+)(?:-Product Build (\d+))?", config)
    mkl_version = UNKNOWN
    if mkl:
        mkl_version = mkl.group(1) + (f" (build {mkl.group(2)})" if mkl.group(2) else "")
    return {
        "onednn_version": onednn.group(1) if onednn else "not built",
        "mkl_version": mkl_version if "Math Kernel Library" in config else "not built",
    }


def isa_from_verbose(text: str) -> str:
    """The ``isa:`` of oneDNN's verbose header (``onednn_verbose,v1,info,cpu,isa:Intel AVX2``)."""
    for line in text.splitlines():
        if ",cpu,isa:" in line:
            return line.split(",cpu,isa:", 1)[1].strip()
    return UNKNOWN


@functools.lru_cache(maxsize=1)
def onednn_isa() -> str:
    """The instruction set oneDNN dispatches to in this process (see the module docstring).

    oneDNN prints its header once per process: where this process's state hides it (the header
    went out earlier, or standard output is not a file), a fresh interpreter with the same
    environment (so the same ``ONEDNN_MAX_CPU_ISA``) is asked instead.
    """
    if not torch.backends.mkldnn.is_available():
        return "not built"
    found = _onednn_isa_here()
    return found if found != UNKNOWN else _onednn_isa_in_subprocess()


def _onednn_isa_in_subprocess() -> str:
    import subprocess

    code = "from workbench.kernel_identity import _onednn_isa_here; print(_onednn_isa_here())"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    lines = done.stdout.strip().splitlines()
    return lines[-1] if done.returncode == 0 and lines else UNKNOWN


def _onednn_isa_here() -> str:
    sys.stdout.flush()
    with tempfile.TemporaryFile() as capture:
        try:
            saved = os.dup(1)
        except OSError:  # no standard output to borrow (a daemon with fd 1 closed)
            return UNKNOWN
        try:
            os.dup2(capture.fileno(), 1)
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                torch.ones(2, 8).to_mkldnn()  # one reorder primitive: oneDNN prints its header
        except RuntimeError:
            return UNKNOWN
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        capture.seek(0)
        return isa_from_verbose(capture.read().decode("utf-8", "replace"))


def _env(*names: str) -> str:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return UNSET


def kernel_identity(device: torch.device | str = "cpu") -> dict[str, str]:
    """What decides the kernels that compute a run's numbers, as ``kernel.*`` strings.

    Args:
        device: The run's device; on CUDA the card, its compute capability and the CUDA and
            cuDNN versions are added.
    """
    device = torch.device(device)
    cpu = cpu_info()
    flags = set(cpu["flags"].split())
    info = {
        "device": device.type,
        "torch": torch.__version__,
        "torch_git": (torch.version.git_version or UNKNOWN)[:12],
        "torch_cuda_build": torch.version.cuda or "cpu-only",
        "cpu_vendor": cpu["vendor_id"] or UNKNOWN,
        "cpu_model": cpu["model name"] or UNKNOWN,
        "cpu_family": cpu["cpu family"] or UNKNOWN,
        "cpu_model_number": cpu["model"] or UNKNOWN,
        "cpu_stepping": cpu["stepping"] or UNKNOWN,
        **{f"cpu_{flag}": str(flag in flags).lower() for flag in CPU_FLAGS},
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        **build_versions(),
        "onednn_isa": onednn_isa(),
        "onednn_max_isa": _env("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"),
        "mkl_cbwr": _env("MKL_CBWR"),
        "mkl_enable_instructions": _env("MKL_ENABLE_INSTRUCTIONS"),
        "threads": str(torch.get_num_threads()),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        info |= {
            "gpu_name": torch.cuda.get_device_name(device),
            "gpu_capability": f"sm_{major}{minor}",
            "cuda": str(torch.version.cuda),
            "cudnn": str(torch.backends.cudnn.version()),
        }
    return {PREFIX + key: value for key, value in info.items()}


def recorded_identity(params: dict[str, str]) -> dict[str, str]:
    """The ``kernel.*`` entries of a run's params (empty for runs that predate them)."""
    return {k: v for k, v in params.items() if k.startswith(PREFIX)}


# Fields added after records existed: a record without them is not called different for that.
LATER_FIELDS = frozenset(PREFIX + k for k in ("cpu_family", "cpu_model_number", "cpu_stepping"))


def kernel_differences(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """``field: recorded -> current`` for every ``kernel.*`` field whose value differs (or is missing on one side).

    A field of ``LATER_FIELDS`` that the record predates is not compared.
    """
    out = []
    for key in sorted(set(recorded) | set(current)):
        if key in LATER_FIELDS and key not in recorded:
            continue
        a, b = recorded.get(key, "absent"), current.get(key, "absent")
        if a != b:
            out.append(f"{key.removeprefix(PREFIX)}: {a} -> {b}")
    return out


def kernel_summary(identity: dict[str, str]) -> str:
    """One short line for a report's runs table: CPU model, the ISAs, threads (or the GPU)."""
    if not identity:
        return "n/a"

    def get(key: str) -> str:
        return identity.get(PREFIX + key, "?")

    if get("device") == "cuda":
        return f"{get('gpu_name')} (CUDA {get('cuda')}, cuDNN {get('cudnn')}; torch {get('torch')})"
    amx = ", AMX" if get("cpu_amx_bf16") == "true" else ""
    return (
        f"{get('cpu_model')}; ATen {get('aten_capability')}, oneDNN {get('onednn_isa')}{amx}; "
        f"MKL CBWR {get('mkl_cbwr')}; torch {get('torch')}"
    )
