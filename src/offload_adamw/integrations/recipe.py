"""Recipe files in the ``_component_`` style (torchtune, and Hydra's ``_target_`` alike).

A node is a mapping whose ``_component_`` is the dotted path of a callable
(``offload_adamw.OffloadAdamW``) and whose other keys are its keyword arguments::

    optimizer:
      _component_: offload_adamw.OffloadAdamW
      lr: 3.0e-4
      betas: [0.9, 0.95]
      weight_decay: 0.1

Contract of :func:`instantiate`: ``instantiate(node, *args, **kwargs)`` imports the
callable and calls it with ``args`` first, then the node's keys, then ``kwargs`` (which win),
as torchtune's ``config.instantiate`` does; nested nodes (values that are mappings with a
``_component_``) are built first. A missing ``_component_``, a path that does not import, or a
name the module lacks raises ValueError naming it. Building an optimizer from a recipe::

    optimizer = instantiate(recipe["optimizer"], named_param_groups(model, rules))

No import of torch or of a recipe tool here; torchtune's own ``instantiate`` reads the same file.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

__all__ = ["COMPONENT_KEY", "resolve", "instantiate"]

COMPONENT_KEY = "_component_"


def resolve(path: str) -> Any:
    """The object named by a dotted path ``package.module.Name`` (the longest importable module prefix)."""
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"{COMPONENT_KEY} must be a dotted path such as 'offload_adamw.OffloadAdamW', got {path!r}")
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if not (module_name == missing or module_name.startswith(missing + ".")):
                raise  # the module exists but one of its own imports is missing: show that
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                raise ValueError(f"{COMPONENT_KEY} {path!r}: {obj.__name__ if hasattr(obj, '__name__') else obj!r} "
                                 f"has no attribute {attribute!r}")
            obj = getattr(obj, attribute)
        return obj
    raise ValueError(f"{COMPONENT_KEY} {path!r}: no module {parts[0]!r} to import")


def _build(value: Any) -> Any:
    if isinstance(value, Mapping) and COMPONENT_KEY in value:
        return instantiate(value)
    if isinstance(value, list):
        return [_build(v) for v in value]
    return value


def instantiate(node: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``node[_component_]`` with ``args``, the node's other keys and ``kwargs``; see the module docstring."""
    if not isinstance(node, Mapping) or COMPONENT_KEY not in node:
        raise ValueError(f"a recipe node needs a {COMPONENT_KEY!r} key, got {node!r}")
    target = resolve(node[COMPONENT_KEY])
    if not callable(target):
        raise ValueError(f"{COMPONENT_KEY} {node[COMPONENT_KEY]!r} is not callable")
    options = {k: _build(v) for k, v in node.items() if k != COMPONENT_KEY}
    options.update(kwargs)
    return target(*args, **options)
