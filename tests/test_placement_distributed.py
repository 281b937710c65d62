"""Placements under DDP and FSDP2 on 2 gloo ranks, and DCP checkpoints that change placement (the CPU as device).

The worker (tests/support/_placement_distributed_worker.py) trains 8 blocks, each a parameter group placed by a pattern of
``"stream"``, ``"device"`` and ``"host"``: under DDP (attached; kept and freed gradients; updates at step() and during
backward; clipping; accumulation inside ``ddp_model.no_sync()``) and under FSDP2 (one group per block and the root;
kept and freed gradients; torch's clip_grad_norm_ on the model and max_grad_norm; accumulation with
``set_requires_gradient_sync(False)``), against DDP / FSDP2 + torch.optim.AdamW(fused=True) under the same user
calls. Property: every parameter (local shard) and second moment bitwise equal on both ranks (and, clipped during
backward under DDP, p.grad after step() is the clipped gradient, as torch's clipping leaves it). Updates during
backward without clipping run before backward ends. DCP: a run saved with one placement and loaded at world size 2
into another continues bitwise as the uninterrupted run; loaded at world size 1 (resharded) its state is the saved
state, whatever the placement it is loaded into.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch.distributed.checkpoint as dcp

import _placement_distributed_worker as worker_cases
from _overlap_fsdp_worker import Blocks
from _parity import same_bits
from _quick import only, table
from offload_adamw import OffloadAdamW

WORKER = Path(__file__).resolve().parent / "support" / "_placement_distributed_worker.py"
CASES = [name for name, *_ in worker_cases.DDP_CASES + worker_cases.FSDP_CASES] + [
    "ddp-stream-freed-inbwd-clip-grads-after-step", "dcp-placement-change"]
#: what CI runs (the rest is slow): DDP's reduced buckets landing for a streamed update during backward (held until the
#: step), a clipped three-placement mix during backward on each wrapper, and the DCP checkpoint the resharding test loads
QUICK = ["ddp-stream-freed-inbwd-acc1", "ddp-stream+device+host-freed-inbwd-clip-acc4",
         "fsdp-stream+host-freed-inbwd-optclip-acc4", "dcp-placement-change"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, request) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("placement_distributed")
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(out), *only(request.config, QUICK)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return out, [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", table(CASES, CASES, QUICK))
def test_placements_on_two_ranks_are_bitwise_the_reference(run, name) -> None:
    _, results = run
    for rank, result in enumerate(results):
        case = result[name]
        assert case["ok"], f"rank {rank}:\n{case['error'][-3000:]}"
    in_backward = [args for case, *args in worker_cases.DDP_CASES + worker_cases.FSDP_CASES if case == name]
    if in_backward and in_backward[0][2] and in_backward[0][3] is None:  # during backward, not clipped
        assert all(max(r[name]["measured"]["overlaps"]) > 0.3 for r in results), "no update ran during backward"


def _single_process_state(pattern: tuple[str, str], path: Path) -> dict:
    model = Blocks(seed=3)  # another initialisation: the state comes from the checkpoint
    groups = worker_cases.placed(model.blocks, pattern, rest=[model.norm.weight, model.norm.bias, model.probe])
    opt = OffloadAdamW(groups, lr=worker_cases.fsdp_cases.LR, weight_decay=worker_cases.fsdp_cases.WEIGHT_DECAY,
                       stream_chunk_bytes=worker_cases.CHUNK)
    sd = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, sd["optim"])
    assert [g["update_on"] for g in opt.param_groups[:2]] == list(pattern)
    return opt.state_dict()


def test_a_world2_checkpoint_loads_at_world1_into_any_placement(run) -> None:
    """Resharded from 2 ranks to 1: the state is the saved one, the same bytes in every placement it is loaded into."""
    out, _ = run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        host = _single_process_state(("host", "host"), out / "ckpt_placed")
        for pattern in [("stream", "device"), ("device", "stream")]:
            other = _single_process_state(pattern, out / "ckpt_placed")
            assert host["state"].keys() == other["state"].keys() and host["param_groups"] == other["param_groups"]
            for pid, entry in host["state"].items():
                assert float(entry["step"]) == worker_cases.DCP_AT
                for key, value in entry.items():
                    assert same_bits(value, other["state"][pid][key]), (pattern, pid, key)
    finally:
        torch.set_num_threads(threads)
