"""The 2-process half of test_distributed.py: real torch.distributed (gloo, CPU), FSDP2, DDP and DCP.

Run as ``python tests/support/_distributed_worker.py --out DIR [--ckpt-w1 DIR]``: it spawns two
ranks that share one process group for all checks (gloo start-up is the slow
part), runs every check in turn and writes ``DIR/results_rank{r}.json``:
``{check: {"ok": bool, "error": str, "measured": {...}}}``. A check that fails
records its traceback and the run goes on with the next one.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _distributed_common import ATOL, LR, RTOL, STEPS, WEIGHT_DECAY, TinyCausalLM, batch, full_params, loss_of, spawn_ranks, train
from offload_adamw import OffloadAdamW, StateDictMismatch

WORLD = 2
RESUME_AT, RESUME_END = 3, 6
RESUME_CLIP = 0.05  # torch's clip_grad_norm_ before each step of the default-kernel resume (check_dcp_resume)


def sharded(seed: int, mesh) -> torch.nn.Module:
    """The FSDP2 way: each block is a unit, the root takes the rest (embedding, norm, head)."""
    model = TinyCausalLM(seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def torch_adamw(model, kind: str) -> torch.optim.Optimizer:
    flags = {"fused": {"fused": True}, "single": {"foreach": False, "fused": False}}[kind]
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **flags)


def offload_adamw(model, kind: str, **kw) -> OffloadAdamW:
    """``kind`` "single": the for-loop update (fused=False); "fused": fused=True; "default": fused=None."""
    fused = {"single": False, "fused": True, "default": None}[kind]
    return OffloadAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=fused, **kw)


def full_states(model, optimizer) -> dict[str, torch.Tensor]:
    """name.key -> whole tensor, from the optimizer's own state_dict (DTensors gathered)."""
    names = [n.removeprefix("module.") for n, _ in model.named_parameters()]
    sd = optimizer.state_dict()
    out = {}
    for pid, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensor = value.full_tensor() if isinstance(value, DTensor) else value
                out[f"{names[pid]}.{key}"] = tensor.detach().clone()
    return out


