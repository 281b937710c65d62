"""The production stream lane (accel/transfer.py) on the simulated CUDA device (offload_adamw.testing.simulated_cuda).

The lane is the one a GPU runs: here it runs over the simulated backend, whose copies land late into poisoned
buffers and which records CUDA's hazards. Each test below holds one promise of the lane's contract to what the
simulated device does, so that removing any ``wait_stream``, ``wait_event``, ``record_stream``, event record,
the worker threads' device set-up or the synchronisation before unlocking host memory gives wrong bits or a
recorded hazard (tests/test_simulated_mutations.py removes each one). The device index is 1 throughout: a call from
a thread whose current device is 0 is a stray context. tests/test_simulated_suites.py runs the pipeline's bitwise
suites on the same device.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import torch

from offload_adamw.accel import streams
from offload_adamw.accel.host_memory import HostArena
from offload_adamw.accel.transfer import DONE, TransferEngine
from offload_adamw.testing.simulated_cuda import SimulatedCuda, simulated_cuda

DEV = torch.device("cpu")  # the simulated device keeps its tensors in host memory
TRIES = 20  # a race shows in at least one of this many tries (each copy draws a delay of up to 5 ms)


@pytest.fixture
def sim() -> Iterator[SimulatedCuda]:
    with simulated_cuda(3, index=1) as device:
        yield device


def _engine(sim: SimulatedCuda) -> TransferEngine:
    return TransferEngine(sim)


def _host(sim: SimulatedCuda, *shape: int) -> torch.Tensor:
    """Page-locked host memory of the simulated device (copies to and from it are asynchronous)."""
    return sim.pinned_empty(int(torch.Size(shape).numel()), torch.float32).view(shape).zero_()


def test_a_copy_lands_late_into_a_poisoned_buffer(sim) -> None:
    engine = _engine(sim)
    src = torch.arange(1000, dtype=torch.float32)
    dst = _host(sim, 1000)
    poisoned = []
    for _ in range(TRIES):  # at least one of twenty copies is still in flight right after it is issued
        done = engine.copy_to_host(src, dst)
        poisoned.append(bool(torch.isnan(dst).all()) and not done.done())
        done.wait()
        assert torch.equal(dst, src), "after its wait the destination holds the source"
    assert any(poisoned), "no copy was ever seen before it landed: the device is not asynchronous"
    assert sim.take_hazards() == [] and not sim.hidden_syncs


def test_work_on_one_stream_completes_in_order(sim) -> None:
    engine = _engine(sim)
    dst = [_host(sim, 10) for _ in range(30)]
    done = [engine.copy_to_host(torch.full((10,), float(i)), d) for i, d in enumerate(dst)]
    done[-1].wait()
    assert all(c.done() for c in done), "the last copy completed before an earlier one on the same stream"
    assert all(torch.equal(d, torch.full((10,), float(i))) for i, d in enumerate(dst))
    assert sim.take_hazards() == []


def test_a_copy_to_the_host_waits_for_the_compute_that_produced_its_source(sim) -> None:
    """copy_to_host's ``wait_stream``: the source is written late by the thread's compute stream."""
    engine = _engine(sim)
    for i in range(3):
        src = torch.zeros(256)
        dst = _host(sim, 256)
        sim.compute_later(lambda s=src, v=float(i + 1): s.fill_(v))
        engine.copy_to_host(src, dst).wait()
        assert torch.equal(dst, torch.full((256,), float(i + 1))), "the copy read its source before compute wrote it"
    assert sim.take_hazards() == []


def test_copies_of_an_update_to_the_host_wait_for_the_compute_that_wrote_them(sim) -> None:
    """copy_all_to_host's ``wait_stream``."""
    engine = _engine(sim)
    src = [torch.zeros(64) for _ in range(3)]
    dst = [_host(sim, 64) for _ in range(3)]
    sim.compute_later(lambda: [s.fill_(5.0) for s in src])
    engine.copy_all_to_host(DEV, list(zip(src, dst))).wait()
    assert all(torch.equal(d, torch.full((64,), 5.0)) for d in dst), "a copy read its source before compute wrote it"
    assert sim.take_hazards() == []


