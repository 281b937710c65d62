"""The environment report of ``offload-adamw selftest``: what this machine offers the optimizer.

Contract: :func:`environment` returns a JSON-ready dict and never raises for a missing piece: every figure
that cannot be read here (no GPU, no ``/proc``, no numba) is None with, where it helps, a word on why.
It holds the versions (torch, its CUDA build, the NVIDIA driver, numba, Python), each GPU with its memory,
PCI bus id and NUMA node (the optimizer's own: accel/streams.py's ``CUDA.pci_bus_id`` and
distributed/node.py's ``device_numa_node``, from ``/sys/bus/pci/devices/<bus id>/numa_node``; -1 there means the
platform does not say), host memory (``MemTotal`` and ``MemAvailable`` from ``/proc/meminfo``, and :func:`host_memory_for_sizing`:
the figure a run should size itself by), the locked-memory limit (``RLIMIT_MEMLOCK``, soft and hard), the
cores this process may run on (``os.sched_getaffinity``), the host update's threads and NUMA node as the optimizer
would choose them (``host_update``: distributed/node.py), torch's OpenMP team and how long it spins after each
parallel region (``torch_openmp``: :func:`openmp_spin`, the loss docs/host-step.md measures after torch's own CPU
work), and whether page-locking works (a 1 MiB pinned
allocation, only where an accelerator is there to pin for), and the stream backend a pipeline would use
(CUDA, or a test device such as the simulated one).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import resource
from typing import Any

import torch

from offload_adamw._version import __version__

__all__ = ["environment", "meminfo", "host_memory_for_sizing", "default_device", "resolve_device", "openmp_spin",
           "PLAUSIBLE_AVAILABLE_FRACTION"]

PLAUSIBLE_AVAILABLE_FRACTION = 0.25
"""Below this share of MemTotal, MemAvailable is taken as not yet meaning what it says: a fresh VM whose balloon
or page cache has not settled reports a small MemAvailable that grows as memory is touched (the GPU machine of this
project starts far below its 128 GiB), so a run that trusted it would refuse what fits."""


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """The fields of ``/proc/meminfo`` in bytes (those given in kB), or {} where it cannot be read."""
    found: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    found[name.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        return {}
    return found


def host_memory_for_sizing(info: dict[str, int]) -> tuple[int | None, str]:
    """(bytes a run may size itself by, where that figure comes from): MemAvailable, or MemTotal where
    MemAvailable is under :data:`PLAUSIBLE_AVAILABLE_FRACTION` of it (then the reason says so)."""
    total, available = info.get("MemTotal"), info.get("MemAvailable")
    if total is None:
        return available, "MemAvailable" if available is not None else "unknown (no /proc/meminfo)"
    if available is None:
        return total, "MemTotal (no MemAvailable)"
    if available < PLAUSIBLE_AVAILABLE_FRACTION * total:
        return total, (f"MemTotal: MemAvailable is {available / total:.0%} of it, below "
                       f"{PLAUSIBLE_AVAILABLE_FRACTION:.0%}, taken as a VM that has not settled yet")
    return available, "MemAvailable"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version(path: str = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA kernel module's version from /proc (no subprocess: nvidia-smi may hang on a broken driver)."""
    try:
        with open(path) as f:
            first = f.readline()
    except OSError:
        return None
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..."
    words = first.split("Kernel Module", 1)[-1].split()
    return words[0] if words else None


def _gpus() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    from offload_adamw.accel import streams
    from offload_adamw.distributed import node

    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        bus_id = streams.CUDA.pci_bus_id(index)  # the address the optimizer places its host update by
        gpus.append({"index": index, "name": props.name, "memory_bytes": int(props.total_memory),
                     "capability": f"{props.major}.{props.minor}", "pci_bus_id": bus_id,
                     "numa_node": node.device_numa_node(bus_id) if bus_id else None})
    return gpus


