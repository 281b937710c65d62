"""Where gradients come from: autograd's hooks, and the communication hook of an attached DDP model.

Contract:

* Both adapters end in one ``land(slot, grad, group=..., accumulated=...)`` of the pipeline: the gradient of
  ``slot`` is complete on its device (``group``: the FSDP2 reduce-scatter or DDP bucket it came with, or
  None). Everything before that call (is it a gradient the pipeline takes? which group?) is the adapter's;
  everything after it is the pipeline's.
* :class:`AutogradHooks`: a post-accumulate-grad hook on every trainable parameter (FSDP2 calls it after
  the shard's reduce-scatter, on its post-reduce stream), and with freed gradients a pre-hook that runs
  before autograd accumulates into ``p.grad``. A parameter unfrozen since the last step gets its hooks at
  the first hook of the next backward. The gradients of one FSDP2 group are views of one reduce-scatter
  output: that storage names the group. One pipeline takes a parameter's gradients: a new pipeline over
  the same parameters removes an earlier one's hooks (with a warning), and a pipeline dropped by its
  optimizer removes its own, so no dead hook stays on a parameter. The hooks hold the pipeline weakly.
* :class:`DdpSource` (freed gradients): DDP reduces after the hooks have run, so an attached model's
  parameters are taken off them; DDP's communication hook (accel/ddp.py) brings each reduced bucket,
  whose parameters land together, on the thread that completes the all-reduce (gloo's worker, or
  backward's with NCCL). After DDP's final callback has written ``p.grad``, the pipeline's callback (queued
  behind it) makes the stand-ins. With kept gradients nothing is taken from DDP in backward: the step
  copies the reduced ``p.grad``; attaching still names the replicas for the non-finite decision.
* :meth:`DdpSource.check_unattached`: a DDP model over these parameters that was not attached is refused with
  freed gradients (its gradients would be freed before DDP reduces them), and warned about with kept ones.
* What the residency and schedule ask of both adapters is one component, chosen once where the pipeline is built:
  :class:`KeptTaking` (gradients stay where autograd put them until the step), :class:`FreedTaking` (each is taken
  as backward produces it, an attached DDP model's reduced bucket by bucket) or :class:`EarlyTaking` (freed, and a
  reduced bucket's parameters may update during backward). No adapter branches on a mode flag.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from offload_adamw.accel import ddp as _ddp
from offload_adamw.accel.freed import is_host_resident
from offload_adamw.accel.slots import Holding, Slot, SlotTable, Source
from offload_adamw.distributed import local_tensor

__all__ = ["AutogradHooks", "DdpSource", "EarlyTaking", "FreedTaking", "GroupIds", "KeptTaking", "Landing", "Taking",
           "accumulates", "graph_task", "take_over"]


class Landing(Protocol):
    """What the adapters call: the pipeline front."""

    def land(self, slot: Slot, grad: Tensor, *, group: int | None, accumulated: bool) -> None:
        """A gradient from backward's hook is complete on its device."""
        ...

    def arrived(self, slot: Slot, group: int | None) -> None:
        """A DDP bucket with this parameter went to its all-reduce (its place in this backward's order)."""
        ...

    def reduced_landed(self, slot: Slot, grad: Tensor, *, lands: bool) -> None:
        """A reduced DDP gradient was copied to the host (``lands``: its update may run during backward)."""
        ...

    def syncing(self) -> bool:
        """False inside ``no_sync()``: micro-batches that only accumulate."""
        ...


class KeptTaking:
    """Kept gradients: a gradient stays where autograd accumulated it until the step copies it once."""

    def extra_hooks(self, slot: Slot, owner: weakref.ref[AutogradHooks]) -> list[Any]:
        """No hook before accumulation: autograd accumulates into the device ``p.grad`` itself."""
        return []

    def takes_sharded(self) -> bool:
        """A DTensor gradient (FSDP2's reduced shard) is copied at the step, not in backward."""
        return False

    def takes_reduced(self) -> bool:
        """An attached DDP model's reduced gradients are copied from ``p.grad`` at the step: no communication hook, and an
        unattached model is only warned about (nothing is freed before DDP reduces it)."""
        return False

    def arrival_group(self, group: int) -> int | None:
        return None

    def lands_in_backward(self) -> bool:
        return False


