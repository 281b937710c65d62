"""Clauses 8 and 9: the state's precision for every parameter dtype over a long horizon, and where it lives.

Contract and method: the package's docstring (:mod:`offload_adamw.conformance.clauses`), clause 8 (the
candidate in each dtype against its own widest run, the state's dtypes, the master's narrowing) and
clause 9 (information only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor

from offload_adamw.conformance.clauses.cache import _referenced
from offload_adamw.conformance.clauses.common import EXACT, ClauseFinding, Context, _dtype_name, _fmt, _wd
from offload_adamw.conformance.clauses.update import _UpdateRuns
from offload_adamw.conformance.harness import (
    NotApplicable,
    as_reference,
    compare,
    dtype_bits,
    hyper,
    moment_dtypes,
    random_values,
    tolerance_for,
)
from offload_adamw.contract import reference

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
