"""The streamed placement: state in host memory, updated on the device chunk by chunk through a ring of buffers.

Contract:

* :class:`StreamUpdate` updates the parameters of ``update_on="stream"`` groups. Their float32 master, ``exp_avg``
  and ``exp_avg_sq`` (and ``max_exp_avg_sq``) stay in host memory (page-locked for a CUDA device); the gradient
  never leaves the device. For each group and device the tensors are packed in order into chunks
  (kernels/fused_device.py's ``chunk_plan``: a tensor split only at multiples of CHUNK_ALIGN elements) that fill
  one ring buffer each: its state arrays and one gradient buffer of the state's dtype.
* A ring of ``buffers`` (2 or 3) device buffers of ``chunk_bytes`` each per device, allocated before any update of
  a step (:meth:`reserve`, after the optimizer's device-memory check). Chunk k's state goes host to device
  (ordered after the copy out of the buffer's previous chunk), the compute stream waits for it, the fused kernel
  updates it there (the device parameter receives round(master) in place), and it goes back device to host,
  ordered after that update. So while chunk k is updated, chunk k+1's copy in and chunk k-1's copy out run; with
  three buffers chunk k+2's copy in can start before chunk k-1's copy out has ended.
* The step count is advanced once per tensor (kernels/fused_device.py's ``advance_steps``), every chunk of a tensor
  reads the same count, and GradScaler's scale divides inside the fused op: the result is bitwise torch's
  fused AdamW on float32 masters on that device.
* The host never waits inside a step on CUDA; :meth:`settle` (the end of ``step()``) waits for every copy back,
  so that the host state is whole when ``step()`` returns. The next forward waits on the device for the
  parameters written (the completion returned for each group and device).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch
from torch import Tensor

from offload_adamw.accel.placements import TensorWork, gather, sender
from offload_adamw.accel.slots import Slot, SlotTable
from offload_adamw.accel.transfer import DONE, Completion, TransferEngine
from offload_adamw.accel.work import Work
from offload_adamw.kernels.adamw import StepHyper
from offload_adamw.kernels.fused_device import CHUNK_ALIGN, Piece, advance_steps, chunk_plan, fused_adamw_

__all__ = ["StreamUpdate", "capacity"]

Sent = list[tuple[torch.device, Completion]]


def capacity(chunk_bytes: int, dtype: torch.dtype, amsgrad: bool) -> int:
    """Elements of one chunk: each ring buffer holds the state arrays and a gradient buffer of ``dtype``."""
    per_element = torch.empty((), dtype=dtype).element_size() * ((4 if amsgrad else 3) + 1)
    return chunk_bytes // per_element // CHUNK_ALIGN * CHUNK_ALIGN


class _Ring:
    """The ring buffers of one device and, per buffer, the copy out that still reads it."""

    def __init__(self, device: torch.device, chunk_bytes: int, buffers: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.raw = torch.empty(buffers * chunk_bytes, dtype=torch.uint8, device=device)
        self.free: list[Completion] = [DONE] * buffers
        self.turn = 0

    def regions(self, k: int, dtype: torch.dtype, arrays: int, cap: int) -> list[Tensor]:
        """Buffer ``k`` as ``arrays`` + 1 regions of ``cap`` elements of ``dtype`` (the last: the gradient's)."""
        start = k * self.chunk_bytes
        whole = self.raw[start:start + self.chunk_bytes].view(dtype)
        return [whole[a * cap:(a + 1) * cap] for a in range(arrays + 1)]


class StreamUpdate:
    """The streamed placement of a bucket's ``update_on="stream"`` groups (see the module contract)."""

    def __init__(self, slots: SlotTable, engine: TransferEngine, check_memory: Callable[[int, torch.device, str], None],
                 coefficient: Callable[[torch.device], Tensor | None], *, chunk_bytes: int, buffers: int,
                 used: Callable[[Slot, Tensor], None]) -> None:
        self._check_memory = check_memory  # the optimizer's device-memory check, before device buffers are allocated
        self._used = used  # the residency learns the update read the gradient (accel/device_grads.py)
        self._slots = slots
        self._engine = engine
        self._coefficient = coefficient
        self._chunk_bytes = chunk_bytes
        self._buffers = buffers
        self._rings: dict[torch.device, _Ring] = {}
        self._pending: list[Completion] = []

    def reserve(self, slots: Sequence[Slot]) -> None:
        """A ring on each device these slots' updates run on, checked against the device's memory first."""
        for device in {s.local.device for s in slots} - set(self._rings):
            nbytes = self._buffers * self._chunk_bytes
            self._check_memory(nbytes, device, "stream ring")
            self._rings[device] = _Ring(device, self._chunk_bytes, self._buffers)

    def buffer_bytes(self) -> int:
        """Device bytes of the rings, as allocated."""
        return sum(r.raw.numel() for r in self._rings.values())

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
                by_dtype: dict[torch.dtype, list[int]] = {}
                for i, w in enumerate(work):
                    by_dtype.setdefault(w.state.master.dtype, []).append(i)
                for dtype, members in by_dtype.items():
                    self._stream(device, hp, [work[i] for i in members], [counts[i] for i in members], dtype,
                                 device_scale)
                if any(w.host_temporaries for w in work):
                    self.settle()  # a host temporary of the state receives its copy back before it is written back
                for w in work:
                    w.write_back()
                sent.append((device, self._engine.mark(device)))
        return sent

    def _stream(self, device: torch.device, hp: StepHyper, work: list[TensorWork], counts: list[Tensor],
                dtype: torch.dtype, scale: Tensor | None) -> None:
        ring = self._rings[device]
        arrays = 4 if hp.amsgrad else 3
        cap = capacity(self._chunk_bytes, dtype, hp.amsgrad)
        plan = chunk_plan([w.numel for w in work], cap)
        n = self._buffers

        def buffer(c: int) -> int:
            return (ring.turn + c) % n

        def pairs(c: int) -> list[tuple[Tensor, Tensor]]:
            """(device view, host view) of every state array of chunk ``c``'s pieces."""
            regions = ring.regions(buffer(c), dtype, arrays, cap)
            out = []
            for piece in plan[c]:
                for region, flat in zip(regions, work[piece.index].state_flats):
                    out.append((_at(region, piece), flat[piece.start:piece.end]))
            return out

        inbound: dict[int, Completion] = {}

        def send(c: int) -> None:
            inbound[c] = self._engine.send_to_device(device, pairs(c), after=ring.free[buffer(c)])

        for c in range(min(n, len(plan))):
            send(c)
        for c, pieces in enumerate(plan):
            k = buffer(c)
            self._engine.compute_waits(device, inbound.pop(c))  # the chunk's state is on the device
            regions = ring.regions(k, dtype, arrays, cap)
            self._update(pieces, regions, work, counts, hp, scale, arrays)
            ring.free[k] = self._engine.copy_all_to_host(device, [(d, h) for d, h in pairs(c)])
            self._pending.append(ring.free[k])
            if c + n < len(plan):
                send(c + n)
        ring.turn = buffer(len(plan))

    @staticmethod
    def _update(pieces: list[Piece], regions: list[Tensor], work: list[TensorWork], counts: list[Tensor],
                hp: StepHyper, scale: Tensor | None, arrays: int) -> None:
        views = [[_at(r, p) for r in regions] for p in pieces]
        items = [work[p.index] for p in pieces]
        fused_adamw_(
            [v[0] for v in views], [w.grad[p.start:p.end] for w, p in zip(items, pieces)], [v[1] for v in views],
            [v[2] for v in views], [v[3] for v in views] if arrays == 4 else [], [counts[p.index] for p in pieces], hp,
            model_copies=[None if w.model is None else w.model[p.start:p.end] for w, p in zip(items, pieces)],
            take_edits=[w.take_edits for w in items], grad_scale=scale, widened=[v[arrays] for v in views],
        )

    def settle(self) -> None:
        """The host waits for every copy of streamed state back into host memory."""
        pending, self._pending = self._pending, []
        for done in pending:
            done.wait()

    def close(self) -> None:
        self.settle()
        self._rings.clear()


def _at(region: Tensor, piece: Piece) -> Tensor:
    return region[piece.offset:piece.offset + piece.end - piece.start]
