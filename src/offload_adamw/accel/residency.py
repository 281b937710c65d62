"""Where a gradient lives between backward and the step: kept on its device, or freed into host memory.

Contract, one strategy each, chosen once at construction:

* :class:`KeptGradients` (``offload_gradients=False``): ``p.grad`` on the device is the truth, and
  nothing is copied during backward: a copy taken then could not be known current at the step, since
  edits through ``.data``, collectives and DTensor ops move no version counter. The step copies each
  gradient once, bucket by bucket, the next bucket's copies issued while the current one updates.
* :class:`FreedGradients` (``offload_gradients=True``): each device gradient is copied to its host buffer
  as it lands and freed (the transfer engine keeps its memory until the copy has read it); ``p.grad``
  becomes the storage-less stand-in of accel/freed.py, through which torch's clipping, GradScaler and
  ``model.zero_grad()`` reach the host buffer (for a DTensor parameter a DTensor over it, so DTensor
  ops keep their cross-rank meaning). A second micro-batch's gradient is copied into the accumulation
  buffer and added on the accumulator thread; so is a reduced shard FSDP2 adds into ``p.grad``. Neither
  blocks backward. A cleared ``p.grad`` drops the host gradient; an assigned one replaces it. When the
  optimizer goes before its step, each stand-in becomes a real tensor holding its gradient (:meth:`FreedGradients.give_back`),
  except the gradients an update during backward already applied, which the pipeline clears first (accel/pipeline.py).
* Both strategies answer the step's question, :meth:`FreedGradients.ready` and :meth:`KeptGradients.ready`:
  the complete, current host gradient of a parameter, or None.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor

from offload_adamw.accel.freed import HostResidentGradient, is_host_resident
from offload_adamw.accel.slots import Holding, Slot, SlotTable, Source
from offload_adamw.accel.transfer import TransferEngine
from offload_adamw.distributed import local_tensor

__all__ = ["FreedGradients", "KeptGradients", "Residency", "drop_spent"]


class Guard(Protocol):
    """What the schedule says about reading, adding to or clearing a gradient now (accel/schedule.py)."""

    def check_read(self, slot: Slot) -> None: ...

    def check_accumulate(self, slot: Slot) -> None: ...

    def check_zero(self, slot: Slot) -> None: ...

    def check_drop(self, slot: Slot) -> None: ...


class Residency(Protocol):
    def land(self, slot: Slot, grad: Tensor) -> None: ...

    def land_reduced(self, slot: Slot, grad: Tensor) -> None: ...

    def after_ddp(self, slot: Slot) -> None: ...

    def prefetch(self, slots: list[Slot]) -> None: ...

    def ready(self, slot: Slot, validate: Callable[[Slot, Tensor], None]) -> Tensor | None: ...

    def landed(self, slot: Slot) -> Tensor | None: ...

    def gradient(self, slot: Slot, validate: Callable[[Slot, Tensor], None]) -> Tensor | None: ...

    def zero(self, slot: Slot, set_to_none: bool) -> None: ...

    def before_accumulate(self, slot: Slot) -> None: ...

    def present(self, slot: Slot) -> bool: ...

    def in_host_memory(self, slot: Slot) -> bool: ...


class KeptGradients:
    """``p.grad`` stays on the device; the step copies it once (see the module contract)."""

    def __init__(self, engine: TransferEngine, slots: SlotTable) -> None:
        self._engine = engine
        self._slots = slots

    def land(self, slot: Slot, grad: Tensor) -> None:
        return None  # copied at the step, where it is known current

    def land_reduced(self, slot: Slot, grad: Tensor) -> None:
        return None  # DDP writes it into p.grad in its final callback; the step copies it

    def after_ddp(self, slot: Slot) -> None:
        return None

    def _fetchable(self, slot: Slot) -> Tensor | None:
        grad = slot.param.grad
        if grad is None or grad.dtype != slot.param.dtype or grad.shape != slot.param.shape or grad.is_sparse:
            return None  # taken as it is by ready() (after validation), or refused there
        return grad

    def prefetch(self, slots: list[Slot]) -> None:
        """Issue the copies of the next bucket's gradients (the host waits only when it needs them)."""
        for slot in slots:
            grad = self._fetchable(slot)
            if grad is None or slot.fetched is grad or local_tensor(slot.param).device.type == "meta":
                continue
            host = self._slots.ensure_grad_buffer(slot)
            if host.shape != slot.local.shape:
                continue  # refused by name at validation
            slot.landing = self._engine.copy_to_host(local_tensor(grad), host)
            slot.fetched = grad

    def ready(self, slot: Slot, validate: Callable[[Slot, Tensor], None]) -> Tensor | None:
        grad = slot.param.grad
        if grad is None:
            return None
        validate(slot, grad)
        if grad.dtype != slot.param.dtype:
            # Not the dtype of the host buffer: taken as it is, as the plain step does.
            return local_tensor(grad).detach().to("cpu")
        if slot.fetched is not grad:
            slot.fetched = None
            self.prefetch([slot])
        slot.complete()
        slot.fetched = None
        return slot.host_grad

    def landed(self, slot: Slot) -> Tensor | None:
        raise AssertionError("updates during backward need freed gradients")  # refused at construction

    def gradient(self, slot: Slot, validate: Callable[[Slot, Tensor], None]) -> Tensor | None:
        return slot.param.grad

    def zero(self, slot: Slot, set_to_none: bool) -> None:
        slot.complete()  # no copy may land in host memory after it was cleared
        slot.fetched = None

    def before_accumulate(self, slot: Slot) -> None:
        return None

    def present(self, slot: Slot) -> bool:
        return slot.param.grad is not None

    def in_host_memory(self, slot: Slot) -> bool:
        return False  # copied at the step


