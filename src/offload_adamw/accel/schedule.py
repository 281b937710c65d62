"""When the updates of a step run: all at ``step()``, or each bucket during backward as soon as it can.

Contract, one schedule each, chosen once at construction:

* :class:`AtStep`: every update runs in ``step()``; nothing is refused that torch allows.
* :class:`DuringBackward` (``update_in_backward``, freed gradients only): the buckets of a step are those
  of the previous backward's order (an FSDP2 group, or a DDP bucket, is one bucket); a bucket whose
  gradients have all landed is updated by the worker of accel/overlap.py while backward goes on, reading
  the host buffers it landed with. With clipping or a non-finite policy the worker waits for the gate
  (accel/gate.py). Only parameters that had a gradient and state at the previous step are in a bucket:
  creating state can fail, and it must fail before any update of the step. A landing parameter still
  used later in this backward has its version moved, so that the use fails loudly (autograd's check)
  instead of reading the updated value.
* What the protocol cannot make exact after updates ran is refused by name: a second backward through
  an updated parameter, reading or clearing a gradient after its update, a forward before ``step()``,
  loss scaling.
* When updates ran during a backward (from the second step on; not when the gate stayed shut or a parameter
  still needed state: which holds follows from the program, never from the worker's timing), what changed
  after that backward began is refused by ``step()``, every time, naming it: a hyperparameter of a group or of
  the optimizer, compared with what it was when backward began (accel/changes.py, ``Snapshot``); a parameter
  updated during backward and edited after its update (``p.data`` written or assigned,
  ``model.load_state_dict``, an in-place op), compared with its mark (accel/changes.py): backward's last
  callback waits for the updates handed to the worker (``BackwardUpdater.settle``) and marks each, so the
  user's code between backward and ``step()`` cannot race with an update or its mark. After such a
  refusal, or one of a gradient cleared or assigned after its update (:meth:`DuringBackward.tear`), every step
  is refused until a ``load_state_dict`` restores a checkpoint: the updated parameters are one update ahead.
  When no update ran, ``step()`` runs them all with the values of now, exactly as torch's AdamW.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from torch import Tensor

from offload_adamw.accel.changes import DeviceFingerprints, Mark, Snapshot, changed, fingerprint, mark
from offload_adamw.accel.freed import is_host_resident
from offload_adamw.accel.gate import Gate, Settings
from offload_adamw.accel.overlap import Armed, BackwardUpdater, UpdateRecord
from offload_adamw.accel.slots import Holding, Slot, SlotTable
from offload_adamw.accel.sources import graph_task
from offload_adamw.accel.transfer import Completion, TransferEngine

__all__ = ["AtStep", "DuringBackward", "Early"]

Sent = list[tuple[torch.device, Completion]]


class Early:
    """What ran during backward: the parameters updated, their records and the copies they sent back."""

    __slots__ = ("params", "records", "sent")

    def __init__(self, params: set[Tensor] | None = None, records: list[UpdateRecord] | None = None,
                 sent: Sent | None = None) -> None:
        self.params = params or set()
        self.records = records or []
        self.sent = sent or []


class AtStep:
    """Every update runs in step()."""

    early = False

    def landed(self, slot: Slot) -> None:
        return None

    def check_second_backward(self, slot: Slot) -> None:
        return None

    def check_read(self, slot: Slot) -> None:
        return None

    def check_accumulate(self, slot: Slot) -> None:
        return None

    def check_zero(self, slot: Slot) -> None:
        return None

    def check_drop(self, slot: Slot) -> None:
        return None

    def refuse_mid_step(self, what: str) -> None:
        return None

    def refuse_loss_scaling(self) -> None:
        return None

    def backward_began(self) -> None:
        return None

    def before_load(self) -> None:
        return None

    def loaded(self) -> None:
        return None

    def before_step(self) -> Early:
        return Early()

    def check_step(self, where: dict[Tensor, tuple[int, int]], early: Early) -> None:
        return None

    def tear(self, message: str, ran: int) -> NoReturn:
        raise RuntimeError(message)

    def prepare(self, buckets: list[list[Tensor]]) -> None:
        return None

    def zero_grad(self) -> None:
        return None

    def armed(self) -> bool:
        return False

    def close(self) -> dict[Tensor, str]:
        return {}


class DuringBackward:
    """Bucket updates during backward (see the module contract)."""

    early = True

    def __init__(self, settings: Settings, slots: SlotTable, gate: Gate, armed: Armed, *,
                 groups: Callable[[], list[dict[str, Any]]], has_state: Callable[[Tensor], bool],
                 describe: Callable[[Slot], str],
                 run_early: Callable[[list[Tensor]], tuple[Sent, dict[str, float]]],
                 thread_init: Callable[[], None], intact: Callable[[Slot], bool] = lambda s: is_host_resident(s.param.grad),
                 engine: TransferEngine) -> None:
        self._settings = settings  # max_grad_norm and nonfinite as they are now
        self._groups = groups  # the optimizer's param_groups as they are now
        self._has_state = has_state
        self._armed = armed  # the updater of the coming backward, which the gate opens (accel/overlap.py)
        self._intact = intact  # p.grad is still the gradient backward's hook landed (a host stand-in, or on the device)
        self._slots = slots
        self._gate = gate
        self._describe = describe
        self._run_early = run_early
        self._thread_init = thread_init
        self._engine = engine  # which devices live apart from the host, and their streams' waits
        self._fingerprints = DeviceFingerprints()
        self._buckets: list[list[Tensor]] = []
        self._snapshot: Snapshot | None = None  # what the hyperparameters were when the latest backward began
        self._values: dict[Tensor, Tensor | None] = {}  # each updated parameter's fingerprint, as its update left it
        self._marks: dict[Tensor, Mark] = {}  # the parameters updated during backward, as backward left them
        # Updated during a backward whose step() has not run (kept through a refused step), by name: gradients spent.
        self._spent: dict[Tensor, str] = {}
        self._torn_why = ""  # why the step is refused until a load (empty: a backward raised after updates)
        self._unreached: set[Tensor] = set()  # trainable, without state at the last step: no backward reached them yet
        self._missing_state = False
        self._checked_task: int | None = None
        self._open = 0  # backwards whose hooks ran and whose end has not come: one that raised stays open
        self._torn = 0  # parameters updated during a backward that raised: the step is refused until a load
        _watch_forwards(self)

    # ------------------------------------------------------------ in backward

    def backward_began(self) -> None:
        """At the first hook of a backward: counted open until its end (a backward that raises never ends), and the
        hyperparameters as they are now, before any update of this backward, which step() compares."""
        self._open += 1
        updater = self._armed.updater
        if self._snapshot is None or updater is None or not updater.started():
            # Kept from the first backward of the step whose buckets started: a second backward (over other
            # parameters) must not make a change made after those updates look as old as the step.
            self._snapshot = Snapshot(self._groups(), self._settings)
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._open = max(0, self._open - 1)
        if torch._C._current_autograd_node() is None:  # not a backward nested in another one
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._settle(4))

    def _settle(self, tries: int) -> None:
        """After every callback of the ending backward (the gate's decision included, which may start the updates):
        wait for the updates handed to the worker and mark their parameters, once, an accelerator one's fingerprint
        after the copies back have landed, on the current stream (the caller's in final callbacks, where the user's
        edits follow). backward() has not returned yet, so no edit of the user's can come between an update and its mark."""
        if self._gate.deciding() and tries > 0:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._settle(tries - 1))
            return
        updater = self._armed.updater
        if updater is None or not updater.started():
            return
        updater.settle()
        fresh = [(p, slot) for p in list(self._values) if p not in self._marks and (slot := self._slots.get(p)) is not None]
        if any(self._engine.is_device(slot.local.device) for _, slot in fresh):
            for device, done in (s for result in updater.settled_results() for s in result):
                self._engine.compute_waits(device, done)
        on_device = [slot.local for _, slot in fresh if self._engine.is_device(slot.local.device)]
        taken = iter(self._fingerprints.take_all(on_device))  # the small ones of a device together
        for p, slot in fresh:
            device_values = next(taken) if self._engine.is_device(slot.local.device) else None
            self._marks[p] = mark(slot.local, self._values[p], device_values)

    def _failed_backward(self) -> None:
        """Before step(), zero_grad() or a load: a backward that raised. Nothing ran early: it is dropped as torch drops
        it (the gradients as it left them). Updates ran during it: the worker is waited for (nothing changes after this
        call), and the step is refused until a load_state_dict restores a checkpoint."""
        if self._open and not self._torn:
            updater = self._armed.updater
            if updater is not None and updater.started() and not updater.gated():
                self._torn = sum(1 for bucket in self._buckets for p in bucket if updater.covers(p))
            self._open = 0
            self._drop_updater()
        if self._torn and self._torn_why:
            raise RuntimeError(self._torn_why)
        if self._torn:
            raise RuntimeError(
                f"backward raised after the updates of {self._torn} parameter(s) had run during it "
                "(update_in_backward=True): they are one update ahead of the others, and the batch cannot be dropped "
                "exactly. Restore the last checkpoint (offload_adamw.checkpoint.load, or the model's weights and "
                "opt.load_state_dict), or train with update_in_backward=False if your loop skips batches whose backward "
                "fails (with max_grad_norm or nonfinite='skip'/'raise' no update starts before backward has ended, so "
                "such a batch is dropped exactly)"
            )

    def before_load(self) -> None:
        """Before a load_state_dict changes anything: refused mid-step, except after a backward that raised (loading a
        checkpoint is the way back from one after which updates had run)."""
        if self._open or self._torn:
            with contextlib.suppress(RuntimeError):
                self._failed_backward()  # waits for the worker; a torn step is what the load repairs
        if not self._torn:
            self.refuse_mid_step("load a state_dict")

    def loaded(self) -> None:
        """A load_state_dict was committed: whatever a failed backward or a refused step left is forgotten."""
        self._open = 0
        self._torn = 0
        self._torn_why = ""
        self._snapshot = None
        self._marks, self._values, self._spent = {}, {}, {}
        self._drop_updater()

    def landed(self, slot: Slot) -> None:
        """``slot``'s gradient is in host memory (or on its way): its bucket may start."""
        updater = self._armed.updater
        if updater is None:
            return
        if self._gate.gated() and not updater.gated() and not updater.started():
            # Made gated since the last step (max_grad_norm or a policy set): these updates cannot wait for the gate.
            self._drop_updater()
            return
        self._drop_if_state_missing(slot.param)
        if self._armed.updater is not None:
            self._armed.updater.landed(slot.param)
            # An early update runs in place: a use of the parameter still to come in this backward must fail
            # loudly (autograd's saved-tensor check), not read the updated value.
            torch.autograd.graph.increment_version(slot.param)
            if slot.sent_version is not None:
                slot.sent_version += 1  # ours, not an edit of the parameter

    def _drop_if_state_missing(self, landing: Tensor) -> None:
        """While no update has run: a parameter unfrozen since the last step (or ``landing``, reached for the first
        time) needs state, whose creation may fail, so this step's updates wait for step(), where every state is
        created before the first update. A trainable parameter no backward reached keeps nothing waiting until it is
        reached; if that happens after updates ran, its state is created at step()."""
        updater = self._armed.updater
        assert updater is not None
        if updater.started() and not updater.gated():
            return
        has_state = self._has_state
        task = graph_task()
        if task is None or task < 0 or task != self._checked_task:
            # Once per backward: nothing is unfrozen or given state while it runs (DDP's gloo thread has no task).
            self._checked_task = task
            self._missing_state = any(
                s.param.requires_grad and not has_state(s.param) and s.param not in self._unreached for s in self._slots
            )
        if not has_state(landing) or self._missing_state:
            self._drop_updater()

    def _drop_updater(self) -> None:
        if self._armed.updater is not None:
            self._armed.updater.close()
            self._armed.updater = None

    def check_second_backward(self, slot: Slot) -> None:
        if self._armed.updater is not None and self._armed.updater.covers(slot.param):
            raise RuntimeError(self._second_backward(slot))

    def _second_backward(self, slot: Slot) -> str:
        return (
            f"{self._describe(slot)}: a second backward reached this parameter after its update ran during the "
            "previous one (update_in_backward=True); accumulate micro-batches inside opt.no_sync() (FSDP2: "
            "model.set_requires_gradient_sync(False)) and call opt.step() after each backward that runs outside it"
        )

    def check_read(self, slot: Slot) -> None:
        self.check_second_backward(slot)  # FSDP2 accumulating into p.grad after its update ran
        if not self._gate.clipping_at_step:
            # The update may already have consumed this gradient during backward: clipping or unscaling it now
            # would change nothing the optimizer computes.
            raise RuntimeError(
                f"{self._describe(slot)}: with update_in_backward=True the host updates run during backward, so its "
                "gradient cannot be clipped, unscaled or read through p.grad afterwards; use update_in_backward=False "
                "for clipping or loss scaling"
            )

    def check_accumulate(self, slot: Slot) -> None:
        raise RuntimeError(
            f"{self._describe(slot)}: a second gradient was added into p.grad in this step (FSDP2 reduced another "
            "micro-batch into it, or zero_grad(set_to_none=False) left it in place), but with update_in_backward=True "
            "each parameter takes one gradient per step, during backward: run the micro-batches that only accumulate "
            "with model.set_requires_gradient_sync(False) inside opt.no_sync(), and clear gradients with "
            "zero_grad(set_to_none=True)"
        )

    def check_zero(self, slot: Slot) -> None:
        self.refuse_mid_step("zero its gradient")

    def check_drop(self, slot: Slot) -> None:
        """In backward that is the previous step's gradient, even after other parameters' early updates of this step
        ran; only a parameter whose own update already ran in this backward is refused (a second backward)."""
        self.check_second_backward(slot)

    def refuse_mid_step(self, what: str) -> None:
        """Raise when updates already ran during this backward and the optimizer is asked to ``what`` before step()."""
        if self._torn:
            self._failed_backward()
        updater = self._armed.updater
        if updater is not None and updater.started() and not updater.gated():
            raise RuntimeError(
                f"the optimizer cannot {what} now: with update_in_backward=True the last backward already updated "
                "some parameters, so opt.step() must come next (every backward outside opt.no_sync() is followed by "
                "step(); a backward that is not, such as one through another model's parameters, needs "
                "update_in_backward=False)"
            )

    def refuse_loss_scaling(self) -> None:
        raise RuntimeError(
            "update_in_backward=True cannot be combined with loss scaling: the updates run during backward, "
            "before GradScaler knows whether to skip the step; use bf16, or update_in_backward=False"
        )

    def refuse_forward(self, module: torch.nn.Module) -> None:
        """A forward after a backward whose updates ran, before step(): torch's optimizer has not changed the
        parameters yet, ours has (some of them). Raised, naming the module's first updated parameter."""
        updater = self._armed.updater
        if updater is None or not updater.started() or torch._C._current_autograd_node() is not None:
            return  # no update ran, or a recomputation inside backward (activation checkpointing)
        for p in module.parameters(recurse=False):
            if updater.covers(p):
                raise RuntimeError(
                    f"a forward of {type(module).__name__} reads {self._describe(self._slots[p])}, whose update already "
                    "ran during the last backward (update_in_backward=True): opt.step() must come next. Accumulate "
                    "micro-batches inside opt.no_sync(), run other forwards (a metric, an EMA) after opt.step(), or use "
                    "update_in_backward=False"
                )

    def armed(self) -> bool:
        """Whether the next backward's buckets are set (its updates may start during it)."""
        return self._armed.updater is not None

    # ------------------------------------------------------------------ the step

    def before_step(self) -> Early:
        """Wait for the updates that ran during backward (a gate that never opened: none ran, step() updates all)."""
        self._failed_backward()
        if self._armed.updater is not None and self._armed.updater.gated():
            self._drop_updater()
        updater, self._armed.updater = self._armed.updater, None
        snapshot, self._snapshot = self._snapshot, None
        if updater is None:
            self._marks, self._values = {}, {}
            return Early()  # every update runs in step(), with the values of now, as torch's
        _, records = updater.finish()
        marks, self._marks, self._values = self._marks, {}, {}
        sent = [s for r in records for s in r.result]  # what each update sent back, from records of ended updates
        early = {p for r in records for p in self._buckets[r.bucket]}
        self._refuse_changes(snapshot, marks, ran=len(early))
        return Early(early, records, sent)

    def _refuse_changes(self, snapshot: Snapshot | None, marks: dict[Tensor, Mark], ran: int) -> None:
        """Refuse the step, naming each, when updates ran during backward (``ran``: how many parameters) and a
        hyperparameter changed since backward began or a parameter updated during it was edited since. When none ran
        every update runs in step() with the values of now, exactly as torch's."""
        if not ran:
            return
        problems = [] if snapshot is None else snapshot.changes(self._groups(), self._settings)
        marked = [(slot, before) for p, before in marks.items() if (slot := self._slots.get(p)) is not None]
        for (slot, _), was_edited in zip(marked, changed([(s.local, b) for s, b in marked], self._fingerprints)):
            if was_edited:
                problems.append(f"{self._describe(slot)} was changed between backward and step() (written through "
                                "p.data, assigned, loaded or edited in place)")
        if not problems:
            return
        message = (
            "; ".join(problems) + ". With update_in_backward=True the updates of a step run from backward on, with "
            "the hyperparameters backward began with and on the parameters as backward left them: change "
            "hyperparameters (scheduler.step(), a step pre-hook) and edit parameters after optimizer.step() or before "
            "backward, or use update_in_backward=False"
        )
        self.tear(message, ran)

    def tear(self, message: str, ran: int) -> NoReturn:
        """Refuse this step, and every later one until a load restores a checkpoint: the updates of ``ran`` parameters
        ran during backward (a second step() would run them again, or leave them one update ahead)."""
        self._torn = ran
        self._torn_why = message + (
            f". The updates of {ran} parameter(s) already ran during backward and cannot be taken back: the optimizer "
            "refuses to step until a checkpoint is restored (offload_adamw.checkpoint.load, or the model's weights and "
            "opt.load_state_dict)")
        raise RuntimeError(self._torn_why)

    def check_step(self, where: dict[Tensor, tuple[int, int]], early: Early) -> None:
        """What the step may not meet after early updates (before any update of its own): refused, and torn."""
        describe = self._describe
        for p in early.params:
            if p not in where:
                continue
            if p.grad is None:
                self.tear(f"{describe(self._slots[p])}: its gradient was cleared between backward and step() "
                          "(model.zero_grad()), but with update_in_backward=True its update already ran during backward; "
                          "clear gradients after optimizer.step()", len(early.params))
            if not self._intact(self._slots[p]):
                self.tear(f"{describe(self._slots[p])} was given a gradient after backward, or its gradient was changed after "
                          "backward (clipped, unscaled: a streamed or resident group's gradient stays on the device), but "
                          "with update_in_backward=True its update already ran during backward; set gradients only "
                          "through backward, and clip with max_grad_norm", len(early.params))
        if early.params and self._settings.nonfinite != "propagate" and self._gate.checked_policy == "propagate":
            self.tear(f"nonfinite changed to {self._settings.nonfinite!r} between backward and step(), but with "
                      "update_in_backward=True updates already ran during backward without a non-finite check; set "
                      "nonfinite before the backward (the constructor's nonfinite=), or change it after optimizer.step()",
                      len(early.params))

    def prepare(self, buckets: list[list[Tensor]]) -> None:
        """The next step's early updates follow this step's buckets (the order of this backward), with only the
        parameters that had a gradient in this step, and so have state. A trainable parameter that no backward reached
        (an unused head) is in no bucket and keeps nothing waiting."""
        has_state = self._has_state
        self._spent = {}  # the step has run: its gradients are p.grad's as torch's step leaves them
        self._unreached = {s.param for s in self._slots if s.param.requires_grad and not has_state(s.param)}
        self._checked_task = None
        kept = [
            b for b in ([p for p in bucket if self._slots[p].holding is not Holding.NOTHING and has_state(p)]
                        for bucket in buckets)
            if b
        ]
        self._buckets = kept
        self._armed.updater = BackwardUpdater(kept, self._early_update, gated=self._gate.gated(), thread_init=self._thread_init)

    def _early_update(self, index: int) -> tuple[dict[str, float], Sent]:
        """A bucket's update on the worker thread, while backward goes on: its timings and the copies it sent back
        (which step() takes from the records finish() returns)."""
        bucket = self._buckets[index]
        sent, times = self._run_early(bucket)
        for p in bucket:  # the values as the update left them, taken while backward goes on; marked when it ends
            slot = self._slots.get(p)
            if slot is not None:
                self._spent[p] = self._describe(slot)
                # In host memory its fingerprint as the update left it; on an accelerator taken when backward ends (_settle).
                self._values[p] = None if self._engine.is_device(slot.local.device) else fingerprint(slot.local)
        return times, sent

    def zero_grad(self) -> None:
        """Buckets complete in the cleared backward, waiting for a coefficient, would run on the next one's."""
        self._failed_backward()
        self.refuse_mid_step("clear its gradients")
        self._snapshot = None  # a backward dropped without a step: the next one begins afresh
        self._marks, self._values, self._spent = {}, {}, {}
        if self._armed.updater is not None and self._armed.updater.gated() and self._armed.updater.started():
            self._drop_updater()

    def close(self) -> dict[Tensor, str]:
        """Drop the worker (waiting for it); the parameters (by name) updated during a backward whose step() has not
        run: their gradients were applied."""
        _WATCHED.discard(self)
        self._drop_updater()
        return dict(self._spent)


# Schedules with updates during backward, watched by one global forward pre-hook (registered with the first).
_WATCHED: weakref.WeakSet[DuringBackward] = weakref.WeakSet()
_FORWARD_HOOK: Any = None


def _watch_forwards(schedule: DuringBackward) -> None:
    global _FORWARD_HOOK
    _WATCHED.add(schedule)
    if _FORWARD_HOOK is None:
        _FORWARD_HOOK = torch.nn.modules.module.register_module_forward_pre_hook(_forward_guard)


def _forward_guard(module: torch.nn.Module, args: Sequence[Any]) -> None:
    if torch.compiler.is_compiling():
        return  # traced as a constant: compiled forwards keep their graphs (and go unchecked)
    for schedule in list(_WATCHED):
        schedule.refuse_forward(module)
