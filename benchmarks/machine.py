"""The machine and the library versions a result was measured with."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from nanopaged.cpu.features import bf16_matrix_units, cpu_flags


def machine_info(device: str) -> dict:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "device": device,
            "bf16_matrix_units": bf16_matrix_units(),        # the flags dtype="auto" reads
            "matrix_flags": sorted(f for f in cpu_flags() if f.startswith(("amx", "avx512_bf16", "avx512_vnni",
                                                                            "avx512_fp16", "avx2")))}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def versions() -> dict:
    import transformers
    import nanopaged
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "nanopaged": nanopaged.__version__}
    return out        # vLLM's version comes back with its figures (it runs in its own environment)
