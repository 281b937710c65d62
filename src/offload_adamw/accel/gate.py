"""The clip coefficient and the non-finite decision of a step whose updates may start during backward.

Contract:

* With ``update_in_backward`` and ``max_grad_norm`` or a non-finite policy (skip or raise), no update
  may start before every gradient of the step is known: :meth:`Gate.take` records each gradient's norm
  and count of inf/NaN on its device as it lands (before a freed gradient leaves), and an autograd
  callback at the end of backward (after FSDP2's and DDP's own) reduces them as torch does
  (optim/policy.py, handed in at construction) and opens the gate, or leaves it shut for ``step()`` to clip, skip or raise
  before any update. The end-of-backward decision reads the device once per step, not once per
  parameter.
* The coefficient taken then is used only while it is the step's: every gradient the step updates is
  the one whose norm a hook took, with the ``max_grad_norm`` of now. Otherwise (accumulated over more
  than one backward, cleared or set by hand after backward, a nested reentrant backward, a changed
  ``max_grad_norm``) a step before which no update ran clips as ``torch.nn.utils.clip_grad_norm_``
  does (optim/policy.py's ``step_norm``, the one clipping of every step: :meth:`Gate.taken_norm` says None), and
  one after updates that used it is refused.
* Beside an attached DDP model, or with a plain parameter beside FSDP2's shards, the non-finite
  decision is OR-reduced over the ranks, so every rank decides alike.
* With ``update_in_backward`` the hooks take every gradient's norm, clipping or not, so that the step's
  total norm is known after the updates consumed the gradients: :meth:`Gate.taken_norm` gives the step
  the ``last_grad_norm`` it records (torch's ``get_total_norm`` over the model's parameter order,
  optim/clip_order.py) also without ``max_grad_norm``, from the norms the hooks took while they are the
  step's, else from the host gradients (the updates did not change them: nothing clipped them). This is
  what the HF Trainer logs as ``grad_norm`` (integrations/hf.py).
* Two components, chosen once where the pipeline is built: :class:`Gate` (updates during backward: the hooks take
  every norm and count) and :class:`StepGate` (every update at the step: nothing is taken in backward, the gate never
  opens, and the step clips and decides from the gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from offload_adamw.accel.slots import Slot, SlotTable, Source
from offload_adamw.accel.transfer import Completion, TransferEngine
from offload_adamw.distributed import local_tensor

__all__ = ["Gate", "Settings", "StepGate", "StepPolicy", "clip_inputs", "clipped_view"]

Norm = tuple[Tensor, torch.device, torch.dtype]


class StepPolicy(Protocol):
    """The step's clipping and non-finite decision, written once in optim/policy.py (which the optimizer hands in:
    accel/ does not import optim/)."""

    def gradient_norm(self, grad: Tensor, norm_type: float = 2.0) -> Tensor: ...

    def total_norm(self, norms: list[Norm], norm_type: float = 2.0) -> Tensor: ...

    def clip_coefficient(self, norms: list[Norm], max_norm: float, norm_type: float = 2.0) -> tuple[Tensor, Tensor]: ...

    def nonfinite_count(self, grad: Tensor) -> Tensor: ...

    def nonfinite_anywhere(self, counts: Sequence[Tensor], groups: Sequence[Any] = ()) -> bool: ...


class Settings(Protocol):
    """The optimizer's settings as they are now (optim/bucket.py's, read through a weak reference): what the gate and
    the schedule decide by. Read at each use, never kept: the user may change them between steps."""

    @property
    def max_grad_norm(self) -> float | None: ...

    @property
    def nonfinite(self) -> str: ...


class _Decision:
    """What the end of backward decided for a step's gated updates (see the module contract); what both gates share."""

    def __init__(
        self,
        settings: Settings,
        slots: SlotTable,
        engine: TransferEngine,
        *,
        order: Callable[[], list[Tensor]],
        describe: Callable[[Tensor], str],
        policy: StepPolicy,
        decision_groups: Callable[[], list[Any]],
        intact: Callable[[Slot], bool],
        on_open: Callable[[], None],
    ) -> None:
        self._settings = settings
        self._order_of_clipping = order  # the parameters in the model's order (optim/clip_order.py)
        self._policy = policy
        self._slots = slots
        self._engine = engine
        self._describe = describe
        self._on_open = on_open  # the end of backward lets the gated updates start (accel/overlap.py's Armed)
        self.decision_groups = decision_groups
        """The process groups whose ranks must take the same non-finite decision (attached DDP models')."""
        self.ddp_pending = False
        """DDP's final callback is still to come in this backward: the decision follows it."""
        self.clipping_at_step = False
        """The step's own clipping is reading the gradients (no update has run yet)."""
        self.intact = intact
        """Whether ``p.grad`` is still the gradient backward's hook landed (a host stand-in; a streamed or resident
        group's device gradient, unchanged: accel/device_grads.py)."""
        self.reset()

    def reset(self) -> None:
        """Outside backward (step(), zero_grad()): nothing pending, also when a backward raised before its end."""
        self._norms: dict[Tensor, tuple[Tensor, torch.device, torch.dtype]] = {}
        self._counts: dict[Tensor, Tensor] = {}
        self._marks: list[tuple[torch.device, Completion]] = []
        self._callback_queued = False
        self.coefficient: Tensor | None = None
        """The host clip coefficient every gradient of the step is multiplied by, when it is the step's."""
        self._on_device: tuple[Tensor, Tensor] | None = None  # (the host coefficient, the device tensor it was read from)
        self._stale = False
        self._partial = False
        self._max_norm: float | None = None
        self._total: Tensor | None = None  # the total norm that coefficient was taken from
        self._params: frozenset[Tensor] = frozenset()
        self.taken = False
        """The end of a backward let the updates start."""
        self.checked_policy = "propagate"
        self.ddp_pending = False

    # -------------------------------------------------------------- in backward

    def tracks(self) -> bool:
        """Whether backward's hooks take each gradient's norm (updates during backward, clipping or not)."""
        raise NotImplementedError

    def clips(self) -> bool:
        return self.tracks() and self._settings.max_grad_norm is not None

    def checks(self) -> bool:
        """Whether the non-finite policy (skip or raise) decides, at backward's end, if the updates may start."""
        return self.tracks() and self._settings.nonfinite != "propagate"

    def gated(self) -> bool:
        """Whether the updates of a step wait for the end of its backward (clipping, or a non-finite policy)."""
        return self.clips() or self.checks()

    def take(self, param: Tensor, grad: Tensor, *, accumulated: bool) -> None:
        """``param``'s gradient landed: its norm and count on its device, before it leaves (accumulated: added onto
        a gradient of an earlier backward, whose sum's norm is the host's to take)."""
        self._engine.host_gradient_landed(local_tensor(grad))  # FSDP2's CPUOffloadPolicy: its copy in may be pending
        if accumulated or self.taken or param in self._norms or param in self._counts:
            self._stale = True
        if self.tracks():
            self._norms[param] = (self._policy.gradient_norm(grad), grad.device, grad.dtype)
        if self.checks():
            self._counts[param] = self._policy.nonfinite_count(grad)
        if self._engine.is_device(grad.device):
            # Taken on the stream the hook runs on (FSDP2: its post-reduce stream); read on the callback's stream.
            self._marks.append((grad.device, self._engine.mark(grad.device)))

    def queue_decision(self) -> None:
        """Once per backward: decide when it has ended, after every callback queued during it (queued from a
        callback: FSDP2's final callbacks, one per root module, reduce the last groups)."""
        if self._callback_queued:
            return
        self._callback_queued = True
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._backward_ended))

    def deciding(self) -> bool:
        """Whether this backward's decision is still to come (its callback queued, or DDP's final callback first)."""
        return self._callback_queued or self.ddp_pending

    def incomplete(self) -> None:
        """A reduced DDP bucket took no norm (find_unused_parameters): the step clips and checks."""
        self._partial = True

    def _backward_ended(self) -> None:
        self._callback_queued = False
        if torch._C._current_autograd_node() is not None:
            # The end of a backward nested in another one (reentrant activation checkpointing): more gradients
            # come; the next hook queues this again on the outer backward (or step() clips, the gate still closed).
            return
        if self.ddp_pending:
            return  # DDP's final callback is still to come, and with it the norms of reduced buckets
        self.decide()

    def decide(self) -> None:
        """From what the hooks took in this backward: no non-finite gradient (a skip or raise policy) and the
        clip coefficient (clipping); then the gated updates may start. Otherwise the gate stays closed and
        step() does it all (the policy's skip or error, torch's clipping) before any update."""
        if self._stale or self._partial or self._unseen_gradient():
            self.coefficient = None
            return
        marks, self._marks = self._marks, []
        for device, mark in marks:
            self._engine.current_stream_waits(device, mark)
        if self.checks():
            if not self._counts or self._policy.nonfinite_anywhere(list(self._counts.values()), self.decision_groups()):
                return
            self.checked_policy = self._settings.nonfinite
        if self.clips():
            max_norm = self._settings.max_grad_norm
            if not self._norms or max_norm is None:
                self.coefficient = None  # step() clips the gradients it has (torch's clipping), the gate still closed
                return
            order = self._order()
            total, coef = self._policy.clip_coefficient([self._norms[p] for p in order if p in self._norms], max_norm)
            self._max_norm = max_norm
            self._params = frozenset(p for p in order if p in self._norms)
            self._total = total
            self.coefficient = coef.detach().to("cpu")  # with an accelerator: the one wait for the device in the step
            self._on_device = (self.coefficient, coef.detach())
        self.taken = True
        self._on_open()

    def coefficient_on(self, device: torch.device) -> Tensor | None:
        """The step's clip coefficient on ``device`` (None when there is none): on the device the norms were taken on,
        the tensor the host coefficient was read from, so that the gradients of streamed and resident groups are
        multiplied with no copy from the host (from pageable memory, a copy per gradient that blocks the host);
        elsewhere a copy of the host coefficient (the same value)."""
        host = self.coefficient
        if host is None:
            return None
        if self._on_device is not None and self._on_device[0] is host and self._on_device[1].device == device:
            return self._on_device[1]
        return host.to(device)

    def _order(self) -> list[Tensor]:
        """The parameters in the order torch's clipping of the model stacks their norms (optim/clip_order.py)."""
        return self._order_of_clipping()

    def _unseen_gradient(self) -> bool:
        """Whether a parameter has a gradient no hook of this backward took: accumulated only inside ``no_sync()``
        (a layer the last micro-batch does not reach) or set by hand. Its norm and count are not the hooks', so the
        step's clipping and policy, which read it, must come before any update."""
        return any(
            slot.source is not Source.DDP and slot.param.grad is not None and not self.intact(slot)
            for slot in self._slots
        )

    # ------------------------------------------------------------------ at step

    def taken_norm(self, present: Sequence[Tensor], early: bool) -> Tensor | None:
        """The step's total norm taken from backward's hooks while it is the step's (with ``max_grad_norm``: the one
        its coefficient was taken from, which then applies to every update), else None: the step's clipping
        (optim/policy.py's ``step_norm``) reads the gradients ``present`` now. Refused after updates ran (``early``)
        with a coefficient that is not the step's."""
        max_norm = self._settings.max_grad_norm
        reason = self._not_the_steps(present, max_norm)
        if reason is not None and early and (max_norm is not None or self.coefficient is not None):
            raise RuntimeError(
                f"{reason}, but with update_in_backward=True and max_grad_norm the updates that ran during backward "
                "used the clip coefficient taken when backward ended; set gradients only through backward, one backward "
                "per step (accumulate inside opt.no_sync()), and change max_grad_norm after opt.step()"
            )
        if max_norm is None:
            self.coefficient = None
            return self._norms_taken(self.in_order(present))
        if reason is None:
            return self._total  # the coefficient taken after backward applies to every update of the step
        self.coefficient = None
        return None

    def in_order(self, params: Sequence[Tensor]) -> list[Tensor]:
        """``params`` in the order clipping reduces their norms (the model's, optim/clip_order.py)."""
        rank = {p: k for k, p in enumerate(self._order())}
        return sorted(params, key=lambda p: rank.get(p, len(rank)))

    def _norms_taken(self, ordered: list[Tensor]) -> Tensor | None:
        """The step's total gradient norm from the norms the hooks took, while they are this step's gradients' (after
        waiting for the streams they were taken on); None when they are not (the policy then reads the gradients)."""
        if not ordered or self._reason_norms_are_not_the_steps(ordered) is not None:
            return None
        marks, self._marks = self._marks, []
        for device, mark in marks:
            self._engine.current_stream_waits(device, mark)
        return self._policy.total_norm([self._norms[p] for p in ordered])

    def _reason_norms_are_not_the_steps(self, present: Sequence[Tensor]) -> str | None:
        if self._stale or self._partial:
            return "a gradient was accumulated over more than one backward (or changed after its norm was taken)"
        for p in present:
            # intact: a host stand-in, or a streamed or resident group's device gradient unchanged since its landing
            if p not in self._norms or not self.intact(self._slots[p]):
                return f"{self._describe(p)} has a gradient that backward's hooks did not see"
        if len(self._norms) != len(present):
            return "a gradient was cleared after backward"
        return None

    def _not_the_steps(self, present: Sequence[Tensor], max_norm: float | None) -> str | None:
        """Why the coefficient taken after backward does not fit this step's gradients, or None when it does."""
        if self._stale:
            return "a gradient was accumulated over more than one backward (or changed after its norm was taken)"
        if self.coefficient is None:
            return None if max_norm is None else "no backward ended with every gradient's norm taken"
        if max_norm != self._max_norm:
            return f"max_grad_norm changed from {self._max_norm} to {max_norm} between backward and step()"
        for p in present:
            if not self.intact(self._slots[p]) or p not in self._params:
                return f"{self._describe(p)} has a gradient that backward's hooks did not see"
        gone = [p for p in self._params if p not in set(present)]
        if gone:
            return f"{self._describe(gone[0])}'s gradient was cleared after backward"
        return None


class Gate(_Decision):
    """The gate of updates during backward: the hooks take every gradient's norm (and count, with a policy)."""

    def tracks(self) -> bool:
        return True


class StepGate(_Decision):
    """Every update at the step: backward's hooks take nothing, and the step clips and decides from the gradients."""

    def tracks(self) -> bool:
        return False


def clipped_view(p: Tensor, grad: Tensor) -> Tensor:
    """What clipping reads for ``p`` whose complete gradient is ``grad``: its stand-in DTensor (FSDP2: the norm is
    reduced over the ranks), else ``grad`` itself (a host buffer, or a device gradient)."""
    return p.grad if local_tensor(p) is not p and p.grad is not None else grad


def clip_inputs(params: Sequence[Tensor], ready: Callable[[Tensor], Tensor | None]) -> list[Tensor]:
    """:func:`clipped_view` of each of ``params`` that has a complete gradient ``ready(p)``."""
    return [clipped_view(p, grad) for p in params if (grad := ready(p)) is not None]
