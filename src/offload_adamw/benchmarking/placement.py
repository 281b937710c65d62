"""The placement benchmark (``benchmarks/placement_bench.py``): one step of each placement over the same tensors.

Contract:

* :func:`run` makes one set of parameters in a transformer's mix of shapes (workload.transformer_shapes: square
  attention matrices, the MLP's rectangles, norm vectors, an embedding, odd-length vectors) in the model dtype on
  ``device`` (the CPU as device, or a GPU), with fixed gradients, and for each case of :data:`CASES` an
  OffloadAdamW over copies of them with that placement (``"mixed"``: the first third of the elements resident, the
  next streamed, the rest on the host). After ``warmup`` steps (state and buffers allocated) it times ``step()``
  ``repeats`` times per case, the cases in rotated order (benchmarking/timing.py).
* Per case: the median step time and its ratio to the host placement's; the bytes one step moves between host and
  device and the bytes it reads and writes in host memory, counted from the state and buffers the optimizer really
  holds (:func:`traffic`: for the host placement on a device its gradient copies in and parameter copies out, and
  its update's traffic over master, moments, gradient and model copy; for a streamed group its state out and back;
  nothing for a resident one); and ``device_buffer_bytes()`` as allocated. With the CPU as device no copy happens
  for the host placement and a resident group's state is host memory: the figures say what the same step moves on
  a device.
* Timings on a shared machine are not results: the lead measures on a quiet one (docs/placement.md says how).
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from offload_adamw.benchmarking.timing import time_rotated
from offload_adamw.benchmarking.workload import HYPER, transformer_shapes
from offload_adamw.optim import OffloadAdamW

__all__ = ["CASES", "PlacementConfig", "run", "traffic"]

#: case -> the placement of each third of the elements (one placement: all of them)
CASES: dict[str, tuple[str, ...]] = {
    "host": ("host",),
    "stream": ("stream",),
    "device": ("device",),
    "mixed": ("device", "stream", "host"),
}


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """What the benchmark builds and how often it steps."""

    elements: int = 16 << 20
    """Parameter elements, in a transformer's mix of shapes."""
    dtype: str = "bfloat16"
    """The model's dtype (the state is float32)."""
    device: str = "cpu"
    """Where the parameters and gradients live."""
    warmup: int = 1
    """Untimed steps per case (allocate state and buffers)."""
    repeats: int = 5
    """Timed steps per case, in rotated order."""
    chunk_bytes: int = 64 << 20
    """``stream_chunk_bytes``."""
    buffers: int = 2
    """``stream_buffers``."""

    def __post_init__(self) -> None:
        if not 64 <= self.elements:
            raise ValueError(f"elements must be at least 64, got {self.elements}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if not (0 <= self.warmup and 1 <= self.repeats):
            raise ValueError("warmup must be >= 0 and repeats >= 1")


def _groups(params: list[torch.nn.Parameter], thirds: tuple[str, ...]) -> list[dict[str, Any]]:
    total = sum(p.numel() for p in params)
    groups: list[dict[str, Any]] = [{"params": [], "update_on": placement} for placement in thirds]
    seen = 0
    for p in params:
        index = min(len(thirds) - 1, seen * len(thirds) // total)
        groups[index]["params"].append(p)
        seen += p.numel()
    return [g for g in groups if g["params"]]


def traffic(opt: OffloadAdamW) -> dict[str, int]:
    """Bytes one step moves between host and device, and reads and writes in host memory, by the state it holds."""
    transfers = host = 0
    for group in opt.param_groups:
        placement = group.get("update_on", "host")
        for p in group["params"]:
            state = opt.state.get(p, {})
            state_bytes = sum(v.numel() * v.element_size() for k, v in state.items() if k != "step")
            param_bytes = p.numel() * p.element_size()
            if placement == "host":
                # The update reads and writes master and moments (the parameter itself where it is its own master),
                # reads the gradient and writes the model copy: 28 bytes per element for bf16 or float32.
                own = "master_param" not in state
                host += 2 * (state_bytes + (param_bytes if own else 0)) + param_bytes + (0 if own else param_bytes)
                transfers += 2 * param_bytes if p.device.type != "cpu" else 0  # the gradient in, the parameter out
            elif placement == "stream":
                transfers += 2 * state_bytes  # the state out to the device and back
                host += 2 * state_bytes  # those copies read and write it in host memory
    return {"transfer_bytes_per_step": transfers, "host_bytes_per_step": host}


def run(config: PlacementConfig) -> dict[str, Any]:
    """Every case of :data:`CASES` over one set of tensors; the figures per case (see the module contract)."""
    dtype = getattr(torch, config.dtype)
    gen = torch.Generator().manual_seed(0)
    shapes = transformer_shapes(config.elements)
    base = [torch.nn.Parameter(torch.randn(s, generator=gen).mul_(0.02).to(config.device, dtype)) for s in shapes]
    grads = [torch.randn(s, generator=gen).mul_(1e-3).to(config.device, dtype) for s in shapes]
    optimizers: dict[str, OffloadAdamW] = {}
    for name, thirds in CASES.items():
        params = [torch.nn.Parameter(copy.deepcopy(p.detach())) for p in base]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizers[name] = OffloadAdamW(_groups(params, thirds), transfer_pipeline=True, stream_chunk_bytes=config.chunk_bytes,
                                        stream_buffers=config.buffers, **HYPER)

    def stepper(opt: OffloadAdamW) -> Any:
        def step() -> None:
            opt.step()
            if config.device == "cuda":
                torch.cuda.synchronize()
        return step

    samples, _ = time_rotated({n: stepper(o) for n, o in optimizers.items()}, config.warmup, config.repeats,
                              "placement bench")
    host_s = statistics.median(samples["host"])
    elements = sum(math.prod(s) for s in shapes)
    cases = []
    for name, opt in optimizers.items():
        median = statistics.median(samples[name])
        cases.append({
            "case": name, "placements": list(CASES[name]), "step_s": median, "step_ms_all": [t * 1e3 for t in samples[name]],
            "step_vs_host": median / host_s, **traffic(opt), "device_buffer_bytes": opt.device_buffer_bytes(),
            "host_state_bytes": opt.host_state_bytes(),
        })
    return {"elements": elements, "tensors": len(shapes), "cases": cases}
