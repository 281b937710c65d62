"""This rank's share of its node (distributed/node.py): ranks per node from every launcher, and the host update's threads.

The host update ran ``torch.get_num_threads()`` workers, which torchrun and accelerate set to 1 in every rank of a
multi-rank launch: one core per rank of a many-core node. These tests hold the rule that replaced it: the cores of this
process's affinity set, divided among the ranks of the node when they share them, never OMP_NUM_THREADS; and the count
of ranks on the node, which the host-memory pre-flight divides the node's memory by, read from each launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configs import assert_bitwise_equal
from offload_adamw import OffloadAdamW
from offload_adamw.distributed import node
from offload_adamw.kernels import blocked
from offload_adamw.optim import preflight

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("environ", "ranks", "source"), [
    ({"LOCAL_WORLD_SIZE": "8"}, 8, "LOCAL_WORLD_SIZE (torchrun)"),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4, "OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI)"),
    ({"MPI_LOCALNRANKS": "6"}, 6, "MPI_LOCALNRANKS (MPICH / Intel MPI)"),
    ({"SLURM_PROCID": "5", "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3"}, 3,
     "SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID (Slurm)"),
    ({"SLURM_PROCID": "0", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2,5"}, 5,
     "SLURM_TASKS_PER_NODE at SLURM_NODEID (Slurm)"),
    # the first variable that knows wins; a malformed one is skipped, never trusted
    ({"LOCAL_WORLD_SIZE": "two", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2, "OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI)"),
    ({"LOCAL_WORLD_SIZE": "0", "MPI_LOCALNRANKS": "-3"}, 1, "one process (no launcher variable, no process group)"),
    ({"SLURM_PROCID": "0", "SLURM_NODEID": "3", "SLURM_TASKS_PER_NODE": "2(x2)"}, 1,
     "one process (no launcher variable, no process group)"),
    # the batch script around srun is not a task: its Slurm variables describe the tasks it will start
    ({"SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "8"}, 1, "one process (no launcher variable, no process group)"),
    ({}, 1, "one process (no launcher variable, no process group)"),
])
def test_every_launcher_says_how_many_ranks_share_the_node(environ, ranks, source):
    assert node.ranks_on_node(environ) == (ranks, source)


@pytest.mark.parametrize(("text", "node_id", "expected"), [
    ("8", 0, 8), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("2(x3),1", 4, None), ("4(x)", 0, None), ("", 0, None),
    ("0", 0, None),
])
def test_slurm_compressed_task_lists(text, node_id, expected):
    assert node.slurm_tasks_on_node(text, node_id) == expected


@pytest.mark.parametrize(("ranks", "affinity", "host_cores", "shared", "threads"), [
    (8, set(range(100)), 100, True, 12),   # 8 ranks, nobody bound: each takes its twelfth of the host
    (8, set(range(12)), 100, False, 12),   # bound by the launcher to 12 cores: those are its own
    (1, set(range(100)), 100, False, 100),  # one rank: the whole host
    (16, set(range(4)), 4, True, 1),       # more ranks than cores: still one thread
])
def test_the_host_update_takes_its_share_of_the_cores(ranks, affinity, host_cores, shared, threads):
    share = node.node_share({"LOCAL_WORLD_SIZE": str(ranks)}, affinity=affinity, host_cores=host_cores)
    assert (share.shared, share.threads) == (shared, threads)
    assert f"{threads} host update threads" in share.describe()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_host_threads_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="host_threads must be a positive integer or None"):
        OffloadAdamW([torch.nn.Parameter(torch.ones(2))], host_threads=bad)


def _mixed_model(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(300_000,), (512, 300), (4097,), (3, 65)]  # blocked (above the chunk loop's size) and small tensors
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in shapes]


def test_the_bits_do_not_depend_on_host_threads():
    results = []
    for threads in (1, 2, 3):
        params = _mixed_model(0)
        opt = OffloadAdamW(params, lr=1e-2, weight_decay=0.1, host_threads=threads)
        assert opt.host_threads == threads
        for step in range(3):
            g = torch.Generator().manual_seed(100 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            opt.step()
        results.append([p.detach().clone() for p in params]
                       + [opt.state[p][k].clone() for p in params for k in ("exp_avg", "exp_avg_sq")])
    for threads, other in zip((2, 3), results[1:]):
        assert_bitwise_equal(other, results[0], f"parameters and moments with {threads} host threads")


def test_the_update_runs_host_threads_workers_whatever_torch_threads_says():
    params = _mixed_model(1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 under torchrun
    try:
        opt = OffloadAdamW(params, host_threads=3)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    finally:
        torch.set_num_threads(before)
    assert (3, None) in blocked._pools  # the pool of the update's workers: 3, not torch's 1


def test_omp_num_threads_one_no_longer_sizes_the_update():
    """In a fresh process launched as torchrun launches a rank of a one-rank node: OMP_NUM_THREADS=1."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    code = ("import os, torch\nfrom offload_adamw import OffloadAdamW\nfrom offload_adamw.kernels import blocked\n"
            "p = torch.nn.Parameter(torch.ones(1 << 20, dtype=torch.bfloat16))\n"
            "opt = OffloadAdamW([p])\np.grad = torch.ones_like(p)\nopt.step()\n"
            "workers = max((size for size, _ in blocked._pools), default=1)\n"
            "print(torch.get_num_threads(), opt.host_threads, len(os.sched_getaffinity(0)), workers)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    torch_threads, host_threads, cores, workers = map(int, out.stdout.split())
    assert (torch_threads, host_threads, workers) == (1, cores, cores)


