"""``offload-adamw bench``: the host-step benchmark (:mod:`offload_adamw.benchmarking.host_step`) from the command line.

Contract: parses the options into a :class:`~offload_adamw.benchmarking.host_step.BenchConfig` (a bad one
is a usage error, exit status 2, naming the option; so is a size whose arrays alone exceed the memory
available here, :func:`available_memory`), runs the benchmark and prints its table, and writes JSON
(``--json [FILE]``, :mod:`offload_adamw.cli.common`) and a PNG chart (``--plot``). What is measured and
how: the module docstring of :mod:`offload_adamw.benchmarking.host_step`.
"""

from __future__ import annotations

import argparse
import os
import sys

from offload_adamw.benchmarking.host_step import ALL_CASES, BenchConfig, run_benchmark
from offload_adamw.benchmarking.host_step_report import format_report, write_plot
from offload_adamw.benchmarking.workload import MIB, MIXES, format_size
from offload_adamw.cli import common


def parse_size(text: str) -> int:
    """'16M' -> 16 * 2**20; also K and G, or a plain number of elements."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = int(float(number) * scale)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 16M, 65536)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


# --------------------------------------------------------------------- CLI

_DEFAULT_SIZES = "16M,64M,256M"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=None,
                        help=f"comma-separated element counts, K/M/G = 2**10/20/30 (default {_DEFAULT_SIZES})")
    parser.add_argument("--repeats", type=int, default=BenchConfig.repeats,
                        help=f"timed repetitions per case, in rotated order (default {BenchConfig.repeats})")
    parser.add_argument("--warmup", type=int, default=BenchConfig.warmup,
                        help=f"untimed steps per case before timing (default {BenchConfig.warmup})")
    parser.add_argument("--cases", default=",".join(ALL_CASES), help="comma-separated cases (default: all)")
    parser.add_argument("--bandwidth-elements", type=parse_size, default=64 * MIB,
                        help="elements per array of the bandwidth probe (default 64M)")
    parser.add_argument("--scaling-size", default="16M",
                        help="elements of the thread-scaling measurement, or 'none' to skip it (default 16M)")
    parser.add_argument("--scaling-threads", default=None,
                        help="comma-separated thread counts for the scaling measurement (default 1..all CPUs)")
    parser.add_argument("--mixes", default=None,
                        help="comma-separated named mixes of tensor shapes timed after the sizes, or 'none' "
                             f"({', '.join(MIXES)}; default: all with the default sizes, none with --sizes or --quick)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke run)")
    common.add_json_argument(parser, what="all numbers")
    common.add_plot_argument(parser, what="a bar chart and the thread scaling")
    common.add_progress_argument(parser)


def _usage(message: str) -> common.UsageError:
    return common.UsageError(message)


WORKLOAD_BYTES_PER_ELEMENT = 20
"""What one element of a size (or of the thread scaling) holds in the arrays of ``workload.make_workload`` alone:
float32 master, both moments and gradient (16 bytes), bfloat16 gradient and model copy (4). The cases add
their own buffers on top, so this is a lower bound; a test keeps it equal to make_workload's arrays."""
BANDWIDTH_BYTES_PER_ELEMENT = 12
"""The bandwidth probe's three float32 arrays."""


def available_memory() -> tuple[int, str] | None:
    """(bytes this process can still allocate, where the figure comes from), or None where it cannot be told.

    The smaller of the kernel's estimate of memory available without swapping (MemAvailable) and what a
    cgroup v2 limit leaves (memory.max - memory.current), which is what a container may use.
    """
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read().strip())
        if limit != "max":
            found.append((max(0, int(limit) - used), "the cgroup's memory.max less memory.current"))
    except (OSError, ValueError):
        pass
    if not found and hasattr(os, "sysconf"):
        try:
            found.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages"))
        except (OSError, ValueError):
            pass
    return min(found) if found else None


