"""The 2-process half of test_overlap_ddp.py: DDP over 8 blocks in several buckets, host updates during backward.

Run as ``python tests/support/_overlap_ddp_worker.py --out DIR``: it spawns two gloo ranks (CPU as device) and writes
``DIR/results_rank{r}.json``: ``{case: {"ok": bool, "error": str, "measured": {...}}}``. Each case trains
DDP + OffloadAdamW(offload_gradients=True, update_in_backward=True) (attached) and DDP +
torch.optim.AdamW(fused=True) from the same initialisation on the same batches, with the same user calls, and
compares every parameter and second moment bitwise. Micro-batches that only accumulate run inside
``ddp_model.no_sync()``, and ``opt.no_sync()`` too unless the case says it was forgotten; after step()
``opt.zero_grad()``, or the model's where the case says so; clipping is torch's ``clip_grad_norm_`` on the
reference and ``max_grad_norm`` on ours. Then the misuses: ``opt.no_sync()`` without ``ddp_model.no_sync()``
(refused before any update), and ``find_unused_parameters=True`` (exact: the updates wait for step(), since
DDP decides only in its final callback which gradients it leaves unset).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _overlap_common as common
from _distributed_common import CaseResults, join_gloo, worker_main
from offload_adamw import OffloadAdamW

WORLD = 2
BLOCKS = 8
WIDTH = 256
ROWS = 128
STEPS = 4  # DDP's first iteration reduces all in one bucket, rebuilt in the order of gradients at the second
LR = 1e-3
WEIGHT_DECAY = 0.1
CLIP = 0.05  # below every step's norm: the clipping acts
BUCKET_CAP_MB = 1.0  # a block's parameters are about 1 MiB: several DDP buckets
#: (max_grad_norm, accumulation, opt.no_sync() around the micro-batches that only accumulate)
CASES = [(None, 1, True), (None, 4, True), (CLIP, 1, True), (CLIP, 4, True), (None, 4, False), (CLIP, 4, False)]
#: Other DDP settings, each exact: (name, DDP keywords, max_grad_norm, accumulation, model.zero_grad() after step)
SETTINGS = [
    # One micro-batch, not clipped: updates start while later parameters' stale host gradients are still dropped.
    ("bucket_views-model_zero_grad", {"gradient_as_bucket_view": True}, None, 1, True),
    ("bucket_views-clip", {"gradient_as_bucket_view": True}, CLIP, 4, False),
    ("static_graph", {"static_graph": True}, None, 1, False),
]
MISUSES = ["opt_no_sync_without_ddp_no_sync_refused", "find_unused_parameters_exact"]
#: A head outside DDP in the same optimizer, clipped: its norms come from backward's hooks, DDP's from the reduced
#: buckets, one coefficient after DDP's final callback (find_unused_parameters: at the step).
MIXED = ["head_outside_ddp-clip", "head_outside_ddp-clip-find_unused_parameters"]


def case_name(clip: float | None, accumulation: int, opt_no_sync: bool) -> str:
    return f"clip={clip}-accumulation={accumulation}" + ("" if opt_no_sync else "-without_opt_no_sync")


class Blocks(nn.Module):
    def __init__(self, seed: int, spare: bool = False) -> None:
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(BLOCKS)
        )
        # Used on odd steps only (find_unused_parameters=True): a parameter that has a gradient in some steps.
        self.spare = nn.Linear(WIDTH, WIDTH) if spare else None
        torch.random.set_rng_state(generator_state)
        self.use_spare = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        if self.spare is not None and self.use_spare:
            x = x + self.spare(x)
        return x


def wrapped(spare: bool = False, **ddp_kwargs) -> DistributedDataParallel:
    return DistributedDataParallel(Blocks(seed=0, spare=spare), bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=spare,
                                   **ddp_kwargs)


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(ROWS, WIDTH, generator=g)


def train(ddp, opt, clip: float | None, accumulation: int, ours: bool, opt_no_sync: bool = True,
          timelines: list | None = None, steps: int = STEPS, model_zero_grad: bool = False) -> list[float]:
    """Steps of ``accumulation`` micro-batches; the reference clips with torch's clip_grad_norm_ before step().

    Returns the reference's total norms."""
    rank = dist.get_rank()
    norms = []
    for step in range(steps):
        ddp.module.use_spare = step % 2 == 1
        for micro in range(accumulation):
            last = micro == accumulation - 1
            with contextlib.ExitStack() as stack:
                if not last:
                    stack.enter_context(ddp.no_sync())
                    if ours and opt_no_sync:
                        stack.enter_context(opt.no_sync())
                loss = ddp(batch(step, micro, rank)).square().mean() / accumulation
                loss.backward()
        if clip is not None and not ours:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)))
        opt.step()
        if model_zero_grad:
            ddp.zero_grad()  # the model's, as HF Trainer calls it
        else:
            opt.zero_grad()
        if timelines is not None:
            timelines.append(opt.last_step_timeline())
    return norms


