"""Host-memory pre-flight: refuse, with the figures, optimizer state that cannot fit.

Contract:

* :func:`state_bill` counts the bytes OffloadAdamW will allocate for
  parameters that have no state yet (docs/contract.md#memory-bill): the moments
  (``exp_avg``, ``exp_avg_sq``, and ``max_exp_avg_sq`` with amsgrad; float32,
  float64 for float64 parameters), the masters (for every parameter that is not
  a float32/float64 tensor in host memory) and the step counters. When the
  state is pinned, torch's caching host allocator hands out power-of-two
  blocks, so the pinned figure is rounded up per tensor.
* :func:`host_memory` reads what the host can give: ``MemAvailable`` from
  /proc/meminfo; the least free memory (limit minus usage) over this process's
  cgroup and every ancestor (:func:`cgroup_free`; cgroup v2 ``memory.max`` /
  ``memory.current``, v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``
  and memory.stat's ``hierarchical_memory_limit``); ``RLIMIT_AS`` minus the
  address space in use; and ``RLIMIT_MEMLOCK``. Where several ranks share the
  node (distributed/node.py: torchrun's ``LOCAL_WORLD_SIZE``, Open MPI's, MPICH's
  or Slurm's variables, or the process group), each gets its share of the
  node-wide figures (MemAvailable and the cgroup's): they are divided by that count.
* :func:`check_host_memory` raises :class:`HostMemoryError` (a MemoryError)
  before anything is allocated when the bill exceeds the available bytes,
  with the bytes per kind in the message and on the exception. Pinned state
  above ``RLIMIT_MEMLOCK`` warns by default, because the CUDA driver pins
  cudaHostAlloc memory without charging that limit; ``memlock="raise"`` makes
  it an error for setups where it applies.
* A parameter on the meta device (no data) is refused by name: no master can
  be copied from it (:class:`~offload_adamw.contract.rules.Unsupported`, a RuntimeError as torch's fused
  AdamW raises, and a ValueError).
* Environment: ``OFFLOAD_ADAMW_HOST_AVAILABLE_BYTES`` replaces the measured
  available figure (for tests and for reserving room for other work);
  ``OFFLOAD_ADAMW_PREFLIGHT=0`` turns the check off.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offload_adamw.contract import bills
from offload_adamw.contract.rules import Unsupported
from offload_adamw.distributed import local_tensor
from offload_adamw.distributed.node import ranks_on_node
from offload_adamw.optim.state import dtype_name, on_host

try:
    import resource  # POSIX only: the locked-memory limit
except ImportError:  # Windows: no such limit to report
    resource = None  # type: ignore[assignment]

__all__ = ["HostMemory", "HostMemoryError", "StateBill", "cgroup_free", "check_host_memory", "host_memory", "state_bill"]

ENV_AVAILABLE = "OFFLOAD_ADAMW_HOST_AVAILABLE_BYTES"
#: where this process's cgroup is named, and where the cgroup file systems are mounted (tests point these elsewhere).
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_UNLIMITED = 1 << 60
ENV_SWITCH = "OFFLOAD_ADAMW_PREFLIGHT"
MEMLOCK_POLICIES = ("warn", "raise", "ignore")


@dataclass(frozen=True, kw_only=True)
class StateBill:
    """Bytes of host state that will be allocated, by kind."""

    tensors: int
    """Parameters that get state."""
    moments: int
    """exp_avg + exp_avg_sq (+ max_exp_avg_sq)."""
    masters: int
    """float32 host copies of low-precision or accelerator parameters."""
    steps: int
    """The per-parameter step counters (float32 scalars)."""
    pinned: bool
    """Whether moments and masters go to page-locked memory."""
    pinned_blocks: int
    """moments + masters rounded up to the power-of-two blocks of the pinned allocator (0 when not pinned)."""

    @property
    def total(self) -> int:
        """What the host must provide: pinned blocks where pinned, plus the step counters."""
        return (self.pinned_blocks if self.pinned else self.moments + self.masters) + self.steps


@dataclass(frozen=True, kw_only=True)
class HostMemory:
    """What the host can give, and where each figure came from."""

    available: int
    """The smallest of the figures below (or the override)."""
    sources: dict[str, int]
    """figure name -> bytes (MemAvailable, cgroup free, override)."""
    memlock_limit: int | None
    """RLIMIT_MEMLOCK soft limit in bytes; None when unlimited or unknown."""


class HostMemoryError(MemoryError):
    """The optimizer state would not fit in host memory; nothing was allocated."""

    def __init__(self, message: str, bill: StateBill, memory: HostMemory):
        super().__init__(message)
        self.bill = bill
        self.memory = memory


def _fmt(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    return f"{n} B"


def _figure(n: int) -> str:
    return f"{_fmt(n)} ({n:,} bytes)" if n >= 1024 else f"{n} bytes"


def _power_of_two_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def _param_name(group: dict[str, Any], index: int, group_index: int) -> str:
    names = group.get("param_names")
    if names is not None and index < len(names):
        return repr(names[index])
    return f"{index} of param_groups[{group_index}] (shape {tuple(group['params'][index].shape)})"


def state_bill(fresh: Sequence[tuple[dict[str, Any], int]], *, pin_memory: bool) -> StateBill:
    """Bytes of state for the parameters ``group["params"][index]`` of each (group, index) (contract/bills.py)."""
    moments = masters = steps = blocks = 0
    for group, index in fresh:
        # A DTensor (FSDP2) parameter: this rank allocates state for its local shard only.
        p = local_tensor(group["params"][index])
        amsgrad = bool(group.get("amsgrad"))
        bill = bills.tensor_state_bytes(p.numel(), dtype_name(p.dtype), on_host=on_host(p), amsgrad=amsgrad)
        moments += bill.moments
        masters += bill.master
        steps += bill.step
        if pin_memory:
            # Each moment and the master is one allocation of the rounding pinned allocator.
            one = bill.moments // (3 if amsgrad else 2)
            kinds = [one] * (3 if amsgrad else 2) + ([bill.master] if bill.master else [])
            blocks += sum(_power_of_two_ceil(k) for k in kinds)
    return StateBill(tensors=len(fresh), moments=moments, masters=masters, steps=steps, pinned=pin_memory, pinned_blocks=blocks)


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" means no limit


def _ancestors(base: Path, root: Path) -> list[Path]:
    """``base`` and each directory above it up to ``root``; ``root`` alone where ``base`` is not visible here.

    Inside a container with its own cgroup namespace the mount root is this process's cgroup
    even though /proc/self/cgroup may name a path of the host.
    """
    if not base.is_dir():
        return [root]
    out = [base]
    while out[-1] != root and root in out[-1].parents:
        out.append(out[-1].parent)
    return out


def _v1_hierarchical_limit(stat: Path) -> int | None:
    try:
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "hierarchical_memory_limit" and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return None


def cgroup_free(*, proc_cgroup: Path | None = None, root: Path | None = None) -> tuple[int, str] | None:
    """(bytes, file) of the tightest cgroup memory limit minus usage over this cgroup and its ancestors.

    None where no limit is set anywhere. cgroup v2 is read where this process has a v2 entry, else v1's
    memory controller (``ROOT/memory``), including memory.stat's ``hierarchical_memory_limit``, the
    limit an ancestor sets, against this cgroup's usage.
    """
    proc_cgroup = PROC_SELF_CGROUP if proc_cgroup is None else Path(proc_cgroup)
    root = CGROUP_ROOT if root is None else Path(root)
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[int, str]] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            for d in _ancestors(root / rel.lstrip("/"), root):
                limit, usage = _read_int(d / "memory.max"), _read_int(d / "memory.current")
                if limit is not None and usage is not None:
                    found.append((max(limit - usage, 0), str(d / "memory.max")))
        elif "memory" in controllers.split(","):
            v1_root = root / "memory"
            leaf = v1_root / rel.lstrip("/")
            for d in _ancestors(leaf, v1_root):
                limit, usage = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
                if limit is not None and usage is not None and limit < _V1_UNLIMITED:
                    found.append((max(limit - usage, 0), str(d / "memory.limit_in_bytes")))
            leaf = leaf if leaf.is_dir() else v1_root
            hierarchical, usage = _v1_hierarchical_limit(leaf / "memory.stat"), _read_int(leaf / "memory.usage_in_bytes")
            if hierarchical is not None and usage is not None and hierarchical < _V1_UNLIMITED:
                found.append((max(hierarchical - usage, 0), f"{leaf / 'memory.stat'} hierarchical_memory_limit"))
    return min(found) if found else None


def _address_space_free() -> int | None:
    """RLIMIT_AS minus the address space this process already maps; None when unlimited or unknown."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(int(soft) - int(line.split()[1]) * 1024, 0)
    except (OSError, ValueError, IndexError):
        pass
    return int(soft)


