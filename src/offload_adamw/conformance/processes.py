"""The checker's processes: one per clause with a time limit, and the one that holds the candidate.

They are :mod:`multiprocessing` processes of the ``fork`` context, as the audit's are
(:mod:`offload_adamw.auditing.inputs`): a clause is a closure over the candidate that the
process holding it loaded, which a fresh interpreter (spawn, forkserver) could not import
again by name, and a fresh one would import torch again for every clause.

Contract:

* :func:`run_forked` runs a callable in a child and returns ``(True, its result)`` or
  ``(False, why there is none)``: the time limit passed (the child is killed), the child ended
  before it answered (its exit status or signal is named), or its answer could not be read.
  The callable's result travels back pickled; the child ends with ``os._exit`` (no atexit
  handlers, no second flush of the parent's buffers; its stdin is ``/dev/null``, as in every
  multiprocessing child).
* :func:`run_many` runs several such callables, at most ``workers`` at a time, each with its
  own time limit counted from its own start; a task marked *alone* starts only when nothing
  else runs and nothing starts beside it (a timing). It yields ``(key, ran, result)`` as the
  tasks end.
* :class:`CandidateProcess` is a child in a process group of its own: it imports the
  candidate there, so that nothing the candidate does on import (``sys.exit``, ``os._exit``,
  a hang, a crash) reaches the calling process. It sends messages back; the caller
  reads them with a deadline (:meth:`CandidateProcess.receive`), and :meth:`close` kills the
  whole group (the process and every clause child it started). The command line runs its checks
  in one with ``own_group=False``, which stays in the terminal's group so that an interrupt
  reaches it and it closes what it started.
* Exit statuses are multiprocessing's exit codes (negative: the signal), in words by :func:`exit_text`.

Children set torch's intra-op threads to 1 where torch is loaded: the parent's OpenMP pool
does not survive fork (a second one would deadlock), and clause children may run side by
side. This module imports no torch, so that the command line can run a whole check in a
child (:class:`CandidateProcess`) and keep torch out of its own process.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["run_forked", "run_many", "Task", "Pending", "CandidateProcess", "exit_text", "available_workers"]

_REAP_SECONDS = 5.0
_END_GRACE_SECONDS = 2.0
"""How long a child in the caller's group is given to end by itself, then again after an interrupt."""


def exit_text(code: int | None) -> str:
    """An exit code as multiprocessing gives it, in words: ``exit status 3`` or ``killed by signal SIGKILL``."""
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def available_workers() -> int:
    """How many clause children may run side by side: two where two cores are there, else one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


def _start(target: Callable[..., None], *args: Any) -> tuple[BaseProcess, Connection]:
    """Start ``target(*args, sender)`` in a forked child; (the process, the receiving end of its pipe).

    Not a daemon: a daemonic process may start no process of its own, and the candidate's process
    starts the clauses' (as a candidate may in its own steps). Whoever starts one therefore ends it
    (every path below reaps what it started), or multiprocessing's exit handler would wait for it.
    The context flushes stdout and stderr before it forks, so that nothing buffered is written twice."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(*args, sender))
    process.start()
    sender.close()  # the child's end alone stays open: its end is the end of the answer (EOF)
    return process, receiver


def _child_main(run: Callable[[], Any], sender: Connection) -> None:
    """The child: run, send the pickled result, end without running anything of the parent's."""
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
        sender.send_bytes(data)
    except BaseException:
        code = 70  # the checker's own failure in the child: the parent reports the exit status
    finally:
        _flush_and_exit(code)


def _flush_and_exit(code: int) -> None:
    """End a child: what it printed itself is flushed, nothing of the parent's runs (no atexit, no multiprocessing
    epilogue)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # a stream the candidate closed or replaced
            pass
    os._exit(code)


@dataclass(frozen=True)
class _Unsendable:
    why: str


def _receive_bytes(receiver: Connection) -> bytes:
    """The child's whole answer, or nothing where it ended without one (or was killed while it sent it)."""
    try:
        return receiver.recv_bytes()
    except (EOFError, OSError):
        return b""


def _reap(process: BaseProcess, *, kill: bool) -> int:
    """Wait for ``process`` (killing it first, or after a grace period) and return its exit code."""
    if kill:
        process.kill()
    code = _wait_exit(process, _REAP_SECONDS)
    if code is None:
        process.kill()
        process.join()
        code = process.exitcode
    if code is None:  # something else in this process reaped it already (a candidate's os.wait()): as a clean end
        return 0
    process.close()  # its sentinel's descriptors
    return code


def _wait_exit(process: BaseProcess, seconds: float) -> int | None:
    """The exit code of ``process`` once it ends within ``seconds``, else None.

    Polled, not ``join(timeout)``: that waits on the process's sentinel, whose other end the
    children it started inherit, so a dead clause runner would look alive while its clause runs."""
    deadline = time.monotonic() + seconds
    while True:
        code = process.exitcode
        if code is not None:
            return code
        if time.monotonic() > deadline:
            return None
        time.sleep(0.001)


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
    """Run ``run()`` in a child; (True, its result) or (False, why it gave none: a timeout, an exit, a signal)."""
    return Pending(run).result(timeout)


