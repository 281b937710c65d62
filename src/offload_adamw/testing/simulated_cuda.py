"""A simulated CUDA device on the CPU: a stream backend (accel/streams.py) with CUDA's hazards, for tests.

On the CPU every copy is finished the moment it is issued, so a pipeline that reads a buffer before the copy
that fills it has landed, or overwrites a buffer a pending copy still reads, is right there by accident. The
production stream lane of accel/transfer.py runs over this backend in CI exactly as it runs over ``torch.cuda``
on a GPU, and the backend turns each of CUDA's hazards into wrong bits or a recorded hazard
(:attr:`SimulatedCuda.hazards`; the tests fail on any):

1. **Late, in-order completion.** Each stream is a worker thread that runs its queue in order; each copy lands
   after a seeded random delay. A copy's destination holds poison (NaN in every floating dtype, -1 otherwise)
   from its issue until it lands; a copy to the host memory an earlier send still reads poisons it only when its
   stream runs it (on CUDA a copy writes nothing before then). ``wait_stream`` and ``wait_event`` make a stream's
   worker wait; an event is complete when its stream has reached it; an event never recorded is complete (as on
   CUDA).
2. **Stream-ordered reuse of device memory.** A device tensor whose memory is freed while a copy on another
   stream still has to read it is reused at once (the copy reads garbage: its destination stays poisoned, and a
   hazard is recorded) unless ``record_stream`` named that stream.
3. **Page-locked host memory.** Unlocking (``unpin``) host memory a pending copy touches is a hazard. A
   non-blocking copy whose host side is not page-locked is synchronous, as on CUDA: the host waits for the
   stream, and the backend counts it in :attr:`SimulatedCuda.hidden_syncs`. A host buffer changed while a copy
   still reads it leaves the destination poisoned and records a hazard.
4. **Compute is asynchronous, per thread.** Each thread has its own current stream (as a user-set main stream
   would: the updater thread's is not the main thread's). What is modelled, and what is not:

   * *The host runs ahead of its compute stream.* On the thread that installed the device (the test's, a rank's
     main thread) a compute stream's ``wait_stream``/``wait_event`` is the device's, not the host's: the host
     goes on at once (``compute_waits`` at the end of ``step()`` does not block), and a host write after it (a
     staging buffer written again) can meet a send still in flight. That thread runs its torch operations in its
     stream's order (:class:`_DeviceOrder`, a ``TorchFunctionMode``): an operation that reads or writes device
     memory a pending copy to the device writes, or memory another stream's late work writes, first waits for
     the waits its stream deferred (a host read, ``.item()``, ``torch.equal``, the next forward: on CUDA each
     is queued after them or synchronises with them); one on memory no pending copy writes runs at once; one on
     memory a pending copy writes that no wait covered reads poison. Operations on a tensor's metadata or
     views wait for nothing. Other threads' compute-stream waits block the host, as before (conservative).
   * *Late work on a stream.* Work a test gives :meth:`SimulatedCuda.compute_later` runs late on the calling
     thread's stream (a gradient whose kernels the device has not run yet); with ``writes=`` its thread's own
     later operations on that memory are in stream order: an out-of-place one whose inputs need no gradient is
     queued after it (its result poisoned until then, as a norm taken in a hook), any other waits for it. Another
     thread that reads that memory without waiting for the stream reads poison.
   * *Late kernels* (:meth:`SimulatedCuda.late_kernels`, per test): pipeline worker threads started inside it
     queue an update's device kernels (torch's fused AdamW on a parameter's memory, a copy into a parameter) on
     their stream and defer their stream's waits; their in-place writes into host memory a copy to the host
     still writes are hazards (on CUDA the two interleave). The main thread's in-place writes are checked so too.
   * *Late host waits* (:meth:`SimulatedCuda.late_host_waits`, per test): every thread but the test's wakes late
     from an event it waited for (the accumulator, the update's workers, as the OS may schedule them), so the test's
     thread issues its next copies meanwhile; host work a worker does after its wait meets them unless a wait orders it.
   * *Not modelled*: torch's own operations otherwise run at once on the calling thread (autograd's kernels, the
     host kernels, everything on worker threads outside ``late_kernels``); an operation reached only through
     C++ (autograd's accumulation, a backward kernel) is not in stream order; a host read does not wait for
     ``compute_later`` work that named no ``writes``.
   * A copy to the host of a device tensor issued on a stream that has not waited for the issuing thread's
     current stream since that stream last did work (vector clocks: each ``current_stream`` call is new work) is
     a recorded hazard even when the bits happen to be right.
5. **The current device is per thread** (0 unless set). Every call of the backend made from a thread whose
   current device is not the simulated device's index is recorded as a stray context (on CUDA: a context of
   about 0.5 GB created on that device), except page-locking calls that name their device.
6. **Hidden synchronisations are counted** (a copy from pageable memory), for tests to assert zero where the
   design promises none; so are device-wide synchronisations (:attr:`SimulatedCuda.device_syncs`), which the
   pipeline never needs. Inside :meth:`SimulatedCuda.watching` also a ``.to(device)`` of offload_adamw's own host
   tensor in pageable memory that a device kernel reads, and a device tensor read by the host (``.to("cpu")``,
   ``.item()``) from offload_adamw's code. Torch runs autograd's hooks and callbacks without function modes: a
   ``.to`` there is not seen (an ``.item()`` is).
7. **Device buffers shared by threads** (:meth:`SimulatedCuda.watch_buffer`, opt-in per test): every operation of
   a thread that runs pipeline work is seen (a dispatch mode, entered by :meth:`SimulatedCuda.watching_buffers` and
   by each worker thread's set-up); an access to a watched buffer from a stream not ordered after the latest access
   from another stream (vector clocks) is a recorded hazard.

With ``host_parameters`` the device serves no tensor: every parameter is a host parameter (FSDP2's
``CPUOffloadPolicy``), and only the copies a test issues (:meth:`SimulatedCuda.copy`, a stand-in for FSDP2's
non-blocking copy into a page-locked host gradient) land late.

A CPU tensor counts as a tensor of the simulated device when the pipeline's engine claimed it (accel/streams.py's
``is_device_tensor``): every parameter of a pipeline built while the backend is installed.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import queue
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import increment_version
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from offload_adamw.accel import streams
from offload_adamw.accel.transfer import DONE, Completion, HostCompletion, finish_at_exit

__all__ = ["SimulatedCuda", "install", "simulated_cuda"]

MAX_DELAY_S = 0.001
"""The longest ordinary delay of a copy; one copy in 25 waits SLOW_DELAY_S instead."""
SLOW_DELAY_S = 0.005


def _poison(t: Tensor) -> None:
    with torch.no_grad():
        t.fill_(float("nan") if t.is_floating_point() or t.is_complex() else -1)


def _same(a: Tensor, b: Tensor) -> bool:
    """Bitwise, NaN-safe."""
    if a.numel() == 0:
        return True
    if a.is_floating_point():
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(width), b.contiguous().view(width))
    return torch.equal(a, b)


def _span(t: Tensor) -> tuple[int, int]:
    """The bytes ``t`` reads or writes: [start, end)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _spans(tensors: list[Tensor]) -> list[tuple[int, int]]:
    """The memory of each tensor that has some (a DTensor's outer tensor or a meta tensor has none)."""
    out = []
    for t in tensors:
        try:
            if t.device.type == "cpu" and t.layout == torch.strided:
                out.append(_span(t))
        except (RuntimeError, NotImplementedError):
            continue
    return out


