"""Clauses 10 and 11: a state_dict round trip continues bitwise, and a resume matches state by name.

Contract and method: the package's docstring (:mod:`offload_adamw.conformance.clauses`), clauses 10 and 11
(through torch.save and torch.load, torch's global RNG restored at the resume point).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from offload_adamw.conformance.clauses.common import EXACT, ClauseFinding, Context, _dtype_name, _fmt, _series_compare, _tol, _wd
from offload_adamw.conformance.harness import (
    NotApplicable,
    hyper,
    load_bytes,
    random_values,
    save_bytes,
    snap,
    state_dtypes,
)


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
