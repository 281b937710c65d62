"""The fifteen clauses of the conformance checker, one function each.

Contract: every clause function takes a :class:`Context` and returns a
:class:`ClauseFinding` (verdict, deviation, detail); it raises
:class:`~offload_adamw.conformance.harness.NotApplicable` when the question cannot be
asked of the candidate, and lets any other exception of the candidate escape (the
caller turns it into a failed clause that shows the error).

How the clauses isolate one property each. Clause 1 compares the candidate with
:mod:`offload_adamw.reference` step by step (float64 reference; the candidate in
float64 where it accepts float64 parameters, and in the checked dtype), with the
tolerance of the arithmetic the candidate computes in: the narrowest of the observed
value and the parameter-sized state, or, where that fails, a narrower arithmetic that its
own run in that dtype shows (:class:`_UpdateRuns`; float32 moments on float64 parameters,
or a cast to float32 inside the step, round as float32 does: clause 8's finding, not a
wrong formula; bfloat16 and float16, whose tolerances are loose, need theta to hold their
values or the run to be ten times closer to the candidate's own run than to the
reference). Its inputs make the usual departures visible: eps comparable with
sqrt(v_hat), shrinking gradients (amsgrad), and gradients orthogonal to one weight
(projections). A candidate without eps is compared with the reference for every eps in
:data:`OWN_EPS_BAND`. Every other property is checked *metamorphically*: the candidate is
run twice under a change whose effect the contract fixes exactly, and the two runs are
compared with each other. A wrong update formula then fails clause 1 only, instead of
failing every clause that happens to take a step. The pairs:

2. weight_decay 0 vs. weight_decay > 0 on the same gradients: with decoupled decay the
   update direction is the same, so theta_B(k) = s*theta_B(k-1) - (theta_A(k-1) - theta_A(k))
   with s = 1 - lr*wd (or s*(theta_B(k-1) - ...) when the decay comes after the update;
   that ordering is clause 3's business). lr*wd is 0.5, so that a decay factor off by a
   few per cent shows even on a bfloat16 parameter. Where the step itself depends on
   theta (a trust ratio: doubling theta changes the weight_decay-0 step), later steps
   differ whatever the decay is, and one step from a fresh state is judged instead: the
   decayed step must be s*theta0 minus the weight_decay-0 step from theta0 or from
   s*theta0, or s times that step's result (a decay multiplied by the trust ratio fits none).
3. The same pair for one step, with gradients of the sign of theta and a tiny eps: then
   L2 coupling cannot change the first update (it is sign(g) either way), and only the
   place of the decay decides between s*theta0 - u and s*(theta0 - u) (one-step forms as
   in clause 2 where the step depends on theta). Where neither fits with s = 1 - lr*wd, a
   shrink factor fitted per tensor decides the order (a decay scaled by a statistic of v
   is clause 2's finding, its order still this clause's).
4. Tensors with grad None at some step calls vs. the same tensors stepped alone with only
   their real gradients. Where tensors without a gradient were left alone and the
   difference goes away with weight_decay 0, the decay couples the tensors: clause 2's.
5. Explicit zero gradients vs. the midpoint of runs with gradients of +1e-30 and -1e-30
   (the contract is continuous there; a sign-based rule steps +lr and -lr on a cold state,
   whose midpoint is the zero-gradient step; float16 uses 2**-24 and eps 1e-2, so that the
   tiny gradient stays far below eps). Without an eps argument only a tensor with warm
   moments is asked.
6. lr = 0 vs. lr = 1e-20 for one step, written into the groups of optimizers built with
   the real lr (a constructor may refuse lr = 0 or record its base lr), then the same lr
   for both; through the constructor only where the groups' lr is not read.
7. Two parameter groups vs. two optimizers with one group each; and lr changes: runs that
   share every step up to k and differ only in step k's lr, so the step must scale exactly
   (or at least change, where the rule scales its step otherwise, which is reported).
   Where only the decayed group differs and not with weight_decay 0 in both, the decay
   couples the groups: clause 2's.
8. Each parameter dtype vs. the same candidate in the widest dtype it takes, over 1051
   steps on 4096 elements (a bf16 parameter must be the rounded copy of a float32
   computation), plus the state dtypes (read inside nested containers), the arithmetic of the
   widest run (clause 1's judgement where it ends beyond its tolerance from the reference)
   and how the master is narrowed: a visible master against its parameter, a hidden one
   through the parameter against the candidate's own float32 run (truncation and
   stochastic rounding differ from round-to-nearest-even in a tenth of the elements or
   more; another order of operations only near ties); the distance of each run to the
   reference is reported as well.
10. Save at step 3 (through torch.save/torch.load), load into a fresh instance over
    fresh parameters, continue: bitwise equal to the uninterrupted run, state dtypes kept.
    torch's global RNG is restored to its state at the save before the resumed run (as a
    checkpoint that saves it), and a candidate that draws from it is told so.
11. Load the same checkpoint (a fresh copy for each load) into an optimizer built over the
    parameters in another order, and into one built in the saved order: same continuation
    per name, or an error. The saved moments are of opposite signs and the later
    gradients a thousand times smaller, so that a swap shows at any momentum.
13. A step with an inf/NaN gradient vs. a run that never saw it (skip), whether it
    raises, whether theta turns non-finite (propagate).
14. torch.amp.GradScaler with an overflow at step 2 vs. a run without step 2.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from offload_adamw.conformance.harness import (
    Harness,
    NotApplicable,
    Tolerance,
    as_reference,
    compare,
    compare_band,
    dtype_bits,
    hyper,
    load_bytes,
    moment_dtypes,
    random_values,
    save_bytes,
    snap,
    state_dtypes,
    tolerance_for,
)
from offload_adamw.contract import reference
from offload_adamw.contract.rules import NONFINITE_POLICIES

__all__ = ["Context", "ClauseFinding", "Clause", "CLAUSES", "NONFINITE_POLICIES", "REFERENCE_CLAUSES", "prepare_references",
           "install_references"]

EXACT = Tolerance(0.0, 0.0)


@dataclass(kw_only=True)
class Context:
    """What every clause needs: the harness over the candidate and the run's settings."""

    harness: Harness
    """Builds, steps and observes the candidate's optimizers."""
    dtype: torch.dtype
    """Parameter dtype of the checked run."""
    nonfinite_policy: str | None = None
    """Declared non-finite policy (overrides what the candidate advertises)."""


