"""The host step on a whole node: k concurrent processes, each updating its own shard, as a launcher starts them.

    python benchmarks/node_bench.py --elements 64M --ranks 1,2 --steps 5 --json node.json

For each k in ``--ranks``, k fresh processes start at once with ``OMP_NUM_THREADS=1`` and ``LOCAL_WORLD_SIZE=k``
(what torchrun and ``accelerate launch`` set in every rank), each holding 1/k of a bf16 model of ``--elements``
parameters (Llama-layer shapes) and its OffloadAdamW state. Each times ``--steps`` steps after one warm-up step, in
two arrangements, side by side in the same processes, each started at a barrier of every rank (the ranks'
timed windows, in the JSON, overlap):

* ``one-thread``: ``host_threads=1``, what the update ran with when it took ``torch.get_num_threads()``;
* ``node-share``: the default ``host_threads`` (this rank's share of its node's cores, distributed/node.py).

Aggregate GB/s: the traffic bill of the mixed update (28 bytes per element: docs/contract.md#traffic-bill) of every
rank over the slowest rank's median step; beside it the host triad measured first, by one process with every core.
Figures are from the machine this runs on; a 2-core VM says little about a 100-core node beyond the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BYTES_PER_ELEMENT = 28  # grad 2 + master 4+4 + m 4+4 + v 4+4 + model copy 2 (docs/contract.md#traffic-bill)
SCHEMA_VERSION = 1

RANK_CODE = r"""
import json, os, statistics, sys, time
import torch
from offload_adamw import OffloadAdamW
from offload_adamw.benchmarking.workload import transformer_shapes

elements, steps, rank = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(rank)
params = [torch.nn.Parameter(torch.randn(s).mul_(0.02).to(torch.bfloat16)) for s in transformer_shapes(elements)]
for p in params:
    p.grad = torch.randn(p.shape).mul_(1e-3).to(torch.bfloat16)
out = {"elements": sum(p.numel() for p in params)}
for name, threads in (("one-thread", 1), ("node-share", None)):
    opt = OffloadAdamW(params, lr=1e-4, weight_decay=0.01, host_threads=threads)
    opt.step()  # the state is allocated and touched: not timed
    print("ready", flush=True)  # the barrier: every rank times its steps at the same time
    sys.stdin.readline()
    times = []
    began = time.time()  # the wall clock, which every rank shares: the windows are compared across ranks
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    out[name] = {"median_s": statistics.median(times), "host_threads": opt.host_threads, "window": [began, time.time()]}
    del opt
print(json.dumps(out))
"""


def _count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _ranks(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--ranks takes positive integers, got {text!r}")
    return values


def run(elements: int, ranks: int, steps: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE=str(ranks))
    procs = [subprocess.Popen([sys.executable, "-c", RANK_CODE, str(elements // ranks), str(steps), str(r)],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(ranks)]
    for _ in ("one-thread", "node-share"):  # a barrier before each arrangement: every rank ready, then all go
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                for other in procs:  # the others would wait at the barrier, then step for nobody
                    if other is not proc:
                        other.kill()
                proc.wait()
                raise RuntimeError(f"a rank failed before its steps (exit {proc.returncode}): {proc.stderr.read()[-2000:]}")
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"a rank failed (exit {proc.returncode}): {err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    row: dict = {"ranks": ranks, "elements_per_rank": results[0]["elements"]}
    for name in ("one-thread", "node-share"):
        slowest = max(r[name]["median_s"] for r in results)
        moved = BYTES_PER_ELEMENT * sum(r["elements"] for r in results)
        row[name] = {"slowest_median_s": slowest, "aggregate_gbps": moved / slowest / 1e9,
                     "host_threads": results[0][name]["host_threads"], "windows": [r[name]["window"] for r in results]}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="node_bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=_count, default=64 << 20, help="parameters of the whole model (64M)")
    parser.add_argument("--ranks", type=_ranks, default=None, help="process counts, e.g. 1,2,4 (default: 1..cores)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.elements < 1:
        parser.error("--steps and --elements must be positive")
    from offload_adamw.benchmarking.bandwidth import measure_host_bandwidth

    cores = len(os.sched_getaffinity(0))
    counts = args.ranks or list(range(1, cores + 1))
    triad = measure_host_bandwidth(elements=16 << 20, repeats=5, threads=cores)["triad_gbps"]
    rows = []
    started = time.perf_counter()
    for k in counts:
        rows.append(run(args.elements, k, args.steps))
        print(f"  {k} rank(s) done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    print(f"host triad, one process on {cores} cores: {triad:.1f} GB/s; {args.elements:,} bf16 parameters in all")
    print(f"{'ranks':>5}  {'threads':>7}  {'one-thread GB/s':>15}  {'threads':>7}  {'node-share GB/s':>15}  "
          f"{'ratio':>5}  {'of triad':>8}")
    for row in rows:
        one, share = row["one-thread"], row["node-share"]
        print(f"{row['ranks']:>5}  {one['host_threads']:>7}  {one['aggregate_gbps']:>15.2f}  {share['host_threads']:>7}  "
              f"{share['aggregate_gbps']:>15.2f}  {share['aggregate_gbps'] / one['aggregate_gbps']:>5.2f}  "
              f"{share['aggregate_gbps'] / triad:>8.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema_version": SCHEMA_VERSION, "cores": cores, "triad_gbps": triad, "elements": args.elements,
                       "steps": args.steps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
