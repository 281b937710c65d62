"""A table of cases of which CI runs a few: the rest are marked slow and run with ``-m slow`` (or no ``-m``).

A module that runs its cases in one worker process (2 gloo ranks) names its quick cases; :func:`table` turns its
cases into pytest parameters, the others marked ``slow``, and :func:`only` gives the worker's ``--only`` arguments:
the quick cases when the run leaves slow tests out, every case otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest


def table(values: Iterable[Any], ids: Sequence[str], quick: Iterable[str]) -> list[Any]:
    """pytest parameters of ``values`` with ``ids``; the ids not in ``quick`` are marked slow."""
    quick = set(quick)  # may name the cases of other tables of the module too: one worker runs them all
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=i, marks=() if i in quick else pytest.mark.slow)
            for v, i in zip(values, ids, strict=True)]


def only(config: pytest.Config, quick: Iterable[str]) -> list[str]:
    """The worker's ``--only`` arguments: the quick cases when this run deselects slow tests, else none (all)."""
    return ["--only", *quick] if "not slow" in (config.option.markexpr or "") else []