def local_states_equal(ours: tuple, theirs: tuple) -> bool:
    """This rank's shards of (model, OffloadAdamW) and (model, torch AdamW): states bitwise equal."""
    (model_a, opt_a), (model_b, opt_b) = ours, theirs
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            b = sb[key].to_local() if isinstance(sb[key], DTensor) else sb[key]
            if not torch.equal(sa[key], b):
                return False
    return True


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[bool, float, bool]:
    """(bitwise equal, max abs difference, allclose with the project's fp32 tolerances)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    bitwise = all(torch.equal(a[k], b[k]) for k in a)
    worst = max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)
    close = all(torch.allclose(a[k], b[k], rtol=RTOL, atol=ATOL) for k in a)
    return bitwise, worst, close


# --------------------------------------------------------------------------- checks


def check_fsdp_parity(rank, mesh, measured):
    """FSDP2 + OffloadAdamW against torch's FSDP2 + AdamW and against single-process AdamW, 20 steps.

    Two data layouts: "split" (each rank its own rows: the real use) and
    "replicated" (every rank the whole batch, so that the reduced gradient is
    bitwise the single-process one and only the optimizer can make a difference).

    What is held: OffloadAdamW bitwise equal to torch's AdamW under the same
    FSDP2 sharding (parameters and states, every step); against one process,
    bitwise wherever torch's own FSDP2 run is bitwise, else the loss curve
    within fp32 tolerances. Not even torch's FSDP2 + AdamW(fused=True) keeps
    the parameters within fp32 tolerances of one process over 20 steps (split
    data: Adam divides by sqrt(v), so near-zero gradients summed in another
    order move their elements by up to lr; replicated data: the fused CPU
    kernel rounds shard-sized tensors differently, and 20 steps compound it),
    so the parameter gap is measured and reported: it is torch's own gap.
    """
    for layout in ("split", "replicated"):
        data_rank = rank if layout == "split" else None
        runs = {}
        # split data only with the default fused update (the layout users run); replicated with both updates.
        kinds = ("fused",) if layout == "split" else ("fused", "single")
        for kind in kinds:
            runs[f"ref_{kind}"] = (m := TinyCausalLM(0), torch_adamw(m, kind), None)
            runs[f"fsdp_torch_{kind}"] = (m := sharded(0, mesh), torch_adamw(m, kind), data_rank)
            runs[f"fsdp_ours_{kind}"] = (m := sharded(0, mesh), offload_adamw(m, kind), data_rank)
        first_difference: dict[str, int | None] = {}
        worst: dict[str, float] = {}
        worst_loss: dict[str, float] = {}
        for step in range(STEPS):
            losses = {}
            for name, (model, opt, r) in runs.items():
                (loss,) = train(model, opt, range(step, step + 1), r)
                if name.startswith("fsdp") and layout == "split":
                    total = torch.tensor(loss, dtype=torch.float64)
                    dist.all_reduce(total)
                    loss = float(total) / WORLD  # the mean over all rows, as one process computes it
                losses[name] = loss
            params = {name: full_params(model) for name, (model, _, _) in runs.items()}
            for kind in kinds:
                # Same shards, same gradients: OffloadAdamW must be torch's AdamW bit for bit, params and state.
                # Compared shard by shard (the same layout on both sides), then agreed over the ranks.
                mine, theirs = runs[f"fsdp_ours_{kind}"], runs[f"fsdp_torch_{kind}"]
                bitwise, gap, _ = diff(params[f"fsdp_ours_{kind}"], params[f"fsdp_torch_{kind}"])
                assert bitwise, f"{layout}/{kind} step {step}: FSDP2 OffloadAdamW != FSDP2 torch AdamW (max {gap})"
                same = torch.tensor([float(local_states_equal(mine[:2], theirs[:2]))])
                dist.all_reduce(same, op=dist.ReduceOp.MIN)
                assert same.item() == 1.0, f"{layout}/{kind} step {step}: states differ from torch's on some rank"
                for who in ("torch", "ours"):
                    pair = f"{layout}/{kind}/fsdp_{who}_vs_single_process"
                    bitwise, gap, close = diff(params[f"fsdp_{who}_{kind}"], params[f"ref_{kind}"])
                    worst[pair] = max(worst.get(pair, 0.0), gap)
                    if not bitwise and first_difference.get(pair) is None:
                        first_difference[pair] = step
                    first_difference.setdefault(pair, None)
                    a, b = losses[f"fsdp_{who}_{kind}"], losses[f"ref_{kind}"]
                    worst_loss[pair] = max(worst_loss.get(pair, 0.0), abs(a - b))
                    assert abs(a - b) <= ATOL + RTOL * abs(b), f"{pair} step {step}: loss {a} vs {b}"
        for kind in kinds:
            torch_pair = f"{layout}/{kind}/fsdp_torch_vs_single_process"
            ours_pair = f"{layout}/{kind}/fsdp_ours_vs_single_process"
            # Bitwise wherever torch's own FSDP2 is bitwise against one process (else the tolerances above).
            if first_difference[torch_pair] is None:
                assert first_difference[ours_pair] is None, f"{ours_pair}: torch is bitwise here, ours is not"
        measured[layout] = {
            "first_non_bitwise_step": first_difference,
            "max_abs_param_diff": worst,
            "max_abs_loss_diff": worst_loss,
        }
    return runs  # the last layout's runs, reused by the host-bytes check


def check_host_bytes(rank, mesh, measured, runs):
    """Host bytes per rank = this rank's shards only; summed over ranks = the single-process total."""
    model, opt, _ = runs["fsdp_ours_fused"]
    mine = opt.host_state_bytes()
    expected_mine = sum(p.to_local().numel() * 4 * 2 + 4 for p in model.parameters())  # exp_avg, exp_avg_sq, step
    assert mine == expected_mine, f"rank {rank}: {mine} host bytes, its shards need {expected_mine}"
    # The host-memory pre-flight bills the same local shards, not the global tensors.
    from offload_adamw.optim.preflight import state_bill

    every_param = [(g, i) for g in opt.param_groups for i in range(len(g["params"]))]
    billed = state_bill(every_param, pin_memory=False).total
    assert billed == mine, f"rank {rank}: pre-flight bills {billed} bytes, the rank allocated {mine}"
    single = TinyCausalLM(0)
    single_opt = offload_adamw(single, "fused")
    train(single, single_opt, range(1), None)
    total = single_opt.host_state_bytes()
    every = [None] * WORLD
    dist.all_gather_object(every, mine)
    assert sum(every) == total + 4 * len(list(single.parameters())) * (WORLD - 1), (every, total)
    measured.update(per_rank=every, single_process=total, fraction=[b / total for b in every])


