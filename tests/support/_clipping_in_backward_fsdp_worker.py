"""The 2-process half of test_clipping_in_backward.py: FSDP2 (gloo, the CPU as device) with freed DTensor gradients.

Run as ``python tests/support/_clipping_in_backward_fsdp_worker.py --out DIR``: two ranks run every case of ``CASES`` in turn and
write ``DIR/results_rank{r}.json`` = ``{case: {"ok": bool, "error": str, "measured": {...}}}``. A case trains
FSDP2 + OffloadAdamW(offload_gradients=True, ...) and FSDP2 + torch.optim.AdamW(fused=True) from the same
initialisation with the same user calls, and requires every local shard bitwise equal (or, where the case
says so, a clear error).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _distributed_common import CaseResults, join_gloo, worker_main
from configs import same_bits
from offload_adamw import OffloadAdamW, OffloadGradScaler

WORLD = 2
BLOCKS = 4
WIDTH = 32
ROWS = 64
STEPS = 3
LR = 1e-2
WEIGHT_DECAY = 0.1
CLIP = 0.05


class Net(nn.Module):
    """Sharded blocks, a root-level head (its group lands in FSDP2's final callback), an optional branch."""

    def __init__(self) -> None:
        super().__init__()
        state = torch.random.get_rng_state()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(BLOCKS)
        )
        self.head = nn.Linear(WIDTH, WIDTH)
        self.branch = nn.Linear(WIDTH, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        torch.random.set_rng_state(state)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        x = self.head(x)
        for block in self.blocks:
            x = x + block(x)
        x = x + self.frozen(x)
        if use_branch:
            x = x + self.branch(x)
        return x


def sharded(mesh, **kw) -> Net:
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model.branch, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def batch(step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + dist.get_rank())
    return torch.randn(ROWS, WIDTH, generator=g)


def loss_of(model, step: int, micro: int = 0, **kw) -> torch.Tensor:
    return model(batch(step, micro), **kw).square().mean()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def differing(reference, model) -> list[str]:
    out = []
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        a, b = local(p.detach()), local(q.detach())
        if not same_bits(a, b):
            out.append(f"{name}: max |diff| {(a.float() - b.float()).abs().max().item():.3g}")
    return out


def both(mesh, script: Callable, ours_kw: dict, model_kw: dict | None = None, measured: dict | None = None) -> list[str]:
    """``script(model, opt, ours)`` on FSDP2 + torch's AdamW(fused) and on FSDP2 + OffloadAdamW: what differs."""
    model_kw = model_kw or {}
    reference = sharded(mesh, **model_kw)
    theirs = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR,
                               weight_decay=WEIGHT_DECAY, fused=True)
    script(reference, theirs, False)
    model = sharded(mesh, **model_kw)
    ours = OffloadAdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY,
                        offload_gradients=True, **ours_kw)
    script(model, ours, True)
    return differing(reference, model)


def plain_steps(clip_in_script: bool, zero: Callable | None = None, use_branch: Callable[[int], bool] = lambda s: True):
    def script(model, opt, ours):
        for step in range(STEPS):
            loss_of(model, step, use_branch=use_branch(step)).backward()
            if clip_in_script and not ours:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            (zero or (lambda m, o: o.zero_grad()))(model, opt)
    return script


# ----------------------------------------------------------------------------- the cases


def case_model_zero_grad(mesh, measured):
    return both(mesh, plain_steps(False, zero=lambda m, o: m.zero_grad()), {})


def case_uib_model_zero_grad(mesh, measured):
    return both(mesh, plain_steps(True, zero=lambda m, o: m.zero_grad()), {"update_in_backward": True, "max_grad_norm": CLIP})


def case_uib_model_zero_grad_unclipped(mesh, measured):
    return both(mesh, plain_steps(False, zero=lambda m, o: m.zero_grad()), {"update_in_backward": True})


def case_zero_grad_keep_zeros(mesh, measured):
    return both(mesh, plain_steps(False, zero=lambda m, o: o.zero_grad(set_to_none=False)), {})


def case_uib_zero_grad_keep_zeros(mesh, measured):
    """update_in_backward + zero_grad(set_to_none=False): FSDP2 then adds into the stand-in (p.grad exists)."""
    try:
        return both(mesh, plain_steps(False, zero=lambda m, o: o.zero_grad(set_to_none=False)), {"update_in_backward": True})
    except RuntimeError as error:
        measured["error"] = str(error)
        if "set_to_none" not in str(error):
            return [f"confusing error: {error}"]
        return []


