"""Clauses 2 and 3: decoupled weight decay (not L2 in the gradient), applied to the pre-update value.

Contract and method: the package's docstring (:mod:`offload_adamw.conformance.clauses`), clauses 2 and 3:
runs with and without decay on the same gradients, compared with each other, and one-step forms where the
step itself depends on theta.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from offload_adamw.conformance.clauses.common import ClauseFinding, Context, _fmt, _tol
from offload_adamw.conformance.harness import (
    NotApplicable,
    Tolerance,
    compare,
    hyper,
    random_values,
)


def _decay_data(steps: int, same_sign: bool) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    shapes = {"w": (6,), "v": (4,)}
    theta0 = {n: random_values(20 + i, s, 1.0, 3.0) for i, (n, s) in enumerate(shapes.items())}
    grads = []
    for k in range(steps):
        g = {n: random_values(200 + 10 * k + i, s, 0.1, 1.0) for i, (n, s) in enumerate(shapes.items())}
        if same_sign:
            g = {n: t.abs() * torch.sign(theta0[n]) for n, t in g.items()}
        grads.append(g)
    return theta0, grads


def _decay_pair(ctx: Context, *, lr: float, wd: float, steps: int, same_sign: bool, eps: float) -> tuple[list, list, dict]:
    h = ctx.harness
    theta0, grads = _decay_data(steps, same_sign)
    pa = h.params(theta0, ctx.dtype)
    pb = h.params(theta0, ctx.dtype)
    opt_a = h.build(pa, hyper(lr=lr, eps=eps, weight_decay=0.0))
    opt_b = h.build(pb, hyper(lr=lr, eps=eps, weight_decay=wd))
    start = h.observe_all(opt_b, pb)
    seen_a = [h.observe_all(opt_a, pa)] + h.run(opt_a, pa, grads)
    seen_b = [start] + h.run(opt_b, pb, grads)
    tol = _tol(ctx, opt_b, pb, steps=steps)
    return seen_a, seen_b, {"tol": tol}


def _decay_forms(seen_a: list, seen_b: list, shrink: float, tol: Tolerance) -> dict[str, tuple[bool, float]]:
    """How well theta_B fits 'decay before the update' and 'decay after the update', step by step."""
    out = {}
    for form in ("before", "after"):
        ok_all, worst = True, 0.0
        for k in range(1, len(seen_b)):
            for name in seen_b[k]:
                step_a = seen_a[k - 1][name] - seen_a[k][name]
                prev_b = seen_b[k - 1][name]
                predicted = shrink * prev_b - step_a if form == "before" else shrink * (prev_b - step_a)
                ok, dev = compare(seen_b[k][name], predicted, tol)
                ok_all &= ok
                worst = max(worst, dev)
        out[form] = (ok_all, worst)
    return out


def _fitted_shrinks(seen_a: list, seen_b: list, tol: Tolerance) -> dict[str, tuple[bool, float, dict[str, float]]]:
    """One step: the shrink factor per tensor that fits each order best (least squares), and whether it fits.

    A decay scaled by a statistic of the moments (by 1/sqrt(mean v), say) is a shrink by another factor than
    1 - lr*wd: that is clause 2's finding, and the order of decay and update can still be seen."""
    out = {}
    for form in ("before", "after"):
        ok_all, worst, factors = True, 0.0, {}
        for name in seen_b[1]:
            theta0, after_a, after_b = seen_a[0][name], seen_a[1][name], seen_b[1][name]
            step_a = theta0 - after_a
            base, target = (theta0, after_b + step_a) if form == "before" else (after_a, after_b)
            factor = float((target * base).sum() / (base * base).sum())
            predicted = factor * theta0 - step_a if form == "before" else factor * after_a
            ok, dev = compare(after_b, predicted, tol)
            ok_all &= ok and 0.0 < factor < 1.0
            worst = max(worst, dev)
            factors[name] = factor
        out[form] = (ok_all, worst, factors)
    return out


