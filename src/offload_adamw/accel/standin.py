"""An asynchronous stand-in device: CUDA's ordering semantics on the CPU, for tests.

On the CPU every copy is finished the moment it is issued, so a pipeline that reads a buffer before
the copy that fills it has landed, or overwrites a buffer a pending copy still reads, is right there
by accident. This lane makes those mistakes give wrong bits.

Contract:

* Chosen for every pipeline built while the environment variable ``OFFLOAD_ADAMW_STANDIN_DEVICE``
  holds a seed (an integer), or inside :func:`use`. Every parameter, CPU tensors included, is then a
  device parameter: its gradient is copied to a host buffer, its update written into a staging buffer
  and sent back, as on a GPU (accel/transfer.py's ``is_device``).
* Each stream (device-to-host, host-to-device) is a worker thread that runs its queue in order; each
  copy lands after a seeded random delay. A completion is complete when its stream has reached it. The
  compute stream is the calling thread: where CUDA would make the compute stream wait, it blocks.
* A copy's destination is filled with a poison pattern (NaN in every floating dtype) when the copy is
  issued and receives the data only when it lands, so a read before the wait reads NaN. The copy reads
  its source when it runs; a source changed between issue and landing (a buffer overwritten while a
  copy still reads it) leaves the destination poisoned and records a hazard (:func:`hazards`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from offload_adamw.accel.transfer import DONE, Completion, HostCompletion, TransferEngine

__all__ = ["ENV", "clear_hazards", "engine", "hazards", "is_device_tensor", "requested_seed", "use"]

ENV = "OFFLOAD_ADAMW_STANDIN_DEVICE"
"""The environment variable that selects the stand-in for every new pipeline (its value: the seed)."""

MAX_DELAY_S = 0.001
"""The longest ordinary delay of a copy; one copy in 25 waits SLOW_DELAY_S instead."""
SLOW_DELAY_S = 0.005

_override: list[int] = []
# The tensors stand-in engines serve, by id, each held weakly (its entry goes with it; a tensor's == is elementwise,
# so no weak set of tensors can hold them).
_device_tensors: dict[int, weakref.ref[Tensor]] = {}
_hazards: list[str] = []
_hazards_lock = threading.Lock()
_engines = itertools.count()


def requested_seed() -> int | None:
    """The seed a test asked for (:func:`use`, else the environment), or None for the real lanes."""
    if _override:
        return _override[-1]
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{ENV} must be an integer seed, got {value!r}") from None


@contextlib.contextmanager
def use(seed: int) -> Iterator[None]:
    """Pipelines built inside this context run on the stand-in device with ``seed``."""
    _override.append(int(seed))
    try:
        yield
    finally:
        _override.pop()


def is_device_tensor(t: Tensor) -> bool:
    """Whether ``t`` is a parameter (or a shard of one) that a stand-in device serves: it lives "on the device",
    so the optimizer keeps a master for it and never writes it from the host (optim/state.py asks)."""
    ref = _device_tensors.get(id(t))
    return ref is not None and ref() is t


def hazards() -> list[str]:
    """The hazards recorded so far in this process: each a buffer changed while a copy still read it."""
    with _hazards_lock:
        return list(_hazards)


def clear_hazards() -> None:
    with _hazards_lock:
        _hazards.clear()


def _record(hazard: str) -> None:
    with _hazards_lock:
        _hazards.append(hazard)


def _poison(t: Tensor) -> None:
    with torch.no_grad():
        t.fill_(float("nan") if t.is_floating_point() else -1)


def _same(a: Tensor, b: Tensor) -> bool:
    """Bitwise, NaN-safe."""
    if a.numel() == 0:
        return True
    if a.is_floating_point():
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(width), b.contiguous().view(width))
    return torch.equal(a, b)


_streams: weakref.WeakSet[_Stream] = weakref.WeakSet()


def _drain_at_exit() -> None:
    """Let every stream finish its queue before the interpreter goes: a daemon thread stopped inside a torch op at
    shutdown aborts the process."""
    streams = list(_streams)
    for stream in streams:
        stream.stop()
    for stream in streams:
        stream.join(timeout=5.0)


class _Stream:
    """A queue of work run in order by one worker thread, each copy after a seeded random delay."""

    def __init__(self, name: str, seed: int) -> None:
        self._name = name
        self._rng = random.Random(seed)
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"offload-adamw-standin-{name}", daemon=True)
        self._thread.start()
        _streams.add(self)

    def submit(self, work: Callable[[], None], *, copy: bool) -> Completion:
        done = HostCompletion()
        self._jobs.put((work, copy, done))
        return done

    def synchronize(self) -> None:
        self.submit(lambda: None, copy=False).wait()

    def stop(self) -> None:
        self._jobs.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            work, copy, done = job
            if copy:
                slow = self._rng.random() < 0.04
                time.sleep(SLOW_DELAY_S if slow else self._rng.uniform(0.0, MAX_DELAY_S))
            try:
                work()
            except BaseException as error:
                done.fail(error)
            else:
                done.finish()


class _StandInLane:
    """One stand-in device: a device-to-host and a host-to-device stream."""

    def __init__(self, seed: int) -> None:
        self.d2h = _Stream("d2h", seed * 7919 + 1)
        self.h2d = _Stream("h2d", seed * 7919 + 2)

    def copy_to_host(self, src: Tensor, dst: Tensor) -> Completion:
        expected = src.detach().clone()
        _poison(dst)

        def land() -> None:
            with torch.no_grad():
                dst.copy_(src)
            if not _same(src.detach(), expected):
                _poison(dst)
                _record(f"a device tensor of shape {tuple(src.shape)} changed while its copy to the host was pending")

        return self.d2h.submit(land, copy=True)

    def copy_all_to_host(self, pairs: Sequence[tuple[Tensor, Tensor]]) -> Completion:
        expected = [src.detach().clone() for src, _ in pairs]
        for _, dst in pairs:
            _poison(dst)

        def land() -> None:
            with torch.no_grad():
                for (src, dst), before in zip(pairs, expected):
                    dst.copy_(src)
                    if not _same(src.detach(), before):
                        _poison(dst)
                        _record(f"a device tensor of shape {tuple(src.shape)} changed while its copy to the host was "
                                "pending")

        return self.d2h.submit(land, copy=True)

    def send_to_device(self, pairs: Sequence[tuple[Tensor, Tensor]], after: Completion = DONE) -> Completion:
        after.wait()  # where CUDA's copy stream would wait for the event, the calling thread blocks
        expected = [host.detach().clone() for _, host in pairs]
        for device_tensor, _ in pairs:
            _poison(device_tensor.detach())

        def land() -> None:
            with torch.no_grad():
                for (device_tensor, host), before in zip(pairs, expected):
                    # Through .data: the version counter moves once, at issue, as a CUDA copy's does.
                    device_tensor.data.copy_(host)
                    if not _same(host, before):
                        _poison(device_tensor.data)
                        _record(f"a host buffer of shape {tuple(host.shape)} was overwritten while its copy to the "
                                "device was pending")

        return self.h2d.submit(land, copy=True)

    def send_after_compute(self) -> None:
        return None  # the compute stream is the calling thread: what it issued is done

    def compute_waits(self, completion: Completion) -> None:
        completion.wait()

    def mark(self) -> Completion:
        return DONE

    def current_stream_waits(self, completion: Completion) -> None:
        completion.wait()

    def synchronize(self) -> None:
        self.d2h.synchronize()
        self.h2d.synchronize()

    def close(self) -> None:
        self.d2h.stop()
        self.h2d.stop()


class _StandInEngine(TransferEngine):
    def claim(self, tensor: Tensor) -> None:
        key = id(tensor)

        def forget(_: object) -> None:
            _device_tensors.pop(key, None)

        _device_tensors[key] = weakref.ref(tensor, forget)


atexit.register(_drain_at_exit)


def engine(seed: int) -> TransferEngine:
    """A transfer engine whose every lane is a stand-in device (each engine of a process draws its own delays)."""
    index = next(_engines)
    return _StandInEngine(lambda device: _StandInLane(seed * 100_003 + index), every_device=True)
