"""OffloadAdamW against torch.optim.AdamW and the reference (the parity definition of issue #2).

* float32 parameters: theta, m, v, step bitwise equal to torch.optim.AdamW(fused=True).
* bf16/fp16 parameters: master, m, v bitwise equal to fused AdamW run on float32 copies
  fed the same upcast gradients; each model parameter is its master rounded to nearest.
* float64 parameters: within 1e-12 relative of offload_adamw.reference.
* fused=False: bitwise equal to torch's single-tensor AdamW (foreach=False, fused=False).
"""

from __future__ import annotations

import math

import pytest
import torch

from _parity import SHAPES, UNFREEZE_AT, assign_grads, groups_of, make_params, same_bits
from offload_adamw import OffloadAdamW
from offload_adamw import reference as ref

STEPS = 100


def run_pair(model_dtype: torch.dtype, steps: int = STEPS, offload_kwargs=None, torch_kwargs=None, scheduler=None):
    """Train the scripted parameter set with OffloadAdamW (model dtype) and torch AdamW (float32 copies)."""
    ours = make_params(model_dtype)
    theirs = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in ours.items()}
    opt = OffloadAdamW(groups_of(ours), lr=1e-3, **(offload_kwargs or {}))
    base = torch.optim.AdamW(groups_of(theirs), lr=1e-3, **(torch_kwargs or {"fused": True}))
    scheds = [scheduler(o) for o in (opt, base)] if scheduler else []
    for step in range(steps):
        assign_grads(ours, step)
        for n, p in theirs.items():
            g = ours[n].grad
            p.grad = None if g is None else g.float()  # exact upcast of the same gradient
        opt.step()
        base.step()
        for s in scheds:
            s.step()
    return ours, theirs, opt, base


def assert_state_bitwise(ours, theirs, opt, base, exclude_master=False):
    for name in SHAPES:
        p, q = ours[name], theirs[name]
        st_o, st_t = opt.state.get(p, {}), base.state.get(q, {})
        assert bool(st_o) == bool(st_t), name
        if not st_o:
            continue
        assert st_o["step"].item() == st_t["step"].item(), name
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in st_t:
                assert st_o[key].dtype == torch.float32, (name, key)
                assert same_bits(st_o[key], st_t[key]), (name, key)
        assert same_bits(opt.master_param(p), q), name


def test_float32_bitwise_equal_to_torch_fused_over_100_steps_with_scheduler():
    sched = lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS, eta_min=1e-5)  # noqa: E731
    ours, theirs, opt, base = run_pair(torch.float32, scheduler=sched)
    assert_state_bitwise(ours, theirs, opt, base)
    for name in SHAPES:
        assert same_bits(ours[name], theirs[name]), name
        assert "master_param" not in opt.state.get(ours[name], {}), "a float32 host parameter is its own master"
    # The awkward cases really happened.
    assert opt.state[ours["frozen_then_unfrozen"]]["step"].item() == STEPS - UNFREEZE_AT
    assert opt.state[ours["sometimes_none"]]["step"].item() == sum(1 for s in range(STEPS) if s % 3)
    assert opt.state[ours["w1"]]["step"].item() == STEPS
    assert not torch.equal(ours["zero_grad"], make_params(torch.float32)["zero_grad"]), "explicit zeros still decay"


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_master_and_moments_bitwise_equal_to_fused_on_float32_copies(model_dtype):
    ours, theirs, opt, base = run_pair(model_dtype)
    assert_state_bitwise(ours, theirs, opt, base)
    for name in SHAPES:
        p = ours[name]
        assert p.dtype == model_dtype
        if opt.state.get(p):
            master = opt.state[p]["master_param"]
            assert master.dtype == torch.float32 and master.device.type == "cpu"
            assert same_bits(p, master.to(model_dtype)), f"{name}: model parameter is not round(master)"


