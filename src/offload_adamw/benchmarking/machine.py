"""What a benchmark's figures were measured on: the CPU, its threads, torch and Python, the load."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

__all__ = ["cpu_model", "machine_info"]


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo, or None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    """The host-step benchmark's description of the machine (the CPU, its threads, torch, Python, the load)."""
    return {
        "cpu": cpu_model() or platform.processor(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
