"""The `offload-adamw` command line.

Each subcommand lives in its own module that exposes two functions:
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status). The
modules are imported only when their subcommand runs, so ``--help`` and ``plan``
stay fast (no torch) and a subcommand whose optional dependency is missing does
not break the others.

One error path for all of them (:mod:`offload_adamw.cli.common`): argparse errors,
:class:`~offload_adamw.cli.common.UsageError` and an optional package missing for
what was asked end with exit status 2 and one line on stderr; an output file that cannot be
written at the end (:class:`~offload_adamw.cli.common.OutputError`) with 74 and one line; output paths and
the packages outputs need are checked after parsing, before ``run()``; a closed
stdout ends the command quietly with status 141.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from offload_adamw._version import __version__
from offload_adamw.cli import common

# name -> (module, one-line help). Order is the order shown by --help.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("offload_adamw.cli.demo", "train a small Llama four ways and show where a naive offload drifts"),
    "check": ("offload_adamw.cli.check", "check an optimizer against the AdamW contract, clause by clause"),
    "plan": ("offload_adamw.cli.plan", "what fits where for a model and a cluster, and how fast a step can be"),
    "bench": ("offload_adamw.cli.bench", "measure host bandwidth and the optimizer step against torch and DeepSpeed"),
    "audit": ("offload_adamw.cli.audit", "audit the optimizer set-up of a training script or checkpoint"),
    "selftest": ("offload_adamw.cli.selftest",
                 "on this machine: the environment, every placement bitwise against torch's AdamW, --bench"),
}

# what exit statuses 0 and 1 mean per subcommand (2 and 141 mean the same everywhere)
EXIT_MEANINGS: dict[str, dict[int, str]] = {
    "demo": {0: "the demo ran and wrote its files"},
    "check": {0: "no clause fails", 1: "at least one clause fails"},
    "plan": {0: "a strategy this project provides fits", 1: "none fits"},
    "bench": {0: "the benchmark ran"},
    "audit": {0: "no error or warning (info findings allowed)", 1: "at least one error or warning"},
    "selftest": {0: "every parity row that ran is bitwise torch's", 1: "a row differs or failed (the verdict names it)"},
}

# optional package -> the extra of pyproject.toml that brings it
OPTIONAL_EXTRAS = {"matplotlib": "plot", "transformers": "hf", "accelerate": "hf", "deepspeed": "bench"}


def build_parser() -> argparse.ArgumentParser:
    parser = common.Parser(
        prog="offload-adamw",
        description="AdamW with its state in host memory, a conformance checker, a memory planner.",
        epilog="Run 'offload-adamw COMMAND --help' for a command's options.\n\n" + common.exit_codes_text(),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (see :mod:`offload_adamw.cli.common`)."""
    given = list(sys.argv[1:] if argv is None else argv)
    command = given[0] if given and given[0] in SUBCOMMANDS else None
    stdout = sys.stdout
    sys.stdout = common.GuardedStdout(stdout)  # a failed write: one line, not a traceback
    try:
        status = _dispatch(given)
        sys.stdout.flush()  # a closed pipe (or a full disk) shows here, inside the guard, not at interpreter exit
        return status
    except BrokenPipeError:
        return common.closed_pipe()
    except common.OutputError as exc:  # stdout failed outside a command's run(): at the last flush
        print(f"offload-adamw{' ' + command if command else ''}: {exc}", file=sys.stderr)
        return common.EXIT_OUTPUT_FAILED
    except KeyboardInterrupt:
        print(f"offload-adamw{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return common.EXIT_INTERRUPTED
    finally:
        sys.stdout = stdout


def _fail(name: str, message: str, status: int = 2) -> int:
    print(f"offload-adamw {name}: {message}", file=sys.stderr)
    return status


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        # Top-level --help/--version, or an unknown command: argparse reports it.
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            return int(exc.code or 0) if not isinstance(exc.code, str) else 2
        if args.command is None:
            parser.print_help()
        return 0
    name = argv[0]
    module_name, help_text = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        extra = OPTIONAL_EXTRAS.get((exc.name or "").split(".")[0])
        hint = f"; install it with: pip install 'offload-adamw[{extra}]'" if extra else ""
        return _fail(name, f"not available (needs {exc.name}{hint})")
    sub_parser = common.Parser(prog=f"offload-adamw {name}", description=help_text,
                               epilog=common.exit_codes_text(EXIT_MEANINGS.get(name)))
    module.add_arguments(sub_parser)
    try:
        args = sub_parser.parse_args(argv[1:])
    except SystemExit as exc:  # --help (0) or a usage error (2, already reported on one line)
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    try:
        common.check_outputs(sub_parser, args)
        return int(module.run(args) or 0)
    except (common.UsageError, argparse.ArgumentTypeError) as exc:
        return _fail(name, str(exc))
    except common.OutputError as exc:
        return _fail(name, str(exc), common.EXIT_OUTPUT_FAILED)
    except ModuleNotFoundError as exc:
        # An optional dependency that this use of the command needs and that no check caught earlier.
        extra = OPTIONAL_EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        return _fail(name, f"needs {exc.name}; install it with: pip install 'offload-adamw[{extra}]'")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