_REFERENCES: dict[tuple, tuple] = {}


def reference_run(clip: float | None, accumulation: int, spare: bool = False, **ddp_kwargs):
    """DDP + torch.optim.AdamW(fused=True) (cached: cases that differ only in our calls share it)."""
    key = (clip, accumulation, spare, tuple(sorted(ddp_kwargs.items())))
    if key not in _REFERENCES:
        reference = wrapped(spare, **ddp_kwargs)
        theirs = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        norms = train(reference, theirs, clip, accumulation, ours=False)
        _REFERENCES[key] = (reference, theirs, norms)
    return _REFERENCES[key]


def ours_for(ddp, clip: float | None) -> OffloadAdamW:
    opt = OffloadAdamW(ddp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, offload_gradients=True,
                       update_in_backward=True, max_grad_norm=clip)
    opt.attach(ddp)
    return opt


def check_case(clip: float | None, accumulation: int, opt_no_sync: bool, measured: dict, *, model_zero_grad: bool = False,
               **ddp_kwargs) -> None:
    reference, theirs, norms = reference_run(clip, accumulation, **ddp_kwargs)
    model = wrapped(**ddp_kwargs)
    ours = ours_for(model, clip)
    timelines: list = []
    train(model, ours, clip, accumulation, ours=True, opt_no_sync=opt_no_sync, timelines=timelines,
          model_zero_grad=model_zero_grad)
    assert_same(reference, theirs, model, ours)
    overlaps = [t.overlap for t in timelines if t is not None]
    last = timelines[-1]
    measured.update(
        overlaps=[round(o, 3) for o in overlaps],
        buckets=len(last.buckets),
        ddp_buckets=len(str(model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")).split(", ")),
        starts_after_backward=[round(b.update_start - last.backward_end, 4) for b in last.buckets],
        last_grad_norm=None if ours.last_grad_norm is None else float(ours.last_grad_norm),
        reference_norm=norms[-1] if norms else None,
    )


def assert_same(reference, theirs, model, ours) -> None:
    """Every parameter and second moment bitwise equal."""
    common.assert_same(reference, theirs, model, ours, "DDP")


def check_opt_no_sync_without_ddp_no_sync_refused(measured: dict) -> None:
    """opt.no_sync() alone: DDP reduces every micro-batch into the host; the second one is refused before any update."""
    model = wrapped()
    opt = ours_for(model, None)
    rank = dist.get_rank()
    train(model, opt, None, 1, ours=True, steps=2)  # the order is known: the next backward would update early
    before = [p.detach().clone() for p in model.parameters()]
    with opt.no_sync():
        model(batch(0, 0, rank)).square().mean().backward()
    try:
        with opt.no_sync():
            model(batch(0, 1, rank)).square().mean().backward()
    except RuntimeError as error:
        measured["error"] = str(error)
        assert "no_sync" in str(error), str(error)
    else:
        raise AssertionError("a second micro-batch reduced by DDP was accumulated without an error")
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    assert unchanged, "a parameter was updated before the refusal"


def check_find_unused_parameters_exact(measured: dict) -> None:
    """Clipped: neither the updates nor the coefficient come during backward."""
    reference, theirs, _ = reference_run(CLIP, 1, spare=True)
    model = wrapped(spare=True)
    ours = ours_for(model, CLIP)
    timelines: list = []
    train(model, ours, CLIP, 1, ours=True, timelines=timelines)
    assert_same(reference, theirs, model, ours)
    measured["overlaps"] = [round(t.overlap, 3) for t in timelines]


def check_head_outside_ddp(find_unused: bool, measured: dict) -> None:
    rank = dist.get_rank()
    runs = []
    for ours in (False, True):
        ddp = wrapped(spare=find_unused)
        head = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            for i, p in enumerate(head.parameters()):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
        params = list(ddp.parameters()) + list(head.parameters())
        if ours:
            opt = OffloadAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, offload_gradients=True, update_in_backward=True,
                               max_grad_norm=CLIP)
            opt.attach(ddp)
        else:
            opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        timelines = []
        for step in range(3):  # the third step is the first whose updates could run during backward
            ddp.module.use_spare = step % 2 == 1
            head(ddp(batch(step, 0, rank))).square().mean().backward()
            if not ours:
                torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            opt.zero_grad()
            timelines.append(opt.last_step_timeline() if ours else None)
        runs.append((params, opt, timelines))
    (theirs_params, theirs, _), (ours_params, ours, timelines) = runs
    differing = [i for i, (p, q) in enumerate(zip(theirs_params, ours_params)) if not torch.equal(p, q)
                 or not torch.equal(theirs.state[p].get("exp_avg_sq", p), ours.state[q].get("exp_avg_sq", q))]
    assert not differing, f"parameters {differing[:6]} differ from DDP + torch.optim.AdamW(fused=True)"
    measured["overlaps"] = [round(t.overlap, 3) for t in timelines]


BAD_STEP = 2  # a step follows it


def check_nonfinite_skip(measured: dict) -> None:
    """nonfinite='skip' + clipping during backward: an inf in rank 1's batch only (the all-reduce takes it to every
    rank) skips the whole step before any update, on both ranks."""
    rank = dist.get_rank()
    reference = wrapped()
    theirs = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    model = wrapped()
    ours = OffloadAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, offload_gradients=True,
                        update_in_backward=True, max_grad_norm=CLIP, nonfinite="skip")
    ours.attach(model)
    for step in range(STEPS):
        x = batch(step, 0, rank)
        if step == BAD_STEP and rank == 1:
            x[3, 5] = float("inf")
        model(x).square().mean().backward()
        ours.step()
        ours.zero_grad()
        reference(batch(step, 0, rank)).square().mean().backward()
        if step != BAD_STEP:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
            theirs.step()
        theirs.zero_grad()
    measured["skipped_steps"] = ours.skipped_steps
    measured["overlaps"] = [round(t.overlap, 3) for t in [ours.last_step_timeline()] if t is not None]
    assert ours.skipped_steps == 1, f"rank {rank} skipped {ours.skipped_steps} steps"
    assert_same(reference, theirs, model, ours)