def _step_scales_with_theta(ctx: Context, *, lr: float) -> float | None:
    """How far the weight_decay-0 first step taken from 2*theta0 is from the one taken from theta0, where they differ
    (AdamW's step does not depend on theta; a trust ratio's or a weight norm's does); None where they agree.

    Where the step depends on theta, a run with weight decay moves theta and so changes the later steps
    themselves: the step-by-step comparisons of clauses 2 and 3 do not hold, and one step from a fresh state
    is asked instead (:func:`_one_step_forms`)."""
    h = ctx.harness
    theta0 = {n: random_values(20 + i, s, 1.0, 3.0) for i, (n, s) in enumerate({"w": (6,), "v": (4,)}.items())}
    grads = [{n: random_values(200 + i, t.shape, 0.1, 1.0) for i, (n, t) in enumerate(theta0.items())}]
    ends = []
    for scale in (1.0, 2.0):
        start = {n: scale * t for n, t in theta0.items()}
        params = h.params(start, ctx.dtype)
        opt = h.build(params, hyper(lr=lr, eps=1e-8, weight_decay=0.0))
        ends.append((start, h.run(opt, params, grads)[0], _tol(ctx, opt, params, steps=2)))
    (start_one, end_one, _), (start_two, end_two, tol) = ends
    # Compared where theta is, at theta's precision: a rounded parameter's step is only known to its ulp.
    results = [compare(end_two[n], start_two[n] + (end_one[n] - start_one[n]), tol) for n in end_one]
    return None if all(ok for ok, _ in results) else max(dev for _, dev in results)


ONE_STEP_FORMS = {
    "before": "decay first, the step taken as from the undecayed theta: s*theta0 - u(theta0)",
    "before, step from the decayed theta": "decay first, the step taken from the decayed theta: s*theta0 - u(s*theta0)",
    "after": "decay after the update: s*(theta0 - u(theta0))",
}


def _one_step_forms(ctx: Context, *, lr: float, wd: float, same_sign: bool, eps: float) -> dict[str, tuple[bool, float]]:
    """For a step that depends on theta: one step from a fresh state with weight decay, against the weight_decay-0
    step from theta0 and from s*theta0 (s = 1 - lr*wd), in each decoupled form of :data:`ONE_STEP_FORMS`.

    Decay multiplied into a trust-ratio-scaled step (or coupled into the gradient) fits none of them."""
    h = ctx.harness
    theta0, grads = _decay_data(1, same_sign)
    shrink = 1 - lr * wd

    def one(start: Mapping[str, Tensor], decay: float) -> tuple[dict[str, Tensor], dict[str, Tensor], Tolerance]:
        params = h.params(start, ctx.dtype)
        opt = h.build(params, hyper(lr=lr, eps=eps, weight_decay=decay))
        before = h.observe_all(opt, params)
        return before, h.run(opt, params, grads)[0], _tol(ctx, opt, params, steps=2)

    start_a, end_a, _ = one(theta0, 0.0)
    _, end_a_decayed, _ = one({n: shrink * t for n, t in theta0.items()}, 0.0)
    _, end_b, tol = one(theta0, wd)
    predictions = {
        "before": {n: shrink * start_a[n] - (start_a[n] - end_a[n]) for n in end_b},
        "before, step from the decayed theta": end_a_decayed,
        "after": {n: shrink * end_a[n] for n in end_b},
    }
    out = {}
    for form, predicted in predictions.items():
        results = [compare(end_b[n], predicted[n], tol) for n in end_b]
        out[form] = (all(ok for ok, _ in results), max(dev for _, dev in results))
    return out


def _theta_dependent_note(scaled: float) -> str:
    return (f"the step itself depends on theta (doubling theta changes the weight_decay-0 step by {_fmt(scaled)}: a trust "
            "ratio or a weight norm), so later steps with and without decay differ whatever the decay is; judged on "
            "one step from a fresh state instead")


DECAY_LR, DECAY_WD = 0.1, 5.0
"""Clause 2's learning rate and weight decay: s = 1 - lr*wd = 0.5, so that a decay factor wrong by a few per cent
(a clipped lr, a rescaled wd) moves theta by more than a bfloat16 ulp at every step."""


