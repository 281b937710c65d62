"""The weight-decay shrink of a run: ``prod_t (1 - lr_t * weight_decay)``, over a replayed learning-rate schedule.

Contract (docs/contract.md#decay-over-a-run): :func:`shrink_factor` computes the product in float64;
:func:`weight_decay_for` finds the weight decay whose shrink over a sequence of learning rates equals a
target; :func:`replay_lrs` gives each group's learning rate at each of the next updates by stepping a deep
copy of the scheduler bound to a stand-in optimizer (neither the user's scheduler nor the optimizer's
learning rates change); :func:`accumulation_pair` reads ``grad_accumulation`` (``new`` or
``(current, new)``).
"""

from __future__ import annotations

import copy
import math
import sys
import warnings
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from offload_adamw.auditing.values import number

__all__ = ["shrink_factor", "weight_decay_for", "replay_lrs", "accumulation_pair"]


def shrink_factor(lrs: Sequence[float], weight_decay: float) -> float:
    """``prod_t (1 - lrs[t] * weight_decay)``, in float64."""
    if len(lrs) == 0:
        return 1.0
    factors = 1.0 - torch.as_tensor(lrs, dtype=torch.float64) * weight_decay
    if bool((factors <= 0).any()):
        return float(torch.prod(factors))  # lr*wd >= 1 flips or zeroes the weights; no logarithm
    return math.exp(float(torch.log(factors).sum()))


def weight_decay_for(lrs: Sequence[float], target: float) -> float | None:
    """The weight_decay whose shrink over ``lrs`` equals ``target`` (bisection), or None."""
    top = max(lrs, default=0.0)
    if top <= 0 or not 0.0 < target <= 1.0:
        return None
    lo, hi = 0.0, 1.0 / top  # shrink falls monotonically from 1 to 0 on [0, 1/max lr]
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if shrink_factor(lrs, mid) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * hi:
            break
    return 0.5 * (lo + hi)


class _StandInOptimizer(torch.optim.Optimizer):
    """Holds copies of the user's group hyperparameters so a scheduler copy can step without touching anything."""

    def __init__(self, groups: list[dict[str, Any]]):  # no Optimizer.__init__: no parameters to register
        self.defaults = {}
        self.state = defaultdict(dict)
        self.param_groups = groups
        self._opt_called = True

    def step(self, closure: Any = None) -> Any:  # pragma: no cover - never called
        return None


def replay_lrs(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> tuple[list[list[float]], str]:
    """The learning rate of every group at each of the next ``steps`` updates, and where it came from.

    The scheduler is deep-copied with the optimizer, its groups and their dicts
    replaced by stand-ins, so neither the user's scheduler nor the optimizer's
    learning rates change.
    """
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} | {"params": []} for g in optimizer.param_groups]
    current = [[number(g["lr"]) for g in groups]] if steps > 0 else []
    if scheduler is None:
        return current * steps, "constant (no scheduler)"
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return current * steps, "constant (ReduceLROnPlateau depends on the metrics; the current lr is assumed)"
    stand_in = _StandInOptimizer(groups)
    memo: dict[int, Any] = {id(optimizer): stand_in, id(optimizer.param_groups): groups}
    for own, theirs in zip(optimizer.param_groups, groups):
        memo[id(own)] = theirs
    for own in optimizer.param_groups:  # the tensors must not be copied
        for p in own["params"]:
            memo[id(p)] = p
    shadow = copy.deepcopy(scheduler, memo)
    lrs: list[list[float]] = []
    from tqdm.auto import tqdm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # order warnings about optimizer.step(): the stand-in never steps
        for t in tqdm(range(steps), desc="replaying the lr schedule", disable=steps < 100_000 or not sys.stderr.isatty(),
                      leave=False):
            lrs.append([number(g["lr"]) for g in groups])
            if t + 1 < steps:
                shadow.step()
    return lrs, f"replay of {type(scheduler).__name__}"


def accumulation_pair(grad_accumulation: int | Sequence[int] | None) -> tuple[int, int] | None:
    if grad_accumulation is None:
        return None
    pair: tuple[int, ...]
    if isinstance(grad_accumulation, int):
        pair = (1, grad_accumulation)
    else:
        pair = tuple(int(x) for x in grad_accumulation)
    if len(pair) != 2 or pair[0] < 1 or pair[1] < 1:
        raise ValueError(f"grad_accumulation must be a positive int or a (current, new) pair of them, got {grad_accumulation!r}")
    return pair[0], pair[1]
