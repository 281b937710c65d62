"""What a profiler trace says about a training step: when the gradient copies ran against the end of backward.

Contract: :func:`overlap_from_trace` reads a Kineto (chrome) trace as ``torch.profiler`` exports it, of
steps marked with ``record_function`` ranges ``fwd_bwd#i`` and ``step#i``, and returns step ``step``'s copy
timeline (see the function); it needs no torch, and says why (``measured: False``) when the trace lacks what
it reads.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["overlap_from_trace"]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _intersection_us(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the part of ``intervals`` (union) that ``cover`` (union) also covers."""
    merged: list[list[float]] = []
    for a, b in sorted(cover):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = 0.0
    for a, b in sorted(intervals):
        for c, d in merged:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                total += hi - lo
    return total


def overlap_from_trace(trace: dict, step: int = 0) -> dict:
    """From a Kineto (chrome) trace of ``fwd_bwd#i`` / ``step#i`` ranges, step ``step``'s copy timeline.

    Backward ends at the last kernel launched inside ``fwd_bwd#{step}``. The gradient copies are the
    device-to-host memcpys launched from the start of ``fwd_bwd#{step}`` to the end of ``step#{step}``;
    the parameter copies the host-to-device memcpys launched in ``step#{step}``. Reported: how much of
    the gradient copies' busy time lay before backward's end (the overlap), the tail after it, both
    directions' bytes and bandwidth while busy, and how much of the parameter copies overlapped kernels.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") == "user_annotation"}
    fb, st = ranges.get(f"fwd_bwd#{step}"), ranges.get(f"step#{step}")
    if fb is None or st is None:
        return {"measured": False, "why": f"no fwd_bwd#{step}/step#{step} ranges in the trace"}
    launch_ts = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = e["ts"]
    device_events = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]

    def launched_in(e, window) -> bool:
        ts = launch_ts.get(e.get("args", {}).get("correlation"))
        return ts is not None and window[0] <= ts <= window[1]

    def span(e) -> tuple[float, float]:
        return (e["ts"], e["ts"] + e.get("dur", 0))

    kernels = [e for e in device_events if e.get("cat") == "kernel"]
    bwd = [span(e) for e in kernels if launched_in(e, fb)]
    if not bwd:
        return {"measured": False, "why": "no kernels correlated with the fwd_bwd range", "events": len(events)}
    backward_end = max(b for _, b in bwd)
    compute_streams = sorted({e.get("args", {}).get("stream") for e in kernels if launched_in(e, fb)} - {None})
    memcpys = [e for e in device_events if e.get("cat") == "gpu_memcpy"]
    d2h = [e for e in memcpys if "DtoH" in e["name"] and launched_in(e, (fb[0], st[1]))]
    h2d = [e for e in memcpys if "HtoD" in e["name"] and launched_in(e, st)]
    out: dict[str, Any] = {"measured": True, "backward_end_us": backward_end, "compute_streams": compute_streams}
    for tag, copies in (("d2h", d2h), ("h2d", h2d)):
        spans = [span(e) for e in copies]
        busy = _union_us(spans)
        nbytes = sum(int(e.get("args", {}).get("bytes", 0) or 0) for e in copies)
        out[f"{tag}_copies"] = len(copies)
        out[f"{tag}_streams"] = sorted({e.get("args", {}).get("stream") for e in copies} - {None})
        out[f"{tag}_bytes"] = nbytes
        out[f"{tag}_busy_us"] = busy
        out[f"{tag}_GBps_while_busy"] = nbytes / busy / 1e3 if busy > 0 and nbytes else None
        out[f"{tag}_first_start_us"] = min((a for a, _ in spans), default=None)
        out[f"{tag}_last_end_us"] = max((b for _, b in spans), default=None)
    d2h_spans = [span(e) for e in d2h]
    before = _intersection_us(d2h_spans, [(-math.inf, backward_end)])
    out["d2h_busy_before_backward_end_us"] = before
    out["d2h_overlap_fraction"] = before / out["d2h_busy_us"] if out["d2h_busy_us"] > 0 else None
    out["d2h_tail_after_backward_us"] = max(0.0, out["d2h_last_end_us"] - backward_end) if d2h_spans else None
    kernel_spans = [span(e) for e in kernels if e.get("args", {}).get("stream") in compute_streams]
    h2d_spans = [span(e) for e in h2d]
    out["h2d_overlapped_with_kernels_us"] = _intersection_us(h2d_spans, kernel_spans)
    out["step_range_us"] = st[1] - st[0]
    out["forward_backward_range_us"] = fb[1] - fb[0]
    return out
