"""Clause 15: the cost of one step against ``torch.optim.AdamW(fused=True)`` (information; a timing, run alone).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from offload_adamw.conformance.clauses.common import ClauseFinding, Context, _dtype_name, _wd
from offload_adamw.conformance.harness import (
    hyper,
)

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
