"""The step-time model of the planner (planning/overlap.py): serial against overlapped.

Laws: overlap never makes a step longer than serial nor shorter than forward + backward or than the
optimizer's busiest stage; with one group and clipping nothing is hidden but the copy; with many
groups and an optimizer shorter than backward almost everything is hidden; clipping never helps.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_adamw.planning.overlap import StepTimeModel, step_times

seconds = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(fwd=seconds, bwd=seconds, host=seconds, d2h=seconds, h2d=seconds, groups=st.integers(1, 64), clip=st.booleans())
def test_overlap_is_bounded_by_serial_and_by_the_busiest_part(fwd, bwd, host, d2h, h2d, groups, clip) -> None:
    model = StepTimeModel(forward_s=fwd, backward_s=bwd, host_update_s=host, d2h_s=d2h, h2d_s=h2d, groups=groups, clipping=clip)
    t = step_times(model)
    tol = 1e-9 * (1 + t.serial_s)
    assert t.overlapped_s <= t.serial_s + tol
    assert t.overlapped_s >= fwd + bwd - tol
    assert t.overlapped_s >= fwd + max(d2h, host, h2d) - tol  # no stage can start before forward ends
    unclipped = step_times(StepTimeModel(forward_s=fwd, backward_s=bwd, host_update_s=host, d2h_s=d2h, h2d_s=h2d, groups=groups))
    assert unclipped.overlapped_s <= t.overlapped_s + tol, "clipping can only delay the updates"


@settings(max_examples=300, deadline=None)
@given(fwd=seconds, bwd=seconds, host=seconds, d2h=seconds, h2d=seconds, groups=st.integers(1, 64), clip=st.booleans(),
       device=seconds, device_groups=st.integers(1, 64), shared=seconds)
def test_a_device_lane_beside_the_host_lane_keeps_the_laws(fwd, bwd, host, d2h, h2d, groups, clip, device, device_groups,
                                                          shared) -> None:
    kwargs = dict(forward_s=fwd, backward_s=bwd, host_update_s=host, d2h_s=d2h, h2d_s=h2d, groups=groups,
                  device_update_s=device, device_groups=device_groups, host_memory_s=shared)
    t = step_times(StepTimeModel(**kwargs, clipping=clip))
    tol = 1e-9 * (1 + t.serial_s)
    assert t.overlapped_s <= t.serial_s + tol
    assert t.serial_s == pytest.approx(fwd + bwd + max(d2h + host + h2d, device, shared), rel=1e-12, abs=1e-12)
    assert t.overlapped_s >= fwd + max(device, shared) - tol  # neither lane nor host memory starts before forward ends
    if clip:  # nothing of the device lane, nor of host memory's share, before backward ends
        assert t.overlapped_s >= fwd + bwd + max(device, shared) - tol
    host_alone = step_times(StepTimeModel(forward_s=fwd, backward_s=bwd, host_update_s=host, d2h_s=d2h, h2d_s=h2d,
                                          groups=groups, clipping=clip))
    assert t.overlapped_s >= host_alone.overlapped_s - tol  # another lane never makes the host lane faster
    unclipped = step_times(StepTimeModel(**kwargs))
    assert unclipped.overlapped_s <= t.overlapped_s + tol, "clipping can only delay the updates"


def test_a_device_lane_hides_behind_backward_without_clipping() -> None:
    t = step_times(StepTimeModel(forward_s=1, backward_s=4, host_update_s=0, d2h_s=0, h2d_s=0, device_update_s=2,
                                 device_groups=100))
    assert t.serial_s == pytest.approx(7.0) and t.overlapped_s == pytest.approx(5.0 + 2.0 / 100)
    clipped = step_times(StepTimeModel(forward_s=1, backward_s=4, host_update_s=0, d2h_s=0, h2d_s=0, device_update_s=2,
                                       device_groups=100, clipping=True))
    assert clipped.overlapped_s == pytest.approx(7.0)


def test_one_group_hides_nothing() -> None:
    t = step_times(StepTimeModel(forward_s=1, backward_s=2, host_update_s=3, d2h_s=0.5, h2d_s=0.5, groups=1))
    assert t.serial_s == pytest.approx(7.0) and t.overlapped_s == pytest.approx(7.0)
    assert t.hidden_fraction == pytest.approx(0.0)


def test_many_groups_hide_an_update_shorter_than_backward() -> None:
    t = step_times(StepTimeModel(forward_s=1, backward_s=4, host_update_s=2, d2h_s=0.5, h2d_s=0.5, groups=100))
    assert t.serial_s == pytest.approx(8.0)
    # the last group's three stages are what is left after backward: (0.5 + 2 + 0.5) / 100
    assert t.overlapped_s == pytest.approx(5.0 + 3.0 / 100)
    assert t.hidden_fraction > 0.98


def test_with_clipping_only_the_copies_to_the_host_are_hidden() -> None:
    t = step_times(StepTimeModel(forward_s=1, backward_s=4, host_update_s=2, d2h_s=0.5, h2d_s=0.5, groups=100, clipping=True))
    # all updates start at the end of backward; the copies back follow each group's update
    assert t.overlapped_s == pytest.approx(5.0 + 2.0 + 0.5 / 100)


@pytest.mark.parametrize("field", ["forward_s", "backward_s", "host_update_s", "d2h_s", "h2d_s", "device_update_s",
                                   "host_memory_s"])
@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_times_are_refused_by_name(field: str, bad: float) -> None:
    kwargs = dict(forward_s=1.0, backward_s=1.0, host_update_s=1.0, d2h_s=1.0, h2d_s=1.0, device_update_s=1.0,
                  host_memory_s=1.0)
    kwargs[field] = bad
    with pytest.raises(ValueError, match=field):
        StepTimeModel(**kwargs)


def test_a_training_step_counts_six_or_eight_flops_per_parameter_and_token() -> None:
    from offload_adamw.planning.overlap import training_step_model

    common = dict(num_parameters=1e9, tokens_per_gpu=1000, gpu_flops_per_s=1e12, model_flops_utilization=0.5,
                  grad_accumulation=1, host_update_s=1.0, d2h_s=0.1, h2d_s=0.1, groups=10, clipping=False)
    plain = training_step_model(activation_checkpointing=False, **common)
    assert plain.forward_s == pytest.approx(4.0) and plain.backward_s == pytest.approx(8.0)
    recomputed = training_step_model(activation_checkpointing=True, **common)
    assert recomputed.backward_s == pytest.approx(12.0)
    accumulated = training_step_model(activation_checkpointing=False, **{**common, "grad_accumulation": 4})
    assert accumulated.forward_s == pytest.approx(4 * 4.0 + 3 * 8.0) and accumulated.backward_s == pytest.approx(8.0)
    with pytest.raises(ValueError, match="model_flops_utilization"):
        training_step_model(activation_checkpointing=False, **{**common, "model_flops_utilization": 0.0})


def test_the_70b_plan_estimates_serial_and_overlapped_step_times() -> None:
    from offload_adamw.planning.models import PRESETS
    from offload_adamw.planning.planner import TrainingConfig, plan

    clipped = plan(PRESETS["llama-3-70b"])
    free = plan(PRESETS["llama-3-70b"], training=TrainingConfig(clipping=False))
    for name in ("fsdp+offload-adamw", "fsdp+offload-adamw+offload-grads"):
        c, f = clipped.strategy(name), free.strategy(name)
        assert c.step_time_serial_s == pytest.approx(f.step_time_serial_s)
        # the host update (5.6 s at 400 GB/s) is longer than backward: clipped, only the copies hide
        assert f.step_time_overlapped_s < c.step_time_overlapped_s < c.step_time_serial_s
        assert f.step_time_serial_s - f.step_time_overlapped_s > 4.0
    # resident and streamed groups: no copy to hide with clipping, so serial and overlapped agree; without
    # clipping the streamed updates start as their gradients arrive
    for name in ("fsdp+streamed-state", "fsdp+placement-mix"):
        c, f = clipped.strategy(name), free.strategy(name)
        assert c.step_time_overlapped_s == pytest.approx(c.step_time_serial_s)
        assert f.step_time_overlapped_s < c.step_time_overlapped_s
        assert c.step_time_serial_s < clipped.strategy("fsdp+offload-adamw").step_time_serial_s
    gpu_only = clipped.strategy("fsdp")
    assert gpu_only.step_time_overlapped_s == pytest.approx(gpu_only.step_time_serial_s)
    assert clipped.as_dict()["strategies"][0]["step_time_serial_s"] is not None
