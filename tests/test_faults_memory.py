"""Host-memory pre-flight: the bill is what OffloadAdamW allocates; too little memory fails early, with figures."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import warnings

import pytest
import torch

from offload_adamw import OffloadAdamW
from offload_adamw.optim.preflight import ENV_AVAILABLE, ENV_SWITCH, HostMemoryError, check_host_memory, host_memory, state_bill

# (parameter dtype, amsgrad): every kind of state the optimizer can allocate.
CONFIGS = [
    (torch.float32, False),
    (torch.float32, True),
    (torch.bfloat16, False),
    (torch.bfloat16, True),
    (torch.float16, False),
    (torch.float64, True),
]


def model_of(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False)).to(dtype)


def backward(model: torch.nn.Module, dtype: torch.dtype) -> None:
    model(torch.ones(2, 7, dtype=dtype)).float().sum().backward()


def fresh_of(optimizer):
    return [(g, i) for g in optimizer.param_groups for i, p in enumerate(g["params"]) if not optimizer.state.get(p)]


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(ENV_AVAILABLE, raising=False)
    monkeypatch.delenv(ENV_SWITCH, raising=False)


@pytest.mark.parametrize("dtype,amsgrad", CONFIGS)
def test_bill_equals_what_the_optimizer_allocates(dtype, amsgrad):
    model = model_of(dtype)
    optimizer = OffloadAdamW(model.parameters(), amsgrad=amsgrad, pin_memory=False)
    bill = state_bill(fresh_of(optimizer), pin_memory=False)
    backward(model, dtype)
    optimizer.step()
    assert bill.total == bill.moments + bill.masters + bill.steps == optimizer.host_state_bytes()
    masters = sum(s["master_param"].nbytes for s in optimizer.state.values() if "master_param" in s)
    assert bill.masters == masters and bill.tensors == 3


def test_bill_figures_by_hand():
    """bf16 Linear(100, 10): 1010 elements; 4 bytes each for m, v and the master (docs/contract.md#memory-bill)."""
    layer = torch.nn.Linear(100, 10).to(torch.bfloat16)
    optimizer = OffloadAdamW(layer.parameters())
    bill = state_bill(fresh_of(optimizer), pin_memory=False)
    assert (bill.moments, bill.masters, bill.steps) == (8080, 4040, 8)
    pinned = state_bill(fresh_of(optimizer), pin_memory=True)
    # per tensor and kind, power-of-two blocks: 1000 elements * 4 B = 4000 -> 4096; 10 * 4 = 40 -> 64
    assert pinned.pinned_blocks == 3 * 4096 + 3 * 64
    assert pinned.total == pinned.pinned_blocks + 8


@pytest.mark.parametrize("pin_memory", [False, True])
def test_refusal_gives_the_figures_per_kind(pin_memory):
    layer = torch.nn.Linear(100, 10).to(torch.bfloat16)
    optimizer = OffloadAdamW([("layer.weight", layer.weight), ("layer.bias", layer.bias)])
    fresh = fresh_of(optimizer)
    need = state_bill(fresh, pin_memory=pin_memory).total
    assert check_host_memory(fresh, pin_memory=pin_memory, available_bytes=need, memlock="ignore").total == need
    with pytest.raises(HostMemoryError) as info:
        check_host_memory(fresh, pin_memory=pin_memory, available_bytes=need - 1, memlock="ignore")
    message = str(info.value)
    for figure in (
        "moments 7.9 KiB (8,080 bytes)",
        "masters 3.9 KiB (4,040 bytes)",
        "step counters 8 bytes",
        f"{need - 1:,} bytes",
    ):
        assert figure in message, (figure, message)
    assert ("power-of-two blocks" in message) == pin_memory and ("pin_memory=False" in message) == pin_memory
    assert info.value.bill.total == need and info.value.memory.available == need - 1


def test_step_fails_before_allocating_anything(monkeypatch):
    model = model_of(torch.bfloat16)
    backward(model, torch.bfloat16)
    optimizer = OffloadAdamW(model.parameters(), pin_memory=False)
    before = [p.detach().clone() for p in model.parameters()]
    monkeypatch.setenv(ENV_AVAILABLE, "600")  # the bill is 672 bytes
    with pytest.raises(HostMemoryError, match=ENV_AVAILABLE):
        optimizer.step()
    assert len(optimizer.state) == 0 and optimizer.host_state_bytes() == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is not None for p in model.parameters())
    monkeypatch.setenv(ENV_SWITCH, "0")
    optimizer.step()  # switched off: the same step runs
    assert optimizer.host_state_bytes() > 0


