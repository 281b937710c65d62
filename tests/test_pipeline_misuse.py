"""Uses of the transfer pipeline that once trained silently wrong, each now exact or refused loudly.

* Kept gradients edited without a version bump (``p.grad.data``, ``p.grad.data = ...``): the step
  fetches every kept gradient, so the edit counts, bitwise as torch.
* An optimizer re-created over the same parameters: the new one's hooks take over (the old one,
  alive until the garbage collector runs, used to take every gradient), with a warning.
* With update_in_backward=True (updates during backward, from the second step on): a backward
  that is not followed by step() (a skipped step, a GAN's second model), a second synchronising
  backward (accumulation without opt.no_sync()), state_dict / load_state_dict or reading gradients
  between backward and step(), a later use of a weight whose update already ran: each raises,
  naming what to do; zero_grad(set_to_none=False) after step() works; a parameter without state
  (unfrozen later) keeps every update of that step for step(), where creating state can fail first.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from _parity import same_bits
from offload_adamw import OffloadAdamW


def _model(seed: int = 0, width: int = 8, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _x(i: int, width: int = 8) -> torch.Tensor:
    return torch.randn(16, width, generator=torch.Generator().manual_seed(100 + i))


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    return model(_x(i)).square().mean()


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert same_bits(p.detach(), q.detach()), name


@pytest.mark.parametrize("edit", ["data-inplace", "data-assign"])
def test_kept_gradients_edited_without_a_version_bump_count(edit: str) -> None:
    ref, ours = _model(), _model()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, transfer_pipeline=True)
    for step in range(3):
        for model, o in ((ref, torch_opt), (ours, opt)):
            _loss(model, step).backward()
            for p in model.parameters():
                if edit == "data-inplace":
                    p.grad.data.mul_(0.5)
                else:
                    p.grad.data = p.grad.data * 0.5
            o.step()
            o.zero_grad()
        _assert_same(ref, ours)


@pytest.mark.parametrize("freed", [False, True], ids=["kept", "freed"])
def test_a_re_created_optimizer_takes_over_the_gradients(freed: bool) -> None:
    ref, ours = _model(), _model()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    gc.disable()  # the first optimizer stays alive as long as nothing collects its reference cycle
    try:
        first = OffloadAdamW(ours.parameters(), lr=1e-2, transfer_pipeline=True, offload_gradients=freed)
        with pytest.warns(UserWarning, match="takes over"):
            opt = OffloadAdamW(ours.parameters(), lr=1e-2, transfer_pipeline=True, offload_gradients=freed)
        for step in range(3):
            for model, o in ((ref, torch_opt), (ours, opt)):
                _loss(model, step).backward()
                o.step()
                o.zero_grad()
        _assert_same(ref, ours)
        del first
    finally:
        gc.enable()


def _uib(model: nn.Module, **kw) -> OffloadAdamW:
    return OffloadAdamW(model.parameters(), lr=1e-2, offload_gradients=True, update_in_backward=True, bucket_bytes=64, **kw)


def _two_steps(model: nn.Module, opt: OffloadAdamW) -> None:
    for step in range(2):  # the second backward already updates during backward
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()


def test_a_backward_not_followed_by_step_is_refused_at_zero_grad() -> None:
    model = _model()
    opt = _uib(model)
    _two_steps(model, opt)
    _loss(model, 5).backward()  # e.g. a loss found bad and skipped
    with pytest.raises(RuntimeError, match="opt.step\\(\\) must come next"):
        opt.zero_grad()
    model.zero_grad()  # sets p.grad to None: the pipeline sees it at the next backward
    with pytest.raises(RuntimeError, match="opt.step\\(\\) must come next|opt.no_sync\\(\\)"):
        _loss(model, 6).backward()


def test_accumulation_without_no_sync_is_refused_in_the_second_backward() -> None:
    model = _model()
    opt = _uib(model)
    _two_steps(model, opt)
    _loss(model, 5).backward()
    with pytest.raises(RuntimeError, match="opt.no_sync\\(\\)"):
        _loss(model, 6).backward()


@pytest.mark.parametrize("call", ["state_dict", "load_state_dict", "gradient_tensors", "gradient"])
def test_the_optimizer_state_cannot_be_read_or_replaced_mid_step(call: str) -> None:
    model = _model()
    opt = _uib(model)
    _two_steps(model, opt)
    saved = opt.state_dict()  # between step() and the next backward: allowed
    _loss(model, 5).backward()
    with pytest.raises(RuntimeError, match="update_in_backward=True"):
        if call == "state_dict":
            opt.state_dict()
        elif call == "load_state_dict":
            opt.load_state_dict(saved)
        elif call == "gradient_tensors":
            opt.gradient_tensors()
        else:
            opt.gradient(next(model.parameters()))
    opt.step()  # the step itself completes normally


def test_a_later_use_of_an_updated_weight_fails_in_backward() -> None:
    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.c = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            h = h @ self.c.weight.detach().t()  # read again by backward after c's own gradient is complete
            return self.c(h).square().mean()

    torch.manual_seed(0)
    model = Detached()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, offload_gradients=True, update_in_backward=True, bucket_bytes=64)
    model(_x(0)).backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(_x(1)).backward()


def test_zero_grad_keeping_zeros_works_after_step() -> None:
    ref, ours = _model(), _model()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = _uib(ours)
    for step in range(3):
        for model, o in ((ref, torch_opt), (ours, opt)):
            _loss(model, step).backward()
            o.step()
            o.zero_grad(set_to_none=False)
    _assert_same(ref, ours)


def test_a_parameter_without_state_keeps_the_step_free_of_early_updates(monkeypatch) -> None:
    model = _model()
    frozen = model[6]
    for p in frozen.parameters():
        p.requires_grad_(False)
    opt = _uib(model)
    _two_steps(model, opt)
    for p in frozen.parameters():
        p.requires_grad_(True)  # unfrozen: it needs state, which the pre-flight may refuse
    before = copy.deepcopy([p.detach() for p in model.parameters()])
    monkeypatch.setenv("OFFLOAD_ADAMW_HOST_AVAILABLE_BYTES", "400")
    _loss(model, 7).backward()
    with pytest.raises(Exception, match="host memory|Host"):
        opt.step()
    for a, p in zip(before, model.parameters()):
        assert same_bits(a, p.detach()), "an update ran although the step was refused"
