"""OffloadAdamW with every torch.optim.lr_scheduler, clip_grad_norm_, and torch.amp.GradScaler."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.optim import lr_scheduler as S

from _parity import same_bits
from offload_adamw import OffloadAdamW

SCHEDULERS = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda s: 0.9**s),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda s: 0.95),
    "StepLR": lambda o: S.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[2, 5], gamma=0.3),
    "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: S.LinearLR(o, start_factor=0.1, total_iters=6),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=10),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=4),
    "CyclicLR": lambda o: S.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=3),  # cycles beta1 too
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=1e-2, total_steps=12),  # cycles beta1 too
    "SequentialLR": lambda o: S.SequentialLR(
        o, [S.LinearLR(o, start_factor=0.2, total_iters=3), S.ExponentialLR(o, gamma=0.8)], milestones=[3]
    ),
    "ChainedScheduler": lambda o: S.ChainedScheduler([S.ConstantLR(o, factor=0.5, total_iters=3), S.ExponentialLR(o, gamma=0.9)]),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, patience=1, factor=0.5),
}


def _pair(seed=0):
    torch.manual_seed(seed)
    a = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    b = copy.deepcopy(a)
    return a, b


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_scheduler_drives_offload_adamw_like_torch_fused(name):
    a, b = _pair()
    opt_a = OffloadAdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    sched_a, sched_b = SCHEDULERS[name](opt_a), SCHEDULERS[name](opt_b)
    gen = torch.Generator().manual_seed(1)
    lrs = []
    for _ in range(12):
        x = torch.randn(3, 5, generator=gen)
        losses = []
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        for sched in (sched_a, sched_b):
            sched.step(losses[0]) if name == "ReduceLROnPlateau" else sched.step()
        assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
        assert opt_a.param_groups[0]["betas"] == opt_b.param_groups[0]["betas"]
        lrs.append(opt_a.param_groups[0]["lr"])
    assert len(set(lrs)) > 1, "the schedule must actually change lr"
    for p, q in zip(a.parameters(), b.parameters()):
        assert same_bits(p, q)


def test_clip_grad_norm_before_step_matches_torch():
    a, b = _pair()
    opt_a = OffloadAdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        x = torch.randn(3, 5, generator=gen) * 50  # large, so clipping bites
        norms = []
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).square().mean().backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
            opt.step()
        assert norms[0] > 0.5 and same_bits(norms[0], norms[1])
    for p, q in zip(a.parameters(), b.parameters()):
        assert same_bits(p, q)


def test_grad_scaler_skips_an_inf_step_exactly_and_unscales_otherwise():
    # A float32 model under fp16 autocast is what GradScaler serves (it refuses to unscale fp16 grads).
    a, b = _pair()
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in b.parameters()]
    opt = OffloadAdamW(a.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(fp32, lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    gen = torch.Generator().manual_seed(3)
    skipped = 0
    for step in range(8):
        x = torch.randn(3, 5, generator=gen)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = a(x)
        scaler.scale(out.float().square().mean()).backward()
        if step == 4:  # poison one gradient: the whole step must be skipped
            next(a.parameters()).grad[0, 0] = float("inf")
        before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in opt.state}
        params_before = [p.detach().clone() for p in a.parameters()]
        scale_before = scaler.get_scale()
        scaler.unscale_(opt)
        unscaled = [p.grad.float() for p in a.parameters()]
        scaler.step(opt)
        scaler.update()
        if step == 4:
            skipped += 1
            assert scaler.get_scale() < scale_before
            assert all(torch.equal(p, q) for p, q in zip(a.parameters(), params_before))
            for p, st in before.items():
                assert all(same_bits(opt.state[p][k], v) for k, v in st.items())
        else:
            for q, g in zip(fp32, unscaled):
                q.grad = g
            ref.step()
            for p, q in zip(a.parameters(), fp32):
                assert same_bits(opt.master_param(p), q)
    assert skipped == 1


@pytest.mark.parametrize("policy", ["propagate", "skip", "raise"])
def test_nonfinite_policies(policy):
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(2))
    opt = OffloadAdamW([("p", p), ("q", q)], lr=0.1, nonfinite=policy)
    p.grad, q.grad = torch.ones(3), torch.ones(2)
    opt.step()
    snap = [t.detach().clone() for t in (p, q, opt.state[p]["exp_avg"], opt.state[q]["step"])]
    p.grad = torch.tensor([1.0, float("nan"), 1.0])
    q.grad = torch.ones(2)
    if policy == "raise":
        with pytest.raises(FloatingPointError, match="parameter 'p'"):
            opt.step()
    else:
        opt.step()
    after = [p, q, opt.state[p]["exp_avg"], opt.state[q]["step"]]
    if policy == "propagate":
        assert torch.isnan(p).any() and opt.state[q]["step"].item() == 2
    else:
        assert all(same_bits(x, y) for x, y in zip(after, snap))
        assert opt.skipped_steps == (1 if policy == "skip" else 0)
