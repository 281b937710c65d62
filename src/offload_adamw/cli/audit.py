"""``offload-adamw audit SCRIPT_OR_CHECKPOINT``: audit an optimizer set-up from the command line.

Contract:

* A path ending in ``.py`` is a SCRIPT. It is run as a module named
  ``__offload_adamw_audit__`` (so its ``if __name__ == "__main__":`` block,
  the training loop, does not run), then its function ``audit_setup()`` (or
  the one named by ``--function``) is called without arguments. It returns
  either a dict with the keys ``model`` and ``optimizer`` and optionally
  ``scheduler``, ``steps`` (optimizer updates of the run) and
  ``grad_accumulation``, or a tuple ``(model, optimizer[, scheduler[, steps]])``.
  Example::

      def audit_setup():
          model = build_model()
          optimizer = OffloadAdamW(param_groups(model, NO_DECAY_RULES), lr=3e-4)
          scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10_000)
          return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "steps": 10_000}

* Any other path is a CHECKPOINT: a ``torch.save``d optimizer state_dict,
  loaded with ``weights_only=True`` (no code runs), or a dict holding one as a
  top-level value (e.g. ``{"model": ..., "optimizer": ...}``).
* ``--steps`` and ``--grad-accumulation`` override what the script returns.
  Output: the report's tables, or with ``--json [FILE]`` its JSON (:mod:`offload_adamw.cli.common`:
  to FILE, or to stdout in place of the tables).
* Exit status: 0 no fault (info findings allowed), 1 at least one error or
  warning, 2 the input could not be loaded or an argument is bad (one line naming the file or
  argument and why, before anything runs).
"""

from __future__ import annotations

import argparse
import runpy
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offload_adamw.cli import common

if TYPE_CHECKING:  # imported when the command runs: --help needs no torch
    from offload_adamw.auditing.audit import AuditReport

SCRIPT_RUN_NAME = "__offload_adamw_audit__"
DEFAULT_FUNCTION = "audit_setup"


class AuditInputError(Exception):
    """The script or checkpoint could not give an optimizer set-up; the message names it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", metavar="SCRIPT_OR_CHECKPOINT", help="a .py script defining audit_setup(), or a saved optimizer state_dict"
    )
    parser.add_argument(
        "--function", default=DEFAULT_FUNCTION, help=f"the script's set-up function (default: {DEFAULT_FUNCTION})"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="optimizer updates of the run: report the total weight-decay shrink"
    )
    parser.add_argument(
        "--grad-accumulation",
        default=None,
        metavar="NEW or CURRENT:NEW",
        help="micro-batches per update to compare with (current defaults to 1): how updates and decay shrink change",
    )
    common.add_json_argument(parser, what="the report")


def _parse_accumulation(text: str | None) -> Any:
    if text is None:
        return None
    try:
        parts = [int(x) for x in text.split(":")]
    except ValueError:
        raise AuditInputError(f"--grad-accumulation must be N or CURRENT:NEW, got {text!r}") from None
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return tuple(parts)
    raise AuditInputError(f"--grad-accumulation must be N or CURRENT:NEW, got {text!r}")


def _setup_from_script(path: Path, function: str) -> dict[str, Any]:
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


def _state_dict_from_checkpoint(path: Path) -> tuple[Mapping[str, Any], str]:
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


def build_report(args: argparse.Namespace) -> AuditReport:
    """The report the command prints; raises AuditInputError when the input cannot be used."""
    from offload_adamw.auditing.audit import AuditReport, audit, audit_state_dict

    path = Path(args.path)
    if not path.is_file():
        raise AuditInputError(f"{path}: no such file")
    accumulation = _parse_accumulation(args.grad_accumulation)
    if path.suffix == ".py":
        setup = _setup_from_script(path, args.function)
        steps = args.steps if args.steps is not None else setup.get("steps")
        if accumulation is None:
            accumulation = setup.get("grad_accumulation")
        try:
            report = audit(
                setup["model"], setup["optimizer"], setup.get("scheduler"), steps=steps, grad_accumulation=accumulation
            )
        except (TypeError, ValueError) as exc:
            raise AuditInputError(f"{path}: {exc}") from exc
        return AuditReport(source=str(path), findings=report.findings, groups=report.groups, notes=report.notes)
    state_dict, source = _state_dict_from_checkpoint(path)
    try:
        return audit_state_dict(state_dict, source=source, steps=args.steps, grad_accumulation=accumulation)
    except ValueError as exc:  # the audit names the source itself
        raise AuditInputError(str(exc) if str(exc).startswith(source) else f"{source}: {exc}") from exc
    except (TypeError, KeyError, IndexError, AttributeError, RuntimeError) as exc:  # a malformed entry the checks missed
        raise AuditInputError(f"{source}: malformed optimizer state_dict ({type(exc).__name__}: {exc})") from exc


def run(args: argparse.Namespace) -> int:
    if args.steps is not None and args.steps < 0:
        raise common.UsageError(f"--steps must be a non-negative integer, got {args.steps}")
    try:
        report = build_report(args)
    except AuditInputError as exc:
        raise common.UsageError(str(exc)) from None
    if not common.json_to_stdout(args):
        print(report.to_table())
    common.write_json("audit", report.to_dict(), args.json)
    return 1 if report.faults else 0
