"""The audit's findings, one function each, and the registry that runs them.

Contract: every finding function takes what is audited, a :class:`LiveSetup` (a model, its optimizer and
scheduler) or a :class:`SavedSetup` (an optimizer state_dict alone), and returns the findings of its one
kind: none when the set-up is clean, else one per kind (parameter-level kinds, every culprit tensor listed
once) or one per group (group-level kinds). :data:`CHECKS` lists them in the order they run, each with the
function for a live set-up and the one for a saved state_dict (None where that input cannot tell);
:data:`KINDS` maps each kind to its severity. A finding function changes nothing it is given; what a check
of a state_dict could not make it says in :attr:`SavedSetup.notes`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from offload_adamw.auditing.decay import replay_lrs, shrink_factor, weight_decay_for
from offload_adamw.auditing.report import AuditFinding
from offload_adamw.auditing.values import as_float, by_dtype, dtype_label, few, group_label, is_number, number
from offload_adamw.optim.named_groups import named_tensors

__all__ = ["LiveSetup", "SavedSetup", "Check", "CHECKS", "KINDS"]

_STATE_WIDTH_BYTES = 4  # state narrower than float32 loses the small updates (docs/contract.md#state-precision)


# ------------------------------------------------------------------------------- what is audited


@dataclass
class LiveSetup:
    """A model, its optimizer and scheduler, and where each optimized tensor sits in the groups."""

    model: torch.nn.Module
    """The model whose trainable parameters should be optimized."""
    optimizer: torch.optim.Optimizer
    """Its optimizer."""
    scheduler: Any
    """Its learning-rate scheduler, or None."""
    steps: int | None
    """Optimizer updates still to run (None: no shrink finding)."""
    accumulation: tuple[int, int] | None
    """(current, new) micro-batches per update to compare with, or None."""
    model_names: dict[Tensor, list[str]] = field(default_factory=dict)
    """Every parameter of the model -> all its names, canonical first."""
    where: dict[Tensor, list[tuple[int, int]]] = field(default_factory=dict)
    """Every optimized tensor -> its (group, position) places."""
    display: dict[Tensor, str] = field(default_factory=dict)
    """The name an optimized tensor is reported under."""
    mismatched: dict[str, str] = field(default_factory=dict)
    """``param_groups[g][j]`` -> how its param_names entry differs from the model's name for the tensor."""

    @classmethod
    def of(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, steps: int | None,
           accumulation: tuple[int, int] | None) -> LiveSetup:
        setup = cls(model=model, optimizer=optimizer, scheduler=scheduler, steps=steps, accumulation=accumulation,
                    model_names=named_tensors(model))
        for gi, group in enumerate(optimizer.param_groups):
            given = group.get("param_names")
            for j, p in enumerate(group["params"]):
                setup.where.setdefault(p, []).append((gi, j))
                names = setup.model_names.get(p)
                if names is not None:
                    setup.display[p] = names[0]
                    if given is not None and j < len(given) and given[j] not in names:
                        setup.mismatched[f"param_groups[{gi}][{j}]"] = (f"named {given[j]!r}, but the model calls it "
                                                                        f"{names[0]!r}")
                else:
                    setup.display.setdefault(
                        p, given[j] if given is not None and j < len(given) else f"param_groups[{gi}][{j}] {tuple(p.shape)}"
                    )
        return setup

    @property
    def groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def name_of(self, p: Tensor) -> str:
        return self.display[p] if p in self.display else self.model_names[p][0]

    def aliases(self, tensors: Sequence[Tensor]) -> dict[str, list[str]]:
        """The names of each tied tensor among ``tensors`` (canonical name -> all names)."""
        return {self.model_names[p][0]: self.model_names[p] for p in tensors if len(self.model_names.get(p, ())) > 1}

    @staticmethod
    def updated(p: Tensor) -> bool:
        """Whether the next step updates ``p`` (it is trainable, or a gradient is there anyway)."""
        return p.requires_grad or p.grad is not None


