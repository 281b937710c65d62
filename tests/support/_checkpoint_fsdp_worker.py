"""The 2-process half of tests/test_checkpoint_fsdp.py: checkpoint.save / load / latest of FSDP2 models (gloo).

Run as ``python tests/support/_checkpoint_fsdp_worker.py --out DIR [--cases CASE...] [--kill STAGE]``. Each rank
writes ``DIR/rank{r}.json``: per case, what it found (``{"ok", "error", "measured"}``, see CaseResults). Cases:

* ``round_trip``: a small FSDP2 model (two units), OffloadAdamW and a scheduler train 2 steps, are saved
  (with ``extra``), train one more; a fresh model loads the checkpoint and trains the same step: every
  parameter bit for bit, the report, the RNG stream, ``latest`` on every rank. The checkpoint stays at
  ``DIR/ck`` and the full parameters at the save in ``DIR/ck_expected.safetensors`` (the test loads it at world 1).
* ``partial``: ``DIR/ck`` (``round_trip``'s) loaded with ``strict=False`` into an FSDP2 model with one layer
  more: the report names that layer's entries as missing, every other entry and its moments are loaded bit
  for bit, that layer's parameters and moments are as they were.
* ``bf16_masters``: the same with bf16 parameters: the float32 masters are saved and come back bit for bit
  (not rebuilt from bf16), and the resumed step is exact.
* ``refusals``: a copy with one byte of rank 1's shard flipped is refused on both ranks (one rank checks
  that file's digest, all agree) and nothing changes; a second save without ``overwrite`` is refused
  on both ranks, with it the path is replaced; ranks given two different checkpoints are refused on both;
  a save under a regular file is refused on both ranks, naming it; a save that DCP fails (a complex buffer)
  is a CheckpointError on both ranks and leaves nothing.
* ``converted``: a one-process checkpoint (layout 1) of the same model is refused by the FSDP2 model, naming
  the converter; converted by ``checkpoint.convert`` it loads: every parameter and moment bit for bit.
* ``ddp``: the small model under DDP (replicated state): every rank calls ``save`` (collective, as DCP's), each
  tensor is written once (DCP's planner keeps one copy of what every rank holds), each rank's RNG states are
  its own file; a fresh DDP model on each rank loads it alone (no collective) to the saved parameters and
  moments bit for bit, and each rank gets back its own RNG stream.
* ``reshard``: TinyCausalLM under FSDP2 trained 3 steps by OffloadAdamW(fused=True), saved with
  ``checkpoint.save`` at ``DIR/ours``, and by torch.optim.AdamW(fused=True), saved with ``dcp.save`` of
  ``get_state_dict`` at ``DIR/torch``; both resumed under DDP at world 2 for 3 steps: bit for bit the same.
  (The test resumes both at world 1.)
* ``--kill STAGE``: save ``DIR/ck`` at step 2, train a step, save again with ``overwrite=True`` and SIGKILL
  one rank at STAGE (``shards``: rank 1 while DCP writes its shard; ``seal``: rank 0 before the manifest;
  ``publish``: rank 0 before the rename). The test then finds the first checkpoint, whole.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _distributed_common import LR, WEIGHT_DECAY, CaseResults, TinyCausalLM, full_params, join_gloo, spawn_ranks, train
from _layout1_writer import save_layout1
from offload_adamw import OffloadAdamW, checkpoint
from offload_adamw.checkpoint import CheckpointCorrupt, CheckpointError

WORLD = 2
CASES = ("round_trip", "partial", "bf16_masters", "refusals", "converted", "ddp", "reshard")


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def small(mesh, dtype=torch.float32):
    """The small model sharded in two units, OffloadAdamW and a scheduler."""
    model = build().to(dtype)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = OffloadAdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)


def step(model, optimizer, scheduler, i: int, rank: int) -> None:
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * i + rank)).to(next(model.parameters()).dtype)
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def full(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone() for k, v in model.state_dict().items()}


def case_round_trip(rank, mesh, out: Path, measured) -> list[str]:
    bad = []
    model, optimizer, scheduler = small(mesh)
    for i in range(2):
        step(model, optimizer, scheduler, i, rank)
    path = checkpoint.save(out / "ck", model, optimizer, scheduler, extra={"epoch": 1, "tag": "a"})
    at_save = full(model)
    scheduler_at_save = scheduler.state_dict()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in at_save.items()}, str(out / "ck_expected.safetensors"))
    draw = torch.rand(4)  # this rank's stream right after the save
    measured["files"] = sorted(os.listdir(path))
    if checkpoint.latest(out) != path:
        bad.append(f"latest({out}) is {checkpoint.latest(out)}, not {path}")
    step(model, optimizer, scheduler, 2, rank)
    expected = full(model)
    fresh, fresh_optimizer, fresh_scheduler = small(mesh)
    torch.manual_seed(1234 + rank)  # another stream: the load must put the saved one back
    report = checkpoint.load(path, fresh, fresh_optimizer, fresh_scheduler)
    if not torch.equal(torch.rand(4), draw):
        bad.append("the RNG stream after the load is not the one after the save")
    if (report.step, report.extra) != (2, {"epoch": 1, "tag": "a"}):
        bad.append(f"report step/extra {report.step}, {report.extra}")
    if not (report.optimizer_restored and report.scheduler_restored and report.rng_restored):
        bad.append(f"report {report}")
    if sorted(report.loaded) != sorted(at_save):
        bad.append(f"loaded {report.loaded}")
    if fresh_scheduler.state_dict() != scheduler_at_save:
        bad.append(f"scheduler {fresh_scheduler.state_dict()}, saved {scheduler_at_save}")
    step(fresh, fresh_optimizer, fresh_scheduler, 2, rank)
    got = full(fresh)
    bad += [f"{k} differs after resuming" for k in expected if not torch.equal(got[k], expected[k])]
    return bad


def case_partial(rank, mesh, out: Path, measured) -> list[str]:
    from safetensors.torch import load_file

    torch.manual_seed(5)
    model = torch.nn.Sequential(*build(), torch.nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = OffloadAdamW(model.parameters(), lr=1e-2)
    step(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1), 7, rank)  # states of its own
    before = full(model)
    names = dict(model.named_parameters())
    moment = {n: optimizer.state[p]["exp_avg"].clone() for n, p in names.items()}  # this rank's shard
    report = checkpoint.load(out / "ck", model, optimizer, strict=False)
    expected = load_file(out / "ck_expected.safetensors")
    got = full(model)
    bad = []
    if sorted(report.missing) != ["3.bias", "3.weight"] or sorted(report.loaded) != sorted(expected):
        bad.append(f"report: missing {report.missing}, loaded {report.loaded}")
    bad += [f"{k} not loaded" for k in expected if not torch.equal(got[k], expected[k])]
    bad += [f"{k} changed" for k in ("3.weight", "3.bias") if not torch.equal(got[k], before[k])]
    after = {n: optimizer.state[p]["exp_avg"] for n, p in names.items()}
    bad += [f"{n} moments changed" for n in ("3.weight", "3.bias") if not torch.equal(after[n], moment[n])]
    bad += [f"{n} moments not loaded" for n in expected if torch.equal(after[n], moment[n])]
    return bad


def masters(optimizer) -> list[torch.Tensor]:
    out = []
    for state in optimizer.state.values():
        master = state["master_param"]
        out.append(master.full_tensor() if hasattr(master, "full_tensor") else master.clone())
    return out


def case_bf16_masters(rank, mesh, out: Path, measured) -> list[str]:
    """bf16 parameters: the float32 masters are saved and loaded (not rebuilt from bf16), and the resume is exact."""
    bad = []
    model, optimizer, scheduler = small(mesh, torch.bfloat16)
    for i in range(2):
        step(model, optimizer, scheduler, i, rank)
    path = checkpoint.save(out / "ck-bf16", model, optimizer, scheduler)
    saved_masters = masters(optimizer)
    step(model, optimizer, scheduler, 2, rank)
    expected = full(model)
    fresh, fresh_optimizer, fresh_scheduler = small(mesh, torch.bfloat16)
    checkpoint.load(path, fresh, fresh_optimizer, fresh_scheduler)
    loaded = masters(fresh_optimizer)
    if len(loaded) != 4 or any(m.dtype != torch.float32 for m in loaded):
        bad.append(f"masters after the load: {[m.dtype for m in loaded]}")
    bad += [f"master {i} differs after the load" for i, (a, b) in enumerate(zip(loaded, saved_masters, strict=True))
            if not torch.equal(a, b)]
    bad += [f"master {i} is its bf16 copy" for i, m in enumerate(loaded) if torch.equal(m, m.bfloat16().float())]
    step(fresh, fresh_optimizer, fresh_scheduler, 2, rank)
    got = full(fresh)
    bad += [f"{k} differs after resuming" for k in expected if not torch.equal(got[k], expected[k])]
    return bad


def case_refusals(rank, mesh, out: Path, measured) -> list[str]:
    bad = []
    model, optimizer, scheduler = small(mesh)
    step(model, optimizer, scheduler, 0, rank)
    path = checkpoint.save(out / "ck2", model, optimizer, scheduler)
    broken = out / "ck2-flipped"
    if rank == 0:
        import shutil

        shutil.copytree(path, broken)
        shard = broken / "shard-00002-model-00001-of-00001.safetensors"
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x01
        shard.write_bytes(bytes(data))
    dist.barrier()
    fresh, fresh_optimizer, fresh_scheduler = small(mesh)
    before = full(fresh)
    try:
        checkpoint.load(broken, fresh, fresh_optimizer, fresh_scheduler)
        bad.append("a flipped byte was loaded")
    except CheckpointCorrupt as exc:
        measured["flipped"] = str(exc)
        if "shard-00002" not in str(exc) or "sha256" not in str(exc):
            bad.append(f"the refusal does not name the file: {exc}")
    after = full(fresh)
    bad += [f"{k} changed by a refused load" for k in before if not torch.equal(before[k], after[k])]
    try:
        checkpoint.save(path, model, optimizer, scheduler)
        bad.append("a save onto an existing checkpoint without overwrite was accepted")
    except CheckpointError as exc:
        measured["exists"] = str(exc)
    # A tensor safetensors cannot hold (complex): DCP's save fails on the rank that writes it and raises on all;
    # every rank gets a CheckpointError and nothing is published, no temporary is left.
    odd, odd_optimizer, odd_scheduler = small(mesh)
    odd.register_buffer("z", torch.zeros(2, dtype=torch.complex64))
    try:
        checkpoint.save(out / "ck-complex", odd, odd_optimizer, odd_scheduler)
        bad.append("a complex buffer was saved")
    except CheckpointError as exc:
        measured["complex"] = str(exc)[:300]
    dist.barrier()
    if rank == 0 and any(p.name.startswith((".ck-complex", "ck-complex")) for p in out.iterdir()):
        bad.append(f"a failed save left {sorted(p.name for p in out.iterdir())}")
    blocker = out / "a-file"
    if rank == 0:
        blocker.write_text("not a directory")
    dist.barrier()
    try:
        checkpoint.save(blocker / "ck", model, optimizer, scheduler)
        bad.append("a save under a file was accepted")
    except CheckpointError as exc:
        measured["under_a_file"] = str(exc)
        if "a-file is a file, not a directory" not in str(exc):
            bad.append(f"the refusal does not name the file in the way: {exc}")
    step(model, optimizer, scheduler, 1, rank)
    older = out / "ck2-older"
    if rank == 0:
        import shutil

        shutil.copytree(path, older)
    dist.barrier()
    checkpoint.save(path, model, optimizer, scheduler, overwrite=True)
    # The ranks reading two different checkpoints (two paths here; a save replacing the checkpoint between
    # the ranks' opening it, in life) would mix them: refused on both ranks, nothing changed.
    fresh, fresh_optimizer, fresh_scheduler = small(mesh)
    before = full(fresh)
    try:
        checkpoint.load(path if rank == 0 else older, fresh, fresh_optimizer, fresh_scheduler)
        bad.append("ranks reading two different checkpoints were not refused")
    except CheckpointError as exc:
        measured["two_checkpoints"] = str(exc)
    after = full(fresh)
    bad += [f"{k} changed by a load refused for two checkpoints" for k in before if not torch.equal(before[k], after[k])]
    if checkpoint.verify(path)["step"] != 2:
        bad.append("overwrite=True did not replace the checkpoint")
    dist.barrier()
    if rank == 0 and any(p.name.startswith(".") for p in out.iterdir()):
        bad.append(f"hidden leftovers: {sorted(p.name for p in out.iterdir())}")
    return bad


def case_converted(rank, mesh, out: Path, measured) -> list[str]:
    """A one-process checkpoint (layout 1) converted (checkpoint.convert) loads into the FSDP2 model: every
    parameter and moment bit for bit what the one process had."""
    from safetensors.torch import load_file

    from offload_adamw.checkpoint.convert import convert

    if rank == 0:
        plain = build()
        plain_optimizer = OffloadAdamW(plain.parameters(), lr=1e-2)
        plain_scheduler = torch.optim.lr_scheduler.StepLR(plain_optimizer, 1, gamma=0.9)
        for i in range(2):
            step(plain, plain_optimizer, plain_scheduler, i, 0)
        # written by the old one-process writer (a test support module now: save writes layout 2 everywhere)
        convert(save_layout1(out / "legacy", plain, plain_optimizer, plain_scheduler), out / "converted")
        expected = {k: v.detach().clone() for k, v in plain.state_dict().items()}
        names = dict(plain.named_parameters())
        expected |= {f"{n}::exp_avg": plain_optimizer.state[p]["exp_avg"] for n, p in names.items()}
        save_file(expected, str(out / "converted_expected.safetensors"))
    dist.barrier()
    expected = load_file(out / "converted_expected.safetensors")
    model, optimizer, scheduler = small(mesh)
    bad = []
    before = full(model)
    try:  # the original itself: refused, naming the first DTensor and the command that converts it
        checkpoint.load(out / "legacy", model, optimizer, scheduler)
        bad.append("a one-process checkpoint was loaded into the FSDP2 model")
    except CheckpointError as exc:
        if "offload_adamw.checkpoint.convert" not in str(exc) or "'0.weight'" not in str(exc):
            bad.append(f"the refusal does not say what to do: {exc}")
    after = full(model)
    bad += [f"{k} changed by a refused load" for k in before if not torch.equal(before[k], after[k])]
    report = checkpoint.load(out / "converted", model, optimizer, scheduler)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    got = full(model)
    states = get_optimizer_state_dict(model, optimizer)["state"]  # by name, as global DTensors
    for name, state in states.items():
        moment = state["exp_avg"]
        got[f"{name}::exp_avg"] = moment.full_tensor() if hasattr(moment, "full_tensor") else moment
    bad += [] if report.step == 2 else [f"step {report.step}"]
    return bad + [f"{k} differs" for k in expected if not torch.equal(got[k], expected[k])]


def case_ddp(rank, mesh, out: Path, measured) -> list[str]:
    import json as json_

    from safetensors import safe_open
    from torch.nn.parallel import DistributedDataParallel as DDP

    def ddp():
        model = DDP(build())
        optimizer = OffloadAdamW(model.parameters(), lr=1e-2)
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)

    model, optimizer, scheduler = ddp()
    for i in range(2):
        step(model, optimizer, scheduler, i, rank)
    torch.manual_seed(100 + rank)  # each rank its own RNG stream
    path = checkpoint.save(out / "ck-ddp", model, optimizer, scheduler, extra={"ranks": 2})
    expected_draw = torch.rand(4)
    saved = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    saved_moments = {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.module.named_parameters()}
    bad = []
    if rank == 0:
        keys: list[str] = []
        for name in sorted(p.name for p in path.iterdir() if p.name.startswith("shard-")):
            with safe_open(str(path / name), "pt") as f:
                keys += list(f.keys())
        doubled = sorted({k for k in keys if keys.count(k) > 1})
        if doubled or not any(k.startswith("state/model/") for k in keys):
            bad.append(f"replicated tensors written {'more than once: ' + str(doubled) if doubled else 'nowhere'}")
        own = sorted(p.name for p in path.iterdir() if p.name.startswith("rank-"))
        if own != ["rank-00000.json", "rank-00000.safetensors", "rank-00001.json", "rank-00001.safetensors"]:
            bad.append(f"each rank's own state: {own}")
        measured["files"] = sorted(p.name for p in path.iterdir())
        measured["world_size"] = json_.loads((path / "meta.json").read_text())["world_size"]
    dist.barrier()
    fresh, fresh_optimizer, fresh_scheduler = ddp()
    torch.rand(100)  # move the generator on
    report = checkpoint.load(path, fresh, fresh_optimizer, fresh_scheduler)  # each rank alone: no DTensor
    if not (report.ok and report.rng_restored and report.extra == {"ranks": 2} and report.step == 2):
        bad.append(f"report: {report}")
    if not torch.equal(torch.rand(4), expected_draw):
        bad.append("this rank's RNG stream was not restored")
    got = fresh.module.state_dict()
    bad += [f"{k} differs" for k in saved if not torch.equal(got[k], saved[k])]
    bad += [f"{n} exp_avg differs" for n, p in fresh.module.named_parameters()
            if not torch.equal(fresh_optimizer.state[p]["exp_avg"], saved_moments[n])]
    return bad


def case_reshard(rank, mesh, out: Path, measured) -> list[str]:
    """FSDP2 at world 2 -> DDP at world 2: our save/load equals torch's own DCP resume, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    def sharded(seed):
        model = TinyCausalLM(seed)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    ours = sharded(0)
    ours_opt = OffloadAdamW(ours.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    train(ours, ours_opt, range(3), rank)
    checkpoint.save(out / "ours", ours, ours_opt)
    theirs = sharded(0)
    theirs_opt = torch.optim.AdamW(theirs.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    train(theirs, theirs_opt, range(3), rank)
    model_sd, optim_sd = get_state_dict(theirs, theirs_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out / "torch")

    a = DDP(TinyCausalLM(5))
    a_opt = OffloadAdamW(a.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    report = checkpoint.load(out / "ours", a, a_opt)
    b = DDP(TinyCausalLM(5))
    b_opt = torch.optim.AdamW(b.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    model_sd, optim_sd = get_state_dict(b, b_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=out / "torch")
    set_state_dict(b, b_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    bad = []
    if report.step != 3:
        bad.append(f"step {report.step}")
    loaded_a, loaded_b = full_params(a), full_params(b)
    bad += [f"{k} differs right after the load" for k in loaded_b if not torch.equal(loaded_a[k], loaded_b[k])]
    train(a, a_opt, range(3, 6), rank)
    train(b, b_opt, range(3, 6), rank)
    got, want = full_params(a), full_params(b)
    gaps = {k: (got[k] - want[k]).abs().max().item() for k in want}
    measured["max_gap"] = max(gaps.values())
    bad += [f"{k} differs from torch's resumed run (max {gaps[k]})" for k in want if not torch.equal(got[k], want[k])]
    return bad


def kill_at(stage: str, rank: int) -> None:
    """Arrange for this rank to be SIGKILLed at ``stage`` of the next save."""
    from offload_adamw.checkpoint import publication

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if stage == "shards" and rank == 1:
        from offload_adamw.checkpoint import sharded

        original = sharded._write_shard

        def write_then_die(*args, **kwargs):
            original(*args, **kwargs)  # this rank's shard is on disk, the others' may not be yet
            die()

        sharded._write_shard = write_then_die  # type: ignore[assignment]
    elif stage == "seal" and rank == 0:
        publication.seal = die  # type: ignore[assignment]
    elif stage == "publish" and rank == 0:
        publication.publish = die  # type: ignore[assignment]


def killed_save(rank, mesh, out: Path, stage: str) -> None:
    model, optimizer, scheduler = small(mesh)
    for i in range(2):
        step(model, optimizer, scheduler, i, rank)
    checkpoint.save(out / "ck", model, optimizer, scheduler)
    at_save = full(model)  # collective: every rank gathers
    if rank == 0:
        save_file({k: v.contiguous() for k, v in at_save.items()}, str(out / "ck_expected.safetensors"))
    step(model, optimizer, scheduler, 2, rank)
    kill_at(stage, rank)
    checkpoint.save(out / "ck", model, optimizer, scheduler, overwrite=True)
    (out / f"rank{rank}-survived").write_text("the killed save returned")


def worker(rank: int, port: int, out: str, cases: list[str], kill: str | None) -> None:
    join_gloo(rank, port, WORLD, timeout_s=30)
    mesh = init_device_mesh("cpu", (WORLD,))
    root = Path(out)
    if kill:
        killed_save(rank, mesh, root, kill)
        return
    results = CaseResults(root / f"rank{rank}.json", cases)
    checks = {"round_trip": case_round_trip, "bf16_masters": case_bf16_masters, "refusals": case_refusals,
              "converted": case_converted, "ddp": case_ddp, "reshard": case_reshard, "partial": case_partial}
    for name in cases:
        results.judge(name, checks[name], rank, mesh, root)
    # The cases' DDP models and FSDP2 states may sit in reference cycles: collected now, while their process group
    # still exists, not by the interpreter's exit after it is gone (one run of 8 ended in SIGABRT, "terminate called
    # without an active exception", at rank 0's exit after the reshard case had passed).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    # Every result is on disk (CaseResults writes each case's as it ends). The abort above came from a C++ thread's
    # destructor in the interpreter's teardown (torch's, after the process group was gone: no code of this package
    # runs there), and the collection and barrier did not prove to stop it: the rank leaves without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--kill", choices=("shards", "seal", "publish"), default=None)
    args = parser.parse_args()
    spawn_ranks(worker, args.out, args.cases, args.kill, world=WORLD)


if __name__ == "__main__":
    main()