def test_only_parameters_without_state_are_billed(monkeypatch):
    model = model_of(torch.float32)
    optimizer = OffloadAdamW(model[0].parameters(), pin_memory=False)
    backward(model, torch.float32)
    optimizer.step()
    optimizer.add_param_group({"params": model[1].parameters()})
    new_bill = state_bill([(optimizer.param_groups[1], 0)], pin_memory=False).total
    monkeypatch.setenv(ENV_AVAILABLE, str(new_bill))
    optimizer.step()  # fits exactly: the old group's state is not counted again
    assert float(optimizer.state[model[1].weight]["step"]) == 1.0


def test_measured_host_memory_is_plausible():
    memory = host_memory()
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory.sources, "no figure found (no /proc/meminfo?)"
    assert 0 < memory.available <= physical


@pytest.fixture
def low_memlock():
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (4096, hard))
    yield 4096
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_pinned_state_above_memlock_warns_or_raises(low_memlock):
    layer = torch.nn.Linear(100, 10)
    optimizer = OffloadAdamW(layer.parameters())
    fresh = fresh_of(optimizer)
    big = 1 << 40
    with pytest.warns(RuntimeWarning, match="RLIMIT_MEMLOCK 4.0 KiB"):
        check_host_memory(fresh, pin_memory=True, available_bytes=big)
    with pytest.raises(HostMemoryError, match="RLIMIT_MEMLOCK"):
        check_host_memory(fresh, pin_memory=True, available_bytes=big, memlock="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_host_memory(fresh, pin_memory=True, available_bytes=big, memlock="ignore")
        check_host_memory(fresh, pin_memory=False, available_bytes=big)  # unpinned state is not locked


# ------------------------------------------------ the whole cgroup hierarchy

from offload_adamw.optim import preflight  # noqa: E402


def fake_tree(root, files: dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_ancestor_limit_counts(tmp_path):
    """The leaf has no limit; its grandparent has 1 GiB with 900 MiB used: 100 MiB are free."""
    fake_tree(tmp_path, {
        "proc": "0::/a/b/c\n",
        "cg/a/memory.max": str(1 << 30), "cg/a/memory.current": str(900 << 20),
        "cg/a/b/memory.max": "max", "cg/a/b/memory.current": str(10 << 20),
        "cg/a/b/c/memory.max": "max", "cg/a/b/c/memory.current": str(5 << 20),
    })
    free, where = preflight.cgroup_free(proc_cgroup=tmp_path / "proc", root=tmp_path / "cg")
    assert free == (1 << 30) - (900 << 20) and where.endswith("a/memory.max")


def test_cgroup_v2_tightest_of_leaf_and_ancestors(tmp_path):
    fake_tree(tmp_path, {
        "proc": "0::/a/b\n",
        "cg/a/memory.max": str(8 << 30), "cg/a/memory.current": str(1 << 30),
        "cg/a/b/memory.max": str(2 << 30), "cg/a/b/memory.current": str(1536 << 20),
    })
    free, where = preflight.cgroup_free(proc_cgroup=tmp_path / "proc", root=tmp_path / "cg")
    assert free == 512 << 20 and where.endswith("a/b/memory.max")


def test_cgroup_v2_namespace_root_when_the_path_is_not_visible(tmp_path):
    """Inside a container the host's path is not mounted: the mount root is this process's cgroup."""
    fake_tree(tmp_path, {"proc": "0::/docker/abc\n", "cg/memory.max": str(4 << 30), "cg/memory.current": str(3 << 30)})
    assert preflight.cgroup_free(proc_cgroup=tmp_path / "proc", root=tmp_path / "cg")[0] == 1 << 30


def test_cgroup_v1_hierarchical_limit_counts(tmp_path):
    """v1: the leaf's own limit is unset; memory.stat's hierarchical_memory_limit (an ancestor's) applies."""
    unlimited = str(9223372036854771712)
    fake_tree(tmp_path, {
        "proc": "12:memory:/job/step\n11:cpu,cpuacct:/job\n",
        "cg/memory/job/step/memory.limit_in_bytes": unlimited,
        "cg/memory/job/step/memory.usage_in_bytes": str(700 << 20),
        "cg/memory/job/step/memory.stat": f"cache 0\nrss {700 << 20}\nhierarchical_memory_limit {1 << 30}\n",
    })
    free, where = preflight.cgroup_free(proc_cgroup=tmp_path / "proc", root=tmp_path / "cg")
    assert free == (1 << 30) - (700 << 20) and "hierarchical_memory_limit" in where


def test_cgroup_v1_ancestor_limit_counts(tmp_path):
    fake_tree(tmp_path, {
        "proc": "4:memory,foo:/job/step\n",
        "cg/memory/job/memory.limit_in_bytes": str(2 << 30), "cg/memory/job/memory.usage_in_bytes": str(1900 << 20),
        "cg/memory/job/step/memory.limit_in_bytes": str(8 << 30), "cg/memory/job/step/memory.usage_in_bytes": str(100 << 20),
    })
    assert preflight.cgroup_free(proc_cgroup=tmp_path / "proc", root=tmp_path / "cg")[0] == (2 << 30) - (1900 << 20)


def test_no_cgroup_limit_anywhere(tmp_path):
    fake_tree(tmp_path, {"proc": "0::/a\n", "cg/a/memory.max": "max", "cg/a/memory.current": "5", "cg/memory.max": "max"})
    assert preflight.cgroup_free(proc_cgroup=tmp_path / "proc", root=tmp_path / "cg") is None
    assert preflight.cgroup_free(proc_cgroup=tmp_path / "missing", root=tmp_path / "cg") is None


def test_host_memory_takes_the_hierarchy_and_divides_by_the_ranks_of_the_node(tmp_path, monkeypatch):
    fake_tree(tmp_path, {
        "proc": "0::/a/b\n", "cg/a/memory.max": str(1 << 30), "cg/a/memory.current": "0",
        "cg/a/b/memory.max": "max", "cg/a/b/memory.current": "0",
    })
    monkeypatch.setattr(preflight, "PROC_SELF_CGROUP", tmp_path / "proc")
    monkeypatch.setattr(preflight, "CGROUP_ROOT", tmp_path / "cg")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = host_memory()
    assert any(name.startswith("cgroup limit - usage") and value == 1 << 30 for name, value in alone.sources.items()), (
        alone.sources
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    shared = host_memory()
    assert shared.sources["cgroup limit - usage, / 4 ranks on this node (LOCAL_WORLD_SIZE (torchrun))"] == (1 << 30) // 4
    assert shared.available <= (1 << 30) // 4
    layer = torch.nn.Linear(1 << 12, 1 << 12).to(torch.bfloat16)  # 16 Mi elements: 192 MiB of state
    optimizer = OffloadAdamW(layer.parameters(), pin_memory=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    check_host_memory(fresh_of(optimizer), pin_memory=False)  # 192 MiB of 1 GiB: fits alone
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(HostMemoryError, match="8 ranks on this node"):
        check_host_memory(fresh_of(optimizer), pin_memory=False)  # 128 MiB per rank: does not


# --------------------------------------------- RLIMIT_AS, in a real process

RLIMIT_SCRIPT = r"""
import json, os, resource, sys
import torch
torch.set_num_threads(1)
from offload_adamw import OffloadAdamW
from offload_adamw.optim.preflight import HostMemoryError

small = torch.nn.Parameter(torch.full((1000,), 0.5, dtype=torch.bfloat16))
big = torch.nn.Parameter(torch.full((64 << 20,), 0.5, dtype=torch.bfloat16))  # state: 3 x 256 MiB
small.grad, big.grad = torch.ones_like(small), torch.ones_like(big)
opt = OffloadAdamW([{"params": [small]}, {"params": [big]}], pin_memory=False)
before = (small.detach().clone(), big.detach().clone())
vm = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize:"))) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (200 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    opt.step()
    error = None
except MemoryError as exc:
    error = {"type": type(exc).__name__, "message": str(exc)}
except Exception as exc:
    error = {"type": "other " + type(exc).__name__, "message": str(exc)}
print(json.dumps({
    "error": error,
    "states": len(opt.state),
    "unchanged": torch.equal(small, before[0]) and torch.equal(big, before[1]),
}))
"""


def _run_rlimit(preflight_on: bool) -> dict:
    env = {**os.environ, "OFFLOAD_ADAMW_PREFLIGHT": "1" if preflight_on else "0"}
    env.pop(ENV_AVAILABLE, None)
    result = subprocess.run([sys.executable, "-c", RLIMIT_SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_rlimit_as_is_part_of_the_preflight():
    report = _run_rlimit(preflight_on=True)
    assert report["error"] is not None and report["error"]["type"] == "HostMemoryError", report
    assert "RLIMIT_AS" in report["error"]["message"]
    assert report["states"] == 0 and report["unchanged"]


def test_a_step_that_cannot_allocate_changes_nothing():
    """Pre-flight off: group 0's state fits under RLIMIT_AS, group 1's does not. No group is updated."""
    report = _run_rlimit(preflight_on=False)
    assert report["error"] is not None and report["error"]["type"] == "MemoryError", report
    assert "no state or parameter was changed" in report["error"]["message"]
    assert report["states"] == 0 and report["unchanged"], report
