"""This rank's share of its node: how many ranks of the job run on this host, and how many cores the host update may use.

Contract:

* :func:`ranks_on_node` answers from the first source that knows, and says which:
  ``LOCAL_WORLD_SIZE`` (torchrun, hence ``accelerate launch`` and Lightning under torchrun), Open MPI's
  ``OMPI_COMM_WORLD_LOCAL_SIZE``, MPICH's and Intel MPI's ``MPI_LOCALNRANKS``, Slurm's
  ``SLURM_STEP_TASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``) at this task's ``SLURM_NODEID``; then, with
  a default process group of more than one rank, every rank of it when its rendezvous address
  (``MASTER_ADDR``) is a loopback address (``mp.spawn`` on one host), else the ranks whose host name is
  this one's, gathered once per process group (a collective: construct the optimizer on every rank, as
  DDP and FSDP are); else 1 (one process). A malformed variable is skipped, never trusted.
* :func:`host_threads` is the number of threads this rank's host update runs: the cores in this process's
  affinity set (``os.sched_getaffinity``), divided by the ranks on this node when they share them (the
  affinity set is every core of the host: no launcher bound the ranks to their own cores), at least 1.
  ``OMP_NUM_THREADS``, which torchrun and accelerate set to 1 for every rank of a multi-rank launch, is
  not consulted: it sizes torch's intra-op pool, not the update's workers.
* NUMA (:func:`numa_placement`): on a host of two or more NUMA nodes (``/sys/devices/system/node``), the node
  of this rank's GPU (its PCI device's ``numa_node``) or the one the user names, and that node's cores this
  process may use. With one, :attr:`NodeShare.threads` counts those cores, shared by the ranks of this host
  whose GPUs are on that node (the ranks of the host divided evenly among its NUMA nodes); the update's worker
  threads run on them (kernels/blocked.py) and the host state is allocated on that node's memory
  (:func:`allocating_on`: the calling thread's memory policy prefers the node while the state is made, and
  each tensor's pages are moved there after it is filled, since torch's own threads may have touched them
  first). One node, no such file, a device without a node, or none of the node's cores in this process's
  affinity set: no placement, as before.
* :func:`device_numa_node` is the NUMA node sysfs gives a PCI device, -1 included (the platform does not say),
  and :func:`bus_id_by_uuid` the PCI address of a GPU from the NVIDIA driver's folders, where torch gives none
  (accel/streams.py's ``CudaBackend.pci_bus_id`` asks it); the selftest reports both as the optimizer reads them.
* Nothing else here changes the process: reading the environment, sysfs, the affinity set and, in the
  gather case, one collective.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import platform
import re
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

__all__ = ["NodeShare", "NumaPlacement", "allocating_on", "bus_id_by_uuid", "device_numa_node", "host_threads",
           "node_share", "numa_placement", "ranks_on_node"]

#: where the kernel describes the host (tests point it at a made-up topology)
SYSFS = Path("/sys")

#: the launchers' variables for the number of this job's ranks on this host, in the order they are trusted
LOCAL_SIZE_VARIABLES = (
    ("LOCAL_WORLD_SIZE", "torchrun"),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"),
    ("MPI_LOCALNRANKS", "MPICH / Intel MPI"),
)
SLURM_VARIABLES = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")

# the gathered answer per process group (one collective per group and process)
_gathered: dict[int, int] = {}


@dataclass(frozen=True)
class NodeShare:
    """This rank's share of its host, with where each figure came from."""

    ranks: int
    """Ranks of this job on this host."""
    ranks_source: str
    """Where :attr:`ranks` came from (a variable, the process group, or "one process")."""
    cores: int
    """Cores in this process's affinity set."""
    shared: bool
    """Whether those cores are shared with the other ranks of this host (the set is every core of the host)."""
    threads: int
    """Threads of the host update: ``cores // ranks`` (of the NUMA node: ``cores // (ranks / nodes)``) when
    shared, else ``cores``; at least 1."""
    numa: NumaPlacement | None = None
    """The NUMA node the host update and its state are placed on, or None (see the module docstring)."""

    def describe(self) -> str:
        share = f" shared by {self.ranks} ranks" if self.shared else ""
        ranks = "1 rank" if self.ranks == 1 else f"{self.ranks} ranks"
        where = "this process's affinity set" if self.numa is None else f"NUMA node {self.numa.node} ({self.numa.source})"
        return f"{self.threads} host update threads: {self.cores} cores of {where}{share} ({ranks} on this node: " \
               f"{self.ranks_source})"


@dataclass(frozen=True)
class NumaPlacement:
    """The NUMA node of this rank's host update and state."""

    node: int
    cpus: frozenset[int]
    """That node's cores this process may use (never empty)."""
    nodes: int
    """NUMA nodes of the host."""
    source: str
    """How the node was chosen."""


