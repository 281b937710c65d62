"""Is my optimizer still AdamW? The conformance checker (:mod:`offload_adamw.conformance.checker`).

Names are resolved on first use (PEP 562), so that :mod:`offload_adamw.conformance.report` imports
without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["CLAUSES", "CandidateLoadError", "ClauseResult", "HyperMapping", "Report", "UsageError", "check", "load_candidate",
           "parse_dtype"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("offload_adamw.conformance.checker"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'offload_adamw.conformance' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from offload_adamw.conformance.checker import (
        CLAUSES,
        CandidateLoadError,
        ClauseResult,
        HyperMapping,
        Report,
        UsageError,
        check,
        load_candidate,
        parse_dtype,
    )
