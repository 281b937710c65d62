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
* :func:`audit_state_dict` audits a saved optimizer state_dict alone: groups,
  names, state dtypes, decay on 1-D state, empty groups, duplicates and state
  that belongs to no group. What it cannot know (parameters missing from the
  optimizer, frozen parameters, tied parameters) is listed in ``notes``. Its
  input is checked first: a malformed state_dict (wrong types anywhere) raises
  ValueError naming the source and the entry, never another exception.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from offload_adamw.auditing.decay import accumulation_pair, replay_lrs, shrink_factor, weight_decay_for
from offload_adamw.auditing.report import AuditFinding, AuditReport, GroupSummary
from offload_adamw.auditing.values import as_float, by_dtype, dtype_label, few, group_label, is_number, number
from offload_adamw.optim.named_groups import named_tensors

__all__ = ["AuditFinding", "GroupSummary", "AuditReport", "audit", "audit_state_dict", "shrink_factor", "KINDS"]

#: every kind of finding -> its severity.
KINDS: dict[str, str] = {
    "missing_from_optimizer": "error",
    "duplicate_in_optimizer": "error",
    "not_in_model": "error",
    "frozen_with_grad": "error",
    "name_mismatch": "error",
    "state_without_group": "error",
    "invalid_hyperparameter": "error",
    "decay_on_1d": "warning",
    "empty_group": "warning",
    "low_precision_state": "warning",
    "weight_decay_shrink": "info",
}
_STATE_WIDTH_BYTES = 4  # state narrower than float32 loses the small updates (docs/contract.md#state-precision)


def _hyperparameter_findings(groups: Sequence[Mapping[str, Any]]) -> list[AuditFinding]:
    """One finding per group whose lr, betas, eps or weight_decay torch.optim.AdamW's constructor refuses."""
    out = []
    for gi, group in enumerate(groups):
        bad: dict[str, str] = {}
        for key in ("lr", "eps", "weight_decay"):
            if key in group and is_number(group[key]) and not 0.0 <= number(group[key]):
                bad[key] = repr(number(group[key]))
        betas = group.get("betas")
        if betas is not None and not (
            isinstance(betas, (tuple, list)) and len(betas) == 2 and all(is_number(b) and 0.0 <= number(b) < 1.0 for b in betas)
        ):
            shown = tuple(as_float(b) if is_number(b) else b for b in betas) if isinstance(betas, (tuple, list)) else betas
            bad["betas"] = repr(shown)
        if bad:
            out.append(
                _finding(
                    "invalid_hyperparameter",
                    f"group {gi} ({group_label(group, gi)}) has " + ", ".join(f"{k} {v}" for k, v in bad.items())
                    + ": torch.optim.AdamW refuses these (lr, eps, weight_decay >= 0 and 0 <= betas < 1); "
                    "the update computes nonsense or NaN",
                    group=gi,
                    values=bad,
                )
            )
    return out


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


