"""OffloadAdamW's transfer pipeline under DistributedDataParallel and FSDP2 (real gloo, 2 processes, the CPU as device).

What is held, against DDP + torch.optim.AdamW(fused=True) with the same calls, bitwise (parameters and
states, and both replicas equal): gradients kept and freed, bucket views off and on, accumulation over
micro-batches with ``no_sync``, ``static_graph``, clipping with ``torch.nn.utils.clip_grad_norm_`` on the
model and ``model.zero_grad()``; ``opt.attach(ddp_model)`` brings the reduced gradients to the host. And
the refusals: freed gradients under an unattached DDP model (before the first update), freed gradients
accumulated over synchronised backwards; kept gradients under an unattached model are fetched at the step.
FSDP2: the pipeline with kept gradients, bitwise FSDP2 + torch's AdamW (accumulation 1 and 4, clipping on
the model); freed gradients with DTensor parameters refused. The worker (``_wrappers_distributed_worker.py``) runs the
cases; CI runs a subset, the whole matrix is ``slow``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "support" / "_wrappers_distributed_worker.py"
sys.path.insert(0, str(WORKER.parent))
from _wrappers_distributed_worker import CASES, QUICK, case_name  # noqa: E402

REFUSALS = ["unattached_kept_refetches", "unattached_freed_refused", "freed_accumulation_without_no_sync_refused"]
FSDP_QUICK = ["fsdp-kept-acc1-clip", "fsdp-kept-acc4", "fsdp-freed-acc4-clip"]
FSDP_ALL = [f"fsdp-{mode}-acc{a}{c}" for mode in ("kept", "freed") for a in (1, 4) for c in ("", "-clip")]


def _run(out: Path, quick: bool) -> dict:
    cmd = [sys.executable, str(WORKER), "--out", str(out)] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return {r: json.loads((out / f"ddp_rank{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("ddp_quick"), quick=True)


@pytest.fixture(scope="module")
def all_results(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("ddp_all"), quick=False)


def _assert_ok(results: dict, name: str) -> None:
    for rank, got in results.items():
        assert name in got, f"rank {rank} did not run {name}"
        assert got[name]["ok"], f"rank {rank}, {name}:\n{got[name]['error']}"


@pytest.mark.parametrize("name", sorted(QUICK) + REFUSALS + FSDP_QUICK)
def test_ddp_quick(quick_results, name):
    _assert_ok(quick_results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [case_name(c) for c in CASES] + FSDP_ALL)
def test_ddp_matrix(all_results, name):
    _assert_ok(all_results, name)


def test_a_dead_weak_proxy_does_not_break_the_search_for_an_unattached_ddp_model(tmp_path) -> None:
    """The search walks gc.get_objects(); a dead weakref.proxy among them (torch.compile leaves some) raised
    ReferenceError from isinstance() inside backward's hook."""
    script = tmp_path / "run.py"
    script.write_text(
        "import socket, weakref, torch, torch.distributed as dist\n"
        "from offload_adamw import OffloadAdamW\n"
        "with socket.socket() as s:\n    s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)\n"
        "class Thing:\n    pass\n"
        "thing = Thing(); dead = weakref.proxy(thing); keep = [dead]; del thing\n"
        "model = torch.nn.Linear(4, 4)\n"
        "opt = OffloadAdamW(model.parameters(), offload_gradients=True)\n"
        "model(torch.randn(2, 4)).sum().backward(); opt.step()\n"
        "print('ok'); dist.destroy_process_group()\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
