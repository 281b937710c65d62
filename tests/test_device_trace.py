"""The analysis of a profiler trace (benchmarking/device_trace.py): how much of the gradient copies ran before
backward ended, read from a Kineto trace's device timeline. (These tests came from the GPU run's driver, which the
selftest replaced; the analysis stays for a profiled run on a GPU.)"""

from __future__ import annotations

import pytest

from offload_adamw.benchmarking.device_trace import overlap_from_trace


def _trace() -> dict:
    """Two steps as the profiler exports them: runtime launches (CPU) correlated with device events."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "fwd_bwd#0", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "step#0", "ts": 100, "dur": 60},
        {"ph": "X", "cat": "user_annotation", "name": "fwd_bwd#1", "ts": 160, "dur": 100},
    ]
    launches = [  # (correlation, launch ts, category, name, device start, device duration, stream, bytes)
        (1, 5, "kernel", "forward_gemm", 10, 40, 7, None),
        (2, 50, "kernel", "backward_gemm", 50, 50, 7, None),  # backward ends at 100
        (3, 60, "gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 70, 20, 20, 2000),  # entirely before
        (4, 95, "gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 90, 30, 20, 3000),  # 10 before, 20 after
        (5, 120, "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 130, 40, 21, 4000),  # 150..170 over the kernel
        (6, 165, "kernel", "next_forward", 150, 60, 7, None),
    ]
    for corr, launch, cat, name, start, dur, stream, nbytes in launches:
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch, "dur": 1,
                       "args": {"correlation": corr}})
        args = {"correlation": corr, "stream": stream, "device": 0}
        if nbytes is not None:
            args["bytes"] = nbytes
        events.append({"ph": "X", "cat": cat, "name": name, "ts": start, "dur": dur, "args": args})
    events.append({"ph": "i", "cat": "instant", "name": "ignored", "ts": 3})
    return {"traceEvents": events}


def test_overlap_from_a_kineto_trace() -> None:
    out = overlap_from_trace(_trace())
    assert out["measured"] and out["backward_end_us"] == 100 and out["compute_streams"] == [7]
    assert out["d2h_copies"] == 2 and out["d2h_bytes"] == 5000 and out["d2h_busy_us"] == 50
    assert out["d2h_busy_before_backward_end_us"] == 30
    assert out["d2h_overlap_fraction"] == pytest.approx(0.6)
    assert out["d2h_tail_after_backward_us"] == 20
    assert out["d2h_GBps_while_busy"] == pytest.approx(5000 / 50e-6 / 1e9)
    assert out["h2d_copies"] == 1 and out["h2d_bytes"] == 4000 and out["h2d_streams"] == [21]
    assert out["h2d_overlapped_with_kernels_us"] == 20


def test_overlap_says_why_when_the_trace_has_no_ranges() -> None:
    assert overlap_from_trace({"traceEvents": []}) == {
        "measured": False, "why": "no fwd_bwd#0/step#0 ranges in the trace"}
    only_ranges = {"traceEvents": _trace()["traceEvents"][:3]}
    assert overlap_from_trace(only_ranges)["why"] == "no kernels correlated with the fwd_bwd range"

