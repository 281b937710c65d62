"""What the pipeline keeps for each parameter, and the host buffers that hold its gradients.

Contract:

* One :class:`Slot` per parameter of the optimizer: its host gradient buffer, the second buffer of host
  accumulation, the staging copy a device parameter is sent back from, the completions of the copies
  that fill or read them, and one :class:`Holding` state for what the gradient buffer holds. Nothing
  of it is optimizer state.
* Buffers follow the parameters: :meth:`SlotTable.relayout` lays out anew the buffers of a parameter
  cast or moved since (``model.half()``, ``model.cuda()``), never one that holds a gradient not consumed
  yet; a parameter on the meta device gets none until it is materialised. A buffer has the parameter's
  strides where the parameter is dense (``channels_last``, a transposed view), as ``torch.empty_like``
  lays it out, so the host kernel pairs the same elements torch does.
* A slot of a parameter whose update runs on its device (a group with ``update_on`` "stream" or "device":
  ``Slot.update_on``) gets no host buffers: its gradient never leaves the device.
* Host buffers are carved out of a few exactly-sized arenas (accel/host_memory.py), page-locked where
  the transfer engine copies asynchronously; every allocation passes the optimizer's host-memory check
  first; buffers first needed inside backward are page-locked after it (:meth:`SlotTable.pin_deferred`).
* :meth:`SlotTable.release` forgets parameters the optimizer no longer has (a ``param_groups`` swap):
  their slots and buffers go, and no reference to them is kept. A released parameter whose gradient is
  held in host memory gets it back in ``p.grad`` as a real tensor on its device, bitwise (torch's
  optimizers never touch ``p.grad`` of a parameter they lose): its stand-in would stand for nothing.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from offload_adamw.accel.freed import is_host_resident
from offload_adamw.accel.host_memory import HostArena
from offload_adamw.accel.transfer import DONE, Completion, TransferEngine
from offload_adamw.distributed import local_tensor

__all__ = ["Holding", "Slot", "SlotTable", "Source"]


class Holding(enum.Enum):
    """What a slot's host gradient buffer holds."""

    NOTHING = "nothing"
    """No gradient of this parameter is in host memory."""
    GRADIENT = "gradient"
    """The buffer holds this parameter's gradient, or receives it (``Slot.landing``)."""
    ADDING = "adding"
    """As GRADIENT, with an add of the accumulation buffer into it queued (``Slot.adding``)."""


class Source(enum.Enum):
    """Which adapter brings a parameter's gradient (accel/sources.py)."""

    HOOKS = "hooks"
    """Autograd's post-accumulate-grad hook (FSDP2 calls it after the shard's reduce-scatter)."""
    DDP = "ddp"
    """The communication hook of an attached DDP model, with the reduced gradient."""


class Slot:
    """Everything the pipeline keeps for one parameter (none of it is optimizer state)."""

    __slots__ = (
        "param", "host_grad", "incoming", "staging", "layout", "holding", "landing", "adding", "sending",
        "fetched", "arrival", "group", "source", "handles", "grad_node", "sent_version", "sent_ptr", "update_on",
        "__weakref__",
    )

    def __init__(self, param: Tensor) -> None:
        self.param = param
        self.host_grad: Tensor | None = None
        """The host gradient buffer (a view into an arena)."""
        self.incoming: Tensor | None = None
        """The second buffer of host accumulation (freed gradients)."""
        self.staging: Tensor | None = None
        """The parameter-dtype host copy a device parameter is sent back from."""
        self.layout: dict[str, tuple[torch.device, torch.dtype]] = {}
        """Buffer field -> the (device, dtype) it was laid out for."""
        self.holding = Holding.NOTHING
        self.landing: Completion = DONE
        """The copy into ``host_grad``."""
        self.adding: Completion = DONE
        """The add of ``incoming`` into ``host_grad``."""
        self.sending: Completion = DONE
        """The copy out of ``staging`` to the device."""
        self.fetched: Any = None
        """Kept gradients: the device gradient whose copy ``landing`` is, during a step."""
        self.arrival = math.inf
        """Order in the latest backward, for bucketing (never reached: last)."""
        self.group: int | None = None
        """The FSDP2 reduce-scatter or DDP bucket of its latest gradient: one bucket of the step."""
        self.source = Source.HOOKS
        self.handles: list[Any] = []
        """The hooks registered for it (accel/sources.py)."""
        self.sent_version: int | None = None
        """A device parameter's version counter (and ``sent_ptr`` its data pointer) as the latest send-back left it: a
        different one at the next update is an edit of the parameter, which the update starts from."""
        self.sent_ptr = 0
        self.grad_node: Any = None
        """Its AccumulateGrad node (freed gradients: whether a backward will accumulate into ``p.grad``)."""
        self.update_on = "host"
        """Where its group's update runs (contract/rules.py's PLACEMENTS), as of the latest refresh."""

    @property
    def on_host(self) -> bool:
        """Whether its update runs on the host (its gradient and parameter pass through host buffers)."""
        return self.update_on == "host"

    @property
    def local(self) -> Tensor:
        """The tensor the buffers are laid out for: this rank's shard of a DTensor parameter, else the parameter."""
        return local_tensor(self.param)

    def complete(self) -> None:
        """Wait for this slot's copy and accumulation (only this slot's): its host gradient is then whole."""
        self.landing.wait()
        self.adding.wait()
        if self.holding is Holding.ADDING:
            self.holding = Holding.GRADIENT


