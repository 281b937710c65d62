"""What a benchmark's figures were measured on: the CPU, its threads, torch and Python, the load."""

from __future__ import annotations

import os
import platform

import torch

__all__ = ["machine_info"]


def machine_info() -> dict:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
