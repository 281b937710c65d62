"""The AdamW update where the state sits beside the gradient on one device: torch's fused op, chunk by chunk.

Contract (docs/placement.md#the-bitwise-guarantee):

* :func:`advance_steps` is torch.optim.AdamW(fused=True)'s ``_foreach_add_(state_steps, 1)``: each tensor's step
  count (a float32 0-dim host tensor, the state's ``step``) goes up by one, once per tensor and step, and the
  counts come back as float32 0-dim tensors on the update device, for the fused op to read. Every chunk of a
  tensor is then given the same count: the fused op only reads it.
* :func:`fused_adamw_` runs ``torch._fused_adamw_`` over lists of tensors that all live on one device and pair
  element by element (whole tensors, or equal chunks of their memory-order flat views): master, gradient,
  moments in the master's dtype (float32, float64 for float64 parameters; complex ones are updated as their
  ``view_as_real``, as torch's loops update them). A gradient of another dtype is
  widened first (exactly: every bf16/fp16/fp32 value is a float32 value), into the ``widened`` buffer given for
  it, or a temporary; so is a gradient that ``grad_scale`` divides, which the fused op divides in place, as
  torch's fused AdamW does (the caller's gradient is never written). ``grad_scale`` is GradScaler's scale,
  divided inside the fused op as torch.optim.AdamW(fused=True) divides it (true division, on either device).
  Where ``model_copies[i]`` is given it receives round-to-nearest(master) in its own dtype after the update;
  where ``take_edits[i]`` is also set, it holds the parameter's current value and its edited elements replace
  their masters first (kernels/edits.py).
* Hence the bits: on a GPU, each chunk's elements are computed by the same per-element arithmetic as one call
  over the whole tensor; on the CPU, chunk boundaries that are multiples of :data:`CHUNK_ALIGN` elements leave
  every element in the same kind of loop (vector body or scalar tail) as one call (kernels/blocked.py explains
  the 64-element rule; the alignment here is a multiple of it). So the result is bitwise that of
  torch.optim.AdamW(fused=True) on float32 master copies fed the upcast gradients, on that device, followed by
  the round-to-nearest cast.
* Pure: no state of its own, nothing of groups, placements or transfers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offload_adamw.kernels.adamw import StepHyper
from offload_adamw.kernels.edits import take_model_edits_

__all__ = ["CHUNK_ALIGN", "Piece", "StateOperands", "advance_steps", "chunk_plan", "fused_adamw_"]

#: chunk boundaries inside a tensor are multiples of this many elements (64 for the CPU kernel's vector
#: loop, times 64 so that a chunk of any state dtype starts on a 16 KiB boundary of its tensor).
CHUNK_ALIGN = 4096


@dataclass(frozen=True)
class StateOperands:
    """One tensor's state as the device-side update reads and writes it (all but ``step`` on one device)."""

    master: Tensor
    """The float32 (float64) master the update writes: the stored master, or the parameter that is its own."""
    exp_avg: Tensor
    exp_avg_sq: Tensor
    max_exp_avg_sq: Tensor | None
    """With amsgrad, else None."""
    step: Tensor
    """The float32 0-dim host step count."""
    model: Tensor | None
    """The tensor that receives round(master) after the update (the parameter), or None when it is the master."""
    follow_edits: bool
    """Whether ``model`` is a host parameter whose edits since the last update every update takes over."""


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of tensor ``index``'s flat view, at element ``offset`` of its chunk."""

    index: int
    start: int
    end: int
    offset: int


