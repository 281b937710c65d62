"""The step timeline (accel/timeline.py): its overlap fraction, its checks, its chart."""

from __future__ import annotations

import pytest

from offload_adamw.accel.timeline import BucketTimes, StepTimeline


def _bucket(label: str, ready: float, start: float, end: float) -> BucketTimes:
    return BucketTimes(
        label=label, grad_ready=ready, d2h_done=ready + 0.1, update_start=start, update_end=end, h2d_done=end + 0.1
    )


def test_overlap_is_the_share_of_update_time_before_backward_ends() -> None:
    buckets = (_bucket("b0", 0.0, 1.0, 3.0), _bucket("b1", 2.0, 3.0, 5.0))
    assert StepTimeline(buckets=buckets, backward_end=4.0).overlap == pytest.approx(3.0 / 4.0)
    assert StepTimeline(buckets=buckets, backward_end=0.5).overlap == 0.0
    assert StepTimeline(buckets=buckets, backward_end=9.0).overlap == 1.0
    assert StepTimeline(buckets=(), backward_end=1.0).overlap == 0.0


def test_times_out_of_order_are_refused_naming_the_bucket() -> None:
    with pytest.raises(ValueError, match="'late'.*update_end"):
        BucketTimes(label="late", grad_ready=0, d2h_done=1, update_start=2, update_end=1.5, h2d_done=3)


def test_the_gantt_chart_is_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    timeline = StepTimeline(buckets=(_bucket("b0", 0.0, 0.2, 0.5), _bucket("b1", 0.3, 0.5, 0.9)), backward_end=0.6)
    out = timeline.gantt_png(tmp_path / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = timeline.as_dict()
    assert data["overlap"] == pytest.approx(timeline.overlap) and data["buckets"][0]["grad_ready"] == 0.0
