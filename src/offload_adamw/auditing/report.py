"""The audit's result: its findings, one summary per parameter group, and what could not be checked.

Contract: an :class:`AuditReport` holds every :class:`AuditFinding` (errors first, then warnings, then
information), a :class:`GroupSummary` per parameter group and the notes; ``to_dict`` is the JSON document's
body (``offload-adamw audit --json``), ``to_table`` the terminal tables (the last column wrapped to the
terminal's width).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from offload_adamw._output import render_table

__all__ = ["AuditFinding", "GroupSummary", "AuditReport"]


@dataclass(frozen=True, kw_only=True)
class AuditFinding:
    """One fault (or, with severity ``info``, one fact) of the set-up."""

    kind: str
    """One of :data:`KINDS`."""
    severity: str
    """``error`` (the run computes something else than intended), ``warning`` (probably unintended) or ``info``."""
    message: str
    """One sentence for a person, naming the culprits."""
    params: tuple[str, ...] = ()
    """The culprit tensors, one canonical name each, each once."""
    group: int | None = None
    """The parameter group for group-level findings."""
    details: dict[str, Any] = field(default_factory=dict)
    """Machine-readable facts (JSON-serialisable)."""


@dataclass(frozen=True, kw_only=True)
class GroupSummary:
    """What one parameter group holds."""

    index: int
    """Position in ``optimizer.param_groups``."""
    label: str
    """The group's ``rule`` (from :func:`param_groups`) or ``group <index>``."""
    lr: float | None
    """The group's current learning rate."""
    weight_decay: float | None
    """The group's weight decay."""
    tensors: int
    """Number of parameter entries in the group."""
    elements: int | None
    """Number of elements in the group (None when unknown, from a state_dict without state)."""
    param_dtypes: tuple[str, ...]
    """dtypes of the parameters (empty when unknown)."""
    state_dtypes: tuple[str, ...]
    """dtypes of the floating-point state tensors that exist (moments, masters, steps)."""


@dataclass(frozen=True, kw_only=True)
class AuditReport:
    """The result of an audit: findings, per-group summary and what could not be checked."""

    source: str
    """What was audited (``model + optimizer`` or a file)."""
    findings: tuple[AuditFinding, ...]
    """Every finding, errors first."""
    groups: tuple[GroupSummary, ...]
    """One row per parameter group."""
    notes: tuple[str, ...] = ()
    """Checks that could not be made, and why."""

    @property
    def faults(self) -> tuple[AuditFinding, ...]:
        """Findings of severity ``error`` or ``warning``."""
        return tuple(f for f in self.findings if f.severity != "info")

    def of_kind(self, kind: str) -> tuple[AuditFinding, ...]:
        """The findings of one kind."""
        return tuple(f for f in self.findings if f.kind == kind)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "faults": len(self.faults),
            "findings": [asdict(f) for f in self.findings],
            "groups": [asdict(g) for g in self.groups],
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        """The report as JSON (findings, groups, notes)."""
        return json.dumps(self.to_dict(), indent=2)

    def to_table(self) -> str:
        """The report as terminal tables: the groups, then the findings."""
        rows = [
            [
                str(g.index),
                g.label,
                _fmt(g.lr),
                _fmt(g.weight_decay),
                str(g.tensors),
                "?" if g.elements is None else f"{g.elements:,}",
                ",".join(g.param_dtypes) or "?",
                ",".join(g.state_dtypes) or "-",
            ]
            for g in self.groups
        ]
        lines = [f"audit of {self.source}", ""]
        lines += _table(["group", "rule", "lr", "weight_decay", "tensors", "elements", "param dtype", "state dtype"], rows)
        lines.append("")
        if self.findings:
            lines += _table(
                ["severity", "kind", "group", "finding"],
                [[f.severity, f.kind, "" if f.group is None else str(f.group), f.message] for f in self.findings],
            )
        else:
            lines.append("no findings")
        errors = sum(f.severity == "error" for f in self.findings)
        warns = sum(f.severity == "warning" for f in self.findings)
        lines += ["", f"{errors} error(s), {warns} warning(s)"]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.6g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    # The last column (a message) is wrapped to the terminal instead of widening every row.
    return render_table(header, rows, wrap=len(header) - 1).splitlines()