def case_uib_first_step_reduce_each_micro_batch(mesh, measured):
    """Two micro-batches reduced each (FSDP2's default) before the first step, under update_in_backward."""
    def script(model, opt, ours):
        for micro in range(2):
            (loss_of(model, 0, micro) / 2).backward()
        opt.step()
        opt.zero_grad()
    try:
        return both(mesh, script, {"update_in_backward": True})
    except RuntimeError as error:
        measured["error"] = str(error)
        if "set_requires_gradient_sync" not in str(error):
            return [f"confusing error: {error}"]
        return []


def case_uib_clip_branch_sometimes(mesh, measured):
    """Clipping during backward; a group that gets no gradient in step 1 and one again in step 2; a frozen layer."""
    return both(mesh, plain_steps(True, use_branch=lambda s: s != 1), {"update_in_backward": True, "max_grad_norm": CLIP})


def case_uib_clip_reshard_false(mesh, measured):
    return both(mesh, plain_steps(True), {"update_in_backward": True, "max_grad_norm": CLIP},
                model_kw={"reshard_after_forward": False})


def case_uib_clip_mixed_precision(mesh, measured):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return both(mesh, plain_steps(True), {"update_in_backward": True, "max_grad_norm": CLIP}, model_kw={"mp_policy": policy})


def case_freed_mixed_precision_bf16_reduce(mesh, measured):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    return both(mesh, plain_steps(True), {"max_grad_norm": CLIP}, model_kw={"mp_policy": policy})


class CheckpointedNet(Net):
    """Net with every block under reentrant activation checkpointing (nested backwards)."""

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        x = self.head(x)
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        return x + self.frozen(x) + (self.branch(x) if use_branch else 0)


def case_uib_clip_reentrant_checkpointing(mesh, measured):
    global Net
    plain = Net
    Net = CheckpointedNet  # sharded() builds Net
    try:
        return both(mesh, plain_steps(True), {"update_in_backward": True, "max_grad_norm": CLIP})
    finally:
        Net = plain


def case_uib_clip_root_only(mesh, measured):
    """fully_shard on the root alone: every gradient lands in FSDP2's final callback, one group."""
    def script(model, opt, ours):
        plain_steps(True)(model, opt, ours)

    reference = Net()
    fully_shard(reference, mesh=mesh)
    theirs = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR,
                               weight_decay=WEIGHT_DECAY, fused=True)
    script(reference, theirs, False)
    model = Net()
    fully_shard(model, mesh=mesh)
    ours = OffloadAdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY,
                        offload_gradients=True, update_in_backward=True, max_grad_norm=CLIP)
    script(model, ours, True)
    timeline = ours.last_step_timeline()
    measured["buckets"] = None if timeline is None else len(timeline.buckets)
    return differing(reference, model)


def case_uib_clip_blocks_only(mesh, measured):
    """fully_shard on each block but not on the root: every block is a root with its own final callback."""
    def build():
        model = Net()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model.head, mesh=mesh)
        fully_shard(model.branch, mesh=mesh)
        return model

    def script(model, opt, ours):
        plain_steps(True)(model, opt, ours)

    reference = build()
    theirs = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR,
                               weight_decay=WEIGHT_DECAY, fused=True)
    script(reference, theirs, False)
    model = build()
    ours = OffloadAdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY,
                        offload_gradients=True, update_in_backward=True, max_grad_norm=CLIP)
    script(model, ours, True)
    return differing(reference, model)


