"""Timing a benchmark's cases alike: rotated order, the step's own peak memory, summaries of the samples.

Contract: :func:`rotations` gives every case every position over the repetitions; :func:`time_rotated` runs
``warmup`` untimed rounds of every case, then ``repeats`` rounds in rotated order, timing each call with
:func:`measure_step` (seconds, and the bytes its peak resident memory rose above the resident memory before
it: the kernel's high-water mark is reset before the call, Linux >= 4.0; None where that cannot be read);
:func:`summary` turns one case's samples into the milliseconds, spread and throughput figures.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

from offload_adamw.benchmarking.workload import BYTES_PER_ELEMENT

__all__ = ["measure_step", "rotations", "time_rotated", "summary", "usable_cpus"]


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_step(fn: Callable[[], None]) -> tuple[float, int | None]:
    """(seconds, bytes the step's peak resident memory rose above the resident memory before it)."""
    can_reset = _reset_peak_rss()
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    if peak is None or before is None or not can_reset:
        return seconds, None
    return seconds, max(0, peak - before) * 1024


def _progress(iterable, show: bool, **kw):
    if not show:
        return iterable
    try:
        from tqdm import tqdm

        return tqdm(iterable, file=sys.stderr, leave=False, **kw)
    except ImportError:  # pragma: no cover
        return iterable


def rotations(names: list[str], repeats: int) -> list[list[str]]:
    """The case order of each repetition: rotated by one each time (A B C, B C A, C A B, ...)."""
    k = len(names)
    return [names[r % k:] + names[: r % k] for r in range(repeats)] if k else [[] for _ in range(repeats)]


def time_rotated(cases: dict[str, Callable[[], None]], warmup: int, repeats: int, desc: str, progress: bool = False):
    samples: dict[str, list[float]] = {n: [] for n in cases}
    extras: dict[str, list[int]] = {n: [] for n in cases}
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    for order in _progress(rotations(list(cases), repeats), progress, desc=desc):
        for name in order:
            seconds, extra = measure_step(cases[name])
            samples[name].append(seconds)
            if extra is not None:
                extras[name].append(extra)
    return samples, extras


def summary(times: list[float], elements: int) -> dict:
    med = statistics.median(times)
    return {
        "ms_per_step": med * 1e3,
        "ms_min": min(times) * 1e3,
        "ms_max": max(times) * 1e3,
        "spread": (max(times) - min(times)) / med,
        "ms_all": [t * 1e3 for t in times],
        "elements_per_s": elements / med,
        "effective_gbps": BYTES_PER_ELEMENT * elements / med / 1e9,
    }


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        return os.cpu_count() or 1
