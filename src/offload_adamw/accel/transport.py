"""The transfer pipeline as the step's transport: the gradients a step updates, and its buckets.

Contract:

* The step's sequence is optim/step.py's, the same for the plain step and this one: check every gradient,
  clip, apply the non-finite policy, create missing state, then update bucket by bucket and settle. This
  class decides none of it: it says which gradients the step updates and where they are (:meth:`gradients`:
  the device gradient where it is still ``p.grad``, else the host buffer holding it; those updated during
  backward are the schedule's, :meth:`check_step`), the buffers' own checks (:meth:`check`), what clipping
  reads (:meth:`norm_inputs`: with updates during backward the norm the hooks took while it is the step's,
  accel/gate.py), each gradient complete (:meth:`complete`: the host waits for its copy), the ranks that
  must decide alike (:meth:`decision_groups`), and it hands the buckets out (:meth:`update`).
* Inside one ``step()`` a gradient is checked once: what :meth:`gradients` returned was checked before the
  first update, and later reads take it as it is.
* :meth:`update` is a generator of the buckets in the order this backward produced the gradients
  (accel/bucketing.py): it yields each group's work of a bucket (accel/work.py), which the step's driver does
  (optim/bucket.py) before it goes on; the host waits only for the bucket at hand (kept gradients: the next
  bucket's copies are issued before this one is handed out); each bucket's work is laid out by its group's
  placement (accel/placements.py); the parameters go back without the host waiting (the next forward waits on
  the device), and streamed state is back in host memory when the generator ends. It holds no optimizer and
  calls none.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from offload_adamw.accel import amp, bucketing
from offload_adamw.accel.freed import is_host_resident
from offload_adamw.accel.gate import clip_inputs
from offload_adamw.accel.overlap import UpdateRecord
from offload_adamw.accel.schedule import Early
from offload_adamw.accel.work import Work
from offload_adamw.distributed import local_tensor

if TYPE_CHECKING:
    from offload_adamw.accel.pipeline import GradientPipeline

__all__ = ["StepTransport"]

Place = tuple[int, int]


class StepTransport:
    """One ``step()`` of the transfer pipeline, driven by optim/step.py (see the module contract)."""

    def __init__(self, front: GradientPipeline) -> None:
        self._front = front
        self._early = Early()
        self._called = 0.0

    def begin(self, found_inf: Any, called_by_scaler: bool) -> None:
        """Wait for the updates that ran during backward; refuse what this step cannot serve."""
        front = self._front
        self._called = time.monotonic()
        self._early = front.schedule.before_step()
        if called_by_scaler:
            front.schedule.refuse_loss_scaling()
        front.refresh()
        front.ddp.check_unattached()
        if called_by_scaler and not isinstance(found_inf, Tensor) and front.offload_gradients:
            if any(front.residency.present(s) or s.param.grad is not None for s in front.slots):
                raise RuntimeError(
                    "torch.amp.GradScaler could not see any gradient: with offload_gradients=True they live in host "
                    "memory only. Use offload_adamw.OffloadGradScaler (a drop-in GradScaler) with this optimizer."
                )

    def _todo(self) -> list[Tensor]:
        """The parameters this step updates itself (not during backward), in optimizer order."""
        return [p for p in self._front.places() if p not in self._early.params]

    def gradients(self) -> list[tuple[Place, Tensor, Tensor]]:
        """(place, parameter, gradient as it is now) of each parameter the step updates: to be checked."""
        front = self._front
        out = []
        for p in self._todo():
            slot = front.slots[p]
            if p.grad is not None and not is_host_resident(p.grad):
                out.append((front.places()[p], p, p.grad))
            elif front.residency.present(slot) and p.grad is not None:
                assert slot.host_grad is not None  # present: host_grad holds it
                out.append((front.places()[p], p, slot.host_grad))
        return out

    def check(self, p: Tensor, grad: Tensor) -> None:
        """What the pipeline's buffers need of a gradient that is still ``p.grad`` (the optimizer checked the rest)."""
        if grad is p.grad:
            self._front.check_buffers(self._front.slots[p], grad)

    def check_step(self) -> None:
        """What the step may not meet after updates during backward (the schedule's; refused, torn)."""
        self._front.schedule.check_step(self._front.places(), self._early)

    def norm_inputs(self, max_norm: float | None, order: Callable[[], Sequence[Tensor]]
                    ) -> tuple[Tensor | None, Callable[[], list[Tensor]]] | None:
        """What the step's norm reads: (the norm the hooks took while it is the step's, else None; the gradients in
        ``order()``), or None when the step takes no norm (no clipping, and no updates during backward)."""
        front = self._front
        if front.gate.tracks():
            present = [p for p in front.places() if p.grad is not None
                       and (front.residency.present(front.slots[p]) or not is_host_resident(p.grad))]
            taken = front.gate.taken_norm(present, bool(self._early.params))
            ordered = front.gate.in_order(present)
            return taken, lambda: clip_inputs(ordered, self.ready)
        if max_norm is None:
            return None
        return None, lambda: front.gradient_tensors(order(), self.ready)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """The step's clipping reads (and changes) gradients that no update has consumed yet."""
        gate = self._front.gate
        gate.clipping_at_step = True
        try:
            yield
        finally:
            gate.clipping_at_step = False

    def ready(self, p: Tensor) -> Tensor | None:
        """``p``'s complete gradient (the host waits for its copy), checked already in this step."""
        return self._front.checked(self._front.slots[p])

    def complete(self) -> list[tuple[Place, Tensor, Tensor]]:
        """(place, parameter, complete gradient) of each parameter the step updates that has one."""
        places = self._front.places()
        return [(places[p], p, g) for p in self._todo() if (g := self.ready(p)) is not None]

    def decision_groups(self) -> list[Any]:
        """Process groups whose ranks must take the same non-finite decision (attached DDP models')."""
        return list(self._front.ddp.process_groups())

    def skipped(self) -> None:
        """The non-finite policy skipped the step: too late where updates ran during backward (refused, torn)."""
        if self._early.params:
            self._front.schedule.tear(
                "a gradient the hooks did not see is not finite, but with update_in_backward=True the updates of "
                "the others already ran during backward; set gradients only through backward", len(self._early.params))

    def prepare(self) -> list[tuple[Place, Tensor]]:
        """Device buffers for this step's updates, before any update; (place, parameter) of those with a gradient."""
        todo = self._todo()
        self._front.placements.prepare(todo)
        places = self._front.places()
        return [(places[p], p) for p in todo if p.grad is not None]

    def update(self, grad_scale: Tensor | None) -> Generator[Work, None, None]:
        """Every bucket's work, handed out; the parameters sent back, the streamed state settled (the module contract)."""
        front = self._front
        early, where = self._early, front.places()
        scale = amp.step_scale(grad_scale, any(front.slots[p].on_host for p in where if p not in early.params))
        # Parameters the device still reads in backward must not be overwritten: sends wait for compute.
        front.engine.send_after_compute({s.local.device for s in front.slots if front.engine.is_device(s.local.device)})
        # In the order this backward produced the gradients (stable: those it did not reach last, in optimizer order).
        ordered = sorted(where, key=lambda p: front.slots[p].arrival)
        buckets = bucketing.cut([(p, local_tensor(p).numel() * p.element_size(), front.slots[p].group) for p in ordered],
                                front.config.bucket_bytes)
        todo = [b for b in ([p for p in bucket if p not in early.params] for bucket in buckets) if b]
        sent = list(early.sent)
        records = list(early.records)
        if todo:
            front.residency.prefetch([front.slots[p] for p in todo[0]])
        try:
            for k, bucket in enumerate(todo):
                if k + 1 < len(todo):
                    front.residency.prefetch([front.slots[p] for p in todo[k + 1]])  # copies while this bucket updates
                record = UpdateRecord(bucket=len(records), ready=front.recorder.landed_at(bucket, self._called))
                record.start = time.monotonic()
                sent += yield from front.placements.run(bucket, where, scale, front.checked, record.extra)
                record.end = time.monotonic()
                records.append(record)
        finally:
            # Also when a bucket raised (or the driver closed this generator): what the buckets before it sent and
            # streamed must not land after the error reaches the caller, who may save a checkpoint in its handler.
            # The next forward waits for the parameters on the device; the host does not wait at all.
            for device, done in sent:
                front.engine.compute_waits(device, done)
            front.placements.settle()  # streamed state is back in host memory when step() returns or raises
        front.slots.pin_deferred()
        front.new_step()
        front.recorder.finish(records, self._called)
        if any(s.arrival != float("inf") for s in front.slots):
            front.schedule.prepare(buckets)
        self._early = Early()
