"""The errors of checkpoints, and the :class:`LoadReport` that ``load`` returns and a mismatch carries.

No torch: a caller may catch these without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint is incomplete or damaged (no commit marker, a checksum or size mismatch)."""


class CheckpointMismatch(CheckpointError, ValueError):
    """A checkpoint that does not fit the model/optimizer/scheduler; ``report`` names every culprit."""

    def __init__(self, report: LoadReport):
        self.report = report
        lines = "\n  - ".join(report.problems)
        super().__init__(
            f"cannot load checkpoint {report.path} ({len(report.problems)} problem(s)); "
            f"model, optimizer and scheduler were not changed:\n  - {lines}"
        )


@dataclass
class LoadReport:
    """What ``load`` found and did. Entry names are fully qualified model state names."""

    path: str
    """The checkpoint directory read (the kept previous one where :func:`resolve` found only that)."""
    step: int | None = None
    """The training step recorded at save time."""
    extra: Any = None
    """The ``extra`` object given to ``save``."""
    loaded: list[str] = field(default_factory=list)
    """Model entries restored from the checkpoint."""
    missing: list[str] = field(default_factory=list)
    """Model entries with no counterpart in the checkpoint."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint entries with no counterpart in the model."""
    wrong_shape: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    """name -> (shape in the checkpoint, shape in the model)."""
    wrong_dtype: dict[str, tuple[str, str]] = field(default_factory=dict)
    """name -> (dtype in the checkpoint, dtype in the model)."""
    group_mismatch: list[str] = field(default_factory=list)
    """Parameters optimized in another group (or not at all) on one side."""
    problems: list[str] = field(default_factory=list)
    """One sentence per problem, naming its culprit; empty when everything matched."""
    optimizer_restored: bool = False
    """Whether the optimizer's groups and states were replaced."""
    scheduler_restored: bool = False
    """Whether the scheduler's state was replaced."""
    rng_restored: bool = False
    """Whether the RNG states were restored (those of the generators this process has: see ``rng_skipped``)."""
    rng_skipped: dict[str, str] = field(default_factory=dict)
    """RNG states the checkpoint holds that were not (all) restored here, by generator, with the reason:
    ``"cuda"`` where this process has no CUDA device, or another number of them than the saving process."""

    @property
    def ok(self) -> bool:
        return not self.problems
