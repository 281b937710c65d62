"""Fault and misuse cases of the transfer pipeline (issue 28's round two), each exact or refused by name.

* ``torch.autograd.grad(loss, params)`` between backward and ``step()`` (a gradient metric) leaves ``p.grad``
  as it was, with kept and freed gradients and with updates during backward: torch's result.
* A backward that raises: before any update started (also whenever clipping or a non-finite policy gates the
  updates to the end of backward) the batch is dropped as torch drops it (``opt.zero_grad()`` and go on);
  after updates ran during it, ``step()`` and ``zero_grad()`` are refused with what happened and the way back
  (a checkpoint), and loading one restores torch's result exactly.
* ``add_param_group`` between steps with updates during backward and clipping: the new group's gradients are
  in the clip coefficient, as in torch; mid-step it is refused before anything changes.
* ``update_in_backward=True`` with ``fused=False``: the for-loop kernel on the worker thread, bitwise torch's
  ``foreach=False, fused=False``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from configs import MODES, assert_bitwise_equal, same_bits
from offload_adamw import OffloadAdamW

WIDTH = 16


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(6))
        self.fail_at: int | None = None  # raise inside backward, below the top layers, when set

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1 and self.fail_at is not None and x.requires_grad:
                x.register_hook(_raise)
        return x.square().mean()


def _raise(grad: torch.Tensor) -> None:
    raise RuntimeError("a failure inside backward (an OOM, a hook)")


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))


def _pair(**kwargs):
    torch.manual_seed(0)
    ref = Stack()
    model = copy.deepcopy(ref)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    bucket = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    # one layer per bucket, whatever bucket size the mode's entry names (configs.MODES)
    ours = OffloadAdamW(model.parameters(), **{"lr": 1e-2, "weight_decay": 0.1, **kwargs, "bucket_bytes": bucket})
    return ref, theirs, model, ours


def _same(ref: nn.Module, model: nn.Module) -> bool:
    return all(same_bits(p.detach(), q.detach()) for p, q in zip(ref.parameters(), model.parameters()))


# ------------------------------------------------------------------------------- autograd.grad


@pytest.mark.parametrize("mode", ["kept", "freed", "update_in_backward"])
def test_autograd_grad_between_backward_and_step_leaves_the_gradients(mode) -> None:
    ref, theirs, model, ours = _pair(**MODES[mode].kwargs())
    for step in range(4):
        for net, opt in ((ref, theirs), (model, ours)):
            loss = net(_batch(step))
            loss.backward(retain_graph=True)
            if opt is ours and mode == "update_in_backward" and step >= 1:
                # Updates ran in backward: the retained graph's saved parameters changed, and autograd says so
                # (the version check) instead of computing gradients at the updated values.
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    torch.autograd.grad(loss, list(net.parameters()))
            else:
                metric = torch.autograd.grad(loss, list(net.parameters()))  # e.g. a gradient-noise metric
                assert len(metric) == len(list(net.parameters()))
            opt.step()
            opt.zero_grad()
    assert _same(ref, model)


# ------------------------------------------------------------------------------ a failed backward


def _train_with_a_failure(model, opt, fail_step: int, steps: int = 5) -> list[str]:
    errors = []
    for step in range(steps):
        model.fail_at = step if step == fail_step else None
        try:
            model(_batch(step)).backward()
        except RuntimeError as error:
            errors.append(str(error))
            opt.zero_grad()  # the usual skip of a failed batch
            continue
        opt.step()
        opt.zero_grad()
    model.fail_at = None
    return errors


@pytest.mark.parametrize("kwargs", [MODES["freed"].kwargs(), MODES["kept"].kwargs(),
                                    MODES["update_in_backward"].kwargs(max_grad_norm=1e6),
                                    MODES["update_in_backward"].kwargs(nonfinite="skip")],
                         ids=["freed", "kept", "update_in_backward_clipped", "update_in_backward_nonfinite_skip"])
def test_a_failed_backward_is_dropped_as_torch_drops_it(kwargs) -> None:
    """Where no update can start before backward has ended, skipping the batch is exact."""
    ref, theirs, model, ours = _pair(**kwargs)
    assert len(_train_with_a_failure(ref, theirs, fail_step=2)) == 1
    assert len(_train_with_a_failure(model, ours, fail_step=2)) == 1
    assert _same(ref, model)


def test_a_failed_backward_on_the_first_step_of_updates_during_backward_is_dropped() -> None:
    """Step 0 knows no buckets yet: nothing runs early, the batch is dropped exactly."""
    ref, theirs, model, ours = _pair(offload_gradients=True, update_in_backward=True)
    _train_with_a_failure(ref, theirs, fail_step=0)
    _train_with_a_failure(model, ours, fail_step=0)
    assert _same(ref, model)


def test_a_backward_that_raised_after_updates_ran_is_refused_and_a_checkpoint_restores_torchs_result() -> None:
    ref, theirs, model, ours = _pair(offload_gradients=True, update_in_backward=True)
    for step in range(2):
        for net, opt in ((ref, theirs), (model, ours)):
            net(_batch(step)).backward()
            opt.step()
            opt.zero_grad()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(ours.state_dict())
    model.fail_at = 2
    with pytest.raises(RuntimeError, match="a failure inside backward"):
        model(_batch(2)).backward()
    model.fail_at = None
    for call in (ours.zero_grad, ours.step):
        with pytest.raises(RuntimeError, match=r"backward raised after the updates of \d+ parameter\(s\) had run"):
            call()
    # The way back: the last checkpoint (here the state of step 2's start), then the batch is skipped as torch skips it.
    model.load_state_dict(saved_model)
    ours.load_state_dict(saved_opt)
    ours.zero_grad()
    theirs.zero_grad()
    for step in range(3, 5):
        for net, opt in ((ref, theirs), (model, ours)):
            net(_batch(step)).backward()
            opt.step()
            opt.zero_grad()
    assert _same(ref, model)


def test_a_rejected_load_after_a_failed_backward_keeps_the_step_refused() -> None:
    ref, theirs, model, ours = _pair(offload_gradients=True, update_in_backward=True)
    for step in range(2):
        model(_batch(step)).backward()
        ours.step()
        ours.zero_grad()
    bad = copy.deepcopy(ours.state_dict())
    bad["param_groups"][0]["params"] = bad["param_groups"][0]["params"][:-1]  # one parameter short
    model.fail_at = 2
    with pytest.raises(RuntimeError, match="a failure inside backward"):
        model(_batch(2)).backward()
    with pytest.raises(ValueError):
        ours.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="backward raised after the updates"):
        ours.step()


# ------------------------------------------------------------------------------ add_param_group


def test_a_group_added_between_steps_is_in_the_clip_coefficient() -> None:
    torch.manual_seed(0)
    ref = Stack()
    model = copy.deepcopy(ref)
    head_ref = nn.Linear(WIDTH, 1)
    head = copy.deepcopy(head_ref)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    ours = OffloadAdamW(model.parameters(), lr=1e-2, offload_gradients=True, update_in_backward=True, max_grad_norm=0.01)
    for step in range(4):
        if step == 2:
            theirs.add_param_group({"params": list(head_ref.parameters())})
            ours.add_param_group({"params": list(head.parameters())})
        for net, extra, opt, ours_side in ((ref, head_ref, theirs, False), (model, head, ours, True)):
            x = _batch(step)
            loss = net(x) + (extra(x).square().mean() if step >= 2 else 0.0)
            loss.backward()
            if not ours_side:
                params = list(net.parameters()) + (list(extra.parameters()) if step >= 2 else [])
                torch.nn.utils.clip_grad_norm_(params, 0.01)
            opt.step()
            opt.zero_grad()
    assert _same(ref, model) and _same(head_ref, head)


def test_add_param_group_after_updates_ran_is_refused_before_anything_changes() -> None:
    _, _, model, ours = _pair(offload_gradients=True, update_in_backward=True)
    for step in range(2):
        model(_batch(step)).backward()
        ours.step()
        ours.zero_grad()
    model(_batch(2)).backward()
    groups = len(ours.param_groups)
    with pytest.raises(RuntimeError, match="cannot add a parameter group now"):
        ours.add_param_group({"params": [nn.Parameter(torch.ones(3))]})
    assert len(ours.param_groups) == groups
    ours.step()


# ---------------------------------------------------------------------------------- fused=False


def test_updates_during_backward_with_the_for_loop_kernel_are_torchs_single_tensor_adamw() -> None:
    torch.manual_seed(0)
    ref = Stack()
    model = copy.deepcopy(ref)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False, fused=False)
    bucket = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    ours = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=False, offload_gradients=True,
                        update_in_backward=True, bucket_bytes=bucket)
    for step in range(4):
        for net, opt in ((ref, theirs), (model, ours)):
            net(_batch(step)).backward()
            opt.step()
            opt.zero_grad()
    assert _same(ref, model)
    assert all(float(s["step"]) == 4 for s in ours.state.values())


# ------------------------------------------------------------- edits of a device parameter between steps

import test_faults_misuse as misuse  # noqa: E402

DEVICE_EDITS = ["load_state_dict", "clamp_", "pruning-mask", "copy_"]  # what moves the version counter
DEVICE_PATHS = {"kept": {"transfer_pipeline": True}, "freed": {"offload_gradients": True},
                "update_in_backward": {"offload_gradients": True, "update_in_backward": True, "bucket_bytes": 1}}


@pytest.mark.parametrize("path", DEVICE_PATHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("edit", DEVICE_EDITS)
def test_an_edit_of_a_device_parameter_is_what_the_next_update_starts_from(edit, dtype, path, simulated_device) -> None:
    """On the simulated device every parameter is a device parameter with a host master: an edit between steps is read
    back and the master follows it element by element, as on the host (tests/test_faults_misuse.py's rule)."""
    model = misuse.linear_model(misuse.DTYPES[dtype])
    opt = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **DEVICE_PATHS[path])
    params = list(model.parameters())
    ref_params = [nn.Parameter(p.detach().float().clone()) for p in params]  # a copy also of a float32 parameter
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(5):
        if step == 3:
            misuse.EDITS[edit](model)
            for p, q in zip(params, ref_params):
                q.data.copy_(misuse.followed(q.detach(), p))
        opt.zero_grad()
        misuse.backward(model)
        for p, q in zip(params, ref_params):
            g = p.grad if path == "kept" else None
            q.grad = (g if g is not None else _host_gradient(opt, p)).detach().float().clone()
        opt.step()
        ref.step()
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_bitwise_equal(p.detach(), q.detach().to(p.dtype), f"parameter {i}")


