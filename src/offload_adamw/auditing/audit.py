"""An audit of an optimizer's set-up: what it will and will not update, and how.

Contract:

* :func:`audit` inspects a model, its optimizer and optionally its learning-rate
  scheduler, changes none of them (the scheduler is replayed on a copy bound to
  a stand-in optimizer), and returns an :class:`AuditReport`.
* A finding is one fault of one kind. Parameter-level kinds are reported at
  most once each, listing every culprit tensor once (a tied tensor under all
  its names, canonical name first): ``missing_from_optimizer``,
  ``duplicate_in_optimizer``, ``not_in_model``, ``frozen_with_grad``,
  ``name_mismatch``, ``decay_on_1d``, ``low_precision_state``. Group-level kinds
  are reported at most once per group: ``empty_group``,
  ``invalid_hyperparameter`` (an lr, betas, eps or weight_decay the constructor
  refuses: a NaN, a negative, a beta outside [0, 1)) and, given ``steps``, the
  informational ``weight_decay_shrink``. A set-up without faults has no
  finding of severity ``error`` or ``warning`` (:attr:`AuditReport.faults`).
* The weight-decay shrink of a group over a run of ``steps`` optimizer updates
  is ``prod_t (1 - lr_t * weight_decay)`` (docs/contract.md#decay-over-a-run), with lr_t the
  group's learning rate at update t: the current one for the first update, then
  the scheduler's after each ``scheduler.step()``. With
  ``grad_accumulation=(current, new)`` the run has ``round(steps * current /
  new)`` updates instead; the schedule is assumed rebuilt for that length (as
  scripts that derive the total step count from the data do), i.e. update j
  uses the replayed lr at the same fraction of the run, and the report gives the
  new shrink and the weight_decay that would keep the old one.
* Each kind is looked for by one function of :mod:`offload_adamw.auditing.findings`, whose registry
  ``CHECKS`` says which kinds a saved state_dict can show.
* :func:`audit_state_dict` audits a saved optimizer state_dict alone: groups,
  names, state dtypes, decay on 1-D state, empty groups, duplicates and state
  that belongs to no group. What it cannot know (parameters missing from the
  optimizer, frozen parameters, tied parameters) is listed in ``notes``. Its
  input is checked first: a malformed state_dict (wrong types anywhere) raises
  ValueError naming the source and the entry, never another exception.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from offload_adamw.auditing.decay import accumulation_pair, shrink_factor
from offload_adamw.auditing.findings import CHECKS, KINDS, LiveSetup, SavedSetup
from offload_adamw.auditing.report import AuditFinding, AuditReport, GroupSummary
from offload_adamw.auditing.values import as_float, dtype_label, group_label, is_number

__all__ = ["AuditFinding", "GroupSummary", "AuditReport", "audit", "audit_state_dict", "shrink_factor", "KINDS"]


def audit(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    steps: int | None = None,
    grad_accumulation: int | Sequence[int] | None = None,
) -> AuditReport:
    """Audit the set-up of ``optimizer`` over ``model``; see the module docstring.

    Args:
        model: the model whose trainable parameters should be optimized.
        optimizer: any ``torch.optim.Optimizer`` (the state checks know
            torch's optimizers and OffloadAdamW before their first step, any
            optimizer after it).
        scheduler: its learning-rate scheduler, replayed on a copy.
        steps: the number of optimizer updates still to run; with it, the
            report gives each decayed group's total weight-decay shrink.
        grad_accumulation: ``new`` or ``(current, new)`` micro-batches per
            update (``current`` defaults to 1): how the number of updates and
            the shrink change when the same data is accumulated differently.
    """
    if steps is None and (scheduler is not None or grad_accumulation is not None):
        raise ValueError("the shrink of weight decay needs steps= (the number of optimizer updates of the run)")
    if steps is not None and steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    accumulation = accumulation_pair(grad_accumulation)

    setup = LiveSetup.of(model, optimizer, scheduler, steps, accumulation)
    findings = [f for check in CHECKS if check.of_setup is not None for f in check.of_setup(setup)]
    summaries = []
    for gi, group in enumerate(optimizer.param_groups):
        params = group["params"]
        summaries.append(
            GroupSummary(
                index=gi,
                label=group_label(group, gi),
                lr=as_float(group.get("lr")),
                weight_decay=as_float(group.get("weight_decay")),
                tensors=len(params),
                elements=sum(p.numel() for p in params),
                param_dtypes=tuple(sorted({dtype_label(p.dtype) for p in params})),
                state_dtypes=_state_dtypes(optimizer.state.get(p) for p in params),
            )
        )
    return AuditReport(source="model + optimizer", findings=_by_severity(findings), groups=tuple(summaries))


def _state_dtypes(entries: Iterable[Mapping[str, Any] | None]) -> tuple[str, ...]:
    """The floating dtypes of the state tensors in ``entries`` (per-parameter state dicts or None), sorted."""
    return tuple(sorted({
        dtype_label(v.dtype)
        for entry in entries
        for v in (entry or {}).values()
        if isinstance(v, Tensor) and v.is_floating_point()
    }))


def _by_severity(findings: list[AuditFinding]) -> tuple[AuditFinding, ...]:
    """Errors, then warnings, then info; stable, so the order of the checks is kept within a severity."""
    order = {"error": 0, "warning": 1, "info": 2}
    return tuple(sorted(findings, key=lambda f: order[f.severity]))


# ---------------------------------------------------------- state_dict audit


def audit_state_dict(
    state_dict: Mapping[str, Any],
    *,
    source: str = "optimizer state_dict",
    steps: int | None = None,
    grad_accumulation: int | Sequence[int] | None = None,
) -> AuditReport:
    """Audit a saved optimizer state_dict (``{"state": ..., "param_groups": ...}``) without its model.

    With ``steps`` the shrink assumes each group's saved lr stays constant (the
    scheduler is not in an optimizer state_dict).
    """
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"{source}: not an optimizer state_dict (expected the keys 'state' and 'param_groups')")
    _check_state_dict_layout(state_dict, source)
    accumulation = accumulation_pair(grad_accumulation)
    groups = state_dict["param_groups"]
    state = state_dict["state"]
    setup = SavedSetup.of(groups, state, steps, accumulation)
    findings = [f for check in CHECKS if check.of_state_dict is not None for f in check.of_state_dict(setup)]
    summaries = []
    for gi, group in enumerate(groups):
        pids = group.get("params", [])
        shapes = [setup.shape_of(pid) for pid in pids]
        known = [s for s in shapes if s is not None]
        summaries.append(
            GroupSummary(
                index=gi,
                label=group_label(group, gi),
                lr=as_float(group.get("lr")),
                weight_decay=as_float(group.get("weight_decay")),
                tensors=len(pids),
                elements=None if len(known) != len(shapes) else sum(math.prod(s) for s in known),
                param_dtypes=(),
                state_dtypes=_state_dtypes(state.get(pid) for pid in pids),
            )
        )
    return AuditReport(source=source, findings=_by_severity(findings), groups=tuple(summaries), notes=tuple(setup.notes))


def _check_state_dict_layout(state_dict: Mapping[str, Any], source: str) -> None:
    """ValueError naming ``source`` and the entry for anything audit_state_dict could not read."""

    def fail(what: str) -> None:
        raise ValueError(f"{source}: malformed optimizer state_dict: {what}")

    groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(groups, (list, tuple)):
        fail(f"param_groups must be a list, got {type(groups).__name__}")
    for gi, group in enumerate(groups):
        if not isinstance(group, Mapping):
            fail(f"param_groups[{gi}] must be a dict, got {type(group).__name__}")
        params = group.get("params", [])
        if not isinstance(params, (list, tuple)):
            fail(f"param_groups[{gi}]['params'] must be a list of ids, got {type(params).__name__}")
        for pid in params:
            try:
                hash(pid)
            except TypeError:
                fail(f"param_groups[{gi}]['params'] holds {pid!r}, which is not an id")
        names = group.get("param_names")
        if names is not None and not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)):
            fail(f"param_groups[{gi}]['param_names'] must be a list of names, got {names!r}")
        for key in ("lr", "eps", "weight_decay"):
            if group.get(key) is not None and not is_number(group[key]):
                fail(f"param_groups[{gi}][{key!r}] must be a number, got {group[key]!r}")
        betas = group.get("betas")
        if betas is not None and not (isinstance(betas, (list, tuple)) and all(is_number(b) for b in betas)):
            fail(f"param_groups[{gi}]['betas'] must be a pair of numbers, got {betas!r}")
    if not isinstance(state, Mapping):
        fail(f"state must be a dict, got {type(state).__name__}")
    for pid, entry in state.items():
        if entry is not None and not isinstance(entry, Mapping):
            fail(f"state entry {pid!r} must be a dict, got {type(entry).__name__}")
