"""Pinned host memory in a few exactly-sized buffers, for the transfer pipeline.

Contract: :class:`HostArena` carves the host tensors of many parameters (their gradient buffers,
their staging copies) out of one flat allocation per dtype, each exactly the sum of its tensors'
sizes. Where the transfer engine copies asynchronously each allocation is page-locked by the device's stream
backend (accel/streams.py; on CUDA ``cudaHostRegister`` on an exactly-sized pageable buffer, because torch's
pinned allocator rounds every allocation up to a power of two), from the arena's own device whichever
thread runs it; where the registration fails, the backend's pinned allocator is the fallback
(``rounded_bytes`` counts it).

With ``defer_pin`` the exactly-sized buffers are allocated pageable and page-locked later by
:meth:`HostArena.pin_now` (the pipeline does it outside backward: ``cudaHostRegister`` of gigabytes
takes long). Before a registration is undone, only the copies of the transfer engine that may touch
these pages are waited for (its ``synchronize``), not whole devices: no CUDA context is created on a
device the arena never served, and nothing else waits.

Each tensor is carved with the strides it is given (those of the parameter it serves where that one is
dense: ``channels_last``, a transposed view), so that an elementwise copy between the two is a copy of
the same memory order.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import mmap
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offload_adamw.accel.streams import StreamBackend

__all__ = ["HostArena", "PageLocker", "is_page_locked", "page_locked_empty_strided"]

_PAGE = mmap.PAGESIZE


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class PageLocker:
    """Who page-locks host memory that serves a device: its stream backend (accel/streams.py), the device index it
    does it from (whichever thread runs it: no context on another device), and what waits for every copy that may
    touch the memory before it is unlocked (the transfer engine's ``synchronize``)."""

    backend: StreamBackend
    index: int
    synchronize: Callable[[], None] = _nothing


# Storages page-locked here, by id, held weakly: is_page_locked answers for them (the simulated device's memory is
# not pinned in torch's eyes).
_locked: dict[int, weakref.ref[Any]] = {}


def _forget(key: int) -> None:
    _locked.pop(key, None)


def is_page_locked(t: Tensor) -> bool:
    """Whether ``t`` lives in page-locked host memory (torch's pinned allocator, or :func:`page_locked_empty_strided`)."""
    if t.device.type != "cpu":
        return False
    storage = t.untyped_storage()
    ref = _locked.get(id(storage))
    return (ref is not None and ref() is storage) or t.is_pinned()


class _Pages:
    """A page-aligned allocation and its registration. The tensors handed out alias its memory without owning it: the
    finalizer of their storage owns it, and frees it only after every copy that may touch it has ended and it is
    unlocked (a copy in flight when the last tensor goes must not DMA into memory already handed back to malloc)."""

    __slots__ = ("raw", "ptr", "span", "locked")

    def __init__(self, nbytes: int) -> None:
        self.raw: Tensor | None = torch.empty(nbytes + 2 * _PAGE, dtype=torch.uint8)
        self.ptr = self.raw.data_ptr() + (-self.raw.data_ptr()) % _PAGE
        self.span = -(-nbytes // _PAGE) * _PAGE  # whole pages of this buffer alone: registrations may not share one
        self.locked = False


def _release(locker: PageLocker, pages: _Pages) -> None:
    try:
        if pages.locked:
            # A copy still in flight into or out of these pages (an optimizer dropped between backward and step)
            # would otherwise DMA into memory unlocked here and freed right after. Those copies run on the
            # pipeline's own streams only.
            # The wait and the unlock from the memory's own device, whichever thread the finalizer runs on (the
            # collector may run it on an autograd or communication thread whose current device is 0): no context there.
            backend, index = locker.backend, locker.index
            before = backend.get_device() if index is not None else None
            if before is not None and before != index:
                backend.set_device(index)
            try:
                locker.synchronize()
                backend.unpin(pages.ptr, index)
            finally:
                if before is not None and before != index:
                    backend.set_device(before)
    except Exception:  # pragma: no cover - interpreter shutdown
        pass
    pages.raw = None  # the memory goes now


def _aliased(locker: PageLocker, nbytes: int) -> tuple[Tensor, _Pages]:
    """``nbytes`` (> 0) of page-aligned host memory as a uint8 tensor that does not own it (see :class:`_Pages`)."""
    pages = _Pages(nbytes)
    buffer = (ctypes.c_uint8 * nbytes).from_address(pages.ptr)
    alias = torch.frombuffer(buffer, dtype=torch.uint8)
    storage = alias.untyped_storage()
    weakref.finalize(storage, _release, locker, pages)
    weakref.finalize(storage, _forget, id(storage))
    return alias, pages


def _register(locker: PageLocker, alias: Tensor, pages: _Pages) -> bool:
    """Page-lock ``pages``, whose memory ``alias`` is (unlocked when the last tensor of its storage goes)."""
    if not locker.backend.pin(pages.ptr, pages.span, locker.index):
        return False
    pages.locked = True
    storage = alias.untyped_storage()
    _locked[id(storage)] = weakref.ref(storage)
    return True


def page_locked_empty_strided(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
                              locker: PageLocker) -> Tensor:
    """An uninitialised host tensor of exactly its size, page-locked by ``locker`` (no power-of-two rounding: torch's
    pinned allocator only where the registration fails)."""
    numel = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype)
    alias, pages = _aliased(locker, nbytes)
    flat = alias.view(dtype) if _register(locker, alias, pages) else locker.backend.pinned_empty(numel, dtype)
    return flat.as_strided(tuple(shape), tuple(stride))


class HostArena:
    """Flat host buffers, one per dtype, each exactly the sum of its tensors' sizes.

    ``pin`` page-locks the buffers for asynchronous copies: first with
    ``cudaHostRegister`` on an exactly-sized buffer (no rounding), falling back
    to torch's pinned allocator (which rounds up to a power of two) if that fails.
    """

    def __init__(
        self,
        shapes: Iterable[tuple[Any, torch.Size, torch.dtype, tuple[int, ...] | None]],
        *,
        pin: bool,
        label: str,
        locker: PageLocker | None = None,
        synchronize: Callable[[], None] | None = None,
        defer_pin: bool = False,
        field: str = "",
    ) -> None:
        self.label = label
        self.field = field
        """What the views are for (the slot field they fill), for the owner's bookkeeping."""
        # Who page-locks (none: pageable), and what waits for the copies that may touch these pages.
        self._locker = None if locker is None else dataclasses.replace(locker, synchronize=synchronize or locker.synchronize)
        pin = pin and locker is not None
        self._defer = pin and defer_pin
        self._unpinned: list[tuple[Tensor, _Pages, int]] = []  # deferred registrations: (alias, pages, nbytes)
        self.views: dict[Any, Tensor] = {}
        self.buffers: list[Tensor] = []
        self.pinned_bytes = 0
        self.rounded_bytes = 0  # bytes requested through the rounding pinned allocator (fallback only)
        by_dtype: dict[torch.dtype, list[tuple[Any, torch.Size, tuple[int, ...] | None]]] = {}
        for key, shape, dtype, stride in shapes:
            by_dtype.setdefault(dtype, []).append((key, shape, stride))
        for dtype, items in by_dtype.items():
            numel = sum(math.prod(shape) for _, shape, _ in items)
            buffer = self._allocate(numel, dtype, pin)
            offset = 0
            for key, shape, stride in items:
                n = math.prod(shape)
                piece = buffer[offset : offset + n]
                if stride is None or n == 0:
                    self.views[key] = piece.view(shape)
                else:  # a dense layout over exactly these n elements: the parameter's own
                    self.views[key] = piece.as_strided(shape, stride)
                offset += n

    def _allocate(self, numel: int, dtype: torch.dtype, pin: bool) -> Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not (pin and nbytes > 0):
            buffer = torch.empty(numel, dtype=dtype)
            self.buffers.append(buffer)
            return buffer
        assert self._locker is not None  # pin: a locker was given
        alias, pages = _aliased(self._locker, nbytes)
        if self._defer:
            self._unpinned.append((alias, pages, nbytes))
            buffer = alias.view(dtype)
            self.buffers.append(buffer)
            return buffer
        if _register(self._locker, alias, pages):
            buffer = alias.view(dtype)
        else:
            buffer = self._locker.backend.pinned_empty(numel, dtype)
            self.rounded_bytes += nbytes
        self.pinned_bytes += nbytes
        self.buffers.append(buffer)
        return buffer

    @property
    def pin_pending(self) -> bool:
        """Buffers allocated with ``defer_pin`` that are not page-locked yet."""
        return bool(self._unpinned)

    def pin_now(self) -> None:
        """Page-lock the deferred buffers in place (no copy lands in them while this runs: the caller's guarantee).

        A buffer whose registration fails stays pageable: copies into it are then synchronous, still correct.
        """
        pending, self._unpinned = self._unpinned, []
        for alias, pages, nbytes in pending:
            if self._locker is not None and _register(self._locker, alias, pages):
                self.pinned_bytes += nbytes

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
