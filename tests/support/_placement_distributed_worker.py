"""The 2-process half of test_placement_distributed.py: DDP, FSDP2 and DCP with streamed and resident groups.

Run as ``python tests/support/_placement_distributed_worker.py --out DIR``: two gloo ranks (the CPU as device) write
``DIR/results_rank{r}.json``: ``{case: {"ok": bool, "error": str, "measured": {...}}}``. The models, batches,
training loops and references are those of tests/support/_overlap_ddp_worker.py and tests/support/_overlap_fsdp_worker.py (8
blocks; DDP in several buckets; FSDP2 one group per block and the root); here each block is a parameter group
placed by a pattern (docs/placement.md), with kept or freed gradients, the update at step() or during backward,
clipping and accumulation. Every parameter (local shard) and second moment must be bitwise the reference's:
DDP / FSDP2 + torch.optim.AdamW(fused=True) under the same user calls. Then DCP: an FSDP2 run saved with one
placement, loaded at the same world size into another (bitwise the uninterrupted run), and the checkpoint left
in DIR for the parent process to load at world size 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _overlap_ddp_worker as ddp_cases
import _overlap_fsdp_worker as fsdp_cases
from _distributed_common import CaseResults, join_gloo, worker_main
from offload_adamw import OffloadAdamW

WORLD = 2
CHUNK = 1 << 20  # each block's weights span several ring chunks

#: (name, placement of the blocks in turn, offload_gradients, update_in_backward, max_grad_norm, accumulation)
DDP_CASES = [
    ("ddp-stream+host-kept-clip-acc4", ("stream", "host"), False, False, ddp_cases.CLIP, 4),
    ("ddp-device+stream-freed-acc1", ("device", "stream"), True, False, None, 1),
    ("ddp-stream+device+host-freed-inbwd-clip-acc4", ("stream", "device", "host"), True, True, ddp_cases.CLIP, 4),
    ("ddp-stream-freed-inbwd-acc1", ("stream",), True, True, None, 1),
]
#: (name, placements, offload_gradients, update_in_backward, how ours clips, accumulation); the reference clips with
#: torch's clip_grad_norm_ on the model whenever ours clips
FSDP_CASES = [
    ("fsdp-stream+host-kept-torchclip-acc4", ("stream", "host"), False, False, "torch", 4),
    ("fsdp-device+stream+host-freed-optclip-acc1", ("device", "stream", "host"), True, False, "optimizer", 1),
    ("fsdp-stream+host-freed-inbwd-optclip-acc4", ("stream", "host"), True, True, "optimizer", 4),
    ("fsdp-device-freed-inbwd-acc1", ("device",), True, True, None, 1),
]
DCP_SAVED = ("device", "stream")  # the placement of the saved run ...
DCP_LOADED = ("host", "device")  # ... and of the run that loads it at world size 2
DCP_AT, DCP_END = 2, 4


def placed(blocks, pattern: tuple[str, ...], rest=()) -> list[dict]:
    groups = [{"params": list(b.parameters()), "update_on": pattern[k % len(pattern)]} for k, b in enumerate(blocks)]
    rest = list(rest)
    return groups + ([{"params": rest, "update_on": "host"}] if rest else [])


def check_ddp(pattern, freed, in_backward, clip, accumulation, mesh, measured: dict) -> None:
    reference, theirs, _ = ddp_cases.reference_run(clip, accumulation)
    model = ddp_cases.wrapped()
    ours = OffloadAdamW(placed(model.module.blocks, pattern), lr=ddp_cases.LR, weight_decay=ddp_cases.WEIGHT_DECAY,
                        offload_gradients=freed, update_in_backward=in_backward, max_grad_norm=clip,
                        stream_chunk_bytes=CHUNK)
    ours.attach(model)
    timelines: list = []
    ddp_cases.train(model, ours, clip, accumulation, ours=True, timelines=timelines)
    ddp_cases.assert_same(reference, theirs, model, ours)
    host_params = [p for g in ours.param_groups if g["update_on"] == "host" for p in g["params"]]
    gradient_bytes = ours.host_buffer_bytes().get("gradients", 0)
    assert gradient_bytes == sum(p.numel() * p.element_size() for p in host_params), \
        f"host gradient buffers of {gradient_bytes} bytes: a streamed or resident group's gradient never leaves the device"
    measured["device_buffer_bytes"] = ours.device_buffer_bytes()
    measured["overlaps"] = [round(t.overlap, 3) for t in timelines if t is not None]


def check_ddp_clipped_gradients(mesh, measured: dict) -> None:
    """Streamed groups, freed, updates during backward, max_grad_norm: after step() each streamed parameter's p.grad
    holds the clipped gradient, as torch's clip_grad_norm_ leaves it on the reference (the coefficient multiplies
    p.grad, not DDP's bucket)."""
    rank = dist.get_rank()
    reference, model = ddp_cases.wrapped(), ddp_cases.wrapped()
    theirs = torch.optim.AdamW(reference.parameters(), lr=ddp_cases.LR, weight_decay=ddp_cases.WEIGHT_DECAY, fused=True)
    ours = OffloadAdamW(placed(model.module.blocks, ("stream",)), lr=ddp_cases.LR, weight_decay=ddp_cases.WEIGHT_DECAY,
                        offload_gradients=True, update_in_backward=True, max_grad_norm=ddp_cases.CLIP,
                        stream_chunk_bytes=CHUNK)
    ours.attach(model)
    differing = []
    for step in range(ddp_cases.STEPS):
        for net in (reference, model):
            net(ddp_cases.batch(step, 0, rank)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), ddp_cases.CLIP)
        theirs.step()
        ours.step()
        differing += [f"step {step} {name}" for (name, p), q in zip(reference.named_parameters(), model.parameters())
                      if not torch.equal(p.grad, q.grad)]
        theirs.zero_grad()
        ours.zero_grad()
    ddp_cases.assert_same(reference, theirs, model, ours)
    assert not differing, "p.grad after step() is not the clipped gradient: " + ", ".join(differing[:4])


