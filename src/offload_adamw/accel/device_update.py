"""The resident placement: state on the device, updated there by torch's fused kernel, nothing transferred.

Contract:

* :class:`DeviceUpdate` updates the parameters of ``update_on="device"`` groups. Their master, ``exp_avg`` and
  ``exp_avg_sq`` (and ``max_exp_avg_sq``) live on the parameter's device (optim/placement.py), the gradient is read
  there, and the parameter receives round(master) in place: no copy between host and device.
* Tensors whose gradient already has the master's dtype and that no loss scale divides are updated by one call of
  the fused kernel over the whole list (what torch.optim.AdamW(fused=True) runs). The others (a bf16 model over
  float32 masters, or GradScaler's scale, which the fused op divides in place) go through one device buffer that
  receives their widened gradient chunk by chunk (at most ``chunk_bytes`` of the state's dtype, allocated before any
  update of a step by :meth:`reserve`, after the optimizer's device-memory check), never a full-size copy. The
  updater thread (updates during backward) and the main thread (step()) use it on their own streams: each use waits
  for an event recorded after the previous one.
* The step count is advanced once per tensor, every chunk of a tensor reads the same count: the result is bitwise
  torch's fused AdamW on float32 masters on that device (kernels/fused_device.py).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch
from torch import Tensor

from offload_adamw.accel.placements import TensorWork, gather, sender
from offload_adamw.accel.slots import Slot, SlotTable
from offload_adamw.accel.transfer import Completion, TransferEngine
from offload_adamw.accel.work import Work
from offload_adamw.kernels.adamw import StepHyper
from offload_adamw.kernels.fused_device import CHUNK_ALIGN, advance_steps, chunk_plan, fused_adamw_

__all__ = ["DeviceUpdate"]

Sent = list[tuple[torch.device, Completion]]


class DeviceUpdate:
    """The resident placement of a bucket's ``update_on="device"`` groups (see the module contract)."""

    def __init__(self, slots: SlotTable, engine: TransferEngine, check_memory: Callable[[int, torch.device, str], None],
                 coefficient: Callable[[torch.device], Tensor | None], *, chunk_bytes: int,
                 used: Callable[[Slot, Tensor], None]) -> None:
        self._check_memory = check_memory  # the optimizer's device-memory check, before device buffers are allocated
        self._used = used  # the residency learns the update read the gradient (accel/device_grads.py)
        self._slots = slots
        self._engine = engine
        self._coefficient = coefficient
        self._chunk_bytes = chunk_bytes // CHUNK_ALIGN * CHUNK_ALIGN
        self._buffers: dict[torch.device, Tensor] = {}
        # A widening buffer is used by the updater thread's stream (updates during backward) and by the main thread's
        # (step()): each use is ordered after the other's by waits stated elsewhere, once: the main stream waits at
        # backward's end for every early update's kernels (DuringBackward._settle, before their parameters'
        # fingerprints), and an early update's stream waits for the stream that produced its gradient, which is the
        # main stream after its step() (DeviceGradients.landed). tests/test_simulated_hazards.py holds it (N8).

    def reserve(self, slots: Sequence[Slot]) -> None:
        """A gradient buffer on each device these slots' updates run on, checked against the device's memory first."""
        for device in {s.local.device for s in slots} - set(self._buffers):
            self._check_memory(self._chunk_bytes, device, "gradient widening")
            self._buffers[device] = torch.empty(self._chunk_bytes, dtype=torch.uint8, device=device)

    def buffer_bytes(self) -> int:
        """Device bytes of the widening buffers, as allocated (the resident state is the optimizer's to count)."""
        return sum(b.numel() for b in self._buffers.values())

    def run(self, params: list[Tensor], where: dict[Tensor, tuple[int, int]], scale: Tensor | None,
            gradient: Callable[[Slot], Tensor | None], times: dict[str, float] | None = None,
            ) -> Generator[Work, None, Sent]:
        sent: Sent = []
        groups = yield from gather(self._slots, params, where, gradient, self._coefficient, self._used)
        for _, hp, by_device in groups:
            for device, work in by_device.items():
                send = sender(self._engine, device)
                counts = advance_steps([w.state.step for w in work], device, send)
                device_scale = None if scale is None else scale.to(device) if send is None else send(scale)
                whole = [i for i, w in enumerate(work) if device_scale is None and w.grad.dtype == w.state.master.dtype]
                if whole:
                    _fused([work[i] for i in whole], [counts[i] for i in whole], hp, None)
                rest = [i for i in range(len(work)) if i not in set(whole)]
                for dtype in {work[i].state.master.dtype for i in rest}:
                    members = [i for i in rest if work[i].state.master.dtype == dtype]
                    self._widened([work[i] for i in members], [counts[i] for i in members], hp, device_scale, dtype,
                                  device)
                for w in work:
                    w.write_back()
                sent.append((device, self._engine.mark(device)))
        return sent

    def _widened(self, work: list[TensorWork], counts: list[Tensor], hp: StepHyper, scale: Tensor | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        buffer = self._buffers[device].view(dtype)
        cap = buffer.numel() // CHUNK_ALIGN * CHUNK_ALIGN
        for pieces in chunk_plan([w.numel for w in work], cap):
            sliced = [[f[p.start:p.end] for f in work[p.index].state_flats] for p in pieces]
            items = [work[p.index] for p in pieces]
            fused_adamw_(
                [s[0] for s in sliced], [w.grad[p.start:p.end] for w, p in zip(items, pieces)], [s[1] for s in sliced],
                [s[2] for s in sliced], [s[3] for s in sliced] if hp.amsgrad else [], [counts[p.index] for p in pieces],
                hp, model_copies=[None if w.model is None else w.model[p.start:p.end] for w, p in zip(items, pieces)],
                take_edits=[w.take_edits for w in items], grad_scale=scale,
                widened=[buffer[p.offset:p.offset + p.end - p.start] for p in pieces],
            )

    def settle(self) -> None:
        return None  # nothing is copied: the next forward waits on the device for the parameters written

    def close(self) -> None:
        self._buffers.clear()


def _fused(work: list[TensorWork], counts: list[Tensor], hp: StepHyper, scale: Tensor | None) -> None:
    """One fused call over whole tensors (torch.optim.AdamW(fused=True)'s own call)."""
    fused_adamw_(
        [w.state_flats[0] for w in work], [w.grad for w in work], [w.state_flats[1] for w in work],
        [w.state_flats[2] for w in work], [w.state_flats[3] for w in work] if hp.amsgrad else [], counts, hp,
        model_copies=[w.model for w in work], take_edits=[w.take_edits for w in work], grad_scale=scale,
    )
