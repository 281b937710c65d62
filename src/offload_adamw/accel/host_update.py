"""The update of one bucket on the host: its gradients, handed out per group for the host update, the parameters back.

Contract:

* :meth:`HostUpdate.run` takes a bucket's parameters and, for each, its complete host gradient (the caller
  has waited for its copy), multiplies it by the step's clip coefficient where one was taken after backward
  (what ``clip_grads_with_norm_`` does to it, on the host where it is), and yields one
  :class:`~offload_adamw.accel.work.HostGroup` per parameter group with (parameter, host gradient, staging buffer),
  which its driver updates (optim/bucket.py) before it resumes and sends that group's parameters back.
* A device parameter's staging buffer receives round(master) and is sent back with one copy per device
  and bucket; before a staging buffer is written again the host waits for the copy that still reads it.
* A device parameter edited since its last send-back (its version counter or data pointer moved:
  ``model.load_state_dict``, an in-place op under ``no_grad``, ``p.data = ...``) is read back into its staging
  buffer first, and the update starts from it (docs/contract.md#edits-between-steps). In-place writes through
  ``p.data``, which move no version counter (autograd cannot see them either), are not seen on a device.
  A host parameter (none on the stand-in device) is written by the host update itself.
* It returns the completions of the copies it sent; the compute stream waits for them before the next
  forward, the host does not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence

import torch
from torch import Tensor

from offload_adamw.accel.slots import Slot, SlotTable
from offload_adamw.accel.timeline import Recorder
from offload_adamw.accel.transfer import Completion, TransferEngine
from offload_adamw.accel.work import HostGroup

__all__ = ["HostUpdate"]


class HostUpdate:
    """The host placement of a bucket's update (see the module contract)."""

    def __init__(self, slots: SlotTable, engine: TransferEngine, recorder: Recorder,
                 coefficient: Callable[[], Tensor | None]) -> None:
        self._slots = slots
        self._engine = engine
        self._recorder = recorder
        self._coefficient = coefficient

    def reserve(self, slots: Sequence[Slot]) -> None:
        return None  # its buffers are the slots' host buffers, laid out at refresh()

    def settle(self) -> None:
        return None  # the host waits for nothing of a host update at the end of a step: sends go unwaited

    def close(self) -> None:
        return None

    def buffer_bytes(self) -> int:
        return 0  # no device buffers

    def run(self, params: list[Tensor], where: dict[Tensor, tuple[int, int]], scale: Tensor | None,
            gradient: Callable[[Slot], Tensor | None], times: dict[str, float] | None = None,
            ) -> Generator[HostGroup, None, list[tuple[torch.device, Completion]]]:
        coef = self._coefficient()
        by_group: dict[int, list[tuple[Slot, Tensor]]] = {}
        for p in params:
            slot = self._slots[p]
            grad = gradient(slot)
            if grad is not None:
                if coef is not None:
                    grad.mul_(coef)
                by_group.setdefault(where[p][0], []).append((slot, grad))
        if times is not None:
            times["d2h_done"] = self._recorder.copies_done(params)
        sent: list[tuple[torch.device, Completion]] = []
        for gi, members in by_group.items():
            updates: list[tuple[Tensor, Tensor, Tensor | None]] = []
            current: list[bool] = []
            to_device: list[Slot] = []
            for slot, grad in members:
                if not self._engine.is_device(slot.local.device):
                    updates.append((slot.param, grad, None))  # the host update writes host parameters itself
                    current.append(False)
                else:
                    slot.sending.wait()  # the previous copy out of staging has ended
                    current.append(self._read_back_if_edited(slot))
                    updates.append((slot.param, grad, slot.staging))
                    to_device.append(slot)
            yield HostGroup(gi, updates, current, scale)  # updated by the driver before this resumes
            sent += self._send_back(to_device)
        if times is not None:
            times["h2d_issued"] = time.monotonic()
        return sent

    def _read_back_if_edited(self, slot: Slot) -> bool:
        """Whether ``slot``'s staging buffer now holds its device parameter's current value (read back after an edit)."""
        local = slot.local
        if slot.sent_version is None or (local._version == slot.sent_version and local.data_ptr() == slot.sent_ptr):
            return False
        assert slot.staging is not None  # laid out for every device parameter
        self._engine.copy_to_host(local.detach(), slot.staging).wait()
        return True

    def _send_back(self, slots: list[Slot]) -> list[tuple[torch.device, Completion]]:
        """Updated parameters host -> device, non-blocking; one completion per device for the bucket."""
        by_device: dict[torch.device, list[Slot]] = {}
        for s in slots:
            by_device.setdefault(s.local.device, []).append(s)
        sent = []
        for device, members in by_device.items():
            pairs = []
            for s in members:
                assert s.staging is not None  # laid out for every device parameter
                pairs.append((s.local, s.staging))
            done = self._engine.send_to_device(device, pairs)
            for s in members:
                s.sending = done
                s.sent_version, s.sent_ptr = s.local._version, s.local.data_ptr()  # the lanes count the copy at issue
            sent.append((device, done))
        return sent