@dataclass
class SavedSetup:
    """An optimizer state_dict (already checked for its layout) and the names its ids are saved under."""

    groups: Sequence[Mapping[str, Any]]
    """Its ``param_groups``."""
    state: Mapping[Any, Any]
    """Its ``state``."""
    steps: int | None
    """Optimizer updates still to run (None: no shrink finding)."""
    accumulation: tuple[int, int] | None
    """(current, new) micro-batches per update to compare with, or None."""
    names: dict[Any, str] = field(default_factory=dict)
    """Every id in the groups -> the name it is reported under (``a = b`` for an id saved under two names)."""
    id_places: dict[Any, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    """Every id -> its (group, position) places."""
    name_ids: dict[str, set[Any]] = field(default_factory=lambda: defaultdict(set))
    """Every name -> the ids saved under it."""
    notes: list[str] = field(default_factory=list)
    """What could not be checked, and why."""

    @classmethod
    def of(cls, groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Any], steps: int | None,
           accumulation: tuple[int, int] | None) -> SavedSetup:
        setup = cls(groups=groups, state=state, steps=steps, accumulation=accumulation, notes=[
            "from a state_dict alone, trainable parameters missing from the optimizer, frozen parameters that hold a "
            "gradient and tied parameters cannot be checked: audit the training script for those",
        ])
        for gi, group in enumerate(groups):
            given = group.get("param_names")
            for j, pid in enumerate(group.get("params", [])):
                name = given[j] if given is not None and j < len(given) else f"id {pid}"
                if pid in setup.names and name not in setup.names[pid].split(" = "):
                    setup.names[pid] += f" = {name}"  # one id listed under two names: show both
                setup.names.setdefault(pid, name)
                setup.id_places[pid].append((gi, j))
                setup.name_ids[name].add(pid)
        return setup

    def shape_of(self, pid: Any) -> torch.Size | None:
        """The parameter's shape, read from its state (None before its first step)."""
        for key in ("exp_avg", "exp_avg_sq", "master_param", "momentum_buffer"):
            value = (self.state.get(pid) or {}).get(key)
            if isinstance(value, Tensor):
                return value.shape
        return None


def _finding(kind: str, message: str, params: Sequence[str] = (), group: int | None = None, **details: Any) -> AuditFinding:
    return AuditFinding(kind=kind, severity=KINDS[kind], message=message, params=tuple(params), group=group, details=details)


# ------------------------------------------------------------------------------- group-level, both


def invalid_hyperparameter(setup: LiveSetup | SavedSetup) -> list[AuditFinding]:
    """One finding per group whose lr, betas, eps or weight_decay torch.optim.AdamW's constructor refuses."""
    out = []
    for gi, group in enumerate(setup.groups):
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


def empty_group(setup: LiveSetup | SavedSetup) -> list[AuditFinding]:
    """One finding per group without a parameter."""
    return [
        _finding("empty_group", f"group {gi} ({group_label(group, gi)}) has no parameter", group=gi,
                 label=group_label(group, gi))
        for gi, group in enumerate(setup.groups) if not group.get("params")
    ]


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


def weight_decay_shrink(setup: LiveSetup) -> list[AuditFinding]:
    """Given ``steps``: each decayed group's total shrink over the run, with the scheduler's learning rates."""
    if setup.steps is None:
        return []
    lrs, source = replay_lrs(setup.optimizer, setup.scheduler, setup.steps)
    return _shrink_findings(setup.groups, lrs, source, setup.accumulation)


def saved_weight_decay_shrink(setup: SavedSetup) -> list[AuditFinding]:
    """Given ``steps``: each decayed group's total shrink at its saved learning rate (no scheduler is saved)."""
    if setup.steps is None:
        return []
    current = [as_float(g.get("lr")) or 0.0 for g in setup.groups]
    return _shrink_findings(setup.groups, [current] * setup.steps, "constant: the saved lr (no scheduler in a state_dict)",
                            setup.accumulation)


# ------------------------------------------------------------------------------- a live set-up


def missing_from_optimizer(setup: LiveSetup) -> list[AuditFinding]:
    """Trainable parameters of the model that are in no parameter group."""
    missing = [p for p, names in setup.model_names.items() if p.requires_grad and p not in setup.where]
    if not missing:
        return []
    names = [setup.name_of(p) for p in missing]
    return [_finding(
        "missing_from_optimizer",
        f"{len(missing)} trainable parameter(s) are in no parameter group and will never be updated: {few(names)}",
        names,
        tied_names=setup.aliases(missing),
    )]


def duplicate_in_optimizer(setup: LiveSetup) -> list[AuditFinding]:
    """Tensors that appear more than once in the optimizer's groups."""
    twice = [p for p, places in setup.where.items() if len(places) > 1]
    if not twice:
        return []
    names = [setup.name_of(p) for p in twice]
    return [_finding(
        "duplicate_in_optimizer",
        f"{len(twice)} tensor(s) appear more than once in the optimizer and are updated once per appearance: "
        + "; ".join(f"{setup.name_of(p)} at {[f'param_groups[{gj[0]}][{gj[1]}]' for gj in setup.where[p]]}"
                    for p in twice[:6]),
        names,
        places={setup.name_of(p): [list(gj) for gj in setup.where[p]] for p in twice},
        tied_names=setup.aliases(twice),
    )]