def _positive(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int | None:
    """The count at ``node_id`` of Slurm's compressed list ("2(x3),1" is 2, 2, 2, 1); None if malformed."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    if not 0 <= node_id < len(counts) or counts[node_id] <= 0:
        return None
    return counts[node_id]


def _is_loopback(address: str) -> bool:
    if address.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip()).is_loopback
    except ValueError:
        return False


def _gather_hosts() -> int:
    import torch.distributed as dist

    group = dist.group.WORLD
    key = id(group)
    if key not in _gathered:
        hosts: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        _gathered[key] = sum(host == socket.gethostname() for host in hosts)
    return _gathered[key]


def ranks_on_node(environ: Mapping[str, str] | None = None, *, gather: bool = True) -> tuple[int, str]:
    """The ranks of this job on this host and the source of that figure (see the module docstring).

    ``gather=False`` never communicates: where only a gather could tell (an answer not already gathered), 1.
    """
    env = os.environ if environ is None else environ
    for name, launcher in LOCAL_SIZE_VARIABLES:
        count = _positive(env.get(name))
        if count is not None:
            return count, f"{name} ({launcher})"
    node_id = env.get("SLURM_NODEID", "").strip()
    if node_id.isdigit() and env.get("SLURM_PROCID"):  # a task of srun, not the batch script around it
        for name in SLURM_VARIABLES:
            count = slurm_tasks_on_node(env[name], int(node_id)) if env.get(name) else None
            if count is not None:
                return count, f"{name} at SLURM_NODEID (Slurm)"
    try:
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
    except ImportError:  # a torch built without distributed
        initialized = False
    if initialized:
        world = dist.get_world_size()
        if world == 1:
            return 1, "a process group of one rank"
        if _is_loopback(env.get("MASTER_ADDR", "")):
            return world, f"every rank of the process group (MASTER_ADDR {env['MASTER_ADDR']} is this host)"
        if gather or id(dist.group.WORLD) in _gathered:
            return _gather_hosts(), "the ranks of the process group on this host name (gathered)"
        return 1, "unknown without a gather of the process group's host names: counted as 1"
    return 1, "one process (no launcher variable, no process group)"


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux: every core
        return set(range(os.cpu_count() or 1))


def _host_cores() -> int:
    return os.cpu_count() or 1


def node_share(environ: Mapping[str, str] | None = None, *, gather: bool = True, affinity: set[int] | None = None,
               host_cores: int | None = None, numa: NumaPlacement | None = None) -> NodeShare:
    """This rank's :class:`NodeShare` (``affinity`` and ``host_cores`` replace the measured ones, for tests), on the
    NUMA placement ``numa`` where there is one (:func:`numa_placement`)."""
    ranks, source = ranks_on_node(environ, gather=gather)
    allowed = _affinity() if affinity is None else affinity
    cores = max(len(allowed), 1)
    shared = ranks > 1 and cores >= (_host_cores() if host_cores is None else host_cores)
    threads = max(cores // ranks, 1) if shared else cores
    if numa is not None:
        # the node's cores, shared (when nobody bound the ranks) by the ranks whose GPUs are on it
        cores = len(numa.cpus)
        threads = max(cores // max(ranks // numa.nodes, 1), 1) if shared else cores
    return NodeShare(ranks=ranks, ranks_source=source, cores=cores, shared=shared, threads=threads, numa=numa)


def host_threads(environ: Mapping[str, str] | None = None) -> int:
    """Threads of this rank's host update (:attr:`NodeShare.threads`)."""
    return node_share(environ).threads


# ------------------------------------------------------------------------------------------------------ NUMA


def parse_cpulist(text: str) -> set[int]:
    """The kernel's cpu list ("0-3,8-11,16") as a set; ValueError when malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def numa_nodes(root: Path | None = None) -> dict[int, frozenset[int]]:
    """NUMA node -> its cores, from sysfs (empty where it cannot be read)."""
    base = (SYSFS if root is None else root) / "devices/system/node"
    nodes: dict[int, frozenset[int]] = {}
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return {}
    for entry in entries:
        match = re.fullmatch(r"node(\d+)", entry.name)
        if match is None:
            continue
        try:
            nodes[int(match.group(1))] = frozenset(parse_cpulist((entry / "cpulist").read_text()))
        except (OSError, ValueError):
            return {}
    return nodes


def device_numa_node(pci_bus_id: str, root: Path | None = None) -> int | None:
    """The NUMA node sysfs gives the PCI device ``pci_bus_id`` ("0000:1b:00.0"): -1 where the platform does not
    say (as the kernel writes it, which the selftest reports), None where it cannot be read or is malformed."""
    path = (SYSFS if root is None else root) / "bus/pci/devices" / pci_bus_id.lower() / "numa_node"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


#: the NVIDIA driver's folder of one folder per GPU, named by PCI bus id (tests point it at a made-up one)
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def bus_id_by_uuid(uuid: str, root: str | None = None) -> str | None:
    """The PCI bus id of the GPU whose UUID is ``uuid``, from the driver's folders (:data:`NVIDIA_GPUS`, named by bus
    id, each with an ``information`` file holding ``GPU UUID: GPU-<uuid>``): where torch does not give the bus id."""
    root = NVIDIA_GPUS if root is None else root
    try:
        folders = sorted(os.listdir(root))
    except OSError:
        return None
    wanted = uuid.lower().removeprefix("gpu-")
    for folder in folders:
        try:
            with open(os.path.join(root, folder, "information")) as f:
                for line in f:
                    if line.startswith("GPU UUID:") and line.split(":", 1)[1].strip().lower().removeprefix("gpu-") == wanted:
                        return folder.lower()
        except OSError:
            continue
    return None


def numa_placement(*, pci_bus_id: str | None = None, node: int | None = None, affinity: set[int] | None = None,
                   root: Path | None = None) -> NumaPlacement | None:
    """Where this rank's host update and state go: the node ``node`` names, else the node of the GPU at
    ``pci_bus_id``; None on a host of one node, or where the node is unknown or none of its cores is allowed."""
    nodes = numa_nodes(root)
    if node is not None:
        if node not in nodes:
            raise ValueError(f"host_numa_node={node}: this host's NUMA nodes are {sorted(nodes) or 'unknown'}")
        source = "host_numa_node"
    elif len(nodes) < 2 or pci_bus_id is None:
        return None
    else:
        node = device_numa_node(pci_bus_id, root)
        if node is None or node not in nodes:  # unreadable, -1 (the platform does not say) or no such node here
            return None
        source = f"the GPU at {pci_bus_id.lower()} is on it"
    cpus = nodes[node] & (_affinity() if affinity is None else affinity)
    if not cpus:
        return None
    return NumaPlacement(node=node, cpus=frozenset(cpus), nodes=len(nodes), source=source)


# The memory-policy system calls (Linux): numbers per architecture, and the constants of <numaif.h>.
_SYSCALLS = {"x86_64": {"mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239},
             "aarch64": {"mbind": 235, "get_mempolicy": 236, "set_mempolicy": 237}}
MPOL_DEFAULT, MPOL_PREFERRED = 0, 1
MPOL_F_NODE, MPOL_F_ADDR = 1, 2
MPOL_MF_MOVE = 2
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _syscall(name: str, *args: int | ctypes.Array[ctypes.c_ulong] | ctypes.c_int | None) -> bool:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no C library to call
        return False
    converted = [ctypes.c_long(a) if isinstance(a, int) else (ctypes.byref(a) if isinstance(a, ctypes.c_int) else a)
                 for a in args]
    return int(libc.syscall(ctypes.c_long(numbers[name]), *converted)) == 0


def _mask(node: int) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    return mask, words * 64 + 1  # the kernel reads maxnode - 1 bits


def prefer_node(node: int | None) -> bool:
    """The calling thread's memory policy: prefer ``node`` (None: the default policy again)."""
    if node is None:
        return _syscall("set_mempolicy", MPOL_DEFAULT, None, 0)
    mask, maxnode = _mask(node)
    return _syscall("set_mempolicy", MPOL_PREFERRED, mask, maxnode)


