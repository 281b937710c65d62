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
* :func:`audit_file` returns the :class:`~offload_adamw.auditing.audit.AuditReport`
  of either; ``steps`` and ``grad_accumulation`` given to it override what the
  script returns. Whatever keeps the file from giving an optimizer set-up raises
  :class:`AuditInputError`, whose message starts with the file's path.
"""

from __future__ import annotations

import runpy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from offload_adamw.auditing.audit import AuditReport, audit, audit_state_dict

__all__ = ["AuditInputError", "SCRIPT_RUN_NAME", "DEFAULT_FUNCTION", "audit_file", "setup_from_script",
           "state_dict_from_checkpoint"]

SCRIPT_RUN_NAME = "__offload_adamw_audit__"
DEFAULT_FUNCTION = "audit_setup"


class AuditInputError(Exception):
    """The script or checkpoint could not give an optimizer set-up; the message names it."""


def setup_from_script(path: Path, function: str) -> dict[str, Any]:
    """The set-up ``function()`` of the script at ``path`` returns, as a dict with the keys of the contract."""
    try:
        namespace = runpy.run_path(str(path), run_name=SCRIPT_RUN_NAME)
    except Exception as exc:  # the user's script: report whatever it raised, with the file
        raise AuditInputError(f"{path}: running the script failed: {type(exc).__name__}: {exc}") from exc
    setup_fn = namespace.get(function)
    if not callable(setup_fn):
        raise AuditInputError(f"{path}: defines no function {function}() (see `offload-adamw audit --help`)")
    try:
        result = setup_fn()
    except Exception as exc:
        raise AuditInputError(f"{path}: {function}() raised {type(exc).__name__}: {exc}") from exc
    if isinstance(result, Mapping):
        setup = dict(result)
    elif isinstance(result, tuple) and 2 <= len(result) <= 4:
        setup = dict(zip(("model", "optimizer", "scheduler", "steps"), result))
    else:
        raise AuditInputError(
            f"{path}: {function}() must return a dict with 'model' and 'optimizer' (and optionally 'scheduler', "
            f"'steps', 'grad_accumulation') or a tuple (model, optimizer[, scheduler[, steps]]), got {type(result).__name__}"
        )
    unknown = sorted(set(setup) - {"model", "optimizer", "scheduler", "steps", "grad_accumulation"})
    missing = sorted({"model", "optimizer"} - set(setup))
    if unknown or missing:
        raise AuditInputError(f"{path}: {function}() returned unknown keys {unknown} / lacks {missing}")
    return setup


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
    accumulation = grad_accumulation
    if path.suffix == ".py":
        setup = setup_from_script(path, function)
        run_steps = steps if steps is not None else setup.get("steps")
        if accumulation is None:
            accumulation = setup.get("grad_accumulation")
        try:
            report = audit(
                setup["model"], setup["optimizer"], setup.get("scheduler"), steps=run_steps, grad_accumulation=accumulation
            )
        except (TypeError, ValueError) as exc:
            raise AuditInputError(f"{path}: {exc}") from exc
        return AuditReport(source=str(path), findings=report.findings, groups=report.groups, notes=report.notes)
    state_dict, source = state_dict_from_checkpoint(path)
    try:
        return audit_state_dict(state_dict, source=source, steps=steps, grad_accumulation=accumulation)
    except ValueError as exc:  # the audit names the source itself
        raise AuditInputError(str(exc) if str(exc).startswith(source) else f"{source}: {exc}") from exc
    except (TypeError, KeyError, IndexError, AttributeError, RuntimeError) as exc:  # a malformed entry the checks missed
        raise AuditInputError(f"{source}: malformed optimizer state_dict ({type(exc).__name__}: {exc})") from exc