def not_in_model(setup: LiveSetup) -> list[AuditFinding]:
    """Optimized tensors that are not parameters of the model."""
    foreign = [p for p in setup.where if p not in setup.model_names]
    if not foreign:
        return []
    names = [setup.name_of(p) for p in foreign]
    return [_finding(
        "not_in_model",
        f"{len(foreign)} optimized tensor(s) are not parameters of the model (a stale or another model?): {few(names)}",
        names,
    )]


def frozen_with_grad(setup: LiveSetup) -> list[AuditFinding]:
    """Frozen parameters that still hold a gradient, which the next step applies."""
    frozen = [p for p in setup.where if not p.requires_grad and p.grad is not None]
    if not frozen:
        return []
    names = [setup.name_of(p) for p in frozen]
    return [_finding(
        "frozen_with_grad",
        f"{len(frozen)} frozen parameter(s) (requires_grad=False) still hold a .grad and will be updated "
        f"by the next step (set .grad = None or zero_grad(set_to_none=True)): {few(names)}",
        names,
    )]


def name_mismatch(setup: LiveSetup) -> list[AuditFinding]:
    """param_names entries that do not name their tensor."""
    mismatched = setup.mismatched
    if not mismatched:
        return []
    return [_finding(
        "name_mismatch",
        f"{len(mismatched)} param_names entr(y/ies) do not name their tensor, so a state_dict keyed by name "
        f"puts state on the wrong tensor: " + "; ".join(f"{k} {v}" for k, v in list(mismatched.items())[:6]),
        list(mismatched),
        entries=mismatched,
    )]


def decay_on_1d(setup: LiveSetup) -> list[AuditFinding]:
    """Weight decay on 1-D parameters (biases, norm weights) that the next step updates."""
    decayed: dict[Tensor, list[float]] = {}
    for group in setup.groups:
        wd = as_float(group.get("weight_decay")) or 0.0
        for p in group["params"]:
            if wd > 0 and p.ndim <= 1 and setup.updated(p) and wd not in decayed.setdefault(p, []):
                decayed[p].append(wd)
    decayed = {p: wds for p, wds in decayed.items() if wds}
    if not decayed:
        return []
    names = [setup.name_of(p) for p in decayed]
    return [_finding(
        "decay_on_1d",
        f"weight decay on {len(decayed)} 1-D parameter(s) (biases, norm weights), which usually should not "
        f"decay: {few(names)}",
        names,
        weight_decay={setup.name_of(p): wds for p, wds in decayed.items()},
        groups={setup.name_of(p): sorted({gi for gi, _ in setup.where[p]}) for p in decayed},
    )]


def _predicted_state_dtype(optimizer: torch.optim.Optimizer, p: Tensor) -> torch.dtype | None:
    """The dtype of the moments the optimizer will create for ``p``, where it is known before any step."""
    from offload_adamw.optim.optimizer import OffloadAdamW

    if isinstance(optimizer, OffloadAdamW):
        return torch.float64 if p.dtype == torch.float64 else torch.float32
    if type(optimizer).__module__.startswith("torch.optim"):
        return p.dtype  # torch's optimizers allocate their state with zeros_like(param)
    return None


def low_precision_state(setup: LiveSetup) -> list[AuditFinding]:
    """Optimizer state narrower than float32, existing or (before the first step) predicted."""
    narrow: dict[str, dict[str, str]] = {}
    for p in setup.where:
        state = setup.optimizer.state.get(p) or {}
        low = {
            k: dtype_label(v.dtype)
            for k, v in state.items()
            if isinstance(v, Tensor) and v.is_floating_point() and v.element_size() < _STATE_WIDTH_BYTES
        }
        if not state and setup.updated(p):
            predicted = _predicted_state_dtype(setup.optimizer, p)
            if predicted is not None and predicted.is_floating_point and predicted.itemsize < _STATE_WIDTH_BYTES:
                low = {"moments (at the first step)": dtype_label(predicted)}
        if low:
            narrow[setup.name_of(p)] = low
    if not narrow:
        return []
    return [_finding(
        "low_precision_state",
        f"{len(narrow)} parameter(s) have optimizer state narrower than float32: small updates and weight "
        f"decay round away, and no float32 master exists (docs/contract.md, section State precision): "
        f"{by_dtype(narrow)}",
        list(narrow),
        dtypes=narrow,
    )]


# ------------------------------------------------------------------------------- a saved state_dict