def test_a_copy_that_did_not_wait_for_the_producing_stream_is_a_hazard(sim) -> None:
    """The vector clocks: a copy to the host on a stream that never waited for the thread's current stream."""
    side = sim.new_stream(1)
    sim.current_stream(1)  # the thread issues work
    src = torch.ones(4)
    dst = _host(sim, 4)
    with sim.stream(side):
        sim.copy(dst, src, to_device=False)
    side.synchronize()
    hazards = sim.take_hazards()
    assert len(hazards) == 1 and "wait_stream" in hazards[0], hazards


def test_sends_wait_for_the_compute_that_still_reads_the_parameters(sim) -> None:
    """send_after_compute's ``wait_stream``: compute issued before the step still reads the old parameter."""
    engine = _engine(sim)
    for _ in range(3):
        p = torch.full((128,), 1.0)
        seen: list[torch.Tensor] = []
        sim.compute_later(lambda p=p, seen=seen: seen.append(p.clone()))
        engine.send_after_compute({DEV})
        new = _host(sim, 128).fill_(2.0)
        engine.send_to_device(DEV, [(p, new)]).wait()
        assert torch.equal(seen[0], torch.full((128,), 1.0)), "the send overwrote a parameter compute still read"
        assert torch.equal(p, new)
    assert sim.take_hazards() == []


def test_the_compute_stream_waits_for_a_send_before_reading_it(sim) -> None:
    """compute_waits' ``wait_event`` (and the send's event record): what compute reads next is what was sent."""
    engine = _engine(sim)
    for i in range(TRIES):
        device_tensor = torch.zeros(100)
        host = _host(sim, 100).fill_(float(i))
        sent = engine.send_to_device(DEV, [(device_tensor, host)])
        engine.compute_waits(DEV, sent)
        assert torch.equal(device_tensor, host), "compute read a parameter before its send landed"
        engine.current_stream_waits(DEV, sent)
    assert sim.take_hazards() == []


def test_a_copy_back_into_host_memory_a_send_still_reads_writes_it_only_when_its_stream_runs_it(sim) -> None:
    """The streamed ring's order: a chunk of host state is sent, the compute stream waits for it and updates it, and the
    copy back into the same host memory (ordered after that update) is issued at once, the send still in flight. On
    CUDA the copy back writes the host memory only when its stream runs it, after the send has read it: no hazard, and
    the host holds the updated chunk."""
    engine = _engine(sim)
    with sim.slow_copies(0.005):  # the send is still in flight when the copy back is issued
        for i in range(3):
            host = _host(sim, 512).fill_(float(i))
            device_tensor = torch.zeros(512)
            sent = engine.send_to_device(DEV, [(device_tensor, host)])
            engine.compute_waits(DEV, sent)  # the device waits, not the host (the test's thread defers its waits)
            sim.compute_later(lambda t=device_tensor: t.add_(1.0), delay_s=0.001, writes=[device_tensor])
            engine.copy_all_to_host(DEV, [(device_tensor, host)]).wait()
            assert torch.equal(host, torch.full((512,), float(i + 1))), "the copy back wrote the host before the send read it"
    assert sim.take_hazards() == []


def test_a_mark_completes_after_the_compute_issued_before_it(sim) -> None:
    """mark's event record on the current stream: waiting for it is waiting for that compute."""
    engine = _engine(sim)
    out = torch.zeros(8)
    sim.compute_later(lambda: out.fill_(3.0))
    mark = engine.mark(DEV)
    mark.wait()
    assert torch.equal(out, torch.full((8,), 3.0)), "a mark completed before the compute issued before it"


