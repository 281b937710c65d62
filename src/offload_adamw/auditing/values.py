"""How the audit reads what it inspects: numbers that may be one-element tensors, dtypes, groups, name lists."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["dtype_label", "few", "by_dtype", "as_float", "number", "is_number", "group_label"]


def dtype_label(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def few(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def by_dtype(narrow: Mapping[str, Mapping[str, str]]) -> str:
    """``{name: {state key: dtype}}`` -> "exp_avg bfloat16, exp_avg_sq bfloat16: a, b and 3 more; ..."."""
    by_kind: dict[str, list[str]] = defaultdict(list)
    for name, low in narrow.items():
        by_kind[", ".join(f"{k} {d}" for k, d in low.items())].append(name)
    return "; ".join(f"{kind}: {few(names)}" for kind, names in by_kind.items())


def as_float(x: Any) -> float | None:
    if x is None:
        return None
    if isinstance(x, Tensor):
        return float(x.item())
    return float(x)


def number(x: Any) -> float:
    """``x``, a number or a one-element tensor (``is_number``, or an lr of a param group), as a float."""
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def is_number(x: Any) -> bool:
    if isinstance(x, Tensor):
        return x.numel() == 1 and not x.is_complex()
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def group_label(group: Mapping[str, Any], index: int) -> str:
    rule = group.get("rule")
    return str(rule) if rule is not None else f"group {index}"
