"""Training-step time with the host update after backward, and hidden behind it, side by side.

    python benchmarks/overlap_bench.py                       # 8 blocks of 1024-wide MLPs, batch 64
    python benchmarks/overlap_bench.py --json overlap.json --timeline overlap.png
    python benchmarks/overlap_bench.py --quick               # a smoke run (seconds)

One training step is forward, backward and ``step()`` of an MLP of ``--blocks`` residual blocks on the CPU;
the cases (``torch_fused``, ``offload_step``, ``offload_overlap``) and how each is measured:
:mod:`offload_adamw.benchmarking.overlap`. Each case runs in its own process (a clean peak resident memory),
interleaved over ``--rounds`` rounds.

Printed: the median training-step time of each case and its ratio to ``torch_fused``, split into
forward+backward (which, overlapped, includes the host updates' contention for the cores and memory)
and the ``step()`` call (the optimizer time backward did not hide), the timeline's overlap and the
peak resident memory. ``--json`` writes them with a schema version; ``--timeline``
draws the overlapped case's last step as a Gantt chart.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from offload_adamw.benchmarking.overlap import CASES, format_table, parameters, run_case, summarise

SCHEMA_VERSION = 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overlap_bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8, help="residual MLP blocks (one bucket each)")
    parser.add_argument("--width", type=int, default=1024, help="block width (each block has 4*width^2 weights)")
    parser.add_argument("--batch", type=int, default=64, help="rows per step")
    parser.add_argument("--steps", type=int, default=12, help="steps per case and round (the first two are not timed)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three cases, interleaved")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--timeline", default=None, help="draw the overlapped case's last step here (PNG)")
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (a smoke run)")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # the child's mode
    args = parser.parse_args(argv)
    for name in ("blocks", "width", "batch", "rounds"):
        if not 0 < getattr(args, name):
            parser.error(f"--{name} must be positive")
    if not 3 <= args.steps:
        parser.error("--steps must be at least 3 (the first two are not timed)")
    if args.quick:
        args.blocks, args.width, args.batch, args.steps, args.rounds = 4, 128, 32, 4, 1
    if args.case:
        print(json.dumps(run_case(args.case, args.blocks, args.width, args.batch, args.steps, args.timeline)))
        return 0

    progress = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        progress = tqdm(total=args.rounds * len(CASES), desc="overlap bench", unit="case")
    results: dict[str, list[dict]] = {case: [] for case in CASES}
    for round_index in range(args.rounds):
        for case in CASES:
            cmd = [sys.executable, __file__, "--case", case, "--blocks", str(args.blocks), "--width", str(args.width),
                   "--batch", str(args.batch), "--steps", str(args.steps)]
            if args.timeline and round_index == args.rounds - 1:
                cmd += ["--timeline", args.timeline]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(f"overlap_bench.py: case {case} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            results[case].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            if progress is not None:
                progress.update()
    if progress is not None:
        progress.close()

    rows = summarise(results)
    print(format_table(rows, blocks=args.blocks, width=args.width, batch=args.batch, rounds=args.rounds, steps=args.steps))
    if args.timeline:
        print(f"timeline: {args.timeline}")
    if args.json:
        document = {"schema_version": SCHEMA_VERSION, "command": "overlap_bench",
                    "config": {k: getattr(args, k) for k in ("blocks", "width", "batch", "steps", "rounds")},
                    "parameters": parameters(args.blocks, args.width), "cases": rows}
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