def check_state_dict_is_global(rank, mesh, measured, runs):
    """No plain local tensor can end up in the state_dict of sharded parameters, nor be loaded as one."""
    model, opt, _ = runs["fsdp_ours_fused"]
    params = list(model.parameters())
    sd = opt.state_dict()
    for pid, state in sd["state"].items():
        p = params[pid]
        for key, value in state.items():
            if key == "step":
                assert not isinstance(value, DTensor) and value.dim() == 0
                continue
            assert isinstance(value, DTensor), f"{key} of parameter {pid} is a plain {type(value).__name__}"
            assert value.shape == p.shape and value.placements == p.placements and value.device_mesh == p.device_mesh
            assert torch.equal(value.to_local(), opt.state[p][key]), "the DTensor must wrap the host state itself"
    # A state of the wrong shape is refused by name, not wrapped or passed through.
    victim = params[0]
    saved = opt.state[victim]["exp_avg"]
    opt.state[victim]["exp_avg"] = torch.zeros(3)
    try:
        opt.state_dict()
        raise AssertionError("a state that is no shard of its parameter went into the state_dict")
    except RuntimeError as err:
        assert "exp_avg" in str(err) and "plain local tensor" in str(err), err
    finally:
        opt.state[victim]["exp_avg"] = saved
    # Plain local tensors offered to load_state_dict: refused for every unevenly or evenly sharded parameter,
    # and nothing changes.
    local_sd = {"param_groups": sd["param_groups"], "state": {
        pid: {k: (v.to_local().clone() if isinstance(v, DTensor) else v) for k, v in state.items()}
        for pid, state in sd["state"].items()
    }}
    before = full_states(model, opt)
    try:
        opt.load_state_dict(local_sd)
        raise AssertionError("plain local tensors were loaded as if they were whole tensors")
    except StateDictMismatch as err:
        measured["refused_problems"] = len(err.problems)
        assert len(err.problems) == 2 * len(params), err
    assert diff(before, full_states(model, opt))[0]
    # A state_dict round trip through DTensors changes nothing (each rank keeps its own shard).
    opt.load_state_dict(sd)
    assert diff(before, full_states(model, opt))[0]
    # A consolidated (plain, global-shape) state_dict of one process loads as each rank's slice of it.
    single = TinyCausalLM(0)
    single_opt = offload_adamw(single, "fused")
    train(single, single_opt, range(2), None)
    opt.load_state_dict(single_opt.state_dict())
    assert diff(full_states(model, opt), full_states(single, single_opt))[0], "global plain tensors were not sliced"
    for p in params:
        assert opt.state[p]["exp_avg"].shape == p.to_local().shape


