"""The timeline of one optimizer step: when each bucket's gradient, update and copies happened.

Contract: times are ``time.monotonic()`` seconds on the host. Per bucket (or FSDP group) a
:class:`BucketTimes` records when its last gradient was ready (the hook fired, or the step found it),
when its copy to the host was complete, when its host update started and ended, and when its copy
back was complete (equal to the update's end where nothing goes back). :class:`StepTimeline` adds
the end of backward and derives ``overlap``: the fraction of host-update time that ran before
backward ended, 0 when every update starts after backward and 1 when all of it is hidden.

:class:`Recorder` collects those moments during a step (when each parameter's gradient landed, when a
synchronous copy of it ended) and turns the step's update records into its :class:`StepTimeline`.

``gantt_png`` draws the timeline as a Gantt chart, one row per stream or thread (gradients ready,
device-to-host copies, host updates, host-to-device copies), with backward's end as a line.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.colors import ListedColormap

__all__ = ["BucketTimes", "Recorder", "StepTimeline"]


@dataclass(frozen=True, kw_only=True)
class BucketTimes:
    """The moments of one bucket's trip through a step (monotonic seconds)."""

    label: str
    """Which bucket or FSDP group (its first parameter's name, or its index)."""
    grad_ready: float
    """The last gradient of the bucket was produced."""
    d2h_done: float
    """Its gradients were complete in host memory."""
    update_start: float
    """Its host update started."""
    update_end: float
    """Its host update ended."""
    h2d_done: float
    """Its updated parameters were back on the device (update_end where nothing goes back)."""

    def __post_init__(self) -> None:
        order = (self.grad_ready, self.d2h_done, self.update_start, self.update_end, self.h2d_done)
        names = ("grad_ready", "d2h_done", "update_start", "update_end", "h2d_done")
        for (a, b), (na, nb) in zip(zip(order, order[1:]), zip(names, names[1:])):
            if b < a and nb != "update_start":  # an update may start before its own copy reports (it waits inside)
                raise ValueError(f"bucket {self.label!r}: {nb} ({b}) is before {na} ({a})")


@dataclass(frozen=True, kw_only=True)
class StepTimeline:
    """One step's buckets and the end of its backward."""

    buckets: tuple[BucketTimes, ...]
    backward_end: float
    """The end of backward: the last gradient hook of the step, or the call of step() when later hooks did not run."""
    rows: dict[str, str] = field(default_factory=dict)
    """Optional names of the rows (stream or thread) for the chart."""

    @property
    def update_seconds(self) -> float:
        return sum(b.update_end - b.update_start for b in self.buckets)

    @property
    def overlap(self) -> float:
        """The fraction of host-update time that ran before backward ended."""
        total = self.update_seconds
        if total <= 0:
            return 0.0
        hidden = sum(max(0.0, min(b.update_end, self.backward_end) - b.update_start) for b in self.buckets)
        return hidden / total

    @property
    def start(self) -> float:
        return min([b.grad_ready for b in self.buckets], default=self.backward_end)

    def as_dict(self) -> dict[str, Any]:
        """Times relative to the first gradient, for JSON."""
        t0 = self.start
        return {
            "backward_end_s": self.backward_end - t0,
            "overlap": self.overlap,
            "buckets": [
                {k: (getattr(b, k) - t0 if k != "label" else b.label)
                 for k in ("label", "grad_ready", "d2h_done", "update_start", "update_end", "h2d_done")}
                for b in self.buckets
            ],
        }

    def gantt_png(self, path: str | Path, *, title: str | None = None) -> Path:
        """Draw the timeline (matplotlib, imported here) and write it to ``path``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t0 = self.start
        rows = [("device-to-host copies", "d2h"), ("host updates", "update"), ("host-to-device copies", "h2d")]
        fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.6))
        # tab20 is a ListedColormap (get_cmap is typed as the base class); its colors: a list of RGB tuples
        colors: Any = cast("ListedColormap", plt.get_cmap("tab20")).colors
        for index, b in enumerate(self.buckets):
            color = colors[index % len(colors)]
            spans = {
                "d2h": (b.grad_ready, b.d2h_done),
                "update": (b.update_start, b.update_end),
                "h2d": (b.update_end, b.h2d_done),
            }
            for row, (_, key) in enumerate(rows):
                lo, hi = spans[key]
                if hi > lo:
                    ax.barh(row, (hi - lo) * 1e3, left=(lo - t0) * 1e3, color=color, edgecolor="black", linewidth=0.3)
        ax.axvline((self.backward_end - t0) * 1e3, color="red", linestyle="--", label="end of backward")
        ax.set_yticks(range(len(rows)), [self.rows.get(key, label) for label, key in rows])
        ax.invert_yaxis()
        ax.set_xlabel("ms since the first gradient")
        ax.set_title(title or f"optimizer step timeline: overlap {self.overlap:.2f}")
        ax.legend(loc="lower right")
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=120)
        plt.close(fig)
        return out


class Recorder:
    """The moments of one step, as they happen (monotonic seconds), keyed by parameter."""

    def __init__(self) -> None:
        self._landed: dict[Hashable, float] = {}
        self._copied: dict[Hashable, float] = {}
        self.latest: StepTimeline | None = None
        """The timeline of the latest step, or None before the first."""

    def landed(self, key: Hashable, *, copied: bool) -> None:
        """``key``'s gradient landed now (``copied``: its copy to the host is already complete)."""
        now = time.monotonic()
        self._landed[key] = now
        if copied:
            self._copied[key] = now

    def landed_at(self, keys: Iterable[Hashable], default: float) -> float:
        return max((self._landed.get(k, default) for k in keys), default=default)

    def copies_done(self, keys: Sequence[Hashable]) -> float:
        """When the copies of ``keys`` were complete: the latest synchronous one, else now (their waits returned)."""
        copied = [self._copied[k] for k in keys if k in self._copied]
        return max(copied) if keys and len(copied) == len(keys) else time.monotonic()

    def finish(self, records: Sequence[Any], step_called: float) -> None:
        """The step's timeline from its update records (accel/overlap.py's UpdateRecord); a new step begins."""
        backward_end = max(self._landed.values(), default=step_called)
        buckets = []
        for r in records:
            d2h = r.extra.get("d2h_done", r.start)
            buckets.append(BucketTimes(
                label=str(r.bucket), grad_ready=min(r.ready, d2h), d2h_done=d2h, update_start=r.start,
                update_end=r.end, h2d_done=max(r.end, r.extra.get("h2d_issued", r.end)),
            ))
        self.latest = StepTimeline(buckets=tuple(buckets), backward_end=backward_end)
        self._landed = {}
        self._copied = {}
