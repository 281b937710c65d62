"""Every copy between a device and the host, and every wait on one: the transfer engine.

Contract:

* One :class:`TransferEngine` per pipeline owns every stream, event, ``record_stream`` and the
  accumulator thread. Nothing else in the pipeline touches a stream: it asks for a copy and gets a
  :class:`Completion` back, and it waits on that completion before it reads a buffer the copy fills
  and before it overwrites a buffer a copy still reads. Those waits are the pipeline's ordering; the
  engine only carries them out.
* ``copy_to_host(src, dst)``: the host buffer ``dst`` receives the device tensor ``src``, ordered after
  the work already issued on the current stream of ``src``'s device (the work that produced it);
  ``src``'s memory is not handed to anyone else before the copy has read it.
* ``add_on_host(after, dst, src)``: ``dst += src`` in host memory, on the accumulator thread, once
  ``after`` is complete: ``old + new`` rounded once to the gradient's dtype, which is what autograd's
  accumulation computes. The hook that asks for it never waits.
* ``send_to_device(pairs, after=...)``: each device tensor receives its host source, once ``after`` (a copy
  that still reads a device tensor about to be overwritten: a ring slot's copy out) is complete;
  :meth:`send_after_compute` orders later sends after the compute stream's work issued so far (the
  parameters the device still reads), and :meth:`compute_waits` makes the compute stream (the next
  forward, or the update of a chunk that was sent) wait for a send without the host waiting.
* ``copy_all_to_host(device, pairs)``: every host buffer receives its device tensor, ordered after the work
  issued so far on the current stream of ``device`` (the update that wrote them); one completion for all.
* ``to_device(device, host)``: a step's small host tensors (its step counts, its loss scale) reach the device from
  page-locked staging on the current stream, ordered before the kernels issued after it: never a copy from pageable
  memory, which would block the host (a hidden synchronisation per bucket on CUDA, and the streamed ring's prefetch
  lost).
* ``mark(device)`` is a completion for the work issued so far on the current stream of ``device``
  (a gradient norm taken in a hook); :meth:`TransferEngine.current_stream_waits` orders the current stream after it.
* Lanes, one per device, chosen by the device, never by a flag: a device with streams gets the stream lane,
  side streams and blocking events (a host that waits sleeps instead of spinning a core the host kernel
  wants), written once over a stream backend (accel/streams.py): ``torch.cuda`` for CUDA devices, or the
  backend installed when the engine was built (the simulated CUDA device of ``offload_adamw.testing``, which
  serves CPU tensors), so that the lane CI runs is the lane a GPU runs. Every other device, the CPU included,
  gets synchronous copies (a completion that is complete when returned).
* Worker threads (the accumulator here, the updater of accel/overlap.py) call :meth:`TransferEngine.thread_init`
  first: it makes the pipeline's device current on the thread, so that a rank's threads never create a
  context on device 0.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from offload_adamw.accel.host_memory import PageLocker
from offload_adamw.accel.streams import CUDA, StreamBackend, claim, current_device, is_device_tensor, wait_for_current_stream

__all__ = ["Completion", "DONE", "HostCompletion", "Lane", "TransferEngine", "finish_at_exit"]


class Completion(Protocol):
    """Work issued on a stream or a worker thread, complete at some later moment."""

    def wait(self) -> None:
        """Block the calling thread until the work is complete; raise what the work raised."""
        ...

    def done(self) -> bool:
        """Whether the work is complete (never blocks)."""
        ...


class _Done:
    """A completion that is complete from the start (a synchronous copy)."""

    __slots__ = ()

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "DONE"


DONE: Completion = _Done()


class HostCompletion:
    """Work of a host thread; ``fail`` keeps the error for :meth:`wait` to raise on the waiting thread."""

    __slots__ = ("_event", "_error")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None

    def finish(self) -> None:
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def wait(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        return self._event.is_set()


class _StreamCompletion:
    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return bool(self.event.query())


class Lane(Protocol):
    """The copies of one device (see the module contract)."""

    def copy_to_host(self, src: Tensor, dst: Tensor) -> Completion: ...

    def copy_all_to_host(self, pairs: Sequence[tuple[Tensor, Tensor]]) -> Completion: ...

    def send_to_device(self, pairs: Sequence[tuple[Tensor, Tensor]], after: Completion = DONE) -> Completion: ...

    def send_after_compute(self) -> None: ...

    def compute_waits(self, completion: Completion) -> None: ...

    def mark(self) -> Completion: ...

    def to_device(self, device: torch.device, host: Tensor) -> Tensor: ...

    def current_stream_waits(self, completion: Completion) -> None: ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


class _Synchronous:
    """The CPU as device, or an accelerator without streams here: every copy is complete when it returns."""

    def __init__(self, landed: Callable[[Tensor], None]) -> None:
        self._landed = landed

    def copy_to_host(self, src: Tensor, dst: Tensor) -> Completion:
        self._landed(src)
        dst.copy_(src)
        return DONE

    def copy_all_to_host(self, pairs: Sequence[tuple[Tensor, Tensor]]) -> Completion:
        with torch.no_grad():
            for src, dst in pairs:
                dst.copy_(src)
        return DONE

    def send_to_device(self, pairs: Sequence[tuple[Tensor, Tensor]], after: Completion = DONE) -> Completion:
        after.wait()
        with torch.no_grad():
            for device_tensor, host in pairs:
                device_tensor.copy_(host)
        return DONE

    def send_after_compute(self) -> None:
        return None

    def compute_waits(self, completion: Completion) -> None:
        completion.wait()

    def mark(self) -> Completion:
        return DONE

    def to_device(self, device: torch.device, host: Tensor) -> Tensor:
        return host.to(device)

    def current_stream_waits(self, completion: Completion) -> None:
        completion.wait()

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        return None


class _StreamLane:
    """One device with streams (CUDA, or the simulated device of the tests): a side stream for each direction,
    blocking events. Written once over the backend (accel/streams.py): the code a GPU runs is the code CI runs."""

    def __init__(self, backend: StreamBackend, device: torch.device) -> None:
        self.backend = backend
        self.index = backend.index(device)
        self.d2h = backend.new_stream(self.index)
        self.h2d = backend.new_stream(self.index)

    def _event(self, stream: Any) -> Completion:
        event = self.backend.new_event()
        event.record(stream)
        return _StreamCompletion(event)

    def _compute(self) -> Any:
        return self.backend.current_stream(self.index)

    def copy_to_host(self, src: Tensor, dst: Tensor) -> Completion:
        self.d2h.wait_stream(self._compute())  # the work that produced src
        with self.backend.stream(self.d2h):
            self.backend.copy(dst, src, to_device=False)
        # The caching allocator must not hand src's memory to anyone before this copy has read it.
        self.backend.record_stream(src, self.d2h)
        return self._event(self.d2h)

    def copy_all_to_host(self, pairs: Sequence[tuple[Tensor, Tensor]]) -> Completion:
        self.d2h.wait_stream(self._compute())  # the update that wrote the sources
        with self.backend.stream(self.d2h), torch.no_grad():
            for src, dst in pairs:
                self.backend.copy(dst, src, to_device=False)
        for src, _ in pairs:
            self.backend.record_stream(src, self.d2h)
        return self._event(self.d2h)

    def send_to_device(self, pairs: Sequence[tuple[Tensor, Tensor]], after: Completion = DONE) -> Completion:
        if isinstance(after, _StreamCompletion):
            self.h2d.wait_event(after.event)  # the device waits, not the host
        else:
            after.wait()
        with self.backend.stream(self.h2d), torch.no_grad():
            for device_tensor, host in pairs:
                self.backend.copy(device_tensor, host, to_device=True)
        return self._event(self.h2d)

    def send_after_compute(self) -> None:
        self.h2d.wait_stream(self._compute())  # the parameters the device still reads

    def compute_waits(self, completion: Completion) -> None:
        if isinstance(completion, _StreamCompletion):
            self._compute().wait_event(completion.event)
        else:
            completion.wait()

    def mark(self) -> Completion:
        return self._event(self._compute())

    def to_device(self, device: torch.device, host: Tensor) -> Tensor:
        # From page-locked staging, on the current stream: the kernels issued after it read it in stream order, and
        # the host does not wait (from pageable memory the copy would block the host). The staging may go at once:
        # torch's page-locked allocator keeps it until the copy has read it.
        staging = self.backend.pinned_empty(host.numel(), host.dtype).view(host.shape)
        staging.copy_(host)
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        compute = self._compute()
        self.backend.copy(out, staging, to_device=True)
        landed = self._event(compute)
        assert isinstance(landed, _StreamCompletion)
        compute.wait_event(landed.event)  # a no-op on CUDA (one stream, in order); a thread that computes at once waits
        return out

    def current_stream_waits(self, completion: Completion) -> None:
        self.compute_waits(completion)

    def synchronize(self) -> None:
        self.d2h.synchronize()
        self.h2d.synchronize()

    def close(self) -> None:
        return None  # the backend destroys the streams with the last reference


# Every worker thread started (ended by a None in its queue), with its queue: ended at exit (see _finish_at_exit).
_workers: list[tuple[queue.SimpleQueue[Any], threading.Thread]] = []
_workers_lock = threading.Lock()


def finish_at_exit(jobs: queue.SimpleQueue[Any], thread: threading.Thread) -> None:
    """Have the daemon ``thread``, which ends at a None in ``jobs``, finish its queue before the interpreter goes
    (the accumulator here, the simulated device's stream workers)."""
    with _workers_lock:
        _workers[:] = [w for w in _workers if w[1].is_alive()]
        _workers.append((jobs, thread))


def _finish_at_exit() -> None:
    """Let every worker finish the work it was given before the interpreter goes: a daemon thread still inside a
    torch op when the interpreter finalizes aborts the process (a script that ends between backward and step())."""
    with _workers_lock:
        live = [(jobs, thread) for jobs, thread in _workers if thread.is_alive()]
    for jobs, _ in live:
        jobs.put(None)
    for _, thread in live:
        thread.join(5.0)


atexit.register(_finish_at_exit)


class _Accumulator:
    """Adds accumulation copies into their host gradients on a worker thread, never on autograd's."""

    def __init__(self, thread_init: Callable[[], None]) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._thread_init = thread_init

    def submit(self, after: Completion, dst: Tensor, src: Tensor) -> Completion:
        done = HostCompletion()
        if self._thread is None:
            self._thread = threading.Thread(
                target=_accumulate_forever, args=(self._jobs, self._thread_init), name="offload-adamw-accumulate", daemon=True
            )
            self._thread.start()
            finish_at_exit(self._jobs, self._thread)
        self._jobs.put((after, dst, src, done))
        return done

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)


