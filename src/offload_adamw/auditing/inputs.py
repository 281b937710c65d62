"""What the audit reads from a file: a training script's set-up, or a saved optimizer state_dict.

Contract:

* A path ending in ``.py`` is a SCRIPT. It is run as a module named
  ``__offload_adamw_audit__`` (so its ``if __name__ == "__main__":`` block,
  the training loop, does not run), then its function ``audit_setup()`` (or
  the one named by ``function``) is called without arguments. It returns
  either a dict with the keys ``model`` and ``optimizer`` and optionally
  ``scheduler``, ``steps`` (optimizer updates of the run) and
  ``grad_accumulation``, or a tuple ``(model, optimizer[, scheduler[, steps]])``.
* Any other path is a CHECKPOINT: a ``torch.save``d optimizer state_dict,
  loaded with ``weights_only=True`` (no code runs), or a dict holding one as a
  top-level value (e.g. ``{"model": ..., "optimizer": ...}``).
  What it returns is checked before the audit: ``model`` a ``torch.nn.Module``,
  ``optimizer`` an optimizer (``param_groups`` and ``state``), ``scheduler`` None or
  something with ``step()``, ``steps`` None or an int >= 0, ``grad_accumulation``
  None, an int >= 1 or a pair of them.
* The script runs, and is audited, in a forked child process where fork exists and
  CUDA is not initialized in this process (elsewhere in this process): a script that
  ends the process while it is run or set up (``sys.exit``, ``os._exit``, a crash)
  ends the child, and the audit says so instead of exiting with the script's status.
* :func:`audit_file` returns the :class:`~offload_adamw.auditing.audit.AuditReport`
  of either; ``steps`` and ``grad_accumulation`` given to it override what the
  script returns. Whatever keeps the file from giving an optimizer set-up (a script
  that raises, exits or returns the wrong things; a file that is no optimizer
  state_dict) raises :class:`AuditInputError`, whose message starts with the file's
  path and is one line.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from offload_adamw.auditing.audit import AuditReport, audit, audit_state_dict

__all__ = ["AuditInputError", "SCRIPT_RUN_NAME", "DEFAULT_FUNCTION", "audit_file", "audit_script", "checked_setup",
           "setup_from_script", "state_dict_from_checkpoint"]

SCRIPT_RUN_NAME = "__offload_adamw_audit__"
DEFAULT_FUNCTION = "audit_setup"


class AuditInputError(Exception):
    """The script or checkpoint could not give an optimizer set-up; the message names it."""


def setup_from_script(path: Path, function: str) -> dict[str, Any]:
    """The set-up ``function()`` of the script at ``path`` returns, as a dict with the keys of the contract, checked."""
    try:
        namespace = runpy.run_path(str(path), run_name=SCRIPT_RUN_NAME)
    except SystemExit as exc:
        raise AuditInputError(f"{path}: the script called sys.exit({exc.code!r}) while it was run for the audit"
                              f"{_where(exc)}; not audited (keep the exit under `if __name__ == \"__main__\":`)") from None
    except Exception as exc:  # the user's script: report whatever it raised, with the file
        raise AuditInputError(f"{path}: running the script failed: {type(exc).__name__}: {exc}") from exc
    setup_fn = namespace.get(function)
    if not callable(setup_fn):
        raise AuditInputError(f"{path}: defines no function {function}() (see `offload-adamw audit --help`)")
    try:
        result = setup_fn()
    except SystemExit as exc:
        raise AuditInputError(f"{path}: {function}() called sys.exit({exc.code!r}){_where(exc)}; not audited") from None
    except Exception as exc:
        raise AuditInputError(f"{path}: {function}() raised {type(exc).__name__}: {exc}") from exc
    return checked_setup(result, f"{path}: {function}()")


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


_KEYS = ("model", "optimizer", "scheduler", "steps", "grad_accumulation")
_SHAPE = ("a dict with 'model' and 'optimizer' (and optionally 'scheduler', 'steps', 'grad_accumulation') "
          "or a tuple (model, optimizer[, scheduler[, steps]])")


def _shown(value: Any) -> str:
    """A value of a set-up as a reader recognises it: numbers and None as they are, objects by their type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return repr(value)
    return type(value).__name__


def _returned(result: Any) -> str:
    if isinstance(result, tuple):
        return f"a tuple of {len(result)} ({', '.join(type(v).__name__ for v in result)})"
    if isinstance(result, Mapping):
        return "a dict {" + ", ".join(f"{k!r}: {_shown(v)}" for k, v in result.items()) + "}"
    return type(result).__name__


def _problem(setup: Mapping[str, Any]) -> str | None:
    """What is wrong with a set-up that has the right keys, or None."""
    import torch

    model, optimizer = setup["model"], setup["optimizer"]
    if not isinstance(model, torch.nn.Module):
        return f"the model must be a torch.nn.Module, got {type(model).__name__}"
    if not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "state")) or isinstance(optimizer, torch.nn.Module):
        return f"the optimizer must be an optimizer (param_groups and state), got {type(optimizer).__name__}"
    scheduler = setup.get("scheduler")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        return f"the scheduler must be None or a learning-rate scheduler (with step()), got {_shown(scheduler)}"
    steps = setup.get("steps")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 0):
        return f"steps must be None or an int >= 0, got {_shown(steps)}"
    accumulation = setup.get("grad_accumulation")
    pair = accumulation if isinstance(accumulation, (tuple, list)) and len(accumulation) == 2 else (accumulation,)
    if accumulation is not None and not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in pair):
        return f"grad_accumulation must be None, an int >= 1 or a (current, new) pair of them, got {_shown(accumulation)}"
    return None


