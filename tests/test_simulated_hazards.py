"""Issue 41's hazards N4, N5, N7, N8 and N9 on the simulated CUDA device (offload_adamw.testing.simulated_cuda).

Each test failed before its fix: it turns the hazard into wrong bits or a count or record of the simulated device
that a GPU would pay for silently (a poisoned read, a device-wide synchronisation, a context on device 0, a hidden
synchronisation). tests/test_simulated_mutations.py (``HAZARDS_N``) removes each fix again and names the test here that
catches it. The device index is 1 throughout: a call from a thread whose current device is 0 is a stray context.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter

import pytest
import torch

import configs
from configs import assert_bitwise_equal, same_bits
from offload_adamw import OffloadAdamW, OffloadGradScaler
from offload_adamw.accel import streams
from offload_adamw.accel.transfer import TransferEngine
from offload_adamw.testing.simulated_cuda import SimulatedCuda, simulated_cuda


def _fsdp2_cpu_offload(model: torch.nn.Module, sim: SimulatedCuda) -> list[torch.Tensor]:
    """A stand-in for FSDP2's ``CPUOffloadPolicy`` as torch before 2.12 runs it: each reduced gradient is copied into a
    page-locked host gradient without blocking, on the hook's stream, ``p.grad`` becomes that host tensor, and the
    post-accumulate-grad hooks (the optimizer's among them) run before the copy has landed (the host tensor is poisoned
    until then). Returns the list that keeps each copy's device source alive, as FSDP2 keeps its reduce-scatter output
    until its event. Register before the optimizer is built: the hooks run in registration order."""
    sources: list[torch.Tensor] = []

    def late_landing(p: torch.Tensor) -> None:
        assert p.grad is not None
        source = p.grad.detach().clone()  # the reduce-scatter's output, on the device
        sources.append(source)
        landing = sim.pinned_empty(source.numel(), source.dtype).view_as(source)
        sim.copy(landing, source, to_device=False)  # non-blocking, on the calling thread's current stream
        p.grad = landing

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(late_landing)
    return sources


def test_the_gate_reads_a_cpu_offloaded_gradient_only_after_fsdp2s_copy_landed_with_no_device_wide_sync() -> None:
    """N4 and N7: with FSDP2's CPUOffloadPolicy (host parameters, page-locked host gradients filled by a late copy),
    freed gradients, updates during backward and clipping, the hooks' norms and the non-finite counts are taken after
    the copy into the host gradient has landed (else they read poison: NaN norms, a skipped or wrong step), and the
    wait is an event on the hook's stream of the pipeline's device, not a synchronisation of the whole device."""
    with simulated_cuda(401, index=1, host_parameters=True) as sim:
        torch.manual_seed(0)
        reference = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        model = copy.deepcopy(reference)
        sources = _fsdp2_cpu_offload(model, sim)
        theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
        ours = OffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, offload_gradients=True,
                            update_in_backward=True, bucket_bytes=64 * 65 * 4, max_grad_norm=0.01)
        x = torch.randn(32, 64)
        for _ in range(3):  # the first step learns the buckets, the next ones update during backward
            for net, opt in ((reference, theirs), (model, ours)):
                net(x).square().mean().backward()
                if opt is theirs:
                    torch_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
                opt.step()
                opt.zero_grad()
        assert len(sources) == 3 * len(list(model.parameters())), "the stand-in's copies did not run"
        assert float(torch_norm) > 0.01, "the clipping must have acted"
        for p, q in zip(reference.parameters(), model.parameters()):
            assert_bitwise_equal(p.detach(), q.detach(), "parameter")
        assert ours.last_grad_norm is not None and same_bits(ours.last_grad_norm, torch_norm)
        assert sim.device_syncs == 0, "the wait for FSDP2's copy synchronised the whole device (N7)"
        assert sim.take_hazards() == []


def test_the_wait_for_a_cpu_offloaded_gradient_runs_on_the_pipelines_device_from_any_thread() -> None:
    """N9: the wait for FSDP2's copy into a page-locked host gradient is issued on the device current where the
    pipeline was built (rank 1's), also from a thread whose current device is 0 (a rank's thread that never set its
    device): no context on device 0 (torch.cuda.synchronize() synchronised the calling thread's current device)."""
    with simulated_cuda(402, index=1, host_parameters=True) as sim:
        engine = TransferEngine(sim)
        param = torch.zeros(4096)
        engine.claim(param)  # a host parameter beside device 1, on the thread that builds the pipeline
        source = torch.arange(4096, dtype=torch.float32)
        landing = sim.pinned_empty(4096, torch.float32)
        seen: list[bool] = []

        def hook_thread() -> None:  # its current device is 0
            sim.set_device(1)
            sim.copy(landing, source, to_device=False)  # FSDP2's copy, issued on device 1
            sim.set_device(0)
            engine.host_gradient_landed(landing)
            seen.append(torch.equal(landing, source))

        thread = threading.Thread(target=hook_thread)
        thread.start()
        thread.join()
        assert seen == [True], "the wait did not cover the copy into the host gradient"
        assert sim.take_hazards() == []
        assert sim.device_syncs == 0


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, with_b: bool) -> torch.Tensor:
        return self.b(self.a(x)) if with_b else self.a(x)


