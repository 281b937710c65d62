"""The host's memory bandwidth, measured the way the optimizer step uses memory.

Contract: :func:`measure_host_bandwidth` runs two STREAM-style kernels with
torch's CPU ops on all of torch's intra-op threads and returns GB/s figures
(decimal gigabytes, bytes counted as STREAM counts them: every array read or
written once per element, no write-allocate traffic):

* ``triad``: ``a = b + s*c`` over three arrays (read 2, write 1). Storing into
  ``a`` without reading it costs a hidden read of ``a`` on most CPUs
  (write-allocate) that STREAM does not count.
* ``inplace_triad``: ``a += s*b`` (read 2, write 1, where the written array is
  one of those read). This is the optimizer's pattern: the step reads master,
  m and v and writes them back in place, so no write-allocate is hidden. Its
  figure is the ceiling a host AdamW step can reach at 28 bytes per element.

The figures are the best and the median of ``repeats`` timed passes, after one
untimed pass that faults the pages in. Arrays must be much larger than the
last-level cache to measure memory rather than cache; the default (64 Mi
float32 elements, 256 MiB per array) is a compromise with run time and memory
(three arrays: 768 MiB).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

__all__ = ["BandwidthConfig", "measure_host_bandwidth"]


@dataclass(frozen=True, kw_only=True)
class BandwidthConfig:
    """What the probe allocates and how often it runs."""

    elements: int = 64 * 2**20
    """Elements per array (float32): 64 Mi = 256 MiB per array, three arrays."""
    repeats: int = 5
    """Timed passes per kernel (after one warm-up pass)."""
    threads: int = 0
    """torch intra-op threads for the probe; 0 keeps torch's current setting."""


def _time_passes(fn, repeats: int) -> list[float]:
    fn()  # fault pages in, warm the thread pool
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure_host_bandwidth(
    *, elements: int = BandwidthConfig.elements, repeats: int = BandwidthConfig.repeats, threads: int = 0
) -> dict:
    """Measure host memory bandwidth; returns a dict of GB/s figures (see the module docstring).

    Keys: ``triad_gbps``, ``inplace_triad_gbps`` (best of the passes),
    ``triad_gbps_median``, ``inplace_triad_gbps_median``, ``elements``,
    ``bytes_per_array``, ``threads``, ``repeats``.
    """
    if elements <= 0 or repeats <= 0:
        raise ValueError(f"elements and repeats must be positive, got elements={elements}, repeats={repeats}")
    previous_threads = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        a = torch.empty(elements, dtype=torch.float32)
        b = torch.empty(elements, dtype=torch.float32)
        c = torch.empty(elements, dtype=torch.float32)
        a.fill_(1.0)
        b.fill_(2.0)
        c.fill_(0.5)
        scalar = 1e-3
        moved = 3 * elements * a.element_size()  # bytes STREAM counts for both kernels

        # The lambda and inplace() run inside _time_passes, before the `del` below: ruff's F821 is wrong here.
        triad = _time_passes(lambda: torch.add(b, c, alpha=scalar, out=a), repeats)  # noqa: F821
        # Alternate the sign so that repeated passes keep the values bounded.
        sign = [1.0]

        def inplace():
            a.add_(b, alpha=sign[0] * scalar)  # noqa: F821
            sign[0] = -sign[0]

        inplace_triad = _time_passes(inplace, repeats)
        used_threads = torch.get_num_threads()
        del a, b, c
    finally:
        if threads > 0:
            torch.set_num_threads(previous_threads)
    return {
        "triad_gbps": moved / min(triad) / 1e9,
        "inplace_triad_gbps": moved / min(inplace_triad) / 1e9,
        "triad_gbps_median": moved / statistics.median(triad) / 1e9,
        "inplace_triad_gbps_median": moved / statistics.median(inplace_triad) / 1e9,
        "elements": elements,
        "bytes_per_array": elements * 4,
        "threads": used_threads,
        "repeats": repeats,
    }


def default_config() -> dict:
    """The probe's defaults, for reports."""
    return asdict(BandwidthConfig())
