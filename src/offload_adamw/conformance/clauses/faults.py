"""Clauses 12 to 14: what the candidate does with bad input.

Invalid hyperparameters are refused at construction (12); a non-finite gradient is propagated, skipped or
raised as declared (13); GradScaler's overflow step leaves no trace (14). Contract and method: the package's
docstring (:mod:`offload_adamw.conformance.clauses`).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import Tensor

from offload_adamw.conformance.clauses.common import EXACT, ClauseFinding, Context, _fmt, _series_compare, _tol, _wd
from offload_adamw.conformance.harness import (
    NotApplicable,
    compare,
    hyper,
    random_values,
)
from offload_adamw.contract.rules import NONFINITE_POLICIES


def clause_validation(ctx: Context) -> ClauseFinding:
    h = ctx.harness
    ok_values = hyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=_wd(ctx, 0.01))
    cases: list[tuple[str, dict[str, Any]]] = [
        ("lr = nan", {"lr": math.nan}),
        ("lr = -1e-3", {"lr": -1e-3}),
        ("eps = -1e-8", {"eps": -1e-8}),
        ("weight_decay = -0.01", {"weight_decay": -0.01}),
        ("beta1 = 1.0", {"betas": (1.0, 0.999)}),
        ("beta2 = 1.0", {"betas": (0.9, 1.0)}),
    ]
    accepted, rejected, skipped = [], [], []
    for label, change in cases:
        key = next(iter(change))
        if not h.mapping.accepts(key):
            skipped.append(label)
            continue
        params = h.params({"w": random_values(120, (4,), 0.5, 2.0)}, ctx.dtype)
        try:
            h.build(params, {**ok_values, **change})
        except NotApplicable:
            skipped.append(label)
        except Exception as exc:
            rejected.append(f"{label} ({type(exc).__name__})")
        else:
            accepted.append(label)
    detail = f"rejected: {', '.join(rejected) or 'none'}"
    if skipped:
        detail += f"; not asked (no such argument): {', '.join(skipped)}"
    if accepted:
        return ClauseFinding("fail", None, f"accepted at construction: {', '.join(accepted)}; " + detail)
    return ClauseFinding("pass", None, detail)


# ----------------------------------------------------------------------------- 13

def clause_nonfinite(ctx: Context) -> ClauseFinding:
    h = ctx.harness
    theta0 = {"bad": random_values(130, (6,), 0.5, 2.0), "good": random_values(131, (4,), 0.5, 2.0)}
    grads = [
        {n: random_values(1300 + 10 * k + i, t.shape, 0.1, 1.0) for i, (n, t) in enumerate(theta0.items())} for k in range(3)
    ]
    poisoned = dict(grads[1])
    bad = poisoned["bad"].clone()
    bad[0], bad[1] = math.inf, math.nan
    poisoned["bad"] = bad
    values = hyper(lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=_wd(ctx, 0.1))

    px = h.params(theta0, ctx.dtype)
    opt_x = h.build(px, values)
    declared = ctx.nonfinite_policy
    source = "declared by the caller"
    if declared is None:
        advertised = getattr(opt_x, "nonfinite", None)
        if isinstance(advertised, str) and advertised in NONFINITE_POLICIES:
            declared, source = advertised, "advertised by the candidate's 'nonfinite' attribute"
    before = h.run(opt_x, px, grads[:1])[0]
    raised = None
    try:
        h.step(opt_x, px, poisoned)
    except Exception as exc:
        raised = exc
    after = h.observe_all(opt_x, px)
    try:
        later = h.run(opt_x, px, grads[2:])[0]
    except Exception:
        later = None

    py = h.params(theta0, ctx.dtype)
    opt_y = h.build(py, values)
    clean = h.run(opt_y, py, [grads[0], grads[2]])[-1]
    tol = _tol(ctx, opt_x, px, steps=2)
    unchanged = {n: compare(after[n], before[n], EXACT)[0] for n in theta0}
    as_if_never = later is not None and all(compare(later[n], clean[n], tol)[0] for n in theta0)

    if raised is not None:
        behaviour = "raise" if all(unchanged.values()) and as_if_never else "raise (after changing state)"
        observed = f"step raised {type(raised).__name__}: {str(raised).strip().splitlines()[0] if str(raised).strip() else ''}"
    elif not bool(torch.isfinite(after["bad"]).all()):
        behaviour = "propagate"
        observed = "the update went ahead and theta of the tensor with the inf/NaN gradient became non-finite"
    elif all(unchanged.values()) and as_if_never:
        behaviour = "skip"
        observed = "no tensor changed and the next step continued as if the bad step never happened"
    elif all(unchanged.values()):
        behaviour = "skip (state changed)"
        observed = "theta unchanged but the next step differs from a run without the bad step (t or moments moved)"
    elif unchanged["bad"]:
        behaviour = "skip per tensor"
        observed = "only the tensor with the bad gradient was left alone"
    else:
        behaviour = "other"
        observed = "theta stayed finite but changed"
    detail = f"inf and NaN in one tensor's gradient at step 2: {observed}"
    if declared is None:
        return ClauseFinding("info", None, f"behaviour: {behaviour} (no policy declared). " + detail)
    verdict = "pass" if behaviour == declared else "fail"
    return ClauseFinding(verdict, None, f"behaviour: {behaviour}; policy {declared!r} {source}. " + detail)


# ----------------------------------------------------------------------------- 14

def clause_grad_scaler(ctx: Context) -> ClauseFinding:
    h = ctx.harness
    dtype = torch.float64 if ctx.dtype == torch.float64 else torch.float32
    theta0 = {"w": random_values(140, (6,), 0.5, 2.0), "b": random_values(141, (4,), 0.5, 2.0)}
    weights = [
        {n: random_values(1400 + 10 * k + i, t.shape, 0.1, 1.0) for i, (n, t) in enumerate(theta0.items())} for k in range(3)
    ]
    values = hyper(lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=_wd(ctx, 0.1))
    px = h.params(theta0, dtype)
    opt_x = h.build(px, values)
    if not isinstance(opt_x, torch.optim.Optimizer):
        raise NotApplicable("GradScaler support is not advertised (the candidate is not a torch.optim.Optimizer)")
    scaler = torch.amp.GradScaler(h.device.type, init_scale=2.0**10)
    seen = []
    for k, w in enumerate(weights):
        for p in px.values():
            p.grad = None
        loss = cast(Tensor, sum((p * w[n].to(p.device, p.dtype)).sum() for n, p in px.items()))  # px is not empty
        scaler.scale(loss).backward()
        if k == 1:
            grad = px["w"].grad
            assert grad is not None  # set by the backward just run
            grad[0] = math.inf  # an overflow in the scaled backward pass
        scaler.step(opt_x)
        scaler.update()
        seen.append(h.observe_all(opt_x, px))

    py = h.params(theta0, dtype)
    opt_y = h.build(py, values)
    clean = h.run(opt_y, py, [weights[0], weights[2]])
    tol = _tol(ctx, opt_x, px, steps=2)
    skipped = all(compare(seen[1][n], seen[0][n], EXACT)[0] for n in theta0)
    ok, dev, where = _series_compare([seen[0], seen[2]], clean, tol)
    detail = (f"torch.amp.GradScaler, overflow at step 2 of 3, compared with plain steps 1 and 3: theta untouched at the "
              f"overflow step: {skipped}; continuation deviation {_fmt(dev)}")
    if skipped and ok:
        return ClauseFinding("pass", dev, "the found_inf step is skipped without a trace. " + detail)
    return ClauseFinding(
        "fail",
        dev,
        "a GradScaler overflow step changes the optimizer" + (f" (first at {where})" if not ok else "") + ". " + detail,
    )
