"""Gradients that never leave their device: the residency of a parameter whose update runs there.

Contract:

* :class:`DeviceGradients` is the residency (accel/residency.py's protocol) of a slot whose group's update runs
  on the device (``update_on`` "stream" or "device"): ``p.grad`` on the device is the gradient, read where it
  is; nothing is copied to the host and no host buffer exists for it. ``offload_gradients=True`` frees the
  gradients of host groups only: the update of a streamed or resident group reads its gradient on the device.
* With updates during backward (``update_in_backward``), a gradient that backward's hook (or DDP's communication
  hook: a slice of its reduced bucket) lands is recorded with a completion of the work that produced it, so that
  the update orders its device work after it, and with its version, so that a gradient changed after its update
  ran is seen (:meth:`intact`). The record holds the tensor until the step ends (:meth:`new_step`) or the optimizer
  is dropped, not longer: a ``p.grad`` cleared between steps is freed. With every update at the step nothing is
  recorded: the step reads ``p.grad``. The two are two components, chosen once where the pipeline is built:
  :class:`DeviceGradients` (every update at the step) and :class:`LandedDeviceGradients` (updates during backward).
* :class:`ByPlacement` answers every residency call of the pipeline for a slot from the residency of its
  placement: the configured one (kept or freed gradients) for host slots, :class:`DeviceGradients` for the
  others. Both are chosen once, at construction; a slot's placement is the one of its latest refresh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from offload_adamw.accel.freed import is_host_resident
from offload_adamw.accel.residency import Residency
from offload_adamw.accel.slots import Holding, Slot, SlotTable
from offload_adamw.accel.transfer import DONE, TransferEngine
from offload_adamw.distributed import local_tensor

__all__ = ["ByPlacement", "DeviceGradients", "LandedDeviceGradients", "landed_intact"]


class _OnDevice:
    """What both device residencies share: ``p.grad`` on its device is the gradient (see the module contract)."""

    def __init__(self, engine: TransferEngine, slots: SlotTable) -> None:
        self._engine = engine
        self._slots = slots

    def land(self, slot: Slot, grad: Tensor) -> None:
        """A gradient complete on its device (backward's hook; DDP's reduced bucket slice)."""
        raise NotImplementedError

    def record(self, slot: Slot, grad: Tensor) -> None:
        """What an update during backward reads of ``grad``: the tensor, its version and the work that produced it."""
        local = local_tensor(grad)
        slot.fetched = (local, local._version)
        slot.landing = self._engine.mark(local.device) if self._engine.is_device(local.device) else DONE
        slot.holding = Holding.GRADIENT

    def land_reduced(self, slot: Slot, grad: Tensor) -> None:
        self.land(slot, grad)

    def after_ddp(self, slot: Slot) -> None:
        """DDP's final callback wrote ``p.grad`` (None where it found the parameter unused)."""
        if slot.param.grad is None:
            self.zero(slot, True)
        else:
            self.land(slot, slot.param.grad)

    def prefetch(self, slots: list[Slot]) -> None:
        return None

    def ready(self, slot: Slot, validate: Callable[[Slot, Tensor], None]) -> Tensor | None:
        grad = slot.param.grad
        if grad is None:
            return None
        validate(slot, grad)
        return local_tensor(grad)

    def landed(self, slot: Slot) -> Tensor | None:
        """An update during backward's gradient: the one its hook landed, after the work that produced it."""
        grad = None if slot.holding is Holding.NOTHING or slot.fetched is None else slot.fetched[0]
        if grad is None:
            return None
        self._engine.current_stream_waits(grad.device, slot.landing)
        return grad

    def gradient(self, slot: Slot, validate: Callable[[Slot, Tensor], None]) -> Tensor | None:
        return self.ready(slot, validate)

    def zero(self, slot: Slot, set_to_none: bool) -> None:
        slot.holding = Holding.NOTHING  # p.grad itself is torch's zero_grad's
        slot.fetched = None
        slot.landing = DONE

    def before_accumulate(self, slot: Slot) -> None:
        """Before autograd accumulates into ``p.grad``: a gradient cleared or replaced since its landing starts afresh."""
        if not self.intact(slot):
            self.zero(slot, True)

    def present(self, slot: Slot) -> bool:
        return slot.param.grad is not None

    def in_host_memory(self, slot: Slot) -> bool:
        return False

    def intact(self, slot: Slot) -> bool:
        """Whether ``p.grad`` is the gradient its hook landed, unchanged since (no clipping, unscaling or edit after)."""
        grad = slot.param.grad
        if slot.fetched is None or grad is None:
            return False
        landed, version = slot.fetched
        return bool(local_tensor(grad) is landed and landed._version == version)

    def used(self, slot: Slot, grad: Tensor) -> None:
        """The update read (and may have scaled) ``grad``."""
        raise NotImplementedError

    def new_step(self) -> None:
        """The step has ended: the landings of its backward are let go (what landed stays counted until zero_grad)."""
        for slot in self._slots:
            if not slot.on_host:
                slot.fetched = None


