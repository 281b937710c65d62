"""The 2-process half of test_wrappers_distributed.py: OffloadAdamW's transfer pipeline under real DDP and FSDP2 (gloo, CPU).

Run as ``python tests/support/_wrappers_distributed_worker.py --out DIR [--quick]``: two ranks, one process group, every
case in turn; each rank writes ``DIR/ddp_rank{r}.json`` = ``{case: {"ok": bool, "error": str}}``.

A case trains DDP + OffloadAdamW (pipeline with the CPU as device) and DDP + torch.optim.AdamW(fused=True)
on the same batches with the same calls and requires bitwise equal parameters and states, and equal
replicas on both ranks. Cases: gradients kept / freed x bucket views off / on x accumulation 1 / 4
(``no_sync`` for all micro-batches but the last) x static_graph, plus clipping with
``torch.nn.utils.clip_grad_norm_`` on the model and ``model.zero_grad()``; and the refusals: freed
gradients with an unattached DDP model, freed accumulation without ``no_sync``. FSDP2: the pipeline with
kept gradients (the hooks FSDP2 calls on each shard after its reduce-scatter) against FSDP2 + torch's AdamW,
accumulation 1 and 4, clipping on the model (the global norm).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _distributed_common import LR, WEIGHT_DECAY, TinyCausalLM, batch, full_params, loss_of, spawn_ranks
from offload_adamw import OffloadAdamW

WORLD = 2
STEPS = 4
CASES = [
    dict(freed=freed, bucket_view=view, accumulate=acc, static_graph=static, clip=clip)
    for freed in (False, True)
    for view in (False, True)
    for acc in (1, 4)
    for static in (False, True)
    for clip in (False, True)
    # torch's DDP itself fails an internal assert with static_graph and no_sync in the first iteration
    if not (static and (clip or acc > 1))
]
# torch.amp.GradScaler (unscale_, clip, step, update; one step with inf skipped), both modes
CASES += [
    dict(freed=freed, bucket_view=True, accumulate=2, static_graph=False, clip=True, scaler=True) for freed in (False, True)
]
#: The cases CI runs (the whole matrix is the slow test): every mode, bucket setting and accumulation at least once.
QUICK = {
    "kept-copies-acc1", "kept-views-acc4", "freed-copies-acc4-clip",
    "freed-views-acc1", "freed-views-acc4", "freed-copies-acc1-static", "freed-views-acc2-clip-scaler",
}


def case_name(c: dict) -> str:
    return "{}-{}-acc{}{}{}".format(
        "freed" if c["freed"] else "kept", "views" if c["bucket_view"] else "copies", c["accumulate"],
        "-static" if c["static_graph"] else "", "-clip" if c["clip"] else "",
    ) + ("-scaler" if c.get("scaler") else "")


def train(case: dict, ours: bool, group) -> tuple[dict, dict]:
    ddp = DistributedDataParallel(
        TinyCausalLM(0), process_group=group, gradient_as_bucket_view=case["bucket_view"], static_graph=case["static_graph"],
    )
    if ours:
        opt = OffloadAdamW(
            ddp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, transfer_pipeline=True, offload_gradients=case["freed"]
        )
        opt.attach(ddp)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    rank = dist.get_rank()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if case.get("scaler") else None
    for step in range(STEPS):
        for micro in range(case["accumulate"]):
            last = micro == case["accumulate"] - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = loss_of(ddp, batch(step * 8 + micro, rank))
                if scaler is not None and step == 2:
                    loss = loss * float("inf")  # a step GradScaler must skip, on both ranks
                (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if case["clip"]:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        ddp.zero_grad()  # the model's zero_grad, as HF Trainer calls it
    names = [n.removeprefix("module.") for n, _ in ddp.named_parameters()]
    states = {}
    for i, p in enumerate(ddp.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            states[f"{names[i]}.{key}"] = opt.state[p][key].detach().clone()
    return full_params(ddp), states


def check_case(case: dict, group) -> None:
    ours_p, ours_s = train(case, True, group)
    ref_p, ref_s = train(case, False, group)
    bad = [k for k in ref_p if not torch.equal(ours_p[k], ref_p[k])]
    bad += [k for k in ref_s if not torch.equal(ours_s[k], ref_s[k])]
    assert not bad, f"differs from DDP + torch AdamW(fused=True): {bad[:4]}"
    flat = torch.cat([v.reshape(-1) for v in ours_p.values()])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat, group=group)
    assert torch.equal(gathered[0], gathered[1]), "the replicas differ between ranks"


def check_unattached_freed_refused(group) -> None:
    ddp = DistributedDataParallel(TinyCausalLM(0), process_group=group)
    opt = OffloadAdamW(ddp.parameters(), lr=LR, transfer_pipeline=True, offload_gradients=True)
    try:
        loss_of(ddp, batch(0, dist.get_rank())).backward()
    except RuntimeError as e:
        assert "opt.attach(ddp_model)" in str(e), str(e)
    else:
        raise AssertionError("freed gradients under an unattached DDP model were not refused")
    assert not opt.state


def check_unattached_kept_refetches(group) -> None:
    runs = []
    for ours in (True, False):
        ddp = DistributedDataParallel(TinyCausalLM(0), process_group=group, gradient_as_bucket_view=True)
        if ours:
            opt = OffloadAdamW(ddp.parameters(), lr=LR, transfer_pipeline=True)
        else:
            opt = torch.optim.AdamW(ddp.parameters(), lr=LR, fused=True)
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                loss_of(ddp, batch(step, dist.get_rank())).backward()
                opt.step()
                opt.zero_grad()
        if ours:
            assert any("opt.attach(ddp_model)" in str(w.message) for w in caught), "no warning for the unattached DDP model"
        runs.append(full_params(ddp))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def check_freed_accumulation_without_no_sync_refused(group) -> None:
    ddp = DistributedDataParallel(TinyCausalLM(0), process_group=group)
    opt = OffloadAdamW(ddp.parameters(), lr=LR, transfer_pipeline=True, offload_gradients=True)
    opt.attach(ddp)
    loss_of(ddp, batch(0, dist.get_rank())).backward()
    try:
        loss_of(ddp, batch(1, dist.get_rank())).backward()
    except RuntimeError as e:
        assert "no_sync" in str(e), str(e)
    else:
        raise AssertionError("a second synchronised backward onto freed gradients was not refused")
    assert not opt.state


def _fsdp_train(ours: bool, accumulation: int, clip: bool, mesh, freed: bool = False) -> dict:
    model = TinyCausalLM(0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if ours:
        opt = OffloadAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, transfer_pipeline=True,
                           offload_gradients=freed)
        assert opt.transfer_pipeline is not None
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    rank = dist.get_rank()
    for step in range(STEPS):
        for micro in range(accumulation):
            loss_of(model, batch(step * 8 + micro, rank)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    states = {}
    for i, p in enumerate(model.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            value = opt.state[p][key]
            states[f"{i}.{key}"] = (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
    return {**full_params(model), **states}


def check_fsdp(accumulation: int, clip: bool, mesh, freed: bool = False) -> None:
    """Kept or freed DTensor gradients; FSDP2 reduces every micro-batch (freed: it accumulates into the stand-in)."""
    ours, ref = _fsdp_train(True, accumulation, clip, mesh, freed), _fsdp_train(False, accumulation, clip, mesh)
    bad = [k for k in ref if not torch.equal(ours[k], ref[k])]
    assert not bad, f"FSDP2 + pipeline differs from FSDP2 + torch AdamW(fused=True): {bad[:4]}"


def worker(rank: int, port: int, out: str, quick: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD
    results: dict[str, dict] = {}

    def run(name, fn, *args):
        try:
            fn(*args)
            results[name] = {"ok": True, "error": ""}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        with contextlib.suppress(Exception):
            dist.barrier()

    for case in CASES:
        if not quick or case_name(case) in QUICK:
            run(case_name(case), check_case, case, group)
    run("unattached_kept_refetches", check_unattached_kept_refetches, group)
    run("unattached_freed_refused", check_unattached_freed_refused, group)
    run("freed_accumulation_without_no_sync_refused", check_freed_accumulation_without_no_sync_refused, group)
    mesh = init_device_mesh("cpu", (WORLD,))
    for accumulation, clip in ((1, True), (4, False)) if quick else ((1, False), (1, True), (4, False), (4, True)):
        run(f"fsdp-kept-acc{accumulation}{'-clip' if clip else ''}", check_fsdp, accumulation, clip, mesh)
    for accumulation, clip in ((4, True),) if quick else ((1, False), (1, True), (4, False), (4, True)):
        run(f"fsdp-freed-acc{accumulation}{'-clip' if clip else ''}", check_fsdp, accumulation, clip, mesh, True)
    (Path(out) / f"ddp_rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="only the QUICK cases and the refusals")
    args = parser.parse_args()
    spawn_ranks(worker, args.out, args.quick, world=WORLD)


if __name__ == "__main__":
    main()
