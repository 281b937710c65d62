"""Clause 1: the update rule (bias correction, eps outside the square root), against the reference.

Contract and method: the package's docstring (:mod:`offload_adamw.conformance.clauses`), clause 1, and
:class:`_UpdateRuns`, whose judgement of the candidate's arithmetic clause 8 reads too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor

from offload_adamw.conformance.clauses.cache import _referenced
from offload_adamw.conformance.clauses.common import (
    ARITHMETICS,
    EXACT,
    ClauseFinding,
    Context,
    _dtype_name,
    _fmt,
    _series_compare,
)
from offload_adamw.conformance.harness import (
    NotApplicable,
    as_reference,
    compare,
    hyper,
    random_values,
    snap,
    tolerance_for,
)
from offload_adamw.contract import reference


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
