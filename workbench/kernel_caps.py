"""Cap this machine's kernels to the ones a recorded cell ran on (``reproduce --match-kernels``).

ATen, oneDNN and MKL each pick their code path from the CPU they find, and each can be capped by
an environment variable read when the library starts: ``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA`` and ``MKL_ENABLE_INSTRUCTIONS``. A cell's record holds its kernel identity
(``workbench.kernel_identity``); ``caps_for`` turns it into those three variables, so that a
newer CPU of the same vendor runs the older one's kernels (bitwise equal results were measured
so: an AVX2 AMD cell re-trained on an AVX512 AMD CPU under AVX2 caps). A cap cannot add an
instruction set: a cell recorded with AVX512 kernels on a CPU without AVX512 is refused. Across
vendors the caps still apply, but the libraries' per-vendor paths (MKL's above all) may differ,
so bitwise equality is not promised there (``notes``).

The variables only act when set before torch starts, so the caller starts a fresh process with
them (``studies/tools/reproduce.py``).
"""

from __future__ import annotations

from workbench.kernel_identity import PREFIX

# ATen's capability names -> (ATEN_CPU_CAPABILITY value, MKL_ENABLE_INSTRUCTIONS value, CPU flag it needs)
ATEN_CAPS = {
    "DEFAULT": ("default", "SSE4_2", None),
    "AVX2": ("avx2", "AVX2", "avx2"),
    "AVX512": ("avx512", "AVX512", "avx512f"),
}
CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


class KernelCapsError(ValueError):
    """A recorded kernel identity that this machine cannot be capped to (the message says why)."""


def onednn_cap(isa: str) -> str | None:
    """``ONEDNN_MAX_CPU_ISA`` for oneDNN's own description of the ISA it ran (its verbose ``isa:``).

    None for a description this table does not know (the caller refuses it rather than guess).
    """
    text = isa.lower()
    if "amx" in text:
        return "AVX512_CORE_AMX"
    if "avx10" in text or "avx-512" in text or "avx512" in text:
        if "bfloat16" in text:
            return "AVX512_CORE_BF16"
        if "dl boost" in text or "vnni" in text:
            return "AVX512_CORE_VNNI"
        return "AVX512_CORE"
    if "avx2" in text:
        return "AVX2_VNNI" if "vnni" in text or "dl boost" in text else "AVX2"
    if "avx" in text:
        return "AVX"
    if "sse4.1" in text or "sse41" in text:
        return "SSE41"
    return None


def _field(identity: dict[str, str], key: str) -> str:
    return identity.get(PREFIX + key, "")


def caps_for(recorded: dict[str, str], here: dict[str, str]) -> dict[str, str]:
    """The three cap variables that make this machine (identity ``here``) run ``recorded``'s kernels.

    A cap the record already set (``kernel.onednn_max_isa``, ``kernel.mkl_enable_instructions``)
    is kept as recorded.

    Raises:
        KernelCapsError: The record lacks a kernel identity, names kernels this table does not
            know, or needs an instruction set this CPU does not have.
    """
    if not recorded:
        raise KernelCapsError("the cell's record has no kernel identity (kernel.* params) to match")
    if _field(recorded, "device") not in ("", "cpu"):
        raise KernelCapsError(
            f"the cell ran on {_field(recorded, 'device')}: CPU kernel caps do not apply"
        )
    aten = _field(recorded, "aten_capability")
    if aten not in ATEN_CAPS:
        raise KernelCapsError(f"recorded ATen capability {aten!r} has no cap here")
    aten_value, mkl_value, needs = ATEN_CAPS[aten]
    if needs and _field(here, f"cpu_{needs}") != "true":
        raise KernelCapsError(
            f"the cell ran ATen's {aten} kernels ({_field(recorded, 'cpu_model')}); this CPU "
            f"({_field(here, 'cpu_model')}) has no {needs}: a cap cannot add an instruction set"
        )
    isa = _field(recorded, "onednn_isa")
    onednn = _field(recorded, "onednn_max_isa")
    if onednn in ("", "unset"):
        onednn = onednn_cap(isa)
        if onednn is None:
            raise KernelCapsError(f"recorded oneDNN ISA {isa!r} has no cap here")
    if onednn.startswith("AVX512") and _field(here, "cpu_avx512f") != "true":
        raise KernelCapsError(
            f"the cell ran oneDNN's {isa!r}; this CPU has no AVX512: a cap cannot add it"
        )
    if onednn == "AVX512_CORE_AMX" and _field(here, "cpu_amx_bf16") != "true":
        raise KernelCapsError(f"the cell ran oneDNN's {isa!r}; this CPU has no AMX")
    mkl = _field(recorded, "mkl_enable_instructions")
    return {
        "ATEN_CPU_CAPABILITY": aten_value,
        "ONEDNN_MAX_CPU_ISA": onednn,
        "MKL_ENABLE_INSTRUCTIONS": mkl if mkl not in ("", "unset") else mkl_value,
    }


def notes(recorded: dict[str, str], here: dict[str, str]) -> list[str]:
    """What the caps cannot match: another CPU vendor, other library builds."""
    out = []
    for key, what in (
        ("cpu_vendor", "CPU vendor"),
        ("torch", "torch build"),
        ("onednn_version", "oneDNN version"),
        ("mkl_version", "MKL version"),
    ):
        a, b = _field(recorded, key), _field(here, key)
        if a and b and a != b:
            out.append(f"{what} differs ({a} recorded, {b} here): bitwise equality is not expected")
    return out