class FreedTaking:
    """Freed gradients: each gradient is taken as backward produces it, and its device memory freed."""

    def extra_hooks(self, slot: Slot, owner: weakref.ref[AutogradHooks]) -> list[Any]:
        """A pre-hook before autograd accumulates into ``p.grad`` (our host stand-in)."""
        handle = slot.param.register_hook(_pre_hook(owner, slot))
        slot.grad_node = _grad_accumulator(slot.param)
        return [handle]

    def takes_sharded(self) -> bool:
        """A DTensor gradient is taken after FSDP2's reduce-scatter, on its post-reduce stream."""
        return True

    def takes_reduced(self) -> bool:
        """An attached DDP model's reduced buckets come through its communication hook; an unattached model is refused."""
        return True

    def arrival_group(self, group: int) -> int | None:
        """A reduced bucket is no group of updates during backward: every update runs at the step."""
        return None

    def lands_in_backward(self) -> bool:
        return False


class EarlyTaking(FreedTaking):
    """Freed gradients with updates during backward: a reduced DDP bucket's parameters are one group that may update
    as soon as it lands."""

    def arrival_group(self, group: int) -> int | None:
        return group

    def lands_in_backward(self) -> bool:
        return True


Taking = KeptTaking | FreedTaking


class GroupIds:
    """The ids of the groups gradients land in (an FSDP2 reduce-scatter, a DDP bucket), one counter for both adapters:
    built before either, so neither is patched into the other."""

    def __init__(self) -> None:
        self._last = 0

    def next(self) -> int:
        self._last += 1
        return self._last


# The hooks whose owner takes a parameter's gradients, by the parameter's id, both held weakly: nothing is stored
# on the parameter (torch.save(model) and deepcopy see plain parameters), and an entry goes with its parameter.
_OWNERS: dict[int, tuple[weakref.ref[Tensor], weakref.ref[Any]]] = {}