def _give_back_gradient(slot: Slot) -> None:
    """A released parameter's host-held gradient back into ``p.grad``: a copy on the parameter's device."""
    grad = slot.param.grad
    if grad is None or not is_host_resident(grad):
        return
    if slot.holding is Holding.NOTHING or slot.host_grad is None:
        slot.param.grad = None  # the stand-in of a gradient already dropped
        return
    local = slot.host_grad.to(device=slot.local.device, copy=True)
    if local_tensor(grad) is not grad:
        dtensor: Any = grad  # FSDP2: a DTensor with the stand-in's mesh and placements over the real shard
        slot.param.grad = type(dtensor)(local, dtensor._spec, requires_grad=False)
    else:
        slot.param.grad = local
    slot.holding = Holding.NOTHING


def _strides(t: Tensor) -> tuple[int, ...]:
    """The strides ``torch.empty_like`` gives a copy of ``t`` (the parameter's own where it is dense)."""
    return tuple(torch.empty_like(t, device="meta").stride())


class SlotTable:
    """The slots of one pipeline and the arenas their buffers live in."""

    def __init__(self, engine: TransferEngine, host_memory: Callable[[int, str], None] | None) -> None:
        self._engine = engine
        self._check = host_memory
        self.slots: dict[Tensor, Slot] = {}
        self._arenas: list[HostArena] = []

    def __iter__(self):
        return iter(self.slots.values())

    def __len__(self) -> int:
        return len(self.slots)

    def get(self, param: Tensor) -> Slot | None:
        return self.slots.get(param)

    def __getitem__(self, param: Tensor) -> Slot:
        return self.slots[param]

    def add(self, params: Iterable[Tensor]) -> list[Slot]:
        """Slots for the parameters that have none; the new ones."""
        new = []
        for p in params:
            if p not in self.slots:
                slot = self.slots[p] = Slot(p)
                new.append(slot)
        return new

    def release(self, keep: Iterable[Tensor]) -> list[Slot]:
        """Forget every parameter not in ``keep`` (see the module contract); the slots dropped."""
        kept = set(keep)
        gone = [s for p, s in self.slots.items() if p not in kept]
        for slot in gone:
            slot.complete()  # no copy or add may land in a buffer that is about to go
            slot.sending.wait()
            _give_back_gradient(slot)
            del self.slots[slot.param]
        if gone:
            self._drop_unused_arenas()
        return gone

    def place(self, slot: Slot, update_on: str) -> None:
        """``slot``'s group's update now runs ``update_on``: off the host it keeps no host buffers (the next
        relayout gives a slot back on the host its buffers)."""
        slot.update_on = update_on
        if not slot.on_host:
            slot.host_grad = slot.incoming = slot.staging = None
            slot.layout.clear()
            self._drop_unused_arenas()

    # ------------------------------------------------------------------ layout

    def relayout(self, *, defer_pin: bool) -> None:
        """Buffers for what has none or was laid out for another device or dtype (see the module contract)."""
        idle = [s for s in self.slots.values() if s.holding is Holding.NOTHING and s.on_host]
        grads = [s for s in idle if s.param.requires_grad and self.stale(s, "host_grad")]
        for s in grads:
            s.incoming = None  # laid out again with the next accumulation
        self._allocate("host_grad", grads, "gradients", defer_pin=defer_pin)
        staging = [s for s in self.slots.values()
                   if s.on_host and self._engine.is_device(s.local.device) and self.stale(s, "staging")]
        self._allocate("staging", staging, "parameter staging", defer_pin=defer_pin)

    @staticmethod
    def stale(slot: Slot, field: str) -> bool:
        """``field`` of ``slot`` must be laid out (again): missing, or made for another device or dtype (same shape)."""
        p = slot.local
        if p.device.type == "meta":
            return False  # holds no data; buffers come when it is materialised
        buffer = getattr(slot, field)
        if buffer is None:
            return True
        return buffer.shape == p.shape and slot.layout.get(field) != (p.device, p.dtype)

    def ensure_grad_buffer(self, slot: Slot) -> Tensor:
        if slot.host_grad is None:  # a parameter unfrozen (or materialised) since the last step
            self._allocate("host_grad", [slot], "gradients", defer_pin=True)
        assert slot.host_grad is not None  # allocated just above
        return slot.host_grad

    def ensure_incoming(self, slot: Slot) -> Tensor:
        if slot.incoming is None:
            # First accumulation: one buffer for every slot that has a gradient buffer, in one go. Inside
            # backward: page-locking gigabytes (cudaHostRegister) waits until the step; until then the
            # copies into it are synchronous.
            self._allocate(
                "incoming", [s for s in self.slots.values() if s.host_grad is not None and s.incoming is None],
                "accumulation", defer_pin=True,
            )
        assert slot.incoming is not None  # allocated just above
        return slot.incoming

    def _allocate(self, field: str, slots: list[Slot], label: str, *, defer_pin: bool) -> None:
        if not slots:
            return
        nbytes = sum(s.local.numel() * s.local.element_size() for s in slots)
        if self._check is not None:
            self._check(nbytes, label)  # the host-memory pre-flight, before anything is allocated
        lockers = [self._engine.page_locker(s.local.device) for s in slots]
        locker = next((lk for lk in lockers if lk is not None), None)
        arena = HostArena(
            ((id(s), s.local.shape, s.local.dtype, _strides(s.local)) for s in slots),
            pin=locker is not None, locker=locker, label=label, synchronize=self._engine.synchronize,
            defer_pin=defer_pin, field=field,
        )
        for s in slots:
            setattr(s, field, arena.views[id(s)])
            s.layout[field] = (s.local.device, s.local.dtype)
        self._arenas.append(arena)
        self._drop_unused_arenas()

    def _drop_unused_arenas(self) -> None:
        """Arenas none of whose views is in use any more (every slot laid out anew, or released) go."""
        in_use = {id(getattr(s, a.field)) for s in self.slots.values() for a in self._arenas}
        self._arenas = [a for a in self._arenas if any(id(v) in in_use for v in a.views.values())]

    def pin_deferred(self) -> None:
        """Page-lock buffers allocated inside backward (accumulation), now that no copy is in flight into them."""
        pending = [a for a in self._arenas if a.pin_pending]
        if not pending:
            return
        for slot in self.slots.values():
            slot.complete()
        for arena in pending:
            arena.pin_now()

    def pinned_bytes(self) -> int:
        """Page-locked host bytes held by the pipeline (exact: no allocator rounding unless the fallback ran)."""
        return sum(a.pinned_bytes for a in self._arenas)

    def host_buffer_bytes(self) -> dict[str, int]:
        """Host bytes of the pipeline's buffers, by purpose."""
        out: dict[str, int] = {}
        for a in self._arenas:
            out[a.label] = out.get(a.label, 0) + a.nbytes
        return out

    def arenas(self) -> list[HostArena]:
        return list(self._arenas)
