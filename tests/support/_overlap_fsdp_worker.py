"""The 2-process half of test_overlap_fsdp.py: FSDP2 over 8 sharded blocks, host updates during backward.

Run as ``python tests/support/_overlap_fsdp_worker.py --out DIR``: it spawns two gloo ranks (CPU as device) and
writes ``DIR/results_rank{r}.json``: ``{case: {"ok": bool, "error": str, "measured": {...}}}``, one case
per (clipping, accumulation). Each case trains FSDP2 + OffloadAdamW(offload_gradients=True,
update_in_backward=True) and FSDP2 + torch.optim.AdamW(fused=True) from the same initialisation on the
same batches, with the same user calls (micro-batches that only accumulate run with
``set_requires_gradient_sync(False)``; clipping is torch's ``clip_grad_norm_`` on the reference and
``max_grad_norm`` on ours), and compares every local shard bitwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _overlap_common as common
from _distributed_common import CaseResults, join_gloo, worker_main
from _overlap_common import local
from offload_adamw import OffloadAdamW

WORLD = 2
BLOCKS = 8
WIDTH = 256
ROWS = 256
STEPS = 5
LR = 1e-3
WEIGHT_DECAY = 0.1
CLIP = 0.05  # below every step's norm: the clipping acts
CASES = [(None, 1), (None, 4), (CLIP, 1), (CLIP, 4)]  # updates during backward: (max_grad_norm, accumulation)
# Freed gradients with the update at step(): (how ours clips, accumulation, reduce every micro-batch). With
# a reduce per micro-batch FSDP2 accumulates into p.grad, our DTensor stand-in: the add runs on the host.
FREED_CASES = [("torch", 4, True), ("optimizer", 1, False), (None, 4, False)]


def case_name(clip: float | None, accumulation: int) -> str:
    return f"clip={clip}-accumulation={accumulation}"


BAD_STEP = 2  # the nonfinite case: an inf in rank 1's batch of this step only


def freed_case_name(clip_by: str | None, accumulation: int, sync_each: bool) -> str:
    return f"freed-clip_by={clip_by}-accumulation={accumulation}-sync_each={sync_each}"


class Blocks(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(BLOCKS)
        )
        # The root's own group (its gradient is reduced by FSDP2's final callback, at the very end of backward).
        self.norm = nn.LayerNorm(WIDTH)
        # A root parameter whose gradient is whatever loss_of puts there: an inf in one element lands in one
        # rank's shard only (the nonfinite case), where an inf in the data would reach every shard.
        self.probe = nn.Parameter(torch.zeros(64))
        torch.random.set_rng_state(generator_state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)


def sharded(mesh) -> Blocks:
    model = Blocks(seed=0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(ROWS, WIDTH, generator=g)


def loss_of(model, step: int, micro: int, rank: int, poisoned: bool = False) -> torch.Tensor:
    """The model's loss plus probe . c: c is zero, but on rank 0 at BAD_STEP (poisoned) it has an inf at index 40,
    which after the reduce-scatter is in rank 1's shard of the probe's gradient only (Shard(0): 32 + 32)."""
    c = torch.zeros(64)
    if poisoned and step == BAD_STEP and rank == 0:
        c[40] = float("inf")
    return model(batch(step, micro, rank)).square().mean() + (model.probe * c).sum()


def train(model, opt, clip: float | None, accumulation: int, torch_clips: bool, timelines: list | None = None,
          sync_each: bool = False) -> None:
    """Steps of ``accumulation`` micro-batches; ``torch_clips``: torch's clip_grad_norm_ on the model before step()."""
    rank = dist.get_rank()
    for step in range(STEPS):
        for micro in range(accumulation):
            model.set_requires_gradient_sync(sync_each or micro == accumulation - 1)
            loss = loss_of(model, step, micro, rank) / accumulation
            loss.backward()
        if clip is not None and torch_clips:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if timelines is not None:
            timelines.append(opt.last_step_timeline())


def check_case(clip: float | None, accumulation: int, mesh, measured: dict) -> None:
    reference = sharded(mesh)
    theirs = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    train(reference, theirs, clip, accumulation, torch_clips=True)

    model = sharded(mesh)
    ours = OffloadAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, offload_gradients=True,
                        update_in_backward=True, max_grad_norm=clip)
    timelines: list = []
    train(model, ours, clip, accumulation, torch_clips=False, timelines=timelines)
    assert_same(reference, theirs, model, ours)
    overlaps = [t.overlap for t in timelines if t is not None]
    last = timelines[-1]
    measured.update(
        overlaps=[round(o, 3) for o in overlaps],
        buckets=len(last.buckets),
        # An update may start before its own copies report (it waits for them inside): that pair is not ordered.
        events_in_order=all(
            b.grad_ready <= b.d2h_done <= b.update_end <= b.h2d_done and b.grad_ready <= b.update_start <= b.update_end
            for b in last.buckets
        ),
        starts_after_backward=[round(b.update_start - last.backward_end, 4) for b in last.buckets],
        # The step-time model's flow shop (planning/overlap.py): groups in the order their gradients became
        # ready, one host update at a time.
        flow_shop=all(
            a.grad_ready <= b.grad_ready and a.update_end <= b.update_start
            for a, b in zip(last.buckets, last.buckets[1:])
        ),
        last_grad_norm=None if ours.last_grad_norm is None else float(local(ours.last_grad_norm)),
    )


