"""The reference trajectories the clauses compare with, computed once per process (or installed from another).

Contract: :func:`_referenced` returns the value cached under a key, computing it on first use; a key names
everything its value depends on, so a value is never computed twice in a process nor used for another
question. :func:`install_references` adds values computed elsewhere (a child of the checker), which clause
children forked afterwards inherit; :func:`held` and :func:`holds` say what is here. Nothing else holds state
between checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

_REFERENCES: dict[tuple[Any, ...], Any] = {}
"""Reference trajectories and long-horizon data by key, computed once per process (or installed)."""


def _referenced(key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
    if key not in _REFERENCES:
        _REFERENCES[key] = compute()
    return _REFERENCES[key]


def holds(keys: Iterable[tuple[Any, ...]]) -> bool:
    """Whether every one of ``keys`` has its value here."""
    return all(key in _REFERENCES for key in keys)


def held() -> dict[tuple[Any, ...], Any]:
    """Every value here, by key (a copy: what a child sends back to the checker)."""
    return dict(_REFERENCES)


def install_references(values: Mapping[tuple[Any, ...], Any]) -> None:
    """Use ``values`` (from :func:`~offload_adamw.conformance.clauses.registry.prepare_references`, maybe computed in
    another process) from now on."""
    _REFERENCES.update(values)