class DeviceGradients(_OnDevice):
    """Device gradients with every update at the step: it reads ``p.grad`` itself, so nothing is recorded."""

    def land(self, slot: Slot, grad: Tensor) -> None:
        return None

    def used(self, slot: Slot, grad: Tensor) -> None:
        return None


class LandedDeviceGradients(_OnDevice):
    """Device gradients with updates during backward: each landing is recorded, because the update reads what
    landed, after the stream that produced it (see the module contract)."""

    def land(self, slot: Slot, grad: Tensor) -> None:
        self.record(slot, grad)

    def used(self, slot: Slot, grad: Tensor) -> None:
        """The update read (and may have scaled) ``grad``: its version now is no change after backward."""
        if slot.fetched is not None and slot.fetched[0] is grad:
            slot.fetched = (grad, grad._version)


def landed_intact(device: DeviceGradients | LandedDeviceGradients) -> Callable[[Slot], bool]:
    """Whether ``p.grad`` is still the gradient backward's hook landed: the host buffer's stand-in (freed host slots), or
    the device gradient unchanged (the others). Needs only the device residency, so the gate is built before the host
    residency (which needs the schedule, which needs the gate)."""
    def intact(slot: Slot) -> bool:
        return is_host_resident(slot.param.grad) if slot.on_host else device.intact(slot)

    return intact


class ByPlacement:
    """Each slot's residency by its placement (see the module contract)."""

    def __init__(self, host: Residency, device: DeviceGradients | LandedDeviceGradients) -> None:
        self.host = host
        self.device = device
        self.intact = landed_intact(device)

    def _of(self, slot: Slot) -> Any:
        return self.host if slot.on_host else self.device

    def land(self, slot: Slot, grad: Tensor) -> None:
        self._of(slot).land(slot, grad)

    def land_reduced(self, slot: Slot, grad: Tensor) -> None:
        self._of(slot).land_reduced(slot, grad)

    def after_ddp(self, slot: Slot) -> None:
        self._of(slot).after_ddp(slot)

    def prefetch(self, slots: list[Slot]) -> None:
        self.host.prefetch([s for s in slots if s.on_host])

    def ready(self, slot: Slot, validate: Callable[[Slot, Tensor], None]) -> Tensor | None:
        return self._of(slot).ready(slot, validate)

    def landed(self, slot: Slot) -> Tensor | None:
        return self._of(slot).landed(slot)

    def gradient(self, slot: Slot, validate: Callable[[Slot, Tensor], None]) -> Tensor | None:
        return self._of(slot).gradient(slot, validate)

    def zero(self, slot: Slot, set_to_none: bool) -> None:
        self._of(slot).zero(slot, set_to_none)

    def before_accumulate(self, slot: Slot) -> None:
        self._of(slot).before_accumulate(slot)

    def present(self, slot: Slot) -> bool:
        return bool(self._of(slot).present(slot))

    def in_host_memory(self, slot: Slot) -> bool:
        return bool(self._of(slot).in_host_memory(slot))

    def used(self, slot: Slot, grad: Tensor) -> None:
        """An on-device update read ``grad`` (accel/placements.py)."""
        if not slot.on_host:
            self.device.used(slot, grad)

    def new_step(self) -> None:
        self.device.new_step()

    def close(self) -> None:
        """The pipeline closes (its optimizer went): host gradients are given back through ``p.grad``."""
        give_back = getattr(self.host, "give_back", None)
        if give_back is not None:
            give_back()
        self.new_step()

    intact: Callable[[Slot], bool]
    """:func:`landed_intact` of the device residency."""
