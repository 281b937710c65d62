"""Gradient-norm clipping that works wherever OffloadAdamW keeps the gradients.

Contract:

* :func:`clip_grad_norm_` computes and applies exactly what
  ``torch.nn.utils.clip_grad_norm_`` computes and applies to the same gradient
  tensors, in the same order: it calls torch's own ``get_total_norm`` and
  ``clip_grads_with_norm_`` on them, so the arithmetic is torch's by construction.
* Which tensors: for an ``OffloadAdamW`` whose device gradients are freed
  (``offload_gradients=True``), the host gradient buffers (where the gradients
  are); for any other optimizer, the ``.grad`` of its parameters, in its
  ``param_groups`` order; for an iterable of parameters (or one tensor), their
  ``.grad`` as torch does.
* Bitwise equality with torch therefore holds whenever the tensors are the same
  ones torch would see. With freed device gradients on an accelerator the norm
  is reduced on the host instead of the device: the two can differ in the last
  bits of the norm (a different summation order), not more.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import Tensor

__all__ = ["clip_grad_norm_", "gradients_of"]


class _GradHolder:
    """Presents a bare gradient tensor to torch's clipping, which reads ``.grad``."""

    __slots__ = ("grad",)

    def __init__(self, grad: Tensor) -> None:
        self.grad = grad


def gradients_of(target: torch.optim.Optimizer | Tensor | Iterable[Tensor]) -> list[Tensor]:
    """The gradient tensors clipping acts on (see the module contract)."""
    pipeline = getattr(target, "_pipeline", None)
    if pipeline is not None:
        return pipeline.gradient_tensors()
    if isinstance(target, torch.optim.Optimizer):
        return [p.grad for g in target.param_groups for p in g["params"] if p.grad is not None]
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
) -> Tensor:
    """Scale the gradients of ``target`` so that their total ``norm_type``-norm is at most ``max_norm``.

    ``target`` is an optimizer (OffloadAdamW in any mode, or any torch optimizer)
    or what ``torch.nn.utils.clip_grad_norm_`` takes. Returns the total norm of
    the gradients before clipping, as torch does; with freed device gradients
    it is a host tensor.
    """
    grads = gradients_of(target)
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    # clip_grads_with_norm_ reads only each item's .grad: the holders stand in for parameters (its stub says Tensor)
    holders = cast(list[Tensor], [_GradHolder(g) for g in grads])
    torch.nn.utils.clip_grads_with_norm_(holders, max_norm, total_norm, foreach)
    return total_norm
