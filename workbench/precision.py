"""Numerics and threads of a training run: which autocast dtype, whether the device can do it.

``amp: bf16`` means bf16 autocast wherever the device has native bf16 matrix units: CUDA
GPUs that report bf16 support, and CPUs with AVX512-BF16 or AMX (oneDNN's bf16 kernels).
Elsewhere bf16 matmuls are emulated and slower than fp32, so asking for them is refused
with one clear line instead of silently training slower (or silently in fp32).

``amp: fp16`` is a GPU setting (with a gradient scaler). On CPU it is refused: oneDNN has
no fast fp16 training path on the CPUs this workbench targets, and bf16 (same exponent
range as fp32, no scaler needed) is the CPU precision to ask for.
"""

from __future__ import annotations

from pathlib import Path

import torch

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class AmpUnsupported(ValueError):
    """The requested autocast precision cannot run (natively) on this device."""


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("flags"):
            return line
    return ""


def cpu_bf16_supported() -> bool:
    """Whether this CPU has native bf16 matmul kernels (AVX512-BF16 or AMX) that torch can use.

    oneDNN's own check is the authority (it is what autocast's kernels dispatch on); the
    cpuinfo flags are the fallback where torch does not expose it.
    """
    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    if check is not None:
        try:
            return bool(check())
        except (RuntimeError, AttributeError):
            pass
    flags = _cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_supported(device: torch.device | str) -> bool:
    """bf16 runs natively on ``device``: CUDA devices that report it, CPUs per ``cpu_bf16_supported``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_bf16_supported()
    return False


def resolve_amp(amp: str, device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype for ``amp`` ("off", "bf16", "fp16") on ``device``, or None for fp32.

    Raises:
        AmpUnsupported: bf16 on a device without native bf16, fp16 on CPU, any autocast on
            a device type the workbench does not train on with autocast (e.g. MPS).
    """
    if amp in (None, "off"):
        return None
    if amp not in AMP_DTYPES:
        raise AmpUnsupported(f"run.amp={amp!r}: must be 'off', 'bf16' or 'fp16'")
    device = torch.device(device)
    if device.type == "cuda":
        if amp == "bf16" and not bf16_supported(device):
            raise AmpUnsupported(
                f"run.amp='bf16': {torch.cuda.get_device_name(device)} has no native bf16; "
                "use amp: fp16 or amp: off"
            )
        return AMP_DTYPES[amp]
    if device.type == "cpu":
        if amp == "fp16":
            raise AmpUnsupported(
                "run.amp='fp16' is a GPU setting; on CPU use amp: bf16 (needs AVX512-BF16 or AMX) "
                "or amp: off"
            )
        if not cpu_bf16_supported():
            raise AmpUnsupported(
                f"run.amp='bf16': this CPU ({cpu_name()}) has no native bf16 (AVX512-BF16 or AMX), "
                "so bf16 would be emulated and slower than fp32; use amp: off"
            )
        return torch.bfloat16
    raise AmpUnsupported(
        f"run.amp={amp!r}: autocast is supported on cuda and cpu, not {device.type}; use amp: off"
    )


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def device_capability(device: torch.device | str) -> dict[str, str]:
    """What the run's device can do, as strings (recorded as run tags).

    ``device.bf16_native`` says whether ``amp: bf16`` can run there; on CPU the oneDNN ISA
    level and the bf16/AMX flags say which units a bf16 run used.
    """
    device = torch.device(device)
    info = {"device.type": device.type, "device.bf16_native": str(bf16_supported(device)).lower()}
    if device.type == "cpu":
        flags = _cpu_flags().split()
        info |= {
            "device.cpu_name": cpu_name(),
            "device.cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "device.cpu_avx512_bf16": str("avx512_bf16" in flags).lower(),
            "device.cpu_amx_bf16": str("amx_bf16" in flags).lower(),
            "device.mkldnn": str(torch.backends.mkldnn.is_available()).lower(),
        }
    elif device.type == "cuda":
        info["device.cuda_name"] = torch.cuda.get_device_name(device)
    return info


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (``None`` or 0 keeps the current setting); returns the count in effect.

    On a shared machine torch's default (one thread per core) oversubscribes the cores and
    can make training several times slower than one thread.
    """
    if threads is not None and threads < 0:
        raise ValueError(f"threads={threads!r}: must be >= 0 (0 keeps torch's default)")
    if threads:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()