def case_opt_clip_grad_norm_is_global(mesh, measured):
    norms = {}

    def script(model, opt, ours):
        loss_of(model, 0).backward()
        norm = opt.clip_grad_norm_(CLIP) if ours else torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        norms[ours] = float(local(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
    out = both(mesh, script, {})
    measured["norms"] = norms
    if norms[True] != norms[False]:
        out.append(f"opt.clip_grad_norm_ {norms[True]} != torch's {norms[False]}")
    return out


def case_gradient_of_a_sharded_parameter(mesh, measured):
    """opt.gradient(p) of a DTensor parameter: this rank's shard of the gradient, torch's p.grad.to_local()."""
    grads = {}

    def script(model, opt, ours):
        loss_of(model, 0).backward()
        p = model.head.weight
        grads[ours] = (opt.gradient(p) if ours else local(p.grad)).clone()
        opt.step()
    out = both(mesh, script, {})
    if not torch.equal(grads[True], grads[False]):
        out.append(f"opt.gradient(p) {tuple(grads[True].shape)} is not torch's p.grad.to_local() {tuple(grads[False].shape)}")
    return out


def case_nonfinite_on_one_rank(mesh, measured):
    """An inf in one rank's gradient shard only: nonfinite='skip' skips the step on every rank."""
    reference = sharded(mesh)
    model = sharded(mesh)
    ours = OffloadAdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY,
                        offload_gradients=True, nonfinite="skip")
    theirs = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR,
                               weight_decay=WEIGHT_DECAY, fused=True)
    for step in range(2):
        loss_of(reference, step).backward()
        if step == 0:
            theirs.step()  # torch's AdamW has no skip: the poisoned step is left out of the reference
        theirs.zero_grad()
        loss_of(model, step).backward()
        if step == 1 and dist.get_rank() == 0:
            ours.gradient(model.head.bias)[0] = float("inf")
        ours.step()
        ours.zero_grad()
    measured["skipped"] = ours.skipped_steps
    out = differing(reference, model)
    if ours.skipped_steps != 1:
        out.append(f"skipped {ours.skipped_steps} steps on rank {dist.get_rank()}")
    return out


def case_nonfinite_raise_on_one_rank(mesh, measured):
    """An inf in one rank's shard only: nonfinite='raise' raises on every rank, before any update."""
    model = sharded(mesh)
    ours = OffloadAdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY,
                        offload_gradients=True, nonfinite="raise")
    loss_of(model, 0).backward()
    if dist.get_rank() == 0:
        ours.gradient(model.head.bias)[0] = float("inf")
    before = [local(p.detach()).clone() for p in model.parameters()]
    try:
        ours.step()
    except FloatingPointError as error:
        measured["error"] = str(error)
    else:
        return [f"no FloatingPointError on rank {dist.get_rank()}"]
    if any(not torch.equal(a, local(p.detach())) for a, p in zip(before, model.parameters())) or ours.state:
        return ["the refused step changed something"]
    return []


def case_scaler_inf_on_one_rank(mesh, measured):
    """OffloadGradScaler: an inf in one rank's shard only must skip the step on every rank (torch's does: DTensor)."""
    def script(model, opt, ours):
        scaler = (OffloadGradScaler if ours else torch.amp.GradScaler)("cpu", init_scale=2.0 ** 10)
        for step in range(2):
            model.zero_grad()
            opt.zero_grad()
            loss = loss_of(model, step)
            scaler.scale(loss).backward()
            if step == 1:
                # an inf in the gradient shard of one rank only, written where each optimizer reads it
                p = model.head.bias
                if dist.get_rank() == 0:
                    grad = opt.gradient(p) if ours else local(p.grad)
                    grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        measured["scale" + ("_ours" if ours else "_torch")] = float(scaler.get_scale())
    out = both(mesh, script, {})
    if measured["scale_ours"] != measured["scale_torch"]:
        out.append(f"scale {measured['scale_ours']} != torch's {measured['scale_torch']} on rank {dist.get_rank()}")
    return out


def case_dcp_resume_with_freed_gradients(mesh, measured):
    """get/set_optimizer_state_dict (DCP) with freed DTensor gradients present, then one more step: torch's."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    reference = sharded(mesh)
    theirs = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR,
                               weight_decay=WEIGHT_DECAY, fused=True)
    for step in range(STEPS):
        loss_of(reference, step).backward()
        theirs.step()
        theirs.zero_grad()

    model = sharded(mesh)
    ours = OffloadAdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY,
                        offload_gradients=True)
    for step in range(STEPS - 1):
        loss_of(model, step).backward()
        ours.step()
        if step < STEPS - 2:
            ours.zero_grad()  # the last one is saved with its freed gradients still in p.grad
    saved = get_optimizer_state_dict(model, ours)
    fresh = sharded(mesh)
    with torch.no_grad():
        for p, q in zip(fresh.parameters(), model.parameters()):
            local(p).copy_(local(q))
    fresh_opt = OffloadAdamW([p for p in fresh.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY,
                             offload_gradients=True)
    set_optimizer_state_dict(fresh, fresh_opt, saved)
    loss_of(fresh, STEPS - 1).backward()
    fresh_opt.step()
    return differing(reference, fresh)


def case_gradient_assigned_by_hand(mesh, measured):
    """A DTensor gradient assigned to p.grad after backward (freed mode), then torch's clipping and the step."""
    def script(model, opt, ours):
        for step in range(2):
            loss_of(model, step).backward()
            p = model.head.weight
            p.grad = torch.ones_like(p) * 0.5  # a DTensor, as p
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    return both(mesh, script, {})


