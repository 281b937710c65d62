"""Host updates hidden behind backward (update_in_backward=True), with the CPU as device.

Properties: bitwise equal to torch.optim.AdamW(fused=True) over steps with accumulation 1 and 4
(micro-batches that only accumulate run inside opt.no_sync()); the timeline shows updates that ran
before backward ended (overlap above 0.3 on 8 blocks); what cannot be exact is refused before the
first update (clipping, loss scaling, non-finite policies, kept gradients) or loudly at the step
that would be wrong (hyperparameters changed between backward and step()).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from _parity import same_bits
from offload_adamw import OffloadAdamW, OffloadGradScaler, is_host_resident

BLOCKS = 8


class Blocks(nn.Module):
    def __init__(self, width: int = 192) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(BLOCKS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _batches(n: int, width: int = 192) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(256, width, generator=g) for _ in range(n)]


def _block_bytes(model: Blocks) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())


def _train(model: nn.Module, opt, steps: int, accumulation: int, ours: bool, clip: float | None = None) -> list:
    """Train; clipping is torch's clip_grad_norm_ on torch's optimizer and max_grad_norm on ours.

    Returns our timelines, or torch's total norms."""
    batches = _batches(steps * accumulation)
    timelines: list = []
    for step in range(steps):
        for micro in range(accumulation):
            last = micro == accumulation - 1
            context = opt.no_sync() if (ours and not last) else _nothing()
            with context:
                loss = model(batches[step * accumulation + micro]).square().mean() / accumulation
                loss.backward()
        if clip is not None and not ours:
            timelines.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
        if ours:
            timelines.append(opt.last_step_timeline())
    return timelines


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


@pytest.mark.parametrize("accumulation", [1, 4])
def test_updates_during_backward_are_bitwise_torch_fused(accumulation: int) -> None:
    torch.manual_seed(0)
    reference = Blocks()
    model = copy.deepcopy(reference)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ours = OffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, offload_gradients=True, update_in_backward=True,
                        bucket_bytes=_block_bytes(model))
    _train(reference, theirs, 4, accumulation, ours=False)
    _train(model, ours, 4, accumulation, ours=True)
    for p, q in zip(reference.parameters(), model.parameters()):
        assert same_bits(p.detach(), q.detach())
        assert same_bits(theirs.state[p]["exp_avg_sq"], ours.state[q]["exp_avg_sq"])
    timeline = ours.last_step_timeline()
    assert timeline is not None and len(timeline.buckets) == BLOCKS


@pytest.mark.parametrize("accumulation", [1, 4])
def test_clipped_updates_during_backward_are_bitwise_torch_clip_and_fused(accumulation: int) -> None:
    """max_grad_norm with update_in_backward: norms taken in the hooks, the coefficient at backward's end."""
    torch.manual_seed(0)
    reference = Blocks()
    model = copy.deepcopy(reference)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ours = OffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, offload_gradients=True, update_in_backward=True,
                        bucket_bytes=_block_bytes(model), max_grad_norm=0.05)
    torch_norms = _train(reference, theirs, 4, accumulation, ours=False, clip=0.05)
    timelines = _train(model, ours, 4, accumulation, ours=True)
    for p, q in zip(reference.parameters(), model.parameters()):
        assert same_bits(p.detach(), q.detach())
        assert same_bits(theirs.state[p]["exp_avg_sq"], ours.state[q]["exp_avg_sq"])
    assert ours.last_grad_norm is not None and same_bits(ours.last_grad_norm, torch_norms[-1])
    assert float(torch_norms[-1]) > 0.05, "the clipping must have acted"
    last = timelines[-1]
    assert len(last.buckets) == BLOCKS
    # With clipping an update needs the global norm, known when backward ends: none starts before.
    assert all(b.update_start >= last.backward_end for b in last.buckets)


def _placed(model: Blocks, pattern: tuple[str, ...]) -> list[dict]:
    """One group per block, placed by ``pattern`` in turn (docs/placement.md)."""
    return [{"params": list(block.parameters()), "update_on": pattern[k % len(pattern)]}
            for k, block in enumerate(model.blocks)]


