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
* Nothing here allocates or changes the process: reading the environment, the affinity set and, in the
  gather case, one collective.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["NodeShare", "host_threads", "node_share", "ranks_on_node"]

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
    """Threads of the host update: ``cores // ranks`` when shared, else ``cores``; at least 1."""

    def describe(self) -> str:
        share = f" shared by {self.ranks} ranks" if self.shared else ""
        ranks = "1 rank" if self.ranks == 1 else f"{self.ranks} ranks"
        return (f"{self.threads} host update threads: {self.cores} cores in this process's affinity set{share} "
                f"({ranks} on this node: {self.ranks_source})")


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
               host_cores: int | None = None) -> NodeShare:
    """This rank's :class:`NodeShare` (``affinity`` and ``host_cores`` replace the measured ones, for tests)."""
    ranks, source = ranks_on_node(environ, gather=gather)
    allowed = _affinity() if affinity is None else affinity
    cores = max(len(allowed), 1)
    shared = ranks > 1 and cores >= (_host_cores() if host_cores is None else host_cores)
    threads = max(cores // ranks, 1) if shared else cores
    return NodeShare(ranks=ranks, ranks_source=source, cores=cores, shared=shared, threads=threads)


def host_threads(environ: Mapping[str, str] | None = None) -> int:
    """Threads of this rank's host update (:attr:`NodeShare.threads`)."""
    return node_share(environ).threads