def move_to_node(t: Tensor, node: int) -> bool:
    """Prefer ``node`` for the whole pages of ``t``'s storage, moving those already elsewhere; whether it took."""
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if last <= first:
        return True  # less than a page of its own: it lives where its neighbours do
    mask, maxnode = _mask(node)
    return _syscall("mbind", first, last - first, MPOL_PREFERRED, mask, maxnode, MPOL_MF_MOVE)


def page_policy(t: Tensor) -> tuple[int, int] | None:
    """(policy, node the page lives on) of the first whole page of ``t``'s storage, or None; for tests and reports."""
    start = t.untyped_storage().data_ptr()
    address = -(-start // _PAGE) * _PAGE
    if address + _PAGE > start + t.untyped_storage().nbytes():
        return None
    policy, where = ctypes.c_int(-1), ctypes.c_int(-1)
    mask, maxnode = _mask(0)
    if not _syscall("get_mempolicy", policy, mask, maxnode, address, MPOL_F_ADDR):
        return None
    if not _syscall("get_mempolicy", where, None, 0, address, MPOL_F_ADDR | MPOL_F_NODE):
        return None
    return policy.value, where.value


@contextlib.contextmanager
def allocating_on(placement: NumaPlacement | None) -> Iterator[list[Tensor]]:
    """Host memory the calling thread allocates inside goes to ``placement``'s node; tensors appended to the list it
    gives are moved there on the way out (torch's threads may have touched some pages first). None: no effect."""
    made: list[Tensor] = []
    if placement is None:
        yield made
        return
    prefer_node(placement.node)
    try:
        yield made
    finally:
        prefer_node(None)
        for t in made:
            if t.device.type == "cpu" and not t.is_pinned():  # page-locked pages cannot move; they were made here
                move_to_node(t, placement.node)
