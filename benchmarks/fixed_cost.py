"""The fixed cost of a host step: many small tensors, where the per-tensor bookkeeping is the step.

    python benchmarks/fixed_cost.py --mixes 30x64,300x1024 --rounds 5 --steps 300 --json fixed.json
    python benchmarks/fixed_cost.py --sources new=src,old=/tmp/old/src   # two trees side by side, one run

A step of a model with many small tensors (norms, biases, a LoRA adapter) costs what the optimizer does per
tensor in Python, not memory bandwidth. This benchmark times ``step()`` on CPU float32 parameters of a mix of
equal small tensors (``COUNTxELEMENTS``: 30x64 is 30 tensors of 64 elements), every one with a gradient, for:

* ``offload`` : ``OffloadAdamW`` with default settings (the plain host step; float32 CPU parameters are their own
  masters, so its kernel is torch's fused op and what is measured beyond it is the bookkeeping), once per
  source tree given with ``--sources`` (``NAME=PATH`` of a ``src`` directory put first on ``PYTHONPATH``: the
  working tree and a ``git worktree`` of an older commit compare in one run) and per ``--dtypes`` entry
  (``bfloat16``: bf16 parameters and gradients, float32 masters in host memory, the numba loop's update);
* ``fused``, ``foreach``, ``for-loop``: ``torch.optim.AdamW(fused=True)``, ``(foreach=True)`` and
  ``(foreach=False)``.

Every (optimizer, mix) is one fresh process per round, started as torchrun starts a rank of a multi-rank job
(``OMP_NUM_THREADS=1``, ``LOCAL_WORLD_SIZE=1``); rounds interleave the optimizers, rotated, so that load from
elsewhere on a shared machine falls on all of them. A process warms up (``--warmup`` steps: state allocated,
numba and TorchScript loaded) and then times ``--steps`` steps one by one; its figure is their median. The report
gives, per row, the median over the rounds' medians and the spread (lowest and highest round median), and the
ratio to ``fused``'s median in the same run. The JSON holds every round's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SCHEMA_VERSION = 1
TORCH_KINDS = ("fused", "foreach", "for-loop")


def _mix(text: str) -> tuple[int, int]:
    count, sep, elements = text.strip().lower().partition("x")
    try:
        pair = int(count), int(elements)
    except ValueError:
        pair = (0, 0)
    if not sep or pair[0] < 1 or pair[1] < 1:
        raise argparse.ArgumentTypeError(f"a mix is COUNTxELEMENTS (30x64: 30 tensors of 64 elements), got {text!r}")
    return pair


def _source(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not os.path.isdir(os.path.join(path, "offload_adamw")):
        raise argparse.ArgumentTypeError(f"a source is NAME=PATH of a directory holding offload_adamw/, got {text!r}")
    return name, os.path.abspath(path)


# ---------------------------------------------------------------------------------------------------- the child


def child(kind: str, count: int, elements: int, warmup: int, steps: int, dtype_name: str) -> dict[str, Any]:
    import torch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(elements, generator=gen).to(dtype)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(elements, generator=gen).mul_(1e-3).to(dtype)
    opt: torch.optim.Optimizer
    version = None
    if kind == "offload":
        import offload_adamw
        from offload_adamw import OffloadAdamW

        opt = OffloadAdamW(params, lr=1e-3, weight_decay=0.01)
        version = offload_adamw.__file__
    else:
        options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kind]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **options)
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "steps": steps,
            "torch_threads": torch.get_num_threads(), "module": version}


# --------------------------------------------------------------------------------------------------- the parent


def run_child(kind: str, source: str | None, dtype: str, mix: tuple[int, int], warmup: int, steps: int
              ) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    if source is not None:
        env["PYTHONPATH"] = source + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, str(mix[0]), str(mix[1]),
                           str(warmup), str(steps), dtype], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} process for {mix} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, count, elements, warmup, steps = sys.argv[2], *map(int, sys.argv[3:7])
        print(json.dumps(child(kind, count, elements, warmup, steps, sys.argv[7])))
        return 0
    parser = argparse.ArgumentParser(prog="fixed_cost.py", description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", default="30x64,300x1024", help="COUNTxELEMENTS, comma-separated (30x64,300x1024)")
    parser.add_argument("--sources", default=None,
                        help="NAME=PATH of src directories to time OffloadAdamW from, comma-separated "
                             "(default: the offload_adamw this Python imports, as 'offload')")
    parser.add_argument("--dtypes", default="float32",
                        help="parameter dtypes of OffloadAdamW's rows, comma-separated (float32, bfloat16); torch's "
                             "rows are float32 (torch's parity definition: its fused step on float32 masters)")
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per optimizer and mix (5)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per process (300)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (20)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    try:
        mixes = [_mix(m) for m in args.mixes.split(",") if m.strip()]
        sources = [_source(s) for s in args.sources.split(",") if s.strip()] if args.sources else []
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or not mixes:
        parser.error("--rounds and --steps must be positive, --warmup not negative, --mixes not empty")
    if not dtypes or any(d not in ("float32", "bfloat16", "float16") for d in dtypes):
        parser.error("--dtypes takes float32, bfloat16, float16")
    # (row name, kind, source directory or None, dtype)
    offload = [(f" ({name})", path) for name, path in sources] if sources else [("", None)]
    rows: list[tuple[str, str, str | None, str]] = [
        (f"offload{label}" + ("" if dtype == "float32" else f" {dtype}"), "offload", path, dtype)
        for dtype in dtypes for label, path in offload
    ] + [(kind, kind, None, "float32") for kind in TORCH_KINDS]
    runs: dict[tuple[str, tuple[int, int]], list[dict[str, Any]]] = {(r[0], m): [] for r in rows for m in mixes}
    started = time.perf_counter()
    for k in range(args.rounds):
        order = rows[k % len(rows):] + rows[: k % len(rows)]  # rotated: every optimizer in every position
        for mix in mixes:
            for name, kind, source, dtype in order:
                runs[(name, mix)].append(run_child(kind, source, dtype, mix, args.warmup, args.steps))
        print(f"  round {k + 1}/{args.rounds} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    try:
        load: tuple[float, float, float] | None = os.getloadavg()
    except OSError:
        load = None
    table = []
    for mix in mixes:
        fused = statistics.median(r["median_ms"] for r in runs[("fused", mix)])
        for name, kind, source, dtype in rows:
            per_round = [r["median_ms"] for r in runs[(name, mix)]]
            median = statistics.median(per_round)
            table.append({"mix": f"{mix[0]}x{mix[1]}", "tensors": mix[0], "elements_per_tensor": mix[1],
                          "optimizer": name, "kind": kind, "source": source, "dtype": dtype, "median_ms": median,
                          "spread_ms": [min(per_round), max(per_round)], "ratio_to_fused": median / fused,
                          "us_per_tensor": median * 1e3 / mix[0], "rounds": runs[(name, mix)]})
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores, OMP_NUM_THREADS=1, {args.rounds} fresh processes x {args.steps} steps per row (median of "
          f"round medians, ms [lowest, highest round median])"
          + (f"; load average at the end {load[0]:.1f}" if load else ""))
    print(f"{'mix':>10}  {'optimizer':<26} {'ms/step':>8}  {'spread':>15}  {'x fused':>7}  {'us/tensor':>9}")
    for row in table:
        spread = f"[{row['spread_ms'][0]:.3f}, {row['spread_ms'][1]:.3f}]"
        print(f"{row['mix']:>10}  {row['optimizer']:<26} {row['median_ms']:8.3f}  {spread:>15}  "
              f"{row['ratio_to_fused']:7.2f}  {row['us_per_tensor']:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema_version": SCHEMA_VERSION, "cores": cores, "omp_num_threads": 1, "rounds": args.rounds,
                       "steps": args.steps, "warmup": args.warmup, "load_average": load, "rows": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
