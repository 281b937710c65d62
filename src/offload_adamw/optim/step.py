"""The one step sequence of OffloadAdamW, over a transport that says where the gradients are.

Contract (docs/contract.md#what-each-input-does):

* :func:`run` is every ``step()``: refuse what the step cannot serve and wait for updates that ran during
  backward (``transport.begin``); GradScaler's skip (``found_inf``: nothing changes); check every gradient
  the step updates before anything changes (optim/update.py's ``check_gradient``, then what the transport's
  buffers need), so that an error names its parameter and leaves every tensor as it was; clip (or, where the
  norm is always taken, measure: ``last_grad_norm``) with optim/policy.py's ``step_norm``; apply the
  non-finite policy (optim/policy.py's ``nonfinite_decision``, ``skipped_steps`` counts a skip); create
  the missing state, all or none (``OffloadAdamW.preflight``); then the updates, bucket by bucket: the
  transport hands out each group's work (``transport.update``, a generator of accel/work.py's pieces), which
  optim/bucket.py's ``serve`` does with the optimizer's state before the transport goes on (sends the parameters
  back, runs the device kernel over the state given, settles).
* Two transports: :class:`PlainTransport` reads ``p.grad`` where it lies and hands out one host group at a time
  (a device parameter, an FSDP2 shard, through a host copy of its current value); the transfer pipeline's
  (accel/transport.py) holds gradients in host buffers and hands out buckets. Neither calls the optimizer. The
  sequence does not depend on which: a decision of the step is written here once.
* Clipping needs unscaled gradients: with ``max_grad_norm`` a GradScaler's ``grad_scale`` (``scaler.step``
  without ``scaler.unscale_``) is refused before anything changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from offload_adamw.accel.work import HostGroup, Work
from offload_adamw.contract.rules import PLACEMENT_KEY
from offload_adamw.distributed import dtensor as _distributed
from offload_adamw.optim import bucket as _bucket
from offload_adamw.optim import placement as _placement
from offload_adamw.optim import policy as _policy

if TYPE_CHECKING:
    from offload_adamw.optim.optimizer import OffloadAdamW

__all__ = ["PlainTransport", "Transport", "run"]

Place = tuple[int, int]


class Transport(Protocol):
    """Where a step's gradients are and how its updates run (accel/transport.py's ``StepTransport``, or
    :class:`PlainTransport`)."""

    def begin(self, found_inf: Any, called_by_scaler: bool) -> None: ...

    def gradients(self) -> list[tuple[Place, Tensor, Tensor]]: ...

    def check(self, p: Tensor, grad: Tensor) -> None: ...

    def check_step(self) -> None: ...

    def norm_inputs(self, max_norm: float | None, order: Callable[[], Sequence[Tensor]]
                    ) -> tuple[Tensor | None, Callable[[], list[Tensor]]] | None: ...

    def reading(self) -> contextlib.AbstractContextManager[None]: ...

    def complete(self) -> list[tuple[Place, Tensor, Tensor]]: ...

    def decision_groups(self) -> list[Any]: ...

    def skipped(self) -> None: ...

    def prepare(self) -> list[tuple[Place, Tensor]]: ...

    def update(self, grad_scale: Tensor | None) -> Generator[Work, None, None]: ...


def run(opt: OffloadAdamW, transport: Transport, grad_scale: Tensor | None, found_inf: Any, called_by_scaler: bool) -> None:
    """One step of ``opt`` over ``transport`` (see the module contract)."""
    transport.begin(found_inf, called_by_scaler)
    if opt.max_grad_norm is not None and grad_scale is not None:
        raise RuntimeError(
            "OffloadAdamW(max_grad_norm=...) clips unscaled gradients: call scaler.unscale_(opt) before scaler.step(opt)"
        )
    if isinstance(found_inf, Tensor) and bool(found_inf.item() != 0):
        return  # GradScaler's skip: no state, no parameter changes
    # Updates run one group or bucket after another: check every gradient first, so that an error names its
    # parameter before anything has changed. Each is checked once in a step.
    for (gi, i), p, grad in transport.gradients():
        opt.check_gradient(gi, i, grad)
        transport.check(p, grad)
    transport.check_step()
    # Clipping before the policy: a skipped step's last_grad_norm is its own (inf or NaN), not the previous step's.
    # The model's order is looked for only where the step takes a norm (optim/clip_order.py searches once).
    inputs = transport.norm_inputs(opt.max_grad_norm, opt.clip_parameters)
    if inputs is not None:
        taken, gradients = inputs
        with transport.reading():
            opt.last_grad_norm = _policy.step_norm(opt.max_grad_norm, gradients, taken)
    if opt.nonfinite != "propagate":
        if opt.skip_for_nonfinite([(gi, i, g) for (gi, i), _, g in transport.complete()], transport.decision_groups()):
            transport.skipped()
            return
    opt.preflight([place for place, p in transport.prepare() if not opt.state.get(p)])
    # Bucket by bucket: the transport goes on once each piece is done. closing(): an error in a piece ends the
    # transport's generator here (it settles what earlier buckets sent), not when reference counting drops it.
    with contextlib.closing(transport.update(grad_scale)) as works:
        for work in works:
            _bucket.serve(opt, work)


class PlainTransport:
    """The plain step's transport: every gradient is ``p.grad`` where it lies, and every group a host group."""

    def __init__(self, opt: OffloadAdamW) -> None:
        self._opt = opt
        self._present: list[tuple[Place, Tensor, Tensor]] = []

    def begin(self, found_inf: Any, called_by_scaler: bool) -> None:
        for gi, group in enumerate(self._opt.param_groups):  # a typo, or a group moved off the host between steps
            if _placement.group_placement(group, gi) != "host":
                raise RuntimeError(self._opt.needs_pipeline(gi, group[PLACEMENT_KEY]))
        # Nothing of the step assigns a gradient: those present now are the step's (clipping scales them in place).
        self._present = [((gi, i), p, p.grad) for gi, group in enumerate(self._opt.param_groups)
                         for i, p in enumerate(group["params"]) if p.grad is not None]

    def gradients(self) -> list[tuple[Place, Tensor, Tensor]]:
        return self._present

    def check(self, p: Tensor, grad: Tensor) -> None:
        return None

    def check_step(self) -> None:
        return None

    def norm_inputs(self, max_norm: float | None, order: Callable[[], Sequence[Tensor]]
                    ) -> tuple[Tensor | None, Callable[[], list[Tensor]]] | None:
        if max_norm is None:
            return None
        # In the model's parameter order, as torch's clip_grad_norm_(model.parameters()) (optim/clip_order.py).
        return None, lambda: [p.grad for p in order() if p.grad is not None]

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        yield

    def complete(self) -> list[tuple[Place, Tensor, Tensor]]:
        return [(place, p, _distributed.local_tensor(grad)) for place, p, grad in self.gradients()]

    def decision_groups(self) -> list[Any]:
        return []

    def skipped(self) -> None:
        return None

    def prepare(self) -> list[tuple[Place, Tensor]]:
        return [(place, p) for place, p, _ in self._present]

    def update(self, grad_scale: Tensor | None) -> Generator[Work, None, None]:
        opt, present, self._present = self._opt, self._present, []
        for gi in range(len(opt.param_groups)):
            updates: list[tuple[Tensor, Tensor, Tensor | None]] = []
            for (group_index, _), p, grad in present:
                if group_index != gi:
                    continue
                host_grad = _distributed.local_grad(grad, p)
                local = _distributed.local_tensor(p)
                # A parameter on a device (an FSDP2 shard on a GPU): its current value, whose edits since the
                # last step the update takes over (docs/contract.md#edits-between-steps), receives round(master).
                staging = local.detach().to("cpu") if local.device.type != "cpu" else None
                updates.append((p, host_grad if host_grad.device.type == "cpu" else host_grad.to("cpu"), staging))
            yield HostGroup(gi, updates, [staging is not None for _, _, staging in updates], None)
            for p, _, staging in updates:
                if staging is not None:
                    _distributed.local_tensor(p).copy_(staging)
