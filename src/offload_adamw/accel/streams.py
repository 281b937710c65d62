"""What the stream lane of accel/transfer.py needs of a device with streams: the stream backend.

Contract:

* :class:`StreamBackend` is exactly what the lane calls: a new stream, the calling thread's current stream,
  a stream context, blocking events (record, synchronize, query), ``wait_stream`` and ``wait_event`` (methods
  of the streams, as torch spells them), ``record_stream``, a non-blocking copy on the current stream,
  page-locking and unlocking host memory (and an exactly sized page-locked allocation's fallback), whether host
  memory is page-locked, the calling thread's current device; and a device-wide synchronisation, which the pipeline
  never calls (a stream or an event names what it waits for; the simulated device counts it). Nothing here decides
  anything: the lane's order of work is the lane's.
* :func:`current_device` makes a device current for a block (no context on another), and
  :func:`wait_for_current_stream` has the host wait for the calling thread's current stream of a device.
* :data:`CUDA` is the backend over ``torch.cuda``, a plain call per method. It is what runs for CUDA devices.
  Its :meth:`~CudaBackend.pci_bus_id` is the one PCI address of a GPU here (the optimizer's NUMA placement and the
  selftest's report read it): torch's PCI fields, or where a torch lacks them the NVIDIA driver's ``/proc`` folder
  whose UUID is the GPU's (distributed/node.py's ``bus_id_by_uuid``); None where neither tells.
* Another backend (the simulated CUDA device of ``offload_adamw.testing``) is chosen only by being installed:
  :func:`installed_backend` (a context manager) or :func:`install`; pipelines built while it is installed
  serve the devices it :meth:`~StreamBackend.serves` with it. Nothing reads an environment variable.
* :func:`is_device_tensor` says whether a CPU tensor counts as a tensor of an installed backend's device (a
  simulated device keeps its tensors in host memory); the optimizer asks it before writing a parameter from
  the host. Only the backend that claimed a tensor knows; production code asks here, never a testing module.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from offload_adamw.distributed import node

__all__ = ["CUDA", "CudaBackend", "StreamBackend", "claim", "current_device", "install", "installed", "installed_backend",
           "is_device_tensor", "pci_bus_id", "wait_for_current_stream"]


class StreamBackend(Protocol):
    """A device with streams, as the lane uses it (see the module contract)."""

    def serves(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` are this backend's (the lane of ``device`` runs over it)."""
        ...

    def index(self, device: torch.device) -> int:
        """The device index of ``device`` (its own, else the calling thread's current one)."""
        ...

    def new_stream(self, index: int) -> Any:
        """A new stream of device ``index``; it has ``wait_stream(other)``, ``wait_event(event)``, ``synchronize()``."""
        ...

    def current_stream(self, index: int) -> Any:
        """The calling thread's current stream of device ``index``."""
        ...

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """A context in which ``stream`` is the calling thread's current stream."""
        ...

    def new_event(self) -> Any:
        """A blocking event: ``record(stream)``, ``synchronize()`` (the host sleeps), ``query()``."""
        ...

    def record_stream(self, tensor: Tensor, stream: Any) -> None:
        """``tensor``'s memory is not handed to anyone before the work issued so far on ``stream`` has ended."""
        ...

    def copy(self, dst: Tensor, src: Tensor, *, to_device: bool) -> None:
        """``dst.copy_(src)`` without blocking the host, on the current stream (``to_device``: ``dst`` is on the device,
        ``src`` in host memory; else the other way round)."""
        ...

    def pin(self, ptr: int, nbytes: int, index: int | None) -> bool:
        """Page-lock ``nbytes`` of host memory at ``ptr`` (whole pages) from device ``index``'s context; whether it took."""
        ...

    def unpin(self, ptr: int, index: int | None) -> None:
        """Undo :meth:`pin` (the caller has waited for every copy that touches the pages)."""
        ...

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Page-locked host memory from the backend's own allocator (the fallback where :meth:`pin` fails)."""
        ...

    def is_page_locked(self, t: Tensor) -> bool:
        """Whether the host tensor ``t`` lives in page-locked memory (a copy into it may still be in flight)."""
        ...

    def synchronize_device(self, index: int) -> None:
        """Wait for every stream of device ``index`` (device-wide: the pipeline never needs it, a stream or an event
        names the work it waits for; a test asserts it is not called)."""
        ...

    def get_device(self) -> int:
        """The calling thread's current device."""
        ...

    def set_device(self, index: int) -> None:
        """Make device ``index`` the calling thread's current device."""
        ...

    def pci_bus_id(self, index: int) -> str | None:
        """The PCI address of device ``index`` as sysfs names it ("0000:1b:00.0"), or None where it has none."""
        ...


