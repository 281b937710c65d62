"""OffloadAdamW under the real HF Trainer and accelerate on FSDP (2 gloo ranks, the CPU as device).

The Trainer builds the optimizer over the unsharded model, accelerate shards it with FSDP2 and swaps the
optimizer's parameters for the DTensor shards. Properties, each on both ranks, against the same Trainer run with
``optim="adamw_torch_fused"`` (every local shard and every logged ``grad_norm`` bitwise):

* after the swap nothing of the unsharded model is alive (weak references), the first step's gradients are
  already freed, and the host bytes OffloadAdamW allocates on each rank (``host_state_bytes``,
  ``host_buffer_bytes``) are the planner's per-rank bill for that rank's shards (``fsdp_rank_host_bytes``),
  with kept and with freed gradients, and with accumulation 4 (accelerate's ``no_sync``: no host accumulation);
* updates during backward through ``OffloadAdamWTrainer``, with and without clipping, accumulation 1 and 4: the
  updates start before ``step()`` from the second step on, and the result is torch's;
* ``OffloadAdamW(max_grad_norm=...)`` over the Trainer's own decay / no-decay groups (``optimizer_cls_and_kwargs``)
  clips with torch's norm of the model (the order the Trainer clips in), kept and freed, where the groups' order
  would give other bits (checked at each step);
* accelerate without the Trainer (``prepare(model, OffloadAdamW(...))`` on FSDP2, ``accelerator.clip_grad_norm_``):
  torch's AdamW bitwise, nothing of the unsharded model alive; ``Trainer(optimizers=(opt, scheduler))`` under FSDP
  is refused by transformers itself (what the docs say); a swap between backward and step gives the released
  shards their host gradients back in ``p.grad`` as DTensors over real shards, bitwise;
* the Trainer's own FSDP2 checkpoint (``SHARDED_STATE_DICT``: DCP; ``FULL_STATE_DICT``) saved at step 2 and
  ``resume_from_checkpoint``: the resumed run ends bitwise where the uninterrupted one ends;
* FSDP1 (torch's FullyShardedDataParallel; accelerate's FSDP1 path stops at FSDP1's device check on the CPU, so
  the model is wrapped as accelerate wraps it on GPUs): ``use_orig_params=True`` with freed gradients is torch's
  AdamW bitwise (the gradients reach the pipeline at the step: FSDP1 writes them after backward, no hook of an
  original parameter runs); ``use_orig_params=False`` hands the optimizer FlatParameters, whose gradient arrives
  in backward with the unsharded size: the pipeline refuses them by name when it is built (before, backward
  failed on a bare size mismatch), and the plain step takes them as torch's AdamW does.

The worker (``_integrations_fsdp_worker.py``) runs the cases and documents the one test-only patch (accelerate
enables FSDP only for accelerator devices). CI runs its ``QUICK`` cases; the whole table is ``slow``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORKER = Path(__file__).resolve().parent / "support" / "_integrations_fsdp_worker.py"
sys.path.insert(0, str(WORKER.parent))
from _integrations_fsdp_worker import CASES, QUICK  # noqa: E402


def _run(out: Path, quick: bool) -> dict:
    cmd = [sys.executable, str(WORKER), "--out", str(out)] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return {r: json.loads((out / f"fsdp_rank{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("fsdp_quick"), quick=True)


@pytest.fixture(scope="module")
def all_results(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("fsdp_all"), quick=False)


def _assert_ok(results: dict, name: str) -> None:
    for rank, got in results.items():
        assert name in got, f"rank {rank} did not run {name}"
        assert got[name]["ok"], f"rank {rank}, {name}:\n{got[name]['error']}"


@pytest.mark.parametrize("name", QUICK)
def test_fsdp_quick(quick_results, name):
    _assert_ok(quick_results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_all(all_results, name):
    _assert_ok(all_results, name)