def test_a_send_into_a_buffer_waits_for_the_copy_that_still_reads_it(sim) -> None:
    """send_to_device's ``wait_event`` on ``after``: a ring buffer is refilled only once its copy out has read it."""
    engine = _engine(sim)
    for i in range(TRIES):
        buffer = torch.full((512,), float(i))
        out = _host(sim, 512)
        refill = _host(sim, 512).fill_(-5.0)
        copied = engine.copy_all_to_host(DEV, [(buffer, out)])
        engine.send_to_device(DEV, [(buffer, refill)], after=copied).wait()
        copied.wait()
        assert torch.equal(out, torch.full((512,), float(i))), "the copy out read the refilled buffer"
    assert sim.take_hazards() == []


@pytest.mark.parametrize("how", ["one", pytest.param("all", marks=pytest.mark.slow)])  # all: 10 s, in the slow tier
def test_a_temporary_source_is_kept_until_its_copy_has_read_it(sim, how) -> None:
    """copy_to_host's and copy_all_to_host's ``record_stream``: a source freed right after the copy is issued is not
    handed out again."""
    engine = _engine(sim)
    for i in range(TRIES):
        dst = _host(sim, 2048)
        if how == "one":
            done = engine.copy_to_host(torch.full((2048,), float(i)) * 1.0, dst)  # the source's last reference goes now
        else:
            done = engine.copy_all_to_host(DEV, [(torch.full((2048,), float(i)) * 1.0, dst)])
        gc.collect()
        done.wait()
        assert torch.equal(dst, torch.full((2048,), float(i))), "the copy read memory the allocator handed out again"
    assert sim.take_hazards() == []


def test_a_freed_source_without_record_stream_is_a_hazard(sim) -> None:
    found = False
    for _ in range(TRIES):
        side = sim.new_stream(1)
        side.wait_stream(sim.current_stream(1))
        dst = _host(sim, 2048)
        with sim.stream(side):
            sim.copy(dst, torch.ones(2048) * 1.0, to_device=False)  # no record_stream
        gc.collect()
        side.synchronize()
        found = found or any("record_stream" in h for h in sim.take_hazards())
    assert found, "freeing a source a pending copy still reads was never noticed"


def test_a_source_overwritten_before_its_copy_landed_is_a_hazard(sim) -> None:
    engine = _engine(sim)
    host = _host(sim, 100).fill_(1.0)
    device_tensor = torch.zeros(100)
    for _ in range(TRIES):
        sent = engine.send_to_device(DEV, [(device_tensor, host)])
        host.add_(1)  # the staging buffer written again before the copy out of it has ended
        sent.wait()
        if sim.hazards:
            break
    assert sim.take_hazards(), "overwriting a buffer a pending copy reads was never noticed"
    assert torch.isnan(device_tensor).all(), "the destination of a hazardous copy must keep its poison"


def test_a_copy_from_pageable_memory_is_synchronous_and_counted(sim) -> None:
    engine = _engine(sim)
    pageable = torch.ones(64)
    device_tensor = torch.zeros(64)
    sent = engine.send_to_device(DEV, [(device_tensor, pageable)])
    assert sent.done() and torch.equal(device_tensor, pageable), "a copy from pageable memory is synchronous"
    assert sim.hidden_syncs["copy from pageable host memory"] == 1
    assert sim.take_hazards() == []


def test_worker_threads_make_the_pipelines_device_current(sim) -> None:
    """The engine's thread_init: the accumulator's calls come from a thread whose current device is the pipeline's."""
    engine = _engine(sim)
    engine.claim(torch.zeros(1))  # the pipeline's device is known from its parameters
    src = torch.ones(32)
    dst = _host(sim, 32)
    landed = engine.copy_to_host(src, dst)
    engine.add_on_host(landed, _host(sim, 32), dst).wait()  # the accumulator thread waits for the copy's event
    engine.close()
    assert sim.take_hazards() == []
    stray: list[str] = []
    thread = threading.Thread(target=lambda: stray.append(str(sim.current_stream(1))))  # no thread_init
    thread.start()
    thread.join()
    assert any("stray context" in h for h in sim.take_hazards()), "a call from a thread on device 0 went unnoticed"


