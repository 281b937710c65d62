"""Element pairing by index, whatever the strides: the layout rules of the host kernels.

Contract:

* The kernels pair the elements of master, gradient, moments and model copy by index, as
  torch's element-wise operations do, for any strides of any of them. torch's fused AdamW op
  pairs elements by memory offset (it walks each tensor's memory from its first element), which
  is the same pairing only for tensors of one dense, non-overlapping layout.
* :func:`align` brings one tensor's set to one such layout, the master's as ``torch.zeros_like``
  lays it out (:func:`zeros_like_strides`: the master's own strides where it is dense). Where they
  already share it (the state is laid out like its parameter, optim/state.py) it returns the same
  tensors, no copy; otherwise each tensor that differs is replaced by a temporary in that layout,
  filled where it is read, and written back by :meth:`Aligned.write_back` where it is written.
* Hence the bits: torch's fused op computes the last ``numel % 16`` elements in memory order with
  its scalar tail, whose arithmetic differs from its vector loop in rare last bits, so the result is
  that of torch's fused AdamW on tensors in that layout: on the parameter itself for a dense
  parameter with a gradient of its layout (what autograd gives), exactly as torch computes.
* :func:`flat` is the memory-order flat view of a dense tensor: element k is the k-th element in
  memory, so two tensors of one layout pair by index through their flat views too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["Aligned", "align", "flat", "is_dense", "same_layout", "zeros_like_strides"]


def is_dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory exactly once (any order of dimensions)."""
    if t.numel() <= 1:
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether the element at each index lies at the same offset from the start in ``a`` and ``b``
    (strides of dimensions of size 1 do not matter; nor does anything for empty tensors)."""
    if a.shape != b.shape:
        return False
    return _has_strides(a, b.stride())


def zeros_like_strides(t: Tensor) -> tuple[int, ...]:
    """The strides ``torch.zeros_like(t)`` gives: ``t``'s own for a dense ``t``, else a dense layout in
    ``t``'s order of dimensions (computed on the meta device: nothing is allocated)."""
    return tuple(torch.empty_like(t, device="meta").stride())


def _has_strides(t: Tensor, strides: Sequence[int]) -> bool:
    return t.numel() <= 1 or all(a == b for a, b, n in zip(t.stride(), strides, t.shape) if n != 1)


def flat(t: Tensor) -> Tensor:
    """The memory-order flat view of the dense tensor ``t`` (no copy)."""
    # Dense with non-negative strides: the element at index 0 is the lowest address, and the
    # elements fill the next numel() places.
    return t.as_strided((t.numel(),), (1,))


@dataclass
class Aligned:
    """One tensor's set of kernel operands in one dense layout, and what must be copied back."""

    tensors: list[Tensor | None]
    """The operands in the order given to :func:`align`; the given tensor where it already had the layout."""
    write_backs: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    """(given tensor, temporary) pairs: the temporary's values go back into the given tensor."""

    def write_back(self) -> None:
        for given, temporary in self.write_backs:
            given.copy_(temporary)


def align(tensors: Sequence[Tensor | None], *, read: Sequence[bool], written: Sequence[bool]) -> Aligned:
    """``tensors[0]`` (the master) and the others in one dense layout (see the module docstring).

    ``read[k]``/``written[k]`` say whether the kernel reads / writes ``tensors[k]``: a temporary is
    filled only where it is read and copied back only where it is written.
    """
    master = tensors[0]
    assert master is not None
    # Row-major tensors (what the optimizer's state and autograd's gradients of a row-major parameter
    # are) share the layout zeros_like gives a row-major master: nothing to compute per step.
    if master.numel() == 0 or all(t is None or t.is_contiguous() for t in tensors):
        return Aligned(list(tensors))
    strides = zeros_like_strides(master)

    def fits(t: Tensor | None) -> bool:
        return t is None or (is_dense(t) and _has_strides(t, strides))

    if all(fits(t) for t in tensors):
        return Aligned(list(tensors))
    out = Aligned([])
    for t, is_read, is_written in zip(tensors, read, written):
        if t is None or fits(t):
            out.tensors.append(t)
            continue
        temporary = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
        if is_read:
            temporary.copy_(t)
        if is_written:
            out.write_backs.append((t, temporary))
        out.tensors.append(temporary)
    return out
