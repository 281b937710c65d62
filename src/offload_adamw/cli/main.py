"""The `offload-adamw` command line.

Each subcommand lives in its own module that exposes two functions:
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status). The
modules are imported only when their subcommand runs, so ``--help`` stays fast
and a subcommand whose optional dependency is missing does not break the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from offload_adamw._version import __version__

# name -> (module, one-line help). Order is the order shown by --help.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("offload_adamw.demo.runs", "train a small Llama three ways and show where a naive offload drifts"),
    "check": ("offload_adamw.cli.check", "check an optimizer against the AdamW contract, clause by clause"),
    "plan": ("offload_adamw.cli.plan", "what fits where for a model and a cluster, and how fast a step can be"),
    "bench": ("offload_adamw.cli.bench", "measure host bandwidth and the optimizer step against torch and DeepSpeed"),
    "audit": ("offload_adamw.cli.audit", "audit the optimizer set-up of a training script or checkpoint"),
}

# optional package -> the extra of pyproject.toml that brings it
OPTIONAL_EXTRAS = {"matplotlib": "plot", "transformers": "hf", "accelerate": "hf", "deepspeed": "bench"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offload-adamw",
        description="AdamW with its state in host memory, a conformance checker, a memory planner.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        # Top-level --help/--version, or an unknown command: argparse reports it.
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
        return 0
    name = argv[0]
    module_name, help_text = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"offload-adamw {name}: not available ({exc})", file=sys.stderr)
        return 2
    sub_parser = argparse.ArgumentParser(prog=f"offload-adamw {name}", description=help_text)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except ModuleNotFoundError as exc:
        # An optional dependency that this use of the command needs (e.g. matplotlib for --plot).
        extra = OPTIONAL_EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"offload-adamw {name}: needs {exc.name}; install it with: pip install 'offload-adamw[{extra}]'", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
