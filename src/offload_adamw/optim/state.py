"""Where a tensor's optimizer state lives and what it holds (docs/contract.md#state, #precision-and-placement).

The state of one parameter tensor is a dict: ``step`` (a float32 0-dim tensor, an exact count),
``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) in host memory, float32 (float64 for float64
parameters), and ``master_param`` unless the parameter is its own master (contract/bills.py says
which). The master is created from the parameter's value when the state is created.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from offload_adamw.accel import standin
from offload_adamw.contract import bills
from offload_adamw.contract.rules import MASTER_KEY

__all__ = [
    "dtype_name",
    "host_zeros",
    "host_copy",
    "is_own_master",
    "on_host",
    "new_state",
    "state_dtype",
    "stored_master",
    "state_tensor_bytes",
]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the names contract/bills.py speaks."""
    return str(dtype).removeprefix("torch.")


def state_dtype(p: Tensor) -> torch.dtype:
    """The dtype of the moments and the master of ``p``."""
    return torch.float64 if bills.state_dtype_name(dtype_name(p.dtype)) == "float64" else torch.float32


def on_host(p: Tensor) -> bool:
    """Whether ``p`` (a local tensor) lives in host memory, where the update can write it: a CPU tensor, unless the
    asynchronous stand-in device of the tests serves it as a device tensor (accel/standin.py)."""
    return p.device.type == "cpu" and not standin.is_device_tensor(p)


def is_own_master(p: Tensor) -> bool:
    """Whether ``p`` (a local tensor, not a DTensor) is its own master: float32/float64 in host memory."""
    return bills.is_own_master(dtype_name(p.dtype), on_host=on_host(p))


def host_zeros(shape: torch.Size, dtype: torch.dtype, *, pin: bool) -> Tensor:
    return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pin)


def host_copy(src: Tensor, dtype: torch.dtype, *, pin: bool) -> Tensor:
    out = torch.empty(src.shape, dtype=dtype, device="cpu", pin_memory=pin)
    out.copy_(src.detach())
    return out


def new_state(p: Tensor, *, amsgrad: bool, pin: bool) -> dict[str, Tensor]:
    """The zero state of the local parameter ``p``, with its master copied from ``p`` where one is needed."""
    dtype = state_dtype(p)
    state: dict[str, Tensor] = {"step": torch.zeros((), dtype=torch.float32)}
    state["exp_avg"] = host_zeros(p.shape, dtype, pin=pin)
    state["exp_avg_sq"] = host_zeros(p.shape, dtype, pin=pin)
    if amsgrad:
        state["max_exp_avg_sq"] = host_zeros(p.shape, dtype, pin=pin)
    if not is_own_master(p):
        state[MASTER_KEY] = host_copy(p, dtype, pin=pin)
    return state


def stored_master(state: dict[str, Any], p: Tensor) -> Tensor:
    """The tensor the update writes: the stored master, or ``p`` itself when it is its own master."""
    return state.get(MASTER_KEY, p)


def state_tensor_bytes(optimizer: torch.optim.Optimizer, *, host_only: bool = False) -> int:
    """Bytes of the tensors held in ``optimizer.state`` (any torch optimizer), measured, not predicted."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor) and not (host_only and value.device.type != "cpu"):
                total += value.numel() * value.element_size()
    return total