def _owner_of(param: Tensor) -> Any:
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def take_over(param: Tensor, owner: Any) -> None:
    """Make ``owner`` the one whose hooks take ``param``'s gradients, removing an earlier one's hooks."""
    previous = _owner_of(param)
    if previous is not None and previous is not owner:
        warnings.warn(
            "OffloadAdamW: a new transfer pipeline takes over parameters of an earlier OffloadAdamW, whose hooks "
            "are removed (that optimizer no longer receives their gradients)",
            stacklevel=5,
        )
        previous.close()
    key = id(param)

    def forget(_: object) -> None:
        _OWNERS.pop(key, None)

    _OWNERS[key] = (weakref.ref(param, forget), weakref.ref(owner))


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class AutogradHooks:
    """Autograd's hooks on every trainable parameter (see the module contract)."""

    def __init__(self, slots: SlotTable, landing: Landing, lock: Any, *, taking: Taking, groups: GroupIds,
                 before_accumulate: Callable[[Slot], None], second_backward: Callable[[Slot], None],
                 relayout: Callable[[], None], on_backward: list[Callable[[], None]]) -> None:
        self._slots = slots
        self._landing = landing
        self._lock = lock
        self._taking = taking
        self._before_accumulate = before_accumulate
        self._groups = groups
        self.on_backward = on_backward
        """Called at the first hook of every backward (the check for an unattached DDP model, the schedule's count
        of backwards that have not ended)."""
        self._second_backward = second_backward
        self._relayout = relayout
        self._unhooked: list[Slot] = []
        self._backward: int | None = None  # the autograd graph task of the latest hook
        self._group_storage: Any = None
        self._group = 0  # the id of the latest FSDP2 group's storage
        self.handles: list[Any] = []
        """Every hook handle, for the finaliser that removes them when the optimizer goes."""

    def watch(self, new: list[Slot]) -> None:
        """Hooks for the new slots that are trainable now; the others at the first backward that finds them trainable."""
        self._unhooked += new
        self.hook_trainable()

    def hook_trainable(self) -> None:
        still = []
        for slot in self._unhooked:
            if slot.param.requires_grad:
                take_over(slot.param, self)
                ref = weakref.ref(self)
                handles = [slot.param.register_post_accumulate_grad_hook(_post_hook(ref)),
                           *self._taking.extra_hooks(slot, ref)]
                slot.handles += handles
                self.handles += handles
            else:
                still.append(slot)
        self._unhooked = still

    def forget(self, gone: list[Slot]) -> None:
        """Slots released by the pipeline: their hooks go, and the parameters are no longer this one's."""
        dropped = {id(s) for s in gone}
        self._unhooked = [s for s in self._unhooked if id(s) not in dropped]
        removed = {id(h) for slot in gone for h in slot.handles}
        for slot in gone:
            for handle in slot.handles:
                handle.remove()
            slot.handles.clear()
            if _owner_of(slot.param) is self:
                _OWNERS.pop(id(slot.param), None)
        self.handles = [h for h in self.handles if id(h) not in removed]

    def close(self) -> None:
        """Remove every hook (the optimizer no longer sees gradients as they arrive) and give up the parameters."""
        _remove_all(self.handles)
        for slot in self._slots:
            slot.handles.clear()
            if _owner_of(slot.param) is self:
                _OWNERS.pop(id(slot.param), None)

    def new_step(self) -> None:
        """step() or zero_grad(): the next hook is a backward's first; the previous group's storage is let go."""
        self._backward = None
        self._group_storage = None

    # ------------------------------------------------------------ in backward

    def on_gradient(self, param: Tensor) -> None:
        """The post-accumulate-grad hook: runs during backward, must not block the host."""
        with self._lock:
            self._on_gradient(param)

    def _on_gradient(self, param: Tensor) -> None:
        task = graph_task()
        if task != self._backward or task is None:
            # The first hook of a backward: parameters unfrozen since get their hooks in time for the rest of it
            # (unless their gradient was already accumulated: step() then picks that one up).
            self._backward = task
            self.hook_trainable()
            for began in self.on_backward:
                began()
        if not self._landing.syncing():
            return  # inside no_sync(): the gradient accumulates where autograd put it, copied once at the last micro-batch
        slot = self._slots.get(param)
        if slot is None:
            return
        self._second_backward(slot)
        grad = param.grad
        if slot.source is Source.DDP or grad is None or is_host_resident(grad):
            return  # an attached DDP model's communication hook brings this gradient, reduced
        if param.device.type == "meta":
            return  # no data to copy: step() refuses it by name
        if slot.holding is Holding.NOTHING and self._slots.stale(slot, "host_grad"):
            self._relayout()  # cast or moved since the last step (model.half(), model.cuda())
        if grad.is_sparse or grad.shape != param.shape or grad.dtype != param.dtype:
            return  # left on the parameter: step() validates it and names the culprit
        group = None
        if local_tensor(grad) is not grad:
            # A DTensor gradient: FSDP2 calls this hook after the shard's reduce-scatter, on its post-reduce stream.
            if not self._taking.takes_sharded():
                return  # copied at the step (kept gradients)
            group = self._fsdp_group_of(grad)
            if slot.holding is not Holding.NOTHING:
                # FSDP2 accumulates into an existing p.grad (our stand-in, on the host); a new DTensor here means
                # p.grad was cleared (model.zero_grad()) or replaced since: this gradient starts afresh.
                self._before_accumulate(slot)
        self._landing.land(slot, grad, group=group, accumulated=slot.holding is not Holding.NOTHING)

    def pre_accumulate(self, slot: Slot) -> None:
        with self._lock:
            if self._slots.get(slot.param) is slot and accumulates(slot):
                self._before_accumulate(slot)

    def _fsdp_group_of(self, grad: Tensor) -> int:
        """Which FSDP2 group ``grad`` came from: the gradients of one group are views of one reduce-scatter output.

        The previous group's storage is held until the next group's first hook, so that its memory cannot be
        handed to the next group's output (whose gradients would then look like the same group's).
        """
        storage = local_tensor(grad).untyped_storage()
        if self._group_storage is None or storage.data_ptr() != self._group_storage.data_ptr():
            self._group = self._groups.next()
            self._group_storage = storage
        return self._group


