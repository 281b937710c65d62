"""The host step where training puts it: right after torch's own multi-threaded CPU work, beside it alone.

    python benchmarks/host_after_torch.py --sizes 5M,50M --rounds 3 --steps 5 --json after.json

In training the host update follows torch's CPU work in the same process: the host-side clipping norm
(``torch.nn.utils.get_total_norm`` of the gradients), the unscale, or in a loop beside it torch's own fused
AdamW. Torch runs that work on its OpenMP team (libgomp in torch's wheels), whose threads, when a parallel
region ends, keep spinning for a while (``GOMP_SPINCOUNT`` pauses, 300000 by default when ``OMP_WAIT_POLICY``
is unset) before they sleep, on the cores the host update's worker threads then need.

Every (setting, size) pair is one fresh process per round, started as torchrun starts a single rank
(``OMP_NUM_THREADS`` as given, default the process's cores; ``LOCAL_WORLD_SIZE=1``), with the setting's
environment on top (``default``: nothing more; ``GOMP_SPINCOUNT=0``; ``OMP_WAIT_POLICY=PASSIVE``; any
``NAME=VALUE``). Inside it the arrangements alternate, rotated, ``--steps`` times each:

* ``ours alone``: ``OffloadAdamW.step()`` (bf16 parameters and gradients, the default host update) after
  ``--settle`` seconds of idleness, so no thread of torch's is spinning;
* ``ours after fused``: the same step right after ``torch.optim.AdamW(fused=True).step()`` on float32 copies;
* ``ours after norm``: right after ``torch.nn.utils.get_total_norm`` of the bf16 gradients;
* ``torch fused alone``: torch's fused step itself, after the same idleness.

Beside each time, the CPU time that torch's own threads (the OpenMP team's workers: the process's threads that
Python did not start, read anew each time since libgomp starts them lazily) spent during the timed step, from
the scheduler's account in ``/proc/self/task/<tid>/schedstat``; and, once per process, the spin itself: the CPU
time those threads consume after a fused step or a norm while the main thread sleeps. The gap between "ours
after fused" and "ours alone" against that spin, and against the setting (``GOMP_SPINCOUNT=0`` and
``3000000``), is the evidence for the cause (docs/host-step.md#after-torchs-own-cpu-work).

Rounds interleave the settings and sizes, so a burst of load from elsewhere lands on all of them. The machine
is shared (other processes run beside this one): the report gives medians and the spread (min and max of the
per-round medians), not single figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

SCHEMA_VERSION = 1
ARRANGEMENTS = ("ours alone", "ours after fused", "ours after norm", "torch fused alone")
DEFAULT_SETTINGS = ("default", "GOMP_SPINCOUNT=0", "OMP_WAIT_POLICY=PASSIVE")


def _count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _size(text: str) -> str:
    from offload_adamw.benchmarking.workload import MIXES

    if text in MIXES:
        return text
    try:
        elements = _count(text)
    except ValueError:
        elements = 0
    if elements < 64:
        raise argparse.ArgumentTypeError(f"a size is an element count (5M, 50M) or one of {sorted(MIXES)}: {text!r}")
    return text


def _setting(text: str) -> str:
    if text != "default" and ("=" not in text or not text.split("=", 1)[0]):
        raise argparse.ArgumentTypeError(f"a setting is 'default' or NAME=VALUE, got {text!r}")
    return text


# ---------------------------------------------------------------------------------------------------- the child


def _torch_threads() -> list[int]:
    """The threads of this process that Python did not start: torch's OpenMP workers (and any idle native thread).

    Read anew at each measurement: libgomp starts its workers at the first parallel region that needs them
    (not necessarily the first one run), and our update's worker threads are Python's, so they are excluded.
    """
    ours = {t.native_id for t in threading.enumerate()}
    return [int(tid) for tid in os.listdir("/proc/self/task") if int(tid) not in ours]


def _cpu_ns(tids: list[int]) -> int:
    """CPU time (ns) these threads have run, from the scheduler's own account (/proc/.../schedstat)."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # a thread that ended
            pass
    return total


