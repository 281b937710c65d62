"""The host-step benchmarks' workload: a transformer's mix of tensor shapes and the arrays of one step.

Contract: :func:`transformer_shapes` sums to exactly the asked number of elements; :data:`MIXES` names fixed
mixes of shapes (``llama-layers``: :func:`llama_layer_mix`); :func:`make_workload` is reproducible from its
seed (float32 master, moments at zero, float32 and bf16 gradients, bf16 model copy), over the shapes of a
size or of a mix; :data:`HYPER` and :func:`step_hyper` are the hyperparameters every case steps with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from offload_adamw.kernels.adamw import StepHyper

__all__ = ["BYTES_PER_ELEMENT", "MIB", "HYPER", "MIXES", "Workload", "transformer_shapes", "llama_layer_mix",
           "make_workload", "step_hyper", "format_size"]

BYTES_PER_ELEMENT = 28  # docs/contract.md#traffic-bill: the ideal traffic of one host step
MIB = 2**20


def transformer_shapes(total: int) -> list[tuple[int, ...]]:
    """A Llama-like mix of shapes summing to exactly ``total`` elements.

    Four decoder layers (attention q, k, v, o: d x d; MLP gate, up: f x d, down:
    d x f; two norms: d), a final norm, a tied embedding that takes what is left
    (rows x d), a vector of 1001 elements and one of the remainder (< d).
    """
    if total < 64:
        return [(total,)] if total > 0 else []
    d = 2 ** max(4, round(math.log2(math.sqrt(total) / 8)))
    f = math.ceil(8 * d / 3 / 256) * 256 if d >= 256 else 3 * d
    layer = [(d, d)] * 4 + [(f, d), (f, d), (d, f), (d,), (d,)]
    per_layer = sum(math.prod(s) for s in layer)
    layers = max(0, min(4, (total - d) // per_layer))
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += layer
    shapes.append((d,))
    left = total - sum(math.prod(s) for s in shapes)
    if left < 0:  # too small for even the final norm
        return [(total,)]
    odd = min(left, 1001)  # odd-length vectors, so that some tensors have a ragged SIMD tail
    rows, rest = divmod(left - odd, d)
    if rows:
        shapes.insert(0, (rows, d))
    shapes += [(n,) for n in (odd, rest) if n]
    return shapes


def llama_layer_mix() -> list[tuple[int, ...]]:
    """50.5 M elements in 30 tensors shaped like a Llama layer's: twice q (4096 x 4096), k and v (1024 x 4096,
    grouped-query attention), six vectors of the MLP's width (11008) and six of the model's (4096).

    Most elements are in a few large matrices and most tensors are small vectors: the mix where what a
    step spends per tensor shows, against torch's fused step over the same tensors.
    """
    half: list[tuple[int, ...]] = [(4096, 4096), (1024, 4096), (1024, 4096)]
    half.extend((width,) for width in [11008] * 6 + [4096] * 6)
    return 2 * half


#: Fixed mixes of tensor shapes a benchmark can time besides its sizes, by name.
MIXES: dict[str, list[tuple[int, ...]]] = {"llama-layers": llama_layer_mix()}


@dataclass
class Workload:
    """The shared arrays of one size."""

    shapes: list[tuple[int, ...]]
    master: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    grad32: list[torch.Tensor]
    grad16: list[torch.Tensor]
    model16: list[torch.Tensor]

    @property
    def elements(self) -> int:
        return sum(t.numel() for t in self.master)


def make_workload(total: int, seed: int = 0, shapes: list[tuple[int, ...]] | None = None) -> Workload:
    """The arrays of ``transformer_shapes(total)``, or of ``shapes`` where given (``total`` is then ignored)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = transformer_shapes(total) if shapes is None else list(shapes)

    def randn(shape, scale):
        return torch.randn(shape, generator=gen).mul_(scale)

    master = [randn(s, 0.02) for s in shapes]
    grad32 = [randn(s, 1e-3) for s in shapes]
    return Workload(
        shapes=shapes,
        master=master,
        exp_avg=[torch.zeros(s) for s in shapes],
        exp_avg_sq=[torch.zeros(s) for s in shapes],
        grad32=grad32,
        grad16=[g.to(torch.bfloat16) for g in grad32],
        model16=[m.to(torch.bfloat16) for m in master],
    )


HYPER: dict[str, Any] = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def step_hyper() -> StepHyper:
    """:data:`HYPER` as the kernels take it."""
    return StepHyper(
        lr=HYPER["lr"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
    )


def format_size(n: int) -> str:
    """16777216 -> '16M' (K, M, G = 2**10, 2**20, 2**30 where they divide), else the number."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
