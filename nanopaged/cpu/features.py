"""What this CPU's matrix units can do, read from its flags: the one place `dtype="auto"` and
the CPU linear kernels look.

Hosts of the same kind differ: an Intel Xeon with AMX multiplies bfloat16 matrices several
times faster than float32, while an AVX2-only AMD EPYC has no bfloat16 arithmetic at all and
runs it slower than float32. So nothing here assumes; it reads the flags Linux lists in
/proc/cpuinfo (docs/05_model_runner_and_kernels.md, "bfloat16 on the matrix units").
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

# The flags that give bfloat16 matmuls their own instructions, best first.
BF16_MATRIX_FLAGS = ("amx_bf16", "avx512_bf16")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first processor's flags, or none where /proc/cpuinfo is missing (not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def bf16_matrix_units() -> list[str]:
    """The bfloat16 matrix flags this CPU has (e.g. ['amx_bf16', 'avx512_bf16']), best first."""
    flags = cpu_flags()
    return [f for f in BF16_MATRIX_FLAGS if f in flags]


def auto_cpu_dtype() -> str:
    """`dtype="auto"` on CPU: bfloat16 where the matrix units multiply it, else float32."""
    return "bfloat16" if bf16_matrix_units() else "float32"