def child(size: str, steps: int, settle: float) -> dict[str, Any]:
    import torch

    from offload_adamw import OffloadAdamW
    from offload_adamw.benchmarking.workload import MIXES, transformer_shapes

    shapes = MIXES[size] if size in MIXES else transformer_shapes(_count(size))
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen).mul_(0.02).to(torch.bfloat16)) for s in shapes]
    for p in ours:
        p.grad = torch.randn(p.shape, generator=gen).mul_(1e-3).to(torch.bfloat16)
    theirs = [torch.nn.Parameter(p.detach().float()) for p in ours]
    for p, q in zip(theirs, ours):
        assert q.grad is not None
        p.grad = q.grad.float()
    opt = OffloadAdamW(ours, lr=1e-4, weight_decay=0.01)
    fused = torch.optim.AdamW(theirs, lr=1e-4, weight_decay=0.01, fused=True)
    grads = [p.grad for p in ours]

    def norm() -> None:
        torch.nn.utils.get_total_norm(grads)

    for _ in range(2):  # state allocated and touched, numba variants loaded: not timed
        opt.step()
        fused.step()
        norm()

    spin = {}
    for name, before in (("after fused", fused.step), ("after norm", norm)):
        samples = []
        for _ in range(3):
            time.sleep(settle)
            before()
            tids = _torch_threads()
            start = _cpu_ns(tids)
            time.sleep(settle)  # the team's workers spin, then sleep; the main thread does nothing meanwhile
            samples.append((_cpu_ns(tids) - start) / 1e6)
        spin[name] = statistics.median(samples)

    def timed(fn: Any) -> tuple[float, float]:
        tids = _torch_threads()
        cpu = _cpu_ns(tids)
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
        return wall * 1e3, (_cpu_ns(tids) - cpu) / 1e6

    def arrangement(name: str) -> tuple[float, float]:
        if name == "ours alone":
            time.sleep(settle)
            return timed(opt.step)
        if name == "ours after fused":
            time.sleep(settle)
            fused.step()
            return timed(opt.step)
        if name == "ours after norm":
            time.sleep(settle)
            norm()
            return timed(opt.step)
        time.sleep(settle)
        return timed(fused.step)

    ms: dict[str, list[float]] = {a: [] for a in ARRANGEMENTS}
    team_ms: dict[str, list[float]] = {a: [] for a in ARRANGEMENTS}
    for k in range(steps):
        order = ARRANGEMENTS[k % len(ARRANGEMENTS):] + ARRANGEMENTS[: k % len(ARRANGEMENTS)]
        for name in order:
            wall, cpu = arrangement(name)
            ms[name].append(wall)
            team_ms[name].append(cpu)
    return {"elements": sum(p.numel() for p in ours), "tensors": len(shapes), "torch_threads": torch.get_num_threads(),
            "host_threads": opt.host_threads, "native_threads": len(_torch_threads()), "spin_cpu_ms": spin,
            "step_ms": ms, "team_cpu_ms": team_ms}


# --------------------------------------------------------------------------------------------------- the parent


