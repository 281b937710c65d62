"""``offload-adamw check``: the conformance checker on the command line.

Contract: prints the report table to stdout, or with ``--json [FILE]`` the report as JSON
(:mod:`offload_adamw.cli.common`: to FILE, or to stdout in place of the table), and
returns the exit status: 0 when no clause fails, 1 when any clause fails, 2 when the
candidate cannot be loaded or the arguments are invalid (bad JSON, unknown dtype,
unknown clause, bad mapping).

Examples::

    offload-adamw check torch.optim:AdamW
    offload-adamw check offload_adamw:OffloadAdamW --dtype bf16 --json report.json
    offload-adamw check my_opt.py:MyAdamW --map '{"betas": ["beta1", "beta2"], "eps": "epsilon"}' \\
        --kwargs '{"correct_bias": true}'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from offload_adamw.cli import common

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("candidate", help="the optimizer: 'package.module:Class' or 'path/to/file.py:Class'")
    parser.add_argument("--dtype", default="fp32", help="parameter dtype of the checked run: fp32 (default), bf16, fp16, fp64")
    parser.add_argument("--kwargs", default=None, metavar="JSON",
                        help="fixed constructor keyword arguments, e.g. '{\"correct_bias\": true}' (or @file.json)")
    parser.add_argument("--map", dest="mapping", default=None, metavar="JSON",
                        help="canonical hyperparameter -> the candidate's name: lr, betas (one name or two), eps, "
                             "weight_decay, amsgrad, maximize; null = no such argument. "
                             "E.g. '{\"betas\": [\"beta1\", \"beta2\"], \"eps\": \"epsilon\"}' (or @file.json)")
    parser.add_argument("--clauses", default=None, metavar="N,N,...", help="run only these clauses (default: all 15)")
    parser.add_argument("--nonfinite", choices=("propagate", "skip", "raise"), default=None,
                        help="the declared non-finite policy clause 13 is judged against "
                             "(default: the candidate's 'nonfinite' attribute, else reported only)")
    parser.add_argument("--device", default="cpu", help="device of the parameters (default: cpu)")
    common.add_json_argument(parser, what="the report", dest="json_path")
    common.add_progress_argument(parser)


def _json_argument(flag: str, text: str | None) -> Any:
    if text is None:
        return None
    source = text
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            source = path.read_text()
        except OSError as exc:
            raise ValueError(f"{flag}: cannot read {str(path)!r}: {exc}") from exc
    try:
        value = json.loads(source)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not valid JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object, got {type(value).__name__}")
    return value


def run(args: argparse.Namespace) -> int:
    from offload_adamw.conformance.checker import CandidateLoadError, check

    try:
        kwargs = _json_argument("--kwargs", args.kwargs)
        mapping = _json_argument("--map", args.mapping)
        clauses = None
        if args.clauses:
            try:
                clauses = [int(part) for part in args.clauses.split(",") if part.strip()]
            except ValueError:
                raise ValueError(f"--clauses: expected numbers separated by commas, got {args.clauses!r}") from None
        progress = common.progress_wanted(args)
        report = check(args.candidate, dtype=args.dtype, kwargs=kwargs, mapping=mapping, clauses=clauses,
                       nonfinite_policy=args.nonfinite, device=args.device, progress=progress)
    except CandidateLoadError as exc:
        print(f"offload-adamw check: cannot load the candidate: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"offload-adamw check: {exc}", file=sys.stderr)
        return 2
    if not common.json_to_stdout(args, "json_path"):
        print(report.to_table())
    common.write_json("check", report.to_json(), args.json_path)
    return 1 if report.failed else 0
