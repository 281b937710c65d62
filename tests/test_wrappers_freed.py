"""Freed device gradients (offload_gradients=True) seen through ``p.grad``: the stand-in of accel/freed.py.

The user calls of torch's own loop, on the model, must reach the host gradient: ``torch.nn.utils.clip_grad_norm_
(model.parameters())`` and ``model.zero_grad()`` (both settings of set_to_none), every step bitwise equal to
torch.optim.AdamW(fused=True); anything else done to ``p.grad`` is refused with an error that names the parameter.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload_adamw import OffloadAdamW, is_host_resident


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _x(i: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_model_clip_and_model_zero_grad_match_torch(set_to_none, accumulation):
    ref = _model()
    model = copy.deepcopy(ref)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, transfer_pipeline=True, offload_gradients=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for step in range(5):
        norms = []
        for m, o in ((model, opt), (ref, ref_opt)):
            for micro in range(accumulation):
                m(_x(step * 10 + micro)).square().mean().backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01))
            o.step()
            m.zero_grad(set_to_none=set_to_none)
        assert torch.equal(norms[0], norms[1]) and norms[1] > 0.01
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q), f"step {step}"
    assert all(p.grad is None or is_host_resident(p.grad) for p in model.parameters())


def test_other_operations_on_the_stand_in_are_refused_by_name():
    model = _model()
    named = [{"params": [p], "param_names": [n]} for n, p in model.named_parameters()]
    opt = OffloadAdamW(named, transfer_pipeline=True, offload_gradients=True)
    model(_x(0)).sum().backward()
    g = model[0].weight.grad
    assert is_host_resident(g) and g.shape == model[0].weight.shape
    with pytest.raises(RuntimeError, match=r"'0\.weight'.*host memory.*opt\.gradient"):
        g + 1
    with pytest.raises(RuntimeError, match="host memory"):
        g.clone()
    assert opt.offload_gradients  # kept alive to here: an optimizer let go takes its hooks with it


def test_gradients_kept_until_zeroed_accumulate_across_steps_as_torch():
    # No zero_grad at all between steps: torch accumulates into p.grad, so the host does too.
    ref = _model()
    model = copy.deepcopy(ref)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, transfer_pipeline=True, offload_gradients=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(_x(step)).square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["freed", "update in backward"])
@pytest.mark.parametrize("after", ["OffloadAdamW", "torch AdamW"])
def test_an_optimizer_dropped_before_its_step_gives_the_gradients_back_as_real_tensors(after, update_in_backward):
    # issue 37: an optimizer dropped between backward and step() while its gradients live in host memory took them
    # with it; p.grad kept the stand-in, so a new OffloadAdamW moved nothing and torch's AdamW raised. When it goes,
    # each p.grad becomes a real tensor holding the gradient, and what the user let go is freed.
    import gc
    import weakref

    ours, theirs = _model(), _model()
    make = {"OffloadAdamW": lambda ps: OffloadAdamW(ps, lr=1e-2),
            "torch AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)}[after]
    dropped = OffloadAdamW(ours.parameters(), lr=1e-2, offload_gradients=True, update_in_backward=update_in_backward)
    gc.disable()  # freed by reference counting, not by a collection: nothing keeps it in a cycle
    try:
        ours(_x(0)).square().mean().backward()
        assert all(is_host_resident(p.grad) for p in ours.parameters())
        gone = weakref.ref(dropped)
        pipeline = weakref.ref(dropped.transfer_pipeline)
        del dropped
        alive = gone() is not None
    finally:
        gc.enable()
    gc.collect()
    assert not alive and gone() is None and pipeline() is None
    theirs(_x(0)).square().mean().backward()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert type(p.grad) is torch.Tensor and p.grad.device == p.device and torch.equal(p.grad, q.grad)
    new, reference = make(list(ours.parameters())), torch.optim.AdamW(theirs.parameters(), lr=1e-2, fused=True)
    new.step()
    reference.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p.detach(), q.detach())
    grads = [weakref.ref(p.grad) for p in ours.parameters()]
    new.zero_grad()
    gc.collect()
    assert all(r() is None for r in grads), "a given-back gradient is kept alive after zero_grad()"


@pytest.mark.parametrize("update_on", ["host", "device"])
def test_gradients_whose_update_ran_during_backward_are_not_given_back_to_be_applied_twice(update_on):
    # An optimizer dropped between a backward whose updates ran (update_in_backward) and its step(): those gradients
    # were applied already. Given back as real tensors, a new optimizer would apply them a second time (silent wrong
    # training). As torch's optimizer-in-backward pattern (step() and zero_grad() in a post-accumulate-grad hook)
    # leaves it, each such p.grad is None, with a warning naming the parameters and why.
    import gc

    ours, theirs = _model(), _model()
    named = [{"params": list(ours.named_parameters()), "update_on": update_on}]
    dropped = OffloadAdamW(named, lr=1e-2, offload_gradients=True, update_in_backward=True, bucket_bytes=1)
    reference = torch.optim.AdamW(theirs.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        for m, o in ((ours, dropped), (theirs, reference)):
            m(_x(step)).square().mean().backward()
            if step < 2:
                o.step()
                o.zero_grad()
    reference.step()  # torch's third step; ours ran during the third backward
    with pytest.warns(RuntimeWarning, match=r"'0\.weight'.*update_in_backward.*a second time"):
        del dropped
        gc.collect()
    assert all(p.grad is None for p in ours.parameters())
    new = torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=True)
    new.step()  # nothing to apply: the updates of the third step ran once
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_after_a_completed_step_with_updates_during_backward_every_gradient_is_given_back():
    # torch keeps p.grad after its step: an optimizer dropped after step() and before zero_grad() gives every gradient
    # back, also those its updates during backward applied, and says nothing.
    import gc
    import warnings

    ours, theirs = _model(), _model()
    dropped = OffloadAdamW(ours.named_parameters(), lr=1e-2, offload_gradients=True, update_in_backward=True,
                           bucket_bytes=1)
    reference = torch.optim.AdamW(theirs.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        for m, o in ((ours, dropped), (theirs, reference)):
            m(_x(step)).square().mean().backward()
            o.step()
            if step < 2:
                o.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del dropped
        gc.collect()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert type(p.grad) is torch.Tensor and torch.equal(p.grad, q.grad) and torch.equal(p.detach(), q.detach())
