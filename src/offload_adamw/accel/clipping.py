"""Gradient-norm clipping that works wherever OffloadAdamW keeps the gradients.

Contract:

* :func:`clip_grad_norm_` computes and applies exactly what
  ``torch.nn.utils.clip_grad_norm_`` computes and applies to the same gradient
  tensors, in the same order: it calls torch's own ``get_total_norm`` and
  ``clip_grads_with_norm_`` on them, so the arithmetic is torch's by construction.
* Which tensors: for an ``OffloadAdamW`` whose device gradients are freed
  (``offload_gradients=True``), the host gradient buffers (where the gradients
  are); for any other optimizer, the ``.grad`` of its parameters; both in the
  ``param_groups`` order, or in ``order`` where one is given (``max_grad_norm=``
  gives the model's parameter order, optim/clip_order.py); for an iterable of
  parameters (or one tensor), their ``.grad`` as torch does.
* Bitwise equality with torch therefore holds whenever the tensors are the same
  ones torch would see. With freed device gradients on an accelerator the norm
  is reduced on the host instead of the device: the two can differ in the last
  bits of the norm (a different summation order), not more.
* Clipping while updates run during backward (``update_in_backward=True``):
  :func:`gradient_norm` takes each gradient's norm on its device in backward's
  hook, before the gradient leaves, exactly as ``get_total_norm`` takes it (the
  foreach kernel where torch would use it); once backward has ended
  :func:`clip_coefficient` reduces them as torch does (grouped by device and
  dtype, then the norm of their stack; for DTensor gradients the same DTensor
  ops, so the cross-rank reduction is torch's) and returns the coefficient
  ``clip_grads_with_norm_`` multiplies every gradient by. Each gradient is then
  multiplied by it on the host, where its update runs. That coefficient is used
  only while it is the step's: when the gradients at ``step()`` are not the ones
  whose norms the hooks took (accumulated over more than one backward, cleared or
  set by hand after backward, a nested reentrant backward, ``max_grad_norm``
  changed), a step before which no update ran clips as ``clip_grad_norm_`` does,
  over its host gradients; one after updates that used it is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

__all__ = ["clip_grad_norm_", "clip_gradients_", "clip_coefficient", "gradient_norm", "gradients_of", "total_norm"]


class _GradHolder:
    """Presents a bare gradient tensor to torch's clipping, which reads ``.grad``."""

    __slots__ = ("grad",)

    def __init__(self, grad: Tensor) -> None:
        self.grad = grad


def gradients_of(target: torch.optim.Optimizer | Tensor | Iterable[Tensor], order: list[Tensor] | None = None) -> list[Tensor]:
    """The gradient tensors clipping acts on (see the module contract)."""
    pipeline = getattr(target, "_pipeline", None)
    if pipeline is not None:
        return pipeline.gradient_tensors(order)
    if isinstance(target, torch.optim.Optimizer):
        params = order if order is not None else [p for g in target.param_groups for p in g["params"]]
        return [p.grad for p in params if p.grad is not None]
    if isinstance(target, Tensor):
        target = [target]
    return [p.grad for p in target if p.grad is not None]


@torch.no_grad()
def clip_grad_norm_(
    target: torch.optim.Optimizer | Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    order: list[Tensor] | None = None,
) -> Tensor:
    """Scale the gradients of ``target`` so that their total ``norm_type``-norm is at most ``max_norm``.

    ``target`` is an optimizer (OffloadAdamW in any mode, or any torch optimizer)
    or what ``torch.nn.utils.clip_grad_norm_`` takes; ``order``: an optimizer's
    parameters in the order to reduce their norms in. Returns the total norm of
    the gradients before clipping, as torch does; with freed device gradients
    it is a host tensor.
    """
    return clip_gradients_(gradients_of(target, order), max_norm, norm_type, error_if_nonfinite, foreach)


@torch.no_grad()
def clip_gradients_(
    grads: list[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """torch's ``get_total_norm`` and ``clip_grads_with_norm_`` over these gradient tensors; the total norm."""
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    # clip_grads_with_norm_ reads only each item's .grad: the holders stand in for parameters (its stub says Tensor)
    holders = cast(list[Tensor], [_GradHolder(g) for g in grads])
    torch.nn.utils.clip_grads_with_norm_(holders, max_norm, total_norm, foreach)
    return total_norm


@torch.no_grad()
def gradient_norm(grad: Tensor, norm_type: float = 2.0) -> Tensor:
    """One gradient's ``norm_type``-norm, on its device, as ``get_total_norm`` computes it for that tensor."""
    if _has_foreach_support([grad], grad.device):
        return torch._foreach_norm([grad], norm_type)[0]
    return torch.linalg.vector_norm(grad, norm_type)


@torch.no_grad()
def total_norm(norms: list[tuple[Tensor, torch.device, torch.dtype]], norm_type: float = 2.0) -> Tensor:
    """The total norm ``get_total_norm`` returns, from per-gradient norms in parameter order (see clip_coefficient)."""
    placeholders = [torch.empty(0, device=device, dtype=dtype) for _, device, dtype in norms]
    grouped = _group_tensors_by_device_and_dtype([placeholders], with_indices=True)  # type: ignore[list-item]
    ordered = [norms[i][0] for _, (_, indices) in grouped.items() for i in indices]
    first_device = norms[0][1]
    return torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in ordered]), norm_type)


@torch.no_grad()
def clip_coefficient(
    norms: list[tuple[Tensor, torch.device, torch.dtype]], max_norm: float, norm_type: float = 2.0
) -> tuple[Tensor, Tensor]:
    """(total norm as torch returns it, clamped clip coefficient) from per-gradient norms in parameter order.

    ``norms`` holds, for each gradient, its :func:`gradient_norm` and the gradient's device and dtype
    (torch groups the norms by those before it stacks them). The coefficient is a plain tensor (a DTensor
    total norm is reduced across ranks first, as torch's ``clip_grads_with_norm_`` does).
    """
    total = total_norm(norms, norm_type)
    clip_coef = max_norm / (total + 1e-6)
    clamped = torch.clamp(clip_coef, max=1.0)
    full = getattr(clamped, "full_tensor", None)
    return total, clamped if full is None else full()
