"""The transfer pipeline's components one by one, and the properties the split was made for.

Bucketing is a pure function (a hypothesis law); kept gradients are copied once per step; an add into a freed
``p.grad`` (FSDP2's reduce per micro-batch) goes through the asynchronous copy and the accumulator; every worker
thread runs the engine's thread set-up first (on CUDA: the pipeline's device, never device 0); the end-of-backward
non-finite decision reads the device once; the hook does O(1) work after a backward's first; a dropped optimizer
takes its hooks with it, and nothing is left on the parameters (``torch.save(model)``, ``deepcopy``).
"""

from __future__ import annotations

import copy
import gc
import io
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from _parity import same_bits
from offload_adamw import OffloadAdamW
from offload_adamw.accel import bucketing, streams
from offload_adamw.accel.overlap import BackwardUpdater
from offload_adamw.accel.sources import AutogradHooks
from offload_adamw.accel.transfer import DONE, TransferEngine

# --------------------------------------------------------------------------------- bucketing


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(st.tuples(st.integers(0, 100), st.one_of(st.none(), st.integers(0, 3))), max_size=30),
    bucket_bytes=st.integers(1, 200),
)
def test_buckets_keep_the_order_and_each_group_whole(items, bucket_bytes) -> None:
    order = [(i, size, group) for i, (size, group) in enumerate(items)]
    buckets = bucketing.cut(order, bucket_bytes)
    assert [k for b in buckets for k in b] == [k for k, _, _ in order], "every parameter once, in order"
    assert all(buckets), "no empty bucket"
    where = {k: n for n, b in enumerate(buckets) for k in b}
    for (a, _, ga), (b, _, gb) in zip(order, order[1:]):
        if ga is not None and ga == gb:
            assert where[a] == where[b], "consecutive members of one group share a bucket"
        if ga != gb:
            assert where[a] != where[b], "a group starts a bucket of its own"
    sizes = {k: s for k, s, _ in order}
    for b in buckets[:-1]:
        groups = {g for k, _, g in order if k in set(b)}
        if groups == {None} and where[b[-1]] + 1 < len(buckets):
            nxt = buckets[where[b[-1]] + 1]
            if {g for k, _, g in order if k in set(nxt)} == {None}:
                assert sum(sizes[k] for k in b) >= bucket_bytes, "an ungrouped bucket is cut only once it is full"


def test_bucketing_refuses_a_size_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        bucketing.cut([], 0)


# ----------------------------------------------------------------- kept gradients: one copy each


class _CountingEngine(TransferEngine):
    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def copy_to_host(self, src, dst):
        self.copies += 1
        return super().copy_to_host(src, dst)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("bucket_bytes", [64, 32 << 20], ids=["many_buckets", "one_bucket"])
def test_kept_gradients_are_copied_once_per_step(bucket_bytes) -> None:
    model, ref = _model(), _model()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, transfer_pipeline=True, bucket_bytes=bucket_bytes)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    engine = _CountingEngine()
    opt.transfer_pipeline.engine = engine  # the same calls, counted
    for component in (opt.transfer_pipeline.residency.host, opt.transfer_pipeline.slots):  # host groups' residency
        component._engine = engine
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            o.step()
            o.zero_grad()
    assert engine.copies == 3 * len(list(model.parameters())), "each kept gradient is copied exactly once a step"
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), ref.parameters()))


# ------------------------------------------------------------- an add into a freed p.grad is asynchronous


def test_an_add_into_a_freed_gradient_is_bitwise_and_goes_through_the_accumulator(simulated_device) -> None:
    p = nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    opt = OffloadAdamW([p], transfer_pipeline=True, offload_gradients=True)
    (p.float() * torch.randn(64)).sum().backward()
    first = opt.gradient(p).clone()
    addend = torch.randn(64, dtype=torch.bfloat16)
    pipeline = opt.transfer_pipeline
    slot = pipeline.slots[p]
    p.grad.add_(addend)  # what FSDP2 does with each reduced micro-batch
    assert slot.adding is not DONE, "the add was not handed to the accumulator"
    assert same_bits(opt.gradient(p), first + addend), "old + new, rounded once to the gradient's dtype"


