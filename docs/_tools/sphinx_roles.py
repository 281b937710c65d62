"""Griffe extension: the Sphinx roles of this project's docstrings rendered as code with a link.

The docstrings are written with Sphinx roles (``:class:`~offload_adamw.accel.pipeline.Wiring```,
``:func:`resolve```). mkdocstrings renders Markdown, where a role would show as literal text. This extension
rewrites each role, before rendering, as a code span of the name (the last component where the role has ``~``)
inside an optional cross-reference to the object, resolved the way Sphinx resolves it: a dotted path as
written, a bare name in the scope of the object whose docstring holds it, then of its parents. The link is
drawn where the object has a page on the site; the name stays plain code where it has none.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|mod|func|meth|attr|data|exc|obj):`(~?)\.?([\w.]+)`")


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)  # type: ignore[arg-type]


def _resolve(root: griffe.Module, scope: griffe.Object | None, target: str) -> str | None:
    if target.split(".")[0] == root.name:
        node: Any = root
        for part in target.split(".")[1:]:
            if part not in node.members:
                return None
            node = node.members[part]
        return str(node.path)
    head = target.split(".")[0]
    while scope is not None:
        if head in scope.members:
            return f"{scope.members[head].path}{target[len(head):]}"
        try:
            return scope.resolve(target)
        except (griffe.NameResolutionError, ValueError):
            scope = scope.parent
    return None


def _rewrite(root: griffe.Module, obj: griffe.Object, text: str) -> str:
    def one(match: re.Match[str]) -> str:
        tilde, target = match.group(1), match.group(2)
        shown = target.rsplit(".", 1)[-1] if tilde else target
        path = _resolve(root, obj, target)
        code = f"<code>{html.escape(shown)}</code>"
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>' if path else code

    return ROLE.sub(one, text)


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _rewrite(pkg, obj, obj.docstring.value)