def _grad_accumulator(param: Tensor) -> Any:
    """The AccumulateGrad node of the leaf ``param`` (built outside backward, where grad mode is on)."""
    with torch.enable_grad():
        fn = param.view_as(param).grad_fn
    return None if fn is None else fn.next_functions[0][0]


def accumulates(slot: Slot) -> bool:
    """Whether the running backward will accumulate into ``slot``'s ``p.grad`` (``torch.autograd.grad`` does not: its
    gradients go to the caller)."""
    if slot.grad_node is None:
        return True
    try:
        return bool(torch._C._will_engine_execute_node(slot.grad_node))
    except RuntimeError:  # torch refuses the question inside autograd.grad(), which never accumulates into p.grad
        return False


def graph_task() -> int | None:
    """The id of the running autograd graph task (one per backward, nested ones their own; -1 outside one, as on
    DDP's gloo thread), or None where torch does not tell."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else int(current())


def _post_hook(ref: weakref.ref[AutogradHooks]) -> Callable[[Tensor], None]:
    @torch._dynamo.disable
    def hook(param: Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner.on_gradient(param)

    return hook


def _pre_hook(ref: weakref.ref[AutogradHooks], slot: Slot) -> Callable[[Tensor], None]:
    target = weakref.ref(slot)

    @torch._dynamo.disable
    def prehook(grad: Tensor) -> None:
        owner, s = ref(), target()
        if owner is not None and s is not None:
            owner.pre_accumulate(s)

    return prehook


class DdpSource:
    """The reduced gradients of attached DDP models (see the module contract)."""

    def __init__(self, slots: SlotTable, landing: Landing, *, taking: Taking, land_reduced: Callable[[Slot, Tensor], None],
                 after_ddp: Callable[[Slot], None], groups: GroupIds, models: _ddp.AttachedModels, lock: Any, gate: Any,
                 on_device: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext) -> None:
        self._slots = slots
        self._on_device = on_device  # the callback may run on a thread not the pipeline's (gloo's)
        self._landing = landing
        self._taking = taking
        self._land_reduced = land_reduced
        self._after_ddp = after_ddp
        self._groups = groups
        self._lock = lock
        self._gate = gate
        self._models = models
        self._written: set[Slot] = set()
        self._callback_queued = False
        self._checked = False

    def models(self) -> list[Any]:
        return self._models.models()

    def process_groups(self) -> list[Any]:
        """The process groups of the attached DDP models (:meth:`AttachedModels.process_groups`)."""
        return self._models.process_groups()

    def attach(self, ddp: Any) -> None:
        params = _ddp.ddp_parameters(ddp)
        missing = [p for p in params if p not in self._slots.slots]
        if len(missing) == len(params):
            raise ValueError("opt.attach(ddp_model): none of the model's parameters is a parameter of this optimizer")
        if any(s.holding is not Holding.NOTHING or s.param.grad is not None for s in self._slots):
            raise RuntimeError("opt.attach(ddp_model) must be called before the first backward (gradients exist already)")
        self._models.add(ddp)
        if not self._taking.takes_reduced():
            return  # kept gradients: the step copies DDP's reduced p.grad
        # With find_unused_parameters DDP decides only in its final callback which gradients stay unset (those
        # every rank left unused: their reduced bucket slices are zeros), so an early update could update a
        # parameter torch would skip; that model's buckets wait for step().
        lands = not getattr(ddp, "find_unused_parameters", False)
        _ddp.attach(ddp, self._launched, lambda ps, reduced: self._reduced(ps, reduced, lands=lands))
        for p in params:
            slot = self._slots.get(p)
            if slot is not None:
                slot.source = Source.DDP

    def check_unattached(self) -> None:
        """Once: a DDP model over these parameters that was not attached is refused (freed) or warned about (kept)."""
        if self._checked:
            return
        self._checked = True
        ddp = _ddp.unattached_ddp(set(self._slots.slots), self.models())
        if ddp is None:
            return
        if self._taking.takes_reduced():
            raise RuntimeError(
                "this OffloadAdamW (offload_gradients=True) optimizes parameters of a DistributedDataParallel model "
                "that was not attached: backward's hook would free each gradient before DDP reduces it. "
                "Call opt.attach(ddp_model) once, before the first backward"
            )
        warnings.warn(
            "OffloadAdamW: a DistributedDataParallel model over this optimizer's parameters was not attached; "
            "its reduced gradients are copied from p.grad at the step (correct), but a non-finite policy cannot "
            "name its replicas. Call opt.attach(ddp_model) once, before the first backward",
            stacklevel=4,
        )

    def _launched(self, params: list[Tensor]) -> None:
        """In backward, as DDP hands a bucket to the communication hook: its order, and the end-of-backward callback."""
        with self._lock:
            group = self._groups.next()
            for p in params:
                slot = self._slots.get(p)
                if slot is not None:
                    self._landing.arrived(slot, self._taking.arrival_group(group))
            if not self._callback_queued:
                self._callback_queued = True
                self._gate.ddp_pending = True
                # Queued now, before DDP queues its own final callback (when its last bucket is ready), so the
                # callback queued from this one runs after DDP has written p.grad.
                engine = torch.autograd.Variable._execution_engine
                engine.queue_callback(lambda: engine.queue_callback(self._after_backward))

    def _reduced(self, params: list[Tensor], reduced: Tensor, *, lands: bool) -> None:
        """The all-reduce of a bucket completed: its averaged gradients go to the host buffers, and (with updates
        during backward, outside ``no_sync()``) its parameters land. Nothing here waits for the device.

        Runs on whichever thread completes the all-reduce (gloo's own): the pipeline's device is made current for it,
        so that no call creates a context on that thread's current device."""
        with self._on_device():
            self._reduced_on_device(params, reduced, lands=lands)

    def _reduced_on_device(self, params: list[Tensor], reduced: Tensor, *, lands: bool) -> None:
        with self._lock:
            members = []
            for p, grad in _ddp.bucket_views(params, reduced):
                slot = self._slots.get(p)
                if slot is not None:
                    if slot.on_host:  # a streamed or resident group's gradient never leaves the device
                        # Under the lock, which allocation needs; the residency's land_reduced orders its copy after any
                        # add still queued into the buffer.
                        self._slots.ensure_grad_buffer(slot)
                    members.append((slot, grad))
        syncing = self._landing.syncing() and self._taking.lands_in_backward()
        if syncing and not lands and self._gate.gated():
            self._gate.incomplete()  # no coefficient in backward: other parameters' norms would miss these
        # The copies without the lock, which backward's hooks take for every parameter (a synchronous copy of a
        # large bucket would hold them up); nothing else touches these slots until DDP's final callback.
        for slot, grad in members:
            self._land_reduced(slot, grad)
        with self._lock:
            for slot, grad in members:
                self._written.add(slot)
                self._landing.reduced_landed(slot, grad, lands=lands and syncing)

    def _after_backward(self) -> None:
        """After DDP's final callback: p.grad holds the reduced gradient (or None for a parameter DDP found unused)."""
        with self._lock:
            self._callback_queued = False
            self._gate.ddp_pending = False
            written, self._written = self._written, set()
            for slot in written:
                self._after_ddp(slot)  # before the gate opens: an update it starts reads the gradient p.grad now holds
            if self._gate.gated():
                self._gate.decide()

    def new_step(self) -> None:
        """A backward that raised never ran DDP's final callback: the next backward must queue it again."""
        self._callback_queued = False
        self._written = set()