def case_uib_clip_gradient_assigned_by_hand_on_the_first_step(mesh, measured):
    """update_in_backward + max_grad_norm, a DTensor gradient set by hand before the first step: the step clips as torch."""
    def script(model, opt, ours):
        for step in range(STEPS):
            loss_of(model, step).backward()
            if step == 0:
                model.head.weight.grad = torch.ones_like(model.head.weight) * 0.5
            if not ours:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    return both(mesh, script, {"update_in_backward": True, "max_grad_norm": CLIP})


def case_uib_clip_frozen_parameters_given_to_the_optimizer(mesh, measured):
    """model.parameters() with a frozen layer in them, as most loops pass them."""
    reference = sharded(mesh)
    theirs = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    plain_steps(True)(reference, theirs, False)
    model = sharded(mesh)
    ours = OffloadAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, offload_gradients=True,
                        update_in_backward=True, max_grad_norm=CLIP)
    plain_steps(True)(model, ours, True)
    pipeline = ours.transfer_pipeline
    measured["armed"] = pipeline is not None and pipeline.armed()
    out = differing(reference, model)
    if not measured["armed"]:
        out.append("the next step's updates wait for step()")
    return out


CASES = {
    "model_zero_grad_between_steps_is_torch": case_model_zero_grad,
    "zero_grad_set_to_none_false_is_torch": case_zero_grad_keep_zeros,
    "uib_clip_model_zero_grad_after_each_step_is_torch": case_uib_model_zero_grad,
    "uib_model_zero_grad_after_each_step_is_torch": case_uib_model_zero_grad_unclipped,
    "uib_zero_grad_set_to_none_false_is_torch_or_refused_naming_set_to_none": case_uib_zero_grad_keep_zeros,
    "uib_reduce_per_micro_batch_is_refused_naming_set_requires_gradient_sync": case_uib_first_step_reduce_each_micro_batch,
    "uib_clip_with_a_group_skipped_in_one_step_and_a_frozen_layer_is_torch": case_uib_clip_branch_sometimes,
    "uib_clip_reshard_after_forward_false_is_torch": case_uib_clip_reshard_false,
    "uib_clip_bf16_params_fp32_reduce_is_torch": case_uib_clip_mixed_precision,
    "uib_clip_reentrant_checkpointing_is_torch": case_uib_clip_reentrant_checkpointing,
    "uib_clip_root_only_fully_shard_is_torch": case_uib_clip_root_only,
    "uib_clip_with_frozen_parameters_given_to_the_optimizer_is_torch": case_uib_clip_frozen_parameters_given_to_the_optimizer,
    "uib_clip_fully_shard_without_root_is_torch": case_uib_clip_blocks_only,
    "freed_clip_bf16_params_bf16_reduce_is_torch": case_freed_mixed_precision_bf16_reduce,
    "opt_clip_grad_norm_is_the_global_norm": case_opt_clip_grad_norm_is_global,
    "opt_gradient_of_a_sharded_parameter_is_this_ranks_shard": case_gradient_of_a_sharded_parameter,
    "nonfinite_skip_with_inf_on_one_rank_skips_every_rank": case_nonfinite_on_one_rank,
    "nonfinite_raise_with_inf_on_one_rank_raises_on_every_rank": case_nonfinite_raise_on_one_rank,
    "offload_grad_scaler_with_inf_on_one_rank_skips_every_rank": case_scaler_inf_on_one_rank,
    "dcp_get_set_optimizer_state_dict_with_freed_gradients_resumes_exactly": case_dcp_resume_with_freed_gradients,
    "dtensor_gradient_assigned_by_hand_then_clipped_is_torch": case_gradient_assigned_by_hand,
    "uib_clip_dtensor_gradient_assigned_by_hand_before_the_first_step_is_torch":
        case_uib_clip_gradient_assigned_by_hand_on_the_first_step,
}


def worker(rank: int, port: int, out: str, only: list[str]) -> None:
    join_gloo(rank, port, WORLD, timeout_s=60)
    mesh = init_device_mesh("cpu", (WORLD,))
    cases = CaseResults(Path(out) / f"results_rank{rank}.json", only)
    for name, case in CASES.items():
        cases.judge(name, case, mesh)
    dist.destroy_process_group()


def main() -> None:
    worker_main(worker, world=WORLD)


if __name__ == "__main__":
    main()
