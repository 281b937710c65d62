"""The step's policies, each written once: gradient clipping and the non-finite decision.

Pure functions over gradients and their norms; the plain step (optim/optimizer.py), the bucketed step of the
transfer pipeline and its end-of-backward gate (accel/gate.py, which receives this module at construction: accel/
does not import optim/) all call these, so that a step clips and decides alike on every path.

Contract:

* **Clipping is torch's.** :func:`clip_gradients_` calls torch's own ``get_total_norm`` and
  ``clip_grads_with_norm_`` on the given gradient tensors, so its arithmetic is
  ``torch.nn.utils.clip_grad_norm_``'s by construction; :func:`clip_grad_norm_` does it over the gradients of an
  optimizer wherever it keeps them (for an ``OffloadAdamW`` whose device gradients are freed, the host buffers;
  for any other optimizer, the ``.grad`` of its parameters; both in the ``param_groups`` order, or in ``order``
  where one is given: ``max_grad_norm=`` gives the model's parameter order, optim/clip_order.py), or over an
  iterable of parameters as torch does. Bitwise equality with torch holds whenever the tensors are the same ones
  torch would see; with freed device gradients on an accelerator the norm is reduced on the host instead of the
  device, which can differ in the last bits of the norm (a different summation order), not more.
* :func:`step_norm` is the step's clipping decision: with ``max_grad_norm`` torch's clipping of the step's
  gradients, without it their total norm (``last_grad_norm``, what the HF Trainer logs), unless a norm taken in
  backward's hooks is still the step's (updates during backward: it is then the step's norm and its coefficient
  already applies).
* **Norms taken in backward** (updates during backward): :func:`gradient_norm` takes one gradient's norm on its
  device exactly as ``get_total_norm`` takes it (the foreach kernel where torch would use it); once backward has
  ended :func:`clip_coefficient` reduces them as torch does (grouped by device and dtype, then the norm of their
  stack; for DTensor gradients the same DTensor ops, so the cross-rank reduction is torch's) and returns the
  coefficient ``clip_grads_with_norm_`` multiplies every gradient by.
* **The non-finite decision**: :func:`nonfinite_count` counts a gradient's inf and NaN elements on its device
  (a DTensor: a partial sum over the ranks); :func:`nonfinite_anywhere` says, from such counts and with one read
  of the device, whether any rank has one (the end-of-backward gate); :func:`nonfinite_decision` applies the
  optimizer's policy to a step's gradients from the same counts: ``propagate`` updates anyway (as torch does),
  ``skip`` skips the step for every tensor (the caller counts it), ``raise`` raises FloatingPointError naming
  every culprit. Every rank of a sharded or replicated model takes the same decision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from offload_adamw.contract.rules import NONFINITE_POLICIES
from offload_adamw.distributed import any_rank, local_tensor

__all__ = [
    "clip_coefficient", "clip_grad_norm_", "clip_gradients_", "gradient_norm", "gradients_of", "nonfinite_anywhere",
    "nonfinite_count", "nonfinite_decision", "step_norm", "total_norm",
]


# ------------------------------------------------------------------ clipping


class _GradHolder:
    """Presents a bare gradient tensor to torch's clipping, which reads ``.grad``."""

    __slots__ = ("grad",)

    def __init__(self, grad: Tensor) -> None:
        self.grad = grad


def gradients_of(target: torch.optim.Optimizer | Tensor | Iterable[Tensor], order: list[Tensor] | None = None) -> list[Tensor]:
    """The gradient tensors clipping acts on (see the module contract)."""
    pipeline = getattr(target, "_pipeline", None)
    if pipeline is not None:
        return cast(list[Tensor], pipeline.gradient_tensors(order))
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
def step_norm(max_norm: float | None, gradients: Callable[[], list[Tensor]], taken: Tensor | None = None) -> Tensor:
    """The step's total gradient norm (``last_grad_norm``), clipping the gradients to ``max_norm`` where one is given.

    ``gradients()`` are the step's gradients in the order clipping reduces their norms (the model's); ``taken`` is
    the total norm taken from backward's hooks while it is still the step's (its coefficient then already applies
    to every update, and the gradients are not read again).
    """
    if taken is not None:
        return taken
    if max_norm is None:
        return torch.nn.utils.get_total_norm(gradients())
    return clip_gradients_(gradients(), max_norm)