def test_the_preflight_divides_the_node_among_the_ranks_every_launcher_names(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(preflight, "_meminfo_available", lambda: 8 << 30)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")  # mpirun: before, every rank was told the whole node
    memory = preflight.host_memory()
    assert memory.sources["MemAvailable (/proc/meminfo), / 8 ranks on this node (OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI))"] \
        == 1 << 30
    given = preflight.host_memory(ranks=(4, "the optimizer's node"))
    assert given.sources["MemAvailable (/proc/meminfo), / 4 ranks on this node (the optimizer's node)"] == 2 << 30


def test_two_gloo_ranks_find_each_other_on_this_host(tmp_path):
    out = tmp_path / "found"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/support/_node_worker.py"), str(out)], env=env,
                          timeout=170, capture_output=True, text=True)
    assert proc.returncode == 0, f"the worker failed ({proc.returncode}); it said:\n{proc.stderr[-3000:]}"
    for rank in (0, 1):
        found = json.loads(Path(f"{out}.{rank}").read_text())
        assert found["before_gather"] == [1, "unknown without a gather of the process group's host names: counted as 1"]
        assert found["optimizer"][:2] == [2, "the ranks of the process group on this host name (gathered)"]
        assert found["optimizer"][2] == max(found["cores"] // 2, 1) if found["cores"] >= (os.cpu_count() or 1) \
            else found["cores"]
        assert found["after_gather"] == [2, "the ranks of the process group on this host name (gathered)"]
        assert found["loopback"] == [2, "every rank of the process group (MASTER_ADDR 127.0.0.1 is this host)"]
        assert found["variable"] == [3, "LOCAL_WORLD_SIZE (torchrun)"]


@pytest.mark.slow
def test_the_node_benchmark_runs_and_reports_both_arrangements(tmp_path):
    out = tmp_path / "node.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run([sys.executable, str(ROOT / "benchmarks/node_bench.py"), "--elements", "1M", "--ranks", "1,2",
                    "--steps", "3", "--json", str(out)], env=env, check=True, timeout=600, capture_output=True)
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1 and [row["ranks"] for row in data["rows"]] == [1, 2]
    for row in data["rows"]:
        assert row["one-thread"]["host_threads"] == 1
        assert row["node-share"]["host_threads"] == max(data["cores"] // row["ranks"], 1)
        assert row["one-thread"]["aggregate_gbps"] > 0 and row["node-share"]["aggregate_gbps"] > 0
        # The ranks' timed steps ran at the same time (each arrangement starts at a barrier of every rank): an
        # aggregate over ranks that ran one after another would count the node's bandwidth once per rank.
        for name in ("one-thread", "node-share"):
            windows = row[name]["windows"]
            assert len(windows) == row["ranks"]
            assert max(start for start, _ in windows) < min(end for _, end in windows), (name, windows)


# ------------------------------------------------------------------------------------------------------ NUMA


def fake_sysfs(root: Path, nodes: dict[int, str], devices: dict[str, str]) -> Path:
    """A made-up /sys: NUMA nodes with their cpu lists, PCI devices with their numa_node."""
    for number, cpulist in nodes.items():
        (root / f"devices/system/node/node{number}").mkdir(parents=True)
        (root / f"devices/system/node/node{number}/cpulist").write_text(cpulist + "\n")
    (root / "devices/system/node/possible").write_text("0-1\n")  # not a node: skipped
    for address, numa in devices.items():
        (root / f"bus/pci/devices/{address}").mkdir(parents=True)
        (root / f"bus/pci/devices/{address}/numa_node").write_text(numa + "\n")
    return root


TWO_SOCKETS = {0: "0-3,8-11", 1: "4-7,12-15"}
GPUS = {"0000:1b:00.0": "1", "0000:3d:00.0": "-1"}


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"pci_bus_id": "0000:1B:00.0"}, (1, {4, 5, 6, 7, 12, 13, 14, 15})),           # the GPU's node, sysfs's spelling
    ({"pci_bus_id": "0000:1b:00.0", "affinity": {0, 1, 4, 5}}, (1, {4, 5})),    # only the cores this rank may use
    ({"pci_bus_id": "0000:1b:00.0", "affinity": {0, 1, 2}}, None),             # none of that node's: as before
    ({"pci_bus_id": "0000:3d:00.0"}, None),                                      # a device without a node (-1)
    ({"pci_bus_id": "0000:99:00.0"}, None),                                      # not there
    ({"pci_bus_id": None}, None),                                                # the parameters are not on a GPU
    ({"node": 0}, (0, {0, 1, 2, 3, 8, 9, 10, 11})),                              # named by the user
])
def test_numa_placement_on_two_sockets(tmp_path, kwargs, expected):
    root = fake_sysfs(tmp_path, TWO_SOCKETS, GPUS)
    kwargs.setdefault("affinity", set(range(16)))
    placement = node.numa_placement(root=root, **kwargs)
    assert (None if placement is None else (placement.node, set(placement.cpus))) == expected
    if placement is not None:
        assert placement.nodes == 2


