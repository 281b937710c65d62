"""HSDP in the planner: ``replicas`` copies of the model, each sharded over (nodes x GPUs) / replicas ranks.

Before ``--replicas`` the planner always sharded over every rank of every node, so for llama-3-70b on 2 nodes it said
628 GB of host memory per node, right for FSDP over 16 ranks, where HSDP with a replica per node needs about 1.19 TB.
The per-rank bill is held against what OffloadAdamW allocates under HSDP on 4 gloo ranks (slow tier).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_adamw import cli
from offload_adamw.planning.models import PRESETS
from offload_adamw.planning.planner import GB, HardwareConfig, TrainingConfig, fsdp_rank_host_bytes, plan

ROOT = Path(__file__).resolve().parents[1]
OFFLOAD = "fsdp+offload-adamw"


def _strategy(result, name):
    return next(s for s in result.strategies if s.name == name)


def test_hsdp_with_a_replica_per_node_holds_the_whole_state_on_every_node():
    model = PRESETS["llama-3-70b"]
    fsdp = plan(model, HardwareConfig(nodes=2), TrainingConfig())
    hsdp = plan(model, HardwareConfig(nodes=2, replicas=2), TrainingConfig())
    fsdp_host, hsdp_host = _strategy(fsdp, OFFLOAD).host.total, _strategy(hsdp, OFFLOAD).host.total
    assert round(fsdp_host / GB) == 628 and round(hsdp_host / GB) == 1193
    # every node holds one whole replica's state: 12 bytes per parameter, plus the gradients and staging (2 + 2)
    reserved = HardwareConfig().host_reserved_bytes
    assert abs((hsdp_host - reserved) - 16 * model.num_parameters()) < 0.01 * 16 * model.num_parameters()
    assert any("HSDP: 2 replicas, each sharded over 8 ranks" in note for note in _strategy(hsdp, OFFLOAD).notes)
    assert not any("HSDP" in note for note in _strategy(fsdp, OFFLOAD).notes)
    # twice the elements per rank: twice the host update per node
    assert _strategy(hsdp, OFFLOAD).step_time_lower_bound_s == pytest.approx(
        2 * _strategy(fsdp, OFFLOAD).step_time_lower_bound_s, rel=0.01)


@settings(max_examples=25, deadline=None)
@given(per_node=st.integers(1, 8), nodes=st.integers(1, 4), split=st.integers(0, 5))
def test_the_per_rank_bill_is_fsdp_over_one_replicas_ranks(per_node, nodes, split):
    world = per_node * nodes
    divisors = [r for r in range(1, world + 1) if world % r == 0]
    replicas = divisors[split % len(divisors)]
    shapes = [s for _, s in PRESETS["llama-2-7b"].parameter_shapes()]
    result = plan(PRESETS["llama-2-7b"], HardwareConfig(gpus_per_node=per_node, nodes=nodes, replicas=replicas),
                  TrainingConfig())
    rank = _strategy(result, OFFLOAD).host_per_rank
    expected = fsdp_rank_host_bytes(shapes, world=world // replicas, rank=0)
    assert rank.state == expected.state and rank.gradients == expected.gradients


@pytest.mark.parametrize("replicas", [0, -1, 3, True])
def test_replicas_must_divide_the_ranks(replicas):
    with pytest.raises(ValueError, match="replicas must"):
        HardwareConfig(nodes=2, replicas=replicas)


def test_the_command_line_takes_replicas_and_refuses_a_bad_count_with_exit_2(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--preset", "llama-3-70b", "--nodes", "2", "--replicas", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["hardware"]["replicas"] == 2
    assert "HSDP: 2 replicas of 8-way shards" in capsys.readouterr().out
    assert cli.main(["plan", "--preset", "llama-3-70b", "--nodes", "2", "--replicas", "3"]) == 2
    assert "replicas must divide the 16 ranks" in capsys.readouterr().err


@pytest.mark.slow
def test_the_planners_bill_is_what_offload_adamw_allocates_under_hsdp_on_4_gloo_ranks(tmp_path):
    out = tmp_path / "hsdp"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    subprocess.run([sys.executable, str(ROOT / "tests/support/_hsdp_worker.py"), str(out)], env=env, check=True,
                   timeout=600, capture_output=True)
    for rank in range(4):
        found = json.loads(Path(f"{out}.{rank}").read_text())
        assert found["state"] == found["bill_state"] and found["buffers"] == found["bill_buffers"], found
        assert found["bitwise_equal"], found  # HSDP + OffloadAdamW is torch's HSDP + AdamW(fused=True), bit for bit
        assert found["ranks_on_node"] == 4