def _pause(rng: random.Random, latency_s: float) -> None:
    time.sleep(latency_s + (SLOW_DELAY_S if rng.random() < 0.04 else rng.uniform(0.0, MAX_DELAY_S)))


def _work_forever(jobs: queue.SimpleQueue[Any], rng: random.Random, finished: list[Any], backend: SimulatedCuda) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        work, copy, done = job
        del job
        if copy:
            _pause(rng, backend.copy_latency_s)
        try:
            work()
        except BaseException as error:
            done.fail(error)
        else:
            done.finish()
        # The work's references (host buffers, device tensors) are dropped by the thread that issues the next work,
        # never here: a finalizer that waits for this stream (host memory unlocked) would wait for itself.
        finished.append(work)
        del work


class _Stream:
    """A simulated stream: an in-order queue run by a worker thread (started at its first job), and a vector clock."""

    _ids = itertools.count(1)

    def __init__(self, backend: SimulatedCuda, name: str, seed: int, *, compute: bool) -> None:
        self.backend = backend
        self.id = next(self._ids)
        self.name = name
        self.compute = compute
        self.clock: dict[int, int] = {self.id: 1}
        self.rng = random.Random(seed)  # drawn from by the worker thread only
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._last: Completion = DONE
        self._finished: list[Any] = []  # work the worker has run, dropped by the issuing thread
        self._lock = threading.Lock()
        # A compute stream's waits its thread did not block for (the thread runs torch's operations on a device tensor
        # a pending copy writes only after them: _DeviceOrder)
        self.deferred: list[Completion] = []

    def __repr__(self) -> str:
        return f"<simulated stream {self.name}>"

    @property
    def time(self) -> int:
        return self.clock[self.id]

    def tick(self) -> None:
        self.clock[self.id] += 1

    def merge(self, clock: dict[int, int]) -> None:
        for key, value in clock.items():
            if self.clock.get(key, 0) < value:
                self.clock[key] = value

    def submit(self, work: Callable[[], None], *, copy: bool) -> Completion:
        done = HostCompletion()
        with self._lock:
            finished, self._finished[:] = list(self._finished), []
            if self._thread is None:
                thread = threading.Thread(target=_work_forever, args=(self._jobs, self.rng, self._finished, self.backend),
                                          name=f"simulated-cuda-{self.name}", daemon=True)
                thread.start()
                self._thread = thread
                finish_at_exit(self._jobs, thread)  # its queue finished before the interpreter goes
                weakref.finalize(self, self._jobs.put, None)  # the worker ends with its stream
            self._jobs.put((work, copy, done))
            self._last = done
        del finished  # here, on the issuing thread, outside the lock
        return done

    def reached(self) -> Completion:
        """A completion for the work issued on this stream so far."""
        return self._last

    def stop(self) -> None:
        self._jobs.put(None)

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # ---------------------------------------------------------------- torch.cuda.Stream's methods the lane calls

    def wait_stream(self, other: _Stream) -> None:
        self.backend.called("wait_stream")
        with self.backend.lock:
            self.merge(other.clock)
        self._wait_for(other.reached())

    def wait_event(self, event: _Event) -> None:
        self.backend.called("wait_event")
        with self.backend.lock:
            self.merge(event.snapshot)
        self._wait_for(event.completion)

    def synchronize(self) -> None:
        self.backend.called("synchronize")
        self.reached().wait()

    def _wait_for(self, completion: Completion) -> None:
        if completion.done():
            return
        if self.compute and not self.backend.orders_device_work():
            completion.wait()  # what this thread issues next is this stream's work: the thread itself waits
            return
        # The device waits, not the host: later work of this stream (and of streams that wait for it) runs after it;
        # on a compute stream whose thread orders its device work (_DeviceOrder), the thread's torch operations on
        # device memory a pending copy writes wait for it too, and nothing else does.
        self.submit(completion.wait, copy=False)
        if self.compute:
            with self.backend.lock:
                self.deferred.append(completion)

    def drain(self) -> None:
        """The calling thread (this compute stream's) waits for the waits it deferred."""
        with self.backend.lock:
            deferred, self.deferred = self.deferred, []
        for completion in deferred:
            completion.wait()


class _Event:
    """A simulated blocking event: complete when its stream has reached the point it was recorded at."""

    def __init__(self, backend: SimulatedCuda) -> None:
        self.backend = backend
        self.completion: Completion = DONE  # never recorded: complete, as on CUDA
        self.snapshot: dict[int, int] = {}

    def record(self, stream: _Stream) -> None:
        self.backend.called("event record")
        with self.backend.lock:
            self.snapshot = dict(stream.clock)
        self.completion = stream.reached()

    def synchronize(self) -> None:
        self.backend.called("event synchronize")
        self.completion.wait()
        late = self.backend.host_wait_latency
        if late is not None and threading.get_ident() != late[1]:
            time.sleep(late[0])  # a worker thread woken late (see SimulatedCuda.late_host_waits)

    def query(self) -> bool:
        self.backend.called("event query")
        return self.completion.done()