def _accumulate_forever(jobs: queue.SimpleQueue[Any], thread_init: Callable[[], None]) -> None:
    thread_init()
    while True:
        job = jobs.get()
        if job is None:
            return
        after, dst, src, done = job
        try:
            after.wait()  # the copy into src has landed
            with torch.no_grad():
                dst.add_(src)  # old + new, rounded once to the gradient's dtype: what autograd's accumulation computes
        except BaseException as error:
            done.fail(error)
        else:
            done.finish()


class TransferEngine:
    """The lanes of every device a pipeline copies to or from, and its accumulator (see the module contract)."""

    def __init__(self, backend: StreamBackend | None = None) -> None:
        self._backend = backend  # an installed backend (the simulated device of the tests), else CUDA's for CUDA
        self._lanes: dict[torch.device, Lane] = {}
        self._lock = threading.Lock()
        self._home: tuple[StreamBackend, int] | None = None  # the first stream device: worker threads make it current
        self._offload_index: int | None = None  # the device beside host parameters (see host_gradient_landed)
        self.accumulator = _Accumulator(self.thread_init)

    def backend_for(self, device: torch.device) -> StreamBackend | None:
        """The stream backend of ``device``, or None where copies are synchronous."""
        if self._backend is not None and self._backend.serves(device):
            return self._backend
        return CUDA if device.type == "cuda" else None

    def is_device(self, device: torch.device) -> bool:
        """Whether a parameter on ``device`` lives apart from the host (it gets a staging buffer and a send-back)."""
        return device.type not in ("cpu", "meta") or self.backend_for(device) is not None

    def claim(self, tensor: Tensor) -> None:
        """``tensor`` is a parameter this engine's pipeline serves: where an installed backend keeps its device's
        tensors in host memory, it counts as a device tensor from now on (accel/streams.py)."""
        backend = self.backend_for(tensor.device)
        if backend is None:
            offload = self._offload_backend() if tensor.device.type == "cpu" else None
            if offload is not None and self._offload_index is None:
                # A host parameter beside a device (FSDP2's CPUOffloadPolicy): the device whose copies land in its
                # gradient is the current device of the thread that builds the pipeline (a rank's own).
                self._offload_index = offload.get_device()
            return
        if self._home is None:
            self._home = (backend, backend.index(tensor.device))
        if tensor.device.type == "cpu":
            claim(tensor)

    def page_locker(self, device: torch.device) -> PageLocker | None:
        """Who page-locks host memory that serves ``device`` (its stream backend, from its own device index, after this
        engine's copies have ended when it unlocks), or None: copies to ``device`` are synchronous, nothing to lock."""
        backend = self.backend_for(device)
        return None if backend is None else PageLocker(backend, backend.index(device), self.synchronize)

    def lane(self, device: torch.device) -> Lane:
        lane = self._lanes.get(device)
        if lane is None:
            with self._lock:
                lane = self._lanes.get(device)
                if lane is None:
                    backend = self.backend_for(device)
                    if backend is None:
                        lane = _Synchronous(self.host_gradient_landed)
                    else:
                        stream_lane = _StreamLane(backend, device)
                        if self._home is None:
                            self._home = (backend, stream_lane.index)
                        lane = stream_lane
                    self._lanes[device] = lane
        return lane

    def _offload_backend(self) -> StreamBackend | None:
        """The device whose copies may land in a host parameter's page-locked gradient (installed, or CUDA's)."""
        return self._backend if self._backend is not None else CUDA if torch.cuda.is_initialized() else None

    def host_gradient_landed(self, grad: Tensor) -> None:
        """A host parameter's gradient ``grad`` (host memory) has landed: FSDP2's ``CPUOffloadPolicy`` copies each
        reduced shard into a page-locked host gradient without blocking, and torch before 2.12 calls the hook before
        that copy has ended. Called before anything reads such a gradient (its norm and count in the gate, its copy).
        The wait: an event on the hook's stream (where FSDP2 issued the copy) of the pipeline's device, else the rank's
        (current where the pipeline was built), not the whole device, never device 0 from a thread of another rank."""
        if grad.device.type != "cpu" or self.backend_for(grad.device) is not None:
            return  # a device tensor: the lane orders its reads
        backend = self._offload_backend()
        if backend is None or not backend.is_page_locked(grad):
            return
        index = (self._home[1] if self._home is not None
                 else self._offload_index if self._offload_index is not None else backend.get_device())
        wait_for_current_stream(backend, index)

    def thread_init(self) -> None:
        """Called first by every worker thread of the pipeline: its current device is the pipeline's, so that no
        call of the thread creates a context on another device (device 0)."""
        if self._home is not None:
            backend, index = self._home
            backend.set_device(index)

    @contextlib.contextmanager
    def on_home(self) -> Iterator[None]:
        """The pipeline's device current on the calling thread for the block (a thread not the pipeline's own: the
        one that runs DDP's communication-hook callback), restored after it."""
        if self._home is None:
            yield
            return
        with current_device(*self._home):
            yield

    def copy_to_host(self, src: Tensor, dst: Tensor) -> Completion:
        return self.lane(src.device).copy_to_host(src, dst)

    def add_on_host(self, after: Completion, dst: Tensor, src: Tensor) -> Completion:
        return self.accumulator.submit(after, dst, src)

    def copy_all_to_host(self, device: torch.device, pairs: Sequence[tuple[Tensor, Tensor]]) -> Completion:
        return self.lane(device).copy_all_to_host(pairs)

    def send_to_device(self, device: torch.device, pairs: Sequence[tuple[Tensor, Tensor]],
                       after: Completion = DONE) -> Completion:
        return self.lane(device).send_to_device(pairs, after)

    def send_after_compute(self, devices: set[torch.device]) -> None:
        for device in devices:
            self.lane(device).send_after_compute()

    def compute_waits(self, device: torch.device, completion: Completion) -> None:
        self.lane(device).compute_waits(completion)

    def mark(self, device: torch.device) -> Completion:
        return self.lane(device).mark()

    def to_device(self, device: torch.device, host: Tensor) -> Tensor:
        """A copy on ``device`` of the small host tensor ``host`` (a step's counts, its loss scale), ordered before
        the work issued next on the current stream of ``device``, without the host waiting for the device (see the
        module contract)."""
        if host.device.type != "cpu" or is_device_tensor(host):
            return host.to(device)  # on a device already (a GradScaler's scale): no copy through the host
        out = self.lane(device).to_device(device, host)
        if out is not host and out.device.type == "cpu" and self.backend_for(device) is not None:
            claim(out)  # a tensor of the simulated device
        return out

    def current_stream_waits(self, device: torch.device, completion: Completion) -> None:
        self.lane(device).current_stream_waits(completion)

    def synchronize(self) -> None:
        """Every copy this engine issued has ended (before page-locked memory is released)."""
        for lane in list(self._lanes.values()):
            lane.synchronize()

    def close(self) -> None:
        """Stop the worker threads (the pipeline is being dropped)."""
        self.accumulator.stop()
        for lane in list(self._lanes.values()):
            lane.close()


