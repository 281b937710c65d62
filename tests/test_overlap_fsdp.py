"""FSDP2 with host updates during backward: 2 gloo ranks, the CPU as device, 8 sharded blocks and
the root's own parameters, freed gradients.

Also freed DTensor gradients with the update at step(): torch's clipping through ``p.grad`` and FSDP2's
accumulation into ``p.grad`` (a reduce per micro-batch) act on the host shard.

Properties, for accumulation 1 and 4 (``set_requires_gradient_sync(False)`` on the micro-batches that only
accumulate) and with and without clipping: every local shard and second moment is bitwise equal to FSDP2 +
torch.optim.AdamW(fused=True) under the same user calls; each FSDP group is one bucket; the timeline's
events come in the order the planner's step-time model assumes (planning/overlap.py: groups in the order
their gradients became ready, each stage one group at a time). Without clipping more than 0.3 of the
host-update time runs before backward ends; with clipping none starts before (the global norm needs the
last group's gradient).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _overlap_fsdp_worker import BLOCKS, CASES, FREED_CASES, case_name, freed_case_name
from _quick import only, table

WORKER = Path(__file__).resolve().parent / "support" / "_overlap_fsdp_worker.py"


#: what CI runs (the rest is slow): updates during backward unclipped and clipped with accumulation, and the
#: non-finite skip (freed gradients at the step on FSDP2: test_clipping_in_backward's quick cases)
QUICK = [case_name(None, 1), case_name(0.05, 4), "nonfinite-skip"]


@pytest.fixture(scope="module")
def results(tmp_path_factory, request) -> list[dict]:
    out = tmp_path_factory.mktemp("overlap_fsdp")
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(out), *only(request.config, QUICK)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize(("clip", "accumulation"), table(CASES, [case_name(c, a) for c, a in CASES], QUICK))
def test_fsdp2_updates_during_backward(results, clip, accumulation) -> None:
    for rank, result in enumerate(results):
        case = result[case_name(clip, accumulation)]
        assert case["ok"], f"rank {rank}:\n{case['error']}"
        measured = case["measured"]
        assert measured["buckets"] == BLOCKS + 1, "one bucket per FSDP group (the blocks and the root)"
        assert measured["events_in_order"], measured
        assert measured["flow_shop"], f"not the order the planner's step-time model assumes: {measured}"
        assert measured["overlaps"][0] == 0.0, "the first step knows no order yet"
        if clip is None:
            assert max(measured["overlaps"][1:]) > 0.3, measured
        else:
            assert all(start >= 0 for start in measured["starts_after_backward"]), measured
            assert measured["last_grad_norm"] > clip, "the clipping must have acted"
    if clip is not None:
        assert results[0][case_name(clip, accumulation)]["measured"]["last_grad_norm"] == \
            results[1][case_name(clip, accumulation)]["measured"]["last_grad_norm"], "one global norm"


@pytest.mark.parametrize(("clip_by", "accumulation", "sync_each"),
                         table(FREED_CASES, [freed_case_name(*c) for c in FREED_CASES], QUICK))
def test_fsdp2_freed_gradients_with_the_update_at_step(results, clip_by, accumulation, sync_each) -> None:
    """Freed DTensor gradients: torch's clip_grad_norm_ on the model and FSDP2's own accumulation reach the host."""
    for rank, result in enumerate(results):
        case = result[freed_case_name(clip_by, accumulation, sync_each)]
        assert case["ok"], f"rank {rank}:\n{case['error']}"


def test_fsdp2_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(results) -> None:
    """nonfinite='skip' + max_grad_norm during backward: the inf counts are summed over the ranks before any update."""
    for rank, result in enumerate(results):
        case = result["nonfinite-skip"]
        assert case["ok"], f"rank {rank}:\n{case['error']}"
        assert case["measured"]["skipped_steps"] == 1


@pytest.mark.slow  # the simulated device's run (tests/test_simulated_suites.py) is the quick one: the device fingerprint
def test_fsdp2_an_edit_through_p_data_between_backward_and_step_is_refused_on_every_rank(results) -> None:
    """A clamp and an in-place copy of a sharded parameter's .data after its update ran during backward: step() refuses
    them by name on both ranks (the local shard's mark)."""
    for rank, result in enumerate(results):
        case = result["edit-refused"]
        assert case["ok"], f"rank {rank}:\n{case['error']}"
        assert case["measured"]["refused"] == {"clamp": True, "in-place copy": True}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["given-back", "given-back-update_in_backward"])
def test_fsdp2_an_optimizer_dropped_before_its_step_gives_back_what_it_did_not_apply(results, name) -> None:
    """Freed DTensor gradients come back as DTensors over real shards, the reference's bits; those the updates during
    backward applied do not (p.grad None, one warning), so that no new optimizer applies them twice."""
    for rank, result in enumerate(results):
        assert result[name]["ok"], f"rank {rank}:\n{result[name]['error']}"