def _check_memory(needs: list[tuple[str, int]]) -> None:
    """UsageError naming the first (flag and value, bytes) of ``needs`` that exceeds the memory available here.

    Checked before the run: an array larger than memory either fails inside torch's allocator (a traceback
    after minutes of work) or, with overcommit, is granted and then gets the process killed.
    """
    available = available_memory()
    if available is None:
        return
    free, source = available
    for what, bytes_needed in needs:
        if bytes_needed > free:
            raise _usage(f"{what}: needs at least {bytes_needed / 2**30:,.1f} GiB of host memory for its arrays alone, "
                         f"this machine has {free / 2**30:,.1f} GiB available ({source}); choose a smaller size")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run's configuration; a bad argument raises common.UsageError (exit status 2) naming it."""
    try:
        sizes = tuple(parse_size(s) for s in (_DEFAULT_SIZES if args.sizes is None else args.sizes).split(",") if s.strip())
        scaling_size = None if args.scaling_size.strip().lower() == "none" else parse_size(args.scaling_size)
        scaling_threads = (tuple(int(t) for t in args.scaling_threads.split(",") if t.strip())
                           if args.scaling_threads else None)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise _usage(f"--sizes / --scaling-size / --scaling-threads: {exc}") from None
    cases = tuple(c.strip() for c in args.cases.split(",") if c.strip())
    unknown = [c for c in cases if c not in ALL_CASES]
    if unknown or not cases:
        raise _usage(f"--cases: unknown case(s) {unknown or [args.cases]}; choose from {', '.join(ALL_CASES)}")
    if not sizes:
        raise _usage(f"--sizes: no size in {args.sizes!r}")
    if args.mixes is None:  # the default run times every mix; a run of chosen sizes (or a smoke run) only those
        mixes: tuple[str, ...] = () if args.quick or args.sizes is not None else tuple(MIXES)
    else:
        mixes = tuple(m.strip() for m in args.mixes.split(",") if m.strip() and m.strip().lower() != "none")
        unknown_mixes = [m for m in mixes if m not in MIXES]
        if unknown_mixes:
            raise _usage(f"--mixes: unknown mix(es) {unknown_mixes}; choose from {', '.join(MIXES)} or none")
    if args.repeats < 1:
        raise _usage("--repeats must be at least 1")
    if args.warmup < 0:
        raise _usage("--warmup must be at least 0")
    if scaling_threads is not None and (not scaling_threads or min(scaling_threads) < 1):
        raise _usage("--scaling-threads must be positive thread counts")
    largest = max(zip(sizes, (t for t in (args.sizes or _DEFAULT_SIZES).split(",") if t.strip())))
    probe = args.bandwidth_elements
    needs = [(f"--sizes {largest[1].strip()}", largest[0] * WORKLOAD_BYTES_PER_ELEMENT),
             (f"--bandwidth-elements {format_size(probe)}", probe * BANDWIDTH_BYTES_PER_ELEMENT)]
    if scaling_size:
        needs.append((f"--scaling-size {args.scaling_size}", scaling_size * WORKLOAD_BYTES_PER_ELEMENT))
    if args.quick:
        return BenchConfig(sizes=(MIB, 4 * MIB), repeats=3, warmup=1, cases=cases, bandwidth_elements=16 * MIB,
                           scaling_size=MIB if scaling_size else None, scaling_threads=scaling_threads,
                           parity_elements=256 * 1024, mixes=mixes)
    _check_memory(needs)
    return BenchConfig(sizes=sizes, repeats=args.repeats, warmup=args.warmup, cases=cases,
                       bandwidth_elements=args.bandwidth_elements, scaling_size=scaling_size,
                       scaling_threads=scaling_threads, mixes=mixes)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    result = run_benchmark(config, progress=common.progress_wanted(args))
    if not common.json_to_stdout(args):
        print(format_report(result))
    common.write_json("bench", result, args.json)
    if args.plot:
        with common.writing("--plot", args.plot):
            write_plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
