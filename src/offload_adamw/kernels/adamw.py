"""The AdamW update over host tensors: the one place where the update math lives.

Contract (docs/contract.md#one-update, #what-each-input-does, #precision-and-placement):

* ``adamw_update_`` updates, in place, for each tensor i: the step count
  ``steps[i]`` (a float32 0-dim tensor, +1), the master ``masters[i]`` (float32
  or float64), ``exp_avgs[i]``, ``exp_avg_sqs[i]`` (and ``max_exp_avg_sqs[i]``
  with amsgrad), from ``grads[i]`` of any floating dtype (upcast to the master's
  dtype with exact widening). Where ``model_params[i]`` is not None it receives
  the round-to-nearest copy of the updated master in its own dtype. Elements pair by
  index, whatever the strides of any of these tensors (kernels/layout.py).
* Where ``take_model_edits[i]`` is True, ``model_params[i]`` holds the parameter's
  current value (a low-precision host parameter is its own model copy): an element
  that differs from round(master) was edited since the last update, and the master
  takes its exact widening before the update (kernels/edits.py).
* The functions are pure in the optimizer sense: they own no state, know
  nothing of parameter groups, devices or transfers. The optimizer class calls
  them; a faster body can replace ``_blocked_impl`` without touching it.

Two implementations, picked by :func:`adamw_update_`'s ``impl`` flag (the way
torch/optim/adam.py dispatches):

* ``"blocked"`` (default): torch's fused CPU AdamW arithmetic. Bitwise equal to
  ``torch.optim.AdamW(fused=True)`` on float32 masters (the parity definition of
  the project), and for low-precision models bitwise equal to that optimizer run
  on float32 copies fed the upcast gradients, followed by a round-to-nearest cast.
  The mixed case runs in one memory pass (``blocked.py``): one loop compiled by
  numba with the casts inside it (``numba_loop.py``, self-tested before use), and
  the chunk loop (TorchScript, 128 Ki-element chunks) for the rest and wherever
  numba is unavailable: the same arithmetic, hence the same bits.
* ``"for_loop"``: a readable per-tensor loop that spells out the contract, with
  the operation order of torch's single-tensor AdamW (``fused=False,
  foreach=False``), bitwise equal to it. It is the ground truth the fast path is
  tested against within torch's float32 tolerances.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offload_adamw.kernels.blocked import blocked_adamw_
from offload_adamw.kernels.edits import take_model_edits_

__all__ = ["StepHyper", "adamw_update_", "IMPLEMENTATIONS"]


@dataclass(frozen=True)
class StepHyper:
    """The hyperparameters of one parameter group at one step."""

    lr: float | Tensor
    """Learning rate; a 1-element CPU tensor is passed through as torch does."""
    beta1: float | Tensor
    """Decay rate of the first moment; a 0-dim CPU tensor (for-loop kernel only) is used as torch's loop uses it."""
    beta2: float | Tensor
    """Decay rate of the second moment; likewise."""
    eps: float
    """Added to sqrt(v_hat), outside the square root."""
    weight_decay: float
    """Decoupled decay: theta <- theta * (1 - lr * weight_decay) before the update."""
    amsgrad: bool = False
    """Use max(v) over time in the denominator."""
    maximize: bool = False
    """Ascend instead of descend (negates the gradient)."""


#: the tensors of one list argument of the kernels, and the model copies (None: no copy for that tensor)
Tensors = Sequence[Tensor]
ModelCopies = Sequence[Tensor | None] | None


def _check_lists(masters: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, max_exp_avg_sqs: Tensors,
                 steps: Tensors, model_params: ModelCopies, take_model_edits: Sequence[bool] | None,
                 amsgrad: bool) -> None:
    n = len(masters)
    lengths = {
        "grads": len(grads),
        "exp_avgs": len(exp_avgs),
        "exp_avg_sqs": len(exp_avg_sqs),
        "steps": len(steps),
    }
    if amsgrad:
        lengths["max_exp_avg_sqs"] = len(max_exp_avg_sqs)
    if model_params is not None:
        lengths["model_params"] = len(model_params)
    if take_model_edits is not None:
        lengths["take_model_edits"] = len(take_model_edits)
    for name, length in lengths.items():
        if length != n:
            raise ValueError(f"adamw_update_: {name} has {length} tensors, masters has {n}")
    if take_model_edits is not None and any(
        edits and (model_params is None or model_params[i] is None) for i, edits in enumerate(take_model_edits)
    ):
        raise ValueError("adamw_update_: take_model_edits[i] needs a model copy model_params[i]")


