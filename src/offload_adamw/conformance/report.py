"""The result of a conformance check: one verdict per clause, as a table and as JSON.

Contract: a :class:`Report` holds one :class:`ClauseResult` per clause run, in clause
order. ``verdict`` is one of ``pass``, ``fail`` (the property was measured and is broken),
``error`` (the candidate raised, hung past the time limit, or ended the process: the
property could not be measured, which never counts as a pass), ``n/a`` (the property
cannot apply to this candidate) and ``info`` (reported, never judged). ``deviation`` is
the measured distance that decided the verdict (relative, see each clause), or None
where the clause measures no distance. A report is *conforming* when no clause fails or
errs and the update rule (clause 1), where it was run, passed: a candidate whose update
rule cannot be compared in full (no betas; no eps argument, where its own eps fits, so that
where eps goes is not seen) is not shown to be AdamW. ``to_json()`` holds
only JSON types, with ``schema_version`` 1: a non-finite deviation is ``null`` there and its path
is listed under ``"nonfinite"`` (:func:`offload_adamw._output.finite_json`). ``to_table()`` fits the
terminal's width (``COLUMNS``).
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any

from offload_adamw._output import finite_json, render_table, terminal_width

__all__ = ["VERDICTS", "SCHEMA_VERSION", "ClauseResult", "Report"]

VERDICTS = ("pass", "fail", "error", "n/a", "info")
SCHEMA_VERSION = 1
UPDATE_RULE_CLAUSE = 1


@dataclass(frozen=True, kw_only=True)
class ClauseResult:
    """The outcome of one clause for one candidate."""

    number: int
    """Clause number (1-15), as listed in :mod:`offload_adamw.conformance`."""
    name: str
    """What the clause checks, in a few words."""
    verdict: str
    """``pass``, ``fail``, ``error``, ``n/a`` or ``info``."""
    deviation: float | None
    """The measured deviation that decided the verdict (None when nothing is measured)."""
    consequence: str
    """One line on what breaking this clause does to training."""
    detail: str
    """What was measured or observed, including the candidate's error when it raised."""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")


def _format_deviation(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return f"{value:.2e}"


@dataclass(kw_only=True)
class Report:
    """Every clause's result for one candidate."""

    candidate: str
    """How the candidate was named (spec string or qualified name of the factory)."""
    dtype: str
    """Parameter dtype the clauses ran with (clause 8 adds bf16 and fp16 itself)."""
    device: str
    """Device of the parameters."""
    results: list[ClauseResult] = field(default_factory=list)
    """One result per clause run, in clause order."""
    seconds: float = 0.0
    """Wall time of the whole check."""
    timeout: float | None = None
    """The time limit of each clause in seconds (None: the clauses ran in this process, unlimited)."""

    @property
    def failed(self) -> list[ClauseResult]:
        """Clauses that fail or err (the candidate raised, hung or exited)."""
        return [r for r in self.results if r.verdict in ("fail", "error")]

    @property
    def unproven(self) -> str | None:
        """Why a report without failures still does not show AdamW (None when it does, or when nothing failed to show it)."""
        for r in self.results:
            if r.number == UPDATE_RULE_CLAUSE and r.verdict == "n/a":
                first_line = r.detail.splitlines()[0] if r.detail else ""
                return f"the update rule (clause {UPDATE_RULE_CLAUSE}) could not be compared with AdamW's: {first_line}"
        return None

    @property
    def conforming(self) -> bool:
        return not self.failed and self.unproven is None

    def result(self, number: int) -> ClauseResult:
        for r in self.results:
            if r.number == number:
                return r
        raise KeyError(f"clause {number} was not run")

    def to_json(self) -> dict[str, Any]:
        return finite_json({
            "schema_version": SCHEMA_VERSION,
            "candidate": self.candidate,
            "dtype": self.dtype,
            "device": self.device,
            "seconds": round(self.seconds, 3),
            "timeout": self.timeout,
            "conforming": self.conforming,
            "unproven": self.unproven,
            "failed": [r.number for r in self.failed],
            "results": [asdict(r) for r in self.results],
        })

    def to_table(self, width: int | None = None) -> str:
        """A terminal table (clause, verdict, deviation, consequence), then the details."""
        width = width or terminal_width()
        rows = [[str(r.number), r.name, r.verdict.upper() if r.verdict in ("fail", "error") else r.verdict,
                 _format_deviation(r.deviation), r.consequence] for r in self.results]
        lines = [
            f"conformance of {self.candidate} to the AdamW contract "
            f"({self.dtype} parameters on {self.device}, {self.seconds:.1f} s)",
            "the section of the contract each clause checks: docs/contract.md, section Checker clauses",
            "",
        ]
        lines.append(render_table(["#", "clause", "verdict", "deviation", "consequence when broken"], rows,
                                  align="rllrl", wrap=4, width=width))
        lines.append("")
        verdicts = {v: sum(r.verdict == v for r in self.results) for v in VERDICTS}
        lines.append("  ".join(f"{n} {v}" for v, n in verdicts.items()))
        if self.unproven:
            lines.append(f"not shown to be AdamW: {self.unproven}")
        lines.append("")
        for r in self.results:
            lines.append(f"[{r.number}] {r.name}: {r.verdict}")
            for paragraph in r.detail.splitlines() or [""]:
                lines.extend("    " + s for s in (textwrap.wrap(paragraph, max(20, width - 4)) or [""]))
        return "\n".join(lines)