def saved_duplicate_in_optimizer(setup: SavedSetup) -> list[AuditFinding]:
    """Ids listed in two places, and names saved for two ids (each makes a by-name load ambiguous)."""
    # torch numbers each tensor once, so a tensor listed twice has one id in two places; two ids under one
    # name make a by-name load ambiguous. Both are duplicates, each reported once under its name.
    twice: dict[str, list[tuple[int, int]]] = {}
    for pid, pl in setup.id_places.items():
        if len(pl) > 1:
            twice[setup.names[pid]] = pl
    for name, pids in setup.name_ids.items():
        if len(pids) > 1:
            twice.setdefault(name, sorted(gj for pid in pids for gj in setup.id_places[pid]))
    if not twice:
        return []
    return [_finding(
        "duplicate_in_optimizer",
        f"{len(twice)} parameter(s) appear more than once in the saved groups: {few(list(twice))}",
        list(twice),
        places={n: [list(gj) for gj in pl] for n, pl in twice.items()},
    )]


def state_without_group(setup: SavedSetup) -> list[AuditFinding]:
    """State entries whose id is in no parameter group."""
    orphans = [pid for pid in setup.state if pid not in setup.names]
    if not orphans:
        return []
    return [_finding(
        "state_without_group",
        f"{len(orphans)} state entr(y/ies) belong to no parameter group: ids {few([str(o) for o in orphans])}",
        [f"id {o}" for o in orphans],
    )]


def saved_decay_on_1d(setup: SavedSetup) -> list[AuditFinding]:
    """Weight decay on parameters whose state is 1-D; a parameter without state has no known shape (a note)."""
    decayed: dict[str, float] = {}
    unknown_shape = 0
    for group in setup.groups:
        wd = as_float(group.get("weight_decay")) or 0.0
        for pid in group.get("params", []):
            shape = setup.shape_of(pid)
            if shape is None:
                unknown_shape += 1
            elif wd > 0 and len(shape) <= 1:
                decayed.setdefault(setup.names[pid], wd)
    if unknown_shape:
        setup.notes.append(f"{unknown_shape} parameter(s) have no state yet (never stepped, or frozen): their shape is unknown")
    if not decayed:
        return []
    return [_finding(
        "decay_on_1d",
        f"weight decay on {len(decayed)} 1-D parameter(s) (by the shape of their state): {few(list(decayed))}",
        list(decayed),
        weight_decay=decayed,
    )]


def saved_low_precision_state(setup: SavedSetup) -> list[AuditFinding]:
    """Saved state tensors narrower than float32."""
    narrow: dict[str, dict[str, str]] = {}
    for pid, entry in setup.state.items():
        low = {
            k: dtype_label(v.dtype)
            for k, v in (entry or {}).items()
            if isinstance(v, Tensor) and v.is_floating_point() and v.element_size() < _STATE_WIDTH_BYTES
        }
        if low:
            narrow[setup.names.get(pid, f"id {pid}")] = low
    if not narrow:
        return []
    return [_finding(
        "low_precision_state",
        f"{len(narrow)} parameter(s) have state narrower than float32: {by_dtype(narrow)}",
        list(narrow),
        dtypes=narrow,
    )]


# ------------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Check:
    """One kind of finding: its severity and the functions that look for it."""

    kind: str
    """The ``kind`` of the findings it reports."""
    severity: str
    """``error`` (the run computes something else than intended), ``warning`` (probably unintended) or ``info``."""
    of_setup: Callable[[LiveSetup], list[AuditFinding]] | None
    """Its findings in a live set-up; None where a live set-up cannot have them."""
    of_state_dict: Callable[[SavedSetup], list[AuditFinding]] | None
    """Its findings in a saved state_dict; None where a state_dict alone cannot tell."""


#: in the order they run; within a severity the findings keep this order.
CHECKS: tuple[Check, ...] = (
    Check("invalid_hyperparameter", "error", invalid_hyperparameter, invalid_hyperparameter),
    Check("missing_from_optimizer", "error", missing_from_optimizer, None),
    Check("duplicate_in_optimizer", "error", duplicate_in_optimizer, saved_duplicate_in_optimizer),
    Check("not_in_model", "error", not_in_model, None),
    Check("frozen_with_grad", "error", frozen_with_grad, None),
    Check("name_mismatch", "error", name_mismatch, None),
    # a live optimizer's state is keyed by the tensors themselves: only a saved one can hold an orphan id
    Check("state_without_group", "error", None, state_without_group),
    Check("decay_on_1d", "warning", decay_on_1d, saved_decay_on_1d),
    Check("low_precision_state", "warning", low_precision_state, saved_low_precision_state),
    Check("empty_group", "warning", empty_group, empty_group),
    Check("weight_decay_shrink", "info", weight_decay_shrink, saved_weight_decay_shrink),
)

#: every kind of finding -> its severity.
KINDS: dict[str, str] = {check.kind: check.severity for check in CHECKS}