def test_page_locked_memory_is_unlocked_only_after_the_copies_that_touch_it(sim) -> None:
    """The arena's synchronisation before it unlocks its pages (accel/host_memory.py)."""
    engine = _engine(sim)
    # Slow copies: each is surely still in flight when its arena goes, so a missing wait is a hazard every run. One
    # direction per arena: a wait for the other direction's stream, as slow, would otherwise cover the missing one.
    with sim.slow_copies(0.02):
        for direction in ("to the host", "to the device"):
            arena = HostArena([("a", torch.Size([4096]), torch.float32, None),
                               ("b", torch.Size([4096]), torch.bfloat16, None)],
                              pin=True, label="test", locker=engine.page_locker(DEV))
            assert arena.pinned_bytes == 4096 * 6 and arena.rounded_bytes == 0, "exactly sized, page-locked"
            if direction == "to the host":
                engine.copy_to_host(torch.ones(4096), arena.views["a"])
            else:
                engine.send_to_device(DEV, [(torch.zeros(4096), arena.views["b"])])
            del arena
            gc.collect()
            assert sim.take_hazards() == [], f"unlocked while a copy {direction} was in flight"
    assert sim.take_hazards() == [] and not sim.hidden_syncs


def test_every_tensor_a_pipeline_serves_on_the_simulated_device_is_a_device_tensor() -> None:
    from offload_adamw import OffloadAdamW

    p = torch.nn.Parameter(torch.randn(4, 4))
    q = torch.nn.Parameter(torch.randn(4))
    with simulated_cuda(5, index=1) as sim:
        opt = OffloadAdamW([p], transfer_pipeline=True)
    plain = OffloadAdamW([q], transfer_pipeline=True)
    assert streams.is_device_tensor(p) and not streams.is_device_tensor(q)
    assert opt.transfer_pipeline is not None and opt.transfer_pipeline.engine.is_device(p.device)
    assert plain.transfer_pipeline is not None and not plain.transfer_pipeline.engine.is_device(q.device)
    p.grad = torch.ones_like(p)
    sim.set_device(1)  # the rank's device, current on its thread
    opt.step()
    sim.set_device(0)
    assert "master_param" in opt.state[p], "a float32 parameter on a device has a host master"
    assert streams.installed() is None, "the simulated device is installed only inside its context"
    assert sim.take_hazards() == []


@pytest.mark.parametrize("seed", [1, 2])
def test_an_early_read_gives_wrong_bits(seed: int) -> None:
    """The reason the simulated device exists: reading a host buffer without waiting for its copy reads poison."""
    with simulated_cuda(seed, index=1) as sim:
        engine = _engine(sim)
        src = torch.randn(4096)
        dst = _host(sim, 4096)
        wrong = 0
        for _ in range(TRIES):
            done = engine.copy_to_host(src, dst)
            early = dst.clone()  # no wait
            done.wait()
            wrong += int(not torch.equal(early, src))
        assert wrong > 0
        assert done is not DONE


