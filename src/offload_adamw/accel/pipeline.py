"""The transfer pipeline between a parameter's device and the host for OffloadAdamW: the front.

Contract:

* **Gradients leave the device as backward produces them** (freed gradients) or once, at the step (kept
  gradients): accel/residency.py. Every copy and every wait goes through one transfer engine
  (accel/transfer.py): on CUDA side streams ordered after the producing stream, with events the host
  waits on only when it needs *that* buffer; on the CPU synchronous copies. The stream lane runs over a
  stream backend (accel/streams.py): ``torch.cuda``, or the simulated CUDA device the tests install, whose
  copies land late into poisoned buffers and which records CUDA's hazards: that is how CI proves the
  order of work of the very lane a GPU runs.
* **Where gradients come from**: autograd's hooks (FSDP2 calls them after each reduce-scatter) or the
  communication hook of an attached DDP model (accel/sources.py); both end in :meth:`GradientPipeline.land`.
* **The step is the optimizer's** (optim/step.py: check, clip, non-finite policy, pre-flight, updates);
  this pipeline is its transport (accel/transport.py, :attr:`GradientPipeline.transport`): it says where
  the gradients are and hands the buckets out (accel/bucketing.py): gradients in the order they arrived, in
  buckets of about ``bucket_bytes`` (an FSDP2 group or a DDP bucket is one bucket); the host waits only
  for the bucket at hand (kept gradients: the next bucket's copies are issued while it updates), hands out
  each group's work (accel/work.py, laid out by accel/host_update.py and the other placements), which the
  optimizer does (optim/bucket.py), and sends the parameters back without waiting; the compute stream waits
  for them, so the next forward waits on the device, not the host.
* **It holds no optimizer and calls none**: what it needs of the optimizer it is handed at construction as
  data and narrow callables (:class:`Wiring`, built by optim/bucket.py over a weak reference).
* **Updates during backward** (``update_in_backward``): accel/schedule.py, gated for clipping and
  non-finite policies by accel/gate.py; each bucket is handed whole to ``Wiring.update_bucket``. What cannot
  be made exact after updates ran is refused by name.
* **Buffers follow the parameters** (accel/slots.py): a parameter cast or moved gets buffers laid out
  anew, with the parameter's strides; every allocation passes the optimizer's host-memory check first.
* **Where each group's update runs** (``update_on``): on the host (accel/host_update.py), streamed through a ring of
  device buffers (accel/stream_update.py) or on the device with resident state (accel/device_update.py), routed per
  group by accel/placements.py; a streamed or resident group's gradient never leaves the device
  (accel/device_grads.py), also with ``offload_gradients``, which frees the gradients of host groups only.
* A parameter that leaves ``param_groups`` (accelerate's and the Trainer's swap to FSDP2 shards, any edit) is
  released with its hooks and buffers, and one put in gets its hooks before its first backward (accel/swaps.py).
* **Nothing of this is optimizer state**: ``state_dict`` looks the same with or without the pipeline.
* **GradScaler**: the step honours ``grad_scale`` (gradients divided by it in float32, as torch's fused
  AdamW does) and ``found_inf`` (the step is skipped, nothing changes). Freed gradients are invisible to
  ``torch.amp.GradScaler``; :class:`~offload_adamw.accel.amp.OffloadGradScaler` unscales the host copies,
  and a plain GradScaler with freed gradients is refused instead of silently skipping the unscale.

Only this module wires the components; each is chosen once, at construction, by the configuration.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offload_adamw.accel import amp, streams, swaps
from offload_adamw.accel.ddp import AttachedModels
from offload_adamw.accel.device_grads import ByPlacement, DeviceGradients, LandedDeviceGradients, landed_intact
from offload_adamw.accel.device_update import DeviceUpdate
from offload_adamw.accel.gate import Gate, Settings, StepGate, StepPolicy, clipped_view
from offload_adamw.accel.host_update import HostUpdate
from offload_adamw.accel.overlap import Armed
from offload_adamw.accel.placements import Placements
from offload_adamw.accel.residency import FreedGradients, KeptGradients, drop_spent
from offload_adamw.accel.schedule import AtStep, DuringBackward
from offload_adamw.accel.slots import Holding, Slot, SlotTable
from offload_adamw.accel.sources import AutogradHooks, DdpSource, EarlyTaking, FreedTaking, GroupIds, KeptTaking
from offload_adamw.accel.stream_update import StreamUpdate
from offload_adamw.accel.timeline import Recorder, StepTimeline
from offload_adamw.accel.transfer import TransferEngine
from offload_adamw.accel.transport import StepTransport
from offload_adamw.accel.work import LandedBucket, Work

__all__ = ["GradientPipeline", "PipelineConfig", "Wiring"]


@dataclass(frozen=True, kw_only=True)
class Wiring:
    """What the pipeline is handed by the optimizer that owns it, once, at construction: data and narrow callables
    (optim/bucket.py's ``wiring`` builds them over a weak reference: the optimizer owns the pipeline, and a dropped
    optimizer takes its hooks and buffers with it). The pipeline holds no optimizer and calls none.

    Parameters are named by ``(group_index, index)`` in ``param_groups``. The step's sequence is the optimizer's
    (optim/step.py), which drives :attr:`GradientPipeline.transport`; for updates during backward the pipeline hands
    each bucket to ``update_bucket`` (optim/bucket.py's ``BackwardBuckets``)."""

    groups: Callable[[], list[dict[str, Any]]]
    """The optimizer's ``param_groups`` as they are now (a load replaces the list)."""
    describe: Callable[[int, int], str]
    """A parameter's name, as the optimizer's messages give it."""
    gradient_check: Callable[[int, int, Tensor], None]
    """The optimizer's check of a gradient that a read outside ``step()`` hands out (optim/update.py)."""
    has_state: Callable[[Tensor], bool]
    clip_order: Callable[[], list[Tensor]]
    """The parameters in the order clipping reduces their norms (the model's, optim/clip_order.py)."""
    host_memory: Callable[[int, str], None]
    """The host-memory check before host buffers are allocated."""
    device_memory: Callable[[int, torch.device, str], None]
    """The device-memory check before device buffers are allocated."""
    settings: Settings
    policy: StepPolicy
    """The step's clipping and non-finite decision (optim/policy.py), for the gate of updates during backward."""
    update_bucket: Callable[[LandedBucket], None]


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How OffloadAdamW moves gradients and parameters between device and host."""

    offload_gradients: bool = False
    """Free each device gradient as soon as its copy to the host is issued (the host buffer is then the gradient)."""
    bucket_bytes: int = 32 << 20
    """Gradient bytes per bucket of the step: the host waits for one bucket's copies at a time."""
    update_in_backward: bool = False
    """Start each bucket's host update on a worker thread as soon as its gradients are all in during
    backward (from the second step on: buckets follow the previous backward's order). Needs freed
    device gradients; micro-batches that only accumulate run inside ``no_sync()``."""
    stream_chunk_bytes: int = 64 << 20
    """Device bytes of one ring buffer of a streamed group (its state arrays and a gradient buffer), and of the
    widening buffer of a resident group; at least 1 MiB, rounded down to a multiple of 4 KiB."""
    stream_buffers: int = 2
    """Ring buffers per device of the streamed groups: 2 or 3."""

    def __post_init__(self) -> None:
        if not 0 < self.bucket_bytes:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if not (isinstance(self.stream_chunk_bytes, int) and 1 << 20 <= self.stream_chunk_bytes):
            raise ValueError(f"stream_chunk_bytes must be an int of at least 1 MiB (1048576), got {self.stream_chunk_bytes!r}")
        if self.stream_buffers not in (2, 3) or isinstance(self.stream_buffers, bool):
            raise ValueError(f"stream_buffers must be 2 or 3, got {self.stream_buffers!r}")
        if self.update_in_backward and not self.offload_gradients:
            raise ValueError(
                "update_in_backward=True needs offload_gradients=True: a gradient kept on the device could still "
                "be changed (clipped, unscaled) after its early update"
            )


class GradientPipeline:
    """Hooks, host buffers, transfers and the bucketed step of one OffloadAdamW (see the module contract)."""

    def __init__(self, config: PipelineConfig, wiring: Wiring) -> None:
        self._wiring = wiring
        self._closed = False
        self.config = config
        self.offload_gradients = config.offload_gradients
        self.engine = TransferEngine(streams.installed())
        # With parameters on several devices autograd runs the hooks on one thread per device, and the GIL is
        # released inside copies and waits: every entry from outside (hooks, DDP callbacks, p.grad's stand-in)
        # takes this lock.
        self._lock = threading.RLock()
        self._syncing = True
        self._arrival = 0
        self.slots = SlotTable(self.engine, wiring.host_memory)
        self.recorder = Recorder()
        self._places: dict[Tensor, tuple[int, int]] = {}  # (group, index) of each parameter as of the latest refresh()
        # Built in dependency order, nothing patched afterwards; each mode is a component chosen here, once.
        models, groups = AttachedModels(), GroupIds()  # shared by the gate and the DDP source, which needs the gate
        device_grads = (LandedDeviceGradients if config.update_in_backward else DeviceGradients)(self.engine, self.slots)
        intact = landed_intact(device_grads)
        # Updates during backward: the gate their schedule waits on; else the step decides alone (StepGate).
        gate_kind = Gate if config.update_in_backward else StepGate
        armed = Armed()  # the updater of the coming backward: the schedule sets it, the gate opens it
        self.gate: Gate | StepGate = gate_kind(wiring.settings, self.slots, self.engine, order=wiring.clip_order,
                                               describe=self._describe, policy=wiring.policy,
                                               decision_groups=models.process_groups, intact=intact,
                                               on_open=armed.open_gate)
        self.schedule: AtStep | DuringBackward = (
            DuringBackward(wiring.settings, self.slots, self.gate, armed, groups=wiring.groups,
                           has_state=wiring.has_state, describe=self._describe,
                           run_early=self._run_early, thread_init=self.engine.thread_init, intact=intact,
                           engine=self.engine)
            if isinstance(self.gate, Gate) else AtStep()  # the gate chosen above: the same mode
        )
        self.residency: ByPlacement = ByPlacement(
            FreedGradients(self.engine, self.slots, self.schedule, self._lock, self._describe)
            if config.offload_gradients else KeptGradients(self.engine, self.slots),
            device_grads,
        )
        coefficient = lambda: self.gate.coefficient  # noqa: E731
        chunk = config.stream_chunk_bytes // 4096 * 4096
        self.placements = Placements(wiring.groups, wiring.describe, self.slots, {
            "host": HostUpdate(self.slots, self.engine, self.recorder, coefficient),
            "stream": StreamUpdate(self.slots, self.engine, wiring.device_memory, self.gate.coefficient_on, chunk_bytes=chunk,
                                   buffers=config.stream_buffers, used=self.residency.used),
            "device": DeviceUpdate(self.slots, self.engine, wiring.device_memory, self.gate.coefficient_on, chunk_bytes=chunk,
                                   used=self.residency.used),
        })
        taking = EarlyTaking() if config.update_in_backward else FreedTaking() if config.offload_gradients else KeptTaking()
        self.ddp = DdpSource(
            self.slots, self, taking=taking, land_reduced=self.residency.land_reduced,
            after_ddp=self.residency.after_ddp, groups=groups, models=models, lock=self._lock, gate=self.gate,
            on_device=self.engine.on_home,
        )
        self.hooks = AutogradHooks(
            self.slots, self, self._lock, taking=taking, groups=groups,
            before_accumulate=self.residency.before_accumulate,
            second_backward=self.schedule.check_second_backward, relayout=lambda: self.slots.relayout(defer_pin=True),
            on_backward=[lambda: self.placements.assign(self._places), self.ddp.check_unattached,
                         self.schedule.backward_began, lambda: swaps.look_before_next_forward(self)],
        )
        self.transport = StepTransport(self)
        self.refresh()
        swaps.look_before_next_forward(self)

    # ------------------------------------------------------------------ set-up

    def refresh(self, *, if_changed: bool = False) -> None:
        """Slots for new parameters, released ones for those that left; buffers for what has none or was laid out for
        another device or dtype; hooks.

        Runs at construction, at every step and (``if_changed``: only when ``param_groups`` changed) at the first module
        forward after each (accel/swaps.py), outside backward.
        """
        groups = self._wiring.groups()
        if if_changed and not swaps.changed(groups, self._places):
            return
        self._places = {p: (gi, i) for gi, g in enumerate(groups) for i, p in enumerate(g["params"])}
        swaps.refuse_flat_parameters((p for p in self._places if self.slots.get(p) is None), self._describe)
        with self._lock:
            self.hooks.forget(self.slots.release(self._places))
        new = self.slots.add(self._places)
        for slot in new:
            self.engine.claim(slot.local)
        self.placements.assign(self._places)
        self.slots.relayout(defer_pin=False)
        self.hooks.watch(new)

    def close(self) -> None:
        """Remove the hooks, stop the worker threads, free the device buffers; once, here or when the optimizer goes
        (optim/bucket.py's ``pipeline_for`` calls it from a finaliser of the optimizer)."""
        if self._closed:
            return
        self._closed = True
        swaps.stop_looking(self)
        self.hooks.close()
        drop_spent(self.schedule.close())  # after the worker has ended: the gradients its updates applied
        self.residency.close()  # freed gradients outlive their buffers: each p.grad becomes a real tensor holding one
        # The pipeline is a reference cycle, freed only by the collector: what it holds on the device goes now.
        self.placements.close()
        self.engine.close()

    def attach_ddp(self, ddp: Any) -> None:
        """Take DDP's reduced gradients from its communication hook (accel/sources.py)."""
        self.refresh()
        self.ddp.attach(ddp)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches that only accumulate: their gradients stay where autograd accumulates them (on the
        device) and start no copy and no update; the next backward outside it copies each once."""
        before, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = before

    def last_step_timeline(self) -> StepTimeline | None:
        """The timeline of the latest step (accel/timeline.py), or None before the first."""
        return self.recorder.latest

    # -------------------------------------------------------- landing (sources)

    def syncing(self) -> bool:
        return self._syncing

    def arrived(self, slot: Slot, group: int | None) -> None:
        self._arrival += 1
        slot.arrival = self._arrival
        slot.group = group

    def land(self, slot: Slot, grad: Tensor, *, group: int | None, accumulated: bool) -> None:
        """``slot``'s gradient from backward's hook, complete on its device: into host memory (freed), its norm and
        count (gated), and its bucket told (updates during backward)."""
        self.arrived(slot, group)
        if self.gate.tracks():
            self.gate.take(slot.param, grad, accumulated=accumulated)
        if self.gate.gated():
            self.gate.queue_decision()
        self.residency.land(slot, grad)
        self.recorder.landed(slot.param, copied=self.residency.in_host_memory(slot))
        self.schedule.landed(slot)

    def reduced_landed(self, slot: Slot, grad: Tensor, *, lands: bool) -> None:
        """A reduced DDP gradient was copied to the host; the decision follows DDP's final callback."""
        self.recorder.landed(slot.param, copied=self.residency.in_host_memory(slot))
        if lands:
            if self.gate.tracks():
                self.gate.take(slot.param, grad, accumulated=False)
            self.schedule.landed(slot)

    # ---------------------------------------------------------------- gradients

    def _describe(self, which: Slot | Tensor) -> str:
        """A slot's or parameter's name, as the optimizer's messages give it."""
        where = self._places.get(which.param if isinstance(which, Slot) else which)
        return self._wiring.describe(*where) if where is not None else "a parameter"

    def places(self) -> dict[Tensor, tuple[int, int]]:
        """(group, index) of each parameter as of the latest refresh(), in optimizer order."""
        return self._places

    def _validate(self, slot: Slot, grad: Tensor) -> None:
        """The optimizer's checks (optim/update.py), then what the pipeline's buffers need."""
        where = self._places[slot.param]
        self._wiring.gradient_check(where[0], where[1], grad)
        self.check_buffers(slot, grad)

    def check_buffers(self, slot: Slot, grad: Tensor) -> None:
        """What the pipeline's buffers need of ``slot``'s gradient ``grad``."""
        describe, where = self._wiring.describe, self._places[slot.param]
        if self.offload_gradients and slot.on_host and grad.dtype != slot.param.dtype:
            raise RuntimeError(
                f"gradient of {describe(*where)} has dtype {grad.dtype}, the parameter {slot.param.dtype}: "
                "with offload_gradients=True gradients are accumulated in host buffers of the parameter's dtype; "
                "produce gradients in the parameter's dtype, or use offload_gradients=False"
            )
        if slot.host_grad is not None and slot.host_grad.shape != slot.local.shape:
            raise RuntimeError(
                f"{describe(*where)} changed shape under the optimizer: its host gradient buffer "
                f"has {tuple(slot.host_grad.shape)}, the parameter is {tuple(slot.local.shape)}"
            )

    def _ready(self, slot: Slot) -> Tensor | None:
        with self._lock:
            return self.residency.ready(slot, self._validate)

    def checked(self, slot: Slot) -> Tensor | None:
        """:meth:`_ready` in ``step()``, after the step checked every gradient once (not again: accel/transport.py)."""
        with self._lock:
            return self.residency.ready(slot, lambda _slot, _grad: None)

    def host_gradients(self, order: Sequence[Tensor] | None = None,
                       ready: Callable[[Tensor], Tensor | None] | None = None) -> list[tuple[Tensor, Tensor]]:
        """(parameter, complete host gradient) for every parameter that has one, in optimizer order (or ``order``'s)."""
        self.refresh()
        out = []
        for p in self._places if order is None else order:
            grad = self._ready(self.slots[p]) if ready is None else ready(p)
            if grad is not None:
                out.append((p, grad))
        return out

    def gradient_tensors(self, order: Sequence[Tensor] | None = None,
                         ready: Callable[[Tensor], Tensor | None] | None = None) -> list[Tensor]:
        """The gradients as the truth holds them: host buffers when freed, else the device ``p.grad``; in optimizer
        order, or in ``order`` (the parameters in the order clipping reads them); ``ready``: a host gradient as
        ``step()`` reads it, checked already."""
        if self.config.update_in_backward:
            raise RuntimeError(
                "with update_in_backward=True the host updates may already have consumed the gradients during "
                "backward: they cannot be read or changed between backward and step(); use update_in_backward=False"
            )
        if self.offload_gradients:
            return [clipped_view(p, g) for p, g in self.host_gradients(order, ready)]
        params = [p for g in self._wiring.groups() for p in g["params"]] if order is None else order
        return [p.grad for p in params if p.grad is not None]

    def gradient(self, p: Tensor) -> Tensor | None:
        """The current gradient of ``p``: its host buffer when device gradients are freed, else ``p.grad``."""
        if not self.offload_gradients:
            return p.grad
        self.refuse_mid_step("read a gradient")
        self.refresh()
        if p not in self._places:
            raise KeyError("the tensor is not a parameter of this optimizer")
        return self._ready(self.slots[p])

    def zero_grad(self, set_to_none: bool) -> None:
        """Clear the host gradients as torch's zero_grad clears ``p.grad`` (device grads: the optimizer's job)."""
        self.schedule.zero_grad()
        self.new_step()
        with self._lock:
            for slot in self.slots:
                self.residency.zero(slot, set_to_none)
        self.refresh()

    def unscale_(self, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool) -> dict[torch.device, Tensor]:
        """GradScaler's unscale-and-check over the gradients wherever they live (freed mode; accel/amp.py)."""
        return amp.unscale_gradients_(self.host_gradients(), inv_scale, found_inf, allow_fp16, self.placements.on_device,
                                      lambda host: self.engine.to_device(found_inf.device, host))

    def refuse_mid_step(self, what: str) -> None:
        """Raise when updates already ran during this backward and the optimizer is asked to ``what`` before step()."""
        self.schedule.refuse_mid_step(what)

    def armed(self) -> bool:
        """Whether the next backward's updates may start during it (updates during backward, buckets set)."""
        return self.schedule.armed()

    def gate_taken(self) -> bool:
        """Whether the end of the latest backward let the gated updates start (until the step)."""
        return self.gate.taken

    def new_step(self) -> None:
        """Outside backward: nothing of a backward is pending, also when one raised before its end."""
        self.gate.reset()
        self.hooks.new_step()
        self.ddp.new_step()
        swaps.look_before_next_forward(self)
        self.residency.new_step()

    def _run_early(self, bucket: list[Tensor]) -> tuple[list[Any], dict[str, float]]:
        """A bucket's update on the worker thread, while backward goes on (accel/schedule.py): handed whole to the
        bucket function given at construction (optim/bucket.py), which checks, creates state and serves its work."""
        where = self._places
        members = [p for p in bucket if p in where]
        landed = [p for p in members if self.slots[p].holding is not Holding.NOTHING]
        gradients = []
        for p in landed:
            grad = self.residency.landed(self.slots[p])
            assert grad is not None  # landed: in its host buffer (the hook or the communication hook copied it) or device
            gradients.append((where[p], p, grad))
        times: dict[str, float] = {}
        sent: list[Any] = []

        def updates() -> Generator[Work, None, None]:
            sent.extend((yield from self.placements.run(members, where, None, self.residency.landed, times)))

        with torch.no_grad():  # grad mode is per thread: the worker's is on, and an update is no graph's business
            self._wiring.update_bucket(LandedBucket(gradients, lambda: self.placements.prepare(landed), updates()))
        return sent, times