PLACED = [(("stream",), 1, False), (("stream", "host"), 4, False), (("device", "stream", "host"), 1, True),
          (("stream",), 4, True)]


@pytest.mark.parametrize(("pattern", "accumulation", "clipped"), PLACED,
                         ids=[f"{'+'.join(p)}-acc{a}-{'clip' if c else 'noclip'}" for p, a, c in PLACED])
def test_streamed_and_resident_groups_update_during_backward_bitwise_torch_fused(pattern, accumulation, clipped) -> None:
    """A streamed (or resident) group's update starts when its gradients are complete, like a host group's: during
    backward, or when it ends with clipping; its gradient stays on the device."""
    torch.manual_seed(0)
    reference = Blocks()
    model = copy.deepcopy(reference)
    clip = 0.05 if clipped else None
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ours = OffloadAdamW(_placed(model, pattern), lr=1e-3, weight_decay=0.1, offload_gradients=True,
                        update_in_backward=True, bucket_bytes=_block_bytes(model), max_grad_norm=clip,
                        stream_chunk_bytes=1 << 20)
    torch_norms = _train(reference, theirs, 4, accumulation, ours=False, clip=clip)
    timelines = _train(model, ours, 4, accumulation, ours=True)
    for p, q in zip(reference.parameters(), model.parameters()):
        assert same_bits(p.detach(), q.detach())
        assert same_bits(theirs.state[p]["exp_avg_sq"], ours.state[q]["exp_avg_sq"])
    if clipped:
        assert same_bits(ours.last_grad_norm, torch_norms[-1]) and float(torch_norms[-1]) > 0.05
    last = timelines[-1]
    assert len(last.buckets) == BLOCKS
    started = [b.update_start < last.backward_end for b in last.buckets]
    assert (not any(started)) if clipped else any(started), "early updates must start as their buckets complete"


def test_clipped_streamed_updates_start_when_backward_ends() -> None:
    """With max_grad_norm the gate opens at the end of backward, streamed groups' updates included: they run on the
    worker before step() is called, not in it."""
    model = Blocks(width=32)
    opt = OffloadAdamW(_placed(model, ("stream", "device", "host")), offload_gradients=True, update_in_backward=True,
                       bucket_bytes=_block_bytes(model), max_grad_norm=0.05, stream_chunk_bytes=1 << 20)
    for x in _batches(3, width=32):
        model(x).square().mean().backward()
        time.sleep(0.5)  # the worker has run every bucket once the gate opened
        step_called = time.monotonic()
        opt.step()
        opt.zero_grad()
    last = opt.last_step_timeline()
    assert len(last.buckets) == BLOCKS
    assert all(last.backward_end <= b.update_start < step_called for b in last.buckets)


def test_a_streamed_gradient_changed_after_its_early_update_is_refused() -> None:
    """The gradient of a streamed group stays on the device, so torch's clipping can reach it after its update ran
    during backward: the step refuses by name instead of pretending the clipping counted."""
    model = Blocks(width=16)
    opt = OffloadAdamW(_placed(model, ("stream",)), offload_gradients=True, update_in_backward=True, bucket_bytes=64,
                       stream_chunk_bytes=1 << 20)
    x = _batches(1, width=16)[0]
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model(x).square().mean().backward()
    time.sleep(0.5)  # the worker has updated every bucket before the clipping below
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="changed after backward.*its update already ran during backward"):
        opt.step()


def test_the_timeline_shows_updates_hidden_behind_backward() -> None:
    torch.manual_seed(0)
    model = Blocks(width=384)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, offload_gradients=True, update_in_backward=True,
                       bucket_bytes=_block_bytes(model))
    overlaps = []
    for x in _batches(6, width=384):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        overlaps.append(opt.last_step_timeline().overlap)
    assert overlaps[0] == 0.0, "the first step knows no order yet: every update runs in step()"
    assert max(overlaps[1:]) > 0.3, overlaps
    baseline = OffloadAdamW(Blocks(width=64).parameters(), offload_gradients=True)
    assert baseline.last_step_timeline() is None


