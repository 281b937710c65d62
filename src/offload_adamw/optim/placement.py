"""Where a group's update runs, and so where its state lives (docs/placement.md).

Contract:

* A group's ``update_on`` (contract/rules.py's PLACEMENT_KEY) is one of ``"host"``, ``"stream"``, ``"device"``;
  :func:`group_placement` refuses anything else, naming the group, whenever it is read (a typo in a group edited
  between steps fails at the next step, before any update).
* The state's keys, dtypes and layout do not depend on the placement (optim/state.py): only its home does.
  ``"host"`` and ``"stream"`` keep it in host memory; a stream to a device with streams page-locks it in place,
  exactly sized, through the device's stream backend (accel/host_memory.py; the ring's copies are then
  asynchronous), ``pin_memory=True`` through torch's pinned allocator; ``"device"`` keeps the moments and the
  master on the parameter's device (on the CPU as device, or the simulated CUDA device of the tests, that is host
  memory). The ``step`` count is a float32 0-dim
  host tensor in every placement. :func:`place_state_` moves a state to its home, values unchanged.
* :func:`state_operands` gives the device-side update (accel/stream_update.py, accel/device_update.py) one
  tensor's state as the kernel takes it (kernels/fused_device.py): created by the pre-flight before, laid out
  like the parameter, ``max_exp_avg_sq`` added where amsgrad was switched on later.
* :func:`check_device_memory` is the device's pre-flight: bytes about to be allocated on a CUDA device (state of
  ``"device"`` groups, a stream's ring) against what the device can give, refused with the figures before anything
  is allocated or updated. On the CPU the "device" is host memory and the host pre-flight applies instead.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from offload_adamw.accel.host_memory import PageLocker, is_page_locked
from offload_adamw.contract.rules import MASTER_KEY, PLACEMENT_KEY, check_placement
from offload_adamw.kernels.fused_device import StateOperands
from offload_adamw.optim import preflight as _preflight
from offload_adamw.optim import state as host_state
from offload_adamw.optim.state import Pin

__all__ = [
    "DeviceMemoryError", "check_device_memory", "device_free_bytes", "group_placement", "home_of", "misplaced", "moved_bytes",
    "new_state_at", "place_state_", "shared_home", "state_operands",
]


class DeviceMemoryError(MemoryError):
    """A placement's device bytes would not fit on its device; nothing was allocated."""


def group_placement(group: dict[str, Any], group_index: int) -> str:
    """The group's placement, or ValueError naming the group."""
    return check_placement(group.get(PLACEMENT_KEY, "host"), f"param_groups[{group_index}]")


_HOST = torch.device("cpu")


def home_of(placement: str, local: Tensor, *, pin_default: bool, locker: PageLocker | None) -> tuple[torch.device, Pin]:
    """(device, pinned) of the moments and master of the local parameter ``local`` under ``placement``.

    ``locker``: who page-locks host memory for the parameter's device, where it copies asynchronously. A streamed
    group's host state is page-locked by it, exactly sized (torch's pinned allocator would round every tensor up to a
    power of two, and keep it); ``pin_memory=True`` (``pin_default``) keeps torch's allocator for all host state.
    """
    if placement == "device" and local.device.type != "meta":
        return local.device, False
    if pin_default:
        return _HOST, True
    return _HOST, locker if placement == "stream" and locker is not None else False


def shared_home(placement: str, *, pin_default: bool) -> tuple[torch.device, Pin] | None:
    """The home :func:`home_of` gives every parameter of a group under ``placement`` where it does not depend on the
    parameter (a host group's: host memory, pinned by torch's allocator with ``pin_memory=True``), else None."""
    return (_HOST, True if pin_default else False) if placement == "host" else None


def _shaped(state: dict[str, Any], local: Tensor) -> list[str]:
    return [k for k, v in state.items() if k != "step" and isinstance(v, Tensor) and v.shape == local.shape]


def misplaced(state: dict[str, Any], local: Tensor, device: torch.device, pin: Pin) -> bool:
    """Whether some shaped state tensor of ``local`` is not at (device, pinned)."""
    # Asked for every parameter with state at every step: one pass over the state, no list made, the cheap
    # questions first (the host home is _HOST itself where it comes from home_of or shared_home; is_cpu is its test).
    host = device is _HOST or (device.type == "cpu" and device.index is None)
    locked = host and bool(pin)
    for key, value in state.items():
        if key == "step" or not isinstance(value, Tensor):
            continue
        away = not value.is_cpu if host else value.device != device
        if (away or (locked and not is_page_locked(value))) and value.shape == local.shape:
            return True
    return False