def clause_decoupled(ctx: Context) -> ClauseFinding:
    if not ctx.harness.mapping.accepts("weight_decay"):
        raise NotApplicable("the candidate takes no weight decay")
    lr, wd, steps = DECAY_LR, DECAY_WD, 4
    seen_a, seen_b, info = _decay_pair(ctx, lr=lr, wd=wd, steps=steps, same_sign=False, eps=1e-8)
    forms = _decay_forms(seen_a, seen_b, 1 - lr * wd, info["tol"])
    deviation = min(forms["before"][1], forms["after"][1])
    detail = (
        f"{steps} steps with lr {lr}, weight_decay {wd} vs. weight_decay 0 on the same gradients; "
        f"fit as decoupled decay before the update: {_fmt(forms['before'][1])}, after the update: {_fmt(forms['after'][1])}"
    )
    if forms["before"][0] or forms["after"][0]:
        return ClauseFinding("pass", deviation, "the update direction does not depend on weight_decay (decoupled). " + detail)
    scaled = _step_scales_with_theta(ctx, lr=lr)
    if scaled is not None:
        one = _one_step_forms(ctx, lr=lr, wd=wd, same_sign=False, eps=1e-8)
        fits = [form for form, (ok, _) in one.items() if ok]
        one_dev = min(dev for _, dev in one.values())
        distances = "; ".join(f"{ONE_STEP_FORMS[form]}: {_fmt(dev)}" for form, (_, dev) in one.items())
        note = _theta_dependent_note(scaled) + f". One step, lr {lr}, weight_decay {wd}: distance to {distances}"
        if fits:
            return ClauseFinding("pass", one_dev, f"decay is a separate shrink by 1 - lr*wd ({fits[0]}): decoupled. " + note)
        return ClauseFinding("fail", one_dev, "weight decay is not a separate shrink by 1 - lr*wd: it goes through the "
                             "theta-dependent step (multiplied by a trust ratio) or reaches the moments. " + note)
    return ClauseFinding("fail", deviation, "weight_decay changes the update direction: it reaches the moments "
                   "(L2 coupled into the gradient) or is not lr*wd*theta. " + detail)


def clause_decay_order(ctx: Context) -> ClauseFinding:
    if not ctx.harness.mapping.accepts("weight_decay"):
        raise NotApplicable("the candidate takes no weight decay")
    lr, wd = 0.5, 0.5
    seen_a, seen_b, info = _decay_pair(ctx, lr=lr, wd=wd, steps=1, same_sign=True, eps=1e-8)
    forms = _decay_forms(seen_a, seen_b, 1 - lr * wd, info["tol"])
    detail = (
        f"one step, lr {lr}, weight_decay {wd}, gradients of theta's sign: distance to "
        f"s*theta0 - u (decay first): {_fmt(forms['before'][1])}; to s*(theta0 - u) (decay after): {_fmt(forms['after'][1])}"
    )
    if forms["before"][0]:
        return ClauseFinding("pass", forms["before"][1], "decay acts on the pre-update value. " + detail)
    scaled = _step_scales_with_theta(ctx, lr=lr)
    if scaled is not None:
        one = _one_step_forms(ctx, lr=lr, wd=wd, same_sign=True, eps=1e-8)
        note = _theta_dependent_note(scaled) + ": " + "; ".join(
            f"{ONE_STEP_FORMS[form]}: {_fmt(dev)}" for form, (_, dev) in one.items())
        for form in ("before", "before, step from the decayed theta"):
            if one[form][0]:
                return ClauseFinding("pass", one[form][1], "decay acts on the pre-update value. " + note)
        if one["after"][0]:
            return ClauseFinding("fail", one["after"][1], "decay is applied after the update (adds lr^2*wd*u). " + note)
        raise NotApplicable("the decayed step fits no decoupled form (clause 2's finding), so the order of decay and "
                            "update cannot be seen. " + note)
    if all(compare(seen_b[1][n], seen_a[1][n], info["tol"])[0] for n in seen_b[1]):
        raise NotApplicable("weight_decay has no effect on the first step (not decoupled: clause 2), "
                            "so the order of decay and update cannot be seen")
    if forms["after"][0]:
        return ClauseFinding("fail", forms["before"][1], "decay is applied after the update (adds lr^2*wd*u). " + detail)
    fitted = _fitted_shrinks(seen_a, seen_b, info["tol"])
    for form in ("before", "after"):
        ok, dev, factors = fitted[form]
        if ok:
            factor_text = ", ".join(f"{n} {f:.6g}" for n, f in factors.items())
            note = (f"; the decay shrinks theta by {factor_text}, not by 1 - lr*wd = {1 - lr * wd:g} (the decay is scaled "
                    "by something else, a statistic of the moments, say: clause 2's finding)")
            if form == "before":
                return ClauseFinding("pass", dev, "decay acts on the pre-update value. " + detail + note)
            return ClauseFinding("fail", dev, "decay is applied after the update (adds lr^2*wd*u). " + detail + note)
    return ClauseFinding("fail", forms["before"][1], "the decayed step fits neither order (is the decay lr*wd*theta?). " + detail)
