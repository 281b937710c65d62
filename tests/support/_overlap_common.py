"""What the DDP and the FSDP2 overlap workers (``_overlap_ddp_worker.py``, ``_overlap_fsdp_worker.py``) check alike.

Both train the wrapped model with OffloadAdamW and the same wrapped model with ``torch.optim.AdamW(fused=True)`` on
2 gloo ranks and compare them bit for bit; both drop an optimizer between a backward and its step and check what
comes back in ``p.grad``. The wrappers differ in what a parameter is (a tensor, or a DTensor whose local shard is
compared) and in how the optimizer learns the model (``opt.attach(ddp)``, or nothing for FSDP2): the callers pass
those in, the checks are written here once.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from configs import same_bits
from offload_adamw import OffloadAdamW


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def assert_same(reference: nn.Module, theirs: torch.optim.Optimizer, model: nn.Module, ours: OffloadAdamW,
                wrapper: str) -> None:
    """Every parameter (its local shard) and second moment of ``model`` under ``ours`` bitwise those of ``reference``
    under ``theirs``; the message names the first six that differ."""
    differing = []
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        a, b = local(p.detach()), local(q.detach())
        if not same_bits(a, b):
            differing.append(f"{name}: max |diff| {(a - b).abs().max().item():.3g}")
        sa, sb = theirs.state[p].get("exp_avg_sq"), ours.state[q].get("exp_avg_sq")
        if (sa is None) != (sb is None) or (sa is not None and not same_bits(local(sa), local(sb))):
            differing.append(f"{name} exp_avg_sq")
    assert not differing, f"not bitwise {wrapper} + torch.optim.AdamW(fused=True): " + "; ".join(differing[:6])


def check_given_back(make_model: Callable[[], nn.Module], batch: Callable[[int, int, int], torch.Tensor],
                     attach: bool, update_in_backward: bool, measured: dict, *, lr: float, weight_decay: float) -> None:
    """An optimizer dropped between the third backward and its step(): freed gradients come back as real tensors
    (under FSDP2 DTensors over real local shards, with the stand-in's placements) equal to the reference's, and a
    fresh torch AdamW steps with them as with the reference's; with updates during backward the gradients those
    updates applied are not given back (p.grad None, a warning), the parameters being the reference's after its
    third step. ``attach``: the optimizer is attached to the model (DDP)."""
    rank = dist.get_rank()
    reference, model = make_model(), make_model()
    theirs = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    ours = OffloadAdamW(model.parameters(), lr=lr, weight_decay=weight_decay, offload_gradients=True,
                        update_in_backward=update_in_backward)
    if attach:
        ours.attach(model)
    for m, o in ((reference, theirs), (model, ours)):
        for step in range(3):
            m(batch(step, 0, rank)).square().mean().backward()
            if step < 2:
                o.step()
                o.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del ours, o
        gc.collect()
    said = [str(w.message) for w in caught if "not given back" in str(w.message)]
    grads = [p.grad for p in model.parameters()]
    measured.update(none=sum(g is None for g in grads), grads=len(grads), warned=len(said),
                    types=sorted({type(g).__name__ for g in grads if g is not None}))
    if update_in_backward:
        theirs.step()
        assert all(g is None for g in grads) and len(said) == 1, measured
    else:
        assert not said and [g is None for g in grads] == [q.grad is None for q in reference.parameters()], measured
        for p, q in zip(model.parameters(), reference.parameters()):
            same = p.grad is None or torch.equal(local(p.grad), local(q.grad))
            assert type(p.grad) is type(q.grad) and same, "a gradient given back differs"
        for m in (model, reference):
            torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=weight_decay, fused=True).step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(local(p.detach()), local(q.detach())), "not the reference's parameters"
