"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks:``).

Pages other work writes are listed in the navigation before they exist; while one is absent it is left out of
the navigation (an info line says so) rather than failing the build, and it appears there once it lands.
Every other navigation entry must exist: a missing one stays in the list and fails the strict build.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

OPTIONAL_PAGES = frozenset({"checker.md", "integrations.md"})

log = logging.getLogger("mkdocs.hooks.optional_pages")


def _present(entry: Any, docs_dir: Path) -> Any:
    """The navigation entry without the optional pages that are absent (None where nothing is left)."""
    if isinstance(entry, str):
        if entry in OPTIONAL_PAGES and not (docs_dir / entry).is_file():
            log.info("docs/%s is absent: left out of the navigation", entry)
            return None
        return entry
    if isinstance(entry, list):
        kept = [e for e in (_present(item, docs_dir) for item in entry) if e is not None]
        return kept or None
    if isinstance(entry, dict):
        kept_dict = {title: v for title, value in entry.items() if (v := _present(value, docs_dir)) is not None}
        return kept_dict or None
    return entry


def on_config(config: Any) -> Any:
    if config["nav"] is not None:
        config["nav"] = _present(config["nav"], Path(config["docs_dir"])) or []
    return config