def test_bf16_model_keeps_decaying_where_torch_bf16_state_stalls():
    """The reason for float32 state: v*0.999 rounds back to v in bf16."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = OffloadAdamW([p], lr=1e-3, weight_decay=0.0)
    p.grad = torch.ones_like(p)
    opt.step()
    v1 = opt.state[p]["exp_avg_sq"].clone()
    for _ in range(50):
        p.grad = torch.zeros_like(p)
        opt.step()
    assert torch.allclose(opt.state[p]["exp_avg_sq"], v1 * 0.999**50, rtol=1e-5)


def test_float64_within_1e12_of_the_reference():
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(6, dtype=torch.float64, generator=gen))
    hp = dict(lr=0.05, betas=(0.85, 0.98), eps=1e-6, weight_decay=0.2)
    opt = OffloadAdamW([p], **hp)
    state = ref.init_state(p.detach().tolist())
    rhp = ref.Hyper(lr=0.05, beta1=0.85, beta2=0.98, eps=1e-6, weight_decay=0.2)
    for step in range(60):
        g = (
            None
            if step % 7 == 3
            else (torch.zeros(6, dtype=torch.float64) if step % 5 == 0 else torch.randn(6, dtype=torch.float64, generator=gen))
        )
        p.grad = g
        opt.step()
        state = ref.adamw_step(state, None if g is None else g.tolist(), rhp)
    assert opt.state[p]["exp_avg"].dtype == torch.float64
    assert opt.state[p]["step"].item() == state.t
    for ours, theirs in ((p.detach(), state.theta), (opt.state[p]["exp_avg"], state.m), (opt.state[p]["exp_avg_sq"], state.v)):
        for a, b in zip(ours.tolist(), theirs):
            assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300), (a, b)


def test_fused_false_is_bitwise_torch_single_tensor():
    ours, theirs, opt, base = run_pair(
        torch.float32, steps=30, offload_kwargs={"fused": False}, torch_kwargs={"foreach": False, "fused": False}
    )
    assert_state_bitwise(ours, theirs, opt, base)


def test_fused_and_for_loop_paths_agree_within_torch_tolerance():
    ours, theirs, opt, base = run_pair(
        torch.float32, steps=30, offload_kwargs={"fused": False}, torch_kwargs={"fused": True}
    )
    for name in SHAPES:
        torch.testing.assert_close(ours[name].detach(), theirs[name].detach(), rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_flags_bitwise(amsgrad, maximize):
    gen = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(torch.randn(33, 7, generator=gen))
    q = torch.nn.Parameter(p.detach().clone())
    a = OffloadAdamW([p], lr=0.01, amsgrad=amsgrad, maximize=maximize)
    b = torch.optim.AdamW([q], lr=0.01, amsgrad=amsgrad, maximize=maximize, fused=True)
    for _ in range(20):
        g = torch.randn(33, 7, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert same_bits(p, q)


def test_tensor_lr_bitwise():
    p = torch.nn.Parameter(torch.randn(10, 3))
    q = torch.nn.Parameter(p.detach().clone())
    a = OffloadAdamW([p], lr=torch.tensor(0.01))
    b = torch.optim.AdamW([q], lr=torch.tensor(0.01), fused=True)
    for _ in range(10):
        g = torch.randn(10, 3)
        p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert same_bits(p, q)


TENSOR_BETAS = {
    "fused": ({}, {"fused": True}),
    "fused, amsgrad, pipeline": ({"amsgrad": True, "transfer_pipeline": True}, {"amsgrad": True, "fused": True}),
    # torch's single-tensor loop keeps tensor betas as float32 tensors: its bias corrections are float32 tensors.
    "for-loop": ({"fused": False}, {"foreach": False, "fused": False}),
    "for-loop, amsgrad, tensor lr": ({"fused": False, "amsgrad": True, "lr": torch.tensor(0.01)},
                                     {"foreach": False, "fused": False, "amsgrad": True, "lr": torch.tensor(0.01)}),
}


@pytest.mark.parametrize("case", list(TENSOR_BETAS))
def test_tensor_betas_are_kept_as_torch_keeps_them_and_train_bitwise(case):
    # issue 37: betas=(tensor, tensor), which torch accepts, must train as torch trains, with the groups torch has.
    ours_kwargs, torch_kwargs = TENSOR_BETAS[case]
    gen = torch.Generator().manual_seed(7)
    p = torch.nn.Parameter(torch.randn(33, 7, generator=gen))
    q = torch.nn.Parameter(p.detach().clone())
    betas = (torch.tensor(0.9), torch.tensor([0.999]))  # a 1-element beta is squeezed to 0-dim, as torch does
    a = OffloadAdamW([p], **{"lr": 0.01, "betas": betas, **ours_kwargs})
    b = torch.optim.AdamW([q], **{"lr": 0.01, "betas": betas, **torch_kwargs})
    for _ in range(20):
        g = torch.randn(33, 7, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert same_bits(p.detach(), q.detach())
    for key in ("exp_avg", "exp_avg_sq"):
        assert same_bits(a.state[p][key], b.state[q][key])
    ours_betas, their_betas = a.param_groups[0]["betas"], b.param_groups[0]["betas"]
    assert all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in ours_betas)
    assert [x.item() for x in ours_betas] == [x.item() for x in their_betas]


def test_lr_zero_absorbs_and_grad_none_skips_exactly():
    p = torch.nn.Parameter(torch.randn(5))
    opt = OffloadAdamW([p], lr=0.0, weight_decay=0.3)
    before = p.detach().clone()
    p.grad = torch.ones(5)
    opt.step()
    assert torch.equal(p, before) and opt.state[p]["step"].item() == 1
    assert torch.all(opt.state[p]["exp_avg"] > 0)
    snapshot = {k: v.clone() for k, v in opt.state[p].items()}
    p.grad = None
    opt.param_groups[0]["lr"] = 0.1
    opt.step()
    assert torch.equal(p, before)
    assert all(torch.equal(snapshot[k], opt.state[p][k]) for k in snapshot)


def test_requires_grad_false_with_old_grad_is_still_updated():
    """docs/contract.md#frozen-parameters: freezing does not remove .grad; the tensor keeps moving."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = OffloadAdamW([p], lr=0.1)
    p.grad = torch.ones(4)
    p.requires_grad_(False)
    before = p.detach().clone()
    opt.step()
    assert not torch.equal(p, before)


