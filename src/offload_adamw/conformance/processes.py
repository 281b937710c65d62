"""The checker's forked processes: one per clause with a time limit, and the one that holds the candidate.

Contract:

* :func:`run_forked` runs a callable in a forked child and returns ``(True, its result)`` or
  ``(False, why there is none)``: the time limit passed (the child is killed), the child ended
  before it answered (its exit status or signal is named), or its answer could not be read.
  The callable's result travels back pickled; the child ends with ``os._exit`` (no atexit
  handlers, no second flush of the parent's buffers).
* :func:`run_many` runs several such callables, at most ``workers`` at a time, each with its
  own time limit counted from its own start; a task marked *alone* starts only when nothing
  else runs and nothing starts beside it (a timing). It yields ``(key, ran, result)`` as the
  tasks end.
* :class:`CandidateProcess` is a forked child in a process group of its own: it imports the
  candidate there, so that nothing the candidate does on import (``sys.exit``, ``os._exit``,
  a hang, a crash) reaches the calling process. It sends framed messages back; the caller
  reads them with a deadline (:meth:`CandidateProcess.receive`), and :meth:`close` kills the
  whole group (the process and every clause child it forked). The command line runs its checks
  in one with ``own_group=False``, which stays in the terminal's group so that an interrupt
  reaches it and it closes what it started.

Children set torch's intra-op threads to 1 where torch is loaded: the parent's OpenMP pool
does not survive fork (a second one would deadlock), and clause children may run side by
side. This module imports no torch, so that the command line can run a whole check in a
child (:class:`Pending`) and keep torch out of its own process.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["run_forked", "run_many", "Task", "Pending", "CandidateProcess", "send_message", "exit_text", "available_workers"]

_REAP_SECONDS = 5.0
_END_GRACE_SECONDS = 2.0
"""How long a child in the caller's group is given to end by itself, then again after an interrupt."""


def exit_text(status: int) -> str:
    """A wait status as words: ``exit status 3`` or ``killed by signal SIGKILL``."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"killed by signal {signal.Signals(number).name}"
        except ValueError:
            return f"killed by signal {number}"
    if os.WIFEXITED(status):
        return f"exit status {os.WEXITSTATUS(status)}"
    return f"wait status {status}"


def available_workers() -> int:
    """How many clause children may run side by side: two where two cores are there, else one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


def _child_main(run: Callable[[], Any], write_fd: int) -> None:
    """The forked child: run, send the pickled result, end without running anything of the parent's."""
    code = 0
    try:
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(1)
        result = run()
        try:
            data = pickle.dumps(result)
        except Exception as exc:  # an answer that cannot travel is reported, not lost
            data = pickle.dumps(_Unsendable(f"{type(exc).__name__}: {exc}"))
        view = memoryview(data)
        while view:
            written = os.write(write_fd, view)
            view = view[written:]
    except BaseException:
        code = 70  # the checker's own failure in the child: the parent reports the exit status
    finally:
        _flush_and_exit(code)


def _flush_and_exit(code: int) -> None:
    """End a forked child: what it printed itself is flushed, nothing of the parent's runs (no atexit)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # a stream the candidate closed or replaced
            pass
    os._exit(code)


@dataclass(frozen=True)
class _Unsendable:
    why: str


def _fork(run: Callable[[], Any]) -> tuple[int, int]:
    """Fork a child running ``run``; (pid, the read end of its result pipe)."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, which ends with os._exit
        os.close(read_fd)
        _child_main(run, write_fd)
    os.close(write_fd)
    return pid, read_fd


def _reap(pid: int, *, kill: bool) -> int:
    """Wait for ``pid`` (killing it first, or after a grace period) and return its wait status."""
    if kill:
        _kill(pid)
    status = _wait_status(pid, _REAP_SECONDS)
    if status is None:
        _kill(pid)
        return os.waitpid(pid, 0)[1]
    return status


