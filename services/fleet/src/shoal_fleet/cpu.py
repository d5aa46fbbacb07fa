"""The engine precision this machine's CPU computes natively.

vLLM's CPU build runs bf16 models on any x86 CPU, but without AVX-512 BF16 or AMX it emulates
every bf16 operation in float32 and converts back, which makes decoding several times slower
than float32 itself. So a fleet started without ``--dtype`` takes bf16 only where the CPU says
it has the instructions.
"""

from __future__ import annotations

from pathlib import Path

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
"""CPU flags (``/proc/cpuinfo``) of bf16 arithmetic in hardware: x86's AMX and AVX-512 BF16,
and Arm's BF16 extension."""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first processor's feature flags (x86 ``flags``, Arm ``Features``); empty if unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_dtype(flags: set[str]) -> tuple[str, str]:
    """The engine dtype for a CPU with ``flags``, and why (a line for the start-up output)."""
    found = [flag for flag in NATIVE_BF16_FLAGS if flag in flags]
    if found:
        return "bfloat16", f"the CPU computes bf16 natively ({', '.join(found)})"
    return "float32", "the CPU has no bf16 instructions (amx_bf16, avx512_bf16), where bf16 is emulated"
