"""The machine and the library versions a result was measured with."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


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
            "platform": platform.platform(), "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def versions() -> dict:
    import transformers
    import nanopaged
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "nanopaged": nanopaged.__version__}
    try:
        import vllm
        out["vllm"] = vllm.__version__
    except ImportError:
        pass
    return out