def chunk_plan(numels: Sequence[int], capacity: int) -> list[list[Piece]]:
    """Pack tensors of ``numels`` elements, in order, into chunks of at most ``capacity`` elements.

    A tensor is split only at multiples of CHUNK_ALIGN of its own elements (``capacity`` is one, at least
    CHUNK_ALIGN), so that chunking changes no bit; pieces start at multiples of 64 elements within their chunk.
    Empty tensors get no piece.
    """
    if capacity < CHUNK_ALIGN or capacity % CHUNK_ALIGN:
        raise ValueError(f"chunk_plan: capacity must be a positive multiple of {CHUNK_ALIGN}, got {capacity}")
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for index, n in enumerate(numels):
        start = 0
        while start < n:
            room = capacity - used
            take = n - start if n - start <= room else room // CHUNK_ALIGN * CHUNK_ALIGN
            if take <= 0:
                chunks.append(current)
                current, used = [], 0
                continue
            current.append(Piece(index, start, start + take, used))
            used += -(-take // 64) * 64
            start += take
            if used >= capacity:
                chunks.append(current)
                current, used = [], 0
    if current:
        chunks.append(current)
    return chunks


def advance_steps(steps: Sequence[Tensor], device: torch.device,
                  to_device: Callable[[Tensor], Tensor] | None = None) -> list[Tensor]:
    """+1 on each host step count (torch's fused AdamW, once per tensor before its fused op); the counts on ``device``,
    moved there by ``to_device`` (the transfer engine's: from page-locked memory, no host wait), or by ``.to(device)``
    where none is given; on the host itself where ``to_device`` is None and ``device`` is the CPU."""
    if not steps:
        return []
    torch._foreach_add_(list(steps), 1)
    if to_device is None and device.type == "cpu":
        return list(steps)  # the CPU fused op reads the host counts themselves
    stacked = torch.stack(list(steps))
    return list((stacked.to(device) if to_device is None else to_device(stacked)).unbind(0))


def _lr_for(lr: float | Tensor, device: torch.device) -> float | Tensor:
    """torch's choice: a tensor lr off the CPU goes to the update device; a CPU tensor lr is read as a double (what
    the fused op does with it on any device: on the CPU it is passed as it is, as torch passes it)."""
    if not isinstance(lr, Tensor):
        return lr
    if lr.device.type == "cpu":
        return lr if device.type == "cpu" else float(lr.item())
    return lr if lr.device == device else lr.to(device)


def fused_adamw_(
    masters: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    counts: Sequence[Tensor],
    hp: StepHyper,
    *,
    model_copies: Sequence[Tensor | None] | None = None,
    take_edits: Sequence[bool] | None = None,
    grad_scale: Tensor | None = None,
    widened: Sequence[Tensor | None] | None = None,
) -> None:
    """One AdamW update of every tensor (or chunk) in the lists, on their device (see the module contract).

    ``counts[i]`` is the (already advanced) step count tensor ``i`` reads; ``widened[i]``, where given, is a
    buffer of ``masters[i]``'s shape and dtype that receives the widened (and then unscaled) gradient.
    """
    n = len(masters)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "counts": counts}
    if hp.amsgrad:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    for name, values in lists.items():
        if len(values) != n:
            raise ValueError(f"fused_adamw_: {name} has {len(values)} tensors, masters has {n}")
    if n == 0:
        return
    if any(m.is_complex() for m in masters):
        # A complex tensor is updated as its view_as_real, as torch's loops update it (its fused op takes no complex).
        masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = (
            [_real_view(t) for t in ts] for ts in (masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs))
        model_copies = None if model_copies is None else [None if t is None else _real_view(t) for t in model_copies]
        widened = None if widened is None else [None if t is None else _real_view(t) for t in widened]
    device = masters[0].device
    # torch's fused op takes one dtype per call: float32 and float64 masters go in separate calls.
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, master in enumerate(masters):
        if master.numel() > 0:
            by_dtype.setdefault(master.dtype, []).append(i)
    scale = None if grad_scale is None else grad_scale.detach().to(device, torch.float32)
    for dtype, members in by_dtype.items():
        for i in members:
            out = model_copies[i] if model_copies is not None else None
            if take_edits is not None and take_edits[i] and out is not None:
                take_model_edits_(masters[i], out)
        operands = [_widen(grads[i], dtype, scale is not None, None if widened is None else widened[i]) for i in members]
        kwargs: dict[str, Any] = dict(
            lr=_lr_for(hp.lr, device), beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
            amsgrad=hp.amsgrad, maximize=hp.maximize, grad_scale=scale, found_inf=None,
        )
        torch._fused_adamw_(
            [masters[i] for i in members], operands, [exp_avgs[i] for i in members], [exp_avg_sqs[i] for i in members],
            [max_exp_avg_sqs[i] for i in members] if hp.amsgrad else [], [counts[i] for i in members], **kwargs,
        )
        if model_copies is not None:
            for i in members:
                out = model_copies[i]
                if out is not None:
                    out.copy_(masters[i])  # round-to-nearest in the model's dtype (exact for float32)


def _real_view(t: Tensor) -> Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _widen(grad: Tensor, dtype: torch.dtype, scaled: bool, buffer: Tensor | None) -> Tensor:
    """The gradient the fused op reads: the caller's own where it already has the master's dtype and no scale
    divides it (the op only reads it then), else a copy in the master's dtype (exact widening)."""
    if grad.dtype == dtype and not scaled:
        return grad
    if buffer is None:
        return grad.to(dtype, copy=True)
    buffer.copy_(grad)
    return buffer
