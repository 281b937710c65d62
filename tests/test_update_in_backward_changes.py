"""What users change between backward and step() with updates during backward (issue 37): refused, every time.

With ``update_in_backward=True`` some updates of a step run while backward goes on, so a hyperparameter changed
after backward began (a step pre-hook setting lr, a scheduler stepped before ``opt.step()``, a ``param_groups``
edit) or a parameter edited between backward and ``step()`` (``p.data`` clamped or assigned,
``model.load_state_dict``) would be half taken. ``step()`` refuses each, naming what changed, whatever the timing
of the worker: every probe below runs 8 times, with no pause between backward and the change, and must be refused
every time (a check that raced with the updates refused some of them and let others through, wrong).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from offload_adamw import OffloadAdamW

REPETITIONS = 8
# The probes step a scheduler before opt.step() on purpose; torch warns about that order.
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 8))


def _loss(model: nn.Module, k: int) -> torch.Tensor:
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(k))
    return model(x).square().mean()


def _set_lr(opt, value):
    opt.param_groups[0]["lr"] = value


PROBES = {
    # hyperparameters: (what to do after backward, what the refusal names)
    "step pre-hook sets lr": (lambda model, opt: opt.register_step_pre_hook(lambda o, a, k: _set_lr(o, 5e-4)),
                              r"param_groups\[0\]\['lr'\] changed between backward and step\(\)"),
    "scheduler stepped before step()": (lambda model, opt: opt.scheduler.step(),
                                        r"param_groups\[0\]\['lr'\] changed between backward and step\(\)"),
    "param_groups edit": (lambda model, opt: opt.param_groups[0].__setitem__("weight_decay", 0.3),
                          r"param_groups\[0\]\['weight_decay'\] changed between backward and step\(\)"),
    "betas edit": (lambda model, opt: opt.param_groups[0].__setitem__("betas", (0.8, 0.999)),
                   r"param_groups\[0\]\['betas'\] changed between backward and step\(\)"),
    "max_grad_norm edit": (lambda model, opt: setattr(opt, "max_grad_norm", 0.5),
                           r"max_grad_norm changed between backward and step\(\)"),
    # parameters
    "p.data clamp": (lambda model, opt: model[2].weight.data.clamp_(-0.01, 0.01),
                     r"parameter '2.weight' was changed between backward and step\(\)"),
    "p.data assignment": (lambda model, opt: setattr(model[4].bias, "data", model[4].bias.data * 0.5),
                          r"parameter '4.bias' was changed between backward and step\(\)"),
    "in-place edit under no_grad": (lambda model, opt: _no_grad_mul(model[0].weight),
                                    r"parameter '0.weight' was changed between backward and step\(\)"),
    "model.load_state_dict": (lambda model, opt: model.load_state_dict(_model(seed=5).state_dict()),
                              r"parameter '0.weight' was changed between backward and step\(\)"),
}


def _no_grad_mul(p):
    with torch.no_grad():
        p.mul_(0.5)


def _armed(clip: float | None = None):
    """A model and an optimizer after two steps: the third backward's updates run during it."""
    model = _model()
    opt = OffloadAdamW(model.named_parameters(), lr=1e-3, offload_gradients=True, update_in_backward=True,
                       bucket_bytes=1, max_grad_norm=clip)
    opt.scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for k in range(2):
        _loss(model, k).backward()
        opt.step()
        opt.scheduler.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("probe", list(PROBES))
def test_a_change_between_backward_and_step_is_refused_every_time_naming_it(probe):
    change, names = PROBES[probe]
    refused = 0
    for _ in range(REPETITIONS):
        model, opt = _armed(clip=1.0 if probe == "max_grad_norm edit" else None)
        _loss(model, 2).backward()
        change(model, opt)  # at once: the worker may still be updating
        with pytest.raises(RuntimeError, match=names) as error:
            opt.step()
        refused += 1
        # The updates that ran during backward cannot be taken back: the optimizer stays refused until a load.
        with pytest.raises(RuntimeError, match="update_in_backward"):
            opt.step()
        assert "update_in_backward" in str(error.value)
    assert refused == REPETITIONS