class _Watched:
    """A device tensor's memory that a pending copy still reads: freed before it has, it is reused unless recorded."""

    __slots__ = ("streams", "pending", "freed")

    def __init__(self) -> None:
        self.streams: set[int] = set()  # the streams record_stream named
        self.pending: list[_Read] = []
        self.freed = False


class _Ticket:
    """A pending copy of page-locked host memory: cancelled (never touching the memory) once it is unlocked under it."""

    __slots__ = ("lock", "cancelled")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False


def _unowned(t: Tensor) -> Tensor:
    """A view of ``t``'s host memory that does not keep it alive."""
    start, end = _span(t)
    if end == start:
        return t
    flat = torch.frombuffer((ctypes.c_uint8 * (end - start)).from_address(start), dtype=torch.uint8).view(t.dtype)
    return flat.as_strided(t.shape, t.stride())


#: torch functions that read or write no element of a tensor (its metadata, a view of it): they wait for nothing
_METADATA = frozenset({
    "__get__", "__set__", "data_ptr", "untyped_storage", "is_pinned", "numel", "element_size", "stride", "size", "dim",
    "storage_offset", "is_contiguous", "is_floating_point", "is_complex", "detach", "view", "as_strided", "__getitem__",
    "__hash__", "__len__", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "_is_view",
})


#: the device kernels of an update that a worker thread queues on its stream under SimulatedCuda.late_kernels
_KERNELS = frozenset({"_fused_adamw_", "copy_"})


def _in_a_parameter(t: Tensor) -> bool:
    """Whether ``t`` is (a view of) the memory of a tensor a pipeline claimed as a device tensor (accel/streams.py)."""
    try:
        start, end = _span(t)
    except (RuntimeError, NotImplementedError):
        return False
    for ref in list(streams._claimed.values()):
        claimed = ref()
        if claimed is not None and claimed.numel():
            a, b = _span(claimed)
            if a <= start and end <= b:
                return True
    return False


def _overlaps(spans: list[tuple[int, int]], pending: list[tuple[int, int, Completion]]) -> list[Completion]:
    return [done for a, b, done in pending if any(s < b and a < e for s, e in spans)]


class _DeviceOrder(TorchFunctionMode):
    """On a thread whose compute stream defers its waits: each torch operation runs in the thread's stream order.

    The simulated device runs torch's operations at once on the calling thread. On CUDA they are queued on the
    thread's current stream, after every wait issued on it before them; so an operation that touches device memory a
    pending copy writes (a parameter being sent back, a ring buffer being filled) first waits, here, for the waits the
    thread's compute stream deferred, and one that touches memory that :meth:`SimulatedCuda.compute_later` work of this
    thread's stream still writes waits for that work. Nothing else waits: an operation on host memory (a staging
    buffer) runs at once, as the host does on CUDA, and one on memory a copy writes that no wait covered reads poison.
    """

    def __init__(self, backend: SimulatedCuda) -> None:
        super().__init__()
        self.backend = backend

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if getattr(self.backend._local, "internal", False):
            return func(*args, **kwargs)  # the simulated device's own bookkeeping (a copy's poison, its snapshot)
        if name in _KERNELS and self.backend._queues_kernels() and self.backend._queue_kernel(func, name, args, kwargs):
            return None if name == "_fused_adamw_" else args[0]
        if name.endswith("_") and not name.startswith("__") and args and isinstance(args[0], Tensor):
            self.backend._check_host_write(args[0], name)
        if name not in _METADATA:
            late = self.backend._in_stream_order(args, kwargs)
            if late:
                return self.backend._after_late_work(func, name, args, kwargs, late)
        return func(*args, **kwargs)


class _Read:
    __slots__ = ("stream", "reused", "done")

    def __init__(self, stream: _Stream) -> None:
        self.stream = stream
        self.reused = False
        self.done: Completion = DONE