def _host_gradient(opt: OffloadAdamW, p: torch.Tensor) -> torch.Tensor:
    if opt.update_in_backward:  # read before the step: the host buffer the update used (no other way to ask)
        slot = opt.transfer_pipeline.slots[p]
        slot.complete()
        return slot.host_grad
    return opt.gradient(p)


# ------------------------------------------------------------------ non-contiguous parameters on the pipeline

PIPELINE_MODES = ["kept", "freed"]  # of configs.MODES


@pytest.mark.parametrize("device", ["cpu", "simulated"])
@pytest.mark.parametrize("mode", PIPELINE_MODES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["conv-channels-last", "transposed-view"])
def test_non_contiguous_parameters_on_the_pipeline_step_as_the_plain_step(layout, dtype, mode, device, request) -> None:
    """The pipeline's host buffers are laid out like the parameter: the same bits as the plain step (itself held to
    torch's fused AdamW on the same layouts by tests/test_faults_misuse.py), a gradient set by hand contiguous too."""
    if device == "simulated":
        request.getfixturevalue("simulated_device")
    params = misuse.LAYOUTS[layout](misuse.DTYPES[dtype])
    ref_params = misuse.dense_copies(params)
    ours = OffloadAdamW(params, lr=1e-2, weight_decay=0.1, **MODES[mode].kwargs())
    ref = OffloadAdamW(ref_params, lr=1e-2, weight_decay=0.1)  # the plain step: no pipeline, host parameters
    for grad_layout in ("like-param", "contiguous"):
        misuse.train(ours, params, grad_layout, steps=range(3))
        misuse.train(ref, ref_params, "like-param", steps=range(3))
        for i, (p, q) in enumerate(zip(params, ref_params)):
            assert_bitwise_equal(p.detach(), q.detach(), f"parameter {i} after {grad_layout} gradients")
            assert_bitwise_equal(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], f"exp_avg_sq {i}")
        assert ours.host_buffer_bytes()["gradients"] == sum(p.numel() * p.element_size() for p in params)
        for p in params:
            slot = ours.transfer_pipeline.slots[p]
            assert slot.host_grad.stride() == torch.empty_like(p).stride(), "the host buffer is laid out like the parameter"


@pytest.mark.parametrize("device", ["cpu", "simulated"])
def test_a_channels_last_convnet_with_updates_during_backward_equals_torch_fused(device, request) -> None:
    if device == "simulated":
        request.getfixturevalue("simulated_device")
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    model = copy.deepcopy(ref)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ours = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, offload_gradients=True, update_in_backward=True,
                        bucket_bytes=1)
    for step in range(4):
        x = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(step)).to(memory_format=torch.channels_last)
        for net, opt in ((ref, theirs), (model, ours)):
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert _same(ref, model)
