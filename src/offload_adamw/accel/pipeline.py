"""The transfer pipeline between a parameter's device and the host for OffloadAdamW.

Contract:

* **Gradients leave the device as backward produces them.** A post-accumulate-grad
  hook on every trainable parameter copies its gradient into a host buffer; on
  CUDA the copy runs on a side stream (ordered after the producing stream by a
  stream wait, never by a host synchronisation) and completes an event that the
  host waits on only when it needs *that* gradient.
* **Two modes.** ``offload_gradients=False`` keeps ``p.grad`` on the device as
  the truth; the host copy is a cache that is re-fetched when the device
  gradient changed after the copy (its version counter moved: clipping,
  unscaling, a user's in-place edit), and always for DTensor gradients, whose
  in-place edits move no counter. ``offload_gradients=True`` frees the device
  gradient right after its copy is issued (``record_stream`` keeps the memory
  from being reused before the copy ends): the host buffer is then the
  gradient, and ``p.grad`` its storage-less stand-in (accel/freed.py), through
  which torch's clipping, GradScaler and ``model.zero_grad()`` reach the host
  buffer (for a DTensor parameter, FSDP2's, a DTensor over that stand-in, so
  DTensor ops keep their cross-rank meaning). Gradient accumulation over micro-batches works in both modes; with
  freed device gradients it happens in host memory, in the gradient's dtype,
  which is bitwise what autograd's accumulation on the device computes
  (``old + new`` rounded once to the gradient dtype), on a worker thread: the
  hook only issues copies, the waits and adds run off the thread of backward.
* **DDP.** Parameters of a DDP model attached with ``attach_ddp`` are left alone
  by the hooks; DDP's communication hook brings their reduced gradients
  (accel/ddp.py). An unattached DDP model over these parameters is refused with
  freed gradients and makes the step fetch every kept gradient. With
  ``update_in_backward`` each DDP bucket is one bucket of the step, and its
  parameters land as soon as its reduced gradients have been copied to the host
  (on the thread that completes the all-reduce: gloo's, or backward's with
  NCCL); the early update reads those host buffers, never ``p.grad``, which DDP
  sets only in its final callback. With ``max_grad_norm`` each reduced
  gradient's norm is taken there, on its device; the coefficient follows DDP's
  final callback. Micro-batches accumulate on the device inside
  ``ddp_model.no_sync()``, with or without ``opt.no_sync()`` for DDP's
  parameters (only the last backward reduces and copies); ``opt.no_sync()``
  alone, where DDP reduces every micro-batch, is refused at the second. A model with
  ``find_unused_parameters=True`` updates at the step: DDP decides only in its
  final callback which gradients stay unset.
* **Buffers follow the parameters.** At construction and at each step (and in
  the hook when a parameter changed since), a parameter cast or moved gets
  buffers laid out for its dtype and device; meta parameters get none. Every
  allocation passes the optimizer's host-memory check first. Buffers first
  needed inside backward are page-locked after it, at the end of the step.
* **Pinned memory in a few exactly-sized buffers.** Host gradient buffers (and
  the host staging copies of device parameters) are carved out of one flat
  allocation per dtype and purpose. On CUDA each allocation is page-locked with
  ``cudaHostRegister`` on an exactly-sized pageable buffer, because torch's
  pinned allocator rounds every allocation up to a power of two. The pinned
  bytes are reported by :meth:`GradientPipeline.pinned_bytes`.
* **The step runs bucket by bucket.** Gradients are taken in the order they
  arrived in backward, in buckets of about ``bucket_bytes``: the host waits only
  for the copies of the bucket at hand, updates it with the kernel of
  :mod:`offload_adamw.kernels.adamw`, and sends the updated parameters back with
  non-blocking copies on a second side stream; the compute stream waits on the
  buckets' events, so the next forward waits on the device, not the host.
* **Updates during backward** (``update_in_backward``, freed gradients only). The
  buckets of a step are those of the previous backward's order (an FSDP2 group, the
  views of one reduce-scatter output, or a DDP bucket is one bucket); a bucket whose
  gradients have all landed is updated by the worker of accel/overlap.py while
  backward goes on, reading the host buffers it landed with, never ``p.grad``. With
  ``max_grad_norm`` or a non-finite policy the updater is gated: each hook takes its
  gradient's norm and count of inf/NaN on the device, an autograd callback at the
  end of backward (after FSDP2's and DDP's own) reduces them as torch does and opens
  the gate, or leaves it shut for step() to clip, skip or raise before any update.
  What the protocol cannot make exact after updates ran (a second backward, cleared
  or hand-set gradients, changed hyperparameters) is refused by name.
* **CPU as device.** With CPU parameters the same pipeline runs without streams
  or events (copies are synchronous): this is how the tests exercise ordering,
  accumulation, clipping, scaling and parity on a machine without an accelerator.
* **Nothing of this is optimizer state.** ``state_dict`` looks the same with or
  without the pipeline, in either mode.
* **GradScaler.** A pipelined optimizer sets ``_step_supports_amp_scaling``:
  ``step`` honours ``grad_scale`` (gradients divided by it in float32, as torch's
  fused AdamW does) and ``found_inf`` (the step is skipped, nothing changes).
  Freed device gradients are invisible to ``torch.amp.GradScaler``; use
  :class:`OffloadGradScaler`, which unscales and checks the host gradients. A
  plain GradScaler with freed gradients raises a clear error instead of silently
  skipping the unscale.
"""

from __future__ import annotations

import functools
import math
import operator
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from offload_adamw.accel import clipping as _clipping
from offload_adamw.accel import ddp as _ddp
from offload_adamw.accel.freed import HostResidentGradient, is_host_resident
from offload_adamw.accel.host_memory import HostArena
from offload_adamw.accel.overlap import BackwardUpdater, UpdateRecord
from offload_adamw.accel.timeline import BucketTimes, StepTimeline

__all__ = ["PipelineConfig", "GradientPipeline", "UpdateTarget"]


class UpdateTarget(Protocol):
    """What the pipeline needs of its optimizer (OffloadAdamW implements it; optim/update.py does the work).

    Parameters are named by ``(group_index, index)`` in ``param_groups``. The pipeline checks every
    gradient with ``check_gradient`` before the first update of a step, asks ``skip_for_nonfinite``
    (only when ``nonfinite`` is not ``"propagate"``, since it needs every gradient complete), runs
    ``preflight`` for parameters that have no state yet (and ``check_host_buffers`` before it allocates
    host buffers of its own), then calls ``update_group`` once per group
    and bucket with (parameter, host gradient, staging buffer): a device parameter's staging buffer
    receives round(master), which the pipeline sends back; for a host parameter it is None and the
    optimizer writes the parameter itself.
    """

    param_groups: list[dict[str, Any]]
    state: Any
    nonfinite: str
    max_grad_norm: float | None
    last_grad_norm: Tensor | None

    def describe_param(self, group_index: int, index: int) -> str: ...

    def check_gradient(self, group_index: int, index: int, grad: Tensor) -> None: ...

    def skip_for_nonfinite(self, gradients: list[tuple[int, int, Tensor]], groups: Sequence[Any] = ()) -> bool: ...

    def preflight(self, fresh: list[tuple[int, int]]) -> None: ...

    def check_host_buffers(self, nbytes: int, label: str) -> None: ...

    def update_group(
        self, group_index: int, updates: list[tuple[Tensor, Tensor, Tensor | None]], grad_scale: Tensor | None = None
    ) -> None: ...


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

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.update_in_backward and not self.offload_gradients:
            raise ValueError(
                "update_in_backward=True needs offload_gradients=True: a gradient kept on the device could still "
                "be changed (clipped, unscaled) after its early update"
            )


# --------------------------------------------------------------------------- per-parameter slots


def _local(t: Tensor) -> Tensor:
    """This rank's tensor of a DTensor (an FSDP2 shard, or its gradient), else ``t``."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


class _Slot:
    """Everything the pipeline keeps for one parameter (none of it is optimizer state)."""

    __slots__ = (
        "param", "host_grad", "incoming", "staging", "has_grad", "pending_add",
        "d2h_event", "h2d_event", "source", "source_version", "arrival", "hook", "prehook", "ddp", "ddp_written",
        "add_done", "layout", "group",
    )

    def __init__(self, param: Tensor) -> None:
        self.param = param
        self.host_grad: Tensor | None = None  # the host gradient buffer (a view into an arena)
        self.incoming: Tensor | None = None  # second buffer for accumulation with freed device grads
        self.staging: Tensor | None = None  # param-dtype host copy sent back to a device parameter
        self.has_grad = False  # freed mode: host_grad holds this parameter's gradient
        self.pending_add = False  # freed mode: an add of incoming into host_grad is queued on the accumulator
        self.add_done: threading.Event | None = None  # set by the accumulator when that add has run
        self.layout: dict[str, tuple[torch.device, torch.dtype]] = {}  # buffer field -> (device, dtype) it was laid out for
        self.d2h_event: Any = None
        self.h2d_event: Any = None
        self.source: weakref.ref[Tensor] | None = None  # kept mode: the device gradient that host_grad copies
        self.source_version = -1
        self.arrival = math.inf  # order in the latest backward, for bucketing
        self.hook: Any = None
        self.prehook: Any = None  # freed mode: runs before autograd accumulates into p.grad
        self.ddp = False  # reduced by an attached DDP model: its communication hook brings the gradient
        self.ddp_written = False  # the communication hook wrote host_grad in the current backward
        self.group: int | None = None  # the FSDP2 group of its latest gradient (freed mode): one bucket per group

    @property
    def on_device(self) -> bool:
        return self.param.device.type != "cpu"

    @property
    def local(self) -> Tensor:
        """The tensor the buffers are laid out for: this rank's shard of a DTensor parameter, else the parameter."""
        return _local(self.param)


