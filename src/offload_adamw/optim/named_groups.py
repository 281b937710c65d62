"""Parameter groups built from fully qualified parameter names.

Contract of :func:`param_groups`:

* ``rules`` are applied in order. A rule is a pattern over fully qualified
  parameter names (``"transformer.h.0.ln_1.bias"``) together with the
  hyperparameters of its group. A pattern is a glob (``fnmatch`` syntax,
  case-sensitive, matched against the whole name, ``*`` crosses dots) unless it
  is a compiled ``re.Pattern`` or a string starting with ``"re:"``, which is a
  regular expression searched anywhere in the name (anchor it with ``^``/``$``).
* Only trainable parameters (``requires_grad=True``) are grouped. Each lands in
  exactly one group: the group of the first rule that matches one of its names,
  else the default group (``default=``, last). ``default=None`` makes an
  unmatched trainable parameter an error that names it. A default group with no
  parameter is left out, so no group is ever empty.
* A rule that takes no parameter is an error naming the rule: whether it matches
  no name at all, matches only frozen parameters, or matches only parameters
  that an earlier rule already took (a dead rule is a set-up bug, and it would
  give an empty group).
* Tied (shared) parameters (one tensor reachable under several names, such as
  GPT-2's ``transformer.wte.weight`` and ``lm_head.weight``) appear once. A rule
  matches a tied tensor when it matches any of its names.
* Each group carries ``param_names`` (one name per tensor, as
  ``torch.optim.Optimizer`` requires, so that torch's AdamW and OffloadAdamW
  key their state_dicts by name). For a tied tensor that name is its
  *canonical* name: the first under which ``model.named_parameters()`` yields
  it, which is the name ``named_parameters()`` keeps when it removes
  duplicates. Every name of every tied tensor is recorded in the group's
  ``tied_names``: ``{canonical name: [all names, canonical first]}`` (an empty
  dict when the group holds no tied tensor). Each group also carries ``rule``,
  the text of its pattern (``"<default>"`` for the default group), so that a
  group can be recognised in reports and in a saved state_dict.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch

from offload_adamw.contract.rules import ADAMW_GROUP_KEYS as TORCH_GROUP_KEYS
from offload_adamw.contract.rules import PLACEMENT_KEY

__all__ = ["Rule", "ParamGroupError", "named_param_groups", "param_groups", "as_rules", "ADAMW_GROUP_KEYS", "DEFAULT_GROUP_RULE"]

#: hyperparameter keys that a group of torch.optim.AdamW / OffloadAdamW understands
#: (plus ``initial_lr``, which lr schedulers add, and ``update_on``, where OffloadAdamW runs the update).
ADAMW_GROUP_KEYS = frozenset(TORCH_GROUP_KEYS) | {"initial_lr", PLACEMENT_KEY}
#: the ``rule`` entry of the group of parameters that no rule matched.
DEFAULT_GROUP_RULE = "<default>"
_RESERVED_KEYS = frozenset({"params", "param_names", "tied_names", "rule"})
_REGEX_PREFIX = "re:"


class ParamGroupError(ValueError):
    """Rules that do not give a well-formed set of groups; the message names the culprit."""


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One rule: the parameters whose names match ``pattern`` get ``hyper``."""

    pattern: str | re.Pattern[str]
    """A glob over the whole name, or a regex (compiled, or a string starting with ``"re:"``) searched in it."""
    hyper: Mapping[str, Any] = field(default_factory=dict)
    """The hyperparameters of the rule's group, e.g. ``{"weight_decay": 0.0}``; the optimizer's defaults fill the rest."""

    @property
    def text(self) -> str:
        """The pattern as the user wrote it (regexes keep their ``re:`` prefix)."""
        if isinstance(self.pattern, re.Pattern):
            return _REGEX_PREFIX + self.pattern.pattern
        return self.pattern

    def matches(self, name: str) -> bool:
        """Whether the fully qualified ``name`` matches this rule's pattern."""
        if isinstance(self.pattern, re.Pattern):
            return self.pattern.search(name) is not None
        if self.pattern.startswith(_REGEX_PREFIX):
            return re.search(self.pattern[len(_REGEX_PREFIX) :], name) is not None
        return fnmatch.fnmatchcase(name, self.pattern)


RuleLike: TypeAlias = Rule | tuple[Any, Mapping[str, Any]]


def as_rules(rules: Mapping[Any, Mapping[str, Any]] | Sequence[RuleLike]) -> list[Rule]:
    """``rules`` in any form :func:`named_param_groups` takes, as ``Rule`` objects; ParamGroupError names a malformed one."""
    if isinstance(rules, Mapping):
        items: Iterable[Any] = list(rules.items())
    else:
        items = rules
    out = []
    for index, item in enumerate(items):
        if isinstance(item, Rule):
            rule = item
        elif isinstance(item, tuple) and len(item) == 2:
            rule = Rule(pattern=item[0], hyper=item[1])
        else:
            raise ParamGroupError(f"rule {index} must be a Rule or a (pattern, hyperparameters) pair, got {item!r}")
        if not isinstance(rule.pattern, (str, re.Pattern)):
            raise ParamGroupError(f"rule {index}: the pattern must be a str or a compiled regex, got {rule.pattern!r}")
        if isinstance(rule.pattern, str) and rule.pattern.startswith(_REGEX_PREFIX):
            try:
                re.compile(rule.pattern[len(_REGEX_PREFIX) :])
            except re.error as exc:
                raise ParamGroupError(f"rule {index} {rule.text!r}: invalid regular expression: {exc}") from None
        if not isinstance(rule.hyper, Mapping):
            raise ParamGroupError(f"rule {index} {rule.text!r}: hyperparameters must be a mapping, got {rule.hyper!r}")
        out.append(rule)
    return out