def test_real_model_backward_bf16():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3))
    ref_model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3))
    ref_model.load_state_dict(model.state_dict())
    model.to(torch.bfloat16)
    ref_model.to(torch.bfloat16)
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in ref_model.parameters()]
    opt = OffloadAdamW(model.named_parameters(), lr=3e-3, weight_decay=0.05)
    base = torch.optim.AdamW(fp32, lr=3e-3, weight_decay=0.05, fused=True)
    for _ in range(15):
        x = torch.randn(8, 12, dtype=torch.bfloat16)
        model(x).float().square().mean().backward()
        for p, q in zip(model.parameters(), fp32):
            q.grad = p.grad.float()
        opt.step()
        base.step()
        opt.zero_grad()
        for p, q in zip(model.parameters(), fp32):
            assert same_bits(opt.master_param(p), q)
            assert same_bits(p, q.to(torch.bfloat16))


def test_a_bad_gradient_in_a_later_group_changes_nothing_in_earlier_groups():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(2))
    opt = OffloadAdamW([{"params": [("a", a)]}, {"params": [("b", b)]}], lr=0.1)
    a.grad = torch.ones(3)
    b.grad = torch.ones(2, dtype=torch.float32).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients \\(parameter 'b'\\)"):
        opt.step()
    assert torch.equal(a, torch.ones(3)) and not opt.state, "the first group was not updated, no state was created"