class CudaBackend:
    """:class:`StreamBackend` over ``torch.cuda``: one call each, no logic (but for a PCI address where torch has none)."""

    def serves(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def index(self, device: torch.device) -> int:
        return torch.cuda.current_device() if device.index is None else device.index

    def new_stream(self, index: int) -> Any:
        return torch.cuda.Stream(device=index)

    def current_stream(self, index: int) -> Any:
        return torch.cuda.current_stream(index)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event(blocking=True)

    def record_stream(self, tensor: Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def copy(self, dst: Tensor, src: Tensor, *, to_device: bool) -> None:
        dst.copy_(src, non_blocking=True)

    def pin(self, ptr: int, nbytes: int, index: int | None) -> bool:
        with _on(index):
            try:
                error = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
            except Exception:
                return False
            if error > 0:
                _clear_cuda_error(index)
            return error == 0

    def unpin(self, ptr: int, index: int | None) -> None:
        with _on(index):
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def is_page_locked(self, t: Tensor) -> bool:
        return t.device.type == "cpu" and t.is_pinned()

    def synchronize_device(self, index: int) -> None:
        torch.cuda.synchronize(index)

    def get_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def pci_bus_id(self, index: int) -> str | None:
        props = torch.cuda.get_device_properties(index)  # no context: the driver's description of the device
        domain, bus, device = (getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
        if None not in (domain, bus, device):
            return f"{domain:04x}:{bus:02x}:{device:02x}.0"
        uuid = getattr(props, "uuid", None)  # a torch without the PCI fields: the driver's folders, matched by UUID
        return node.bus_id_by_uuid(str(uuid)) if uuid is not None else None


def _on(index: int | None) -> contextlib.AbstractContextManager[Any]:
    """Device ``index`` current for the call (no context is created on the thread's current device), or as is."""
    return torch.cuda.device(index) if index is not None else contextlib.nullcontext()


def _clear_cuda_error(index: int | None) -> None:
    """Consume the error a failed ``cudaHostRegister`` left as CUDA's last error of this thread.

    torch binds no ``cudaGetLastError``; left set, the error would be raised by the next kernel-launch check (which
    calls it) from an unrelated op, possibly inside backward. That check clears the error as it raises it, so one
    tiny kernel launch consumes it (on device ``index``: no context on another device).
    """
    try:
        torch.empty(1, device="cuda" if index is None else f"cuda:{index}").fill_(0)
    except Exception:  # pragma: no cover - needs a failing registration
        pass


CUDA: StreamBackend = CudaBackend()


@contextlib.contextmanager
def current_device(backend: StreamBackend, index: int) -> Iterator[None]:
    """Device ``index`` current on the calling thread for the block, restored after it (no context on another)."""
    before = backend.get_device()
    if before != index:
        backend.set_device(index)
    try:
        yield
    finally:
        if before != index:
            backend.set_device(before)


def wait_for_current_stream(backend: StreamBackend, index: int) -> None:
    """The host waits for the work issued so far on the calling thread's current stream of device ``index`` (an
    event on it: that stream's work, not the whole device's), with ``index`` current for the calls."""
    with current_device(backend, index):
        event = backend.new_event()
        event.record(backend.current_stream(index))
        event.synchronize()

_installed: list[StreamBackend] = []
# The tensors an installed backend serves as device tensors, by id, each held weakly (its entry goes with it; a
# tensor's == is elementwise, so no weak set of tensors can hold them).
_claimed: dict[int, weakref.ref[Tensor]] = {}
_claimed_lock = threading.Lock()


def install(backend: StreamBackend) -> None:
    """Pipelines built from now on serve the devices ``backend`` serves with it (until :func:`uninstall`)."""
    _installed.append(backend)


def uninstall(backend: StreamBackend) -> None:
    _installed.remove(backend)


@contextlib.contextmanager
def installed_backend(backend: StreamBackend) -> Iterator[StreamBackend]:
    """Pipelines built inside this context serve the devices ``backend`` serves with it."""
    install(backend)
    try:
        yield backend
    finally:
        uninstall(backend)


def installed() -> StreamBackend | None:
    """The backend installed last, or None (CUDA devices then get :data:`CUDA`, every other device plain copies)."""
    return _installed[-1] if _installed else None


def claim(tensor: Tensor) -> None:
    """``tensor`` (host memory) is a tensor of an installed backend's device from now on, for as long as it lives."""
    key = id(tensor)

    def forget(_: object) -> None:
        with _claimed_lock:
            _claimed.pop(key, None)

    with _claimed_lock:
        _claimed[key] = weakref.ref(tensor, forget)


def is_device_tensor(t: Tensor) -> bool:
    """Whether ``t`` is a tensor (a parameter, or a shard of one) an installed backend serves as a device tensor: the
    optimizer keeps a master for it and never writes it from the host (optim/state.py asks)."""
    ref = _claimed.get(id(t))
    return ref is not None and ref() is t


def pci_bus_id(device: torch.device) -> str | None:
    """The PCI address of the GPU of ``device`` (its backend's answer), or None for a host device."""
    backend = installed()
    if backend is not None and backend.serves(device):
        return backend.pci_bus_id(backend.index(device))
    return CUDA.pci_bus_id(CUDA.index(device)) if device.type == "cuda" else None
