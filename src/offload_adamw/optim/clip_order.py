"""The order in which ``max_grad_norm=`` reduces the per-tensor gradient norms: the model's.

Contract:

* ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (what the HF Trainer and accelerate call)
  stacks the per-tensor norms in ``model.parameters()`` order, and the last bit of the total norm depends on
  that order. An optimizer's ``param_groups`` may list the parameters in another order (the Trainer's
  decay / no-decay split does), so clipping in the groups' order would drift from torch's clipping by that
  bit. :class:`ClipOrder` gives the optimizer's parameters in the model's order, so that ``max_grad_norm=``
  (every path: plain step, kept and freed gradients, updates during backward, FSDP2) and
  ``opt.clip_grad_norm_`` compute torch's bits.
* The model is the one given to ``opt.clip_order(model)`` (the Trainer route gives it); otherwise the one
  module, among the live ones, that holds every parameter of the optimizer and is held by no other module
  that does (wrappers such as DDP, ``torch.compile`` and PEFT hold the same parameters in the same order,
  and any of them gives the same order). It is searched once, weakly held, and searched again when the
  optimizer's parameters change (accelerate's swap to FSDP2 shards keeps the model object). Where no such
  module exists (the parameters of two models in one optimizer, a model that is gone) the order is the
  groups'.
* The optimizer's parameters the model does not hold come after the model's, in the groups' order.
  Nothing here holds a parameter: the cached order is weak references and indices.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["ClipOrder"]


class ClipOrder:
    """The optimizer's parameters in the order clipping reduces their norms (see the module contract)."""

    def __init__(self) -> None:
        self._given: weakref.ref[torch.nn.Module] | None = None
        self._found: weakref.ref[torch.nn.Module] | None = None
        self._params: list[weakref.ref[Tensor]] = []
        self._order: list[int] = []

    def use(self, model: torch.nn.Module) -> None:
        """Clip in ``model.parameters()``' order from now on."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"clip_order takes the model (a torch.nn.Module), got {type(model).__name__}")
        self._given = weakref.ref(model)
        self._params = []

    def of(self, params: Sequence[Tensor]) -> list[Tensor]:
        """``params`` (the groups' order) in the model's order."""
        if len(self._params) != len(params) or any(r() is not p for r, p in zip(self._params, params)):
            self._order = self._compute(params)
            self._params = [weakref.ref(p) for p in params]
        return [params[i] for i in self._order]

    def _compute(self, params: Sequence[Tensor]) -> list[int]:
        model = _alive(self._given) or _alive(self._found)
        if model is None or not _holds_all(model, params):
            model = _the_model(params)
            self._found = None if model is None else weakref.ref(model)
        index = {id(p): i for i, p in enumerate(params)}
        first = [] if model is None else [index.pop(id(p)) for p in model.parameters() if id(p) in index]
        return first + sorted(index.values())


def _alive(ref: weakref.ref[torch.nn.Module] | None) -> torch.nn.Module | None:
    return None if ref is None else ref()


def _holds_all(model: torch.nn.Module, params: Sequence[Tensor]) -> bool:
    held = {id(p) for p in model.parameters()}
    return all(id(p) in held for p in params)


def _the_model(params: Sequence[Tensor]) -> torch.nn.Module | None:
    """The outermost live module holding every one of ``params``; None when there is none, or several that disagree."""
    if not params:
        return None
    # type(), not isinstance(): isinstance() reads __class__, which a dead weakref.proxy among gc's objects raises on;
    # a module whose __init__ raised before Module.__init__ ran has no _modules or _parameters and is no model
    modules: list[Any] = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module)
                          and "_modules" in vars(o) and "_parameters" in vars(o)]
    inner = {id(child) for m in modules for child in m.children()}
    found = [m for m in modules if id(m) not in inner and _holds_all(m, params)]
    ours = {id(p) for p in params}
    orders = {tuple(id(p) for p in m.parameters() if id(p) in ours) for m in found}
    return found[0] if len(orders) == 1 else None
