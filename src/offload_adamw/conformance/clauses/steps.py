"""Clauses 4 to 7: which tensors and groups a step updates, and with what.

Per-tensor step counts (grad None leaves a tensor alone), an explicit zero gradient as an update, lr = 0,
parameter groups and changes of lr. Contract and method: the package's docstring
(:mod:`offload_adamw.conformance.clauses`), clauses 4 to 7; each is a pair of runs whose difference the
contract fixes exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from offload_adamw.conformance.clauses.common import EXACT, ClauseFinding, Context, _fmt, _series_compare, _tol, _wd
from offload_adamw.conformance.harness import (
    NotApplicable,
    compare,
    hyper,
    random_values,
)


def _step_count_run(ctx: Context, wd: float) -> tuple[list[str], float, bool, str]:
    """(problems, worst deviation, whether a tensor moved at a call where its grad was None, state step counts)."""
    h = ctx.harness
    shapes = {"always": (6,), "skipped_middle": (4,), "late_start": (5,)}
    theta0 = {n: random_values(30 + i, s, 0.5, 2.0) for i, (n, s) in enumerate(shapes.items())}
    full = [{n: random_values(300 + 10 * k + i, s, 0.1, 1.0) for i, (n, s) in enumerate(shapes.items())} for k in range(4)]
    grads = [{n: (full[k][n] if k in STEP_COUNT_PRESENT[n] else None) for n in shapes} for k in range(4)]
    values = hyper(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)

    params = h.params(theta0, ctx.dtype)
    opt = h.build(params, values)
    seen = h.run(opt, params, grads)
    tol = _tol(ctx, opt, params, steps=4)

    problems, worst, idle_moved = [], 0.0, False
    for name in shapes:
        present = STEP_COUNT_PRESENT[name]
        alone_params = h.params({name: theta0[name]}, ctx.dtype)
        alone = h.build(alone_params, values)
        alone_seen = h.run(alone, alone_params, [{name: full[k][name]} for k in present])
        j = 0
        for k in range(4):
            if k in present:
                expected, tol_k = alone_seen[j][name], tol
                j += 1
            else:  # no gradient: exactly what it was before this call (theta0 before its first gradient)
                expected, tol_k = (seen[k - 1][name] if k > 0 else theta0[name]), EXACT
            ok, dev = compare(seen[k][name], expected, tol_k)
            worst = max(worst, dev)
            if not ok:
                idle_moved |= k not in present
                kind = "updated although its grad was None" if k not in present else "differs from stepping it alone"
                problems.append(f"{name!r} at step call {k + 1}: {kind} (deviation {_fmt(dev)})")
    counts = []
    for name, p in params.items():
        step = opt.state.get(p, {}).get("step") if hasattr(opt, "state") else None
        if step is not None:
            counts.append(f"{name}: step {float(step):g} (expected {len(STEP_COUNT_PRESENT[name])})")
    return problems, worst, idle_moved, ", ".join(counts)


STEP_COUNT_PRESENT = {"always": (0, 1, 2, 3), "skipped_middle": (0, 3), "late_start": (2, 3)}


def clause_step_count(ctx: Context) -> ClauseFinding:
    wd = _wd(ctx, 0.1)
    problems, worst, idle_moved, counts = _step_count_run(ctx, wd)
    detail = ("4 step calls; 'skipped_middle' has grad None at calls 2-3, 'late_start' at calls 1-2; each compared with "
              "the same tensor stepped alone with only its real gradients")
    if counts:
        detail += "\nstate step counts: " + counts
    if problems and not idle_moved and wd:
        # Tensors without a gradient were left alone, yet the others differ from stepping them alone: where that
        # goes away without weight decay, the decay of one tensor depends on the others (a statistic taken over
        # every tensor, say): clause 2's finding, not the step count.
        quiet, _, _, _ = _step_count_run(ctx, 0.0)
        if not quiet:
            note = ("; with weight_decay 0 every tensor matches stepping it alone, and with weight_decay "
                    f"{wd} only the decay differs ({problems[0]}): the decay depends on other tensors, clause 2's finding")
            return ClauseFinding("pass", 0.0, "each tensor's t, m, v, theta advance only when it has a gradient. "
                                 + detail + note)
    if problems:
        return ClauseFinding(
            "fail",
            worst,
            "tensors without a gradient are not left alone, or their step count is not their own:\n"
            + "\n".join(problems)
            + "\n"
            + detail,
        )
    return ClauseFinding("pass", worst, "each tensor's t, m, v, theta advance only when it has a gradient. " + detail)


# ----------------------------------------------------------------------------- 5

def _tiny_and_eps(dtype: torch.dtype) -> tuple[float, float]:
    """A gradient that is not zero in the dtype yet changes nothing measurable, and an eps far above it.

    On a tensor whose moments are still zero the first update is g/(|g| + eps): the tiny
    gradient must be far below eps, or it moves theta by a full step. float16 has nothing
    below 2**-24, so its eps is raised to 1e-2.
    """
    return (2.0**-24, 1e-2) if dtype == torch.float16 else (1e-30, 1e-8)


def clause_zero_grad(ctx: Context) -> ClauseFinding:
    h = ctx.harness
    shapes = {"warm": (6,), "cold": (4,)}
    theta0 = {n: random_values(40 + i, s, 0.5, 2.0) for i, (n, s) in enumerate(shapes.items())}
    real = [{n: random_values(400 + 10 * k + i, s, 0.1, 1.0) for i, (n, s) in enumerate(shapes.items())} for k in range(4)]
    zero_at = {"warm": (1, 2), "cold": (0, 1)}  # 'cold' starts with zero gradients (no state yet)
    tiny, eps = _tiny_and_eps(ctx.dtype)
    note = ""
    if not h.mapping.accepts("eps"):
        # Without a known eps far above the tiny gradient, a tensor with empty moments may take a
        # full step on it (sign-based rules do); a warm tensor's moments dwarf it either way.
        shapes, note = {"warm": shapes["warm"]}, "; the candidate takes no eps, so only the 'warm' tensor is asked"
        theta0 = {"warm": theta0["warm"]}

    def history(filler: Callable[[Tensor], Tensor]) -> list[dict[str, Tensor]]:
        return [{n: (filler(real[k][n]) if k in zero_at[n] else real[k][n]) for n in shapes} for k in range(4)]

    values = hyper(lr=0.1, betas=(0.9, 0.999), eps=eps, weight_decay=_wd(ctx, 0.1))
    px, py, pz = h.params(theta0, ctx.dtype), h.params(theta0, ctx.dtype), h.params(theta0, ctx.dtype)
    opt_x, opt_y, opt_z = h.build(px, values), h.build(py, values), h.build(pz, values)
    seen_x = h.run(opt_x, px, history(torch.zeros_like))
    # A rule continuous at zero gives the zero-gradient result for a tiny gradient of either sign; a sign-based
    # one steps +lr and -lr on a cold state, whose midpoint is the zero-gradient result: the midpoint of the two
    # tiny runs is compared, and sign(0) = 0 against sign(tiny) = 1 is no finding.
    seen_y = h.run(opt_y, py, history(lambda g: torch.sign(g) * tiny))
    seen_z = h.run(opt_z, pz, history(lambda g: -torch.sign(g) * tiny))
    midpoint = [{n: (y[n] + z[n]) / 2 for n in y} for y, z in zip(seen_y, seen_z)]
    tol = _tol(ctx, opt_x, px, steps=4)
    ok, dev, where = _series_compare(seen_x, midpoint, tol)
    moved = not torch.equal(seen_x[1]["warm"], seen_x[0]["warm"])
    detail = (f"gradients exactly 0 vs. the midpoint of runs with +{tiny:g} and -{tiny:g} at the same steps ('warm' at "
              f"steps 2-3, 'cold' at steps 1-2, before any other gradient); theta moved at the first zero step: {moved}{note}")
    if ok:
        return ClauseFinding("pass", dev, "a zero gradient is an update (moments decay, t advances, theta moves). " + detail)
    return ClauseFinding("fail", dev, f"a zero gradient is treated differently from a tiny one, first at {where}: "
                   "zero gradients are skipped or special-cased. " + detail)


# ----------------------------------------------------------------------------- 6

def clause_lr_zero(ctx: Context) -> ClauseFinding:
    h = ctx.harness
    theta0 = {"w": random_values(50, (6,), 0.5, 2.0), "b": random_values(51, (3,), 0.5, 2.0)}
    grads = [{n: random_values(500 + 10 * k + i, t.shape, 0.1, 1.0) for i, (n, t) in enumerate(theta0.items())} for k in range(3)]
    eta = 0.1

    def trajectory(first_lr: float, *, built_with: float) -> tuple[list, Any, dict]:
        params = h.params(theta0, ctx.dtype)
        opt = h.build(params, hyper(lr=built_with, betas=(0.9, 0.999), eps=1e-8, weight_decay=_wd(ctx, 0.1)))
        h.set_lr(opt, first_lr)
        start = h.observe_all(opt, params)
        seen = h.run(opt, params, grads, before=lambda k: h.set_lr(opt, eta) if k == 1 else None)
        return [start] + seen, opt, params

    # Built with the real lr (a constructor may refuse lr = 0, or record its base lr), then lr is
    # set for the first step the way a warm-up schedule sets it.
    how = f"built with lr {eta}; step 1 with the group's lr set to 0 (vs. 1e-20)"
    seen_x, opt_x, px = trajectory(0.0, built_with=eta)
    seen_y, _, _ = trajectory(1e-20, built_with=eta)
    moved = not all(compare(seen_x[1][n], seen_x[0][n], EXACT)[0] for n in theta0)
    if moved and all(torch.equal(seen_x[1][n], seen_y[1][n]) for n in theta0):
        # lr 0 and lr 1e-20 took the same step: the lr written into the groups is not read (clause 7's
        # finding). Ask through the constructor instead.
        try:
            seen_x, opt_x, px = trajectory(0.0, built_with=0.0)
            seen_y, _, _ = trajectory(1e-20, built_with=1e-20)
        except Exception as exc:
            raise NotApplicable(f"the candidate does not read the lr written into its param groups (clause 7) and its "
                                f"constructor refuses lr = 0 ({type(exc).__name__}: {exc})") from None
        how = "the lr written into the groups is not read (clause 7), so built with lr 0 (vs. 1e-20)"
    unchanged, dev0 = True, 0.0
    for name in theta0:
        ok, dev = compare(seen_x[1][name], seen_x[0][name], EXACT)
        unchanged &= ok
        dev0 = max(dev0, dev)
    ok, dev, where = _series_compare(seen_x[2:], seen_y[2:], _tol(ctx, opt_x, px, steps=3))
    detail = (f"{how}, then lr {eta}; theta unchanged by "
              f"the lr=0 step: {unchanged} (deviation {_fmt(dev0)}); later steps vs. the lr=1e-20 run: {_fmt(dev)}")
    if not unchanged:
        return ClauseFinding("fail", max(dev0, dev), "lr = 0 still moves theta (decay or update not scaled by lr). " + detail)
    if not ok:
        return ClauseFinding("fail", dev, f"the lr=0 step did not count: its gradient is missing from the moments or t did not "
                       f"advance (first seen at {where}). " + detail)
    return ClauseFinding("pass", dev, "lr = 0 leaves theta alone while moments absorb the gradient and t advances. " + detail)


# ----------------------------------------------------------------------------- 7

def _group_problems(ctx: Context, wd: float) -> tuple[list[str], float, set[str]]:
    """Two groups in one optimizer vs. one optimizer per group: (problems, worst deviation, the tensors that differ)."""
    h = ctx.harness
    theta0 = {"decayed.weight": random_values(60, (6,), 0.5, 2.0), "no_decay.bias": random_values(61, (5,), 0.5, 2.0)}
    grads = [{n: random_values(600 + 10 * k + i, t.shape, 0.1, 1.0) for i, (n, t) in enumerate(theta0.items())} for k in range(3)]
    h0 = hyper(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    h1 = hyper(lr=0.02, betas=(0.8, 0.99), eps=1e-3, weight_decay=0.0)
    first, second = "decayed.weight", "no_decay.bias"

    params = h.params(theta0, ctx.dtype)
    opt = h.build({first: params[first]}, h0, groups=[({second: params[second]}, h1)])
    seen = h.run(opt, params, grads)
    tol = _tol(ctx, opt, params, steps=3)
    problems, worst, differ = [], 0.0, set()
    for name, values in ((first, h0), (second, h1)):
        alone_params = h.params({name: theta0[name]}, ctx.dtype)
        alone = h.build(alone_params, values)
        alone_seen = h.run(alone, alone_params, [{name: g[name]} for g in grads])
        ok, dev, where = _series_compare([{name: s[name]} for s in seen], alone_seen, tol)
        worst = max(worst, dev)
        if not ok:
            differ.add(name)
            problems.append(f"group with {name!r} differs from its own single-group optimizer at {where} (deviation {_fmt(dev)})")
    return problems, worst, differ


def clause_groups(ctx: Context) -> ClauseFinding:
    h = ctx.harness
    wd = _wd(ctx, 0.1)
    problems, worst, differ = _group_problems(ctx, wd)
    coupling_note = ""
    if differ == {"decayed.weight"} and wd:
        # The group without decay is stepped as on its own, and the decayed one differs: where that goes away
        # with weight_decay 0 in both, the decay depends on the other group's tensors (a statistic taken over
        # every tensor, say): clause 2's finding, not a hyperparameter that leaks between groups.
        if not _group_problems(ctx, 0.0)[0]:
            coupling_note = (f"; the decayed group differs from its own optimizer only through its decay ({problems[0]}), "
                             "and not at all with weight_decay 0 in both: the decay depends on the other group's tensors, "
                             "clause 2's finding")
            problems, worst = [], 0.0

    # The schedule: each lr change must take effect at the step it is made for. Two runs share
    # every step up to k and differ only in step k's lr (eta vs. f*eta): from the same state,
    # AdamW's displacement scales by f exactly (weight_decay 0). A rule that scales its step
    # otherwise (a trust ratio, an averaging weight) still changes with the lr; one that
    # reads the lr once, or a step late, does not change at all.
    eta = 0.1
    sched_theta = {"w": random_values(62, (6,), 0.5, 2.0)}
    sched_grads = [{"w": random_values(620 + k, (6,), 0.1, 1.0)} for k in range(4)]
    values = hyper(lr=eta, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    pa = h.params(sched_theta, ctx.dtype)
    opt_a = h.build(pa, values)
    seen_a = [h.observe_all(opt_a, pa)] + h.run(opt_a, pa, sched_grads)
    use_scheduler = isinstance(opt_a, torch.optim.Optimizer) and h.mapping.lr_key() == "lr"
    changes = [(1, 0.25), (2, 2.0), (3, 0.5)]  # (step index k, factor f)
    sched_tol = _tol(ctx, opt_a, pa, steps=4)
    ignored, proportional, sched_dev = [], True, 0.0
    for k, factor in changes:
        pb = h.params(sched_theta, ctx.dtype)
        opt_b = h.build(pb, values)
        scheduler = None
        if use_scheduler:

            def factor_at(epoch: int, k: int = k, f: float = factor) -> float:
                return f if epoch == k else 1.0

            scheduler = torch.optim.lr_scheduler.LambdaLR(opt_b, lr_lambda=factor_at)
        for j in range(k + 1):
            if not use_scheduler:
                h.set_lr(opt_b, eta * (factor if j == k else 1.0))
            h.step(opt_b, pb, sched_grads[j])
            if scheduler is not None and j < k:
                scheduler.step()
        after = h.observe(opt_b, pb["w"])
        step_a = seen_a[k + 1]["w"] - seen_a[k]["w"]
        if compare(after, seen_a[k + 1]["w"], EXACT)[0]:
            ignored.append(f"x{factor} at step {k + 1}")
        ok, dev = compare(after, seen_a[k]["w"] + factor * step_a, sched_tol)
        proportional &= ok
        sched_dev = max(sched_dev, dev)
    how = "torch.optim.lr_scheduler.LambdaLR" if use_scheduler else f"writing param_groups[0][{h.mapping.lr_key()!r}]"
    schedule_note = ""
    if ignored:
        worst = max(worst, sched_dev)
        problems.append(f"an lr change made by {how} has no effect on the step it is made for: {', '.join(ignored)}")
    elif not proportional:
        schedule_note = (f"; each lr change takes effect at its step, but the step does not scale with lr alone "
                         f"(deviation {_fmt(sched_dev)} from f times the constant-lr step: the rule scales its step otherwise)")
    else:
        worst = max(worst, sched_dev)
    detail = (f"two groups (lr 0.1/0.02, betas (0.9, 0.999)/(0.8, 0.99), eps 1e-8/1e-3, weight_decay {wd}/0) "
              f"vs. one optimizer per group; lr x0.25, x2, x0.5 at steps 2, 3, 4 by {how}, each from the state of a "
              f"constant-lr run" + schedule_note + coupling_note)
    if problems:
        return ClauseFinding("fail", worst, "\n".join(problems) + "\n" + detail)
    return ClauseFinding("pass", worst, "each group keeps its own hyperparameters and lr changes take effect. " + detail)