def _memlock() -> dict[str, Any]:
    def shown(value: int) -> int | None:  # None: unlimited
        return None if value == resource.RLIM_INFINITY else int(value)

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (OSError, ValueError, AttributeError):
        return {"soft_bytes": None, "hard_bytes": None, "readable": False}
    return {"soft_bytes": shown(soft), "hard_bytes": shown(hard), "readable": True,
            "unlimited": soft == resource.RLIM_INFINITY}


def _page_locking(device: torch.device) -> dict[str, Any]:
    """Whether a small page-locked allocation works for ``device`` (only a CUDA device has one to try)."""
    if device.type != "cuda":
        return {"works": None, "why": f"no accelerator to page-lock for (device {device})"}
    try:
        t = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        works = bool(t.is_pinned())
        del t
        return {"works": works, "why": "1 MiB pinned allocation" + ("" if works else " came back not pinned")}
    except RuntimeError as exc:
        return {"works": False, "why": f"1 MiB pinned allocation failed: {str(exc).splitlines()[0]}"}


def _host_update(device: torch.device) -> dict[str, Any]:
    """The host update's threads and NUMA node, as an optimizer over parameters on ``device`` would choose them
    (distributed/node.py; without a gather: a selftest is one process)."""
    from offload_adamw.accel import streams
    from offload_adamw.distributed import node

    numa = node.numa_placement(pci_bus_id=streams.pci_bus_id(device))
    share = node.node_share(gather=False, numa=numa)
    return {"threads": share.threads, "cores": share.cores, "shared": share.shared, "ranks_on_node": share.ranks,
            "ranks_source": share.ranks_source, "numa_node": None if numa is None else numa.node,
            "numa_source": None if numa is None else numa.source, "describe": share.describe()}


def _openmp_runtime(maps: str = "/proc/self/maps") -> str | None:
    """The OpenMP runtime loaded in this process (torch's Linux wheels bundle libgomp), or None where unknown."""
    try:
        with open(maps) as f:
            text = f.read()
    except OSError:
        return None
    for name in ("libgomp", "libiomp5", "libomp"):  # libgomp first: "libomp" is also a substring of "libgomp"
        if f"/{name}" in text:
            return name
    return None


def openmp_spin(runtime: str | None, threads: int, environ: dict[str, str], cpus: int | None = None) -> str:
    """How long torch's OpenMP workers spin after each parallel region, in words, by the runtime's documented rules.

    libgomp (read when torch loads it; nothing changes it afterwards): ``GOMP_SPINCOUNT`` when set, else
    ``OMP_WAIT_POLICY`` (``PASSIVE``: no spin; ``ACTIVE``: practically forever), else 300000 pauses (a few ms);
    with more threads than the ``cpus`` it may run on, it throttles the spin to at most 100 pauses (1000 under
    ``ACTIVE``, none under ``PASSIVE``). Intel's and LLVM's runtimes: ``KMP_BLOCKTIME`` (200 ms when unset),
    ``PASSIVE`` meaning none."""
    if threads <= 1:
        return "no team (one thread): nothing spins after torch's CPU work"
    policy = environ.get("OMP_WAIT_POLICY", "").strip().upper()
    if runtime == "libgomp" and cpus is not None and threads > cpus:
        return _libgomp_throttled(policy, environ, threads, cpus)
    if runtime == "libgomp":
        pauses = _gomp_spincount(environ)
        if pauses == _GOMP_INFINITE:
            return "spins until the next region (GOMP_SPINCOUNT=INFINITE)"
        if pauses is not None:
            return "sleeps at once (GOMP_SPINCOUNT=0)" if pauses == 0 else f"spins for {pauses} pauses (GOMP_SPINCOUNT)"
        if policy == "PASSIVE":
            return "sleeps at once (OMP_WAIT_POLICY=PASSIVE)"
        if policy == "ACTIVE":
            return "spins until the next region, up to minutes (OMP_WAIT_POLICY=ACTIVE)"
        return ("spins for 300000 pauses, a few ms (libgomp's default; GOMP_SPINCOUNT=0 or OMP_WAIT_POLICY=PASSIVE "
                "before Python starts makes it sleep)")
    if runtime in ("libiomp5", "libomp"):
        if policy == "PASSIVE":
            return "sleeps at once (OMP_WAIT_POLICY=PASSIVE)"
        blocktime = environ.get("KMP_BLOCKTIME", "").strip()
        return f"spins for KMP_BLOCKTIME={blocktime} ms" if blocktime else "spins for 200 ms (KMP_BLOCKTIME unset)"
    return "unknown runtime: not read"


