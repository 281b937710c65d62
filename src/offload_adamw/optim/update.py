"""The one update path: every update of OffloadAdamW, with or without the transfer pipeline, runs here.

Contract (docs/contract.md#one-update, #what-each-input-does, #precision-and-placement):

* :func:`check_gradient` refuses, naming the parameter, what no update may consume: a parameter or gradient on
  the meta device (no data; :class:`~offload_adamw.contract.rules.Unsupported`, a RuntimeError), a sparse
  gradient, a gradient of another shape or of a non-floating dtype, a parameter whose shape
  changed after its state was allocated, a parameter cast or moved since so that its state no
  longer serves it (:func:`check_state_serves`: ``model.float()`` of a bf16 model after some steps,
  refused as torch's AdamW refuses it). Callers check every gradient of a step before the first
  update, so that a refusal leaves every tensor as it was.
* :func:`update_group` runs one parameter group's share of a step on host tensors: it creates a
  tensor's state at its first update (and ``max_exp_avg_sq`` when amsgrad was switched on later),
  laid out like the parameter (optim/state.py),
  divides the gradient by GradScaler's scale where one is given (in the master's dtype, as torch's
  fused AdamW does), and calls the kernel, which writes the round-to-nearest model copy where asked
  and, where the model copy is the parameter's current value, first takes its edits over
  (docs/contract.md#edits-between-steps).
  Where the updated parameter goes afterwards (a device, a staging buffer) is the caller's business.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from offload_adamw.contract.rules import MASTER_KEY, Unsupported
from offload_adamw.kernels import StepHyper, adamw_update_
from offload_adamw.optim import state as host_state

__all__ = [
    "TensorUpdate", "check_gradient", "check_state_serves", "kernel_impl", "step_hyper", "update_group",
]


class TensorUpdate(NamedTuple):
    """One tensor's share of a step (a named tuple: made for every tensor at every step, it costs a quarter of a
    frozen dataclass)."""

    param: Tensor
    """The local parameter tensor (this rank's shard under FSDP2)."""
    state: dict[str, Any]
    """Its optimizer state; empty before its first update."""
    grad: Tensor
    """Its gradient, in host memory, of any floating dtype."""
    model_copy: Tensor | None = None
    """A host tensor that receives round(master) in its own dtype, or None."""
    model_is_current: bool = False
    """Whether ``model_copy`` holds the parameter's current value (a low-precision host parameter is
    its own model copy): its elements edited since the last update replace their masters first."""


def _to_scalar(x: Any) -> Any:
    return x.item() if isinstance(x, Tensor) and x.numel() == 1 else x


def step_hyper(group: dict[str, Any], *, tensor_betas: bool = False) -> StepHyper:
    """The kernel's hyperparameters for one group at this step (a scheduler may have changed lr, betas).

    Tensor betas become numbers (their float32 values, exactly), as torch's fused kernel reads them;
    ``tensor_betas`` keeps them 0-dim host tensors for the for-loop kernel, whose bias corrections are
    then float32 tensor arithmetic, as in torch's single-tensor loop.
    """
    beta1, beta2 = group["betas"]
    if tensor_betas and isinstance(beta1, Tensor) and isinstance(beta2, Tensor):
        beta1, beta2 = beta1.detach().to("cpu").reshape(()), beta2.detach().to("cpu").reshape(())
    else:
        beta1, beta2 = _to_scalar(beta1), _to_scalar(beta2)
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.device.type != "cpu":
        lr = lr.detach().to("cpu")  # the kernel runs on host tensors; the same value, in the same dtype
    return StepHyper(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        amsgrad=group["amsgrad"],
        maximize=group["maximize"],
    )


def kernel_impl(group: dict[str, Any]) -> str:
    """``fused=False`` picks the readable for-loop kernel; else the fused one ("blocked")."""
    if group.get("fused") is False:
        return "for_loop"
    return "blocked"


def check_gradient(describe: Callable[[], str], param: Tensor, grad: Tensor, state: dict[str, Any]) -> None:
    """Refuse a gradient no update may consume; ``param`` is the local tensor, ``describe()`` names it."""
    # Every step asks this of every tensor: each attribute is read once (a tensor's shape is a new torch.Size at
    # every read), and a parameter that is its own master is not compared with itself.
    if param.is_meta or grad.is_meta:
        # Before the transfer pipeline tries to copy it: a RuntimeError as torch's fused AdamW raises (and a ValueError).
        raise Unsupported(
            f"{describe()} is on the meta device (it holds no data): materialize the model (e.g. "
            "module.to_empty(device=...) and initialize it) before the first step"
        )
    if grad.is_sparse:
        raise RuntimeError(
            f"OffloadAdamW does not support sparse gradients ({describe()}); use torch.optim.SparseAdam for sparse embeddings"
        )
    shape = param.shape
    if grad.shape != shape:
        raise RuntimeError(f"gradient of {describe()} has shape {tuple(grad.shape)}, the parameter has {tuple(shape)}")
    if not (grad.is_floating_point() or (grad.is_complex() and param.is_complex())):
        raise RuntimeError(f"gradient of {describe()} has dtype {grad.dtype}")
    if state:
        state_shape = state["exp_avg"].shape
        master = host_state.stored_master(state, param)
        if state_shape != shape or (master is not param and master.shape != shape):
            raise RuntimeError(
                f"{describe()} changed shape under the optimizer: state has {tuple(state_shape)}, "
                f"the parameter is {tuple(shape)}"
            )
        check_state_serves(describe, param, state)


def check_state_serves(describe: Callable[[], str], param: Tensor, state: dict[str, Any]) -> None:
    """Refuse a parameter cast or moved since its state was created where that state cannot serve it.

    The state serves a parameter when it is what its first update would have created: moments in
    ``state_dtype(param)`` and a master exactly when the parameter is not its own master. A bf16 model
    cast to float32 (``model.float()``) would otherwise go on updating a stale master while no
    parameter moves; a float32 one cast to bf16 would be updated in bf16. torch.optim.AdamW refuses
    such a step too (its state keeps the old dtype); here nothing has changed when the refusal comes.
    A cast between bf16 and fp16, or a move of a parameter with a master, keeps a state that serves.
    """
    dtype = host_state.state_dtype(param)
    has_master = MASTER_KEY in state
    moment_dtype = state["exp_avg"].dtype
    master_dtype = state[MASTER_KEY].dtype if has_master else moment_dtype
    if moment_dtype == dtype and master_dtype == dtype and has_master != host_state.is_own_master(param):
        return
    made_for = (f"a parameter with a {master_dtype} master (low precision, or on a device)" if has_master
                else f"a {moment_dtype} host parameter that is its own master")
    raise RuntimeError(
        f"{describe()} changed dtype or device under the optimizer: it is now {param.dtype} on {param.device}, "
        f"its optimizer state was made for {made_for}; as torch.optim.AdamW, OffloadAdamW refuses to step it, "
        "and nothing was changed. Cast or move the model before creating the optimizer, or carry the state "
        "over with opt.load_state_dict(opt.state_dict()) after the cast (a master becomes the parameter's value)"
    )


def _any_strided(state: dict[str, Any]) -> bool:
    """Whether a tensor of ``state`` is not row-major (a plain loop: asked for every tensor at every step)."""
    for t in state.values():
        if isinstance(t, Tensor) and not t.is_contiguous():
            return True
    return False


def _real_view(t: Tensor) -> Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def update_group(
    group: dict[str, Any],
    updates: Sequence[TensorUpdate],
    *,
    impl: str,
    pin_memory: host_state.Pin,
    grad_scale: Tensor | None = None,
    threads: int | None = None,
    cpus: frozenset[int] | None = None,
) -> None:
    """One AdamW update of each tensor in ``updates``, all of them members of ``group``, on ``threads`` workers
    running on ``cpus`` (None: anywhere)."""
    if not updates:
        return
    masters: list[Tensor] = []
    grads: list[Tensor] = []
    exp_avgs: list[Tensor] = []
    exp_avg_sqs: list[Tensor] = []
    max_exp_avg_sqs: list[Tensor] = []
    steps: list[Tensor] = []
    model_copies: list[Tensor | None] = []
    take_edits: list[bool] = []
    amsgrad = group["amsgrad"]
    complex_masters = False
    for param, state, given_grad, model_copy, model_is_current in updates:
        if not state:
            state.update(host_state.new_state(param, amsgrad=amsgrad, pin=pin_memory))
        elif not param.is_contiguous() or _any_strided(state):
            # Laid out like the parameter (re-laid out once where the parameter's layout changed), so
            # that the kernel pairs its elements without a copy at every step; a row-major parameter
            # and row-major state already are.
            host_state.relayout_like(state, param)
        master = host_state.stored_master(state, param)
        grad = given_grad
        if grad_scale is not None:
            # torch's fused AdamW divides the (upcast) gradient by the scale; a new tensor keeps the gradient.
            grad = torch.div(grad.to(master.dtype), grad_scale)
        masters.append(master)
        grads.append(grad)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        if amsgrad:
            if "max_exp_avg_sq" not in state:  # amsgrad switched on after the state existed
                state["max_exp_avg_sq"] = host_state.host_zeros_like(param, master.dtype, pin=pin_memory)
            max_exp_avg_sqs.append(state["max_exp_avg_sq"])
        steps.append(state["step"])
        model_copies.append(model_copy)
        take_edits.append(model_is_current and model_copy is not None)
        complex_masters = complex_masters or master.is_complex()
    if complex_masters:
        # As torch's loops: a complex tensor's update is the real update of its view_as_real (last dimension 2),
        # written through the views into the complex master, moments and model copy.
        masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = (
            [_real_view(t) for t in ts] for ts in (masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs))
        model_copies = [None if t is None else _real_view(t) for t in model_copies]
    adamw_update_(
        masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, step_hyper(group, tensor_betas=impl == "for_loop"),
        model_params=model_copies,
        take_model_edits=take_edits,
        impl=impl,
        threads=threads,
        cpus=cpus,
    )