def test_what_cannot_be_exact_is_refused_before_the_first_update() -> None:
    model = Blocks(width=16)
    with pytest.raises(ValueError, match="offload_gradients=True"):
        OffloadAdamW(model.parameters(), update_in_backward=True)
    opt = OffloadAdamW(model.parameters(), offload_gradients=True, update_in_backward=True)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = OffloadGradScaler("cpu")
    scaler.scale(model(_batches(1, width=16)[0]).square().mean()).backward()
    with pytest.raises(RuntimeError, match="cannot clip"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="loss scaling"):
        scaler.unscale_(opt)
    assert all(same_bits(a, p.detach()) for a, p in zip(before, model.parameters()))
    assert not opt.state


def test_hyperparameters_changed_between_backward_and_step_are_reported() -> None:
    model = Blocks(width=16)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, offload_gradients=True, update_in_backward=True, bucket_bytes=64)
    x = _batches(1, width=16)[0]
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model(x).square().mean().backward()
    time.sleep(0.5)  # the worker has updated every bucket (milliseconds each) before the change below
    opt.param_groups[0]["lr"] = 5e-4  # a scheduler stepped before optimizer.step()
    with pytest.raises(RuntimeError, match="changed between backward and step"):
        opt.step()


def test_inside_no_sync_gradients_stay_on_the_device_and_are_copied_once() -> None:
    model = Blocks(width=16)
    twin = copy.deepcopy(model)
    opt = OffloadAdamW(model.parameters(), offload_gradients=True, bucket_bytes=64)
    x = _batches(3, width=16)
    with opt.no_sync():
        model(x[0]).square().mean().backward()
        model(x[1]).square().mean().backward()
    assert all(p.grad is not None and not is_host_resident(p.grad) for p in model.parameters()), \
        "accumulating micro-batches keep their device gradient"
    model(x[2]).square().mean().backward()
    assert all(is_host_resident(p.grad) for p in model.parameters()), "the last micro-batch moves it to the host"
    for batch in x:
        twin(batch).square().mean().backward()  # autograd's own accumulation
    for p, q in zip(model.parameters(), twin.parameters()):
        assert same_bits(opt.gradient(p), q.grad)