class FreedGradients:
    """The host buffer is the gradient; ``p.grad`` its stand-in (see the module contract)."""

    def __init__(self, engine: TransferEngine, slots: SlotTable, guard: Guard, lock: threading.RLock,
                 describe: Callable[[Slot], str]) -> None:
        self._engine = engine
        self._slots = slots
        self._guard = guard
        self._lock = lock
        self._describe = describe

    # -------------------------------------------------------------- landing

    def land(self, slot: Slot, grad: Tensor) -> None:
        """A gradient from backward's hook: into host memory, and ``p.grad`` becomes its stand-in."""
        self._absorb(slot, grad)
        self.stand_in(slot, grad)

    def land_reduced(self, slot: Slot, grad: Tensor) -> None:
        """A reduced DDP bucket's slice: it replaces the host gradient (DDP accumulates on the device)."""
        host = self._slots.ensure_grad_buffer(slot)
        # No accepted DDP configuration queues an add into this buffer before its bucket lands, but an add of the user's
        # into p.grad's stand-in would: the copy must not write the buffer while the accumulator thread does.
        slot.complete()
        slot.landing = self._engine.copy_to_host(grad, host)
        slot.holding = Holding.GRADIENT

    def after_ddp(self, slot: Slot) -> None:
        """After DDP's final callback: ``p.grad`` is the reduced gradient (None where DDP found it unused)."""
        grad = slot.param.grad
        if grad is None or is_host_resident(grad):
            slot.holding = Holding.NOTHING
        else:
            self.stand_in(slot)

    def _absorb(self, slot: Slot, grad: Tensor) -> None:
        """Take ``grad`` into host memory: copy, or accumulate onto what is there."""
        host = self._slots.ensure_grad_buffer(slot)
        if slot.holding is Holding.NOTHING:
            slot.landing = self._engine.copy_to_host(local_tensor(grad), host)
            slot.holding = Holding.GRADIENT
            return
        slot.adding.wait()  # the accumulation buffer is about to be overwritten
        incoming = self._slots.ensure_incoming(slot)
        copied = self._engine.copy_to_host(local_tensor(grad), incoming)
        slot.adding = self._engine.add_on_host(_Both(slot.landing, copied), host, incoming)
        slot.holding = Holding.ADDING

    def stand_in(self, slot: Slot, like: Tensor | None = None) -> None:
        """``p.grad`` becomes the storage-less stand-in of the host gradient (accel/freed.py).

        For a DTensor gradient ``like`` (FSDP2) the stand-in is a DTensor with its mesh and placements, so that
        DTensor ops on ``p.grad`` (torch's clipping, FSDP2's accumulation) keep their cross-rank meaning. The
        stand-in refers to this strategy and its slot weakly: it never keeps an optimizer alive.
        """
        owner, target = weakref.ref(self), weakref.ref(slot)

        def call(method: str) -> Callable[[], Any]:
            def run() -> Any:
                me, s = owner(), target()
                if me is None or s is None:
                    raise RuntimeError("the optimizer that held this gradient in host memory no longer exists")
                return getattr(me, method)(s)
            return run

        def name() -> str:
            me, s = owner(), target()
            return "a parameter" if me is None or s is None else me._describe(s)

        def accumulate(other: Tensor) -> None:
            me, s = owner(), target()
            if me is None or s is None:
                raise RuntimeError("the optimizer that held this gradient in host memory no longer exists")
            me.accumulate_from_device(s, other)

        local = HostResidentGradient(slot.local, call("_resolve"), name, zero=call("_zero_host"), accumulate=accumulate)
        if like is None and local_tensor(slot.param) is not slot.param:
            like = slot.param  # a gradient assigned by hand: FSDP2's gradients have their parameter's mesh and placements
        if like is not None and local_tensor(like) is not like:
            grad: Any = like  # a DTensor: DTensor(local, spec) makes one without a copy or a check
            slot.param.grad = type(grad)(local, grad._spec, requires_grad=False)
        else:
            slot.param.grad = local

    def give_back(self) -> None:
        """The optimizer goes (or its pipeline closes) between backward and the step: each ``p.grad`` that stands for
        a host gradient becomes a real tensor holding it, on the parameter's device (a DTensor with the stand-in's
        mesh and placements), so that the gradient outlives the buffers and another optimizer finds it."""
        with self._lock:
            for slot in list(self._slots):
                grad = slot.param.grad
                if not is_host_resident(grad):
                    continue
                if slot.holding is Holding.NOTHING or slot.host_grad is None:
                    slot.param.grad = None  # stands for nothing (cleared): as a cleared gradient is
                    continue
                slot.complete()
                real: Any = slot.host_grad.to(slot.local.device, copy=True)  # a copy: the buffer goes with the pipeline
                if local_tensor(grad) is not grad:
                    real = type(grad)(real, grad._spec, requires_grad=False)
                slot.param.grad = real
                slot.holding = Holding.NOTHING

    # -------------------------------------------------- what p.grad's stand-in does

    def _resolve(self, slot: Slot) -> Tensor:
        self._guard.check_read(slot)
        with self._lock:
            slot.complete()
        assert slot.host_grad is not None  # a stand-in exists only for a gradient absorbed into host_grad
        return slot.host_grad

    def _zero_host(self, slot: Slot) -> None:
        """``p.grad.zero_()`` on the stand-in (``zero_grad(set_to_none=False)``): explicit zeros on the host."""
        self._guard.check_zero(slot)
        with self._lock:
            slot.complete()
        if slot.host_grad is not None:
            slot.host_grad.zero_()

    def accumulate_from_device(self, slot: Slot, grad: Tensor) -> None:
        """An add into ``p.grad`` (FSDP2 adds each reduced micro-batch into it): the same add, old + new in the
        gradient's dtype, through the accumulation buffer and the accumulator thread; backward does not wait."""
        self._guard.check_accumulate(slot)
        with self._lock:
            self._absorb(slot, grad)

    # ------------------------------------------------------------------ the step

    def drop(self, slot: Slot) -> None:
        """The user cleared ``p.grad`` (``model.zero_grad()``): the host gradient goes with it."""
        self._guard.check_drop(slot)
        slot.complete()  # no copy or add may land in the buffer after it was cleared
        slot.holding = Holding.NOTHING

    def before_accumulate(self, slot: Slot) -> None:
        """Before autograd accumulates into ``p.grad``: read what the user did to it since."""
        grad = slot.param.grad
        if is_host_resident(grad):
            if slot.source is Source.DDP and slot.holding is not Holding.NOTHING:
                raise RuntimeError(
                    f"{self._describe(slot)}: with offload_gradients=True under DistributedDataParallel, gradients are "
                    "accumulated on the device by DDP: accumulate micro-batches inside ddp_model.no_sync() and "
                    "let only the last backward synchronise, and clear the gradients after each step "
                    "(opt.zero_grad() or model.zero_grad())"
                )
            slot.param.grad = None  # autograd stores the new gradient; the hook adds it to the host's
        elif slot.holding is not Holding.NOTHING:
            self.drop(slot)  # cleared (None) or assigned by the user: the host gradient goes

    def prefetch(self, slots: list[Slot]) -> None:
        return None  # copied during backward

    def ready(self, slot: Slot, validate: Callable[[Slot, Tensor], None]) -> Tensor | None:
        grad = slot.param.grad
        if grad is None:
            if slot.holding is not Holding.NOTHING:
                self.drop(slot)  # cleared by the user (model.zero_grad())
            return None
        if not is_host_resident(grad):  # set outside backward's hooks, or produced before the hook existed
            validate(slot, grad)
            if slot.holding is not Holding.NOTHING:
                self.drop(slot)  # an assigned gradient replaces the host's
            self._absorb(slot, grad)
            self.stand_in(slot)
        if slot.holding is Holding.NOTHING:
            return None
        slot.complete()
        return slot.host_grad

    def landed(self, slot: Slot) -> Tensor | None:
        """An early update's gradient: the host buffer the parameter landed with, complete (never ``p.grad``: the
        worker reads it while the user's thread goes on, and DDP sets it only in its final callback)."""
        if slot.holding is Holding.NOTHING:
            return None
        slot.complete()
        assert slot.host_grad is not None  # the hook or the communication hook copied into it before it landed
        return slot.host_grad

    def gradient(self, slot: Slot, validate: Callable[[Slot, Tensor], None]) -> Tensor | None:
        return self.ready(slot, validate)

    def zero(self, slot: Slot, set_to_none: bool) -> None:
        slot.complete()  # no copy or add may land in host memory after it was cleared
        if set_to_none:
            slot.holding = Holding.NOTHING
        elif slot.holding is not Holding.NOTHING:
            assert slot.host_grad is not None  # holding: host_grad holds it
            slot.host_grad.zero_()

    def present(self, slot: Slot) -> bool:
        return slot.holding is not Holding.NOTHING

    def in_host_memory(self, slot: Slot) -> bool:
        """Whether the latest gradient's copy (and add) into host memory has already ended."""
        return slot.holding is not Holding.NOTHING and slot.landing.done() and slot.adding.done()


class _Both:
    """Complete when both completions are (an add needs the buffer it adds into and the one it adds)."""

    __slots__ = ("_a", "_b")

    def __init__(self, a: Any, b: Any) -> None:
        self._a, self._b = a, b

    def wait(self) -> None:
        self._a.wait()
        self._b.wait()

    def done(self) -> bool:
        return bool(self._a.done() and self._b.done())


def drop_spent(spent: dict[Tensor, str]) -> None:
    """The pipeline closes (its optimizer went) between a backward whose updates ran and step(): those gradients were
    applied. Given back, another optimizer would apply them again; each such ``p.grad`` is None, as torch's
    optimizer-in-backward pattern (step() and zero_grad() in a post-accumulate-grad hook) leaves it, with a warning."""
    names = [name for p, name in spent.items() if p.grad is not None]
    for p in spent:
        p.grad = None
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        warnings.warn(
            f"an OffloadAdamW was dropped between backward and step(): the gradients of {len(names)} parameter(s) "
            f"({shown}) are not given back (p.grad is None): with update_in_backward=True their updates already ran "
            "during that backward, and another optimizer would apply them a second time",
            RuntimeWarning, stacklevel=2,
        )