def run_child(size: str, setting: str, omp_threads: int, steps: int, settle: float) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(omp_threads), LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", RANK="0",
               WORLD_SIZE="1")
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME"):  # only the setting's own
        env.pop(name, None)
    if setting != "default":
        name, value = setting.split("=", 1)
        env[name] = value
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", size, str(steps), str(settle)],
                          env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the {setting} / {size} process failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every timed step of every round; spread: the lowest and highest per-round median."""
    out: dict[str, Any] = {}
    for name in ARRANGEMENTS:
        every = [t for r in runs for t in r["step_ms"][name]]
        per_round = [statistics.median(r["step_ms"][name]) for r in runs]
        team = [t for r in runs for t in r["team_cpu_ms"][name]]
        out[name] = {"median_ms": statistics.median(every), "round_medians_ms": per_round,
                     "spread_ms": [min(per_round), max(per_round)], "team_cpu_median_ms": statistics.median(team)}
    out["spin_cpu_ms"] = {k: statistics.median(r["spin_cpu_ms"][k] for r in runs) for k in runs[0]["spin_cpu_ms"]}
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        size, steps, settle = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
        print(json.dumps(child(size, steps, settle)))
        return 0
    parser = argparse.ArgumentParser(prog="host_after_torch.py", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="5M,50M",
                        help="element counts (Llama-like shapes) or mix names (llama-layers), comma-separated")
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                        help="environments to compare: 'default' or NAME=VALUE, comma-separated")
    parser.add_argument("--omp-threads", type=int, default=None, help="OMP_NUM_THREADS (default: this process's cores)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per setting and size")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each arrangement per process")
    parser.add_argument("--settle", type=float, default=0.1, help="seconds of idleness before a step (0.1)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    try:
        sizes = [_size(s) for s in args.sizes.split(",") if s.strip()]
        settings = [_setting(s) for s in args.settings.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.rounds < 1 or args.steps < 1 or args.settle < 0 or not sizes or not settings:
        parser.error("--rounds and --steps must be positive, --settle not negative, --sizes and --settings not empty")
    cores = len(os.sched_getaffinity(0))
    omp = args.omp_threads or cores
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(s, z): [] for s in settings for z in sizes}
    started = time.perf_counter()
    for r in range(args.rounds):
        pairs = list(runs)
        pairs = pairs[r % len(pairs):] + pairs[: r % len(pairs)]  # rotated: every pair in every position
        for setting, size in pairs:
            runs[(setting, size)].append(run_child(size, setting, omp, args.steps, args.settle))
        print(f"  round {r + 1}/{args.rounds} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    rows = []
    for (setting, size), results in runs.items():
        rows.append({"setting": setting, "size": size, "elements": results[0]["elements"],
                     "tensors": results[0]["tensors"], "host_threads": results[0]["host_threads"],
                     "torch_threads": results[0]["torch_threads"], "native_threads": results[0]["native_threads"],
                     **summarize(results), "runs": results})
    print(f"{cores} cores, OMP_NUM_THREADS={omp}, {args.rounds} fresh processes x {args.steps} steps per row"
          + (f"; load average at the end {load[0]:.1f} (a shared machine: read the spreads)" if load else ""))
    print("medians in ms [lowest, highest round median]; team: CPU ms torch's threads spent during our step; "
          "spin: CPU ms they spend after one op while nothing else runs")
    head = f"{'setting':<24} {'size':>12}  " + "  ".join(f"{a:>22}" for a in ARRANGEMENTS)
    print(head + f"  {'after fused - alone':>19}  {'team':>10}  {'spin':>11}")
    for row in rows:
        cells = [f"{row[a]['median_ms']:7.2f} [{row[a]['spread_ms'][0]:5.1f},{row[a]['spread_ms'][1]:5.1f}]"
                 for a in ARRANGEMENTS]
        gap = row["ours after fused"]["median_ms"] - row["ours alone"]["median_ms"]
        team = f"{row['ours alone']['team_cpu_median_ms']:.1f}/{row['ours after fused']['team_cpu_median_ms']:.1f}"
        spin = f"{row['spin_cpu_ms']['after fused']:.1f}/{row['spin_cpu_ms']['after norm']:.1f}"
        print(f"{row['setting']:<24} {row['size']:>12}  " + "  ".join(f"{c:>22}" for c in cells)
              + f"  {gap:>+19.2f}  {team:>10}  {spin:>11}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema_version": SCHEMA_VERSION, "cores": cores, "omp_num_threads": omp, "rounds": args.rounds,
                       "steps": args.steps, "settle_s": args.settle, "load_average": load, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