# ------------------------------------------------------------------------ worker threads


def test_every_worker_thread_runs_the_engines_thread_set_up() -> None:
    seen: list[str] = []

    def init() -> None:
        seen.append(threading.current_thread().name)

    updater = BackwardUpdater([["a"]], lambda index: None, gated=False, thread_init=init)
    updater.landed("a")
    updater.finish()
    engine = TransferEngine()
    engine.thread_init = init  # type: ignore[method-assign]
    engine.accumulator._thread_init = init
    dst = torch.zeros(3)
    engine.add_on_host(DONE, dst, torch.ones(3)).wait()
    engine.close()
    assert any("update" in name for name in seen) and any("accumulate" in name for name in seen), seen


# ---------------------------------------------------- one read of the device for the non-finite decision


class _Reads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_the_end_of_backward_decision_reads_the_device_once() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)])
    opt = OffloadAdamW(model.parameters(), offload_gradients=True, update_in_backward=True, nonfinite="skip",
                       bucket_bytes=1)
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    reads = _Reads()
    with reads:
        model(torch.randn(2, 8)).sum().backward()
    assert opt.transfer_pipeline.gate_taken(), "the decision let the updates start"
    assert reads.reads == 1, f"{reads.reads} reads of the device for 24 gradients' non-finite counts"
    opt.step()


# --------------------------------------------------------------------------- the hook's work


def test_the_hook_checks_for_unfrozen_parameters_once_per_backward(monkeypatch) -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    for layer in list(model)[:5]:
        layer.requires_grad_(False)
    opt = OffloadAdamW(model.parameters(), offload_gradients=True, update_in_backward=True)
    calls = []
    original = AutogradHooks.hook_trainable

    def counted(self) -> None:
        if torch._C._current_graph_task_id() >= 0:  # inside a backward
            calls.append(1)
        original(self)

    monkeypatch.setattr(AutogradHooks, "hook_trainable", counted)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert len(calls) == 3, f"hook_trainable ran {len(calls)} times in 3 backwards of 10 gradients"


# ------------------------------------------------------------- nothing left behind on the parameters


def _hooks_on(p: nn.Parameter) -> int:
    return len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {})


@pytest.mark.parametrize(("freed", "early"), [(False, False), (True, False), (True, True)],
                         ids=["kept", "freed", "update_in_backward"])
def test_a_dropped_optimizer_takes_its_hooks_with_it(freed, early) -> None:
    model = _model()
    gc.disable()  # no collector: the optimizer must go when its last reference does
    try:
        for _ in range(20):
            opt = OffloadAdamW(model.parameters(), transfer_pipeline=True, offload_gradients=freed,
                               update_in_backward=early)
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            del opt
        assert all(_hooks_on(p) == 0 for p in model.parameters()), [_hooks_on(p) for p in model.parameters()]
    finally:
        gc.enable()


def test_a_model_saves_and_copies_after_a_pipelined_optimizer_existed() -> None:
    model = _model()
    opt = OffloadAdamW(model.parameters(), offload_gradients=True)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    buffer = io.BytesIO()
    torch.save(model, buffer)  # a weakref stored on a parameter made this fail
    twin = copy.deepcopy(model)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert not any(k.startswith("_offload") for p in model.parameters() for k in vars(p))


def test_the_simulated_device_serves_parameters_as_device_tensors_only_inside_its_engine() -> None:
    from offload_adamw.testing.simulated_cuda import simulated_cuda

    p = nn.Parameter(torch.randn(3))
    with simulated_cuda(9, index=1):
        OffloadAdamW([p], transfer_pipeline=True)
    q = nn.Parameter(torch.randn(3))
    OffloadAdamW([q], transfer_pipeline=True)
    assert streams.is_device_tensor(p) and not streams.is_device_tensor(q)