def _hook_for(pipeline: GradientPipeline):
    ref = weakref.ref(pipeline)

    @torch._dynamo.disable
    def hook(param: Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner._on_gradient(param)

    return hook


def _prehook_for(pipeline: GradientPipeline, param: Tensor):
    ref = weakref.ref(pipeline)
    param_ref = weakref.ref(param)

    @torch._dynamo.disable
    def prehook(grad: Tensor) -> None:
        owner, p = ref(), param_ref()
        if owner is not None and p is not None:
            owner._before_accumulate(p)

    return prehook


class _Accumulator:
    """Adds accumulation copies into their host gradients on a worker thread, never on autograd's.

    With freed device gradients a parameter's second, third, ... micro-batch gradient is copied into
    its ``incoming`` buffer; the wait for that copy and the host ``add_`` run here, so backward's hook
    only issues copies. A hook that needs ``incoming`` again waits for the previous add, which has
    normally ended a whole forward and backward earlier.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, event: Any, dst: Tensor, src: Tensor) -> threading.Event:
        done = threading.Event()
        if self._thread is None:
            self._thread = threading.Thread(
                target=_accumulate_forever, args=(self._jobs, self), name="offload-adamw-accumulate", daemon=True
            )
            self._thread.start()
        self._jobs.put((event, dst, src, done))
        return done

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)


def _accumulate_forever(jobs: queue.SimpleQueue[Any], owner: _Accumulator) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        event, dst, src, done = job
        try:
            if event is not None:
                event.synchronize()
            with torch.no_grad():
                dst.add_(src)  # old + new, rounded once to the gradient's dtype: what autograd's accumulation computes
        except BaseException as error:  # noqa: BLE001 - re-raised by the step that needs this gradient
            owner.error = error
        finally:
            done.set()


class GradientPipeline:
    """Hooks, host buffers, streams and the bucketed step of one OffloadAdamW."""

    def __init__(self, optimizer: UpdateTarget, config: PipelineConfig) -> None:
        self.optimizer = optimizer
        self.config = config
        self.offload_gradients = config.offload_gradients
        self._slots: dict[Tensor, _Slot] = {}
        self._unhooked: list[_Slot] = []
        self._arenas: list[HostArena] = []
        self._streams: dict[tuple[torch.device, str], Any] = {}
        self._arrival = 0
        # Early updates (update_in_backward): the buckets of the next step, fixed before its backward.
        self._updater: BackwardUpdater | None = None
        self._early_buckets: list[list[Tensor]] = []
        self._early_events: list = []
        self._early_hyper: dict[int, tuple] = {}
        self._unreached: set[Tensor] = set()  # trainable, without state at the last step: no backward reached them yet
        self._syncing = True  # False inside no_sync(): micro-batches that only accumulate
        self._landed_at: dict[Tensor, float] = {}
        self._copied_at: dict[Tensor, float] = {}  # when a synchronous copy to the host ended, for the timeline
        self._timeline: StepTimeline | None = None
        # With parameters on several devices, autograd runs the hooks on one thread per device; the GIL
        # is released inside cudaHostRegister and event waits, so two hooks could otherwise interleave
        # (two accumulation arenas, one overwriting the other's buffer after a copy into it was issued).
        self._hook_lock = threading.RLock()
        self._ddp_models: list[weakref.ref] = []
        self._ddp_callback_queued = False
        self._wrappers_checked = False
        self._refetch_at_step = False  # kept gradients under an unattached DDP model: fetch every gradient at the step
        self._accumulator = _Accumulator()
        self._group_storage: Any = None  # the storage of the latest FSDP2 group's reduced gradients (see _fsdp_group_of)
        self._group_id = 0
        # Clipping with updates during backward: each gradient's norm, taken on its device in the hook, and the
        # coefficient every gradient of the step is multiplied by, known when backward has ended.
        self._norms: dict[Tensor, tuple[Tensor, torch.device, torch.dtype]] = {}
        self._norms_callback_queued = False
        self._norm_events: list[tuple[torch.device, Any]] = []
        self._norms_partial = False  # a reduced DDP bucket (find_unused_parameters) took no norms: the step clips
        # A non-finite policy with updates during backward: each gradient's count of inf and NaN, taken in the hook;
        # and whether the end of backward let the updates start.
        self._nonfinite: dict[Tensor, Tensor] = {}
        self._gate_taken = False
        self._checked_policy = "propagate"  # the non-finite policy the end of backward checked before the gate opened
        self._clip_coef: Tensor | None = None
        self._norms_stale = False  # a gradient changed after its norm was taken: the coefficient must be taken anew
        self._clip_max_norm: float | None = None  # the max_grad_norm and the parameters the coefficient was taken for
        self._clip_params: frozenset[Tensor] = frozenset()
        self._clipping_at_step = False  # the step's own clipping reads the stand-ins (no update has run yet)
        weakref.finalize(self, self._accumulator.stop)
        if config.update_in_backward:
            _watch_forwards(self)
        self.refresh()

    # ----------------------------------------------------------------- set-up

    def refresh(self) -> None:
        """Slots for new parameters; buffers for what has none or was laid out for another device or dtype; hooks.

        Runs at construction and at every step, outside backward. A parameter on the meta device gets
        no buffer until it is materialised; one moved to another device or cast to another dtype after
        construction (``model.cuda()``, ``model.half()``) gets buffers laid out anew, pinned where it now
        needs them. A buffer that holds a gradient not consumed yet is left as it is.
        """
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if p not in self._slots:
                    self._slots[p] = _Slot(p)
        self._relayout(defer_pin=False)
        self._unhooked = [s for s in self._slots.values() if s.hook is None]
        self._hook_trainable()

    def _relayout(self, *, defer_pin: bool) -> None:
        slots = list(self._slots.values())
        idle = [s for s in slots if not s.has_grad and not s.pending_add]
        grads = [s for s in idle if s.param.requires_grad and self._stale(s, "host_grad")]
        for s in grads:
            s.incoming = None  # laid out again with the next accumulation
        self._allocate("host_grad", grads, "gradients", defer_pin=defer_pin)
        staging = [s for s in slots if s.on_device and self._stale(s, "staging")]
        self._allocate("staging", staging, "parameter staging", defer_pin=defer_pin)

    @staticmethod
    def _stale(slot: _Slot, field: str) -> bool:
        """``field`` of ``slot`` must be laid out (again): missing, or made for another device or dtype (same shape)."""
        p = slot.local
        if p.device.type == "meta":
            return False  # holds no data; buffers come when it is materialised
        buffer = getattr(slot, field)
        if buffer is None:
            return True
        return buffer.shape == p.shape and slot.layout.get(field) != (p.device, p.dtype)

    def _hook_trainable(self) -> None:
        """Hooks for parameters that require a gradient now (a frozen tensor cannot take a hook)."""
        still = []
        for slot in self._unhooked:
            if slot.param.requires_grad:
                _take_over(slot.param, self)
                slot.hook = slot.param.register_post_accumulate_grad_hook(_hook_for(self))
                if self.offload_gradients:
                    slot.prehook = slot.param.register_hook(_prehook_for(self, slot.param))
            else:
                still.append(slot)
        self._unhooked = still

    def _allocate(self, field: str, slots: list[_Slot], label: str, *, defer_pin: bool = False) -> None:
        if not slots:
            return
        nbytes = sum(s.local.numel() * s.local.element_size() for s in slots)
        check = getattr(self.optimizer, "check_host_buffers", None)
        if check is not None:
            check(nbytes, label)  # the host-memory pre-flight, before anything is allocated
        pin = any(s.param.device.type == "cuda" for s in slots)
        arena = HostArena(
            ((id(s), s.local.shape, s.local.dtype) for s in slots),
            pin=pin, label=label, streams=self._streams, defer_pin=defer_pin,
        )
        arena.field = field  # type: ignore[attr-defined]
        for s in slots:
            setattr(s, field, arena.views[id(s)])
            s.layout[field] = (s.local.device, s.local.dtype)
        # Arenas none of whose views is in use any more (every slot laid out anew) are released.
        in_use = {id(getattr(s, getattr(a, "field", field))) for s in self._slots.values() for a in self._arenas}
        self._arenas = [a for a in self._arenas if any(id(v) in in_use for v in a.views.values())]
        self._arenas.append(arena)

    def _pin_deferred(self) -> None:
        """Page-lock buffers allocated inside backward (accumulation), now that no copy is in flight into them."""
        pending = [a for a in self._arenas if a.pin_pending]
        if not pending:
            return
        for slot in self._slots.values():
            self._finish(slot)
        for arena in pending:
            arena.pin_now()

    def close(self) -> None:
        """Remove the hooks (the optimizer no longer sees gradients as they arrive)."""
        _WATCHED.discard(self)
        for slot in self._slots.values():
            if slot.hook is not None:
                slot.hook.remove()
                slot.hook = None
            if slot.prehook is not None:
                slot.prehook.remove()
                slot.prehook = None

    def pinned_bytes(self) -> int:
        """Page-locked host bytes held by the pipeline (exact: no allocator rounding unless the fallback ran)."""
        return sum(a.pinned_bytes for a in self._arenas)

    def host_buffer_bytes(self) -> dict[str, int]:
        """Host bytes of the pipeline's buffers, by purpose."""
        out: dict[str, int] = {}
        for a in self._arenas:
            out[a.label] = out.get(a.label, 0) + a.nbytes
        return out

    def _stream(self, device: torch.device, direction: str):
        key = (device, direction)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=device)
        return self._streams[key]

    # ------------------------------------------------------------ transfers

    def _transfer(self, slot: _Slot, src: Tensor, dst: Tensor) -> None:
        """dst (host) <- src (a gradient where it lives), ordered after the work that produced src."""
        src = _local(src)
        if src.device.type == "cuda":
            stream = self._stream(src.device, "d2h")
            stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            # The caching allocator must not hand src's memory to anyone before this copy has read it.
            src.record_stream(stream)
            if slot.d2h_event is None:
                slot.d2h_event = torch.cuda.Event()
            slot.d2h_event.record(stream)
        else:
            dst.copy_(src)

    def _ensure_grad_buffer(self, slot: _Slot) -> None:
        if slot.host_grad is None:  # a parameter unfrozen (or materialised) since the last step
            self._allocate("host_grad", [slot], "gradients", defer_pin=True)

    def _ensure_incoming(self, slot: _Slot) -> None:
        if slot.incoming is None:
            # First accumulation: one buffer for every slot that has a gradient buffer, in one go. Inside
            # backward: page-locking gigabytes (cudaHostRegister) waits until the step; until then the
            # copies into it are synchronous.
            self._allocate(
                "incoming", [s for s in self._slots.values() if s.host_grad is not None and s.incoming is None], "accumulation",
                defer_pin=True,
            )

    def _absorb(self, slot: _Slot, grad: Tensor) -> None:
        """Freed mode: take ``grad`` into host memory (copy, or accumulate onto what is there)."""
        self._ensure_grad_buffer(slot)
        assert slot.host_grad is not None  # allocated by _ensure_grad_buffer
        if not slot.has_grad:
            self._transfer(slot, grad, slot.host_grad)
            slot.has_grad = True
            return
        if slot.pending_add:
            self._wait_add(slot)  # the incoming buffer is about to be overwritten
        self._ensure_incoming(slot)
        assert slot.incoming is not None  # allocated by _ensure_incoming
        self._transfer(slot, grad, slot.incoming)
        slot.add_done = self._accumulator.submit(slot.d2h_event, slot.host_grad, slot.incoming)
        slot.pending_add = True

    def _copy_out(self, slot: _Slot, grad: Tensor) -> None:
        """Kept mode: refresh the host copy of the device gradient."""
        self._ensure_grad_buffer(slot)
        assert slot.host_grad is not None  # allocated by _ensure_grad_buffer
        self._transfer(slot, grad, slot.host_grad)
        slot.source = weakref.ref(grad)
        slot.source_version = _local(grad)._version

    def _wait_add(self, slot: _Slot) -> None:
        """Wait for the accumulator's add into this slot's host gradient; raise what it raised."""
        if slot.pending_add:
            assert slot.add_done is not None  # set together with pending_add
            slot.add_done.wait()
            slot.pending_add = False
            slot.add_done = None
            if self._accumulator.error is not None:
                error, self._accumulator.error = self._accumulator.error, None
                raise RuntimeError(f"accumulating the gradient of {self._name(slot)} in host memory failed") from error

    def _finish(self, slot: _Slot) -> None:
        """Wait for this slot's copies and accumulation (only this slot's): its host gradient is then complete."""
        self._wait_add(slot)
        if slot.d2h_event is not None:
            slot.d2h_event.synchronize()

    def _on_gradient(self, param: Tensor) -> None:
        """The post-accumulate-grad hook: runs during backward, must not block the host."""
        with self._hook_lock:
            self._on_gradient_locked(param)

    def _on_gradient_locked(self, param: Tensor) -> None:
        if not self._wrappers_checked:
            self._check_wrappers()
        if self._unhooked:
            # A parameter unfrozen since the last step gets its hook now, in time for this backward
            # unless its gradient was already accumulated (step() then picks that one up).
            self._hook_trainable()
        if not self._syncing:
            return  # inside no_sync(): the gradient accumulates where autograd put it, copied once at the last micro-batch
        slot = self._slots.get(param)
        if slot is not None and self._updater is not None and self._updater.covers(param):
            raise RuntimeError(self._second_backward(slot))
        grad = param.grad
        if slot is None or slot.ddp or grad is None or is_host_resident(grad):
            return  # an attached DDP model's communication hook brings this gradient, reduced
        if param.device.type == "meta":
            return  # no data to copy: step() refuses it by name
        if not slot.has_grad and not slot.pending_add and self._stale(slot, "host_grad"):
            self._relayout(defer_pin=True)  # cast or moved since the last step (model.half(), model.cuda())
        if grad.is_sparse or grad.shape != param.shape or grad.dtype != param.dtype:
            return  # left on the parameter: step() validates it and names the culprit
        self._arrival += 1
        slot.arrival = self._arrival
        self._landed_at[param] = time.monotonic()
        slot.group = None
        if _local(grad) is not grad:
            # A DTensor gradient: FSDP2 calls this hook after the shard's reduce-scatter, on its post-reduce
            # stream (the copy below is ordered after it).
            if not self.offload_gradients:
                # In-place edits through DTensor (clipping) move no version counter, so a copy taken now could
                # not be known current at the step, which fetches it.
                return
            slot.group = self._fsdp_group_of(grad)
            if slot.has_grad:
                # FSDP2 accumulates into an existing p.grad (our stand-in, on the host); a new DTensor here means
                # p.grad was cleared (model.zero_grad()) or replaced since: this gradient starts afresh.
                self._drop_host_gradient(slot)
        if self._gated_in_backward():
            if slot.has_grad or self._gate_taken:
                # Added onto a gradient of an earlier backward (the norm of the sum is the host's to take), or
                # after a backward that already took the coefficient: the hooks' norms are not the step's.
                self._norms_stale = True
            self._take_norm(param, grad)
        if self.offload_gradients:
            self._absorb(slot, grad)
            self._stand_in(slot, grad)
        else:
            self._copy_out(slot, grad)
        if self.offload_gradients and slot.d2h_event is None and not slot.pending_add:
            self._copied_at[param] = time.monotonic()  # a synchronous copy (no stream) of the gradient: complete now
        if self._updater is not None and self._syncing:
            self._drop_updater_if_state_missing([param])
        if self._updater is not None and self._syncing:
            self._updater.landed(param)
            # An early update runs in place: a use of the parameter still to come in this backward must fail
            # loudly (autograd's saved-tensor check), not read the updated value.
            torch.autograd.graph.increment_version(param)

    def _drop_updater_if_state_missing(self, landing: list[Tensor]) -> None:
        """While no update has run: a parameter unfrozen since the last step (or one of ``landing``, reached for the
        first time) needs state, whose creation may fail, so this step's updates wait for step(), where every state
        is created before the first update. A trainable parameter no backward reached keeps nothing waiting until it
        is reached; if that happens after updates ran, its state is created at step()."""
        assert self._updater is not None
        if self._updater.started() and not self._updater.gated():
            return
        state = self.optimizer.state
        if any(not state.get(p) for p in landing) or any(
                p.requires_grad and not state.get(p) and p not in self._unreached for p in self._slots):
            self._updater.close()
            self._updater = None

    # ------------------------------------------- clipping with updates during backward

    def _clips_in_backward(self) -> bool:
        return self.config.update_in_backward and self.optimizer.max_grad_norm is not None

    def _checks_in_backward(self) -> bool:
        """Whether the non-finite policy (skip or raise) decides, at backward's end, if the updates may start."""
        return self.config.update_in_backward and self.optimizer.nonfinite != "propagate"

    def _gated_in_backward(self) -> bool:
        """Whether the updates of a step wait for the end of its backward (clipping, or a non-finite policy)."""
        return self._clips_in_backward() or self._checks_in_backward()

    def _take_norm(self, param: Tensor, grad: Tensor) -> None:
        """The gradient's norm (clipping) and count of non-finite elements (a non-finite policy) on its device,
        before it leaves (accel/clipping.py); the coefficient and the decision follow backward."""
        if self._updater is not None and not self._updater.gated() and not self._updater.started():
            # Made ungated (max_grad_norm was None at the last step): its updates cannot wait for the norm; step() runs them.
            self._updater.close()
            self._updater = None
        if self._clips_in_backward():
            self._norms[param] = (_clipping.gradient_norm(grad), grad.device, grad.dtype)
        if self._checks_in_backward():
            self._nonfinite[param] = _nonfinite_count(grad)
        if grad.device.type == "cuda":
            # Taken on the stream the hook runs on (FSDP2: its post-reduce stream); read on the callback's stream.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(grad.device))
            self._norm_events.append((grad.device, event))
        if not self._norms_callback_queued:
            self._norms_callback_queued = True
            # Runs when this backward has ended, on its thread, after every callback queued during it (queued from
            # a callback: FSDP2's final callbacks, one per root module, reduce the last groups): every gradient of the
            # step has its norm then.
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(self._norms_complete))

    def _norms_complete(self) -> None:
        """End of backward: the global norm and the clip coefficient; the gated updates may start."""
        with self._hook_lock:
            self._norms_callback_queued = False
            if torch._C._current_autograd_node() is not None:
                # The end of a backward nested in another one (reentrant activation checkpointing): more gradients
                # come; the next hook queues this again on the outer backward (or step() clips, the gate still closed).
                return
            if self._ddp_callback_queued:
                return  # DDP's final callback is still to come, and with it the norms of reduced buckets: see below
            self._decide_at_backward_end()

    def _decide_at_backward_end(self) -> None:
        """From what the hooks took in this backward: no non-finite gradient (a skip or raise policy) and the
        clip coefficient (clipping); then the gated updates may start. Otherwise the gate stays closed and
        step() does it all (the policy's skip or error, torch's clipping) before any update."""
        if self._norms_stale or self._norms_partial or self._unseen_gradient():
            self._clip_coef = None
            return
        events, self._norm_events = self._norm_events, []
        for device, event in events:
            torch.cuda.current_stream(device).wait_event(event)
        where = self._where()
        if self._checks_in_backward():
            if not self._nonfinite or self._any_nonfinite():
                return
            self._checked_policy = self.optimizer.nonfinite
        if self._clips_in_backward():
            max_norm = self.optimizer.max_grad_norm
            if not self._norms or max_norm is None:
                self._clip_coef = None  # step() clips the gradients it has (torch's clipping), the gate still closed
                return
            total, coef = _clipping.clip_coefficient([self._norms[p] for p in where if p in self._norms], max_norm)
            self._clip_max_norm = max_norm
            self._clip_params = frozenset(p for p in where if p in self._norms)
            self.optimizer.last_grad_norm = total
            self._clip_coef = coef.detach().to("cpu")  # with an accelerator: the one wait for the device in the step
        self._gate_taken = True
        if self._updater is not None:
            self._updater.open_gate()

    def _unseen_gradient(self) -> bool:
        """Whether a parameter has a gradient no hook of this backward took: accumulated only inside ``no_sync()``
        (a layer the last micro-batch does not reach) or set by hand. Its norm and count are not the hooks', so the
        step's clipping and policy, which read it, must come before any update."""
        return any(
            not slot.ddp and slot.param.grad is not None and not is_host_resident(slot.param.grad)
            for slot in self._slots.values()
        )

    def _decision_groups(self) -> list[Any]:
        """The process groups of the attached DDP models: beside one, a parameter outside it has this rank's own
        gradient, so a non-finite decision must be OR-reduced over the replicas (DDP's own gradients agree)."""
        groups = []
        for ref in self._ddp_models:
            model = ref()
            if model is not None and model.process_group not in groups:
                groups.append(model.process_group)
        return groups

    def _any_nonfinite(self) -> bool:
        """Whether a gradient of this backward holds inf or NaN on any rank (a DTensor count is summed over them)."""
        sharded = [c for c in self._nonfinite.values() if _local(c) is not c]
        plain = [c for c in self._nonfinite.values() if _local(c) is c]
        found = sum(int(count.item()) for count in plain) > 0
        groups = self._decision_groups()  # beside an attached DDP model the replicas decide alike
        if sharded:
            summed: Any = functools.reduce(operator.add, sharded)  # DTensor partial sums: one all-reduce
            sharded_found = int(summed.full_tensor().item()) > 0
            found = found or sharded_found
            # A plain gradient beside FSDP2's (a module outside fully_shard) is this rank's own: every rank must
            # still decide alike, as the step's policy does (distributed.any_rank), or one rank's updates run
            # while another's step waits in that policy's all-reduce.
            mesh = summed.device_mesh
            groups = [mesh.get_group(dim) for dim in range(mesh.ndim)] if plain else []
        return _or_over_ranks(found, groups)

    def _second_backward(self, slot: _Slot) -> str:
        return (
            f"{self._name(slot)}: a second backward reached this parameter after its update ran during the "
            "previous one (update_in_backward=True); accumulate micro-batches inside opt.no_sync() (FSDP2: "
            "model.set_requires_gradient_sync(False)) and call opt.step() after each backward that runs outside it"
        )

    # ------------------------------------------- freed gradients: what p.grad says

    def _stand_in(self, slot: _Slot, like: Tensor | None = None) -> None:
        """Freed mode: ``p.grad`` becomes the storage-less stand-in of the host gradient (accel/freed.py).

        For a DTensor gradient ``like`` (FSDP2) the stand-in is a DTensor with its mesh and placements, so that
        DTensor ops on ``p.grad`` (torch's clipping, FSDP2's accumulation) keep their cross-rank meaning.
        """
        local = HostResidentGradient(slot.local, lambda: self._complete(slot), lambda: self._name(slot),
                                     zero=lambda: self._zero_host(slot), accumulate=lambda: self._accumulate_into(slot))
        if like is None and _local(slot.param) is not slot.param:
            like = slot.param  # a gradient assigned by hand: FSDP2's gradients have their parameter's mesh and placements
        if like is not None and _local(like) is not like:
            grad: Any = like  # a DTensor: DTensor(local, spec) makes one without a copy or a check
            slot.param.grad = type(grad)(local, grad._spec, requires_grad=False)
        else:
            slot.param.grad = local

    def _fsdp_group_of(self, grad: Tensor) -> int:
        """Which FSDP2 group ``grad`` came from: the gradients of one group are views of one reduce-scatter output.

        The previous group's storage is held until the next group's first hook, so that its memory cannot be
        handed to the next group's output (whose gradients would then look like the same group's).
        """
        storage = _local(grad).untyped_storage()
        if self._group_storage is None or storage.data_ptr() != self._group_storage.data_ptr():
            self._group_id += 1
            self._group_storage = storage
        return self._group_id

    def _zero_host(self, slot: _Slot) -> None:
        """``p.grad.zero_()`` on the stand-in (``zero_grad(set_to_none=False)``): explicit zeros on the host."""
        self.refuse_mid_step("zero its gradient")
        with self._hook_lock:
            self._finish(slot)
        if slot.host_grad is not None:
            slot.host_grad.zero_()

    def _complete(self, slot: _Slot) -> Tensor:
        if self._updater is not None and self._updater.covers(slot.param):
            raise RuntimeError(self._second_backward(slot))  # FSDP2 accumulating into p.grad after its update ran
        if self.config.update_in_backward and not self._clipping_at_step:
            # The update may already have consumed this gradient during backward: clipping or unscaling it now
            # would change nothing the optimizer computes.
            raise RuntimeError(
                f"{self._name(slot)}: with update_in_backward=True the host updates run during backward, so its "
                "gradient cannot be clipped, unscaled or read through p.grad afterwards; use update_in_backward=False "
                "for clipping or loss scaling"
            )
        with self._hook_lock:
            self._finish(slot)
        assert slot.host_grad is not None  # a stand-in exists only for a gradient absorbed into host_grad
        return slot.host_grad

    def _accumulate_into(self, slot: _Slot) -> Tensor:
        """The host gradient an in-place add into ``p.grad`` reaches (FSDP2 adds each reduced micro-batch into it)."""
        if self.config.update_in_backward:
            raise RuntimeError(
                f"{self._name(slot)}: a second gradient was added into p.grad in this step (FSDP2 reduced another "
                "micro-batch into it, or zero_grad(set_to_none=False) left it in place), but with update_in_backward=True "
                "each parameter takes one gradient per step, during backward: run the micro-batches that only accumulate "
                "with model.set_requires_gradient_sync(False) inside opt.no_sync(), and clear gradients with "
                "zero_grad(set_to_none=True)"
            )
        return self._complete(slot)

    def _drop_host_gradient(self, slot: _Slot) -> None:
        """The user cleared ``p.grad`` (``model.zero_grad()``): the host gradient goes with it.

        In backward that is the previous step's gradient, even after other parameters' early updates of this
        step ran; only a parameter whose own update already ran in this backward is refused (a second backward).
        """
        if self._updater is not None and self._updater.covers(slot.param):
            raise RuntimeError(self._second_backward(slot))
        self._finish(slot)  # no copy or add may land in the buffer after it was cleared
        slot.has_grad = False

    def _before_accumulate(self, param: Tensor) -> None:
        """Freed mode, before autograd accumulates into ``p.grad``: read what the user did to it since."""
        with self._hook_lock:
            slot = self._slots.get(param)
            if slot is None:
                return
            grad = param.grad
            if is_host_resident(grad):
                if slot.ddp and slot.has_grad:
                    raise RuntimeError(
                        f"{self._name(slot)}: with offload_gradients=True under DistributedDataParallel, gradients are "
                        "accumulated on the device by DDP: accumulate micro-batches inside ddp_model.no_sync() and "
                        "let only the last backward synchronise, and clear the gradients after each step "
                        "(opt.zero_grad() or model.zero_grad())"
                    )
                param.grad = None  # autograd stores the new gradient; the hook adds it to the host's
            elif grad is None and slot.has_grad:
                self._drop_host_gradient(slot)
            elif grad is not None and slot.has_grad:
                self._drop_host_gradient(slot)  # a gradient assigned by the user replaces the host's

    def _name(self, slot: _Slot) -> str:
        where = self._where().get(slot.param)
        return self.optimizer.describe_param(*where) if where is not None else "a parameter"

    # ------------------------------------------------------------ wrappers

    def _check_wrappers(self) -> None:
        """Once: a DDP model over these parameters that was not attached is refused (freed) or re-fetched (kept)."""
        self._wrappers_checked = True
        attached = [m for m in (r() for r in self._ddp_models) if m is not None]
        ddp = _ddp.unattached_ddp(set(self._slots), attached)
        if ddp is None:
            return
        if self.offload_gradients:
            raise RuntimeError(
                "this OffloadAdamW (offload_gradients=True) optimizes parameters of a DistributedDataParallel model "
                "that was not attached: backward's hook would free each gradient before DDP reduces it. "
                "Call opt.attach(ddp_model) once, before the first backward"
            )
        self._refetch_at_step = True
        warnings.warn(
            "OffloadAdamW: a DistributedDataParallel model over this optimizer's parameters was not attached; "
            "every gradient is fetched from p.grad at the step (correct, without overlap). "
            "Call opt.attach(ddp_model) so that reduced gradients reach the host during backward",
            stacklevel=3,
        )

    def attach_ddp(self, ddp: Any) -> None:
        """Take DDP's parameters off the post-accumulate hooks; its communication hook brings them reduced (accel/ddp.py)."""
        self.refresh()
        params = _ddp.ddp_parameters(ddp)
        missing = [p for p in params if p not in self._slots]
        if len(missing) == len(params):
            raise ValueError("opt.attach(ddp_model): none of the model's parameters is a parameter of this optimizer")
        if any(s.has_grad or s.param.grad is not None for s in self._slots.values()):
            raise RuntimeError("opt.attach(ddp_model) must be called before the first backward (gradients exist already)")
        # With find_unused_parameters DDP decides only in its final callback which gradients stay unset (those
        # every rank left unused: their reduced bucket slices are zeros), so an early update could update a
        # parameter torch would skip; that model's buckets wait for step().
        lands = not getattr(ddp, "find_unused_parameters", False)
        _ddp.attach(ddp, self._ddp_bucket_launched, lambda ps, reduced: self._ddp_bucket_reduced(ps, reduced, lands=lands))
        for p in params:
            if p in self._slots:
                self._slots[p].ddp = True
        self._ddp_models.append(weakref.ref(ddp))

    def _ddp_bucket_launched(self, params: list[Tensor]) -> None:
        """In backward, as DDP hands a bucket to the communication hook: queue the end-of-backward bookkeeping."""
        with self._hook_lock:
            self._group_id += 1  # with updates during backward a DDP bucket is one bucket: it lands all at once
            for p in params:
                slot = self._slots.get(p)
                if slot is not None:
                    self._arrival += 1
                    slot.arrival = self._arrival
                    if self.config.update_in_backward:
                        slot.group = self._group_id
            if not self._ddp_callback_queued:
                self._ddp_callback_queued = True
                # Queued now, before DDP queues its own final callback (when its last bucket is ready), so the
                # callback queued from this one runs after DDP has written p.grad.
                engine = torch.autograd.Variable._execution_engine
                engine.queue_callback(lambda: engine.queue_callback(self._ddp_after_backward))

    def _ddp_bucket_reduced(self, params: list[Tensor], reduced: Tensor, *, lands: bool = True) -> None:
        """The all-reduce of a bucket completed: its averaged gradients go to the host buffers.

        Runs on the thread that completes the all-reduce's future: gloo's worker thread, or (NCCL, whose future
        completes when the collective is enqueued) backward's own thread, with the current stream ordered after
        the all-reduce. Nothing here waits for the device. With updates during backward (and outside
        ``no_sync()``) the bucket's parameters land: the host buffer now holds their reduced gradient, which is
        what DDP writes into ``p.grad`` in its final callback; with clipping their norms are taken here, on the
        device, from the reduced gradients (the coefficient follows DDP's final callback).
        """
        with self._hook_lock:
            members = []
            for p, grad in _ddp.bucket_views(params, reduced):
                slot = self._slots.get(p)
                if slot is None:
                    continue
                self._ensure_grad_buffer(slot)
                if self.offload_gradients and slot.pending_add:
                    self._wait_add(slot)
                if grad.device.type == "cuda":
                    self._stream(grad.device, "d2h")  # created under the lock: the hooks may create it too
                members.append((p, slot, grad))
        syncing = self._syncing and self.config.update_in_backward
        clips = lands and syncing and self._clips_in_backward()
        checks = lands and syncing and self._checks_in_backward()
        if syncing and not lands and self._gated_in_backward():
            self._norms_partial = True  # no coefficient in backward: other parameters' norms would miss these
        lands = lands and syncing
        # The copies and norms without the lock, which backward's hooks take for every parameter (a synchronous
        # copy of a large bucket would hold them up); nothing else touches these slots until DDP's final callback.
        done = []
        for p, slot, grad in members:
            assert slot.host_grad is not None  # allocated by _ensure_grad_buffer
            self._transfer(slot, grad, slot.host_grad)
            norm, count, event = None, None, None
            if clips:
                norm = _clipping.gradient_norm(grad)
            if checks:
                count = _nonfinite_count(grad)  # a reduced gradient: the same on every rank
            if (clips or checks) and grad.device.type == "cuda":  # read on the stream of DDP's final callback
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(grad.device))
            done.append((p, slot, grad, norm, count, event, time.monotonic()))
        with self._hook_lock:
            landing = []
            for p, slot, grad, norm, count, event, now in done:
                slot.source = None
                slot.ddp_written = True
                self._landed_at[p] = now
                if slot.d2h_event is None:
                    self._copied_at[p] = now  # a synchronous copy (no stream): complete now
                if norm is not None or count is not None:
                    if self._gate_taken or p in self._norms or p in self._nonfinite:
                        self._norms_stale = True  # after the decision, or a second reduction: not the step's
                    if norm is not None:
                        self._norms[p] = (norm, grad.device, grad.dtype)
                    if count is not None:
                        self._nonfinite[p] = count
                    if event is not None:
                        self._norm_events.append((grad.device, event))
                if lands:
                    landing.append(p)
            if landing and self._updater is not None:
                self._drop_updater_if_state_missing(landing)
            if landing and self._updater is not None:
                for p in landing:
                    self._updater.landed(p)
                    # As in the hooks: a use of the parameter still to come in this backward fails loudly.
                    torch.autograd.graph.increment_version(p)

    def _ddp_after_backward(self) -> None:
        """After DDP's final callback: p.grad holds the reduced gradient (or None for a parameter DDP found unused).

        With clipping during backward, every norm of the step is known now (the reduced buckets' and the hooks'):
        the coefficient is computed here, on backward's thread, and the gated updates may start.
        """
        with self._hook_lock:
            self._ddp_callback_queued = False
            if self._gated_in_backward():
                self._decide_at_backward_end()
            written = [s for s in self._slots.values() if s.ddp_written]
            for slot in written:
                slot.ddp_written = False
                grad = slot.param.grad
                if grad is None or is_host_resident(grad):
                    slot.has_grad = False
                    continue
                if self.offload_gradients:
                    slot.has_grad = True
                else:
                    slot.source = weakref.ref(grad)
                    slot.source_version = _local(grad)._version
        if self.offload_gradients:
            for slot in written:
                if slot.has_grad:
                    self._stand_in(slot)

    # ------------------------------------------------------------ gradients

    def _where(self) -> dict[Tensor, tuple[int, int]]:
        return {p: (gi, i) for gi, g in enumerate(self.optimizer.param_groups) for i, p in enumerate(g["params"])}

    def _validate(self, slot: _Slot, grad: Tensor, where: tuple[int, int]) -> None:
        """The optimizer's checks (optim/update.py), then what the pipeline's buffers need."""
        opt = self.optimizer
        opt.check_gradient(where[0], where[1], grad)
        if self.offload_gradients and grad.dtype != slot.param.dtype:
            raise RuntimeError(
                f"gradient of {opt.describe_param(*where)} has dtype {grad.dtype}, the parameter {slot.param.dtype}: "
                "with offload_gradients=True gradients are accumulated in host buffers of the parameter's dtype; "
                "produce gradients in the parameter's dtype, or use offload_gradients=False"
            )
        if slot.host_grad is not None and slot.host_grad.shape != slot.local.shape:
            raise RuntimeError(
                f"{opt.describe_param(*where)} changed shape under the optimizer: its host gradient buffer "
                f"has {tuple(slot.host_grad.shape)}, the parameter is {tuple(slot.local.shape)}"
            )

    def _ready(self, slot: _Slot, where: tuple[int, int]) -> Tensor | None:
        """The host gradient of ``slot``, complete and current, or None when it has none."""
        p = slot.param
        if self.offload_gradients:
            grad = p.grad
            if grad is None:
                if slot.has_grad:
                    self._drop_host_gradient(slot)  # cleared by the user (model.zero_grad())
                return None
            if not is_host_resident(grad):  # set outside backward's hooks, or produced before the hook existed
                self._validate(slot, grad, where)
                if slot.has_grad:
                    self._drop_host_gradient(slot)  # an assigned gradient replaces the host's
                self._absorb(slot, grad)
                self._stand_in(slot)
            if not slot.has_grad:
                return None
            self._finish(slot)
            return slot.host_grad
        grad = p.grad
        if grad is None:
            return None
        self._validate(slot, grad, where)
        if grad.dtype != slot.param.dtype:
            # Not the dtype of the host buffer (the hook left it alone): taken as it is, as the plain step does.
            return _local(grad).detach().to("cpu")
        fresh = (
            slot.source is not None and slot.source() is grad and slot.source_version == _local(grad)._version
            and _local(grad) is grad  # never for a DTensor gradient: see _on_gradient_locked
        )
        if not fresh:
            self._copy_out(slot, grad)
        self._finish(slot)
        return slot.host_grad

    def _landed_on_host(self, slot: _Slot) -> Tensor | None:
        """An early update's gradient: the host buffer the parameter landed with, complete.

        Never ``p.grad``: the worker reads it while the user's thread goes on (a ``model.zero_grad()`` right after
        backward, which step() then refuses by name), and DDP sets it to the reduced gradient only in its final
        callback.
        """
        if not (slot.has_grad or slot.ddp):
            return None
        self._finish(slot)
        assert slot.host_grad is not None  # the hook or the communication hook copied into it before it landed
        return slot.host_grad

    def host_gradients(self) -> list[tuple[Tensor, Tensor]]:
        """(parameter, complete host gradient) for every parameter that has one, in optimizer order."""
        self.refresh()
        where = self._where()
        out = []
        for p, w in where.items():
            grad = self._ready(self._slots[p], w)
            if grad is not None:
                out.append((p, grad))
        return out

    def gradient_tensors(self) -> list[Tensor]:
        """The gradients as the truth holds them: host buffers when freed, else the device ``p.grad``."""
        if self.config.update_in_backward:
            raise RuntimeError(
                "with update_in_backward=True the host updates may already have consumed the gradients during "
                "backward: they cannot be read or changed between backward and step(); use update_in_backward=False"
            )
        if self.offload_gradients:
            # A DTensor parameter's gradient is its stand-in DTensor (the ops reach the host shard through it):
            # a norm over the bare host shards would be this rank's alone.
            return [p.grad if _local(p) is not p and p.grad is not None else g for p, g in self.host_gradients()]
        return [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def gradient(self, p: Tensor) -> Tensor | None:
        """The current gradient of ``p``: its host buffer when device gradients are freed, else ``p.grad``."""
        if not self.offload_gradients:
            return p.grad
        self.refuse_mid_step("read a gradient")
        self.refresh()
        w = self._where().get(p)
        if w is None:
            raise KeyError("the tensor is not a parameter of this optimizer")
        return self._ready(self._slots[p], w)

    def zero_grad(self, set_to_none: bool) -> None:
        """Clear the host gradients as torch's zero_grad clears ``p.grad`` (device grads: the optimizer's job)."""
        self.refuse_mid_step("clear its gradients")
        if self._updater is not None and self._updater.gated() and self._updater.started():
            # Buckets complete in the cleared backward, waiting for a coefficient: they would run on the next one's.
            self._updater.close()
            self._updater = None
        self._reset_norms()
        for slot in self._slots.values():
            self._finish(slot)  # no copy or add may land in host memory after it was cleared
            slot.source = None
            if self.offload_gradients:
                if set_to_none:
                    slot.has_grad = False
                elif slot.has_grad:
                    assert slot.host_grad is not None  # has_grad: host_grad holds it
                    slot.host_grad.zero_()
        self.refresh()

    def unscale_(self, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool) -> dict[torch.device, Tensor]:
        """GradScaler's unscale-and-check over the host gradients (freed mode); found_inf stays on its device."""
        pairs = self.host_gradients()
        if not allow_fp16 and any(g.dtype == torch.float16 for _, g in pairs):
            raise ValueError("Attempting to unscale FP16 gradients.")
        host_found = torch.zeros((), dtype=torch.float32)
        host_inv = inv_scale.detach().to("cpu", torch.float32)
        by_kind: dict[tuple[torch.dtype, bool], list[Tensor]] = {}
        for p, g in pairs:
            stand_in = p.grad if _local(p) is not p and is_host_resident(p.grad) else None
            by_kind.setdefault((g.dtype, stand_in is not None), []).append(g if stand_in is None else stand_in)
        for (_, sharded), same in by_kind.items():
            if sharded:
                # DTensor stand-ins (FSDP2): DTensor's unscale reduces found_inf over the mesh, so that every rank
                # skips the step when one rank's shard has an inf, as torch's GradScaler on FSDP2 gradients does.
                found = torch.zeros_like(found_inf)
                torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv_scale)
                found_inf.add_(found)
            else:
                torch._amp_foreach_non_finite_check_and_unscale_(same, host_found, host_inv)
        found_inf.add_(host_found.to(found_inf.device))
        return {found_inf.device: found_inf}

    # ------------------------------------------------------------------ step

    def step(self, grad_scale: Tensor | None, found_inf: Any, called_by_scaler: bool) -> None:
        """One AdamW update of every parameter with a gradient, bucket by bucket (see the module contract)."""
        opt = self.optimizer
        step_called = time.monotonic()
        if self._updater is not None and self._updater.gated():
            # The gate never opened, so nothing ran early: no backward ended with a coefficient every gradient of the
            # step has (none taken, nested, stale, or a reduced DDP bucket took none). Buckets complete behind the gate
            # are the step's, which clips.
            self._updater.close()
            self._updater = None
        early, early_records = self._finish_early_updates()
        if self.config.update_in_backward and called_by_scaler:
            raise RuntimeError(
                "update_in_backward=True cannot be combined with loss scaling: the updates run during backward, "
                "before GradScaler knows whether to skip the step; use bf16, or update_in_backward=False"
            )
        self.refresh()
        if not self._wrappers_checked:
            self._check_wrappers()
        where = self._where()
        if called_by_scaler and not isinstance(found_inf, Tensor) and self.offload_gradients:
            if any(s.has_grad or s.param.grad is not None for s in self._slots.values()):
                raise RuntimeError(
                    "torch.amp.GradScaler could not see any gradient: with offload_gradients=True they live in host "
                    "memory only. Use offload_adamw.OffloadGradScaler (a drop-in GradScaler) with this optimizer."
                )
        if isinstance(found_inf, Tensor) and bool(found_inf.item() != 0):
            return  # GradScaler's skip: no state, no parameter changes
        if called_by_scaler and grad_scale is None and not self.offload_gradients:
            # GradScaler.unscale_ ran: it rescaled every p.grad in place with
            # _amp_foreach_non_finite_check_and_unscale_, which does not move the version counter,
            # so the host copies taken in backward (still scaled) would look current. Fetch again.
            for slot in self._slots.values():
                slot.source = None
        # Buckets are updated one after another: check every gradient first, so that an
        # error names its parameter before any bucket has changed.
        if not self.offload_gradients:
            # A kept gradient is the device's: fetch every one now. The copy taken in backward cannot be known
            # current, since edits through .data, collectives and DTensor move no version counter.
            for slot in self._slots.values():
                slot.source = None
        for p, w in where.items():
            slot = self._slots[p]
            if p in early:
                if p.grad is None:
                    raise RuntimeError(
                        f"{opt.describe_param(*w)}: its gradient was cleared between backward and step() "
                        "(model.zero_grad()), but with update_in_backward=True its update already ran during backward; "
                        "clear gradients after optimizer.step()"
                    )
                if p.grad is not None and not is_host_resident(p.grad):
                    raise RuntimeError(
                        f"{opt.describe_param(*w)} was given a gradient after backward, but with update_in_backward=True "
                        "its update already ran during backward; set gradients only through backward"
                    )
                continue
            if p.grad is not None and not is_host_resident(p.grad):
                self._validate(slot, p.grad, w)
            elif slot.has_grad and p.grad is not None:
                assert slot.host_grad is not None  # has_grad: host_grad holds it
                opt.check_gradient(w[0], w[1], slot.host_grad)
        if early and opt.nonfinite != "propagate" and self._checked_policy == "propagate":
            raise RuntimeError(
                f"nonfinite changed to {opt.nonfinite!r} between backward and step(), but with update_in_backward=True "
                "updates already ran during backward without a non-finite check; set nonfinite before the backward "
                "(the constructor's nonfinite=), or change it after optimizer.step()"
            )
        if self.config.update_in_backward:
            # Before the policy, as OffloadAdamW clips before it without update_in_backward: a skipped step's
            # last_grad_norm is its own (inf or NaN), not the previous step's.
            self._clip_at_step(where, early)
        if opt.nonfinite != "propagate":
            # After updates during backward (every gradient they used was found finite on the device) the policy
            # reads only the gradients still to update; a skip is then too late.
            present = [(w[0], w[1], self._ready(self._slots[p], w)) for p, w in where.items() if p not in early]
            if opt.skip_for_nonfinite([(gi, i, g) for gi, i, g in present if g is not None], self._decision_groups()):
                if early:
                    raise RuntimeError(
                        "a gradient the hooks did not see is not finite, but with update_in_backward=True the updates of "
                        "the others already ran during backward; set gradients only through backward"
                    )
                return
        opt.preflight([w for p, w in where.items() if p not in early and p.grad is not None and not opt.state.get(p)])
        scale = None if grad_scale is None else grad_scale.detach().to("cpu", torch.float32)

        # Parameters the device still reads in backward must not be overwritten: H2D streams wait for compute.
        devices = {s.param.device for s in self._slots.values() if s.param.device.type == "cuda"}
        for device in devices:
            self._stream(device, "h2d").wait_stream(torch.cuda.current_stream(device))

        buckets = self._buckets(where)  # in the order this backward produced the gradients
        events = list(self._early_events)
        self._early_events = []
        records = list(early_records)
        for bucket in buckets:
            todo = [p for p in bucket if p not in early]
            if not todo:
                continue
            record = UpdateRecord(
                bucket=len(records), ready=max((self._landed_at.get(p, step_called) for p in todo), default=step_called)
            )
            record.start = time.monotonic()
            events += self._update_bucket(todo, where, scale, record.extra)
            record.end = time.monotonic()
            records.append(record)
        # The next forward waits for the parameters on the device, the host does not wait at all.
        for device, event in events:
            torch.cuda.current_stream(device).wait_event(event)
        self._pin_deferred()
        self._group_storage = None
        self._reset_norms()
        self._record_timeline(records, step_called)
        self._prepare_early_updates(buckets)

    # ------------------------------------------------- updates during backward

    def _buckets(self, where: dict[Tensor, tuple[int, int]]) -> list[list[Tensor]]:
        """The parameters in the order of the latest backward, cut into buckets of about bucket_bytes."""
        ordered = sorted(where, key=lambda p: self._slots[p].arrival)  # stable: unseen ones last, in order
        buckets: list[list[Tensor]] = []
        bucket: list[Tensor] = []
        nbytes = 0
        previous: int | None = None
        for p in ordered:
            group = self._slots[p].group
            if bucket and (group is not None or previous is not None) and group != previous:
                # An FSDP2 group lands all at once, after its reduce-scatter: it is one bucket, whatever its size.
                buckets.append(bucket)
                bucket, nbytes = [], 0
            bucket.append(p)
            previous = group
            nbytes += _local(p).numel() * p.element_size()
            if group is None and nbytes >= self.config.bucket_bytes:
                buckets.append(bucket)
                bucket, nbytes = [], 0
        if bucket:
            buckets.append(bucket)
        return buckets

    def _prepare_early_updates(self, buckets: list[list[Tensor]]) -> None:
        """The next step's early updates follow this step's buckets (the order of this backward).

        Only parameters that had a gradient in this step, and so have state: creating state can fail (host
        memory), and it must fail before any update of the step, which an update during backward cannot promise.
        A trainable parameter that no backward reached (an unused head) is in no bucket and keeps nothing waiting.
        """
        self._landed_at = {}
        self._copied_at = {}
        if not self.config.update_in_backward or not any(s.arrival != math.inf for s in self._slots.values()):
            return
        self._unreached = {p for p in self._slots if p.requires_grad and not self.optimizer.state.get(p)}
        # Only what had a gradient in this step: a bucket waiting for a parameter that gets none would wait for step().
        buckets = [
            b for b in ([p for p in bucket if self._slots[p].has_grad and self.optimizer.state.get(p)] for bucket in buckets)
            if b
        ]
        self._early_buckets = buckets
        self._updater = BackwardUpdater(buckets, self._early_update, gated=self._gated_in_backward())

    def _reset_norms(self) -> None:
        """Outside backward (step(), zero_grad()): no callback is pending, also when a backward raised before its end."""
        self._norms = {}
        self._nonfinite = {}
        self._gate_taken = False
        self._checked_policy = "propagate"
        self._norm_events = []
        self._norms_callback_queued = False
        self._clip_coef = None
        self._norms_stale = False
        self._norms_partial = False
        self._clip_max_norm = None
        self._clip_params = frozenset()
        # A backward that raised never ran DDP's final callback: the next backward must queue it again.
        self._ddp_callback_queued = False

    def _clip_at_step(self, where: dict[Tensor, tuple[int, int]], early: set[Tensor]) -> None:
        """Clipping with update_in_backward: the coefficient taken after backward while it is the step's, else torch's now.

        It is the step's when every gradient the step updates is the one whose norm a hook took, with the
        max_grad_norm of now; otherwise, with no update run yet, the step clips as torch's clip_grad_norm_ does,
        and after updates that ran with it the step is refused.
        """
        max_norm = self.optimizer.max_grad_norm
        present = [p for p in where if p.grad is not None and (self._slots[p].has_grad or not is_host_resident(p.grad))]
        reason = self._coefficient_is_not_the_steps(present, max_norm)
        if reason is None:
            return
        if early:
            raise RuntimeError(
                f"{reason}, but with update_in_backward=True and max_grad_norm the updates that ran during backward "
                "used the clip coefficient taken when backward ended; set gradients only through backward, one backward "
                "per step (accumulate inside opt.no_sync()), and change max_grad_norm after opt.step()"
            )
        self._clip_coef = None
        if max_norm is None:
            return
        grads = []
        for p in present:
            grad = self._ready(self._slots[p], where[p])
            if grad is not None:  # a DTensor's stand-in, so that the norm is every rank's
                grads.append(p.grad if _local(p) is not p and p.grad is not None else grad)
        self._clipping_at_step = True
        try:
            self.optimizer.last_grad_norm = _clipping.clip_gradients_(grads, max_norm)
        finally:
            self._clipping_at_step = False

    def _coefficient_is_not_the_steps(self, present: list[Tensor], max_norm: float | None) -> str | None:
        """Why the coefficient taken after backward does not fit this step's gradients, or None when it does."""
        if self._norms_stale:
            return "a gradient was accumulated over more than one backward (or changed after its norm was taken)"
        if self._clip_coef is None:
            return None if max_norm is None else "no backward ended with every gradient's norm taken"
        if max_norm != self._clip_max_norm:
            return f"max_grad_norm changed from {self._clip_max_norm} to {max_norm} between backward and step()"
        where = self._where()
        for p in present:
            if not is_host_resident(p.grad) or p not in self._clip_params:
                return f"{self.optimizer.describe_param(*where[p])} has a gradient that backward's hooks did not see"
        gone = [p for p in self._clip_params if p not in set(present)]
        if gone:
            return f"{self.optimizer.describe_param(*where[gone[0]])}'s gradient was cleared after backward"
        return None

    def _early_update(self, index: int) -> dict[str, float]:
        """A bucket's update on the worker thread, while backward goes on."""
        opt = self.optimizer
        where = self._where()
        bucket = [p for p in self._early_buckets[index] if p in where]
        # An attached DDP parameter landed when its reduced gradient was copied to the host; has_grad and p.grad
        # follow only in DDP's final callback (p.grad is meanwhile the local, unreduced gradient).
        for p in bucket:
            slot = self._slots[p]
            if slot.has_grad or slot.ddp:
                assert slot.host_grad is not None  # has_grad or a DDP landing: host_grad holds it
                opt.check_gradient(*where[p], slot.host_grad)
        opt.preflight([where[p] for p in bucket if (self._slots[p].has_grad or self._slots[p].ddp) and not opt.state.get(p)])
        for gi in {where[p][0] for p in bucket}:
            self._early_hyper[gi] = _hyper_of(opt.param_groups[gi])
        times: dict[str, float] = {}
        self._early_events += self._update_bucket(bucket, where, None, times, early=True)
        return times

    def _finish_early_updates(self) -> tuple[set[Tensor], list[UpdateRecord]]:
        """Wait for the updates that ran during backward; the parameters they covered and their records."""
        updater, self._updater = self._updater, None
        if updater is None:
            return set(), []
        _, records = updater.finish()
        opt = self.optimizer
        for gi, used in self._early_hyper.items():
            if _hyper_of(opt.param_groups[gi]) != used:
                raise RuntimeError(
                    f"param_groups[{gi}]'s hyperparameters changed between backward and step(), but with "
                    "update_in_backward=True the update ran during backward with the old ones; change lr, betas, "
                    "eps or weight_decay (scheduler.step()) after optimizer.step()"
                )
        self._early_hyper = {}
        done = {p for r in records for p in self._early_buckets[r.bucket]}
        return done, records

    def _refuse_forward(self, module: torch.nn.Module) -> None:
        """A forward after a backward whose updates ran, before step(): torch's optimizer has not changed the
        parameters yet, ours has (some of them). Raised, naming the module's first updated parameter."""
        updater = self._updater
        if updater is None or not updater.started() or torch._C._current_autograd_node() is not None:
            return  # no update ran, or a recomputation inside backward (activation checkpointing)
        for p in module.parameters(recurse=False):
            if updater.covers(p):
                slot = self._slots[p]
                raise RuntimeError(
                    f"a forward of {type(module).__name__} reads {self._name(slot)}, whose update already ran during the "
                    "last backward (update_in_backward=True): opt.step() must come next. Accumulate micro-batches inside "
                    "opt.no_sync(), run other forwards (a metric, an EMA) after opt.step(), or use update_in_backward=False"
                )

    def refuse_mid_step(self, what: str) -> None:
        """Raise when updates already ran during this backward and the optimizer is asked to ``what`` before step()."""
        if self._updater is not None and self._updater.started() and not self._updater.gated():
            raise RuntimeError(
                f"the optimizer cannot {what} now: with update_in_backward=True the last backward already updated "
                "some parameters, so opt.step() must come next (every backward outside opt.no_sync() is followed by "
                "step(); a backward that is not, such as one through another model's parameters, needs "
                "update_in_backward=False)"
            )

    def no_sync(self) -> _NoSync:
        """A context for micro-batches that only accumulate: their gradients stay where autograd accumulates
        them (on the device) and start no copy and no update; the next backward outside it copies each once."""
        return _NoSync(self)

    def _record_timeline(self, records: list[UpdateRecord], step_called: float) -> None:
        backward_end = max(self._landed_at.values(), default=step_called)
        buckets = []
        for r in records:
            d2h = r.extra.get("d2h_done", r.start)
            buckets.append(BucketTimes(
                label=str(r.bucket), grad_ready=min(r.ready, d2h), d2h_done=d2h, update_start=r.start,
                update_end=r.end, h2d_done=max(r.end, r.extra.get("h2d_issued", r.end)),
            ))
        self._timeline = StepTimeline(buckets=tuple(buckets), backward_end=backward_end)

    def last_step_timeline(self) -> StepTimeline | None:
        """The timeline of the latest step (accel/timeline.py), or None before the first."""
        return self._timeline

    def _update_bucket(self, params: list[Tensor], where: dict[Tensor, tuple[int, int]], scale: Tensor | None,
                       times: dict[str, float] | None = None, *, early: bool = False) -> list:
        opt = self.optimizer
        by_group: dict[int, list[tuple[_Slot, Tensor]]] = {}
        for p in params:
            slot = self._slots[p]
            grad = self._landed_on_host(slot) if early else self._ready(slot, where[p])
            if grad is not None:
                if self._clip_coef is not None:
                    grad.mul_(self._clip_coef)  # what clip_grads_with_norm_ does to it, on the host where it is
                by_group.setdefault(where[p][0], []).append((slot, grad))
        if times is not None:
            # Copies on a stream are known complete when their wait returned (now); synchronous ones when they ran.
            copied = [self._copied_at[p] for p in params if p in self._copied_at]
            times["d2h_done"] = max(copied) if params and len(copied) == len(params) else time.monotonic()
        events = []
        for gi, members in by_group.items():
            updates: list[tuple[Tensor, Tensor, Tensor | None]] = []
            to_device: list[_Slot] = []
            for slot, grad in members:
                p = slot.param
                if not slot.on_device:
                    updates.append((p, grad, None))  # the optimizer writes host parameters itself
                else:
                    if slot.h2d_event is not None:
                        slot.h2d_event.synchronize()  # the previous copy out of staging has ended
                    updates.append((p, grad, slot.staging))
                    to_device.append(slot)
            opt.update_group(gi, updates, scale)
            events += self._send_back(to_device)
        if times is not None:
            times["h2d_issued"] = time.monotonic()
        return events

    def _send_back(self, slots: list[_Slot]) -> list:
        """Updated parameters host -> device, non-blocking; one event per device for the bucket."""
        by_device: dict[torch.device, list[_Slot]] = {}
        for s in slots:
            by_device.setdefault(s.param.device, []).append(s)
        events = []
        for device, members in by_device.items():
            if device.type != "cuda":
                for s in members:  # another accelerator without streams here: a plain copy
                    assert s.staging is not None  # allocated for every parameter on a device
                    s.local.copy_(s.staging)
                continue
            stream = self._stream(device, "h2d")
            with torch.cuda.stream(stream), torch.no_grad():
                for s in members:
                    assert s.staging is not None  # allocated for every parameter on a device
                    s.local.copy_(s.staging, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            for s in members:
                s.h2d_event = event
            events.append((device, event))
        return events


def _or_over_ranks(flag: bool, groups: list[Any]) -> bool:
    """``flag`` OR-reduced over the ranks of each process group in turn (the step's policy does the same in
    distributed.any_rank, which this layer may not import)."""
    for group in groups:
        device = "cuda" if torch.distributed.get_backend(group) == "nccl" else "cpu"
        local = torch.tensor([1.0 if flag else 0.0], device=device)
        torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX, group=group)
        flag = bool(local.item() > 0)
    return flag


