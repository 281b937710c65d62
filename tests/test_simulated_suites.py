"""The pipeline's bitwise suites again, with the production stream lane on the simulated CUDA device
(offload_adamw.testing.simulated_cuda).

On the CPU every copy is complete when issued, so the order of work is right by accident; here the lane a GPU runs
issues its copies on simulated streams, where they land late into poisoned buffers after seeded random delays, every
parameter is a device parameter (staging buffers, copies back, host masters), and every hazard the device records (a
missing wait, memory reused or unlocked under a copy, a stray context) fails the test. The same configurations as the
suites they come from must give the same bits: single device with kept and freed gradients, accumulation 1 and 4,
clipping, fp16 loss scaling (the parity table of tests/test_offload_parity.py, with small buckets so that a kept
gradient's copy of the next bucket is in flight while a bucket updates), updates during backward with and without
clipping (tests/test_update_in_backward.py), zero_grad (tests/test_optim_info.py), accumulation in host memory
(tests/test_offload.py), and DDP and FSDP2 on 2 gloo ranks (the workers of tests/test_overlap_ddp.py and
tests/test_overlap_fsdp.py, rank r on device index r), and the placements of tests/test_placement.py (streamed and
resident groups, alone and beside host groups, the ring over tensors of many chunks with 2 and 3 buffers, updates
during backward). The in-process rows run on device index 1. Each row has its own seed. The last tests make compute
late where it is on a GPU: a gradient that lands late on the backward thread's stream (a hook poisons it and restores
it there), and the updater thread's kernels queued late on its own stream (``late_kernels``), so that an update
during backward must wait for the stream that produced its gradient, and the next forward for the stream that wrote
the parameters. tests/test_simulated_mutations.py shows that removing any one wait of the pipeline or of the lane
fails one of these or a test of tests/test_simulated_lane.py.
"""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configs import assert_bitwise_equal
from offload_adamw import OffloadAdamW

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import test_offload  # noqa: E402
import test_offload_parity  # noqa: E402
import test_optim_info  # noqa: E402
import test_placement  # noqa: E402
import test_update_in_backward  # noqa: E402

PARITY = [(case, seed) for seed, case in enumerate(test_offload_parity.CASES, start=11)]
#: the quick tier's rows (the others run under -m slow): float32, kept without clipping at accumulation 1 and freed with
#: clipping at accumulation 4 (the stand-in mutations use seeds 11 and 12), and the placements' first row (seed 81). The
#: rows with GradScaler's unscale (seeds 14, 15: 26 and 29 s on 2 loaded cores) run in the slow tier, which CI runs too.
QUICK_SEEDS = {11, 12, 81}


@pytest.mark.parametrize(("case", "simulated_device"),
                         [pytest.param(c, s, id=f"{c.id}-seed{s}", marks=() if s in QUICK_SEEDS else pytest.mark.slow)
                          for c, s in PARITY], indirect=["simulated_device"])
def test_parity_table_on_the_simulated_device(case, simulated_device) -> None:
    test_offload_parity.run_case(case, bucket_bytes=4096)


UIB = [(accumulation, clipped, seed) for seed, (accumulation, clipped) in
       enumerate([(1, False), (4, False), (1, True), (4, True)], start=21)]


@pytest.mark.parametrize(("accumulation", "clipped", "simulated_device"), UIB,
                         ids=[f"acc{a}-{'clip' if c else 'noclip'}-seed{s}" for a, c, s in UIB],
                         indirect=["simulated_device"])
def test_updates_during_backward_on_the_simulated_device(accumulation, clipped, simulated_device) -> None:
    if clipped:
        test_update_in_backward.test_clipped_updates_during_backward_are_bitwise_torch_clip_and_fused(accumulation)
    else:
        test_update_in_backward.test_updates_during_backward_are_bitwise_torch_fused(accumulation)