def moved_bytes(state: dict[str, Any], local: Tensor) -> int:
    """Bytes :func:`place_state_` allocates at the new home of ``local``'s state."""
    return sum(state[k].numel() * state[k].element_size() for k in _shaped(state, local))


def place_state_(state: dict[str, Any], local: Tensor, device: torch.device, pin: Pin) -> None:
    """Move ``local``'s shaped state tensors to ``device`` (page-locked on the host where ``pin``), values and layout
    kept; all or none (the dict is changed only when every copy exists)."""
    if not misplaced(state, local, device, pin):
        return
    moved = {}
    for key in _shaped(state, local):
        value = state[key]
        if device.type == "cpu":
            moved[key] = host_state.host_copy(value, value.dtype, pin=pin, like=value)
        else:
            out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
            out.copy_(value)
            moved[key] = out
    state.update(moved)


def new_state_at(local: Tensor, *, amsgrad: bool, device: torch.device, pin: Pin) -> dict[str, Tensor]:
    """The zero state of ``local`` (optim/state.py's new_state) at its home, allocated there directly."""
    if device.type == "cpu":
        return host_state.new_state(local, amsgrad=amsgrad, pin=pin)
    dtype = host_state.state_dtype(local)
    strides = host_state.layout_of(local)

    def zeros() -> Tensor:
        return torch.empty_strided(local.shape, strides, dtype=dtype, device=device).zero_()

    state: dict[str, Tensor] = {"step": torch.zeros((), dtype=torch.float32)}
    state["exp_avg"] = zeros()
    state["exp_avg_sq"] = zeros()
    if amsgrad:
        state["max_exp_avg_sq"] = zeros()
    if not host_state.is_own_master(local):
        master = torch.empty_strided(local.shape, strides, dtype=dtype, device=device)
        master.copy_(local.detach())
        state[MASTER_KEY] = master
    return state


def state_operands(group: dict[str, Any], local: Tensor, state: dict[str, Any], *, pin: Pin) -> StateOperands:
    """One tensor's state as the device-side kernel takes it; ``local`` is the parameter (this rank's shard)."""
    host_state.relayout_like(state, local)
    master = host_state.stored_master(state, local)
    if group["amsgrad"] and "max_exp_avg_sq" not in state:  # amsgrad switched on after the state existed
        zeros = torch.zeros_like(state["exp_avg"])
        state["max_exp_avg_sq"] = host_state.host_copy(zeros, zeros.dtype, pin=pin) if zeros.device.type == "cpu" else zeros
    own = MASTER_KEY not in state
    return StateOperands(
        master=master, exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"],
        max_exp_avg_sq=state.get("max_exp_avg_sq") if group["amsgrad"] else None, step=state["step"],
        model=None if own else local,
        # A low-precision host parameter is its own model copy, edited through .data unseen by any version counter:
        # its edits are taken at every update, as the host kernel takes them (kernels/edits.py).
        follow_edits=not own and host_state.on_host(local),
    )


def device_free_bytes(device: torch.device) -> int:
    """What the CUDA ``device`` can still give: its free memory plus what torch's caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(reserved))


def check_device_memory(device: torch.device, nbytes: int, what: str) -> None:
    """Refuse, with the figures, ``nbytes`` of ``what`` on the CUDA ``device`` that it cannot give."""
    if nbytes <= 0 or device.type != "cuda":
        return
    if os.environ.get(_preflight.ENV_SWITCH, "1").strip().lower() in ("0", "off", "false", "no"):
        return
    free = device_free_bytes(device)
    if nbytes > free:
        raise DeviceMemoryError(
            f"OffloadAdamW would allocate {nbytes:,} bytes of {what} on {device} but only {free:,} bytes are free there "
            "(free device memory plus what torch's caching allocator holds unused). Nothing was allocated and no "
            "parameter was updated. Put fewer groups on update_on='device', use a smaller stream_chunk_bytes or "
            f"fewer stream_buffers, or update_on='host'; {_preflight.ENV_SWITCH}=0 skips this check"
        )