def assert_same(reference, theirs, model, ours) -> None:
    """Every local shard and second moment bitwise equal."""
    common.assert_same(reference, theirs, model, ours, "FSDP2")


def check_freed_case(clip_by: str | None, accumulation: int, sync_each: bool, mesh, measured: dict) -> None:
    """Freed DTensor gradients, update at step(): torch's clipping through p.grad, or max_grad_norm."""
    clip = None if clip_by is None else CLIP
    reference = sharded(mesh)
    theirs = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    train(reference, theirs, clip, accumulation, torch_clips=True, sync_each=sync_each)
    model = sharded(mesh)
    ours = OffloadAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, offload_gradients=True,
                        max_grad_norm=clip if clip_by == "optimizer" else None)
    train(model, ours, clip, accumulation, torch_clips=clip_by == "torch", sync_each=sync_each)
    assert_same(reference, theirs, model, ours)
    loss_of(model, 0, 0, dist.get_rank()).backward()
    measured["grads_freed"] = all(type(p.grad._local_tensor).__name__ == "HostResidentGradient" for p in model.parameters())
    assert measured["grads_freed"], "each p.grad is a DTensor over a host-resident stand-in"


def check_nonfinite_skip(mesh, measured: dict) -> None:
    """nonfinite='skip' with updates during backward: an inf in rank 1's shard only skips the step on both ranks."""
    rank = dist.get_rank()
    reference = sharded(mesh)
    theirs = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    model = sharded(mesh)
    ours = OffloadAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, offload_gradients=True,
                        update_in_backward=True, nonfinite="skip", max_grad_norm=CLIP)
    for step in range(STEPS):
        loss_of(model, step, 0, rank, poisoned=True).backward()
        ours.step()
        ours.zero_grad()
        loss_of(reference, step, 0, rank).backward()
        if step != BAD_STEP:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
            theirs.step()
        theirs.zero_grad()
    measured["skipped_steps"] = ours.skipped_steps
    assert ours.skipped_steps == 1, f"rank {rank} skipped {ours.skipped_steps} steps"
    assert_same(reference, theirs, model, ours)


#: edits of a DTensor parameter through p.data between backward and step() (its local shard changes on every rank)
EDITS = {
    "clamp": lambda model: model.blocks[3][0].weight.data.clamp_(-0.01, 0.01),
    "in-place copy": lambda model: model.blocks[5][2].bias.data.copy_(model.blocks[5][2].bias.data.flip(0)),
}


def check_edit_refused(mesh, measured: dict) -> None:
    """An edit through p.data of a sharded parameter whose update ran during backward is refused by step(), naming it,
    on every rank (the mark of the local shard: a host fingerprint, or on the simulated device a device one)."""
    rank = dist.get_rank()
    refused = {}
    for edit, change in EDITS.items():
        model = sharded(mesh)
        ours = OffloadAdamW(model.named_parameters(), lr=LR, weight_decay=WEIGHT_DECAY, offload_gradients=True,
                            update_in_backward=True)
        for step in range(2):
            loss_of(model, step, 0, rank).backward()
            ours.step()
            ours.zero_grad()
        loss_of(model, 2, 0, rank).backward()
        change(model)
        try:
            ours.step()
        except RuntimeError as error:
            refused[edit] = str(error)
        else:
            refused[edit] = ""
    measured["refused"] = {edit: bool(why) for edit, why in refused.items()}
    names = {"clamp": "'blocks.3.0.weight' was changed", "in-place copy": "'blocks.5.2.bias' was changed"}
    wrong = {edit: why[:300] for edit, why in refused.items() if names[edit] not in why}
    assert not wrong, f"rank {rank}: not refused by name: {wrong}"


def check_given_back(update_in_backward: bool, mesh, measured: dict) -> None:
    """An optimizer dropped between the third backward and its step() (_overlap_common.check_given_back)."""
    common.check_given_back(lambda: sharded(mesh), batch, False, update_in_backward, measured, lr=LR,
                            weight_decay=WEIGHT_DECAY)


def worker(rank: int, port: int, out: str, only: list[str]) -> None:
    join_gloo(rank, port, WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    cases = CaseResults(Path(out) / f"results_rank{rank}.json", only)

    def run(name: str, check, *args) -> None:
        cases.run(name, check, *args, mesh)

    for clip, accumulation in CASES:
        run(case_name(clip, accumulation), check_case, clip, accumulation)
    for clip_by, accumulation, sync_each in FREED_CASES:
        run(freed_case_name(clip_by, accumulation, sync_each), check_freed_case, clip_by, accumulation, sync_each)
    run("nonfinite-skip", check_nonfinite_skip)
    run("edit-refused", check_edit_refused)
    run("given-back", check_given_back, False)
    run("given-back-update_in_backward", check_given_back, True)
    dist.destroy_process_group()


def main() -> None:
    worker_main(worker, world=WORLD)


if __name__ == "__main__":
    main()
