"""What every clause shares: the context it runs in, its finding, the clause record, the comparisons of series.

Contract: a clause is a :class:`Clause` (number, name, consequence, the function that runs it, whether it is
long or a timing); its function takes a :class:`Context` and returns a :class:`ClauseFinding`. The helpers
here read the candidate only through the context's harness.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offload_adamw.conformance.harness import (
    Harness,
    Tolerance,
    compare,
    compare_band,
    tolerance_for,
)

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