@dataclass(frozen=True)
class ClauseFinding:
    verdict: str
    deviation: float | None
    detail: str


@dataclass(frozen=True)
class Clause:
    number: int
    name: str
    consequence: str
    run: Callable[[Context], ClauseFinding]
    long: bool = False
    """Takes much longer than the others (started first, so that they run beside it)."""
    alone: bool = False
    """A timing: runs when no other clause runs."""


_REFERENCES: dict[tuple[Any, ...], Any] = {}
"""Reference trajectories and long-horizon data by key, computed once per process (or installed)."""


def _referenced(key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
    if key not in _REFERENCES:
        _REFERENCES[key] = compute()
    return _REFERENCES[key]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _wd(ctx: Context, value: float) -> float:
    """``value`` when the candidate takes a weight decay, else 0."""
    return value if ctx.harness.mapping.accepts("weight_decay") else 0.0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _tol(ctx: Context, opt: Any, params: Mapping[str, Tensor], steps: int = 1) -> Tolerance:
    return tolerance_for(ctx.harness.observed_dtype(opt, params), steps=steps)


ARITHMETICS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
"""Arithmetics from the tightest tolerance to the loosest (float16 keeps more digits than bfloat16)."""


def _series_compare(
    actual: list[dict[str, Tensor]], expected: list[dict[str, Tensor]], tol: Tolerance,
    upper: list[dict[str, Tensor]] | None = None,
) -> tuple[bool, float, str]:
    """Compare two observation series; (ok, worst deviation, where the first mismatch is). With ``upper``, each
    value is compared with the interval between ``expected`` and ``upper`` (:func:`compare_band`)."""
    ok_all, worst, where = True, 0.0, ""
    for k, (a, e) in enumerate(zip(actual, expected)):
        for name in e:
            ok, dev = compare(a[name], e[name], tol) if upper is None else compare_band(a[name], e[name], upper[k][name], tol)
            worst = max(worst, dev)
            if not ok and ok_all:
                ok_all, where = False, f"{name!r} after step {k + 1}"
    return ok_all, worst, where


# ----------------------------------------------------------------------------- 1

def _reference_series(
    theta0: Mapping[str, Tensor], grads: list[dict[str, Tensor]], values: Mapping[str, Any]
) -> list[dict[str, Tensor]]:
    hp = as_reference(values)
    states = {n: reference.init_state(tuple(t.flatten().tolist()), amsgrad=hp.amsgrad) for n, t in theta0.items()}
    out = []
    for g in grads:
        states = {n: reference.adamw_step(s, tuple(g[n].flatten().tolist()), hp) for n, s in states.items()}
        out.append({n: torch.tensor(s.theta, dtype=torch.float64).reshape(theta0[n].shape) for n, s in states.items()})
    return out


UPDATE_VARIANTS = ("plain", "amsgrad", "maximize")


def _orthogonal_to(theta: Tensor, raw: Tensor) -> Tensor:
    """``raw`` with its component along each row of ``theta`` (and so along the whole tensor) removed, snapped."""
    rows, raw_rows = theta.reshape(theta.shape[0], -1), raw.reshape(theta.shape[0], -1)
    along = (raw_rows * rows).sum(dim=1, keepdim=True) / (rows * rows).sum(dim=1, keepdim=True)
    return snap((raw_rows - along * rows).reshape(theta.shape))


def _update_problem() -> tuple[dict[str, Tensor], list[dict[str, Tensor]], dict[str, dict[str, Any]]]:
    shapes = {"layer.weight": (4, 3), "layer.bias": (5,), "proj.weight": (4, 4)}
    theta0 = {n: random_values(10 + i, s, 0.5, 2.0) for i, (n, s) in enumerate(shapes.items())}
    # Gradient scales alternate so that v also shrinks (amsgrad differs from plain Adam),
    # and eps is comparable with sqrt(v_hat) so that where eps sits changes the update.
    scales = [1.0, 0.1, 1.0, 0.05, 0.5, 0.1]
    grads = []
    for k, c in enumerate(scales):
        g = {n: snap(random_values(100 + 10 * k + i, s, 0.05, 1.0) * c) for i, (n, s) in enumerate(shapes.items())}
        # Gradients (nearly) orthogonal to the weights, per row and as a whole: where an optimizer
        # projects such gradients (AdamP and its kin) its update is not AdamW's; random ones never are.
        g["proj.weight"] = _orthogonal_to(theta0["proj.weight"], g["proj.weight"])
        grads.append(g)
    base = hyper(lr=0.05, betas=(0.9, 0.999), eps=1e-2, weight_decay=0.0)
    # amsgrad with beta2 = 0.5: v halves when the gradient shrinks, so max(v) and v differ by far.
    variants = {"plain": base, "amsgrad": {**base, "betas": (0.9, 0.5), "amsgrad": True}, "maximize": {**base, "maximize": True}}
    return theta0, grads, variants


OWN_EPS_BAND = (1e-30, 1e-6)
"""A candidate that takes no eps argument (mapped to null) is compared with the reference for every eps in this range."""


def _update_key(label: str, eps: float | None) -> tuple[Any, ...]:
    return ("update", label, eps)


def _update_reference(label: str, eps: float | None = None) -> list[dict[str, Tensor]]:
    """The reference trajectory of one variant (with ``eps`` in place of the problem's, where given)."""
    def compute() -> list[dict[str, Tensor]]:
        theta0, grads, variants = _update_problem()
        values = variants[label] if eps is None else {**variants[label], "eps": eps}
        return _reference_series(theta0, grads, values)

    return cast(list[dict[str, Tensor]], _referenced(_update_key(label, eps), compute))


def _narrower(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The arithmetics whose tolerance is looser than ``dtype``'s, tightest first."""
    return ARITHMETICS[ARITHMETICS.index(dtype) + 1:] if dtype in ARITHMETICS else ()


Judgement = tuple[bool, bool, float, float, str]
"""(step 1 within tolerance, steps 2-6 within tolerance, their deviations, where the first mismatch is)."""


class _UpdateRuns:
    """The candidate on clause 1's problem, one run per (parameter dtype, variant), judged against the reference.

    The formula is judged at the precision the candidate computes in. Where its state's precision fails, a
    narrower arithmetic explains a run when the candidate's own run in that dtype (state and theta kept in it)
    gives the same values to that precision and follows the reference there: a cast inside its step, which is
    clause 8's finding. A wrong formula fails in every arithmetic."""

    def __init__(self, ctx: Context):
        self.h = ctx.harness
        self.own_eps = not self.h.mapping.accepts("eps")
        self.theta0, self.grads, self.variants = _update_problem()
        self.runs: dict[tuple[torch.dtype, str], tuple[list[dict[str, Tensor]], torch.dtype] | None] = {}

    def run(self, dtype: torch.dtype, label: str) -> tuple[list[dict[str, Tensor]], torch.dtype] | None:
        """(observations, the dtype its state and theta are kept in); None where it refuses (raises) the run."""
        if (dtype, label) not in self.runs:
            try:
                self.runs[dtype, label] = self.start(dtype, label)
            except NotApplicable:
                raise
            except Exception:
                self.runs[dtype, label] = None
        return self.runs[dtype, label]

    def start(self, dtype: torch.dtype, label: str) -> tuple[list[dict[str, Tensor]], torch.dtype]:
        params = self.h.params(self.theta0, dtype)
        opt = self.h.build(params, self.variants[label])
        self.runs[dtype, label] = result = (self.h.run(opt, params, self.grads), self.h.observed_dtype(opt, params))
        return result

    def judge(self, seen: list[dict[str, Tensor]], label: str, arithmetic: torch.dtype) -> Judgement:
        tol = tolerance_for(arithmetic, steps=len(self.grads))
        if self.own_eps:  # the candidate's own eps: anywhere in OWN_EPS_BAND
            expected, upper = _update_reference(label, OWN_EPS_BAND[0]), _update_reference(label, OWN_EPS_BAND[1])
        else:
            expected, upper = _update_reference(label), None
        first_ok, first_dev, _ = _series_compare(seen[:1], expected[:1], tol, upper[:1] if upper else None)
        later_ok, later_dev, where = _series_compare(seen[1:], expected[1:], tol, upper[1:] if upper else None)
        return first_ok, later_ok, first_dev, later_dev, where

    def arithmetic(self, dtype: torch.dtype, label: str) -> tuple[torch.dtype, Judgement] | None:
        """The arithmetic that explains the (dtype, label) run and its judgement there; the state's dtype with
        a failed judgement where none does; None where the candidate refuses the run."""
        done = self.run(dtype, label)
        if done is None:
            return None
        seen, state_dtype = done
        judged = self.judge(seen, label, state_dtype)
        if judged[0] and judged[1]:
            return state_dtype, judged
        for narrow in _narrower(state_dtype):
            own = self.run(narrow, label)
            if own is None or own[1] != narrow:
                continue
            narrowed = self.judge(seen, label, narrow)
            own_judged = self.judge(own[0], label, narrow)
            if not (narrowed[0] and narrowed[1] and own_judged[0] and own_judged[1]):
                continue
            if narrow == torch.float32 or self.computed_in(seen, own[0], label, narrow):
                return narrow, narrowed
        return state_dtype, judged

    def computed_in(self, seen: list[dict[str, Tensor]], own: list[dict[str, Tensor]], label: str,
                    narrow: torch.dtype) -> bool:
        """Whether a run shows that it was computed in ``narrow``: theta holds ``narrow`` values after every step,
        or the run is far closer to the candidate's own ``narrow`` run than to the reference.

        float32's tolerance is far below the departures clause 1's inputs give a wrong formula, so a run within
        it needs no more; bfloat16's and float16's are not, so a formula off by a per cent must not pass there
        without this evidence."""
        held = all(torch.equal(t, t.to(narrow).to(t.dtype)) for step in seen for t in step.values())
        if held:
            return True
        to_own = max(compare(a[n], b[n], EXACT)[1] for a, b in zip(seen, own) for n in a)
        to_reference = max(compare(a[n], b[n], EXACT)[1] for a, b in zip(seen, _update_reference(label)) for n in a)
        return to_own * 10 <= to_reference


def clause_update(ctx: Context) -> ClauseFinding:
    h = ctx.harness
    if not h.mapping.accepts("betas"):
        raise NotApplicable("the candidate takes no betas (mapped to null): its update cannot be compared with "
                            "AdamW's, whose rule has them")
    # Without an eps argument the candidate uses its own: it is compared with the reference for every eps
    # in OWN_EPS_BAND, on gradients far above it; where eps goes cannot be seen then.
    updates = _UpdateRuns(ctx)
    dtypes = [torch.float64] + ([ctx.dtype] if ctx.dtype != torch.float64 else [])
    steps = len(updates.grads)

    lines, failed, worst, hints, asked, narrowed = [], [], 0.0, [], 0, []
    for dtype in dtypes:
        for label, values in updates.variants.items():
            what = f"{_dtype_name(dtype)} {label}"
            try:
                seen, state_dtype = updates.start(dtype, label)
            except NotApplicable as exc:
                lines.append(f"{what}: not asked ({exc})")
                continue
            except Exception as exc:  # the candidate does not take this dtype or flag
                if dtype == ctx.dtype and label == "plain":
                    raise
                lines.append(f"{what}: not run, the candidate refused it ({type(exc).__name__}: {exc})")
                continue
            asked += 1
            explained = updates.arithmetic(dtype, label)
            assert explained is not None  # the run above succeeded
            arithmetic, (first_ok, later_ok, first_dev, later_dev, where) = explained
            tol = tolerance_for(arithmetic, steps=steps)
            worst = max(worst, first_dev, later_dev)
            status = "ok" if first_ok and later_ok else "WRONG"
            if arithmetic == state_dtype:
                precision = f"{_dtype_name(arithmetic)} arithmetic as the candidate's state"
            else:
                precision = (f"{_dtype_name(arithmetic)} arithmetic, narrower than the candidate's {_dtype_name(state_dtype)} "
                             f"state: it gives its own {_dtype_name(arithmetic)} run's values; clause 8's finding")
                narrowed.append(f"{what} in {_dtype_name(arithmetic)}")
            lines.append(f"{what}: step 1 deviation {_fmt(first_dev)}, steps 2-{steps} {_fmt(later_dev)} "
                         f"(tolerance rtol {tol.rtol:.1e}, atol {tol.atol:.1e}, {precision}): {status}")
            if not first_ok:
                failed.append(f"{what} step 1")
            elif not later_ok:
                failed.append(f"{what} at {where}")
            if status == "WRONG" and label in ("amsgrad", "maximize"):
                # A constructor that swallows unknown keywords (**kwargs) takes the flag and ignores it.
                off_params = h.params(updates.theta0, dtype)
                off = h.build(off_params, {**values, label: False})
                if all(torch.equal(a[n], b[n]) for a, b in zip(seen, h.run(off, off_params, updates.grads)) for n in a):
                    hints.append(f"{what}: the candidate accepted {label}=True and behaved exactly as with {label}=False: "
                                 f"does its constructor swallow unknown keywords? If it has no {label}, pass "
                                 f"--map '{{\"{label}\": null}}'")
    if not asked:
        raise NotApplicable("no variant of the update could be asked: " + "; ".join(lines))
    band = f"{OWN_EPS_BAND[0]:g} to {OWN_EPS_BAND[1]:g}"
    if failed:
        head = (f"theta differs from the float64 reference for every eps from {band} (the candidate takes no eps argument, "
                "so its own is used): " if updates.own_eps else "theta differs from the float64 reference: ") + "; ".join(failed)
        return ClauseFinding("fail", worst, head + "\n" + "\n".join(hints + lines))
    notes = []
    if narrowed:
        notes.append("the formula holds in a narrower arithmetic than the state: " + "; ".join(narrowed)
                     + " (the precision is clause 8's finding)")
    if updates.own_eps:
        head = (f"the candidate takes no eps (mapped to null): theta follows the reference for an eps between {band} on "
                "gradients far above it, but where eps goes (outside the root, moved with the bias correction) cannot be "
                "checked without an eps argument; map 'eps' to the candidate's name for it to be checked")
        return ClauseFinding("n/a", worst, head + "\n" + "\n".join(notes + lines))
    head = "theta follows the reference on step 1 and later steps"
    return ClauseFinding("pass", worst, head + "\n" + "\n".join(notes + lines))


# ----------------------------------------------------------------------------- 2 and 3

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


# ----------------------------------------------------------------------------- 4

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


# ----------------------------------------------------------------------------- 8

LONG_ZERO_STEPS = 1000
LONG_TAIL_STEPS = 50


PARTS = ("decay_only", "second_moment", "small_updates", "steady")
PART_SIZE = 8
# 4096 elements: low-bit (8-bit, 4-bit, fp8) optimizer states quantize only tensors of at least
# this size and keep smaller ones in float32. The 32 distinct trajectories are tiled 128 times
# (an elementwise rule gives every copy the same values; the reference is computed once per value).
LONG_SHAPE = (64, 64)
TILES = LONG_SHAPE[0] * LONG_SHAPE[1] // (len(PARTS) * PART_SIZE)


def _long_data_key(wd: float) -> tuple[Any, ...]:
    return ("long-data", wd)


def _long_key(wd: float) -> tuple[Any, ...]:
    return ("long", wd)


def _long_horizon_unique(wd: float) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """32 element trajectories in four parts of 8: theta0 (32,), the gradients (steps, 32), the hyperparameters."""
    def compute() -> tuple[Tensor, Tensor, dict[str, Any]]:
        theta0 = torch.cat([random_values(80, (PART_SIZE,), 0.5, 2.0),     # decay_only
                            random_values(81, (PART_SIZE,), 0.5, 2.0),     # second_moment
                            random_values(82, (PART_SIZE,), 8.0, 16.0),    # small_updates: |theta| 8-16
                            random_values(86, (PART_SIZE,), 0.5, 2.0)])    # steady: ordinary gradients throughout
        first = random_values(83, (PART_SIZE,), 0.5, 1.0)
        tail = random_values(84, (PART_SIZE,), 0.005, 0.01)
        steady = random_values(85, (PART_SIZE,), 0.5, 1.0)
        cycle = [random_values(8700 + j, (PART_SIZE,), 0.1, 1.0) for j in range(7)]
        zeros = torch.zeros(PART_SIZE, dtype=torch.float64)
        grads = []
        for k in range(1 + LONG_ZERO_STEPS + LONG_TAIL_STEPS):
            # decay_only: explicit zeros, only weight decay moves theta; second_moment: one gradient,
            # 1000 zeros (v must decay), then small ones; small_updates: lr*u ~ 1e-2, below half a bf16 ulp.
            second = first if k == 0 else (zeros if k <= LONG_ZERO_STEPS else tail)
            grads.append(torch.cat([zeros, second, steady, cycle[k % 7]]))
        return theta0, torch.stack(grads), hyper(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)

    return cast(tuple[Tensor, Tensor, dict[str, Any]], _referenced(_long_data_key(wd), compute))


def _tile(t: Tensor) -> Tensor:
    return t.repeat(TILES).reshape(LONG_SHAPE)


def _parts(t: Tensor) -> dict[str, Tensor]:
    flat = t.reshape(TILES, len(PARTS) * PART_SIZE)
    return {name: flat[:, i * PART_SIZE:(i + 1) * PART_SIZE] for i, name in enumerate(PARTS)}


def _long_horizon_reference(wd: float) -> Tensor:
    def compute() -> Tensor:
        theta0, grads, values = _long_horizon_unique(wd)
        hp = as_reference(values)
        state = reference.init_state(tuple(theta0.tolist()))
        for g in grads.tolist():
            state = reference.adamw_step(state, tuple(g), hp)
        return _tile(torch.tensor(state.theta, dtype=torch.float64))

    return cast(Tensor, _referenced(_long_key(wd), compute))


def _ulp(x: Tensor, dtype: torch.dtype) -> Tensor:
    info = torch.finfo(dtype)
    mag = torch.clamp(x.abs(), min=info.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


def _truncated(master: Tensor, dtype: torch.dtype) -> Tensor:
    """``master`` narrowed to ``dtype`` by rounding toward zero (to tell that rounding apart in the report)."""
    nearest = master.to(dtype)
    wide = nearest.to(master.dtype)
    toward_zero = torch.nextafter(nearest, torch.zeros_like(nearest))
    return torch.where(wide.abs() > master.abs(), toward_zero, nearest)


LONG_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

NEAR_TIE_FRACTION = 0.1
"""Below this fraction of elements, a low-precision parameter that differs from the round-to-nearest-even copy of
the candidate's float32 run is put down to ties met by another order of operations, not to another rounding."""


def _required_state(dtype: torch.dtype) -> torch.dtype:
    """What the contract asks of m, v and the master for a parameter of ``dtype``: float32, or as wide as the parameter."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rounding_of(raw: Tensor, wide: Tensor, dtype: torch.dtype) -> str | None:
    """How a ``dtype`` parameter was narrowed from a computation that gives ``wide``; None where it is the
    round-to-nearest-even copy (up to a few elements near a tie)."""
    nearest = wide.to(dtype).to(torch.float64)
    off = raw != nearest
    count = int(off.sum())
    if count < NEAR_TIE_FRACTION * raw.numel():
        return None
    toward_zero = off & (raw.abs() < nearest.abs())
    if torch.equal(raw, _truncated(wide, dtype).to(torch.float64)) or bool(toward_zero[off].all()):
        how = "every one of them one step toward zero: truncated toward zero"
    else:
        away = int((off & ~toward_zero).sum())
        how = f"{count - away} one step toward zero, {away} away from it: stochastic or another rounding"
    return f"{count} of {raw.numel()} elements differ ({how})"


def _long_runs(ctx: Context, theta_u: Tensor, grads_u: Tensor,
               values: Mapping[str, Any]) -> tuple[dict[torch.dtype, tuple[Any, Tensor, Tensor]], list[str]]:
    """The long horizon in every parameter dtype the candidate takes: {dtype: (optimizer, parameter, observed)}
    and the refused dtypes.

    One optimizer per dtype: in one optimizer over all four, a rule that couples tensors (a statistic over every
    tensor, a global norm) would carry one dtype's overflow or rounding into the others. The gradients are
    shared: each distinct one is laid out once per dtype and copied at each step."""
    h = ctx.harness
    unique, index = torch.unique(grads_u, dim=0, return_inverse=True)
    order = index.tolist()
    theta0 = _tile(theta_u)
    runs: dict[torch.dtype, tuple[Any, Tensor, Tensor]] = {}
    refused = []
    for dtype in LONG_DTYPES:
        try:
            params = h.params({"w": theta0}, dtype)
            p = params["w"]
            opt = h.build(params, values)
            rows = [_tile(row).to(h.device, dtype) for row in unique]
            for k in order:
                p.grad = rows[k].clone()  # a copy each step: some optimizers modify the gradient in place
                opt.step()
            runs[dtype] = (opt, p, h.observe(opt, p))
        except NotApplicable:
            raise
        except Exception as exc:
            if dtype == ctx.dtype:
                raise
            refused.append(f"{_dtype_name(dtype)} ({type(exc).__name__})")
    return runs, refused


def clause_precision(ctx: Context) -> ClauseFinding:
    h = ctx.harness
    wd = _wd(ctx, 0.1)
    theta_u, grads_u, values = _long_horizon_unique(wd)
    steps = grads_u.shape[0]
    ref = _long_horizon_reference(wd)
    runs, refused = _long_runs(ctx, theta_u, grads_u, values)

    lines = [f"one {LONG_SHAPE[0]}x{LONG_SHAPE[1]} tensor per parameter dtype, {steps} steps (lr 1e-2, weight_decay {wd}): "
             f"'decay_only' gets zero gradients throughout, 'second_moment' one gradient, {LONG_ZERO_STEPS} zeros, then "
             f"small ones, 'small_updates' |theta| 8-16 with updates ~1e-2, 'steady' ordinary gradients; each parameter "
             f"dtype is compared with the candidate's own run in the widest dtype it takes (so a formula error cancels out: "
             f"that is clause 1's finding)"]
    if refused:
        lines.append("not asked, the candidate refused these parameter dtypes: " + ", ".join(refused))
    base_dtype = next((d for d in LONG_DTYPES if d in runs), None)
    if base_dtype is None:
        raise NotApplicable("the candidate took none of float64, float32, bfloat16, float16")
    base = runs[base_dtype][2]
    # What a master of a low-precision parameter would hold: the candidate's own float32 computation.
    float32_run = runs[torch.float32][2] if torch.float32 in runs else base

    problems: list[str] = []
    worst = 0.0
    for dtype, (opt, p, seen) in runs.items():
        label = _dtype_name(dtype)
        findings = []
        state = moment_dtypes(opt, p)
        required = _required_state(dtype)
        narrow = {k: d for k, d in state.items() if dtype_bits(d) < dtype_bits(required)}
        master = h.master(opt, p)
        raw = p.detach().to("cpu", torch.float64)
        if dtype == base_dtype:
            # Nothing wider to compare with: the distance to the reference shows what narrow state or
            # narrow arithmetic costs; beyond every arithmetic's tolerance it is a formula (clause 1's).
            ok, dev = compare(seen, ref, tolerance_for(required, steps=steps))
            if not ok and not narrow:
                # The long horizon cannot tell narrow arithmetic from a small formula error; clause 1's problem
                # can (its inputs make formula errors large): the same judgement decides here.
                explained = _UpdateRuns(ctx).arithmetic(dtype, "plain")
                arithmetic = explained[0] if explained is not None and explained[1][0] and explained[1][1] else None
                if arithmetic is not None and dtype_bits(arithmetic) < dtype_bits(required):
                    findings.append(f"computed in {_dtype_name(arithmetic)} arithmetic although its state is "
                                    f"{_dtype_name(required)}: the run ends {_fmt(dev)} from the reference, and on "
                                    f"clause 1's problem it gives the candidate's own {_dtype_name(arithmetic)} run's values")
                else:
                    lines.append(f"{label}: the run ends {_fmt(dev)} from the reference, and no narrower arithmetic "
                                 "explains it: the update rule differs (clause 1's finding), not its precision")
            if not narrow and ok:
                dev = 0.0  # within the tolerance of the arithmetic the contract asks for: nothing lost
            ok = True
        elif master is not None or dtype in (torch.float32, torch.float64):
            ok, dev = compare(seen, base, tolerance_for(torch.float32, steps=steps))
        else:  # only the rounded parameter is visible: within one ulp of the rounded wide result
            expected = base.to(dtype).to(torch.float64)
            diff = torch.nan_to_num((raw - expected).abs(), nan=math.inf)
            ok = bool((diff <= 1.01 * _ulp(expected, dtype) + 1e-5 * expected.abs()).all())
            dev = compare(raw, expected, EXACT)[1]
            rounding = _rounding_of(raw, float32_run, dtype) if ok else None
            if rounding is not None:
                findings.append("the parameter is not the round-to-nearest-even copy of the candidate's float32 run "
                                f"(where its master, if it keeps one unseen, would be): {rounding}")
                dev = max(dev, 1e-3)
        if narrow:
            findings.append(f"state narrower than {_dtype_name(required)}: "
                            + ", ".join(f"{k} {_dtype_name(d)}" for k, d in narrow.items())
                            + (f" (the run ends {_fmt(dev)} from the reference)" if dtype == base_dtype else ""))
        if not ok:
            part_dev = {n: compare(a, b, EXACT)[1] for (n, a), b in zip(_parts(seen if master is not None else raw).items(),
                                                                    _parts(base).values())}
            findings.append(f"ends {_fmt(dev)} away from the {_dtype_name(base_dtype)} run ("
                            + ", ".join(f"{n} {_fmt(d)}" for n, d in part_dev.items()) + ")")
        if master is not None and p.dtype != master.dtype:
            nearest = master.detach().to("cpu").to(p.dtype)
            if not torch.equal(p.detach().cpu(), nearest):
                differ = int((p.detach().cpu() != nearest).sum())
                dev = max(dev, compare(raw, nearest.to(torch.float64), EXACT)[1])
                truncated = torch.equal(p.detach().cpu(), _truncated(master.detach().cpu(), p.dtype))
                how = "it is the master truncated toward zero" if truncated else "another rounding"
                findings.append(f"the parameter is not the round-to-nearest-even copy of its master: {differ} of "
                                f"{p.numel()} elements differ ({how})")
        if findings:
            worst = max(worst, dev)
        elif dtype != base_dtype:
            worst = max(worst, dev)
        kinds = ", ".join(f"{k} {_dtype_name(d)}" for k, d in state.items()) or "none found"
        lines.append(f"{label}: vs. {_dtype_name(base_dtype)} run {_fmt(dev)}, "
                     f"vs. reference {_fmt(compare(seen, ref, EXACT)[1])}; "
                     f"state {kinds}; master copy: {'yes' if master is not None else 'no'}")
        problems.extend(f"{label} parameters: {f}" for f in findings)
    if problems:
        return ClauseFinding("fail", worst, "the state or the parameter is kept below the contract's precision:\n"
                       + "\n".join(problems) + "\n" + "\n".join(lines))
    return ClauseFinding("pass", worst, "every parameter dtype ends where the widest run does (up to the final rounding), "
                         "with float32 (or wider) state.\n" + "\n".join(lines))


# ----------------------------------------------------------------------------- 9

def clause_placement(ctx: Context) -> ClauseFinding:
    if not torch.cuda.is_available():
        raise NotApplicable("no accelerator: every tensor is in host memory")
    h = ctx.harness
    theta0 = {"w": random_values(90, (64,), 0.5, 2.0)}
    params = h.params(theta0, ctx.dtype, device=torch.device("cuda"))
    opt = h.build(params, hyper(lr=1e-3, weight_decay=_wd(ctx, 0.01)))
    for k in range(2):
        h.step(opt, params, {"w": random_values(900 + k, (64,), 0.1, 1.0)})
    torch.cuda.synchronize()
    where = []
    for key, value in opt.state[params["w"]].items():
        if isinstance(value, Tensor):
            pinned = value.device.type == "cpu" and value.is_pinned()
            where.append(f"{key}: {value.device}{' (pinned)' if pinned else ''} {_dtype_name(value.dtype)}")
    return ClauseFinding("info", None, "parameter on cuda; state between steps: " + "; ".join(where))


# ----------------------------------------------------------------------------- 10

def _global_rng_state() -> list[Tensor]:
    """torch's global generators: the CPU one, and each CUDA device's where CUDA is in use."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.extend(torch.cuda.get_rng_state_all())
    return states


def _set_global_rng_state(states: Sequence[Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(list(states[1:]))


def _round_trip(ctx: Context, dtype: torch.dtype) -> tuple[bool, float, str]:
    h = ctx.harness
    theta0 = {"encoder.weight": random_values(100, (3, 4), 0.5, 2.0), "encoder.bias": random_values(101, (4,), 0.5, 2.0)}
    grads = [
        {n: random_values(1000 + 10 * k + i, t.shape, 0.1, 1.0) for i, (n, t) in enumerate(theta0.items())} for k in range(6)
    ]
    values = hyper(lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=_wd(ctx, 0.1))
    pa = h.params(theta0, dtype)
    opt_a = h.build(pa, values)
    h.run(opt_a, pa, grads[:3])
    saved = load_bytes(save_bytes(opt_a.state_dict()))
    at_save = {n: p.detach().clone() for n, p in pa.items()}
    dtypes_a = state_dtypes(opt_a, pa)
    # A checkpoint that resumes bitwise saves the global RNG too (a candidate may draw from it: stochastic
    # rounding): both continuations start from the generators' state at the save.
    rng_at_save = _global_rng_state()
    seen_a = h.run(opt_a, pa, grads[3:])
    draws = any(not torch.equal(a, b) for a, b in zip(rng_at_save, _global_rng_state()))

    pb = {n: torch.nn.Parameter(v.clone()) for n, v in at_save.items()}
    opt_b = h.build(pb, values)
    opt_b.load_state_dict(saved)
    dtypes_b = state_dtypes(opt_b, pb)
    _set_global_rng_state(rng_at_save)
    seen_b = h.run(opt_b, pb, grads[3:])

    bitwise = all(torch.equal(a[n], b[n]) for a, b in zip(seen_a, seen_b) for n in a)
    bitwise &= all(torch.equal(pa[n].detach(), pb[n].detach()) for n in pa)
    _, dev, where = _series_compare(seen_b, seen_a, EXACT)
    changed = [f"{n}.{k}: {_dtype_name(dtypes_a[n][k])} -> {_dtype_name(dtypes_b[n][k]) if k in dtypes_b[n] else 'missing'}"
               for n in dtypes_a for k in dtypes_a[n] if dtypes_b[n].get(k) != dtypes_a[n][k]]
    parts = [
        f"{_dtype_name(dtype)}: continuation after load "
        f"{'bitwise equal' if bitwise else f'differs (deviation {_fmt(dev)}, first at {where})'}"
    ]
    if draws:
        parts.append("the candidate's step draws from torch's global RNG (stochastic rounding?): the continuations "
                     "are compared with the RNG restored to its state at the save, so a resume is bitwise only where "
                     "the checkpoint saves the RNG state too")
    if changed:
        parts.append("loaded state changed dtype: " + ", ".join(changed))
    return bitwise and not changed, dev, "; ".join(parts)


def clause_round_trip(ctx: Context) -> ClauseFinding:
    ok, dev, text = _round_trip(ctx, ctx.dtype)
    lines = [text]
    if ctx.dtype != torch.bfloat16:
        try:
            ok_bf16, dev_bf16, text_bf16 = _round_trip(ctx, torch.bfloat16)
            ok, dev = ok and ok_bf16, max(dev, dev_bf16)
            lines.append(text_bf16)
        except Exception as exc:  # bf16 support itself is clause 8's question
            lines.append(f"bfloat16: not run ({type(exc).__name__}: {exc})")
    head = ("state_dict -> torch.save/load -> fresh instance over the parameters at step 3, 3 more steps, "
            "compared with the uninterrupted run")
    return ClauseFinding("pass" if ok else "fail", dev, head + "\n" + "\n".join(lines))


# ----------------------------------------------------------------------------- 11

def clause_name_mapping(ctx: Context) -> ClauseFinding:
    h = ctx.harness
    theta0 = {"attn.q.weight": random_values(110, (2, 3), 0.5, 2.0), "attn.k.weight": random_values(111, (2, 3), 0.5, 2.0)}
    # Before the save the two same-shaped tensors get gradients of opposite signs and different
    # sizes; after it, gradients a thousand times smaller. The continuation is then driven by the
    # saved moments, so a swap shows even where the momentum is small (beta 0.999: m ~ 1e-3 g).
    q_grad = random_values(1100, (2, 3), 0.5, 1.0)
    grads = [{"attn.q.weight": q_grad * (1 + 0.1 * k), "attn.k.weight": -0.3 * q_grad * (1 + 0.1 * k)} for k in range(3)]
    grads += [{"attn.q.weight": snap(1e-3 * random_values(1150 + k, (2, 3), 0.5, 1.0)),
               "attn.k.weight": snap(1e-3 * random_values(1160 + k, (2, 3), 0.5, 1.0))} for k in range(2)]
    values = hyper(lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=_wd(ctx, 0.1))
    pa = h.params(theta0, ctx.dtype)
    opt_a = h.build(pa, values)
    h.run(opt_a, pa, grads[:3])
    saved = save_bytes(opt_a.state_dict())
    at_save = {n: p.detach().clone() for n, p in pa.items()}

    def resumed(order: list[str]) -> tuple[Any, dict]:
        params = {n: torch.nn.Parameter(at_save[n].clone()) for n in order}
        opt = h.build(params, values)
        opt.load_state_dict(load_bytes(saved))  # a state_dict of its own: loads may keep the given tensors
        return opt, params

    names = list(theta0)
    try:
        opt_same, p_same = resumed(names)
    except Exception as exc:
        raise NotApplicable(f"loading fails even in the saved order (clause 10): {type(exc).__name__}: {exc}") from None
    unnamed = "" if h.named else " (the candidate takes no parameter names, so only positions can match)"
    try:
        opt_rev, p_rev = resumed(names[::-1])
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ClauseFinding("pass", None, f"loading into an optimizer whose parameters are in another order is refused: "
                       f"{type(exc).__name__}: {first_line}")
    seen_same = h.run(opt_same, p_same, grads[3:])
    seen_rev = h.run(opt_rev, p_rev, grads[3:])
    ok, dev, where = _series_compare(seen_rev, seen_same, _tol(ctx, opt_same, p_same, steps=2))
    detail = ("checkpoint of [attn.q.weight, attn.k.weight] (same shape, different moments) loaded into an optimizer over "
              "[attn.k.weight, attn.q.weight]; continuation per name compared with a load in the saved order" + unnamed)
    if ok:
        return ClauseFinding("pass", dev, "state is matched by name: " + detail)
    return ClauseFinding("fail", dev, f"same-shaped state went silently to the wrong tensor (first seen at {where}): " + detail)


# ----------------------------------------------------------------------------- 12

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


# ----------------------------------------------------------------------------- 15

COST_SHAPES = [(256, 256)] * 4


def _median_step_seconds(opt: Any, params: Sequence[Tensor], grads: Sequence[Tensor], repeats: int = 5) -> float:
    for p, g in zip(params, grads):
        p.grad = g
    sync = torch.cuda.synchronize if params[0].device.type == "cuda" else (lambda: None)
    opt.step()  # the first step allocates the state
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def clause_cost(ctx: Context) -> ClauseFinding:
    h = ctx.harness
    gen = torch.Generator().manual_seed(150)
    data = {f"block{i}.weight": torch.randn(s, generator=gen, dtype=torch.float64) for i, s in enumerate(COST_SHAPES)}
    grads = [torch.randn(s, generator=gen).to(h.device, ctx.dtype) for s in COST_SHAPES]
    values = hyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=_wd(ctx, 0.01))
    params = h.params(data, ctx.dtype)
    candidate = _median_step_seconds(h.build(params, values), list(params.values()), grads)
    elements = sum(math.prod(s) for s in COST_SHAPES)
    base_params = [torch.nn.Parameter(v.to(h.device, ctx.dtype)) for v in data.values()]
    try:
        fused = _median_step_seconds(torch.optim.AdamW(base_params, lr=1e-3, weight_decay=0.01, fused=True), base_params, grads)
    except Exception as exc:
        return ClauseFinding(
            "info",
            None,
            f"{elements:,} {_dtype_name(ctx.dtype)} elements: candidate {candidate * 1e3:.2f} ms per step; "
            f"torch.optim.AdamW(fused=True) unavailable here ({type(exc).__name__})",
        )
    ratio = candidate / fused
    return ClauseFinding(
        "info",
        ratio,
        f"{elements:,} {_dtype_name(ctx.dtype)} elements on {h.device}: candidate {candidate * 1e3:.2f} ms, "
        f"torch.optim.AdamW(fused=True) {fused * 1e3:.2f} ms per step (median of 5): "
        f"{ratio:.2f}x (deviation column = this ratio)",
    )


# ----------------------------------------------------------------------------- registry

REFERENCE_CLAUSES = (1, 8)
"""The clauses that compare with reference trajectories (:func:`prepare_references`)."""


_Need = tuple[tuple[Any, ...], Callable[[], Any]]
"""A reference's key and the call that computes it and caches it under that key."""


def _reference_needs(numbers: Sequence[int], mapping_accepts: Callable[[str], bool]) -> list[_Need]:
    """Every reference the selected clauses compare with."""
    needs: list[_Need] = []
    if 1 in numbers:
        needs.extend((_update_key(label, eps), functools.partial(_update_reference, label, eps))
                     for label in UPDATE_VARIANTS for eps in (None, *OWN_EPS_BAND))
    if 8 in numbers:
        wd = 0.1 if mapping_accepts("weight_decay") else 0.0
        needs.append((_long_data_key(wd), functools.partial(_long_horizon_unique, wd)))
        needs.append((_long_key(wd), functools.partial(_long_horizon_reference, wd)))
    return needs


def references_ready(numbers: Sequence[int], *, mapping_accepts: Callable[[str], bool]) -> bool:
    """Whether every reference the selected clauses need is here already (an earlier check in this process
    computed or installed it): then :func:`prepare_references` has nothing left to do."""
    return all(key in _REFERENCES for key, _ in _reference_needs(numbers, mapping_accepts))


def prepare_references(numbers: Sequence[int], *, mapping_accepts: Callable[[str], bool]) -> dict[tuple[Any, ...], Any]:
    """The reference trajectories (and long-horizon data) the selected clauses compare with, by key.

    Computed where the checker can do it beside other work (a forked child while torch's lazily
    imported modules load); :func:`install_references` puts them where the clauses look, and
    clause children forked afterwards inherit them instead of computing them again. A reference
    computed once in a process is not computed again (a study checks many candidates in one)."""
    for _, compute in _reference_needs(numbers, mapping_accepts):
        compute()
    return dict(_REFERENCES)


def install_references(values: Mapping[tuple[Any, ...], Any]) -> None:
    """Use ``values`` (from :func:`prepare_references`, maybe computed in another process) from now on."""
    _REFERENCES.update(values)


CLAUSES: tuple[Clause, ...] = (
    Clause(
        1,
        "update rule: bias correction, eps outside the root",
        "every step has the wrong size: a different effective learning rate, worst in the first steps",
        clause_update,
    ),
    Clause(
        2,
        "decoupled weight decay, not L2 in the gradient",
        "decay is divided by sqrt(v): weights with large gradients barely decay (Adam+L2, not AdamW)",
        clause_decoupled,
    ),
    Clause(
        3,
        "decay applied to the pre-update value",
        "an extra lr^2*wd*u term: the effective decay depends on the update",
        clause_decay_order,
    ),
    Clause(
        4,
        "per-tensor step count, grad None leaves a tensor alone",
        "frozen or conditionally used tensors decay while idle or get the wrong bias correction",
        clause_step_count,
    ),
    Clause(
        5,
        "an explicit zero gradient is an update",
        "where gradients are exactly zero (masked rows, unused tokens) moments and decay stop",
        clause_zero_grad,
    ),
    Clause(
        6,
        "lr = 0: moments absorb the gradient, theta unchanged",
        "warm-up from lr 0 starts from empty moments and a shifted step count",
        clause_lr_zero,
    ),
    Clause(
        7,
        "parameter groups and LR schedules",
        "no-decay groups are decayed, per-group lr or the scheduler is ignored",
        clause_groups,
    ),
    Clause(
        8,
        "state precision for every parameter dtype (long horizon)",
        "v stops decaying, weight decay and small updates vanish: slow drift over long runs",
        clause_precision,
        long=True,
    ),
    Clause(
        9, "where the state lives between steps (info)", "placement changes speed and memory, never results", clause_placement
    ),
    Clause(
        10,
        "state_dict round trip: bitwise continuation, dtypes kept",
        "resuming from a checkpoint starts a different trajectory (a loss jump after resume)",
        clause_round_trip,
    ),
    Clause(
        11,
        "resume matches state by name, not position",
        "after a refactor one tensor's moments silently drive another tensor",
        clause_name_mapping,
    ),
    Clause(12, "hyperparameter validation", "a NaN or sign typo in the config trains silently on garbage", clause_validation),
    Clause(
        13,
        "non-finite gradients (propagate, skip, raise)",
        "one inf/NaN gradient poisons the weights, or a declared skip/raise does not happen",
        clause_nonfinite,
    ),
    Clause(
        14,
        "GradScaler found_inf step is skipped",
        "mixed-precision overflow steps corrupt the moments instead of being skipped",
        clause_grad_scaler,
    ),
    Clause(15, "cost of one step vs. torch.optim.AdamW(fused=True) (info)", "speed only", clause_cost, alone=True),
)