def test_a_streamed_groups_host_state_is_page_locked_exactly_and_its_ring_never_stalls_the_host() -> None:
    """N6: the streamed placement's host state is page-locked by the device's backend, exactly sized (torch's pinned
    allocator rounds each tensor up to a power of two and keeps it), so every copy of the ring is asynchronous: no
    hidden synchronisation in a streamed step."""
    from offload_adamw import OffloadAdamW
    from offload_adamw.accel.host_memory import is_page_locked

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 70), torch.nn.Linear(70, 5))
    with simulated_cuda(7, index=1) as sim:
        opt = OffloadAdamW([{"params": list(model.parameters()), "update_on": "stream"}], lr=1e-2,
                           transfer_pipeline=True, stream_chunk_bytes=1 << 20)
        for step in range(3):
            model(torch.randn(4, 300, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
            opt.zero_grad()
        state = [v for p in model.parameters() for k, v in opt.state[p].items() if k != "step"]
        assert state and all(is_page_locked(v) for v in state), "a streamed group's host state is page-locked"
        exact = sum(-(-v.numel() * v.element_size() // 4096) * 4096 for v in state)
        locked = sum(sim._pinned.values())
        assert locked <= exact, f"{locked} bytes page-locked for {exact} bytes of state (whole pages)"
        assert not sim.hidden_syncs, f"a streamed step stalled the host: {dict(sim.hidden_syncs)}"
    assert sim.take_hazards() == []


def test_page_locked_memory_is_locked_and_unlocked_from_its_own_device_on_any_thread(sim) -> None:
    """N9: the arena's registration and its finalizer name their device: freed from a thread whose current device is 0
    (a finalizer runs wherever the last reference goes), no context is created there."""
    engine = _engine(sim)
    arena = HostArena([("a", torch.Size([1024]), torch.float32, None)], pin=True, label="test",
                      locker=engine.page_locker(DEV))
    assert arena.pinned_bytes == 1024 * 4
    engine.copy_to_host(torch.ones(1024), arena.views["a"]).wait()  # a lane exists: the finalizer waits on its streams
    holder = [arena]
    del arena
    thread = threading.Thread(target=lambda: (holder.clear(), gc.collect()))  # device 0 current: no thread set-up
    thread.start()
    thread.join()
    assert sim._pinned == {}, "the arena's pages were not unlocked"
    assert sim.take_hazards() == []


def _torch_twin(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    import copy

    twin = copy.deepcopy(model)
    return twin, torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)


def test_a_second_step_without_backward_waits_for_the_first_steps_sends_before_it_writes_staging(sim) -> None:
    """HostUpdate's ``slot.sending.wait()``: step() returns with its sends in flight (the compute stream waits for them,
    the host does not), and a second step() right after it, on the same freed gradients (torch allows it), writes the
    staging buffers those sends still read. Bitwise torch's fused AdamW, stepped twice the same way."""
    from offload_adamw import OffloadAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 8))
    twin, reference = _torch_twin(model)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, transfer_pipeline=True, offload_gradients=True, bucket_bytes=1)
    x = torch.randn(16, 64)
    model(x).square().mean().backward()
    twin(x).square().mean().backward()
    with sim.slow_copies(0.02):
        for _ in range(3):
            opt.step()  # no backward in between: the same host gradients, the sends of the step before still in flight
            reference.step()
    for ours, theirs in zip(model.parameters(), twin.parameters()):
        assert torch.equal(ours, theirs), "a staging buffer was written while its send to the device still read it"
    assert sim.take_hazards() == []


def test_a_reduced_bucket_replaces_a_host_gradient_only_once_the_add_queued_into_it_has_ended(sim) -> None:
    """FreedGradients.land_reduced's ``slot.complete()``: DDP's reduced slice replaces the host gradient; an add still
    queued into that buffer (a tensor added into ``p.grad``'s stand-in, as FSDP2's accumulation or compiled autograd
    adds) must have ended before the copy of the slice is issued, or the accumulator thread's add and the copy write
    the buffer at once. Component level: no DDP configuration the library accepts queues such an add before a reduced
    bucket lands (accumulation under DDP happens on the device), but the residency's contract does not rely on it."""
    from offload_adamw import OffloadAdamW

    p = torch.nn.Parameter(torch.randn(4096))
    with sim.late_kernels(0.0):  # the accumulator thread in stream order: its writes into a pending copy are hazards
        opt = OffloadAdamW([p], offload_gradients=True, transfer_pipeline=True)
        pipeline = opt.transfer_pipeline
        assert pipeline is not None
        for _ in range(2):  # the first step page-locks the accumulation buffer: copies into it are asynchronous after
            (p * 2.0).sum().backward()  # the gradient (2.0) in host memory, p.grad its stand-in
            p.grad.add_(torch.ones(4096))
            opt.step()
            opt.zero_grad()
        (p * 2.0).sum().backward()
        with sim.slow_copies(0.02):
            p.grad.add_(torch.ones(4096))  # the addend's copy to the host, then the accumulator's add, both queued
            pipeline.residency.land_reduced(pipeline.slots[p], torch.full((4096,), 5.0))
        assert torch.equal(opt.gradient(p), torch.full((4096,), 5.0))
    assert sim.take_hazards() == []