def test_a_tensor_lr_filled_in_place_by_a_scheduler_is_refused_every_time():
    # torch's schedulers fill a tensor lr in place (the group keeps the same tensor): seen by value, not by identity.
    for _ in range(REPETITIONS):
        model = _model()
        opt = OffloadAdamW(model.named_parameters(), lr=torch.tensor(1e-3), offload_gradients=True,
                           update_in_backward=True, bucket_bytes=1)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        for k in range(2):
            _loss(model, k).backward()
            opt.step()
            scheduler.step()
            opt.zero_grad()
        lr = opt.param_groups[0]["lr"]
        _loss(model, 2).backward()
        scheduler.step()
        assert opt.param_groups[0]["lr"] is lr
        with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['lr'\] changed between backward and step\(\)"):
            opt.step()


def test_a_change_before_the_first_step_is_honoured_exactly_every_time():
    # No update runs during the first backward (the buckets follow the previous backward's order): step() runs every
    # update with the values of now, as torch does. Which steps have updates during backward follows from the
    # program (the step's index, state still to create, a shut gate), never from the worker's timing.
    for _ in range(REPETITIONS):
        ours, theirs = _model(), _model()
        opt = OffloadAdamW(ours.named_parameters(), lr=1e-3, offload_gradients=True, update_in_backward=True)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3, fused=True)
        for model, o in ((ours, opt), (theirs, ref)):
            scheduler = torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)
            _loss(model, 0).backward()
            scheduler.step()
            with torch.no_grad():
                model[2].weight.clamp_(-0.01, 0.01)
            o.step()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(p.detach(), q.detach())


def test_changes_after_step_and_before_backward_are_taken_as_torch_takes_them():
    # The protocol's other side: a scheduler stepped after opt.step(), an edit before backward, are fine and exact.
    ours, theirs = _model(), _model()
    opt = OffloadAdamW(ours.parameters(), lr=1e-3, offload_gradients=True, update_in_backward=True, bucket_bytes=1)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3, fused=True)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (opt, ref)]
    for k in range(4):
        for model, o, s in ((ours, opt, schedulers[0]), (theirs, ref, schedulers[1])):
            with torch.no_grad():
                model[2].weight.clamp_(-0.1, 0.1)
            _loss(model, k).backward()
            o.step()
            s.step()
            o.zero_grad()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_a_mark_sees_any_one_element_changed_in_any_layout():
    # A write through p.data moves no version counter: in host memory the mark's fingerprint must see it, also for a
    # view at an offset that is no multiple of 8 bytes, a tail shorter than 8 bytes, and complex or bf16 elements.
    from offload_adamw.accel.changes import changed, mark, values_of

    cases = {
        "float32": torch.randn(1000),
        "view at an odd offset": torch.randn(1001)[1:],
        "bf16 with a short tail": torch.randn(9, dtype=torch.bfloat16),
        "complex64": torch.randn(7, dtype=torch.complex64),
        "transposed": torch.randn(6, 5).t(),
    }
    for name, t in cases.items():
        before = mark(t, values_of(t))
        assert not changed(t, before), name
        for k in (0, t.numel() // 2, t.numel() - 1):
            where = tuple(int(i) for i in torch.unravel_index(torch.tensor(k), t.shape))
            old = t.data[where].clone()
            t.data[where] += 1
            assert changed(t, before), (name, k)
            t.data[where] = old
            assert not changed(t, before), (name, k, "put back")


def _two_heads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.ModuleDict({"a": nn.Linear(16, 16), "b": nn.Linear(16, 16)})


def _two_backwards(make_opt, change, steps: int = 4):
    """Each step: two losses over disjoint parameters, two backward() calls, one step(); ``change`` between the two
    backwards of the last step (after the first one's updates ran, before the second one began)."""
    model = _two_heads()
    opt = make_opt(model)
    for k in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(k))
        loss_a, loss_b = model["a"](x).square().mean(), model["b"](x).square().mean()
        loss_a.backward()
        if k == steps - 1:
            change(model, opt)
        loss_b.backward()
        opt.step()
        opt.zero_grad()
    return model