def _wait_status(pid: int, seconds: float) -> int | None:
    """The wait status of ``pid`` once it ends within ``seconds`` (0 when it was reaped already), else None."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        if done:
            return status
        if time.monotonic() > deadline:
            return None
        time.sleep(0.001)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


CLAUSE_ENDED = "the candidate ended the process ({status}) before the clause finished"


def _decode(data: bytes, status: int, ended: str = CLAUSE_ENDED) -> tuple[bool, Any]:
    if not data:
        return False, ended.format(status=exit_text(status))
    try:
        result = pickle.loads(data)
    except Exception as exc:
        return False, f"the clause's answer could not be read ({type(exc).__name__}: {exc}; {exit_text(status)})"
    if isinstance(result, _Unsendable):
        return False, f"the clause's answer could not be sent back ({result.why})"
    return True, result


def _timeout_text(timeout: float) -> str:
    return f"the clause did not finish within {timeout:g} s (the candidate hangs or is too slow; see --timeout)"


def run_forked(run: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
    """Run ``run()`` in a forked child; (True, its result) or (False, why it gave none: a timeout, an exit, a signal)."""
    return Pending(run).result(timeout)


class Pending:
    """A forked child started now whose result is collected later (:meth:`result`), so that the caller works meanwhile."""

    def __init__(self, run: Callable[[], Any], *, ended: str = CLAUSE_ENDED):
        self._pid, self._fd = _fork(run)
        self._started = time.monotonic()
        self._ended = ended
        """What an answerless end is reported as (``{status}``: the exit status in words)."""

    def result(self, timeout: float | None) -> tuple[bool, Any]:
        """(True, the result) or (False, why none came) within ``timeout`` seconds of the start (None: no limit).

        Whatever ends the wait early (an interrupt) kills the child first."""
        data = bytearray()
        deadline = None if timeout is None else self._started + timeout
        reaped = False
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    _reap(self._pid, kill=True)
                    reaped = True
                    return False, _timeout_text(timeout or 0.0)
                try:
                    ready, _, _ = select.select([self._fd], [], [], left)
                except InterruptedError:  # pragma: no cover - a signal handler ran; select is retried
                    continue
                if not ready:
                    continue
                chunk = os.read(self._fd, 1 << 16)
                if not chunk:
                    status = _reap(self._pid, kill=False)
                    reaped = True
                    return _decode(bytes(data), status, self._ended)
                data.extend(chunk)
        finally:
            os.close(self._fd)
            if not reaped:
                _reap(self._pid, kill=True)


@dataclass(frozen=True)
class Task:
    """One callable for :func:`run_many`."""

    key: Any
    """What the result is yielded with."""
    run: Callable[[], Any]
    """Runs in the child; its result must pickle."""
    alone: bool = False
    """Start only when no other task runs, and start none beside it (a timing)."""


@dataclass
class _Running:
    task: Task
    pid: int
    fd: int
    deadline: float
    data: bytearray


def run_many(tasks: Sequence[Task], timeout: float, *, workers: int) -> Iterator[tuple[Any, bool, Any]]:
    """Run each task in a forked child, at most ``workers`` at once; yield (key, ran, result) as they end."""
    waiting = list(tasks)
    running: dict[int, _Running] = {}
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                if waiting[0].alone and running:
                    break
                if any(r.task.alone for r in running.values()):
                    break
                task = waiting.pop(0)
                pid, fd = _fork(task.run)
                running[fd] = _Running(task, pid, fd, time.monotonic() + timeout, bytearray())
                if task.alone:
                    break
            now = time.monotonic()
            wait = max(0.0, min(r.deadline for r in running.values()) - now)
            try:
                ready, _, _ = select.select(list(running), [], [], wait)
            except InterruptedError:  # pragma: no cover - a signal handler ran; select is retried
                continue
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    running[fd].data.extend(chunk)
                    continue
                done = running.pop(fd)
                os.close(fd)
                status = _reap(done.pid, kill=False)
                ran, result = _decode(bytes(done.data), status)
                yield done.task.key, ran, result
            now = time.monotonic()
            for fd in [fd for fd, r in running.items() if r.deadline <= now and fd not in ready]:
                late = running.pop(fd)
                os.close(fd)
                _reap(late.pid, kill=True)
                yield late.task.key, False, _timeout_text(timeout)
    finally:
        for late in running.values():  # the caller stopped early (an exception, a closed generator)
            os.close(late.fd)
            _reap(late.pid, kill=True)


# ----------------------------------------------------------------------------- the candidate's process

_FRAME = struct.Struct("!I")


def send_message(fd: int, message: Any) -> None:
    """Write one framed message (length, then the pickle) to ``fd``."""
    data = pickle.dumps(message)
    view = memoryview(_FRAME.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


class CandidateProcess:
    """A forked child, leader of its own process group, that runs ``main(send)``; ``send`` frames messages back.

    With ``own_group=False`` it stays in the caller's group (an interrupt at the terminal reaches it too, so
    that it can close what it started) and :meth:`close` kills the child alone."""

    def __init__(self, main: Callable[[Callable[[Any], None]], None], *, own_group: bool = True):
        def body() -> None:
            main(lambda message: send_message(write_fd, message))

        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child, which ends with os._exit
            os.close(read_fd)
            code = 0
            try:
                if own_group:
                    os.setpgid(0, 0)
                body()
            except BaseException:
                code = 70
            finally:
                _flush_and_exit(code)
        os.close(write_fd)
        if own_group:
            try:
                os.setpgid(pid, pid)  # also here: the caller may kill the group before the child has set it
            except OSError:
                pass
        self.pid = pid
        self._own_group = own_group
        self._fd: int | None = read_fd
        self._buffer = bytearray()
        self.status: int | None = None

    def receive(self, timeout: float) -> tuple[str, Any]:
        """("message", the next message), ("ended", wait status) or ("late", None) after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self._buffer) >= _FRAME.size:
                (size,) = _FRAME.unpack_from(self._buffer)
                if len(self._buffer) >= _FRAME.size + size:
                    data = bytes(self._buffer[_FRAME.size:_FRAME.size + size])
                    del self._buffer[:_FRAME.size + size]
                    return "message", pickle.loads(data)
            if self._fd is None:
                return "ended", self.status
            left = deadline - time.monotonic()
            if left <= 0:
                return "late", None
            try:
                ready, _, _ = select.select([self._fd], [], [], left)
            except InterruptedError:  # pragma: no cover
                continue
            if not ready:
                continue
            chunk = os.read(self._fd, 1 << 16)
            if chunk:
                self._buffer.extend(chunk)
                continue
            os.close(self._fd)
            self._fd = None
            self.status = _reap(self.pid, kill=False)

    def close(self) -> None:
        """Kill the process and everything it forked (its group), and reap it. Without a group of its own the
        process is given the chance to close what it started first: see :meth:`_end_alone`."""
        if not self._own_group:
            if self._fd is not None:
                os.close(self._fd)  # a child blocked writing to us gets an error now, and ends
                self._fd = None
            if self.status is None:
                self.status = self._end_alone()
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.status is None:
            self.status = _reap(self.pid, kill=True)

    def _end_alone(self) -> int:
        """The wait status of a child in the caller's group, once it ended: it may be ending already (an interrupt
        at the terminal reached it too, and it closes what it started); else it is interrupted so that it does;
        a child that still runs after that is killed."""
        for interrupt in (False, True):
            if interrupt:
                try:
                    os.kill(self.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
            status = _wait_status(self.pid, _END_GRACE_SECONDS)
            if status is not None:
                return status
        return _reap(self.pid, kill=True)