def test_clipping_the_model_after_early_updates_is_refused() -> None:
    model = Blocks(width=16)
    opt = OffloadAdamW(model.parameters(), offload_gradients=True, update_in_backward=True)  # noqa: F841 - its hooks must stay alive
    before = [p.detach().clone() for p in model.parameters()]
    model(_batches(1, width=16)[0]).square().mean().backward()
    with pytest.raises(RuntimeError, match="update_in_backward=True"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # through p.grad's stand-in
    assert all(same_bits(a, p.detach()) for a, p in zip(before, model.parameters()))


def test_the_models_zero_grad_between_steps_is_bitwise_torch_fused() -> None:
    """model.zero_grad() (what HF Trainer calls) instead of opt.zero_grad(): the host gradients of the previous
    step are dropped as each parameter's next gradient arrives, also after this backward's first early update."""
    torch.manual_seed(0)
    reference = Blocks(width=32)
    model = copy.deepcopy(reference)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    ours = OffloadAdamW(model.parameters(), lr=1e-3, offload_gradients=True, update_in_backward=True,
                        bucket_bytes=_block_bytes(model))
    overlaps = []
    for x in _batches(4, width=32):
        for m, opt in ((reference, theirs), (model, ours)):
            m(x).square().mean().backward()
            opt.step()
            m.zero_grad()
        overlaps.append(ours.last_step_timeline().overlap)
    for p, q in zip(reference.parameters(), model.parameters()):
        assert same_bits(p.detach(), q.detach())
        assert same_bits(theirs.state[p]["exp_avg_sq"], ours.state[q]["exp_avg_sq"])
    assert max(overlaps[1:]) > 0, overlaps


def test_gradients_cleared_between_backward_and_step_after_early_updates_are_refused() -> None:
    model = Blocks(width=16)
    opt = OffloadAdamW(model.parameters(), offload_gradients=True, update_in_backward=True, bucket_bytes=64)
    x = _batches(1, width=16)[0]
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model(x).square().mean().backward()
    model.zero_grad()  # torch's AdamW would now skip every parameter; their updates already ran during backward
    with pytest.raises(RuntimeError, match="cleared"):
        opt.step()


def _poisoned(batches: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """The batches with an inf in one row of step ``step``'s: that step's gradients are not finite."""
    out = [b.clone() for b in batches]
    out[step][3, 5] = float("inf")
    return out


@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_non_finite_step_is_skipped_before_any_update_during_backward(clip) -> None:
    """nonfinite='skip' with updates during backward: counts taken in the hooks, the updates start when backward
    ends if every gradient is finite; a step with an inf is skipped whole (nothing ran early), as GradScaler skips."""
    torch.manual_seed(0)
    reference = Blocks(width=64)
    model = copy.deepcopy(reference)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ours = OffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, offload_gradients=True, update_in_backward=True,
                        bucket_bytes=_block_bytes(model), nonfinite="skip", max_grad_norm=clip)
    batches = _poisoned(_batches(6, width=64), step=3)
    timelines = []
    for step, x in enumerate(batches):
        model(x).square().mean().backward()
        before = [p.detach().clone() for p in model.parameters()] if step == 3 else None
        ours.step()
        ours.zero_grad()
        timelines.append(ours.last_step_timeline())
        if step == 3:
            assert ours.skipped_steps == 1
            assert all(same_bits(a, p.detach()) for a, p in zip(before, model.parameters())), "an update ran"
        reference(x).square().mean().backward()
        if step != 3:  # torch's AdamW, told to skip the bad step the way GradScaler would
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            theirs.step()
        theirs.zero_grad()
    for p, q in zip(reference.parameters(), model.parameters()):
        assert same_bits(p.detach(), q.detach())
        assert same_bits(theirs.state[p]["exp_avg_sq"], ours.state[q]["exp_avg_sq"])
    last = timelines[-1]
    assert len(last.buckets) == BLOCKS and all(b.update_start >= last.backward_end for b in last.buckets)
    assert ours.transfer_pipeline.gate_taken() is False  # reset by the step


def test_a_non_finite_gradient_raises_by_name_before_any_update_during_backward() -> None:
    model = Blocks(width=64)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, offload_gradients=True, update_in_backward=True,
                       bucket_bytes=_block_bytes(model), nonfinite="raise")
    batches = _poisoned(_batches(3, width=64), step=2)
    for x in batches[:2]:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model(batches[2]).square().mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy({k: v for k, v in enumerate(opt.state_dict()["state"].values())})
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        opt.step()
    assert all(same_bits(a, p.detach()) for a, p in zip(before, model.parameters())), "an update ran"
    after = {k: v for k, v in enumerate(opt.state_dict()["state"].values())}
    assert all(same_bits(state[k]["exp_avg"], after[k]["exp_avg"]) for k in state)


class _Checkpointed(Blocks):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_recomputation_inside_backward_is_not_a_forward_before_step() -> None:
    """Activation checkpointing recomputes each block's forward during backward, after later blocks updated:
    not the forward between backward and step() that is refused, and bitwise torch's."""
    torch.manual_seed(0)
    reference = _Checkpointed()
    model = copy.deepcopy(reference)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ours = OffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, offload_gradients=True, update_in_backward=True,
                        bucket_bytes=_block_bytes(model))
    _train(reference, theirs, 4, 1, ours=False)
    timelines = _train(model, ours, 4, 1, ours=True)
    for p, q in zip(reference.parameters(), model.parameters()):
        assert same_bits(p.detach(), q.detach())
    assert max(t.overlap for t in timelines[1:]) > 0, "the updates ran during backward"


def test_a_forward_between_backward_and_step_is_refused() -> None:
    model = Blocks(width=16)
    opt = OffloadAdamW(model.parameters(), offload_gradients=True, update_in_backward=True, bucket_bytes=64)
    x = _batches(1, width=16)[0]
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model(x).square().mean().backward()
    with torch.no_grad(), pytest.raises(RuntimeError, match="opt.step\\(\\) must come next"):
        model(x)  # an evaluation before step(): torch's parameters are still the old ones here
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model(x)  # after step(): fine
