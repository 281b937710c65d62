"""OffloadAdamW under torch.distributed: FSDP2, DDP, DCP resharding, clipping (real gloo, 2 processes on CPU).

One subprocess (``_distributed_worker.py``) spawns two ranks that share one
process group for every check (gloo start-up dominates the cost) and writes a
result per check and rank; the tests here read them. The single-process side
of resharding (world 1 -> 2 and 2 -> 1) and DCP's state initialisation run in
this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _distributed_common import LR, WEIGHT_DECAY, TinyCausalLM, batch, full_params, loss_of, train
from _distributed_worker import RESUME_AT, RESUME_CLIP, RESUME_END
from offload_adamw import OffloadAdamW
from offload_adamw import distributed as offload_distributed

WORKER = Path(__file__).resolve().parent / "support" / "_distributed_worker.py"
CHECKS = [
    "fsdp_parity",
    "host_bytes",
    "state_dict_is_global",
    "full_state_dict",
    "dcp_resume",
    "checkpoint_metadata",
    "bf16_masters",
    "ddp",
    "clipping",
    "nonfinite_skip",
]


@pytest.fixture(scope="module")
def one_thread():
    # The worker ranks run with one thread; the single-process side must compute with the same kernels.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def offload(model: torch.nn.Module, **kw) -> OffloadAdamW:
    return OffloadAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **kw)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, one_thread) -> Path:
    """World-1 checkpoint first (the worker loads it at world 2), then the 2-rank run."""
    out = tmp_path_factory.mktemp("distributed")
    model = TinyCausalLM(0)
    opt = offload(model, fused=False)
    train(model, opt, range(RESUME_AT), None)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=out / "ckpt_w1")
    proc = subprocess.run(
        [sys.executable, str(WORKER), "--out", str(out), "--ckpt-w1", str(out / "ckpt_w1")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def results(run_dir) -> list[dict]:
    return [json.loads((run_dir / f"results_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("check", CHECKS)
def test_two_ranks(results, check):
    for rank, result in enumerate(results):
        assert check in result, f"rank {rank} did not run {check}"
        assert result[check]["ok"], f"rank {rank}, {check}:\n{result[check]['error']}"


def test_host_state_is_split_between_ranks(results):
    measured = results[0]["host_bytes"]["measured"]
    assert sum(measured["per_rank"]) > measured["single_process"]  # each rank also holds its step counts
    assert all(abs(f - 0.5) < 0.01 for f in measured["fraction"]), measured


def test_world2_checkpoint_resumes_at_world1(run_dir, one_thread):
    """Save at world 2 (FSDP2 DTensor states) -> load into one plain process -> continue: the uninterrupted run."""
    reference = TinyCausalLM(0)
    train(reference, offload(reference, fused=False), range(RESUME_END), None)
    model = TinyCausalLM(3)  # another initialisation: everything must come from the checkpoint
    opt = offload(model, fused=False)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=run_dir / "ckpt_w2")
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    assert {float(s["step"]) for s in opt.state.values()} == {float(RESUME_AT)}
    for p, state in opt.state.items():
        assert state["exp_avg"].shape == p.shape and not offload_distributed.is_dtensor(state["exp_avg"])
    train(model, opt, range(RESUME_AT, RESUME_END), None)
    got, want = full_params(model), full_params(reference)
    assert all(torch.equal(got[k], want[k]) for k in want), "world 2 -> 1 resume left the uninterrupted run"


def test_a_default_kernel_clipped_world2_checkpoint_resumes_at_world1_as_torchs_own_does(run_dir, one_thread):
    """The promise at another world size (docs/distributed.md#dcp-torchdistributedcheckpoint): equal to torch's own
    resumed run, bit for bit. Not to the uninterrupted run: torch's fused CPU kernel gives an element a result that
    depends on its place in the shard, and the clip norm is summed over other shards."""
    ends = {}
    for name, make in (
        ("offload_default", lambda m: OffloadAdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)),
        ("torch_fused", lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)),
    ):
        model = TinyCausalLM(3)  # another initialisation: everything must come from the checkpoint
        opt = make(model)
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=run_dir / f"ckpt_w2_{name}")
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        train(model, opt, range(RESUME_AT, RESUME_END), None, clip=RESUME_CLIP)
        ends[name] = full_params(model)
    ours, torchs = ends["offload_default"], ends["torch_fused"]
    assert all(torch.equal(ours[k], torchs[k]) for k in torchs), "world 2 -> 1: not torch's own resumed run"


def test_dcp_state_initialisation_is_not_an_update(one_thread):
    """get_optimizer_state_dict on a fresh optimizer allocates state (step 0) instead of counting a step.

    torch 2.13's ``_init_optim_state`` runs step() with zero gradients and lr 0;
    for torch.optim.AdamW that leaves step = 1, which changes the bias
    correction of every later step. Here the run after the call must be the run
    without it, bit for bit.
    """
    untouched = TinyCausalLM(0)
    train(untouched, offload(untouched), range(4), None)
    model = TinyCausalLM(0)
    opt = offload(model)
    sd = get_optimizer_state_dict(model, opt)
    assert len(sd["state"]) == len(list(model.parameters()))
    for state in sd["state"].values():
        assert float(state["step"]) == 0.0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert all(p.grad is None for p in model.parameters())
    train(model, opt, range(4), None)
    got, want = full_params(model), full_params(untouched)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_users_zero_lr_step_still_counts():
    """The DCP detection is by call site: a user's own zero-gradient, lr-0 step is an update
    (docs/contract.md#what-each-input-does)."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = OffloadAdamW([p], lr=0.0)
    p.grad = torch.zeros(3)
    opt.step()
    assert float(opt.state[p]["step"]) == 1.0
    assert not offload_distributed.inside_dcp_state_init()


def test_torch_adamw_counts_the_dcp_initialisation_as_a_step():
    """Documents why the detection exists (measured on torch 2.13): torch's AdamW reports step 1 afterwards."""
    model = TinyCausalLM(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sd = get_optimizer_state_dict(model, opt)
    steps = {float(s["step"]) for s in sd["state"].values()}
    if steps != {1.0}:
        pytest.skip(f"this torch ({torch.__version__}) no longer counts DCP's initialisation: steps {steps}")
    # And OffloadAdamW, given the same call, does not.
    ours_model = TinyCausalLM(0)
    ours_steps = {float(s["step"]) for s in get_optimizer_state_dict(ours_model, offload(ours_model))["state"].values()}
    assert ours_steps == {0.0}


def test_plain_model_state_dict_has_no_dtensors():
    """Without DTensor parameters the state_dict is torch's layout unchanged (the hook passes it through)."""
    model = TinyCausalLM(0)
    opt = offload(model)
    loss_of(model, batch(0, None)).backward()
    opt.step()
    sd = opt.state_dict()
    assert all(
        type(v) is torch.Tensor for state in sd["state"].values() for v in state.values() if isinstance(v, torch.Tensor)
    )
    assert sd["state"][0]["exp_avg"] is opt.state[next(iter(model.parameters()))]["exp_avg"]


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp_train.py"


def _torchrun(nproc: int, *args: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(EXAMPLE),
        "--json",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.slow
def test_example_trains_saves_and_resumes_at_another_world_size(tmp_path):
    """torchrun --nproc_per_node 2 examples/fsdp_train.py, then a resume of its checkpoint at world 1."""
    ckpt = str(tmp_path / "ckpt")
    first = _torchrun(2, "--steps", "12", "--save-every", "6", "--ckpt-dir", ckpt)
    assert first["world"] == 2 and first["last_loss"] < first["first_loss"]
    shares = [r["host_state_bytes"] / first["host_state_bytes_total"] for r in first["ranks"]]
    assert all(abs(s - 0.5) < 0.01 for s in shares), shares
    second = _torchrun(1, "--steps", "16", "--resume", "--ckpt-dir", ckpt)
    assert second["steps"] == [12, 16] and second["world"] == 1
    assert second["first_loss"] < first["first_loss"]  # it continued the trained model, not a fresh one


@pytest.mark.slow
def test_example_overlaps_draws_its_timeline_and_resumes(tmp_path):
    """torchrun ... examples/fsdp_train.py --overlap --timeline: updates during backward, a Gantt PNG, a resume."""
    ckpt, png = str(tmp_path / "ckpt"), tmp_path / "timeline.png"
    first = _torchrun(2, "--overlap", "--max-grad-norm", "0", "--layers", "4", "--steps", "8", "--save-every", "0",
                      "--ckpt-dir", ckpt, "--timeline", str(png))
    assert first["last_loss"] < first["first_loss"]
    assert first["overlap"] is not None and first["overlap"] > 0, first
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    second = _torchrun(1, "--overlap", "--layers", "4", "--steps", "10", "--resume", "--ckpt-dir", ckpt)
    assert second["steps"] == [8, 10] and second["first_loss"] < first["first_loss"]
    assert second["overlap"] == 0.0, "clipped (max_grad_norm 1.0): no update starts before backward ends"
