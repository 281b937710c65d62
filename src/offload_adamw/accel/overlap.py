"""Host updates that start while backward is still running.

Contract:

* The buckets of a step are fixed before its backward begins (from the order in which the previous
  backward produced gradients): each is a list of keys. :meth:`BackwardUpdater.landed` is called,
  from backward's hooks, when one key's gradient is complete in host memory (or its copy is at
  least issued: the update function waits for it). When every key of a bucket has landed, the bucket
  is handed to one worker thread, which runs ``update(bucket)``; backward is never blocked by it.
* A *gate* holds every update back until it is opened: the updates of a clipped step need the
  global gradient norm, known only when the last gradient has landed; :meth:`BackwardUpdater.open_gate` is called
  then (or by ``finish``). Without a gate, buckets start as they complete.
* ``update(index)`` returns None or ``(timings, result)``: the timings go into the bucket's record's ``extra``, the
  result (what the update issued: the copies it sent back) into its ``result``. The caller takes results only from
  the records :meth:`BackwardUpdater.finish` returns, after the worker has ended: no result is read while an update
  may still add to it.
* :meth:`BackwardUpdater.settle` waits for the updates handed to the worker so far (the schedule calls it when
  backward ends). :meth:`BackwardUpdater.finish` (called by ``step()``) opens the gate, waits for the worker, re-raises the first
  error of an update, and returns the buckets not updated (those whose gradients did not all land,
  which the caller updates itself) and the timeline records of those that were.
* The worker thread runs ``thread_init`` first (accel/transfer.py: on CUDA it makes the pipeline's
  device current, so that no thread creates a context on device 0).
* Buckets are updated in the order they completed; each bucket once per step. An updater of no buckets (the
  last step updated no parameter that still holds a gradient) does nothing and starts no thread.
* :class:`Armed` holds the updater of the coming backward, if any: the schedule (accel/schedule.py) sets it, and
  the gate (accel/gate.py) opens it when backward's end lets the gated updates start. The front builds it first,
  so that both get it at construction (neither is patched with the other's method afterwards).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Armed", "BackwardUpdater", "UpdateRecord"]


@dataclass
class UpdateRecord:
    """When one bucket's last gradient landed and when its update ran (monotonic seconds)."""

    bucket: int
    ready: float
    start: float = 0.0
    end: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    """What the update function reported (for example when its copies were complete)."""
    result: Any = None
    """What the update function returned besides its timings (see the module contract)."""


class BackwardUpdater:
    """One step's early host updates (see the module contract)."""

    def __init__(
        self,
        buckets: Sequence[Sequence[Hashable]],
        update: Callable[[int], tuple[dict[str, float], Any] | None],
        *,
        gated: bool,
        thread_init: Callable[[], None] | None = None,
    ) -> None:
        self._buckets = [list(b) for b in buckets]
        self._update = update
        self._where: dict[Hashable, int] = {key: index for index, b in enumerate(self._buckets) for key in b}
        self._missing = [set(b) for b in self._buckets]
        self._lock = threading.Lock()
        self._gate_open = not gated
        self._queued: list[int] = []  # complete buckets waiting for the gate, in completion order
        self._records: dict[int, UpdateRecord] = {}
        self._futures: list[Future] = []
        self._enabled = bool(self._buckets)
        self._pool: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(1, thread_name_prefix="offload-adamw-update", initializer=thread_init)
            if self._enabled else None
        )
        self._worker: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self._enabled

    def landed(self, key: Hashable) -> None:
        """``key``'s gradient is in host memory (or on its way there)."""
        if not self._enabled:
            return
        now = time.monotonic()
        with self._lock:
            index = self._where.get(key)
            if index is None or index in self._records or key not in self._missing[index]:
                return
            self._missing[index].discard(key)
            if self._missing[index]:
                return
            self._records[index] = UpdateRecord(bucket=index, ready=now)
            if self._gate_open:
                self._submit(index)
            else:
                self._queued.append(index)

    def gated(self) -> bool:
        """Whether updates wait for :meth:`BackwardUpdater.open_gate`."""
        with self._lock:
            return not self._gate_open

    def started(self) -> bool:
        """Whether any bucket's update was handed to the worker (some state may have changed)."""
        with self._lock:
            return bool(self._records)

    def covers(self, key: Hashable) -> bool:
        """Whether ``key``'s bucket was handed to the worker in this step."""
        with self._lock:
            index = self._where.get(key)
            return index is not None and index in self._records

    def open_gate(self) -> None:
        """Let every complete bucket's update start (the global norm is known, or step() was called)."""
        with self._lock:
            if self._gate_open:
                return
            self._gate_open = True
            queued, self._queued = self._queued, []
            for index in queued:
                self._submit(index)

    def _submit(self, index: int) -> None:
        assert self._pool is not None
        self._futures.append(self._pool.submit(self._run, index))

    def _run(self, index: int) -> None:
        self._worker = threading.current_thread()
        record = self._records[index]
        record.start = time.monotonic()
        out = self._update(index)
        record.end = time.monotonic()
        if out is not None:
            extra, record.result = out
            record.extra.update(extra)

    def settle(self) -> None:
        """Wait for every update handed to the worker so far (an error stays for :meth:`finish` to raise)."""
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            future.exception()

    def settled_results(self) -> list[Any]:
        """What each update that has ended returned, in bucket order; after :meth:`settle` every update handed to
        the worker has (the early updates' copies back, for a wait before their parameters are fingerprinted)."""
        with self._lock:
            futures = list(self._futures)
            records = dict(self._records)
        if not all(f.done() for f in futures):
            raise RuntimeError("settled_results() before settle(): an update is still running")
        return [records[i].result for i in sorted(records) if records[i].end and records[i].result is not None]

    def finish(self) -> tuple[list[int], list[UpdateRecord]]:
        """Wait for every started update; (buckets still to update, records of those updated)."""
        if not self._enabled:
            return list(range(len(self._buckets))), []
        self.open_gate()
        error: BaseException | None = None
        for future in self._futures:
            exc = future.exception()
            if exc is not None and error is None:
                error = exc
        assert self._pool is not None
        self._pool.shutdown(wait=True)
        self._pool = None
        self._enabled = False
        if error is not None:
            raise error
        done = sorted(self._records)
        remaining = [i for i in range(len(self._buckets)) if i not in self._records]
        return remaining, [self._records[i] for i in done]

    def close(self) -> None:
        """Drop the step without waiting for more gradients (used when the step is abandoned). From the worker itself
        (an optimizer let go while its update ran) nothing waits: the worker ends with its update."""
        if self._pool is not None:
            self._pool.shutdown(wait=threading.current_thread() is not self._worker)
            self._pool = None
        self._enabled = False



class Armed:
    """The backward updater of the coming step, or None: every update runs at step() (see the module contract)."""

    def __init__(self) -> None:
        self.updater: BackwardUpdater | None = None

    def open_gate(self) -> None:
        """The end of backward lets the gated updates start."""
        if self.updater is not None:
            self.updater.open_gate()