def host_memory(*, available_bytes: int | None = None, ranks: tuple[int, str] | None = None) -> HostMemory:
    """Measure the host (or take ``available_bytes`` / the environment override).

    ``ranks``: the ranks sharing this node and where that came from (None: distributed/node.py's
    :func:`~offload_adamw.distributed.node.ranks_on_node`, without its collective).
    """
    sources: dict[str, int] = {}
    if available_bytes is None and os.environ.get(ENV_AVAILABLE):
        available_bytes = int(os.environ[ENV_AVAILABLE])
        sources[ENV_AVAILABLE] = available_bytes
    elif available_bytes is not None:
        sources["available_bytes argument"] = int(available_bytes)
    else:
        count, source = ranks_on_node(gather=False) if ranks is None else ranks
        share = "" if count == 1 else f", / {count} ranks on this node ({source})"
        meminfo = _meminfo_available()
        if meminfo is not None:
            sources[f"MemAvailable (/proc/meminfo){share}"] = meminfo // count
        cgroup = cgroup_free()
        if cgroup is not None:
            sources[f"cgroup limit - usage{share}"] = cgroup[0] // count
        address_space = _address_space_free()
        if address_space is not None:
            sources["RLIMIT_AS - address space in use"] = address_space
    soft = None if resource is None else resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    memlock = None if soft is None or soft == resource.RLIM_INFINITY else int(soft)
    available = min(sources.values()) if sources else -1
    return HostMemory(available=available, sources=sources, memlock_limit=memlock)


