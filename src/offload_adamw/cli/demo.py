"""``offload-adamw demo``: the command line of the main job (:mod:`offload_adamw.demo.runs`).

Contract: checks its arguments and optional packages (transformers, matplotlib: the ``demo``
extra) and that ``--out`` can be written before any training; runs the four trainings; prints a
summary and where the files are, or with ``--json [FILE]`` the results as JSON
(:mod:`offload_adamw.cli.common`). Progress bars go to stderr, by default only on a terminal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from offload_adamw.cli import common

__all__ = ["add_arguments", "run"]

DEFAULT_STEPS = 100  # the same as offload_adamw.demo.runs.DEFAULT_STEPS, kept here so that --help imports no torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"optimizer steps per run, four runs (default {DEFAULT_STEPS}: under 3 minutes on 2 cores)")
    parser.add_argument("--out", type=Path, default=Path("offload-adamw-demo"),
                        help="directory for loss_curves.png, report.md and results.json (default ./offload-adamw-demo)")
    common.add_json_argument(parser, what="the results")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the conformance check of the naive optimizer")
    common.add_progress_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.steps < 2:
        raise common.UsageError(f"--steps must be at least 2, got {args.steps}")
    common.writable_directory(args.out, "--out")
    for name in ("transformers", "matplotlib"):  # optional dependencies: the `demo` extra
        common.require_package(name, "demo", "the demo (the model and the plot)")
    from offload_adamw.demo.runs import DemoConfig, run_demo

    config = DemoConfig(steps=args.steps, check=args.check, warmup_steps=min(10, max(1, args.steps // 6)))
    quiet = common.json_to_stdout(args)
    log = (lambda msg: print(msg, file=sys.stderr)) if quiet else print
    summary = run_demo(config, args.out, progress=common.progress_wanted(args), log=log)
    if not quiet:
        _print_summary(summary)
    common.write_json("demo", summary, args.json)
    return 0


def _print_summary(summary: dict[str, Any]) -> None:
    runs = summary["runs"]
    rows = []
    for info in runs.values():
        diff = "-" if info["max_param_diff"] is None else f"{info['max_param_diff']:.3g}"
        ldiff = "-" if info["max_loss_diff"] is None else f"{info['max_loss_diff']:.3g}"
        dist = f"{info['param_distance'][-1]:.3f}" if info["param_distance"] else "-"
        rows.append([info["label"], f"{info['final_train_loss']:.4f}", f"{info['final_val_loss']:.4f}", diff, ldiff, dist,
                     f"{info['median_step_ms']:.0f}"])
    print()
    print(common.render_table(["run", "train", "val", "max|Δθ|", "max|Δloss|", "dist", "ms/step"], rows, align="lrrrrrr"))
    bill = summary["planner"]
    print()
    state = ", ".join(f"{info['label'].split(',')[0]} {info['dtype']}: {info['state_bytes_per_param']:.1f} B/param"
                      for info in runs.values())
    print(f"optimizer state measured: {state}")
    if bill.get("available"):
        print(f"planner: host bytes of OffloadAdamW's state for the bf16 model {bill['predicted_host_optimizer_bytes']:,} "
              f"predicted, {bill['measured_host_optimizer_bytes']:,} measured")
    findings = summary["conformance"]
    print()
    if findings.get("available"):
        if findings.get("table"):
            print(f"conformance checker on the naive offload ({findings['dtype']} parameters):")
            print(findings["table"])
        failed = ", ".join(f"{c['number']} {c['name']}" for c in findings["failed"]) or "none"
        print(f"clauses the naive offload fails: {failed}")
    else:
        print(f"conformance check: {findings['reason']}")
    print()
    for what, path in summary["files"].items():
        print(f"{what:>8}: {path}")