def _no_grad_halve(p):
    with torch.no_grad():
        p.mul_(0.5)


BETWEEN_BACKWARDS = {
    "lr set": (lambda model, opt: _set_lr(opt, 0.1), r"param_groups\[0\]\['lr'\] changed"),
    "in-place edit under no_grad": (lambda model, opt: _no_grad_halve(model["a"].weight),
                                    r"parameter 'a.weight' was changed between backward and step\(\)"),
}


@pytest.mark.parametrize("simulated", [False, True], ids=["host", "simulated-device"])
@pytest.mark.parametrize("probe", list(BETWEEN_BACKWARDS))
def test_a_change_between_two_backwards_after_updates_ran_is_refused(probe, simulated):
    # The first backward's updates ran with what it began with; a second backward over other parameters must not
    # make the change look as old as the step (the snapshot and the marks are those of the first backward whose
    # updates ran). torch's AdamW would step every parameter with the new values: silent wrong training otherwise.
    from offload_adamw.testing.simulated_cuda import simulated_cuda

    change, names = BETWEEN_BACKWARDS[probe]

    def ours(model):
        return OffloadAdamW(model.named_parameters(), lr=1e-2, offload_gradients=True, update_in_backward=True,
                            bucket_bytes=1)

    for _ in range(2):
        with simulated_cuda(3, index=1) if simulated else contextlib.nullcontext():
            with pytest.raises(RuntimeError, match=names):
                _two_backwards(ours, change)


def test_a_change_between_accumulating_backwards_is_taken_as_torch_takes_it():
    # Inside opt.no_sync() no update starts: a change before the backward whose updates run is no change to them.
    def step_with(make_opt):
        model = _two_heads()
        opt = make_opt(model)
        for k in range(4):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(k))
            with opt.no_sync():
                model["a"](x).square().mean().backward()
            _set_lr(opt, 1e-2 * (k + 1))
            model["a"](x * 2).square().mean().backward()
            model["b"](x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model

    ours = step_with(lambda m: OffloadAdamW(m.named_parameters(), lr=1e-2, offload_gradients=True,
                                            update_in_backward=True, bucket_bytes=1))
    theirs = step_with(lambda m: _NoSync(torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)))
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p.detach(), q.detach())


class _NoSync:
    """torch's AdamW with the no_sync() our loops call (accumulation is what torch does anyway)."""

    def __init__(self, opt):
        self.opt = opt
        self.param_groups = opt.param_groups

    def no_sync(self):
        return contextlib.nullcontext()

    def step(self):
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad()


def test_an_edit_right_after_backward_is_refused_while_the_updates_still_wait_for_their_copies():
    # Backward's last callback waits for the updates handed to the worker and marks their parameters, so that an edit
    # made as soon as backward returns comes after every update and its mark. Here the copies are slow (a busy link),
    # so when backward's hooks have all run the worker is still waiting for the first buckets' gradients: without that
    # wait the last bucket (the first layer) is updated after the edit, unmarked, and the edit goes through silently.
    from offload_adamw.testing.simulated_cuda import simulated_cuda

    with simulated_cuda(4, index=1) as sim:
        model, opt = _armed()  # built inside: every parameter is on the simulated device
        with sim.slow_copies(0.02):
            _loss(model, 2).backward()
            _no_grad_mul(model[0].weight)  # at once, from the user's thread
            with pytest.raises(RuntimeError, match=r"parameter '0.weight' was changed between backward and step\(\)"):
                opt.step()
    assert sim.take_hazards() == []