def check_full_state_dict(rank, mesh, measured, runs):
    """StateDictOptions(full_state_dict=True): consolidated on rank 0, then broadcast back into fresh shards."""
    model, opt, _ = runs["fsdp_ours_fused"]
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_optimizer_state_dict(model, opt, options=options)
    expected = full_states(model, opt)
    if rank == 0:
        for name, state in full["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                value = state[key]
                assert type(value) is torch.Tensor and torch.equal(value, expected[f"{name}.{key}"]), f"{name}.{key}"
    fresh = sharded(9, mesh)
    fresh_opt = offload_adamw(fresh, "fused")
    set_optimizer_state_dict(
        fresh, fresh_opt, full if rank == 0 else {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    assert diff(full_states(fresh, fresh_opt), expected)[0], "broadcast full state_dict did not land shard by shard"


def check_bf16_masters(rank, mesh, measured, out: Path):
    """bf16 sharded parameters: float32 host masters per shard, saved as DTensors, bitwise one process.

    Replicated data and the for_loop update: the sharded run must equal the
    single-process OffloadAdamW on the same bf16 model bit for bit, masters included.
    """
    single = TinyCausalLM(0).to(torch.bfloat16)
    single_opt = offload_adamw(single, "single")
    train(single, single_opt, range(4), None)
    model = TinyCausalLM(0).to(torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = offload_adamw(model, "single")
    train(model, opt, range(4), None)
    for p in model.parameters():
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and master.shape == p.to_local().shape
        assert torch.equal(master.to(torch.bfloat16), p.to_local()), "the bf16 shard is not its master rounded"
    assert diff(full_params(model), full_params(single))[0], "bf16 sharded parameters != one process"
    assert diff(full_states(model, opt), full_states(single, single_opt))[0], "bf16 sharded states != one process"
    sd = opt.state_dict()
    masters = [state["master_param"] for state in sd["state"].values()]
    assert all(isinstance(m, DTensor) and m.dtype == torch.float32 for m in masters)
    # DCP round trip into a fresh sharded bf16 model: the masters come back exactly, and so does the model.
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=out / "ckpt_bf16")
    fresh = TinyCausalLM(5).to(torch.bfloat16)
    for block in fresh.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    fresh_opt = offload_adamw(fresh, "single")
    state = {"optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=out / "ckpt_bf16")
    set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    assert diff(full_states(fresh, fresh_opt), full_states(model, opt))[0], "bf16 masters/moments after DCP"
    assert diff(full_params(fresh), full_params(model))[0], "loading the masters must write them to the bf16 shards"


def check_dcp_resume(rank, mesh, measured, out: Path, ckpt_w1: Path | None):
    """DCP save at world 2; load 2 -> 2 and 1 -> 2; continue: bitwise the uninterrupted run.

    for_loop update (fused=False) and replicated data: there the sharded and
    the single-process trajectories are bitwise equal (check_fsdp_parity), so a
    run that changes world size midway can be held to the bit.
    """
    ref = TinyCausalLM(0)
    train(ref, torch_adamw(ref, "single"), range(RESUME_END), None)
    expected = full_params(ref)

    model = sharded(0, mesh)
    opt = offload_adamw(model, "single")
    train(model, opt, range(RESUME_AT), None)
    ckpt_w2 = out / "ckpt_w2"
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt_w2)
    train(model, opt, range(RESUME_AT, RESUME_END), None)
    assert diff(full_params(model), expected)[0], "the uninterrupted sharded run left the single-process one"

    sources = {"world2_to_world2": ckpt_w2}
    if ckpt_w1 is not None:
        sources["world1_to_world2"] = ckpt_w1
    for label, ckpt in sources.items():
        fresh = sharded(7, mesh)  # another initialisation: everything must come from the checkpoint
        fresh_opt = offload_adamw(fresh, "single")
        sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
        steps = {float(s["step"]) for s in fresh_opt.state.values()}
        assert steps == {0.0}, f"{label}: DCP's state initialisation counted as an update: steps {steps}"
        dcp.load(sd, checkpoint_id=ckpt)
        set_model_state_dict(fresh, sd["model"])
        set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
        steps = {float(s["step"]) for s in fresh_opt.state.values()}
        assert steps == {float(RESUME_AT)}, f"{label}: loaded steps {steps}"
        assert all(s["exp_avg"].shape == p.to_local().shape for p, s in fresh_opt.state.items()), label
        train(fresh, fresh_opt, range(RESUME_AT, RESUME_END), None)
        bitwise, gap, _ = diff(full_params(fresh), expected)
        measured[label] = gap
        assert bitwise, f"{label}: resumed run differs from the uninterrupted one (max {gap})"

    # The default kernel (torch's fused op) and clipping: saved at world 2 by OffloadAdamW and by torch's
    # AdamW(fused=True) alike, for tests/test_distributed.py to resume both at world 1 and compare.
    for name, make in (("ckpt_w2_offload_default", lambda m: offload_adamw(m, "default")),
                       ("ckpt_w2_torch_fused", lambda m: torch_adamw(m, "fused"))):
        model = sharded(0, mesh)
        opt = make(model)
        train(model, opt, range(RESUME_AT), None, clip=RESUME_CLIP)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=out / name)


def check_checkpoint_metadata(rank, mesh, measured, out: Path):
    """The DCP metadata of the optimizer state holds GLOBAL shapes, written in one chunk per rank.

    The negative control saves the same states as plain local tensors: their
    metadata then shows the local shape, which is what this check would catch.
    """
    model = sharded(0, mesh)
    names = [n for n, _ in model.named_parameters()]
    metadata = dcp.FileSystemReader(str(out / "ckpt_w2")).read_metadata().state_dict_metadata
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            entry = metadata[f"optim.state.{name}.{key}"]
            assert tuple(entry.size) == tuple(p.shape), f"{name}.{key}: {tuple(entry.size)} saved, global {tuple(p.shape)}"
            if p.shape[0] >= WORLD:
                assert len(entry.chunks) == WORLD, f"{name}.{key}: {len(entry.chunks)} chunk(s)"
    opt = offload_adamw(model, "fused")
    train(model, opt, range(1), rank)
    plain = {"optim": {name: opt.state[p]["exp_avg"] for name, p in zip(names, model.parameters())}}
    dcp.save(plain, checkpoint_id=out / "ckpt_plain_local")
    bad = dcp.FileSystemReader(str(out / "ckpt_plain_local")).read_metadata().state_dict_metadata
    wrong = [n for n, p in zip(names, model.parameters()) if tuple(bad[f"optim.{n}"].size) != tuple(p.shape)]
    assert wrong, "the negative control should show local shapes in the metadata"
    measured["plain_local_tensors_with_wrong_global_shape"] = len(wrong)


def check_ddp(rank, mesh, measured):
    """DDP unchanged: states identical on every rank, bitwise torch's DDP + AdamW(fused=True)."""
    group = mesh.get_group()
    runs = {}
    for who in ("ours", "torch"):
        model = DistributedDataParallel(TinyCausalLM(0), process_group=group)
        opt = offload_adamw(model, "fused") if who == "ours" else torch_adamw(model, "fused")
        train(model, opt, range(5), rank)
        runs[who] = (model, opt)
    ours = full_states(*runs["ours"])
    assert diff(ours, full_states(*runs["torch"]))[0], "DDP: states differ from torch's AdamW"
    assert diff(full_params(runs["ours"][0]), full_params(runs["torch"][0]))[0], "DDP: parameters differ"
    flat = torch.cat([ours[k].reshape(-1) for k in sorted(ours)])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat, group=group)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "DDP: host states differ between ranks"
    measured["state_elements_compared"] = flat.numel()


def check_clipping(rank, mesh, measured):
    """Clipping across shards uses the global norm (torch's and OffloadAdamW.clip_grad_norm_)."""
    single = TinyCausalLM(0)
    loss_of(single, batch(0, None)).backward()
    global_norm = torch.nn.utils.get_total_norm([p.grad for p in single.parameters()])
    model = sharded(0, mesh)
    loss_of(model, batch(0, rank)).backward()
    local_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.to_local()) for p in model.parameters()]))
    opt = offload_adamw(model, "fused")
    norm = opt.clip_grad_norm_(0.05)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    measured.update(global_norm=float(global_norm), sharded_norm=float(norm), this_rank_shards_only=float(local_norm))
    assert torch.allclose(norm, global_norm, rtol=RTOL, atol=0), (float(norm), float(global_norm))
    assert not torch.allclose(local_norm, global_norm, rtol=1e-3), "the control: a shard-local norm is not the global one"
    clipped = full_params_grads(model)
    torch.nn.utils.clip_grad_norm_(single.parameters(), 0.05)
    reference = {n: p.grad for n, p in single.named_parameters()}
    assert diff(clipped, reference)[2], "clipped sharded gradients differ from single-process clipping"
    # 20 steps with clipping every step: bitwise torch's FSDP2 + AdamW(fused), within tolerance of one process.
    runs = {
        "ref": (m := TinyCausalLM(0), torch_adamw(m, "fused"), None),
        "fsdp_torch": (m := sharded(0, mesh), torch_adamw(m, "fused"), rank),
        "fsdp_ours": (m := sharded(0, mesh), offload_adamw(m, "fused"), rank),
    }
    losses = {name: train(model, opt, range(STEPS), r, clip=0.05) for name, (model, opt, r) in runs.items()}
    assert diff(full_params(runs["fsdp_ours"][0]), full_params(runs["fsdp_torch"][0]))[0], "clipped: != torch FSDP2"
    assert diff(full_states(*runs["fsdp_ours"][:2]), full_states(*runs["fsdp_torch"][:2]))[0], "clipped: states"
    mean_losses = torch.tensor(losses["fsdp_ours"], dtype=torch.float64)
    dist.all_reduce(mean_losses)
    mean_losses /= WORLD
    reference = torch.tensor(losses["ref"], dtype=torch.float64)
    measured["clipped_max_abs_loss_diff_vs_single_process"] = float((mean_losses - reference).abs().max())
    measured["clipped_max_abs_param_diff_vs_single_process"] = diff(
        full_params(runs["fsdp_ours"][0]), full_params(runs["ref"][0])
    )[1]
    assert torch.allclose(mean_losses, reference, rtol=RTOL, atol=ATOL), (mean_losses, reference)