def test_the_resident_widening_buffer_is_ordered_between_the_updater_and_the_main_thread(simulated_device) -> None:
    """N8: the resident placement's widening buffer (a bf16 model over float32 masters) is used by the updater
    thread's stream during backward and by the main thread's stream in step(); each use waits for an event recorded
    after the previous one, else the main thread's kernel may overwrite the buffer while the updater's still reads it
    (a main thread on a non-default stream). In the third step ``b``'s gradient is set by hand (its bucket never
    completes during backward: its update runs in step(), on the main thread) while ``a``'s updates during backward."""
    sim = simulated_device
    torch.manual_seed(0)
    model = _TwoLayers().to(torch.bfloat16)
    opt = OffloadAdamW([{"params": list(model.a.parameters()), "update_on": "device"},
                        {"params": list(model.b.parameters()), "update_on": "device"}],
                       lr=1e-3, offload_gradients=True, update_in_backward=True, stream_chunk_bytes=1 << 20,
                       bucket_bytes=1)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with sim.watching():
        for step in range(4):
            if step == 1:
                buffers = opt._pipeline.placements._components["device"]._buffers  # type: ignore[union-attr]
                assert len(buffers) == 1, "the resident update did not widen through its buffer"
                for buffer in buffers.values():
                    sim.watch_buffer(buffer)
            if step == 2:
                for p in model.b.parameters():
                    p.grad = torch.full_like(p, 0.01)
            model(x, with_b=step != 2).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert sim.take_hazards() == []
    assert all(torch.isfinite(p).all() for p in model.parameters())


PLACEMENTS = {"host": ("host",), "stream": ("stream",), "device": ("device",), "mix": ("stream", "device", "host")}
#: the pipeline's modes of configs.MODES, by the short names tests/test_simulated_mutations.py cites in test ids
MODES = {"kept": "kept", "freed": "freed", "uib": "update_in_backward"}


def _steady_syncs(sim: SimulatedCuda, placement: str, mode: str, clip: float | None, *, steps: int = 2,
                  scaler: str = "none", nonfinite: str = "propagate") -> Counter:
    """The hidden synchronisations of ``steps`` steps after two warm-up steps (buffers, state, buckets in place);
    ``scaler``: none, or OffloadGradScaler's ``step`` alone or after ``unscale``."""
    torch.manual_seed(0)
    scaling = None if scaler == "none" else OffloadGradScaler("cpu", init_scale=2.0**12)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    pattern = PLACEMENTS[placement]
    groups = [{"params": list(layer.parameters()), "update_on": pattern[k % len(pattern)]}
              for k, layer in enumerate(model)]
    opt = OffloadAdamW(groups, **configs.MODES[MODES[mode]].kwargs(
        lr=1e-3, max_grad_norm=clip, stream_chunk_bytes=1 << 20, bucket_bytes=1, nonfinite=nonfinite))
    x = torch.randn(16, 32)
    for step in range(2 + steps):
        if step == 2:
            if scaling is not None:  # GradScaler("cpu")'s state: on the simulated device, the device's
                streams.claim(scaling._scale)  # type: ignore[arg-type]
                streams.claim(scaling._growth_tracker)  # type: ignore[arg-type]
            before = Counter(sim.hidden_syncs)
            context = sim.watching()
            context.__enter__()
        loss = model(x).square().mean()
        if scaling is None:
            loss.backward()
            opt.step()
        else:
            scaling.scale(loss).backward()
            if scaler == "unscale":
                scaling.unscale_(opt)
            scaling.step(opt)
            scaling.update()
        opt.zero_grad()
    context.__exit__(None, None, None)
    return Counter(sim.hidden_syncs) - before


