"""Edits of the model copy between updates: the rule by which a master follows its parameter.

Contract (docs/contract.md#edits-between-steps): where the model copy of a tensor holds the
parameter's current value (a bf16 host parameter: the model copy is the parameter itself), an
element whose bits differ from round(master), the value the last update wrote there, was edited
(``model.load_state_dict``, ``clamp_``, a pruning mask, ``p.data.copy_``), and its master becomes
the element's exact widening before the update. An element that still equals round(master) keeps
its master, so the float32 precision of an untouched element is never lost. A NaN equals a NaN
(the payload of a NaN is not a value); -0.0 and 0.0 differ.

:func:`take_model_edits_` is that rule in torch operations, for the chunk loop, the for-loop and
the optimizer's own reads of a master between steps; the numba loop has it inside its one pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["edited", "take_model_edits_"]


def edited(master: Tensor, model: Tensor) -> Tensor:
    """The elements of ``model`` that differ from round(``master``) (NaN equals NaN, -0.0 differs from 0.0)."""
    rounded = master.to(model.dtype)
    differ = (rounded != model) | (torch.signbit(rounded) != torch.signbit(model))
    return differ & ~(torch.isnan(rounded) & torch.isnan(model))


def take_model_edits_(master: Tensor, model: Tensor) -> None:
    """``master`` takes the exact widening of every edited element of ``model`` (same shape; any strides)."""
    mask = edited(master, model)
    master.copy_(torch.where(mask, model.to(master.dtype), master))
