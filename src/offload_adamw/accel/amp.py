"""Loss scaling when the gradients live in host memory only.

Contract: :class:`OffloadGradScaler` is ``torch.amp.GradScaler`` for every optimizer, except that
for an optimizer whose ``host_gradient_holder()`` returns a holder (OffloadAdamW with freed device
gradients) it unscales and checks the holder's host gradients, with the same
``_amp_foreach_non_finite_check_and_unscale_`` op on the same values.

:func:`unscale_gradients_` is that unscale-and-check for a holder whose gradients live in several places: host
buffers, a DTensor's stand-in (FSDP2), and the device gradients of groups updated on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from offload_adamw.distributed import local_tensor

__all__ = ["HostGradientHolder", "OffloadGradScaler", "unscale_gradients_"]


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


def unscale_gradients_(pairs: list[tuple[Tensor, Tensor]], inv_scale: Tensor, found_inf: Tensor,
                       allow_fp16: bool, on_device: Callable[[Tensor, Tensor], bool] | None = None,
                       to_device: Callable[[Tensor], Tensor] | None = None) -> dict[torch.device, Tensor]:
    """GradScaler's unscale-and-check over (parameter, local gradient) ``pairs``; found_inf stays on its device.

    ``on_device(p, grad)``: whether ``grad`` lives on the device (a streamed or resident group's), else in host memory
    (by default: whether it is not on the CPU). ``to_device``: how the host flag reaches ``found_inf``'s device without
    the host waiting (the transfer engine's), else ``.to``. The scale is read to the host (one wait for the device)
    only when a host gradient needs it."""
    if not allow_fp16 and any(g.dtype == torch.float16 for _, g in pairs):
        raise ValueError("Attempting to unscale FP16 gradients.")
    device_grad = on_device if on_device is not None else (lambda p, g: g.device.type != "cpu")
    by_kind: dict[tuple[torch.dtype, bool, torch.device, bool], list[Tensor]] = {}
    for p, g in pairs:
        grad = p.grad
        sharded = local_tensor(p) is not p and grad is not None and local_tensor(grad) is not grad
        by_kind.setdefault((g.dtype, sharded, g.device, device_grad(p, g)), []).append(
            grad if sharded and grad is not None else g)
    host_found: Tensor | None = None
    host_inv: Tensor | None = None
    for (_, sharded, device, on_dev), same in by_kind.items():
        if sharded:
            # DTensor gradients (FSDP2): DTensor's unscale reduces found_inf over the mesh, so that every rank
            # skips the step when one rank's shard has an inf, as torch's GradScaler on FSDP2 gradients does.
            found = torch.zeros_like(found_inf)
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv_scale)
            found_inf.add_(found)
        elif not on_dev:
            if host_inv is None:
                host_found = torch.zeros((), dtype=torch.float32)
                host_inv = inv_scale.detach().to("cpu", torch.float32)  # host gradients: the scale read once
            assert host_found is not None
            torch._amp_foreach_non_finite_check_and_unscale_(same, host_found, host_inv)
        else:  # a device gradient of a group updated on the device
            found = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv_scale.to(device, torch.float32))
            found_inf.add_(found.to(found_inf.device))
    if host_found is not None:
        found_inf.add_(host_found.to(found_inf.device) if to_device is None else to_device(host_found))
    return {found_inf.device: found_inf}


def step_scale(grad_scale: Tensor | None, host_groups: bool) -> Tensor | None:
    """The loss scale a step divides the gradients by, in float32: read to the host (a wait for the device, once per
    step) only where host groups' kernels need it; a streamed or resident group's kernel takes it where it is."""
    if grad_scale is None:
        return None
    return grad_scale.detach().to("cpu" if host_groups else grad_scale.device, torch.float32)