def _shrink_findings(
    groups: Sequence[Mapping[str, Any]],
    lrs: list[list[float]],
    source: str,
    accumulation: tuple[int, int] | None,
) -> list[AuditFinding]:
    steps = len(lrs)
    findings = []
    for gi, group in enumerate(groups):
        wd = as_float(group.get("weight_decay")) or 0.0
        if wd <= 0 or not group["params"]:
            continue
        seq = [row[gi] for row in lrs]
        shrink = shrink_factor(seq, wd)
        details: dict[str, Any] = {
            "updates": steps,
            "weight_decay": wd,
            "shrink": shrink,
            "lr_source": source,
            "lr_first": seq[0] if seq else None,
            "lr_last": seq[-1] if seq else None,
        }
        message = f"over {steps} updates weight decay {wd:g} scales the weights by {shrink:.6g} ({source})"
        if accumulation is not None:
            current, new = accumulation
            new_steps = max(1, round(steps * current / new))
            resampled = [seq[min(steps - 1, (j * steps) // new_steps)] for j in range(new_steps)] if steps else []
            new_shrink = shrink_factor(resampled, wd)
            keep = weight_decay_for(resampled, shrink)
            details["accumulation"] = {
                "current": current,
                "new": new,
                "updates": new_steps,
                "shrink": new_shrink,
                "weight_decay_for_same_shrink": keep,
            }
            message += (
                f"; with gradient accumulation {new} instead of {current}: {new_steps} updates, {new_shrink:.6g}"
                + (f" (weight_decay {keep:.6g} keeps {shrink:.6g})" if keep is not None else "")
            )
        findings.append(
            AuditFinding(kind="weight_decay_shrink", severity="info", message=message, group=gi, details=details)
        )
    return findings


# --------------------------------------------------------------------- audit


def _finding(kind: str, message: str, params: Sequence[str] = (), group: int | None = None, **details: Any) -> AuditFinding:
    return AuditFinding(kind=kind, severity=KINDS[kind], message=message, params=tuple(params), group=group, details=details)


def _predicted_state_dtype(optimizer: torch.optim.Optimizer, p: Tensor) -> torch.dtype | None:
    """The dtype of the moments the optimizer will create for ``p``, where it is known before any step."""
    from offload_adamw.optim.optimizer import OffloadAdamW

    if isinstance(optimizer, OffloadAdamW):
        return torch.float64 if p.dtype == torch.float64 else torch.float32
    if type(optimizer).__module__.startswith("torch.optim"):
        return p.dtype  # torch's optimizers allocate their state with zeros_like(param)
    return None


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

    model_names = named_tensors(model)
    where: dict[Tensor, list[tuple[int, int]]] = {}
    display: dict[Tensor, str] = {}
    findings: list[AuditFinding] = _hyperparameter_findings(optimizer.param_groups)
    mismatched: dict[str, str] = {}
    for gi, group in enumerate(optimizer.param_groups):
        given = group.get("param_names")
        for j, p in enumerate(group["params"]):
            where.setdefault(p, []).append((gi, j))
            names = model_names.get(p)
            if names is not None:
                display[p] = names[0]
                if given is not None and j < len(given) and given[j] not in names:
                    mismatched[f"param_groups[{gi}][{j}]"] = f"named {given[j]!r}, but the model calls it {names[0]!r}"
            else:
                display.setdefault(
                    p, given[j] if given is not None and j < len(given) else f"param_groups[{gi}][{j}] {tuple(p.shape)}"
                )

    def name_of(p: Tensor) -> str:
        return display[p] if p in display else model_names[p][0]

    def aliases(tensors: Sequence[Tensor]) -> dict[str, list[str]]:
        return {model_names[p][0]: model_names[p] for p in tensors if len(model_names.get(p, ())) > 1}

    missing = [p for p, names in model_names.items() if p.requires_grad and p not in where]
    if missing:
        names = [name_of(p) for p in missing]
        findings.append(
            _finding(
                "missing_from_optimizer",
                f"{len(missing)} trainable parameter(s) are in no parameter group and will never be updated: {few(names)}",
                names,
                tied_names=aliases(missing),
            )
        )
    twice = [p for p, places in where.items() if len(places) > 1]
    if twice:
        names = [name_of(p) for p in twice]
        findings.append(
            _finding(
                "duplicate_in_optimizer",
                f"{len(twice)} tensor(s) appear more than once in the optimizer and are updated once per appearance: "
                + "; ".join(f"{name_of(p)} at {[f'param_groups[{gj[0]}][{gj[1]}]' for gj in where[p]]}" for p in twice[:6]),
                names,
                places={name_of(p): [list(gj) for gj in where[p]] for p in twice},
                tied_names=aliases(twice),
            )
        )
    foreign = [p for p in where if p not in model_names]
    if foreign:
        names = [name_of(p) for p in foreign]
        findings.append(
            _finding(
                "not_in_model",
                f"{len(foreign)} optimized tensor(s) are not parameters of the model (a stale or another model?): {few(names)}",
                names,
            )
        )
    frozen = [p for p in where if not p.requires_grad and p.grad is not None]
    if frozen:
        names = [name_of(p) for p in frozen]
        findings.append(
            _finding(
                "frozen_with_grad",
                f"{len(frozen)} frozen parameter(s) (requires_grad=False) still hold a .grad and will be updated "
                f"by the next step (set .grad = None or zero_grad(set_to_none=True)): {few(names)}",
                names,
            )
        )
    if mismatched:
        findings.append(
            _finding(
                "name_mismatch",
                f"{len(mismatched)} param_names entr(y/ies) do not name their tensor, so a state_dict keyed by name "
                f"puts state on the wrong tensor: " + "; ".join(f"{k} {v}" for k, v in list(mismatched.items())[:6]),
                list(mismatched),
                entries=mismatched,
            )
        )

    def updated(p: Tensor) -> bool:
        return p.requires_grad or p.grad is not None

    decayed: dict[Tensor, list[float]] = {}
    for group in optimizer.param_groups:
        wd = as_float(group.get("weight_decay")) or 0.0
        for p in group["params"]:
            if wd > 0 and p.ndim <= 1 and updated(p) and wd not in decayed.setdefault(p, []):
                decayed[p].append(wd)
    decayed = {p: wds for p, wds in decayed.items() if wds}
    if decayed:
        names = [name_of(p) for p in decayed]
        findings.append(
            _finding(
                "decay_on_1d",
                f"weight decay on {len(decayed)} 1-D parameter(s) (biases, norm weights), which usually should not "
                f"decay: {few(names)}",
                names,
                weight_decay={name_of(p): wds for p, wds in decayed.items()},
                groups={name_of(p): sorted({gi for gi, _ in where[p]}) for p in decayed},
            )
        )

    narrow: dict[str, dict[str, str]] = {}
    for p in where:
        state = optimizer.state.get(p) or {}
        low = {
            k: dtype_label(v.dtype)
            for k, v in state.items()
            if isinstance(v, Tensor) and v.is_floating_point() and v.element_size() < _STATE_WIDTH_BYTES
        }
        if not state and updated(p):
            predicted = _predicted_state_dtype(optimizer, p)
            if predicted is not None and predicted.is_floating_point and predicted.itemsize < _STATE_WIDTH_BYTES:
                low = {"moments (at the first step)": dtype_label(predicted)}
        if low:
            narrow[name_of(p)] = low
    if narrow:
        names = list(narrow)
        findings.append(
            _finding(
                "low_precision_state",
                f"{len(narrow)} parameter(s) have optimizer state narrower than float32: small updates and weight "
                f"decay round away, and no float32 master exists (docs/contract.md, section State precision): "
                f"{by_dtype(narrow)}",
                names,
                dtypes=narrow,
            )
        )

    for gi, group in enumerate(optimizer.param_groups):
        if not group["params"]:
            findings.append(
                _finding("empty_group", f"group {gi} ({group_label(group, gi)}) has no parameter", group=gi,
                         label=group_label(group, gi))
            )

    if steps is not None:
        lrs, source = replay_lrs(optimizer, scheduler, steps)
        findings += _shrink_findings(optimizer.param_groups, lrs, source, accumulation)

    summaries = []
    for gi, group in enumerate(optimizer.param_groups):
        params = group["params"]
        state_dtypes = _state_dtypes(optimizer.state.get(p) for p in params)
        summaries.append(
            GroupSummary(
                index=gi,
                label=group_label(group, gi),
                lr=as_float(group.get("lr")),
                weight_decay=as_float(group.get("weight_decay")),
                tensors=len(params),
                elements=sum(p.numel() for p in params),
                param_dtypes=tuple(sorted({dtype_label(p.dtype) for p in params})),
                state_dtypes=state_dtypes,
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
    findings: list[AuditFinding] = _hyperparameter_findings(groups)
    notes = [
        "from a state_dict alone, trainable parameters missing from the optimizer, frozen parameters that hold a "
        "gradient and tied parameters cannot be checked: audit the training script for those",
    ]

    # torch numbers each tensor once, so a tensor listed twice has one id in two places; two ids under one
    # name make a by-name load ambiguous. Both are duplicates, each reported once under its name.
    names: dict[Any, str] = {}
    id_places: dict[Any, list[tuple[int, int]]] = defaultdict(list)
    name_ids: dict[str, set[Any]] = defaultdict(set)
    for gi, group in enumerate(groups):
        given = group.get("param_names")
        for j, pid in enumerate(group.get("params", [])):
            name = given[j] if given is not None and j < len(given) else f"id {pid}"
            if pid in names and name not in names[pid].split(" = "):
                names[pid] += f" = {name}"  # one id listed under two names: show both
            names.setdefault(pid, name)
            id_places[pid].append((gi, j))
            name_ids[name].add(pid)
    twice: dict[str, list[tuple[int, int]]] = {}
    for pid, pl in id_places.items():
        if len(pl) > 1:
            twice[names[pid]] = pl
    for name, pids in name_ids.items():
        if len(pids) > 1:
            twice.setdefault(name, sorted(gj for pid in pids for gj in id_places[pid]))
    if twice:
        findings.append(
            _finding(
                "duplicate_in_optimizer",
                f"{len(twice)} parameter(s) appear more than once in the saved groups: {few(list(twice))}",
                list(twice),
                places={n: [list(gj) for gj in pl] for n, pl in twice.items()},
            )
        )
    orphans = [pid for pid in state if pid not in names]
    if orphans:
        findings.append(
            _finding(
                "state_without_group",
                f"{len(orphans)} state entr(y/ies) belong to no parameter group: ids {few([str(o) for o in orphans])}",
                [f"id {o}" for o in orphans],
            )
        )

    def shape_of(pid: Any) -> torch.Size | None:
        for key in ("exp_avg", "exp_avg_sq", "master_param", "momentum_buffer"):
            value = (state.get(pid) or {}).get(key)
            if isinstance(value, Tensor):
                return value.shape
        return None

    decayed: dict[str, float] = {}
    unknown_shape = 0
    for group in groups:
        wd = as_float(group.get("weight_decay")) or 0.0
        for pid in group.get("params", []):
            shape = shape_of(pid)
            if shape is None:
                unknown_shape += 1
            elif wd > 0 and len(shape) <= 1:
                decayed.setdefault(names[pid], wd)
    if decayed:
        findings.append(
            _finding(
                "decay_on_1d",
                f"weight decay on {len(decayed)} 1-D parameter(s) (by the shape of their state): {few(list(decayed))}",
                list(decayed),
                weight_decay=decayed,
            )
        )
    if unknown_shape:
        notes.append(f"{unknown_shape} parameter(s) have no state yet (never stepped, or frozen): their shape is unknown")

    narrow: dict[str, dict[str, str]] = {}
    for pid, entry in state.items():
        low = {
            k: dtype_label(v.dtype)
            for k, v in (entry or {}).items()
            if isinstance(v, Tensor) and v.is_floating_point() and v.element_size() < _STATE_WIDTH_BYTES
        }
        if low:
            narrow[names.get(pid, f"id {pid}")] = low
    if narrow:
        findings.append(
            _finding(
                "low_precision_state",
                f"{len(narrow)} parameter(s) have state narrower than float32: {by_dtype(narrow)}",
                list(narrow),
                dtypes=narrow,
            )
        )
    for gi, group in enumerate(groups):
        if not group.get("params"):
            findings.append(
                _finding("empty_group", f"group {gi} ({group_label(group, gi)}) has no parameter", group=gi,
                         label=group_label(group, gi))
            )
    if steps is not None:
        current = [as_float(g.get("lr")) or 0.0 for g in groups]
        findings += _shrink_findings(
            groups, [current] * steps, "constant: the saved lr (no scheduler in a state_dict)", accumulation
        )

    summaries = []
    for gi, group in enumerate(groups):
        pids = group.get("params", [])
        shapes = [shape_of(pid) for pid in pids]
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
    return AuditReport(source=source, findings=_by_severity(findings), groups=tuple(summaries), notes=tuple(notes))