def _nonfinite_count(grad: Tensor) -> Tensor:
    """How many elements of ``grad`` are inf or NaN, on its device (a DTensor: a partial sum over the ranks)."""
    return torch.isfinite(grad).logical_not().sum()


def _hyper_of(group: dict[str, Any]) -> tuple:
    """The values an update reads from its group (a tensor lr by value)."""
    lr = group["lr"]
    lr = float(lr) if isinstance(lr, Tensor) else lr
    betas = tuple(float(b) if isinstance(b, Tensor) else b for b in group["betas"])
    return (lr, betas, group["eps"], group["weight_decay"], group["amsgrad"], group["maximize"])


# Pipelines with updates during backward, watched by one global forward pre-hook (registered with the first).
_WATCHED: weakref.WeakSet[GradientPipeline] = weakref.WeakSet()
_FORWARD_HOOK: Any = None


def _watch_forwards(pipeline: GradientPipeline) -> None:
    global _FORWARD_HOOK
    _WATCHED.add(pipeline)
    if _FORWARD_HOOK is None:
        _FORWARD_HOOK = torch.nn.modules.module.register_module_forward_pre_hook(_forward_guard)


def _forward_guard(module: torch.nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return  # traced as a constant: compiled forwards keep their graphs (and go unchecked)
    for pipeline in list(_WATCHED):
        pipeline._refuse_forward(module)


class _NoSync:
    def __init__(self, pipeline: GradientPipeline) -> None:
        self._pipeline = pipeline
        self._before = True

    def __enter__(self) -> None:
        self._before = self._pipeline._syncing
        self._pipeline._syncing = False

    def __exit__(self, *exc: object) -> None:
        self._pipeline._syncing = self._before


# The attribute of a parameter that names the pipeline whose hooks take its gradients: an optimizer dropped
# without close() stays alive until the garbage collector breaks its reference cycle, and its hooks would
# go on taking the gradients.
_OWNER_ATTR = "_offload_adamw_pipeline"


def _take_over(param: Tensor, pipeline: GradientPipeline) -> None:
    """Make ``pipeline`` the one whose hooks take ``param``'s gradients, removing an earlier one's hooks."""
    owner = getattr(param, _OWNER_ATTR, None)
    previous = owner() if owner is not None else None
    if previous is not None and previous is not pipeline:
        warnings.warn(
            "OffloadAdamW: a new transfer pipeline takes over parameters of an earlier OffloadAdamW, whose hooks "
            "are removed (that optimizer no longer receives their gradients)",
            stacklevel=4,
        )
        previous.close()
    setattr(param, _OWNER_ATTR, weakref.ref(pipeline))