def fsdp_groups(model, pattern):
    return placed(model.blocks, pattern, rest=[model.norm.weight, model.norm.bias, model.probe])


def check_fsdp(pattern, freed, in_backward, clip_by, accumulation, mesh, measured: dict) -> None:
    clip = None if clip_by is None else fsdp_cases.CLIP
    reference = fsdp_cases.sharded(mesh)
    theirs = torch.optim.AdamW(reference.parameters(), lr=fsdp_cases.LR, weight_decay=fsdp_cases.WEIGHT_DECAY, fused=True)
    fsdp_cases.train(reference, theirs, clip, accumulation, torch_clips=True)
    model = fsdp_cases.sharded(mesh)
    ours = OffloadAdamW(fsdp_groups(model, pattern), lr=fsdp_cases.LR, weight_decay=fsdp_cases.WEIGHT_DECAY,
                        offload_gradients=freed, update_in_backward=in_backward,
                        max_grad_norm=clip if clip_by == "optimizer" else None, stream_chunk_bytes=CHUNK)
    assert ours.transfer_pipeline is not None, "streamed and resident groups run in the transfer pipeline"
    timelines: list = []
    fsdp_cases.train(model, ours, clip, accumulation, torch_clips=clip_by == "torch", timelines=timelines)
    fsdp_cases.assert_same(reference, theirs, model, ours)
    measured["device_buffer_bytes"] = ours.device_buffer_bytes()
    measured["overlaps"] = [round(t.overlap, 3) for t in timelines if t is not None]


def _steps(model, opt, steps: range) -> None:
    rank = dist.get_rank()
    for step in steps:
        fsdp_cases.loss_of(model, step, 0, rank).backward()
        opt.step()
        opt.zero_grad()


def _optimizer(model, pattern) -> OffloadAdamW:
    return OffloadAdamW(fsdp_groups(model, pattern), lr=fsdp_cases.LR, weight_decay=fsdp_cases.WEIGHT_DECAY,
                        stream_chunk_bytes=CHUNK)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def check_dcp(out: Path, mesh, measured: dict) -> None:
    """Save with DCP_SAVED, load into DCP_LOADED at world 2, continue: bitwise the uninterrupted run."""
    model = fsdp_cases.sharded(mesh)
    opt = _optimizer(model, DCP_SAVED)
    _steps(model, opt, range(DCP_AT))
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=out / "ckpt_placed")
    _steps(model, opt, range(DCP_AT, DCP_END))
    torch.manual_seed(7)
    fresh = fsdp_cases.sharded(mesh)
    with torch.no_grad():
        for p in fresh.parameters():
            _local(p).normal_()  # another initialisation: everything must come from the checkpoint
    fresh_opt = _optimizer(fresh, DCP_LOADED)
    sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(sd, checkpoint_id=out / "ckpt_placed")
    set_model_state_dict(fresh, sd["model"])
    set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
    assert [g["update_on"] for g in fresh_opt.param_groups[:2]] == list(DCP_LOADED), "the load took the saved placement"
    assert {float(s["step"]) for s in fresh_opt.state.values()} == {float(DCP_AT)}
    _steps(fresh, fresh_opt, range(DCP_AT, DCP_END))
    fsdp_cases.assert_same(model, _AsTorch(opt), fresh, fresh_opt)
    measured["steps"] = DCP_END


class _AsTorch:
    """An OffloadAdamW's state where assert_same reads a reference's (``state[p]["exp_avg_sq"]``)."""

    def __init__(self, opt: OffloadAdamW) -> None:
        self.state = opt.state


def worker(rank: int, port: int, out: str, only: list[str]) -> None:
    join_gloo(rank, port, WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    cases = CaseResults(Path(out) / f"results_rank{rank}.json", only)

    def run(name: str, check, *args) -> None:
        cases.run(name, check, *args, mesh)

    for name, *args in DDP_CASES:
        run(name, check_ddp, *args)
    run("ddp-stream-freed-inbwd-clip-grads-after-step", check_ddp_clipped_gradients)
    for name, *args in FSDP_CASES:
        run(name, check_fsdp, *args)
    run("dcp-placement-change", check_dcp, Path(out))
    dist.destroy_process_group()


def main() -> None:
    worker_main(worker, world=WORLD)


if __name__ == "__main__":
    main()