def _check_hyper(where: str, hyper: Mapping[str, Any], known_keys: frozenset[str] | None) -> None:
    reserved = sorted(k for k in hyper if k in _RESERVED_KEYS)
    if reserved:
        raise ParamGroupError(f"{where}: {reserved} are set by param_groups, not by a rule")
    if known_keys is not None:
        unknown = sorted(k for k in hyper if k not in known_keys)
        if unknown:
            # A misspelt key (weight_decy) would otherwise sit in the group unused.
            raise ParamGroupError(
                f"{where}: unknown hyperparameter(s) {unknown}; known: {sorted(known_keys)} "
                "(pass known_keys=None for another optimizer)"
            )


def named_tensors(model: torch.nn.Module) -> dict[torch.Tensor, list[str]]:
    """Every parameter of ``model`` -> all its fully qualified names, canonical (first) first.

    Insertion order is the order of ``model.named_parameters()``.
    """
    names: dict[torch.Tensor, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    return names


def named_param_groups(
    model: torch.nn.Module,
    rules: Mapping[Any, Mapping[str, Any]] | Sequence[RuleLike],
    default: Mapping[str, Any] | None = {},
    *,
    known_keys: Iterable[str] | None = ADAMW_GROUP_KEYS,
) -> list[dict[str, Any]]:
    """Parameter groups of ``model``'s trainable parameters, from ordered name rules.

    Args:
        model: the module whose parameters are grouped.
        rules: ordered rules: ``Rule`` objects, ``(pattern, hyper)`` pairs, or a
            mapping ``{pattern: hyper}`` (its order is the rule order).
        default: hyperparameters of the group of trainable parameters no rule
            matched (``{}``: the optimizer's defaults); ``None`` makes such a
            parameter an error.
        known_keys: hyperparameter keys a rule may set (AdamW's by default);
            ``None`` accepts any key, for other optimizers.

    Returns:
        A list of group dicts for ``torch.optim.AdamW(groups)`` or
        ``OffloadAdamW(groups)``: ``params``, ``param_names``, ``tied_names``,
        ``rule`` and the rule's hyperparameters. See the module docstring.

    Raises:
        ParamGroupError: naming the rule that takes no parameter, the unknown
            hyperparameter, or (with ``default=None``) the unmatched parameters.
    """
    rule_list = as_rules(rules)
    keys = None if known_keys is None else frozenset(known_keys)
    for index, rule in enumerate(rule_list):
        _check_hyper(f"rule {index} {rule.text!r}", rule.hyper, keys)
    if default is not None:
        _check_hyper("default", default, keys)

    all_names = named_tensors(model)
    trainable = {p: names for p, names in all_names.items() if p.requires_grad}
    taken: set[torch.Tensor] = set()
    groups: list[dict[str, Any]] = []
    for index, rule in enumerate(rule_list):
        members = []
        earlier = []
        frozen = []
        for p, names in all_names.items():
            if not any(rule.matches(n) for n in names):
                continue
            if p not in trainable:
                frozen.append(names[0])
            elif p in taken:
                earlier.append(names[0])
            else:
                members.append(p)
        if not members:
            why = []
            if earlier:
                why.append(f"every trainable parameter it matches was taken by an earlier rule ({_few(earlier)})")
            if frozen:
                why.append(f"it matches only frozen parameters ({_few(frozen)})")
            if not why:
                why.append(f"it matches no parameter name (names look like {_few([v[0] for v in all_names.values()], 3)})")
            raise ParamGroupError(f"rule {index} {rule.text!r} takes no parameter: {'; '.join(why)}")
        taken.update(members)
        groups.append(_group(members, all_names, rule.text, rule.hyper))

    rest = [p for p in trainable if p not in taken]
    if rest:
        if default is None:
            raise ParamGroupError(
                f"{len(rest)} trainable parameter(s) match no rule and default=None: "
                f"{_few([all_names[p][0] for p in rest], 10)}"
            )
        groups.append(_group(rest, all_names, DEFAULT_GROUP_RULE, default))
    if not groups:
        raise ParamGroupError("the model has no trainable parameter")
    return groups


def _group(
    members: list[torch.Tensor], all_names: dict[torch.Tensor, list[str]], rule: str, hyper: Mapping[str, Any]
) -> dict[str, Any]:
    group: dict[str, Any] = {
        "params": list(members),
        "param_names": [all_names[p][0] for p in members],
        "tied_names": {all_names[p][0]: list(all_names[p]) for p in members if len(all_names[p]) > 1},
        "rule": rule,
    }
    group.update(dict(hyper))
    return group


def _few(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


#: the name this function had first; kept so that existing scripts keep working.
param_groups = named_param_groups