def test_numa_placement_on_one_node_or_a_broken_sysfs_is_none(tmp_path):
    one = fake_sysfs(tmp_path / "one", {0: "0-15"}, {"0000:1b:00.0": "0"})
    assert node.numa_placement(pci_bus_id="0000:1b:00.0", affinity=set(range(16)), root=one) is None
    broken = fake_sysfs(tmp_path / "broken", {0: "0-7", 1: "8-x"}, GPUS)
    assert node.numa_placement(pci_bus_id="0000:1b:00.0", affinity=set(range(16)), root=broken) is None
    with pytest.raises(ValueError, match="host_numa_node=5: this host's NUMA nodes are \\[0, 1\\]"):
        node.numa_placement(node=5, root=fake_sysfs(tmp_path / "two", TWO_SOCKETS, {}))


def test_the_ranks_whose_gpus_share_a_numa_node_share_its_cores():
    numa = node.NumaPlacement(node=1, cpus=frozenset(range(50, 100)), nodes=2, source="test")
    share = node.node_share({"LOCAL_WORLD_SIZE": "8"}, affinity=set(range(100)), host_cores=100, numa=numa)
    assert (share.cores, share.threads) == (50, 12)  # 4 of the 8 ranks' GPUs on each of the 2 nodes
    bound = node.node_share({"LOCAL_WORLD_SIZE": "8"}, affinity=set(range(50, 62)), host_cores=100,
                            numa=node.NumaPlacement(node=1, cpus=frozenset(range(50, 62)), nodes=2, source="test"))
    assert (bound.cores, bound.threads) == (12, 12)  # bound by the launcher (torchrun --numa-binding): its own


@pytest.mark.parametrize("bad", [-1, True, 1.5, "0"])
def test_host_numa_node_must_be_a_node_number(bad):
    with pytest.raises(ValueError, match="host_numa_node must be a NUMA node number or None"):
        OffloadAdamW([torch.nn.Parameter(torch.ones(2))], host_numa_node=bad)


needs_two_cores_and_numa = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2 or node.page_policy(torch.ones(1 << 12))
    is None, reason="needs Linux's memory-policy calls and two cores")


@needs_two_cores_and_numa
def test_the_gpus_numa_node_holds_the_state_and_runs_the_update(tmp_path, monkeypatch, simulated_device):
    """The whole path, for real where this host can show it: the simulated GPU says its PCI address, a made-up sysfs
    puts it on node 0 with one core of this host (the other core on node 1), and the optimizer places its state's
    pages on node 0 (this host's only real node) and runs its workers on that core alone."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch.setattr(node, "SYSFS", fake_sysfs(tmp_path, {0: str(cores[0]), 1: str(cores[1])},
                                                  {"0000:1b:00.0": "0"}))
    monkeypatch.setattr(simulated_device, "pci_address", "0000:1b:00.0", raising=False)
    pools: dict = {}
    monkeypatch.setattr(blocked, "_pools", pools)  # the pools this test's step makes, alone
    params = _mixed_model(2)
    opt = OffloadAdamW(params, lr=1e-2)
    assert opt.node.numa is not None and (opt.node.numa.node, set(opt.node.numa.cpus)) == (0, {cores[0]})
    assert opt.host_threads == 1 and "NUMA node 0 (the GPU at 0000:1b:00.0 is on it)" in opt.node.describe()
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for p in params:
        for key, t in opt.state[p].items():
            if t.dim() and t.numel() * t.element_size() >= 2 * 4096:
                assert node.page_policy(t) == (node.MPOL_PREFERRED, 0), (key, t.shape)
    outside = torch.zeros(1 << 20)
    assert node.page_policy(outside)[0] == node.MPOL_DEFAULT  # the policy was the state's, not the thread's for good
    assert (1, frozenset({cores[0]})) in pools, f"the step ran on {list(pools)}, not one worker on core {cores[0]}"
    workers = pools[(1, frozenset({cores[0]}))]
    assert workers.submit(lambda: os.sched_getaffinity(0)).result() == {cores[0]}
    assert os.sched_getaffinity(0) >= set(cores)  # ours untouched
    for pool in pools.values():
        pool.shutdown()


def test_the_bits_do_not_depend_on_the_numa_node():
    results = []
    for numa in (None, 0):
        params = _mixed_model(3)
        opt = OffloadAdamW(params, lr=1e-2, weight_decay=0.1, host_numa_node=numa)
        for step in range(2):
            g = torch.Generator().manual_seed(200 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            opt.step()
        results.append([p.detach().clone() for p in params])
    assert_bitwise_equal(results[1], results[0], "parameters on NUMA node 0")
