"""The 2-process half of test_nonfinite_in_backward.py: FSDP2 (gloo, the CPU as device), update_in_backward with a
non-finite policy.

Run as ``python tests/support/_nonfinite_in_backward_worker.py --out DIR``: two ranks run every case of ``CASES`` and write
``DIR/results_rank{r}.json`` = ``{case: {"ok": bool, "error": str, "measured": {...}}}``. A case trains the same
model with OffloadAdamW(update_in_backward=True) and with OffloadAdamW(update_in_backward=False) (the reference:
the step's policy over every gradient, decided on every rank alike) from the same initialisation and user calls.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _clipping_in_backward_fsdp_worker import CLIP, LR, WEIGHT_DECAY, Net, differing, loss_of, sharded
from _distributed_common import CaseResults, join_gloo, worker_main
from offload_adamw import OffloadAdamW

WORLD = 2


def blocks_sharded(mesh) -> Net:
    """Blocks and branch sharded; no root fully_shard: head's parameters are plain tensors, their gradients local."""
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.branch, mesh=mesh)
    return model


def poison_head_on_rank0(model: Net, step_of: list[int], poisoned_step: int) -> None:
    """An inf in the head's (plain, local) gradient on rank 0 only, in one step, put there by backward itself."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 0 and step_of[0] == poisoned_step:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad
    model.head.weight.register_hook(hook)


def case_plain_inf_on_one_rank(mesh, measured, policy: str):
    results = {}
    for uib in (False, True):
        model = blocks_sharded(mesh)
        step_of = [0]
        poison_head_on_rank0(model, step_of, 1)
        opt = OffloadAdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY,
                           offload_gradients=True, update_in_backward=uib, nonfinite=policy)
        error = None
        for step in range(3):
            step_of[0] = step
            loss_of(model, step).backward()
            try:
                opt.step()
            except FloatingPointError as e:
                error = type(e).__name__
            opt.zero_grad()
        results[uib] = (model, opt.skipped_steps, error)
    reference, ref_skipped, ref_error = results[False]
    model, skipped, error = results[True]
    measured.update(reference_skipped=ref_skipped, skipped=skipped, reference_error=ref_error, error=error)
    out = differing(reference, model)
    if (skipped, error) != (ref_skipped, ref_error):
        out.append(f"rank {dist.get_rank()}: skipped {skipped} error {error}, reference: skipped {ref_skipped} "
                   f"error {ref_error}")
    return out


def case_ddp_with_a_head_outside_ddp(mesh, measured, uib: bool):
    """DDP blocks and a head outside DDP (its gradient this rank's own) in one optimizer, nonfinite="skip": an inf
    in rank 0's head gradient. The DDP replicas must stay identical: every rank skips, or none."""
    from torch.nn.parallel import DistributedDataParallel

    blocks = Net().blocks
    ddp = DistributedDataParallel(blocks[0])
    head = torch.nn.Linear(blocks[0][0].in_features, blocks[0][0].in_features)
    step_of = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 0 and step_of[0] == 1:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad

    head.weight.register_hook(hook)
    opt = OffloadAdamW(list(ddp.parameters()) + list(head.parameters()), lr=LR, offload_gradients=True,
                       update_in_backward=uib, nonfinite="skip")
    opt.attach(ddp)
    for step in range(3):
        step_of[0] = step
        g = torch.Generator().manual_seed(10_000 * step + dist.get_rank())
        head(ddp(torch.randn(16, head.in_features, generator=g))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    measured["skipped"] = opt.skipped_steps
    out = []
    for name, p in ddp.module.named_parameters():
        gathered = [torch.empty_like(p) for _ in range(WORLD)]
        dist.all_gather(gathered, p.detach().contiguous())
        if not torch.equal(gathered[0], gathered[1]):
            out.append(f"DDP parameter {name} differs between the ranks (skipped {opt.skipped_steps} on this rank)")
    return out


def case_gate_opens_under_fsdp2(mesh, measured, root: bool):
    """Clipping (with a root fully_shard) and nonfinite="skip", finite gradients: the same result as without
    update_in_backward, and from the second step on the updates start at backward's end (the gate opens on both ranks)."""
    runs = []
    for uib in (False, True):
        model = sharded(mesh) if root else blocks_sharded(mesh)
        opt = OffloadAdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY,
                           offload_gradients=True, update_in_backward=uib, nonfinite="skip",
                           max_grad_norm=CLIP if root else None)  # torch cannot clip plain tensors beside DTensors
        gates = []
        for step in range(3):
            loss_of(model, step).backward()
            gates.append(opt._pipeline.gate_taken() and opt._pipeline.armed())
            opt.step()
            opt.zero_grad()
        runs.append((model, gates))
    (reference, _), (model, gates) = runs
    measured["gates"] = gates
    out = differing(reference, model)
    if gates[1:] != [True, True]:
        out.append(f"the gate did not open on rank {dist.get_rank()}: {gates}")
    return out


CASES = {
    "uib_clip_skip_gate_opens_under_fsdp2": lambda mesh, m: case_gate_opens_under_fsdp2(mesh, m, True),
    "uib_skip_gate_opens_under_fsdp2_with_a_plain_head": lambda mesh, m: case_gate_opens_under_fsdp2(mesh, m, False),
    "ddp_skip_with_inf_in_a_parameter_outside_ddp_on_one_rank_keeps_the_replicas_equal":
        lambda mesh, m: case_ddp_with_a_head_outside_ddp(mesh, m, False),
    "ddp_uib_skip_with_inf_in_a_parameter_outside_ddp_on_one_rank_keeps_the_replicas_equal":
        lambda mesh, m: case_ddp_with_a_head_outside_ddp(mesh, m, True),
    "uib_skip_with_inf_in_a_plain_parameter_on_one_rank_skips_every_rank":
        lambda mesh, m: case_plain_inf_on_one_rank(mesh, m, "skip"),
    "uib_raise_with_inf_in_a_plain_parameter_on_one_rank_raises_on_every_rank":
        lambda mesh, m: case_plain_inf_on_one_rank(mesh, m, "raise"),
}


def worker(rank: int, port: int, out: str, only: list[str]) -> None:
    join_gloo(rank, port, WORLD, timeout_s=20)
    mesh = init_device_mesh("cpu", (WORLD,))
    cases = CaseResults(Path(out) / f"results_rank{rank}.json", only)
    for name, case in CASES.items():
        cases.judge(name, case, mesh)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def main() -> None:
    worker_main(worker, world=WORLD)


if __name__ == "__main__":
    main()
