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
  argument and why, before anything runs): also an input that is not a regular file (a FIFO, a
  directory, a device: the line says which, and it is never opened); also a script that exits (``sys.exit``,
  ``os._exit``) while it is run or set up, or whose set-up returns the wrong things; the
  script's own exit status is never the command's.
"""

from __future__ import annotations

import argparse
from typing import Any

from offload_adamw.cli import common

# auditing.inputs.DEFAULT_FUNCTION, repeated so that --help imports no torch (tests/test_audit.py compares them)
DEFAULT_FUNCTION = "audit_setup"


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
        raise common.UsageError(f"--grad-accumulation must be N or CURRENT:NEW, got {text!r}") from None
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return tuple(parts)
    raise common.UsageError(f"--grad-accumulation must be N or CURRENT:NEW, got {text!r}")


def run(args: argparse.Namespace) -> int:
    if args.steps is not None and args.steps < 0:
        raise common.UsageError(f"--steps must be a non-negative integer, got {args.steps}")
    path = common.input_file(args.path, "", limit=None)  # a checkpoint may be large; a FIFO or directory is no input
    from offload_adamw.auditing.inputs import AuditInputError, audit_file

    try:
        accumulation = _parse_accumulation(args.grad_accumulation)
        report = audit_file(path, function=args.function, steps=args.steps, grad_accumulation=accumulation)
    except AuditInputError as exc:
        raise common.UsageError(str(exc)) from None
    if not common.json_to_stdout(args):
        print(report.to_table())
    common.write_json("audit", report.to_dict(), args.json)
    return 1 if report.faults else 0
