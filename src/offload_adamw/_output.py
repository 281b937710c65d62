"""What every report prints: one table renderer and one JSON convention.

This module imports nothing from the package (and no torch), so every layer may use it: the tool
packages render their reports with it and the command line (:mod:`offload_adamw.cli.common`)
writes their JSON with it.

Contract:

* :func:`render_table` lays out rows in columns that fit :func:`terminal_width` (which honours
  ``COLUMNS``, then the terminal, else 100). When the columns are too wide together, the ``wrap``
  column (default: the widest left-aligned one) is wrapped onto continuation lines, never cut;
  when even that cannot make it fit (many wide numeric columns), the table is printed wider.
* :func:`finite_json` returns a copy of a JSON-like document holding only what strict JSON can
  write: every non-finite float (inf, -inf, nan) becomes ``null`` and its path is listed in the
  document's top-level ``"nonfinite"`` object, e.g. ``{"results[7].deviation": "inf"}``. JSON
  documents never carry ``"inf"`` as a string for a number.
* :data:`SCHEMA_VERSION` is the version of the documents' layout; :func:`json_document` puts it
  first in every document, with the command that wrote it.
* :func:`file_kind` names what a file is ("a FIFO (named pipe)", "a directory", ...), for the
  messages that refuse something other than a regular file (checkpoints, the command line's inputs).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import stat
import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["SCHEMA_VERSION", "terminal_width", "render_table", "finite_json", "json_document", "file_kind"]

SCHEMA_VERSION = 1
"""Layout version of every JSON document the project writes; raised when a key changes meaning or goes away."""

DEFAULT_WIDTH = 100


def terminal_width(default: int = DEFAULT_WIDTH) -> int:
    """Columns available: ``COLUMNS`` when set, else the terminal's, else ``default``."""
    return max(20, shutil.get_terminal_size((default, 24)).columns)


def render_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    align: str | None = None,
    wrap: int | None = None,
    width: int | None = None,
    gap: int = 2,
) -> str:
    """``headers`` over a dashed rule over ``rows``; cells are strings.

    ``align`` has one letter per column, ``l`` or ``r`` (default: all left). ``wrap`` is the index
    of the column that is wrapped when the table is wider than ``width`` (default: the widest
    left-aligned column; default width: :func:`terminal_width`).
    """
    n = len(headers)
    if any(len(r) != n for r in rows):
        raise ValueError(f"every row needs {n} cells")
    align = align or "l" * n
    if len(align) != n or set(align) - {"l", "r"}:
        raise ValueError(f"align must be {n} letters l or r, got {align!r}")
    width = width or terminal_width()
    widths = [max([len(headers[i]), *(len(r[i]) for r in rows)]) for i in range(n)]
    total = sum(widths) + gap * (n - 1)
    if total > width:
        if wrap is None:
            left = [i for i in range(n) if align[i] == "l"] or list(range(n))
            wrap = max(left, key=lambda i: widths[i])
        room = width - (total - widths[wrap])
        widths[wrap] = max(room, min(12, widths[wrap]))  # below 12 columns wrapping helps nobody
    sep = " " * gap

    def lines_of(cells: Sequence[str]) -> list[str]:
        columns = [textwrap.wrap(c, widths[i], break_on_hyphens=False) or [""] if i == wrap and len(c) > widths[i] else [c]
                   for i, c in enumerate(cells)]
        height = max(len(c) for c in columns)
        out = []
        for k in range(height):
            parts = []
            for i, column in enumerate(columns):
                cell = column[k] if k < len(column) else ""
                parts.append(cell.rjust(widths[i]) if align[i] == "r" else cell.ljust(widths[i]))
            out.append(sep.join(parts).rstrip())
        return out

    out = lines_of(headers)
    out.append(sep.join("-" * w for w in widths))
    for row in rows:
        out.extend(lines_of(row))
    return "\n".join(out)


def finite_json(document: Any) -> Any:
    """A copy of ``document`` with non-finite floats as None, their paths listed under ``"nonfinite"``.

    Dataclasses become dicts, tuples become lists, other non-JSON values their ``str()``.
    """
    found: dict[str, str] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
            return value
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            found[path] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            return None
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if isinstance(value, dict):
            return {str(k): walk(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
            return walk(value.item(), path)  # a 0-d tensor or numpy scalar
        return str(value)

    clean = walk(document, "")
    if found:
        if not isinstance(clean, dict):
            raise ValueError("a JSON document with non-finite values must be an object (they are listed in it)")
        clean["nonfinite"] = {**clean.get("nonfinite", {}), **found}
    return clean


def json_document(command: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as a JSON document of ``command``: schema_version and command first, finite numbers only."""
    return finite_json({"schema_version": SCHEMA_VERSION, "command": command, **body})


def file_kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words: "a regular file", "a directory", "a FIFO (named pipe)", ..."""
    kinds = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((words for test, words in kinds if test(mode)), "a special file")