def full_params_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def check_nonfinite_skip(rank, mesh, measured):
    """nonfinite="skip": a NaN in one rank's shard makes EVERY rank skip the step (no rank drifts)."""
    model = sharded(0, mesh)
    opt = offload_adamw(model, "fused", nonfinite="skip")
    train(model, opt, range(1), rank)
    before = full_states(model, opt)
    loss_of(model, batch(1, rank)).backward()
    if rank == 1:
        model.head.weight.grad.to_local()[0, 0] = float("nan")
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 1, f"rank {rank} did not skip"
    assert diff(before, full_states(model, opt))[0], f"rank {rank}: state changed in a skipped step"


# --------------------------------------------------------------------------- driver


def worker(rank: int, port: int, out: str, ckpt_w1: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the single-process references run in the same thread setting
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (WORLD,))
    out_dir = Path(out)
    results: dict[str, dict] = {}
    shared: dict = {}

    def run(name, fn, *args):
        measured: dict = {}
        started = time.perf_counter()
        try:
            value = fn(rank, mesh, measured, *args)
            results[name] = {"ok": True, "error": "", "measured": measured}
            return value
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc(), "measured": measured}
            return None
        finally:
            with contextlib.suppress(Exception):
                dist.barrier()
            measured["seconds"] = round(time.perf_counter() - started, 2)

    shared["runs"] = run("fsdp_parity", check_fsdp_parity)
    if shared["runs"] is not None:
        run("host_bytes", check_host_bytes, shared["runs"])
        run("state_dict_is_global", check_state_dict_is_global, shared["runs"])
        run("full_state_dict", check_full_state_dict, shared["runs"])
    run("dcp_resume", check_dcp_resume, out_dir, Path(ckpt_w1) if ckpt_w1 else None)
    run("checkpoint_metadata", check_checkpoint_metadata, out_dir)
    run("bf16_masters", check_bf16_masters, out_dir)
    run("ddp", check_ddp)
    run("clipping", check_clipping)
    run("nonfinite_skip", check_nonfinite_skip)
    (out_dir / f"results_rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt-w1", default=None)
    args = parser.parse_args()
    spawn_ranks(worker, args.out, args.ckpt_w1, world=WORLD)


if __name__ == "__main__":
    main()
