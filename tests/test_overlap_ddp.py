"""DDP with host updates during backward: 2 gloo ranks, the CPU as device, 8 blocks in several DDP buckets.

``OffloadAdamW(offload_gradients=True, update_in_backward=True)`` attached to the DDP model: as each DDP
bucket's all-reduce completes, its reduced gradients are copied to the host and those parameters land;
a bucket's update then runs on the worker thread while backward goes on.

Properties, for accumulation 1 and 4 (micro-batches that only accumulate inside ``ddp_model.no_sync()``,
with ``opt.no_sync()`` or without it) and with and without clipping: every parameter and second moment is
bitwise equal to DDP + torch.optim.AdamW(fused=True) under the same user calls (clipping: torch's
``clip_grad_norm_`` on the model, the same total norm); each DDP bucket is one bucket of the step. Without
clipping more than 0.3 of the host-update time runs before backward ends (from the third step: DDP
reduces its first iteration in one bucket); with clipping none starts before (the norm of the reduced
gradients is known after DDP's final callback). Exact too: bucket views, ``model.zero_grad()``,
``static_graph``, ``find_unused_parameters=True`` (updated at the step), and clipping with parameters
outside DDP in the same optimizer. ``opt.no_sync()`` without ``ddp_model.no_sync()`` is refused before
any update.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _overlap_ddp_worker import CASES, MISUSES, MIXED, SETTINGS, case_name
from _quick import only, table

WORKER = Path(__file__).resolve().parent / "support" / "_overlap_ddp_worker.py"


#: what CI runs (the rest is slow): unclipped and clipped with accumulation, bucket views, a parameter outside DDP,
#: a misuse refused, the non-finite skip
QUICK = [case_name(None, 1, True), case_name(0.05, 4, True), "bucket_views-clip", "head_outside_ddp-clip",
         "opt_no_sync_without_ddp_no_sync_refused", "nonfinite-skip", "given-back-update_in_backward"]
#: an optimizer dropped between backward and step(): its freed gradients given back, or not where already applied
GIVEN_BACK = ["given-back", "given-back-update_in_backward"]


@pytest.fixture(scope="module")
def results(tmp_path_factory, request) -> list[dict]:
    out = tmp_path_factory.mktemp("overlap_ddp")
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(out), *only(request.config, QUICK)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(2)]


def _check(results: list[dict], name: str, clip: float | None) -> None:
    for rank, result in enumerate(results):
        case = result[name]
        assert case["ok"], f"rank {rank}:\n{case['error']}"
        measured = case["measured"]
        assert measured["buckets"] == measured["ddp_buckets"] > 2, "one bucket per DDP bucket, several of them"
        assert measured["overlaps"][0] == 0.0, "the first step knows no order yet"
        if clip is None:
            # From the third step: DDP's first iteration reduces everything in one bucket (it rebuilds its buckets
            # in the order of the gradients at the second), so the second step's one early bucket lands at the end.
            assert max(measured["overlaps"][2:]) > 0.3, measured
        else:
            assert all(start >= 0 for start in measured["starts_after_backward"]), measured
            assert measured["last_grad_norm"] == measured["reference_norm"] > clip, "torch's norm, and the clipping acted"


@pytest.mark.parametrize(("clip", "accumulation", "opt_no_sync"), table(CASES, [case_name(*c) for c in CASES], QUICK))
def test_ddp_updates_during_backward(results, clip, accumulation, opt_no_sync) -> None:
    _check(results, case_name(clip, accumulation, opt_no_sync), clip)


@pytest.mark.parametrize("setting", table([(s,) for s in SETTINGS], [s[0] for s in SETTINGS], QUICK))
def test_ddp_settings_with_updates_during_backward(results, setting) -> None:
    """Bucket views with the model's zero_grad(), and with clipping and accumulation; static_graph."""
    _check(results, setting[0], setting[2])


@pytest.mark.parametrize("name", table(MIXED, MIXED, QUICK))
def test_ddp_with_parameters_outside_it_clips_exactly(results, name) -> None:
    """Norms from the hooks (outside DDP) and from the reduced buckets make one coefficient, torch's."""
    for rank, result in enumerate(results):
        assert result[name]["ok"], f"rank {rank}:\n{result[name]['error']}"


@pytest.mark.parametrize("name", table(MISUSES, MISUSES, QUICK))
def test_ddp_misuses_are_exact_or_refused(results, name) -> None:
    for rank, result in enumerate(results):
        assert result[name]["ok"], f"rank {rank}:\n{result[name]['error']}"


def test_ddp_non_finite_step_is_skipped_before_any_update(results) -> None:
    """nonfinite='skip' with updates during backward under DDP: counts of the reduced gradients, one decision."""
    for rank, result in enumerate(results):
        case = result["nonfinite-skip"]
        assert case["ok"], f"rank {rank}:\n{case['error']}"
        assert case["measured"]["skipped_steps"] == 1


@pytest.mark.parametrize("name", table(GIVEN_BACK, GIVEN_BACK, QUICK))
def test_ddp_an_optimizer_dropped_before_its_step_gives_back_what_it_did_not_apply(results, name) -> None:
    """Freed gradients come back as real tensors, the reference's bits; those the updates during backward applied do
    not (p.grad None, one warning), so that no new optimizer applies them twice."""
    for rank, result in enumerate(results):
        assert result[name]["ok"], f"rank {rank}:\n{result[name]['error']}"
