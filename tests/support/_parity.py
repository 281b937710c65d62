"""Shared helpers for the parity tests: a parameter set with every awkward case, and a gradient script.

The script decides, for each step and each tensor, whether the gradient is None,
an explicit zero, or random; the same script drives OffloadAdamW and the torch
optimizer it is compared with, so any difference comes from the optimizers.
"""

from __future__ import annotations

import torch

from configs import assert_bitwise_equal, same_bits  # noqa: F401 (same_bits: the modules that import it here)

# name -> shape. Covers matrices, a bias, a 0-dim and a 0-element tensor.
SHAPES = {
    "w1": (16, 8),
    "b1": (16,),
    "w2": (4, 16),
    "scalar": (),
    "empty": (0, 3),
    "frozen_then_unfrozen": (8, 8),
    "zero_grad": (5,),
    "sometimes_none": (7, 3),
}
UNFREEZE_AT = 40


def make_params(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for name, shape in SHAPES.items()}


def groups_of(params: dict[str, torch.Tensor], named: bool = False) -> list[dict]:
    """Three groups with different hyperparameters (one with amsgrad)."""

    def pick(*names):
        return [(n, params[n]) for n in names] if named else [params[n] for n in names]

    return [
        {"params": pick("w1", "b1"), "lr": 1e-2, "weight_decay": 0.1},
        {"params": pick("w2", "scalar", "empty"), "lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0},
        {"params": pick("frozen_then_unfrozen", "zero_grad", "sometimes_none"), "weight_decay": 0.5, "amsgrad": True},
    ]


def gradient(name: str, step: int, shape, dtype: torch.dtype, seed: int = 1):
    """The scripted gradient of tensor ``name`` at ``step`` (None, zero, or random, in ``dtype``)."""
    if name == "zero_grad":
        return torch.zeros(shape, dtype=dtype)
    if name == "sometimes_none" and step % 3 == 0:
        return None
    if name == "frozen_then_unfrozen" and step < UNFREEZE_AT:
        return None
    gen = torch.Generator().manual_seed(seed * 100003 + step * 131 + sum(map(ord, name)))
    return (torch.randn(shape, generator=gen) * 0.1).to(dtype)


def assign_grads(params: dict[str, torch.Tensor], step: int, grad_dtype=None) -> None:
    for name, p in params.items():
        g = gradient(name, step, p.shape, p.dtype)
        p.grad = None if g is None else g.to(grad_dtype or p.dtype)


def assert_same_snapshot(a: dict, b: dict) -> None:
    """Two snapshots of a run (tensors by bits and dtype, everything else by value) are equal, key by key."""
    assert_bitwise_equal(a, b, "snapshot")