def _widen(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """The gradient in the master's dtype (exact: every bf16/fp16/fp32 value is representable)."""
    return grad if grad.dtype == dtype else grad.to(dtype)


def _for_loop_impl(masters: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, max_exp_avg_sqs: Tensors,
                   steps: Tensors, model_params: ModelCopies, take_model_edits: Sequence[bool] | None,
                   hp: StepHyper, threads: int | None, cpus: frozenset[int] | None) -> None:
    del threads, cpus  # the ground truth runs on the calling thread
    # A tensor lr stays a (float32) tensor, as in torch: lr*wd and lr/c1 are then rounded to float32.
    lr = hp.lr
    for i, theta in enumerate(masters):
        out = model_params[i] if model_params is not None else None
        if take_model_edits is not None and take_model_edits[i] and out is not None:
            take_model_edits_(theta, out)  # the update starts from the edited parameter
        grad = _widen(grads[i], theta.dtype)
        if hp.maximize:
            grad = -grad
        exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]

        steps[i].add_(1)
        t = steps[i].item()

        # Decoupled decay, applied to the pre-update value (docs/contract.md#decay-order).
        if hp.weight_decay != 0:
            theta.mul_(1 - lr * hp.weight_decay)
        # m <- b1*m + (1-b1)*g, written as a lerp as torch does (a tensor beta1 in the master's dtype, as torch's
        # loop casts it to the parameter's); a tensor beta makes the bias corrections below float32 tensors, as there.
        beta1 = hp.beta1.to(theta.dtype) if isinstance(hp.beta1, Tensor) else hp.beta1
        exp_avg.lerp_(grad, 1 - beta1)
        # v <- b2*v + (1-b2)*g*g
        one_minus_beta2: Any = 1 - hp.beta2  # a 0-dim tensor with a tensor beta2, read as a number, as in torch
        exp_avg_sq.mul_(hp.beta2).addcmul_(grad, grad, value=one_minus_beta2)

        # Bias corrections in double precision; eps stays outside the square root.
        bias_correction1 = 1 - hp.beta1**t
        bias_correction2 = 1 - hp.beta2**t
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        if hp.amsgrad:
            torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i])
            denom = (max_exp_avg_sqs[i].sqrt() / bias_correction2_sqrt).add_(hp.eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(hp.eps)
        # With a tensor lr the step size is a 0-dim tensor, which torch's own loop passes as the value too.
        value: Any = -step_size
        theta.addcdiv_(exp_avg, denom, value=value)

        if out is not None:
            out.copy_(theta)


def _blocked_impl(masters: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, max_exp_avg_sqs: Tensors,
                  steps: Tensors, model_params: ModelCopies, take_model_edits: Sequence[bool] | None,
                  hp: StepHyper, threads: int | None, cpus: frozenset[int] | None) -> None:
    # float32/float64 tensors without casts: torch's fused op over the whole list, exactly
    # as torch.optim.AdamW(fused=True). Mixed-dtype tensors: the same arithmetic in one
    # memory pass (blocked.py: the numba loop, the chunk loop for the rest).
    blocked_adamw_(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, model_params, hp,
                   take_model_edits=take_model_edits, threads=threads, cpus=cpus)


IMPLEMENTATIONS = {"blocked": _blocked_impl, "for_loop": _for_loop_impl}


def adamw_update_(
    masters: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    hp: StepHyper,
    *,
    model_params: Sequence[Tensor | None] | None = None,
    take_model_edits: Sequence[bool] | None = None,
    impl: str = "blocked",
    threads: int | None = None,
    cpus: frozenset[int] | None = None,
) -> None:
    """One AdamW update of every tensor in the lists (all of them have a gradient).

    All tensors live on one device (the host, for this project). ``masters``,
    the moments and ``steps`` are modified in place; ``grads`` are only read. ``threads``: the worker
    threads of the blocked implementation (None: ``torch.get_num_threads()``) and the cores they run on
    (``cpus``, None: anywhere); the bits do not depend on them.
    """
    _check_lists(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, model_params, take_model_edits, hp.amsgrad)
    if not masters:
        return
    try:
        body = IMPLEMENTATIONS[impl]
    except KeyError:
        raise ValueError(f"unknown kernel implementation {impl!r}; choose one of {sorted(IMPLEMENTATIONS)}") from None
    body(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, model_params, take_model_edits, hp, threads,
         cpus)