class Pending:
    """A child started now whose result is collected later (:meth:`result`), so that the caller works meanwhile;
    a caller that no longer wants it calls :meth:`cancel`."""

    def __init__(self, run: Callable[[], Any], *, ended: str = CLAUSE_ENDED):
        self._process, self._receiver = _start(_child_main, run)
        self._started = time.monotonic()
        self._ended = ended
        """What an answerless end is reported as (``{status}``: the exit status in words)."""

    def result(self, timeout: float | None) -> tuple[bool, Any]:
        """(True, the result) or (False, why none came) within ``timeout`` seconds of the start (None: no limit).

        Whatever ends the wait early (an interrupt) kills the child first."""
        reaped = False
        try:
            left = None if timeout is None else max(0.0, self._started + timeout - time.monotonic())
            if not self._receiver.poll(left):
                _reap(self._process, kill=True)
                reaped = True
                return False, _timeout_text(timeout or 0.0)
            data = _receive_bytes(self._receiver)
            status = _reap(self._process, kill=False)
            reaped = True
            return _decode(data, status, self._ended)
        finally:
            self._receiver.close()
            if not reaped:
                _reap(self._process, kill=True)

    def cancel(self) -> None:
        """Kill the child and reap it (its result is not wanted)."""
        self._receiver.close()
        _reap(self._process, kill=True)


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
    process: BaseProcess
    receiver: Connection
    deadline: float


def run_many(tasks: Sequence[Task], timeout: float, *, workers: int) -> Iterator[tuple[Any, bool, Any]]:
    """Run each task in a child, at most ``workers`` at once; yield (key, ran, result) as they end."""
    waiting = list(tasks)
    running: list[_Running] = []
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                if waiting[0].alone and running:
                    break
                if any(r.task.alone for r in running):
                    break
                task = waiting.pop(0)
                process, receiver = _start(_child_main, task.run)
                running.append(_Running(task, process, receiver, time.monotonic() + timeout))
                if task.alone:
                    break
            left = max(0.0, min(r.deadline for r in running) - time.monotonic())
            ready = wait([r.receiver for r in running], left)
            for done in [r for r in running if r.receiver in ready]:
                running.remove(done)
                data = _receive_bytes(done.receiver)
                done.receiver.close()
                ran, result = _decode(data, _reap(done.process, kill=False))
                yield done.task.key, ran, result
            now = time.monotonic()
            for late in [r for r in running if r.deadline <= now]:
                running.remove(late)
                late.receiver.close()
                _reap(late.process, kill=True)
                yield late.task.key, False, _timeout_text(timeout)
    finally:
        for late in running:  # the caller stopped early (an exception, a closed generator)
            late.receiver.close()
            _reap(late.process, kill=True)


# ----------------------------------------------------------------------------- the candidate's process


def _candidate_main(main: Callable[[Callable[[Any], None]], None], own_group: bool, sender: Connection) -> None:
    """The candidate's process: a group of its own (where asked), then ``main(send)``; ends as a clause child does."""
    code = 0
    try:
        if own_group:
            os.setpgid(0, 0)
        main(sender.send)
    except BaseException:
        code = 70
    finally:
        _flush_and_exit(code)


class CandidateProcess:
    """A child, leader of its own process group, that runs ``main(send)``; ``send`` pickles messages back.

    With ``own_group=False`` it stays in the caller's group (an interrupt at the terminal reaches it too, so
    that it can close what it started) and :meth:`close` kills the child alone."""

    def __init__(self, main: Callable[[Callable[[Any], None]], None], *, own_group: bool = True):
        self._process, receiver = _start(_candidate_main, main, own_group)
        pid = self._process.pid
        assert pid is not None
        if own_group:
            try:
                os.setpgid(pid, pid)  # also here: the caller may kill the group before the child has set it
            except OSError:
                pass
        self.pid = pid
        self._own_group = own_group
        self._receiver: Connection | None = receiver
        self.status: int | None = None
        """The exit code once the process ended (see :func:`exit_text`)."""

    def receive(self, timeout: float) -> tuple[str, Any]:
        """("message", the next message), ("ended", exit code) or ("late", None) after ``timeout`` seconds."""
        if self._receiver is None:
            return "ended", self.status
        if not self._receiver.poll(max(0.0, timeout)):
            return "late", None
        try:
            return "message", self._receiver.recv()
        except (EOFError, OSError):
            self._receiver.close()
            self._receiver = None
            self.status = _reap(self._process, kill=False)
            return "ended", self.status

    def close(self) -> None:
        """Kill the process and everything it started (its group), and reap it. Without a group of its own the
        process is given the chance to close what it started first: see :meth:`_end_alone`."""
        if not self._own_group:
            if self._receiver is not None:
                self._receiver.close()  # a child blocked writing to us gets an error now, and ends
                self._receiver = None
            if self.status is None:
                self.status = self._end_alone()
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if self.status is None:
            self.status = _reap(self._process, kill=True)

    def _end_alone(self) -> int:
        """The exit code of a child in the caller's group, once it ended: it may be ending already (an interrupt
        at the terminal reached it too, and it closes what it started); else it is interrupted so that it does;
        a child that still runs after that is killed."""
        for interrupt in (False, True):
            if interrupt:
                try:
                    os.kill(self.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
            code = _wait_exit(self._process, _END_GRACE_SECONDS)
            if code is not None:
                self._process.close()
                return code
        return _reap(self._process, kill=True)
