"""Pinned host memory in a few exactly-sized buffers, for the transfer pipeline.

Contract: :class:`HostArena` carves the host tensors of many parameters (their gradient buffers,
their staging copies) out of one flat allocation per dtype, each exactly the sum of its tensors'
sizes. On CUDA each allocation is page-locked with ``cudaHostRegister`` on an exactly-sized pageable
buffer, because torch's pinned allocator rounds every allocation up to a power of two; where the
registration fails, torch's pinned allocator is the fallback (``rounded_bytes`` counts it).
"""

from __future__ import annotations

import math
import mmap
import weakref
from typing import Any, Iterable

import torch
from torch import Tensor

__all__ = ["HostArena"]

_PAGE = mmap.PAGESIZE


def _unregister(ptr: int) -> None:
    try:
        # A copy still in flight into or out of these pages (an optimizer dropped between backward
        # and step) would otherwise DMA into memory that is unpinned here and freed right after.
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # pragma: no cover - interpreter shutdown
        pass


def _clear_cuda_error() -> None:
    """Consume the error a failed ``cudaHostRegister`` left as CUDA's last error of this thread.

    torch binds no ``cudaGetLastError``; left set, the error would be raised by the next
    kernel-launch check (which calls it) from an unrelated op, possibly inside backward.
    That check clears the error as it raises it, so one tiny kernel launch consumes it.
    """
    try:
        torch.empty(1, device="cuda").fill_(0)
    except Exception:  # pragma: no cover - needs a failing registration
        pass


class HostArena:
    """Flat host buffers, one per dtype, each exactly the sum of its tensors' sizes.

    ``pin`` page-locks the buffers for asynchronous copies: first with
    ``cudaHostRegister`` on an exactly-sized buffer (no rounding), falling back
    to torch's pinned allocator (which rounds up to a power of two) if that fails.
    """

    def __init__(self, shapes: Iterable[tuple[Any, torch.Size, torch.dtype]], *, pin: bool, label: str) -> None:
        self.label = label
        self.views: dict[Any, Tensor] = {}
        self.buffers: list[Tensor] = []
        self.pinned_bytes = 0
        self.rounded_bytes = 0  # bytes requested through the rounding pinned allocator (fallback only)
        self._raw: list[Tensor] = []  # page-aligned allocations whose registration lives as long as they do
        by_dtype: dict[torch.dtype, list[tuple[Any, torch.Size]]] = {}
        for key, shape, dtype in shapes:
            by_dtype.setdefault(dtype, []).append((key, shape))
        for dtype, items in by_dtype.items():
            numel = sum(math.prod(shape) for _, shape in items)
            buffer = self._allocate(numel, dtype, pin)
            offset = 0
            for key, shape in items:
                n = math.prod(shape)
                self.views[key] = buffer[offset : offset + n].view(shape)
                offset += n

    def _allocate(self, numel: int, dtype: torch.dtype, pin: bool) -> Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not (pin and nbytes > 0):
            buffer = torch.empty(numel, dtype=dtype)
            self.buffers.append(buffer)
            return buffer
        # Register whole pages that belong to this buffer alone: two registrations may not share a page.
        raw = torch.empty(nbytes + 2 * _PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % _PAGE
        span = -(-nbytes // _PAGE) * _PAGE
        try:
            error = int(torch.cuda.cudart().cudaHostRegister(raw.data_ptr() + start, span, 0))
        except Exception:
            error = -1
        if error > 0:
            _clear_cuda_error()
        if error == 0:
            weakref.finalize(raw, _unregister, raw.data_ptr() + start)
            self._raw.append(raw)
            buffer = raw[start : start + nbytes].view(dtype)
        else:
            buffer = torch.empty(numel, dtype=dtype, pin_memory=True)
            self.rounded_bytes += nbytes
        self.pinned_bytes += nbytes
        self.buffers.append(buffer)
        return buffer

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