@pytest.mark.parametrize("simulated_device", [31, 32], indirect=True)
@pytest.mark.parametrize("freed", [True, False], ids=["freed", "kept"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_on_the_simulated_device(set_to_none, freed, simulated_device) -> None:
    test_optim_info.zero_grad_run("freed" if freed else "kept", set_to_none)


@pytest.mark.parametrize("simulated_device", [41, 42], indirect=True)
def test_host_accumulation_on_the_simulated_device(simulated_device) -> None:
    test_offload.test_host_accumulation_equals_autograd_accumulation()


@pytest.mark.parametrize("simulated_device", [43], indirect=True)
def test_host_accumulation_with_a_late_accumulator_on_the_simulated_device(simulated_device) -> None:
    """The accumulator thread wakes late from each copy it waits for, so the next micro-batch's copy into the same
    incoming buffer lands before the add has read it unless the hook waits for that add: the mistake shows every run,
    not only when the thread happens to lag (the accumulation-buffer mutation of test_simulated_mutations)."""
    torch.manual_seed(43)
    ref = test_offload.Mixed()
    model = copy.deepcopy(ref)
    opt = OffloadAdamW(model.parameters(), transfer_pipeline=True, offload_gradients=True)
    with simulated_device.late_host_waits(0.05):
        for i in range(4):
            model(test_offload._x(i)).backward()
            ref(test_offload._x(i)).backward()
        got = dict(opt._pipeline.host_gradients())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_bitwise_equal(got[p], q.grad, f"{name}: gradient accumulated in host memory")


@pytest.mark.parametrize("simulated_device", [51], indirect=True)
def test_found_inf_skip_on_the_simulated_device(simulated_device) -> None:
    test_offload.test_found_inf_skip_is_exact_with_freed_gradients()


def _run_worker(worker: str, out: Path, seed: int, only: list[str]) -> list[dict]:
    proc = subprocess.run([sys.executable, str(HERE / "support" / worker), "--out", str(out),
                           "--simulated-device", str(seed), "--only", *only],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(2)]


import _overlap_ddp_worker as ddp_worker  # noqa: E402
import _overlap_fsdp_worker as fsdp_worker  # noqa: E402

DISTRIBUTED = {
    # accumulation inside ddp_model.no_sync(), each reduced bucket landing during backward; clipping at its end
    "ddp": ("_overlap_ddp_worker.py", 61, [ddp_worker.case_name(None, 4, True), ddp_worker.case_name(ddp_worker.CLIP, 1, True)]),
    # groups landing during backward, clipped; FSDP2 reducing every micro-batch into the host shard (the accumulator)
    # freed gradients at the step on the stand-in: the parity rows above; here the two updates-during-backward cases
    # and an edit of a sharded parameter through p.data between backward and step(), refused (its device fingerprint)
    "fsdp2": ("_overlap_fsdp_worker.py", 62, [fsdp_worker.case_name(None, 1), fsdp_worker.case_name(fsdp_worker.CLIP, 4),
                                              "edit-refused"]),
}


# DDP's in the quick tier (a mutation names it); FSDP2's (15 s on 2 cores) under -m slow, for the quick tier's budget.
@pytest.mark.parametrize("which", [pytest.param(w, marks=pytest.mark.slow if w == "fsdp2" else ()) for w in DISTRIBUTED])
def test_distributed_suites_on_the_simulated_device(which, tmp_path) -> None:
    """The worker's cases are bitwise the reference on both ranks, the optimizer's copies on the simulated device."""
    worker, seed, only = DISTRIBUTED[which]
    results = _run_worker(worker, tmp_path, seed, only)
    assert all(set(result) == set(only) for result in results), "a case did not run"
    failed = [f"rank {rank} {name}: {case['error'][-800:]}" for rank, result in enumerate(results)
              for name, case in result.items() if not case["ok"]]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("simulated_device", [71], indirect=True)
@pytest.mark.parametrize("unscale", [True, False], ids=["unscale_then_clip", "step_only"])
def test_loss_scaling_and_torch_clipping_on_the_simulated_device(unscale, simulated_device) -> None:
    """GradScaler and torch's clip_grad_norm_ read the freed gradients through p.grad's stand-in."""
    test_offload.test_plain_grad_scaler_with_freed_gradients_matches_torch(unscale)


PLACED = [(placed, test_placement.C[name], seed) for seed, (placed, name) in enumerate([
    (("stream", "device"), "fp32-acc4-freed-clip-scaler_none"),
    (("host", "stream"), "fp32-acc4-kept-clip-scaler_unscale"),
    (("device", "host"), "fp32-acc1-freed-noclip-scaler_step"),
    (("stream", "stream"), "bf16-acc4-kept-clip-scaler_none"),
], start=81)]


@pytest.mark.parametrize(("placed", "case", "simulated_device"),
                         [pytest.param(p, c, s, id=f"{'+'.join(p)}-{c.id}-seed{s}",
                                       marks=() if s in QUICK_SEEDS else pytest.mark.slow) for p, c, s in PLACED],
                         indirect=["simulated_device"])
def test_placements_on_the_simulated_device(placed, case, simulated_device) -> None:
    test_offload_parity.run_case(case, bucket_bytes=4096, update_on=placed, stream_chunk_bytes=test_placement.CHUNK)


RING = [(buffers, seed) for seed, buffers in enumerate([2, 3], start=91)]


@pytest.mark.parametrize(("buffers", "simulated_device"), RING, ids=[f"buffers{b}-seed{s}" for b, s in RING],
                         indirect=["simulated_device"])
def test_the_ring_on_the_simulated_device(buffers, simulated_device) -> None:
    """Every tensor spans several chunks: each ring buffer is refilled several times in a step."""
    test_placement.test_the_ring_streams_tensors_of_many_chunks_bitwise(torch.bfloat16, True, buffers)


@pytest.mark.parametrize("simulated_device", [95], indirect=True)
def test_streamed_updates_during_backward_on_the_simulated_device(simulated_device) -> None:
    test_update_in_backward.test_streamed_and_resident_groups_update_during_backward_bitwise_torch_fused(
        ("stream", "host"), 4, False)


def _lands_late(sim):
    """A post-accumulate-grad hook, registered before the optimizer's: the gradient autograd produced lands late on the
    backward thread's compute stream (poisoned now, its values written by work queued on that stream), as a gradient
    whose kernels the device has not run yet when the host reaches the hook."""
    def hook(p: torch.Tensor) -> None:
        grad = p.grad
        values = grad.clone()
        grad.fill_(float("nan"))
        sim.compute_later(lambda: grad.copy_(values), delay_s=0.01, writes=[grad])
    return hook


@pytest.mark.parametrize(("placed", "simulated_device"), [("stream", 96), ("device", 97)],
                         ids=["stream-seed96", "device-seed97"], indirect=["simulated_device"])
def test_an_update_during_backward_waits_for_the_stream_that_produced_its_device_gradient(placed, simulated_device):
    """DeviceGradients.landed's current_stream_waits: the updater thread's update of a streamed or resident group reads a
    gradient that lands late on the backward thread's stream, so it must wait for that stream (the mark its hook
    took). Bitwise torch's fused AdamW, and updates ran during backward."""
    import copy

    from offload_adamw import OffloadAdamW

    uib = test_update_in_backward
    torch.manual_seed(0)
    reference = uib.Blocks()
    model = copy.deepcopy(reference)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(_lands_late(simulated_device))
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ours = OffloadAdamW(uib._placed(model, (placed,)), lr=1e-3, weight_decay=0.1, offload_gradients=True,
                        update_in_backward=True, bucket_bytes=uib._block_bytes(model), stream_chunk_bytes=1 << 20)
    uib._train(reference, theirs, 3, 1, ours=False)
    timelines = uib._train(model, ours, 3, 1, ours=True)
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach()), "an update read its gradient before the stream that produced it"
    last = timelines[-1]
    assert any(b.update_start < last.backward_end for b in last.buckets), "no update ran during backward"


@pytest.mark.parametrize(("placed", "simulated_device"), [("stream", 98), ("device", 99)],
                         ids=["stream-seed98", "device-seed99"], indirect=["simulated_device"])
def test_the_next_forward_waits_for_the_parameters_an_update_during_backward_wrote(placed, simulated_device):
    """The mark StreamUpdate.run and DeviceUpdate.run return: the updater thread's kernels run late on its own stream
    (late_kernels), and the next forward, on the user's thread, must wait for that stream (step() has its compute
    stream wait for the mark). Bitwise torch's fused AdamW, and updates ran during backward."""
    import copy

    from offload_adamw import OffloadAdamW

    uib = test_update_in_backward
    torch.manual_seed(0)
    reference = uib.Blocks()
    model = copy.deepcopy(reference)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ours = OffloadAdamW(uib._placed(model, (placed,)), lr=1e-3, weight_decay=0.1, offload_gradients=True,
                        update_in_backward=True, bucket_bytes=uib._block_bytes(model), stream_chunk_bytes=1 << 20)
    uib._train(reference, theirs, 3, 1, ours=False)
    with simulated_device.late_kernels(0.02):
        timelines = uib._train(model, ours, 3, 1, ours=True)
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach()), "a forward read a parameter before the update that wrote it ran"
    last = timelines[-1]
    assert any(b.update_start < last.backward_end for b in last.buckets), "no update ran during backward"


