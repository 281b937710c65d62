"""Where each parameter's update runs: the placement of its group, a component chosen once per group.

Contract:

* :class:`Placements` routes each parameter of a bucket to the component of its group's placement
  (contract/rules.py's PLACEMENTS): ``"host"`` to accel/host_update.py, ``"stream"`` to accel/stream_update.py,
  ``"device"`` to accel/device_update.py. Device work is issued first, so that it runs while the host updates
  the host groups of the same bucket. The front builds the three components; this router only chooses.
* :meth:`Placements.assign` reads every group's placement at each refresh and at the first hook of every backward
  (so that a placement changed between steps takes effect for the next backward's gradients), refusing an unknown
  value by the group's name; a slot whose placement changed drops (or, back on the host, gets) its host buffers. A
  change while a host slot holds its gradient in host memory (freed gradients, between backward and ``step()``)
  is refused: that gradient left the device for the old placement. A device gradient serves every placement.
* :meth:`Placements.prepare` runs before the optimizer's pre-flight (which creates missing state) and before any
  update of a step: each on-device component allocates its device buffers there (after its own memory check), so
  that a step that cannot get them fails before it has changed anything. :meth:`Placements.settle` ends a step: the host waits
  for the copies of streamed state back into host memory; :meth:`Placements.close` (the optimizer dropped) lets the
  device buffers go at once.
* Every component's :meth:`Placement.run` is a generator: it yields the work of each group (accel/work.py) and
  goes on once its driver has done it (optim/bucket.py); :meth:`Placements.run` chains them in that order.
* :func:`gather` is what both on-device components do first for a group: each parameter's device gradient
  (multiplied in place by the step's clip coefficient, as ``clip_grads_with_norm_`` does), its state, asked of
  the driver by yielding a :class:`~offload_adamw.accel.work.DeviceGroup` per group, and the flat operands the kernel
  pairs element by element (kernels/layout.py: temporaries only where a tensor is laid out otherwise), with the edits
  a device parameter took since the last update; after the update it tells the residency the gradient was used
  (``used``: the version it has now is the update's own).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from offload_adamw.accel.slots import Holding, Slot, SlotTable
from offload_adamw.accel.transfer import Completion, TransferEngine
from offload_adamw.accel.work import DeviceGroup, Work
from offload_adamw.contract.rules import PLACEMENT_KEY, PLACEMENTS, check_placement
from offload_adamw.kernels import layout
from offload_adamw.kernels.adamw import StepHyper
from offload_adamw.kernels.fused_device import StateOperands

__all__ = ["Placement", "Placements", "TensorWork", "gather", "sender"]

Sent = list[tuple[torch.device, Completion]]


class Placement(Protocol):
    """One placement's updates (HostUpdate, StreamUpdate, DeviceUpdate): its whole surface, which the router calls
    for every placement alike (a host update reserves, holds and settles nothing on a device)."""

    def reserve(self, slots: Sequence[Slot]) -> None:
        """Device buffers for these slots' updates of this step, after a memory check; before any update."""

    def run(self, params: list[Tensor], where: dict[Tensor, tuple[int, int]], scale: Tensor | None,
            gradient: Callable[[Slot], Tensor | None], times: dict[str, float] | None = None,
            ) -> Generator[Work, None, Sent]:
        """The bucket's update of these parameters: yields each group's work for the driver (accel/work.py), and
        returns the completions of what it sent to a device."""

    def settle(self) -> None:
        """The end of a step: what this placement still copies into host memory has landed."""

    def close(self) -> None:
        """The optimizer is gone: its device buffers go now."""

    def buffer_bytes(self) -> int:
        """Device bytes this placement's buffers hold, as allocated."""


class Placements:
    """Each parameter's update by its group's placement (see the module contract)."""

    def __init__(self, groups: Callable[[], list[dict[str, Any]]], describe: Callable[[int, int], str], slots: SlotTable,
                 components: dict[str, Placement]) -> None:
        assert set(components) == set(PLACEMENTS)
        self._groups = groups  # the optimizer's param_groups as they are now (a load replaces the list)
        self._describe = describe
        self._slots = slots
        self._components = components

    def assign(self, places: dict[Tensor, tuple[int, int]]) -> None:
        names = {}
        for gi, group in enumerate(self._groups()):
            names[gi] = check_placement(group.get(PLACEMENT_KEY, "host"), f"param_groups[{gi}]")
        for p, (gi, _) in places.items():
            slot = self._slots[p]
            name = names[gi]
            if slot.update_on == name:
                continue
            if slot.on_host and slot.holding is not Holding.NOTHING:
                raise RuntimeError(
                    f"{self._describe(gi, places[p][1])}: param_groups[{gi}]['{PLACEMENT_KEY}'] changed "
                    f"from {slot.update_on!r} to {name!r} while its gradient is held in host memory (offload_gradients, "
                    "between backward and step()); change a group's placement between steps, after opt.zero_grad()"
                )
            slot.holding, slot.fetched = Holding.NOTHING, None
            self._slots.place(slot, name)

    def prepare(self, params: Sequence[Tensor]) -> None:
        for name, component in self._components.items():
            slots = [self._slots[p] for p in params if self._slots[p].update_on == name]
            if slots:
                component.reserve(slots)

    def run(self, params: list[Tensor], where: dict[Tensor, tuple[int, int]], scale: Tensor | None,
            gradient: Callable[[Slot], Tensor | None], times: dict[str, float] | None = None,
            ) -> Generator[Work, None, Sent]:
        by_placement: dict[str, list[Tensor]] = {}
        for p in params:
            by_placement.setdefault(self._slots[p].update_on, []).append(p)
        sent: Sent = []
        for name in ("stream", "device", "host"):  # device work first: it runs while the host updates
            if name in by_placement:
                sent += yield from self._components[name].run(by_placement[name], where, scale, gradient, times)
        return sent

    def on_device(self, p: Tensor, grad: Tensor) -> bool:
        """Whether ``p``'s gradient ``grad`` stays on the device (a streamed or resident group's), not in host memory."""
        return not self._slots[p].on_host

    def settle(self) -> None:
        for component in self._components.values():
            component.settle()

    def close(self) -> None:
        """The optimizer is gone: its device buffers go now, not when the collector finds the pipeline's cycle."""
        for component in self._components.values():
            component.close()

    def device_buffer_bytes(self) -> int:
        return sum(component.buffer_bytes() for component in self._components.values())