class SimulatedCuda:
    """The simulated device ``index`` (see the module contract); an instance is one process's device of that index."""

    def __init__(self, seed: int, index: int = 0, *, host_parameters: bool = False) -> None:
        self.seed = int(seed)
        self.device_index = int(index)
        self.host_parameters = bool(host_parameters)
        """The model's parameters live in host memory (FSDP2's CPUOffloadPolicy): the device serves no tensor (every
        parameter is a host parameter, on the synchronous lane), and only its copies (:meth:`copy`, issued by a test's
        stand-in for FSDP2) land late into page-locked host gradients."""
        self.device_syncs = 0
        """Device-wide synchronisations (:meth:`synchronize_device`): the pipeline promises none."""
        self._all_streams: weakref.WeakSet[_Stream] = weakref.WeakSet()
        self.lock = threading.RLock()
        self.hazards: list[str] = []
        self.hidden_syncs: collections.Counter[str] = collections.Counter()
        self._local = threading.local()
        self._streams = itertools.count()
        self._pinned: dict[int, int] = {}  # page-locked ranges: start -> bytes
        # host bytes pending copies touch: (start, end, done)
        self._host_pending: list[tuple[int, int, Completion, _Ticket]] = []
        self._watched: dict[int, _Watched] = {}  # device storages pending copies read, by the storage object's id
        self._late_runs = 0  # compute_later's work that has run
        # Device buffers a test watches (watch_buffer): span -> (stream, time) of the latest access, by any thread
        self._buffers: dict[tuple[int, int], tuple[_Stream, int] | None] = {}
        self._watching = False  # inside watching(): worker threads set up now watch their operations too
        self._pageable_moves: list[tuple[int, int]] = []  # host memory moved with .to(device), not yet used (N5)
        self._derived: set[tuple[int, int]] = set()  # memory computed from the device's tensors (N5)
        self._host_copies: dict[int, weakref.ref[Tensor]] = {}  # device tensors read to the host, by id (N5)
        self._to_device: list[tuple[int, int, Completion]] = []  # device memory pending copies write: (start, end, done)
        self._to_host: list[tuple[int, int, Completion]] = []  # host memory pending copies write
        self._from_host: list[tuple[int, int, Completion]] = []  # host memory pending copies to the device read
        self._late: list[tuple[int, int, Completion, _Stream]] = []  # memory late work writes (compute_later, queued ops)
        self.copy_latency_s = 0.0
        """Added to every copy's delay (:meth:`slow_copies`)."""
        self.kernel_latency_s: float | None = None
        """Inside :meth:`late_kernels`: how late a worker thread's queued kernel runs."""
        self.host_wait_latency: tuple[float, int] | None = None
        """Inside :meth:`late_host_waits`: how late another thread wakes from an event, and the thread that is exempt."""

    # ------------------------------------------------------------------ the record

    def record(self, hazard: str) -> None:
        with self.lock:
            self.hazards.append(hazard)

    def called(self, what: str) -> None:
        """A call of the backend from the calling thread: on CUDA it needs a context on the thread's current device."""
        current = self.get_device()
        if current != self.device_index:
            self.record(f"stray context: {what} from thread {threading.current_thread().name!r}, whose current "
                        f"device is {current}, for device {self.device_index}")

    def orders_device_work(self) -> bool:
        """Whether the calling thread runs its torch operations in its compute stream's order (:class:`_DeviceOrder`):
        its compute stream's waits are then the device's, not the host's. Not inside a backward where the mode is not
        in force, though the thread entered it: torch runs autograd's hooks and final callbacks without function modes,
        so there a wait deferred to the device would order nothing the thread does next; it blocks the host instead
        (conservative)."""
        if not getattr(self._local, "orders", False):
            return False
        if torch._C._current_graph_task_id() < 0:  # not in a backward: the mode orders what follows
            return True
        return any(isinstance(mode, _DeviceOrder) for mode in torch.overrides._get_current_function_mode_stack())

    def order_device_work(self) -> TorchFunctionMode:
        """The mode (entered by the caller, on its thread) in which the calling thread's compute stream defers its waits
        to the device, and its torch operations wait only where the device would (:class:`_DeviceOrder`)."""
        self._local.orders = True
        return _DeviceOrder(self)

    def _in_stream_order(self, args: Any, kwargs: Any) -> list[Completion]:
        """Drain the calling thread's deferred waits if the operation touches device memory a pending copy writes; the
        compute_later work of the thread's own stream that still writes memory it touches."""
        stream = getattr(self._local, "compute", None)
        if stream is None or not (stream.deferred or self._late):
            return []
        with self.lock:
            stream.deferred = [c for c in stream.deferred if not c.done()]
            self._to_device = [e for e in self._to_device if not e[2].done()]
            self._late = [e for e in self._late if not e[2].done()]
            # What a wait of the thread's stream may stand for: copies to the device, other streams' late work.
            copies = [*self._to_device, *((a, b, d) for a, b, d, on in self._late if on is not stream)] if stream.deferred else []
            late = [(a, b, done) for a, b, done, on in self._late if on is stream]
        if not copies and not late:
            return []
        spans = []
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, Tensor):
                try:
                    spans.append(_span(leaf))
                except (RuntimeError, NotImplementedError):
                    continue  # no memory of its own (a stand-in, a DTensor): its parts pass here one by one
        if _overlaps(spans, copies):
            stream.drain()
        return _overlaps(spans, late)

    def _after_late_work(self, func: Any, name: str, args: Any, kwargs: Any, late: list[Completion]) -> Any:
        """An operation of this thread on memory that compute_later work of its stream still writes. An out-of-place
        operation whose inputs need no gradient is queued after it, as on CUDA: its result is a new tensor, poisoned
        until the operation has run on the stream (and this thread's operations on it wait, in turn). Any other waits
        for the work, then runs (a host read, an in-place write, an operation autograd records)."""
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in leaves)
        if not (grad or "out" in kwargs or name.endswith("_")):
            out = func(*args, **kwargs)  # on what is there now: only the result's shape and dtype are kept
            if isinstance(out, Tensor) and not any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                                                   for t in leaves if t.layout == torch.strided):
                stream = self._compute_stream()
                _poison(out)

                def queued() -> None:
                    with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
                        out.copy_(func(*args, **kwargs))
                    with self.lock:
                        self._late_runs += 1

                done = stream.submit(queued, copy=False)
                with self.lock:
                    self._late.append((*_span(out), done, stream))
                return out
        for completion in late:
            completion.wait()
        return func(*args, **kwargs)

    def _check_host_write(self, t: Tensor, name: str) -> None:
        """An in-place write by a thread in stream order: into host memory a pending copy to the host still writes, it
        races with that copy (on CUDA the copy's bytes and the host's interleave): a hazard."""
        if not self._to_host:
            return
        try:
            span = _span(t)
        except (RuntimeError, NotImplementedError):
            return
        with self.lock:
            self._to_host = [e for e in self._to_host if not e[2].done()]
            racing = _overlaps([span], self._to_host)
        if racing:
            self.record(f"{name} wrote host memory of shape {tuple(t.shape)} on thread "
                        f"{threading.current_thread().name!r} while a copy to the host still wrote it")

    def _queues_kernels(self) -> bool:
        return bool(getattr(self._local, "kernels_late", False))

    def _queue_kernel(self, func: Any, name: str, args: Any, kwargs: Any) -> bool:
        """A pipeline worker's device kernel, queued on its thread's stream (see :meth:`late_kernels`); whether it was."""
        if name == "_fused_adamw_":
            leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
            if not any(_in_a_parameter(t) for t in leaves):
                return False  # the host's own update (kernels of the host placement): host work, at once
            written = [t for t in tree_leaves(args[:5] if len(args) >= 5 else (args, kwargs)) if isinstance(t, Tensor)]
        else:  # copy_ into a device parameter (a model copy of a master)
            if not (args and isinstance(args[0], Tensor) and _in_a_parameter(args[0])):
                return False
            written = [args[0]]
            increment_version(args[0])  # at issue, as on CUDA; the queued copy moves it no more
        stream = self._compute_stream()
        latency = self.kernel_latency_s or 0.0

        def queued() -> None:
            time.sleep(latency)
            with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
                func(*args, **kwargs)
            with self.lock:
                self._late_runs += 1

        done = stream.submit(queued, copy=False)
        with self.lock:
            self._late += [(*_span(t), done, stream) for t in written if t.numel()]
        return True

    @contextlib.contextmanager
    def late_kernels(self, latency_s: float) -> Iterator[None]:
        """Pipeline worker threads started inside (the updater of updates during backward) queue the device kernels of an
        update (torch's fused AdamW on device tensors, the copy into a device parameter) on their compute stream, to run
        ``latency_s`` later, and defer their compute stream's waits to the device: the host goes on, as on CUDA, and
        another thread that reads what they write must have waited for their stream."""
        before, self.kernel_latency_s = self.kernel_latency_s, latency_s
        try:
            yield
        finally:
            self.kernel_latency_s = before

    @contextlib.contextmanager
    def late_host_waits(self, latency_s: float) -> Iterator[None]:
        """Every thread but the caller's (the accumulator, the update's workers) wakes ``latency_s`` late from an event
        it waited for, as a host thread the OS schedules late: the caller's thread issues the next micro-batch's copies
        meanwhile, so work a worker does after its wait meets them, unless a wait of the caller's orders it first."""
        before, self.host_wait_latency = self.host_wait_latency, (latency_s, threading.get_ident())
        try:
            yield
        finally:
            self.host_wait_latency = before

    @contextlib.contextmanager
    def slow_copies(self, latency_s: float) -> Iterator[None]:
        """Every copy issued inside takes ``latency_s`` more (a slow link, a busy copy engine): what runs meanwhile on
        the host is sure to meet the copies still in flight."""
        before, self.copy_latency_s = self.copy_latency_s, latency_s
        try:
            yield
        finally:
            self.copy_latency_s = before

    # ------------------------------------------------------------------ StreamBackend

    def serves(self, device: torch.device) -> bool:
        return device.type == "cpu" and not self.host_parameters

    def index(self, device: torch.device) -> int:
        return self.device_index

    def new_stream(self, index: int) -> _Stream:
        self.called("new stream")
        n = next(self._streams)
        stream = _Stream(self, f"side{n}", self.seed * 7919 + n, compute=False)
        self._all_streams.add(stream)
        return stream

    def _compute_stream(self) -> _Stream:
        stream = getattr(self._local, "compute", None)
        if stream is None:
            thread = threading.current_thread()
            seed = self.seed * 104729 + (thread.ident or 0) % 9973
            stream = self._local.compute = _Stream(self, f"compute-{thread.name}", seed, compute=True)
            self._all_streams.add(stream)
        return stream

    def current_stream(self, index: int) -> _Stream:
        self.called("current_stream")
        override = getattr(self._local, "override", None)
        if override:
            return override[-1]
        stream = self._compute_stream()
        with self.lock:
            stream.tick()  # the thread may have issued work since it last looked: the stream has moved on
        return stream

    @contextlib.contextmanager
    def stream(self, stream: _Stream) -> Iterator[_Stream]:
        self.called("stream context")
        override = getattr(self._local, "override", None)
        if override is None:
            override = self._local.override = []
        override.append(stream)
        try:
            yield stream
        finally:
            override.pop()

    def new_event(self) -> _Event:
        return _Event(self)

    def record_stream(self, tensor: Tensor, stream: _Stream) -> None:
        self.called("record_stream")
        with self.lock:
            watched = self._watched.get(id(tensor.untyped_storage()))
            if watched is not None:
                watched.streams.add(stream.id)

    def copy(self, dst: Tensor, src: Tensor, *, to_device: bool) -> None:
        self.called("copy")
        self._local.internal = True
        try:
            self._copy(dst, src, to_device=to_device)
        finally:
            self._local.internal = False

    def _copy(self, dst: Tensor, src: Tensor, *, to_device: bool) -> None:
        stream = self.current_stream(self.device_index)
        host = src if to_device else dst
        pageable = not self._is_pinned(host)
        start, end = _span(host)
        ticket = _Ticket()
        if not pageable:
            # As a DMA engine holds it: the copy does not keep the page-locked memory alive (whoever frees it must wait
            # for the copy first, and unlock it after).
            if to_device:
                src = _unowned(src)
            else:
                dst = _unowned(dst)
        del host
        if to_device:
            done = self._copy_to_device(stream, dst, src, ticket)
        else:
            done = self._copy_to_host(stream, dst, src, ticket)
        with self.lock:
            self._host_pending = [p for p in self._host_pending if not p[2].done()]
            self._host_pending.append((start, end, done, ticket))
            if to_device:
                self._to_device.append((*_span(dst), done))
                self._from_host = [e for e in self._from_host if not e[2].done()]
                self._from_host.append((start, end, done))
            else:
                self._to_host = [e for e in self._to_host if not e[2].done()]
                self._to_host.append((start, end, done))
        if pageable:
            # cudaMemcpyAsync from pageable memory: staged by the driver, the host waits for the stream.
            self.hidden_syncs["copy from pageable host memory"] += 1
            done.wait()

    def _copy_to_device(self, stream: _Stream, device_tensor: Tensor, host: Tensor, ticket: _Ticket) -> Completion:
        expected = host.detach().clone()
        increment_version(device_tensor)  # the version counter moves once, at issue, as a CUDA copy's does

        def land() -> None:
            with torch.no_grad(), ticket.lock:
                if ticket.cancelled:  # its host memory was unlocked under it (a hazard) and may be gone
                    _poison(device_tensor.data)
                    return
                # Through .data: no further move of the version counter. Poisoned from the moment the copy starts
                # on its stream (after what the stream waits for: compute still reading the old values), until it has
                # landed.
                _poison(device_tensor.data)
                device_tensor.data.copy_(host)
                if not _same(host, expected):
                    _poison(device_tensor.data)
                    self.record(f"a host buffer of shape {tuple(host.shape)} was overwritten while its copy to the "
                                "device was pending")

        return stream.submit(land, copy=True)

    def _copy_to_host(self, stream: _Stream, dst: Tensor, src: Tensor, ticket: _Ticket) -> Completion:
        compute = self._compute_stream()
        with self.lock:
            if stream is not compute and stream.clock.get(compute.id, 0) < compute.time:
                self.record(f"a copy to the host on {stream.name} reads a device tensor of shape {tuple(src.shape)} "
                            f"without having waited for the current stream of thread "
                            f"{threading.current_thread().name!r}, which produced it (wait_stream)")
        at_issue = src.detach().clone()
        storage = src.untyped_storage()
        offset, shape, stride = src.storage_offset(), tuple(src.shape), tuple(src.stride())
        dtype = src.dtype
        read = self._watch(storage, stream)
        storage_ref = weakref.ref(storage)
        del storage, src
        if self._still_sent(dst):
            # An earlier copy to the device still reads this host memory (the streamed ring sends a chunk of host state,
            # updates it, and issues its copy back at once, the send still in flight). On CUDA a copy writes its
            # destination only when its stream runs it, after what the stream waits for: here the update, which waited
            # for the send. So the poison goes in when this stream reaches the copy, not at issue; a stream not ordered
            # after the send poisons the memory under it, and the send records the hazard.
            def start() -> None:
                with torch.no_grad(), ticket.lock:
                    if not ticket.cancelled:
                        _poison(dst)

            stream.submit(start, copy=False)
        else:
            _poison(dst)  # from issue: a host read that did not wait for the copy reads poison

        def view() -> Tensor | None:
            alive = storage_ref()
            if alive is None:
                return None
            return torch.empty(0, dtype=dtype).set_(alive, offset, shape, stride)

        late_before = self._late_runs

        def land() -> None:
            with torch.no_grad(), ticket.lock:
                if ticket.cancelled:  # its host memory was unlocked under it (a hazard) and may be gone
                    return
                if read.reused:
                    return  # freed and reused before the copy read it: the destination keeps its poison
                now = view()
                if now is None:
                    data = at_issue  # freed, but kept for this stream by record_stream: the bytes as they were
                elif _same(now, at_issue) or self._late_runs != late_before:
                    data = now.clone()  # as issued, or written by late compute the stream waited for
                else:
                    _poison(dst)
                    self.record(f"a device tensor of shape {shape} changed while its copy to the host was pending")
                    return
                dst.copy_(data)

        read.done = done = stream.submit(land, copy=True)
        return done

    def _still_sent(self, t: Tensor) -> bool:
        """Whether a pending copy to the device still reads host memory of ``t``."""
        span = _span(t)
        with self.lock:
            self._from_host = [e for e in self._from_host if not e[2].done()]
            return bool(_overlaps([span], self._from_host))

    def _watch(self, storage: Any, stream: _Stream) -> _Read:
        read = _Read(stream)
        key = id(storage)
        with self.lock:
            watched = self._watched.get(key)
            if watched is None:
                watched = self._watched[key] = _Watched()
                weakref.finalize(storage, self._freed, key)
            watched.pending = [r for r in watched.pending if not r.done.done()]
            watched.pending.append(read)
        return read

    def _freed(self, key: int) -> None:
        """The caching allocator got a device storage back: reused at once unless every pending reader was recorded."""
        with self.lock:
            watched = self._watched.pop(key, None)
        if watched is None:
            return
        for read in watched.pending:
            if read.done.done():
                continue
            if read.stream.id not in watched.streams:
                read.reused = True
                self.record(f"device memory freed while a copy on {read.stream.name} still had to read it, and no "
                            "record_stream named that stream: the caching allocator handed it out again")

    def _is_pinned(self, t: Tensor) -> bool:
        start, end = _span(t)
        with self.lock:
            return any(p <= start and end <= p + n for p, n in self._pinned.items())

    def pin(self, ptr: int, nbytes: int, index: int | None) -> bool:
        if index is None:
            self.called("cudaHostRegister")
        with self.lock:
            self._pinned[ptr] = nbytes
        return True

    def unpin(self, ptr: int, index: int | None) -> None:
        if index is None:
            self.called("cudaHostUnregister")
        with self.lock:
            nbytes = self._pinned.pop(ptr, 0)
            touching = [p for p in self._host_pending if not p[2].done() and p[0] < ptr + nbytes and ptr < p[1]]
        for *_, ticket in touching:
            with ticket.lock:
                ticket.cancelled = True  # the memory may be freed right after this: the copy must not touch it
        if touching:
            self.record(f"page-locked host memory ({nbytes} bytes) unlocked while {len(touching)} copies still touch it")

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        self.called("cudaHostAlloc")
        owner = torch.empty(max(numel, 1), dtype=dtype)
        buffer = _unowned(owner)[:numel]
        start, end = _span(owner)
        with self.lock:
            self._pinned[start] = end - start
        # Given back when its last tensor goes, as torch's page-locked allocator gives a block back: once every copy
        # that touches it has ended (torch records an event on the copy's stream for each non-blocking copy from its
        # memory); only then unlocked and freed: the owner outlives the handed-out tensor until the unlock has returned.
        weakref.finalize(buffer.untyped_storage(), self._free_pinned, start, owner)
        return buffer

    def _free_pinned(self, start: int, owner: Tensor) -> None:
        with self.lock:
            nbytes = self._pinned.get(start, 0)
            touching = [p[2] for p in self._host_pending if not p[2].done() and p[0] < start + nbytes and start < p[1]]
        if not touching:
            self.unpin(start, self.device_index)
            return

        def once_the_copies_ended() -> None:
            for done in touching:
                done.wait()
            self.unpin(start, self.device_index)
            owner.untyped_storage()  # kept alive until here

        threading.Thread(target=once_the_copies_ended, name="simulated-pinned-free", daemon=True).start()

    def is_page_locked(self, t: Tensor) -> bool:
        return t.device.type == "cpu" and self._is_pinned(t)

    def synchronize_device(self, index: int) -> None:
        """Every stream of the device has reached the work issued on it so far; counted in :attr:`device_syncs`."""
        self.called("cudaDeviceSynchronize")
        with self.lock:
            self.device_syncs += 1
            every = list(self._all_streams)
        for stream in every:
            stream.reached().wait()

    def get_device(self) -> int:
        return int(getattr(self._local, "device", 0))

    def set_device(self, index: int) -> None:
        self._local.device = int(index)
        if self._watching:
            self._watch_thread()  # a worker thread's set-up (thread_init): its accesses to watched buffers are seen
        if self.kernel_latency_s is not None and not self.orders_device_work():
            # A pipeline worker making the device current (its thread set-up) inside late_kernels: for the thread's life.
            self.order_device_work().__enter__()
            self._local.kernels_late = True

    def _count_moves(self, spans: list[tuple[int, int]]) -> None:
        """An operation over the device's tensors that reads a tensor moved from pageable memory: one hidden
        synchronisation per move (counted once)."""
        if not self._on_device(spans):
            return
        with self.lock:
            used = [m for m in self._pageable_moves if any(m[0] < b and a < m[1] or m == (a, b) for a, b in spans)]
            if not used:
                return
            self._pageable_moves = [m for m in self._pageable_moves if m not in used]
            self.hidden_syncs["a copy to the device from pageable memory (.to(device))"] += len(used)

    # ------------------------------------------------------------------ shared device buffers (N8)

    def watch_buffer(self, t: Tensor) -> None:
        """Record every access to ``t``'s memory (a device buffer the pipeline's threads share) from the threads that
        run pipeline work: the calling thread inside :meth:`watching_buffers`, and every worker thread set up from now
        on. An access from a stream that is not ordered (``wait_event``/``wait_stream``) after the latest access from
        another stream is a recorded hazard: on CUDA the two kernels may run at once (a main thread on a non-default
        stream and the updater thread's own)."""
        with self.lock:
            self._buffers[_span(t)] = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """The calling thread's operations are seen for the block, and those of every worker thread set up inside it
        (its ``thread_init``): accesses to watched buffers, and copies to the device from pageable memory made with
        ``.to(device)`` (see :meth:`_moved`)."""
        before = self._watching
        self._watching = True
        try:
            with _MoveWatch(self), _BufferWatch(self):
                self._local.watching = True
                try:
                    yield
                finally:
                    self._local.watching = False
        finally:
            self._watching = before

    def _watch_thread(self) -> None:
        if getattr(self._local, "watching", False):
            return
        self._local.watching = True
        _MoveWatch(self).__enter__()  # for the rest of the worker thread's life
        _BufferWatch(self).__enter__()

    def _device_spans(self) -> list[tuple[int, int]]:
        """The memory of the tensors the engine claimed as this device's (the parameters), of their gradients where
        these live on the device, and of the watched buffers."""
        spans = list(self._buffers)
        for ref in list(streams._claimed.values()):
            t = ref()
            if t is None:
                continue
            spans.append(_span(t))
            grad = t.grad
            if grad is not None and type(grad) is Tensor and grad.layout == torch.strided:
                with contextlib.suppress(RuntimeError):  # a freed gradient's stand-in has no storage
                    spans.append(_span(grad))
        return spans

    def _derive(self, inputs: list[Tensor], outputs: list[Tensor]) -> None:
        """What an operation over the device's tensors computes is the device's too (a norm, a clip coefficient):
        moving it to the device is no copy from the host."""
        if not outputs or not self._on_device(_spans(inputs)):
            return
        for t in outputs:
            spans = _spans([t])
            if not spans:
                continue
            with self.lock:
                self._derived.add(spans[0])
            weakref.finalize(t.untyped_storage(), self._underive, spans[0])

    def _derive_created(self, t: Tensor) -> None:
        spans = _spans([t])
        if spans:
            with self.lock:
                self._derived.add(spans[0])
            weakref.finalize(t.untyped_storage(), self._underive, spans[0])

    def _underive(self, span: tuple[int, int]) -> None:
        with self.lock:
            self._derived.discard(span)

    def _on_device(self, spans: list[tuple[int, int]]) -> bool:
        with self.lock:
            device = self._device_spans() + list(self._derived)
        return any(a < d_end and d_start < b for a, b in spans for d_start, d_end in device if b > a)

    def _is_device_data(self, t: Tensor) -> bool:
        return streams.is_device_tensor(t) or self._on_device(_spans([t]))

    def _read_by_host(self, t: Tensor, how: str) -> None:
        """A device tensor read by the host (``.to("cpu")`` into ``t``, ``.item()``): on CUDA the host waits for
        the device (a hidden synchronisation)."""
        with self.lock:
            self.hidden_syncs[f"a device tensor read by the host ({how})"] += 1
            self._host_copies[id(t)] = weakref.ref(t)

    def _is_host_copy(self, t: Tensor) -> bool:
        with self.lock:
            ref = self._host_copies.get(id(t))
        return ref is not None and ref() is t

    def _moved(self, t: Tensor, *, host_copy: bool = False) -> None:
        """``t`` is the result of ``.to(device)`` (or ``.to(device, dtype)``) of a host tensor in pageable memory that
        is not the device's: on CUDA, a copy to the device that blocks the host (a hidden synchronisation) when the
        result is used by a device kernel, which :meth:`_accessed` counts (on the CPU the call is a no-op)."""
        span = _span(t)
        if not host_copy and self._on_device([span]):
            return  # computed on the device: no copy
        with self.lock:
            if span not in self._pageable_moves:  # .to("cpu") then .to(device) of one host tensor: one copy on CUDA
                self._pageable_moves.append(span)
        weakref.finalize(t.untyped_storage(), self._unmove, span)

    def _unmove(self, span: tuple[int, int]) -> None:
        with self.lock:
            if span in self._pageable_moves:
                self._pageable_moves.remove(span)

    def _accessed(self, tensors: list[Tensor]) -> None:
        spans = _spans(tensors)
        if self._pageable_moves:
            self._count_moves(spans)
        with self.lock:
            touched = [key for key in self._buffers for start, end in spans if start < key[1] and key[0] < end]
        if not touched:
            return
        override = getattr(self._local, "override", None)
        stream = override[-1] if override else self._compute_stream()
        with self.lock:
            stream.tick()  # this access is new work of the stream: an event recorded from now on covers it
            for key in set(touched):
                last = self._buffers[key]
                if last is not None and last[0] is not stream and stream.clock.get(last[0].id, 0) < last[1]:
                    self.hazards.append(
                        f"a device buffer of {key[1] - key[0]} bytes used on {stream.name} while {last[0].name}'s use "
                        "of it may still run: no event of that stream was waited for")
                self._buffers[key] = (stream, stream.time)

    #: the PCI address the simulated device reports (a test sets it, with a made-up sysfs that places it)
    pci_address: str | None = None

    def pci_bus_id(self, index: int) -> str | None:
        return self.pci_address

    # ------------------------------------------------------------------ for tests

    def compute_later(self, work: Callable[[], None], delay_s: float = 0.02, writes: Sequence[Tensor] = ()) -> Completion:
        """``work`` on the calling thread's current stream, after ``delay_s``: compute the host issued and the device
        has not run yet (what a copy, or another thread, that did not wait for this stream would miss). The calling
        thread's own torch operations on ``writes`` (inside :meth:`order_device_work`) run after it, in stream order."""
        stream = self.current_stream(self.device_index)

        def late() -> None:
            time.sleep(delay_s)
            # No move of a version counter here: a kernel's moves it when the host issues it (the caller's business).
            with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
                work()
            with self.lock:
                self._late_runs += 1  # a change of a copy's source from here on may be this work's

        done = stream.submit(late, copy=False)
        with self.lock:
            self._late += [(*_span(t), done, stream) for t in writes]
        return done

    def take_hazards(self) -> list[str]:
        with self.lock:
            found, self.hazards = self.hazards, []
        return found