class _Gapped(torch.nn.Module):
    """A parameter that is not dense (a slice of a wider tensor): its update writes an aligned copy, written back after."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(48, 64)[:, :32])
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x @ self.w))


@pytest.mark.parametrize("simulated_device", [100], indirect=True)
def test_the_next_forward_waits_for_a_streamed_parameter_written_back_after_its_update(simulated_device):
    """The mark StreamUpdate.run returns: a streamed parameter that is not dense is updated in an aligned copy and
    written back once the chunks have gone back to the host, after the last copy step() waits for; the next forward
    must wait for the updater's stream through the mark. Bitwise torch's fused AdamW."""
    import copy

    from offload_adamw import OffloadAdamW

    torch.manual_seed(0)
    model = _Gapped()
    reference = copy.deepcopy(model)
    assert not model.w.is_contiguous()
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    ours = OffloadAdamW([{"params": list(model.parameters()), "update_on": "stream"}], lr=1e-2, offload_gradients=True,
                        update_in_backward=True, bucket_bytes=1, stream_chunk_bytes=1 << 20)
    batches = [torch.randn(16, 48, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    for net, opt in ((reference, theirs), (model, ours)):
        with simulated_device.late_kernels(0.02) if net is model else contextlib.nullcontext():
            for x in batches:
                net(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach()), "a forward read a parameter before its write-back ran"


@pytest.mark.parametrize("simulated_device", [98], indirect=True)
def test_a_step_that_raises_midway_leaves_no_copy_into_host_memory_in_flight(simulated_device, monkeypatch):
    """A step interrupted after its first bucket (an error raised while the second is served: a KeyboardInterrupt, a
    failed allocation) still settles what it streamed: the first bucket's state, copied back to host memory, has landed
    when the error reaches the caller, so a checkpoint saved in the handler holds what it will hold later, not a torn
    mix of bytes still arriving. The next forward also waits for the parameters the first bucket sent."""
    from offload_adamw.optim import bucket as optim_bucket

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
    opt = OffloadAdamW([{"params": list(model.parameters()), "update_on": "stream"}], lr=1e-2, bucket_bytes=1,
                       stream_chunk_bytes=test_placement.CHUNK)
    x = torch.randn(8, 64)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    model(x).square().mean().backward()

    served = optim_bucket.serve
    calls = []

    def serve_then_fail(opt_, work):
        calls.append(work)
        if len(calls) == 3:
            raise KeyboardInterrupt("the user pressed Ctrl-C during step()")
        served(opt_, work)

    monkeypatch.setattr(optim_bucket, "serve", serve_then_fail)
    with simulated_device.slow_copies(0.1), pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.setattr(optim_bucket, "serve", served)
    at_the_error = {k: v.clone() for k, v in _host_state(opt).items()}
    import time
    time.sleep(0.5)
    later = _host_state(opt)
    changed = [k for k in later if not torch.equal(at_the_error[k], later[k])]
    assert not changed, f"state still landing in host memory after step() raised: {changed[:4]}"
    assert len(calls) == 3


def _host_state(opt) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": t for i, (p, s) in enumerate(opt.state.items()) for name, t in s.items()
            if isinstance(t, torch.Tensor)}