@torch.no_grad()
def gradient_norm(grad: Tensor, norm_type: float = 2.0) -> Tensor:
    """One gradient's ``norm_type``-norm, on its device, as ``get_total_norm`` computes it for that tensor."""
    if _has_foreach_support([grad], grad.device):
        norm: Tensor = torch._foreach_norm([grad], norm_type)[0]
    else:
        norm = torch.linalg.vector_norm(grad, norm_type)
    return norm


@torch.no_grad()
def total_norm(norms: list[tuple[Tensor, torch.device, torch.dtype]], norm_type: float = 2.0) -> Tensor:
    """The total norm ``get_total_norm`` returns, from per-gradient norms in parameter order (see clip_coefficient)."""
    placeholders = [torch.empty(0, device=device, dtype=dtype) for _, device, dtype in norms]
    grouped = _group_tensors_by_device_and_dtype([placeholders], with_indices=True)  # type: ignore[list-item]
    ordered = [norms[i][0] for _, (_, indices) in grouped.items() for i in indices]
    first_device = norms[0][1]
    total: Tensor = torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in ordered]), norm_type)
    return total


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


# ------------------------------------------------------ the non-finite decision


@torch.no_grad()
def nonfinite_count(grad: Tensor) -> Tensor:
    """How many elements of ``grad`` are inf or NaN, on its device (a DTensor: a partial sum over the ranks)."""
    return torch.isfinite(grad).logical_not().sum()


def _any_positive(counts: Sequence[Tensor]) -> list[bool]:
    """Per count, whether it is positive: one read of the device per device holding counts."""
    found = [False] * len(counts)
    by_device: dict[torch.device, list[int]] = {}
    for k, count in enumerate(counts):
        by_device.setdefault(count.device, []).append(k)
    for members in by_device.values():
        values = torch.stack([counts[k] for k in members]).tolist()
        for k, value in zip(members, values):
            found[k] = value > 0
    return found


def nonfinite_anywhere(counts: Sequence[Tensor], groups: Sequence[Any] = ()) -> bool:
    """Whether any of ``counts`` (:func:`nonfinite_count` of a step's gradients, plain or DTensor) is positive on any
    rank: DTensor counts are summed (one all-reduce), plain ones OR-reduced over ``groups`` (whose ranks must decide
    alike: an attached DDP model's), or over the DTensors' meshes when both kinds are present."""
    sharded = [c for c in counts if local_tensor(c) is not c]
    plain = [c for c in counts if local_tensor(c) is c]
    found = bool(torch.stack([c.to(plain[0].device) for c in plain]).sum().item() > 0) if plain else False
    if sharded:
        summed: Any = sharded[0]
        for count in sharded[1:]:
            summed = summed + count  # DTensor partial sums: one all-reduce at full_tensor()
        sharded_found = int(summed.full_tensor().item()) > 0  # a collective: every rank calls it, whatever it found
        found = found or sharded_found
        # A plain gradient beside FSDP2's (a module outside fully_shard) is this rank's own: every rank must
        # still decide alike, as the step's policy does, or one rank's updates run while another's step
        # waits in that policy's all-reduce.
        mesh = summed.device_mesh
        groups = [mesh.get_group(dim) for dim in range(mesh.ndim)] if plain else []
    local = plain or [local_tensor(c) for c in sharded]
    return any_rank(found, (), groups, device=local[0].device if local else None)


def nonfinite_decision(policy: str, named_grads: Iterable[tuple[Callable[[], str], Tensor]], params: Sequence[Tensor],
                       groups: Sequence[Any] = ()) -> bool:
    """True when the step must be skipped for a non-finite gradient; raises under ``"raise"``.

    ``named_grads`` are (describe, local gradient) pairs; ``params`` the parameters with a gradient
    (for the all-ranks decision under FSDP2); ``groups`` process groups whose ranks must decide alike too
    (an attached DDP model's, when some parameters are outside it).
    """
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {policy!r}")
    if policy == "propagate":
        return False
    named = list(named_grads)
    found = _any_positive([nonfinite_count(grad) for _, grad in named])
    culprits = [describe() for (describe, _), bad in zip(named, found) if bad]
    # Shards: every rank must take the same decision, also when the bad values are on another rank.
    if any_rank(bool(culprits), params, groups) and not culprits:
        culprits.append("a gradient shard held by another rank")
    if culprits and policy == "raise":
        raise FloatingPointError(
            f"non-finite gradient in {len(culprits)} parameter(s): {', '.join(culprits)}; no state was changed"
        )
    return bool(culprits)