def check_host_memory(
    fresh: Sequence[tuple[dict[str, Any], int]],
    *,
    pin_memory: bool,
    available_bytes: int | None = None,
    memlock: str = "warn",
    ranks: tuple[int, str] | None = None,
) -> StateBill | None:
    """Fail early, before allocating, if the state of ``fresh`` parameters cannot fit in host memory.

    ``fresh`` lists (group, index in group) of the parameters about to get
    state. Returns the bill (None when switched off by the environment).
    """
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    if memlock not in MEMLOCK_POLICIES:
        raise ValueError(f"memlock must be one of {MEMLOCK_POLICIES}, got {memlock!r}")
    groups: dict[int, int] = {}
    for group, index in fresh:
        if group["params"][index].device.type == "meta":
            gi = groups.setdefault(id(group), len(groups))
            raise Unsupported(  # a RuntimeError as torch's fused AdamW raises, and the ValueError it was
                f"parameter {_param_name(group, index, gi)} is on the meta device (it holds no data): "
                "materialize the model (e.g. module.to_empty(device=...) and initialize it) before the first step"
            )
    bill = state_bill(fresh, pin_memory=pin_memory)
    memory = host_memory(available_bytes=available_bytes, ranks=ranks)
    kinds = f"moments {_figure(bill.moments)}, masters {_figure(bill.masters)}, step counters {_figure(bill.steps)}"
    if bill.pinned:
        kinds += f"; pinned, in power-of-two blocks: {_figure(bill.pinned_blocks)}"
    if memory.sources and bill.total > memory.available:
        where = ", ".join(f"{name}: {_figure(value)}" for name, value in memory.sources.items())
        raise HostMemoryError(
            f"OffloadAdamW would allocate {_figure(bill.total)} of host state for {bill.tensors} parameter(s) "
            f"({kinds}) but only {_figure(memory.available)} of host memory is available ({where}). "
            "Nothing was allocated. Free host memory or shard the optimizer over more processes"
            + (" or use pin_memory=False" if bill.pinned else "")
            + f"; {ENV_SWITCH}=0 skips this check.",
            bill,
            memory,
        )
    if bill.pinned and memlock != "ignore" and memory.memlock_limit is not None and bill.pinned_blocks > memory.memlock_limit:
        message = (
            f"OffloadAdamW will pin {_figure(bill.pinned_blocks)} of host state ({kinds}), above RLIMIT_MEMLOCK "
            f"{_figure(memory.memlock_limit)}. The CUDA driver pins without charging that limit, but other "
            "page-locking (mlock, RDMA registration) is refused beyond it; raise it with `ulimit -l` if that applies."
        )
        if memlock == "raise":
            raise HostMemoryError(message, bill, memory)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return bill