_GOMP_INFINITE = 2**64 - 1  # libgomp's ~0ULL


def _gomp_spincount(environ: dict[str, str]) -> int | None:
    """``GOMP_SPINCOUNT`` as libgomp parses it (a count with an optional k, M, G or T, or INFINITE), None where unset
    or unparsable: libgomp ignores a value it cannot parse."""
    count = environ.get("GOMP_SPINCOUNT", "").strip()
    if count.upper() in ("INFINITE", "INFINITY"):
        return _GOMP_INFINITE
    parsed = re.fullmatch(r"(\d+)\s*([kKmMgGtT]?)", count)
    return int(parsed.group(1)) * 1000 ** " KMGT".index(parsed.group(2).upper() or " ") if parsed else None


def _libgomp_throttled(policy: str, environ: dict[str, str], threads: int, cpus: int) -> str:
    # libgomp's env.c: with more of its threads than available CPUs it spins min(throttled, GOMP_SPINCOUNT)
    # pauses, the throttled count being 1000 under ACTIVE, 0 under PASSIVE and 100 otherwise.
    throttled = {"ACTIVE": 1000, "PASSIVE": 0}.get(policy, 100)
    pauses = _gomp_spincount(environ)
    if pauses is not None:
        throttled = min(throttled, pauses)
    why = f"{threads} threads on {cpus} CPUs: libgomp throttles its spin"
    return f"sleeps at once ({why})" if throttled == 0 else f"spins for {throttled} pauses ({why})"


def _torch_openmp(cores: int | None) -> dict[str, Any]:
    """``cores``: the report's ``cores_available``, which libgomp's throttle compares its team with."""
    runtime, threads = _openmp_runtime(), torch.get_num_threads()
    return {"runtime": runtime, "threads": threads,
            "settings": {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
                         if k in os.environ},
            "after_each_region": openmp_spin(runtime, threads, dict(os.environ), cores)}


def _stream_backend() -> str:
    from offload_adamw.accel import streams  # the backend a pipeline built now would use

    backend = streams.installed()
    if backend is not None:
        return type(backend).__name__
    return "cuda" if torch.cuda.is_available() else "none (the CPU as device: every copy is complete when issued)"


def environment(device: torch.device) -> dict[str, Any]:
    """The report (module docstring) for a selftest on ``device``."""
    info = meminfo()
    sizing, sizing_source = host_memory_for_sizing(info)
    try:
        cores: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = None
    return {
        "device": str(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "driver": _driver_version(),
        "numba": _version("numba"),
        "offload_adamw": __version__,
        "gpus": _gpus(),
        "host_memory": {"total_bytes": info.get("MemTotal"), "available_bytes": info.get("MemAvailable"),
                        "sizing_bytes": sizing, "sizing_source": sizing_source},
        "memlock": _memlock(),
        "cores_available": cores,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host_update": _host_update(device),
        "torch_openmp": _torch_openmp(cores),
        "page_locking": _page_locking(device),
        "stream_backend": _stream_backend(),
    }


def default_device() -> str:
    """``cuda`` where torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(text: str) -> torch.device:
    """The device ``text`` names, once it is clear that the selftest can run there; else ValueError saying why.

    The CPU (the pipeline's CPU mode, where every placement computes on the CPU) and CUDA devices that torch
    sees; a bare ``cuda`` is the current CUDA device.
    """
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"not a device ({str(exc).splitlines()[0]})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"the selftest runs on cpu or cuda devices, not {device.type}")
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
        raise ValueError(f"no CUDA device here ({why}); use --device cpu")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise ValueError(f"no such device: torch sees {count} CUDA device(s) (0..{count - 1})")
    return torch.device("cuda", index)
