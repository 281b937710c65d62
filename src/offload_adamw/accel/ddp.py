"""DistributedDataParallel and the transfer pipeline: the host receives the reduced gradient.

Contract:

* DDP reduces gradients in buckets after the parameters' post-accumulate-grad hooks have run, so
  a hook sees the local gradient, never the reduced one. :func:`attach` therefore takes DDP's
  parameters away from those hooks and registers a DDP communication hook instead: torch's own
  ``allreduce_hook`` (DDP's documented equivalent of its built-in reduction), with the copy of the
  bucket's reduced gradients to the host chained on the all-reduce's future. That is the gradient
  DDP then writes into ``p.grad``, with bucket views or without, whatever NCCL does to version
  counters: nothing relies on them to notice the reduction.
* After DDP has finished the backward (its own final callback, which writes ``p.grad``), the
  pipeline's callback (queued behind it) records what ``p.grad`` now is: with kept gradients the
  host copy is current until something edits ``p.grad`` in place (clipping, unscaling: ops that
  move the version counter); with freed gradients ``p.grad`` becomes the storage-less stand-in of
  accel/freed.py. Parameters DDP found unused keep no gradient, as with torch.
* With ``update_in_backward`` the pipeline's ``reduced`` callback is where the bucket's parameters
  land (their early update reads the host copies; with clipping, their norms are taken from the
  reduced gradients there). It runs on the thread that completes the all-reduce's future (a gloo
  worker thread; with NCCL, whose future completes when the collective is enqueued, backward's own,
  with the current stream ordered after the all-reduce), so it only issues copies and never waits.
* :func:`unattached_ddp` finds a DDP model over the optimizer's parameters that was not attached
  (searched once, when a process group is initialised): with freed gradients the pipeline refuses
  it before the first update; with kept gradients it re-fetches every gradient at the step.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["AttachedModels", "attach", "ddp_parameters", "unattached_ddp", "unwrap"]


class AttachedModels:
    """The attached DDP models, held weakly: built before the gate, whose non-finite decision is OR-reduced over their
    process groups, and the DDP source that attaches them."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[Any]] = []

    def add(self, ddp: Any) -> None:
        self._refs.append(weakref.ref(ddp))

    def models(self) -> list[Any]:
        return [m for m in (r() for r in self._refs) if m is not None]

    def process_groups(self) -> list[Any]:
        """The process groups of the attached DDP models: beside one, a parameter outside it has this rank's own
        gradient, so a non-finite decision must be OR-reduced over the replicas (DDP's own gradients agree)."""
        groups: list[Any] = []
        for model in self.models():
            if model.process_group not in groups:
                groups.append(model.process_group)
        return groups


def unwrap(model: Any) -> Any:
    """A model without torch.compile's wrapper (``_orig_mod``)."""
    while hasattr(model, "_orig_mod"):
        model = model._orig_mod
    return model


def is_ddp(model: Any) -> bool:
    # type(), not isinstance(): isinstance() reads __class__, which a dead weakref.proxy (gc.get_objects() finds
    # them) answers with ReferenceError.
    return issubclass(type(model), torch.nn.parallel.DistributedDataParallel)


def ddp_parameters(ddp: Any) -> list[Tensor]:
    """The parameters DDP reduces (those it was not told to ignore)."""
    params = getattr(ddp, "_module_parameters", None)
    if params is None:
        ignored = set(getattr(ddp, "parameters_to_ignore", ()))
        params = [p for n, p in ddp.module.named_parameters() if n not in ignored]
    return [p for p in params if p.requires_grad]


class _HookState:
    """What the communication hook needs: the process group and the receiver of reduced buckets."""

    def __init__(
        self, process_group: Any, launched: Callable[[list[Tensor]], None], reduced: Callable[[list[Tensor], Tensor], None]
    ) -> None:
        self.process_group = process_group
        self.launched = launched
        self.reduced = reduced


def _comm_hook(state, bucket):  # no annotations: DDP checks them against dist.GradBucket, and they are strings here
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    params = list(bucket.parameters())
    state.launched(params)
    future = default_hooks.allreduce_hook(state.process_group, bucket)

    def copy_to_host(fut: torch.futures.Future[Tensor]) -> Tensor:
        reduced = fut.value()
        state.reduced(params, reduced)
        return reduced

    return future.then(copy_to_host)


def attach(ddp: Any, launched: Callable[[list[Tensor]], None], reduced: Callable[[list[Tensor], Tensor], None]) -> None:
    """Register the communication hook on ``ddp`` (DDP allows one; a model with another hook is refused by DDP)."""
    ddp.register_comm_hook(_HookState(ddp.process_group, launched, reduced), _comm_hook)


def bucket_views(params: list[Tensor], reduced: Tensor) -> Iterable[tuple[Tensor, Tensor]]:
    """(parameter, its slice of the reduced flat bucket): DDP lays a bucket out densely, in parameter order."""
    offset = 0
    for p in params:
        n = p.numel()
        yield p, reduced[offset : offset + n].view_as(p)
        offset += n
    if offset != reduced.numel():
        raise RuntimeError(f"DDP bucket of {reduced.numel()} elements does not hold its {offset} gradient elements densely")


def unattached_ddp(params: set[Tensor], attached: list[Any]) -> Any | None:
    """A live DDP model that reduces some of ``params`` and was not attached, or None (only with a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    for obj in gc.get_objects():
        if is_ddp(obj) and not any(obj is a for a in attached):
            if any(p in params for p in ddp_parameters(obj)):
                return obj
    return None
