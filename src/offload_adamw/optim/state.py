"""Where a tensor's optimizer state lives and what it holds (docs/contract.md#state, #precision-and-placement).

The state of one parameter tensor is a dict: ``step`` (a float32 0-dim tensor, an exact count),
``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) in host memory, float32 (float64 for float64
parameters), and ``master_param`` unless the parameter is its own master (contract/bills.py says
which). The master is created from the parameter's value when the state is created, and follows
the parameter's edits between steps (docs/contract.md#edits-between-steps).

Every state tensor of a parameter is laid out like the parameter, as ``torch.zeros_like`` lays
it out (the same strides for a dense parameter, e.g. a channels_last convolution weight; a dense
layout in the parameter's order of dimensions otherwise): the state then reads like torch's
AdamW state, and the kernels pair its elements with the parameter's without a copy. State that
another layout reached (a state_dict of another layout, a parameter re-laid out after its state
was created) is laid out anew by :func:`relayout_like`.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from offload_adamw.accel import streams
from offload_adamw.accel.host_memory import PageLocker, page_locked_empty_strided
from offload_adamw.contract import bills
from offload_adamw.contract.rules import MASTER_KEY
from offload_adamw.kernels import layout
from offload_adamw.kernels.edits import take_model_edits_

__all__ = [
    "dtype_name",
    "follow_parameter_edits_",
    "host_zeros_like",
    "host_copy",
    "layout_of",
    "pinned_allocator_available",
    "pins_state",
    "relayout_like",
    "is_own_master",
    "on_host",
    "new_state",
    "state_dtype",
    "stored_master",
    "state_tensor_bytes",
]


#: dtype -> its name, and dtype -> the dtype of its state: asked for every tensor at every step, formatted once
_DTYPE_NAMES: dict[torch.dtype, str] = {}
_STATE_DTYPES: dict[torch.dtype, torch.dtype] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the names contract/bills.py speaks."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def state_dtype(p: Tensor) -> torch.dtype:
    """The dtype of the moments and the master of ``p``."""
    dtype = _STATE_DTYPES.get(p.dtype)
    if dtype is None:
        dtype = _STATE_DTYPES[p.dtype] = cast(torch.dtype, getattr(torch, bills.state_dtype_name(dtype_name(p.dtype))))
    return dtype


def on_host(p: Tensor) -> bool:
    """Whether ``p`` (a local tensor) lives in host memory, where the update can write it: a CPU tensor, unless the
    stream backend installed for the tests (the simulated CUDA device) serves it as a device tensor (accel/streams.py)."""
    # is_cpu is the device's type without building a torch.device (p.device.type costs six times as much).
    return p.is_cpu and not streams.is_device_tensor(p)


_WIDE: dict[torch.dtype, bool] = {}


def is_own_master(p: Tensor) -> bool:
    """Whether ``p`` (a local tensor, not a DTensor) is its own master: float32/float64 in host memory."""
    wide = _WIDE.get(p.dtype)
    if wide is None:  # contract/bills.py's rule, asked once per dtype
        wide = _WIDE[p.dtype] = bills.is_own_master(dtype_name(p.dtype), on_host=True)
    return wide and on_host(p)


def layout_of(p: Tensor) -> tuple[int, ...]:
    """The strides ``torch.zeros_like(p)`` gives, which the state of ``p`` has."""
    return layout.zeros_like_strides(p)


Pin = bool | PageLocker
"""How host state is page-locked: not (False), by torch's pinned allocator (True: ``pin_memory=True``), or exactly
sized by a device's page locker (a streamed group's state: accel/host_memory.py)."""


def _host_empty_like(p: Tensor, dtype: torch.dtype, *, pin: Pin) -> Tensor:
    if isinstance(pin, PageLocker):
        return page_locked_empty_strided(p.shape, layout_of(p), dtype, pin)
    return torch.empty_strided(p.shape, layout_of(p), dtype=dtype, device="cpu", pin_memory=pin)


def host_zeros_like(p: Tensor, dtype: torch.dtype, *, pin: Pin) -> Tensor:
    """Zeros in host memory, laid out like ``p``."""
    return _host_empty_like(p, dtype, pin=pin).zero_()


def host_copy(src: Tensor, dtype: torch.dtype, *, pin: Pin, like: Tensor | None = None) -> Tensor:
    """A host copy of ``src`` in ``dtype``, laid out like ``like`` (default: like ``src``); elements pair by index."""
    out = _host_empty_like(src if like is None else like, dtype, pin=pin)
    out.copy_(src.detach())
    return out


def relayout_like(state: dict[str, Any], p: Tensor) -> None:
    """Lay every shaped state tensor of ``p`` out like ``p`` where it is laid out otherwise (values and pinning kept)."""
    like = torch.empty_strided(p.shape, layout_of(p), device="meta")
    for key, value in list(state.items()):
        if isinstance(value, Tensor) and value.shape == p.shape and value.dim() > 0:
            if not layout.same_layout(value, like):
                state[key] = host_copy(value, value.dtype, pin=value.is_pinned(), like=p)


def new_state(p: Tensor, *, amsgrad: bool, pin: Pin) -> dict[str, Tensor]:
    """The zero state of the local parameter ``p``, with its master copied from ``p`` where one is needed."""
    dtype = state_dtype(p)
    state: dict[str, Tensor] = {"step": torch.zeros((), dtype=torch.float32)}
    state["exp_avg"] = host_zeros_like(p, dtype, pin=pin)
    state["exp_avg_sq"] = host_zeros_like(p, dtype, pin=pin)
    if amsgrad:
        state["max_exp_avg_sq"] = host_zeros_like(p, dtype, pin=pin)
    if not is_own_master(p):
        state[MASTER_KEY] = host_copy(p, dtype, pin=pin)
    return state


def follow_parameter_edits_(state: dict[str, Any], p: Tensor) -> None:
    """The master of the host parameter ``p`` (a local tensor) takes ``p``'s edits since the last update.

    What the next update would do first (kernels/edits.py), done now for a read of the master between
    steps (``master_param``, ``state_dict``, a checkpoint), so that a saved state holds the edited
    parameter. A parameter on a device is left to the transfer pipeline; one cast since its state was
    created (a float32 parameter beside a master: optim/update.py refuses to step it) keeps its master,
    which ``load_state_dict`` can carry over.
    """
    master = state.get(MASTER_KEY)
    if master is not None and on_host(p) and master.shape == p.shape and not is_own_master(p):
        take_model_edits_(master, p.detach())


def pinned_allocator_available() -> bool:
    """Whether this process can page-lock host memory (an accelerator backend is present)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def pins_state(pin_memory: bool | None, *, accelerator: bool) -> bool:
    """Whether the host state is page-locked: exactly when ``pin_memory=True`` was asked for.

    Pinning pays only for asynchronous copies, and nothing copies the state asynchronously: the
    transfer pipeline's own exactly-sized pinned buffers carry the gradients and the parameter
    copies, and the plain step copies synchronously. Pinned by default, the whole state would go
    through torch's pinned allocator, which rounds every tensor up to a power of two of locked
    memory. ``pin_memory=True`` where no accelerator can pin is refused (ValueError).
    """
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise ValueError(f"pin_memory must be True, False or None, got {pin_memory!r}")
    if pin_memory and not accelerator:
        raise ValueError(
            "pin_memory=True needs an accelerator (CUDA or another torch.accelerator backend): page-locked host "
            "memory only serves copies to one; use pin_memory=False or leave it unset"
        )
    return bool(pin_memory)


def stored_master(state: dict[str, Any], p: Tensor) -> Tensor:
    """The tensor the update writes: the stored master, or ``p`` itself when it is its own master."""
    return cast(Tensor, state.get(MASTER_KEY, p))


def state_tensor_bytes(optimizer: torch.optim.Optimizer, *, host_only: bool = False) -> int:
    """Bytes of the tensors held in ``optimizer.state`` (any torch optimizer), measured, not predicted."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor) and not (host_only and value.device.type != "cpu"):
                total += value.numel() * value.element_size()
    return total
