"""Training-step time with the host update after backward, and hidden behind it, side by side.

    python benchmarks/overlap_bench.py                       # 8 blocks of 1024-wide MLPs, batch 64
    python benchmarks/overlap_bench.py --json overlap.json --timeline overlap.png
    python benchmarks/overlap_bench.py --quick               # a smoke run (seconds)

One training step is forward, backward and ``step()`` of an MLP of ``--blocks`` residual blocks, with
the CPU as device (the pipeline's CPU mode: the "device" and the host share this machine's memory, so
what is measured is the host update hidden behind backward's compute, not PCIe). Backward computes on
one thread (``torch.set_num_threads(1)``) so that the update has a core of its own, as it has on a
GPU machine, where backward runs on the device.

Cases, each in its own process (a clean peak resident memory), interleaved over ``--rounds`` rounds:

* ``torch_fused``: ``torch.optim.AdamW(fused=True)``, state next to the parameters (the baseline a
  careful engineer writes when everything fits);
* ``offload_step``: ``OffloadAdamW(offload_gradients=True)``: gradients to host buffers in backward's
  hooks, the whole update in ``step()``;
* ``offload_overlap``: the same with ``update_in_backward=True``: each block's update on a worker
  thread as soon as its gradients are in, while backward goes on.

Printed: the median training-step time of each case and its ratio to ``torch_fused``, split into
forward+backward (which, overlapped, includes the host updates' contention for the cores and memory)
and the ``step()`` call (the optimizer time backward did not hide), the timeline's overlap and the
peak resident memory. ``--json`` writes them with a schema version; ``--timeline``
draws the overlapped case's last step as a Gantt chart.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCHEMA_VERSION = 1
CASES = ("torch_fused", "offload_step", "offload_overlap")


def build(blocks: int, width: int):
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(blocks)
            )

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x

    return Blocks()


def run_case(case: str, blocks: int, width: int, batch: int, steps: int, timeline: str | None) -> dict:
    """One case in this process: per-step times, forward+backward alone, overlap, peak RSS."""
    import torch

    from offload_adamw import OffloadAdamW

    torch.set_num_threads(1)
    model = build(blocks, width)
    params = list(model.parameters())
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(batch, width, generator=g) for _ in range(4)]

    def fwd_bwd(i: int) -> None:
        model(xs[i % len(xs)]).square().mean().backward()

    if case == "torch_fused":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    else:
        opt = OffloadAdamW(params, lr=1e-4, weight_decay=0.1, offload_gradients=True, bucket_bytes=block_bytes,
                           update_in_backward=case == "offload_overlap")
    step_s, fwd_bwd_s, call_s, overlaps = [], [], [], []
    for i in range(steps):
        t0 = time.perf_counter()
        fwd_bwd(i)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        step_s.append(t2 - t0)
        fwd_bwd_s.append(t1 - t0)
        call_s.append(t2 - t1)
        if case != "torch_fused":
            overlaps.append(opt.last_step_timeline().overlap)
    if timeline and case == "offload_overlap":
        opt.last_step_timeline().gantt_png(timeline, title=f"{blocks} blocks, width {width}, batch {batch}: "
                                                            f"overlap {overlaps[-1]:.2f}")
    warm = slice(2, None)  # the first step allocates state; the second is the first with early updates
    return {
        "case": case,
        "step_s": statistics.median(step_s[warm]),
        "fwd_bwd_s": statistics.median(fwd_bwd_s[warm]),
        "step_call_s": statistics.median(call_s[warm]),
        "overlap": statistics.median(overlaps[warm]) if overlaps else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


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

    def median(case: str, key: str):
        values = [r[key] for r in results[case] if r[key] is not None]
        return statistics.median(values) if values else None

    base = median("torch_fused", "step_s")
    rows = []
    for case in CASES:
        step, fb = median(case, "step_s"), median(case, "fwd_bwd_s")
        rows.append({
            "case": case, "step_s": step, "fwd_bwd_s": fb, "step_call_s": median(case, "step_call_s"),
            "step_vs_torch_fused": step / base, "overlap": median(case, "overlap"),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results[case]),
        })
    params = args.blocks * (4 * args.width * args.width + 3 * args.width)
    print(f"{args.blocks} blocks x width {args.width} ({params / 1e6:.1f}M parameters), batch {args.batch}, "
          f"median of {args.rounds} rounds x {args.steps - 2} steps, backward on 1 thread")
    print(f"{'case':<16} {'step ms':>8} {'vs fused':>8} {'fwd+bwd':>8} {'step()':>8} {'overlap':>7} {'peak RSS':>9}")
    for r in rows:
        overlap = "-" if r["overlap"] is None else f"{r['overlap']:.2f}"
        print(f"{r['case']:<16} {r['step_s'] * 1e3:>8.1f} {r['step_vs_torch_fused']:>8.2f} {r['fwd_bwd_s'] * 1e3:>8.1f} "
              f"{r['step_call_s'] * 1e3:>8.1f} {overlap:>7} {r['peak_rss_bytes'] / 2**20:>7.0f}Mi")
    if args.timeline:
        print(f"timeline: {args.timeline}")
    if args.json:
        document = {"schema_version": SCHEMA_VERSION, "command": "overlap_bench",
                    "config": {k: getattr(args, k) for k in ("blocks", "width", "batch", "steps", "rounds")},
                    "parameters": params, "cases": rows}
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
