"""The clauses in order (:data:`CLAUSES`) and the references they compare with.

Contract: :data:`CLAUSES` lists the fifteen clauses, each with its name, the consequence of a failure for
training and its function; :data:`REFERENCE_CLAUSES` are those that compare with reference trajectories.
:func:`prepare_references` computes what the selected clauses need (where the checker can do it beside
other work) and :func:`references_ready` says whether an earlier check in this process left it all here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from offload_adamw.conformance.clauses.cache import held, holds
from offload_adamw.conformance.clauses.common import Clause
from offload_adamw.conformance.clauses.cost import clause_cost
from offload_adamw.conformance.clauses.decay import clause_decay_order, clause_decoupled
from offload_adamw.conformance.clauses.faults import clause_grad_scaler, clause_nonfinite, clause_validation
from offload_adamw.conformance.clauses.precision import (
    _long_data_key,
    _long_horizon_reference,
    _long_horizon_unique,
    _long_key,
    clause_placement,
    clause_precision,
)
from offload_adamw.conformance.clauses.resume import clause_name_mapping, clause_round_trip
from offload_adamw.conformance.clauses.steps import clause_groups, clause_lr_zero, clause_step_count, clause_zero_grad
from offload_adamw.conformance.clauses.update import OWN_EPS_BAND, UPDATE_VARIANTS, _update_key, _update_reference, clause_update

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
    return holds(key for key, _ in _reference_needs(numbers, mapping_accepts))


def prepare_references(numbers: Sequence[int], *, mapping_accepts: Callable[[str], bool]) -> dict[tuple[Any, ...], Any]:
    """The reference trajectories (and long-horizon data) the selected clauses compare with, by key.

    Computed where the checker can do it beside other work (a forked child while torch's lazily
    imported modules load); :func:`~offload_adamw.conformance.clauses.cache.install_references` puts them where
    the clauses look, and clause children forked afterwards inherit them instead of computing them again. A reference
    computed once in a process is not computed again (a study checks many candidates in one)."""
    for _, compute in _reference_needs(numbers, mapping_accepts):
        compute()
    return held()


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