@pytest.mark.parametrize("clip", [None, 0.05], ids=["noclip", "clip"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_steady_state_step_issues_no_hidden_synchronisation(placement, mode, clip, simulated_device) -> None:
    """N5: a step's scalars (step counts, the loss scale, the clip coefficient) reach the device without the host
    waiting: no copy from pageable host memory (``.to(device)``, a hidden synchronisation per bucket and group on
    CUDA, per parameter for the clip coefficient, and the streamed ring's prefetch lost)."""
    syncs = _steady_syncs(simulated_device, placement, mode, clip)
    assert syncs == Counter(), f"hidden synchronisations in two steady-state steps: {dict(syncs)}"


@pytest.mark.parametrize("scaler", ["step", "unscale"])
@pytest.mark.parametrize("mode", ["kept", "freed"])
@pytest.mark.parametrize("placement", ["stream", "device", "mix"])
def test_the_loss_scale_reaches_the_device_without_a_hidden_synchronisation(placement, mode, scaler,
                                                                             simulated_device) -> None:
    """N5: OffloadGradScaler's scale stays on the device for a streamed or resident group's fused kernel (``step``), and
    its unscale of the device gradients (``unscale``) copies nothing through the host. Inherent: beside host groups
    (``mix``) the host reads the scale where host kernels need it: step() once per step to divide the host gradients
    by it, and the unscale of freed host gradients once per call for its inverse (with ``step`` alone GradScaler's own
    non-finite check calls it: two reads per step; kept gradients are unscaled by torch on the device: none). And
    every placement reads GradScaler's found_inf once per step: step() decides on the host whether to skip."""
    syncs = _steady_syncs(simulated_device, placement, mode, None, scaler=scaler)
    reads = {("kept", "step"): 1, ("freed", "step"): 2, ("kept", "unscale"): 0, ("freed", "unscale"): 1}
    per_step = reads[mode, scaler] if placement == "mix" else 0
    expected = Counter({"a device tensor read by the host (.item())": 2})
    if per_step:
        expected["a device tensor read by the host (.to('cpu'))"] = 2 * per_step
    assert syncs == expected, f"hidden synchronisations in two steady-state steps: {dict(syncs)}"


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_non_finite_decision_of_updates_during_backward_reads_one_flag_per_step(placement, simulated_device) -> None:
    """N5, inherent: with updates during backward and a skip policy, backward's end reads one flag (the count of inf and
    NaN over every gradient) from the device per step, and nothing else is read or sent."""
    syncs = _steady_syncs(simulated_device, placement, "uib", 0.05, nonfinite="skip")
    assert syncs == Counter({"a device tensor read by the host (.item())": 2}), dict(syncs)


def test_the_ranks_flag_lives_on_the_ranks_own_device_not_the_threads_current_one():
    """N9, distributed/dtensor.py: any_rank's flag for an NCCL collective was made on ``"cuda"``, the calling thread's
    current device: 0 on a thread that never set one, so rank k created a context on GPU 0 (and handed NCCL a tensor
    of another GPU than its communicator's). It now lives on the rank's own device, its parameters' or gradients'.
    (The collective itself needs NCCL and GPUs; the choice of device is a pure function, tested here.)"""
    from offload_adamw.distributed.dtensor import flag_device

    assert flag_device("cuda", torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert flag_device("cuda", torch.device("cpu")) == torch.device("cuda")  # no CUDA device known: as before
    assert flag_device("cuda", None) == torch.device("cuda")
    assert flag_device("cpu", torch.device("cuda", 3)) == torch.device("cpu")  # a gloo mesh: the host


@pytest.mark.parametrize("placement", ["stream", "device"])
def test_clipped_device_gradients_are_multiplied_by_the_devices_own_coefficient(placement, simulated_device) -> None:
    """N5, clipping during backward: a streamed or resident group's gradient is multiplied by the coefficient the gate
    computed on the device, not by ``coefficient.to(device)`` of its host copy (from pageable memory: on CUDA a copy
    that blocks the host, once per parameter). The simulated device cannot see that copy (on the CPU the host copy
    and the device tensor are one, and the gate reads it in autograd's final callback, where no function mode runs),
    so this holds what the pipeline asks of the gate: every coefficient it took for a device gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    opt = OffloadAdamW([{"params": list(model.parameters()), "update_on": placement}], lr=1e-3, max_grad_norm=0.05,
                       stream_chunk_bytes=1 << 20, bucket_bytes=1, offload_gradients=True, update_in_backward=True)
    gate = opt._pipeline.gate
    taken: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    coefficient_on = gate.coefficient_on

    def recorded(device: torch.device) -> torch.Tensor | None:
        out = coefficient_on(device)
        taken.append((out, None if gate._on_device is None else gate._on_device[1]))
        return out

    opt._pipeline.placements._components[placement]._coefficient = recorded  # what the placement asks the gate
    x = torch.randn(16, 32)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    used = [(out, own) for out, own in taken if out is not None]
    assert used, "no gradient was clipped during backward"
    assert all(out is own for out, own in used), "a device gradient was clipped by a copy of the host coefficient"
