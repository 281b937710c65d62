"""Loss scaling when the gradients live in host memory only.

Contract: :class:`OffloadGradScaler` is ``torch.amp.GradScaler`` for every optimizer, except that
for an optimizer whose ``host_gradient_holder()`` returns a holder (OffloadAdamW with freed device
gradients) it unscales and checks the holder's host gradients, with the same
``_amp_foreach_non_finite_check_and_unscale_`` op on the same values.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

__all__ = ["HostGradientHolder", "OffloadGradScaler"]


class HostGradientHolder(Protocol):
    """Gradients that live in host memory only, unscaled in place by GradScaler."""

    def unscale_(self, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool) -> dict[torch.device, Tensor]: ...


class OffloadGradScaler(torch.amp.GradScaler):
    """A drop-in ``torch.amp.GradScaler`` that also sees gradients living only in host memory.

    With ``OffloadAdamW(..., offload_gradients=True)`` the device gradients are
    freed during backward, so torch's GradScaler finds nothing to unscale or
    check. This subclass hands the unscale-and-check of such an optimizer to the
    optimizer's host gradients (the same ``_amp_foreach_non_finite_check_and_unscale_``
    op, on the same values); for every other optimizer it is torch's GradScaler.
    ``scaler.unscale_(opt)`` before clipping, ``scaler.step(opt)`` with the
    found_inf skip and ``scaler.update()`` work unchanged.
    """

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        holder_of = getattr(optimizer, "host_gradient_holder", None)
        holder = holder_of() if callable(holder_of) else None
        if holder is None:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        return holder.unscale_(inv_scale, found_inf, allow_fp16)