def checked_setup(result: Any, what: str) -> dict[str, Any]:
    """``result`` of a set-up function (``what`` names it) as a dict of the contract's keys; else AuditInputError."""
    if isinstance(result, Mapping):
        setup = dict(result)
    elif isinstance(result, tuple) and 2 <= len(result) <= 4:
        setup = dict(zip(_KEYS, result))
    else:
        raise AuditInputError(f"{what} returned {_returned(result)}; it must return {_SHAPE}")
    unknown = sorted(set(setup) - set(_KEYS), key=str)
    missing = sorted({"model", "optimizer"} - set(setup))
    if unknown or missing:
        raise AuditInputError(f"{what} returned unknown keys {unknown} / lacks {missing}")
    problem = _problem(setup)
    if problem is not None:
        raise AuditInputError(f"{what} returned {_returned(result)}: {problem}")
    return setup


def audit_script(path: Path, *, function: str = DEFAULT_FUNCTION, steps: int | None = None,
                 grad_accumulation: int | tuple[int, ...] | None = None) -> AuditReport:
    """The audit of the set-up the script at ``path`` returns (in a forked child where one can be used)."""
    import torch

    if "fork" not in multiprocessing.get_all_start_methods() or torch.cuda.is_initialized():
        return _audit_script_here(path, function, steps, grad_accumulation)
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(sender, path, function, steps, grad_accumulation), daemon=True)
    sys.stdout.flush()  # the child inherits these buffers: empty, so nothing is written twice
    sys.stderr.flush()
    process.start()
    sender.close()
    try:
        try:
            kind, value = receiver.recv()
        except (EOFError, OSError):
            process.join()
            raise AuditInputError(f"{path}: the script ended the process ({_exit_text(process.exitcode)}) while it was "
                                  f"run or in {function}(); not audited") from None
    finally:
        receiver.close()
        process.join()
    if kind == "error":
        raise AuditInputError(value)
    report: AuditReport = value
    return report


def _audit_script_here(path: Path, function: str, steps: int | None,
                       grad_accumulation: int | tuple[int, ...] | None) -> AuditReport:
    setup = setup_from_script(path, function)
    run_steps = steps if steps is not None else setup.get("steps")
    accumulation = grad_accumulation if grad_accumulation is not None else setup.get("grad_accumulation")
    try:
        report = audit(setup["model"], setup["optimizer"], setup.get("scheduler"), steps=run_steps,
                       grad_accumulation=accumulation)
    except (TypeError, ValueError) as exc:
        raise AuditInputError(f"{path}: {exc}") from exc
    return AuditReport(source=str(path), findings=report.findings, groups=report.groups, notes=report.notes)


def _child(conn: Any, path: Path, function: str, steps: int | None, grad_accumulation: Any) -> None:
    import torch

    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork: a second one would deadlock
    try:
        try:
            outcome: tuple[str, Any] = ("report", _audit_script_here(path, function, steps, grad_accumulation))
        except AuditInputError as exc:
            outcome = ("error", str(exc))
        conn.send(outcome)
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no atexit handlers of the parent run a second time


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def state_dict_from_checkpoint(path: Path) -> tuple[Mapping[str, Any], str]:
    """The optimizer state_dict saved at ``path`` (loaded with ``weights_only=True``) and a label of where it was."""
    import torch

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise AuditInputError(f"{path}: cannot load with torch.load(weights_only=True): {type(exc).__name__}: {exc}") from exc

    def is_optimizer_state(x: Any) -> bool:
        return isinstance(x, Mapping) and "state" in x and "param_groups" in x

    if is_optimizer_state(loaded):
        return loaded, str(path)
    if isinstance(loaded, Mapping):
        for key, value in loaded.items():
            if is_optimizer_state(value):
                return value, f"{path} [{key!r}]"
    raise AuditInputError(f"{path}: holds no optimizer state_dict (a mapping with 'state' and 'param_groups')")


def audit_file(path: Path, *, function: str = DEFAULT_FUNCTION, steps: int | None = None,
               grad_accumulation: int | tuple[int, ...] | None = None) -> AuditReport:
    """The audit of the script or checkpoint at ``path``; raises AuditInputError when it cannot be used."""
    if not path.is_file():
        raise AuditInputError(f"{path}: no such file")
    if path.suffix == ".py":
        return audit_script(path, function=function, steps=steps, grad_accumulation=grad_accumulation)
    state_dict, source = state_dict_from_checkpoint(path)
    try:
        return audit_state_dict(state_dict, source=source, steps=steps, grad_accumulation=grad_accumulation)
    except ValueError as exc:  # the audit names the source itself
        raise AuditInputError(str(exc) if str(exc).startswith(source) else f"{source}: {exc}") from exc
    except (TypeError, KeyError, IndexError, AttributeError, RuntimeError) as exc:  # a malformed entry the checks missed
        raise AuditInputError(f"{source}: malformed optimizer state_dict ({type(exc).__name__}: {exc})") from exc