def check_given_back(update_in_backward: bool, measured: dict) -> None:
    """An optimizer dropped between the third backward and its step() (_overlap_common.check_given_back)."""
    common.check_given_back(wrapped, batch, True, update_in_backward, measured, lr=LR, weight_decay=WEIGHT_DECAY)


def worker(rank: int, port: int, out: str, only: list[str]) -> None:
    join_gloo(rank, port, WORLD)
    cases = CaseResults(Path(out) / f"results_rank{rank}.json", only)
    run = cases.run

    for clip, accumulation, opt_no_sync in CASES:
        run(case_name(clip, accumulation, opt_no_sync), check_case, clip, accumulation, opt_no_sync)
    for name, ddp_kwargs, clip, accumulation, model_zero_grad in SETTINGS:
        run(name, lambda measured, k=ddp_kwargs, c=clip, a=accumulation, z=model_zero_grad: check_case(
            c, a, True, measured, model_zero_grad=z, **k))
    run(MISUSES[0], check_opt_no_sync_without_ddp_no_sync_refused)
    run(MISUSES[1], check_find_unused_parameters_exact)
    run(MIXED[0], lambda measured: check_head_outside_ddp(False, measured))
    run(MIXED[1], lambda measured: check_head_outside_ddp(True, measured))
    run("nonfinite-skip", check_nonfinite_skip)
    run("given-back", lambda measured: check_given_back(False, measured))
    run("given-back-update_in_backward", lambda measured: check_given_back(True, measured))
    dist.destroy_process_group()


def main() -> None:
    worker_main(worker, world=WORLD)


if __name__ == "__main__":
    main()
