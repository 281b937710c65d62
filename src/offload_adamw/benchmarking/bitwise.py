"""Bitwise comparisons of tensors, as the benchmarks' parity checks make them.

Contract: two floating tensors are equal when their bits are: the same shape and dtype and, element by
element, the same integer of the same width (so -0.0 differs from 0.0 and a NaN equals only the same NaN).
Tensors on any device are compared on the host; a non-contiguous tensor is compared by value, not layout.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["same_bits", "differing_elements", "max_abs_difference"]

_INTEGER_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
               torch.float16: torch.int16}


def _bits(t: Tensor) -> Tensor:
    """``t``'s elements as the integers of their bits, on the host."""
    return t.detach().cpu().contiguous().view(_INTEGER_OF[t.dtype])


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same shape, dtype and bits."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(_bits(a), _bits(b))


def differing_elements(a: Tensor, b: Tensor) -> int:
    """How many elements of ``a`` and ``b`` (one shape and dtype) differ in their bits."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype} {tuple(a.shape)} with {b.dtype} {tuple(b.shape)} element by element")
    return int((_bits(a) != _bits(b)).sum())


def max_abs_difference(a: Tensor, b: Tensor) -> float:
    """The largest ``|a - b|``, computed in float64 on the host (0.0 for empty tensors)."""
    d = (a.detach().cpu().double() - b.detach().cpu().double()).abs()
    return float(d.max()) if d.numel() else 0.0