class _BufferWatch(TorchDispatchMode):
    """Every operation of the thread it is entered on: the watched device buffers it touches (SimulatedCuda._accessed)."""

    def __init__(self, backend: SimulatedCuda) -> None:
        super().__init__()
        self.backend = backend

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        if not func.is_view:  # a view touches no memory: it is no access of the device
            self.backend._accessed(inputs)
        if func is torch.ops.aten._local_scalar_dense.default and _ours() and self.backend._is_device_data(inputs[0]):
            self.backend._read_by_host(inputs[0], ".item()")
        out = func(*args, **kwargs)
        self.backend._derive(inputs, [t for t in tree_leaves(out) if isinstance(t, Tensor)])
        return out


def _caller() -> str:
    """The module of the code that called the operation, above the modes and torch's own wrappers."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != "torch" and not module.startswith(("torch.", "offload_adamw.testing")):
            return str(module)
        frame = frame.f_back  # type: ignore[assignment]
    return ""


def _ours() -> bool:
    """Whether offload_adamw's production code called the operation: torch's own moves (a GradScaler's, for one) are
    torch's, and on CUDA its state lives on the device."""
    return _caller().startswith("offload_adamw.")


def _target_device(args: Any, kwargs: dict[str, Any]) -> torch.device | None:
    """The device ``Tensor.to(*args, **kwargs)`` moves to (None: the tensor's own)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}  # torch's parser of .to's arguments takes no copy
    for tried in (tuple(args), tuple(args)[:-1]):
        try:
            return torch._C._nn._parse_to(*tried, **kwargs)[0]
        except (TypeError, RuntimeError):
            continue
    return None


class _MoveWatch(TorchFunctionMode):
    """``Tensor.to`` with a device, of a host tensor in pageable memory that is not the device's (SimulatedCuda._moved)."""

    def __init__(self, backend: SimulatedCuda) -> None:
        super().__init__()
        self.backend = backend

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (isinstance(out, Tensor) and kwargs.get("device") not in (None, "cpu")
                and not any(isinstance(t, Tensor) for t in tree_leaves((args, kwargs)))
                and not _caller().startswith("offload_adamw.kernels")):
            # Created on a device named by a device object (a tensor's .device: a GradScaler's flag, a device buffer),
            # not by the string "cpu" (host memory, as offload_adamw spells it) nor by a host kernel: the device's.
            if self.backend.serves(torch.device(kwargs["device"])):
                self.backend._derive_created(out)
        if func is Tensor.to and args and isinstance(args[0], Tensor) and isinstance(out, Tensor) and _ours():
            src = args[0]
            device = _target_device(args[1:], kwargs)
            if device is None or src.device.type != "cpu" or not self.backend.serves(device) or src.numel() == 0:
                return out
            if "cpu" in (args[1] if len(args) > 1 else None, kwargs.get("device")):
                # offload_adamw spells a move to host memory "cpu": of a device tensor, a read by the host
                if self.backend._is_device_data(src):
                    self.backend._read_by_host(out, ".to('cpu')")
            elif self.backend._is_host_copy(src):
                self.backend._moved(out, host_copy=True)  # back to the device: a copy from pageable memory
            elif not streams.is_device_tensor(src) and not self.backend._is_pinned(src):
                self.backend._moved(out)
        return out


def install(seed: int, index: int = 0) -> SimulatedCuda:
    """Install a simulated device ``index`` for every pipeline built from now on in this process (subprocess workers
    call it from their command line), and make ``index`` the calling thread's current device, as a rank's own
    ``torch.cuda.set_device`` would."""
    backend = SimulatedCuda(seed, index)
    streams.install(backend)
    backend.set_device(index)
    backend.order_device_work().__enter__()  # for the life of the process, on the calling (main) thread
    return backend


@contextlib.contextmanager
def simulated_cuda(seed: int, index: int = 0, *, host_parameters: bool = False) -> Iterator[SimulatedCuda]:
    """Pipelines built inside this context run the stream lane on a simulated device ``index`` (the calling thread's
    current device inside it); ``host_parameters``: see :attr:`SimulatedCuda.host_parameters`."""
    backend = SimulatedCuda(seed, index, host_parameters=host_parameters)
    before = backend.get_device()
    backend.set_device(index)
    try:
        with streams.installed_backend(backend), backend.order_device_work():
            yield backend
    finally:
        backend._local.orders = False
        backend.set_device(before)