@dataclass
class TensorWork:
    """One tensor's share of an on-device update: its state and the flat operands its kernel reads and writes."""

    slot: Slot
    state: StateOperands
    grad: Tensor
    """The gradient's flat view on the device, in the state's layout."""
    model: Tensor | None
    """The flat view that receives round(master) (the parameter, or a temporary written back), or None."""
    state_flats: list[Tensor]
    """master, exp_avg, exp_avg_sq (and max_exp_avg_sq): flat views where the state lives."""
    take_edits: bool
    write_back: Callable[[], None]
    """Copies the temporaries back (after the update) and records the parameter's version as the update left it."""
    host_temporaries: bool
    """Whether a temporary stands for a host tensor (an own-master host parameter laid out otherwise)."""

    @property
    def numel(self) -> int:
        return self.grad.numel()


def gather(slots: SlotTable, params: list[Tensor], where: dict[Tensor, tuple[int, int]],
           gradient: Callable[[Slot], Tensor | None], coefficient: Callable[[torch.device], Tensor | None],
           used: Callable[[Slot, Tensor], None] = lambda slot, grad: None,
           ) -> Generator[DeviceGroup, None, list[tuple[int, StepHyper, dict[torch.device, list[TensorWork]]]]]:
    """Per group (in order of first appearance): its index, hyperparameters and work by update device; each group's
    state is asked of the driver (a yielded DeviceGroup) before any kernel of the bucket runs."""
    by_group: dict[int, list[tuple[Slot, Tensor]]] = {}
    for p in params:
        slot = slots[p]
        grad = gradient(slot)
        if grad is not None:
            coef = coefficient(grad.device)  # the gate's, on the gradient's device (Gate.coefficient_on)
            if coef is not None:
                grad.mul_(coef)  # what clip_grads_with_norm_ does to p.grad
            by_group.setdefault(where[p][0], []).append((slot, grad))
    out = []
    for gi, members in by_group.items():
        asked = DeviceGroup(gi, [slot.param for slot, _ in members])
        yield asked  # the driver puts the group's state in it (optim/bucket.py)
        hp, states = asked.given()
        by_device: dict[torch.device, list[TensorWork]] = {}
        for (slot, grad), state in zip(members, states):
            by_device.setdefault(slot.local.device, []).append(_work(slot, grad, state, used))
        out.append((gi, hp, by_device))
    return out


def sender(engine: TransferEngine, device: torch.device) -> Callable[[Tensor], Tensor] | None:
    """How a step's small host tensors (step counts, the loss scale) reach ``device`` in both on-device components: the
    engine's lane (no host wait), or None on the host."""
    if not engine.is_device(device):
        return None
    return lambda host: engine.to_device(device, host)


def _work(slot: Slot, grad: Tensor, state: StateOperands, used: Callable[[Slot, Tensor], None]) -> TensorWork:
    local = slot.local
    moved = slot.sent_version is not None and (local._version != slot.sent_version or local.data_ptr() != slot.sent_ptr)
    model = state.model
    aligned = layout.align([state.master, state.exp_avg, state.exp_avg_sq, state.max_exp_avg_sq, grad.detach(), model],
                           read=(True,) * 6, written=(True, True, True, True, False, True))
    master, m, v, mx, g, out = aligned.tensors
    assert master is not None and m is not None and v is not None and g is not None

    def write_back() -> None:
        aligned.write_back()
        slot.sent_version, slot.sent_ptr = local._version, local.data_ptr()  # our own write is no edit
        # Nor is our own use of the gradient a change after backward: the clip coefficient's multiply, and torch's
        # fused op, whose schema marks its gradients as written (it moves their version counter).
        used(slot, grad)

    return TensorWork(
        slot=slot, state=state, grad=layout.flat(g), model=None if out is None else layout.flat(out),
        state_flats=[layout.flat(t) for t in (master, m, v, mx) if t is not None],
        take_edits=out is not None and (state.follow_edits or moved), write_back=write_back,
        host_temporaries=any(given.device.type == "cpu" for given, _ in aligned.write_backs),
    )
