"""The host AdamW step against the baselines a careful engineer would write (``offload-adamw bench``).

Contract: in one run the benchmark

1. measures the machine's memory bandwidth (STREAM triad and in-place triad,
   :mod:`offload_adamw.benchmarking.bandwidth`) once, before the sizes;
2. checks, on a 1 Mi-element workload, that the default mixed step gives
   bitwise the same master, moments and bf16 copy as the naive path (the
   parity definition), and reports the result;
3. per size (elements in a transformer's mix of tensor shapes), times one
   optimizer step of each case below after ``warmup`` untimed steps;
   repetitions are interleaved and the case order is rotated by one at each
   repetition (A B C, B C A, C A B, ...), so that machine noise and the cache
   state a case inherits from its predecessor hit every case alike; reports
   per case the median ms/step with its spread (min, max), elements/s,
   effective GB/s at 28 bytes/element (the ideal traffic of a step,
   docs/contract.md#traffic-bill), the fraction of an in-place triad over the same
   arrays timed in the same rotation (the bandwidth ceiling under the same
   conditions), and the case's own peak extra host memory during a step
   (kernel high-water mark reset before the step, minus the resident memory
   before it: what the step allocates, not what the process holds);
4. measures thread scaling at one size: the default mixed step, torch's fused
   float32 step, the naive path and the in-place triad at 1, 2, ... all CPUs
   (``torch.set_num_threads``), rotated the same way;
5. gives the result as a JSON-ready dict (:func:`run_benchmark`), a table with the targets met or
   missed (:func:`format_report`) and a PNG chart (:func:`write_plot`).

Cases (all on the same float32 master, m and v; the mixed cases read bf16
gradients and write a bf16 model copy):

* ``ours-bf16``: the default mixed path (``kernels.adamw.adamw_update_``: the
  numba loop, the chunk loop for tails); ``ours-bf16-chunk-loop``: the chunk
  loop alone (the fallback where numba is unavailable); ``ours-fp32``: float32
  gradients and parameters (torch's fused op, as torch.optim.AdamW runs it);
* ``torch-fused-fp32``: ``torch.optim.AdamW(fused=True)`` on float32 parameters
  of the same size: the practical ceiling, the same arithmetic on the same 28
  bytes per element without casts; ``torch-foreach-fp32``,
  ``torch-forloop-fp32``: its other implementations;
* ``torch-naive-bf16``: the naive mixed path as a careful engineer writes it:
  float32 gradient buffers allocated once, each step copies the bf16 gradients
  into them, runs ``AdamW(fused=True).step()`` on the float32 masters and copies
  the masters back into the bf16 parameters (bitwise the parity definition);
* ``deepspeed-fp32``: ``DeepSpeedCPUAdam`` on float32 parameters;
  ``deepspeed-fp32+casts``: the same with the naive path's preallocated casts
  (the same algorithm as ours-bf16); ``deepspeed-bf16-native``: DeepSpeedCPUAdam
  updating bf16 parameters in place with float32 moments
  (``fp32_optimizer_states=True``) and no float32 master: a different, lossy
  algorithm (updates smaller than half a bf16 ulp are lost), reported apart and
  never used as a baseline for a target. DeepSpeed cases run where DeepSpeed
  imports and its CPU Adam builds (the load time, including a JIT build, is
  reported); elsewhere they are skipped with the reason.

Every case works on the same arrays (master, m, v, float32 and bf16 gradients,
bf16 copy), about 20 bytes per element for all cases together; values drift from
case to case, which does not change the work done.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from offload_adamw.benchmarking.bandwidth import measure_host_bandwidth
from offload_adamw.kernels.adamw import StepHyper, adamw_update_
from offload_adamw.kernels.blocked import BlockConfig, blocked_adamw_, chunk_loop_status
from offload_adamw.kernels.numba_loop import numba_kernel_status

BYTES_PER_ELEMENT = 28  # docs/contract.md#traffic-bill: the ideal traffic of one host step
MIB = 2**20
MEMORY_ALLOWANCE = 64 * MIB  # what a step may allocate beyond its state

TRIAD_CASE = "inplace-triad"  # timed in the same rotation: the ceiling under the same conditions
TRIAD_BYTES_PER_ELEMENT = 12
DEFAULT_MIXED = "ours-bf16"
NAIVE = "torch-naive-bf16"
CEILING = "torch-fused-fp32"
LOSSY_CASES = ("deepspeed-bf16-native",)
BF16_CASES = (DEFAULT_MIXED, "ours-bf16-chunk-loop", NAIVE, "deepspeed-fp32+casts", "deepspeed-bf16-native")
ALL_CASES = (
    DEFAULT_MIXED,
    "ours-bf16-chunk-loop",
    "ours-fp32",
    CEILING,
    "torch-foreach-fp32",
    "torch-forloop-fp32",
    NAIVE,
    "deepspeed-fp32",
    "deepspeed-fp32+casts",
    "deepspeed-bf16-native",
)
SCALING_CASES = (DEFAULT_MIXED, CEILING, NAIVE)
#: The targets of the default mixed path: (label, case it is compared with, speed ratio at least).
TARGETS = (
    ("speed vs torch fused float32 (the ceiling)", CEILING, 0.95),
    ("speed vs the preallocated naive path", NAIVE, 1.4),
)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What one benchmark run measures."""

    sizes: tuple[int, ...] = (16 * MIB, 64 * MIB, 256 * MIB)
    """Total trainable elements per size (each split into a transformer's tensor shapes)."""
    repeats: int = 7
    """Timed repetitions per case (after ``warmup`` untimed steps), in rotated order."""
    warmup: int = 3
    """Untimed steps per case first: thread pools, numba's compilation and self-test of each
    variant, chunk buffers, DeepSpeed's first call, TorchScript's profiling runs of the chunk
    loop. The timed figures are the steady state."""
    cases: tuple[str, ...] = ALL_CASES
    """Which cases to time."""
    bandwidth_elements: int = 64 * MIB
    """Elements per array of the bandwidth probe."""
    scaling_size: int | None = 16 * MIB
    """Elements of the thread-scaling measurement (None: skip it)."""
    scaling_threads: tuple[int, ...] | None = None
    """Thread counts of the scaling measurement (None: 1, 2, ... all CPUs this process may use)."""
    parity_elements: int = MIB
    """Elements of the bitwise check of the default mixed step against the naive path (0: skip)."""


# ---------------------------------------------------------------- workload


def transformer_shapes(total: int) -> list[tuple[int, ...]]:
    """A Llama-like mix of shapes summing to exactly ``total`` elements.

    Four decoder layers (attention q, k, v, o: d x d; MLP gate, up: f x d, down:
    d x f; two norms: d), a final norm, a tied embedding that takes what is left
    (rows x d), a vector of 1001 elements and one of the remainder (< d).
    """
    if total < 64:
        return [(total,)] if total > 0 else []
    d = 2 ** max(4, round(math.log2(math.sqrt(total) / 8)))
    f = math.ceil(8 * d / 3 / 256) * 256 if d >= 256 else 3 * d
    layer = [(d, d)] * 4 + [(f, d), (f, d), (d, f), (d,), (d,)]
    per_layer = sum(math.prod(s) for s in layer)
    layers = max(0, min(4, (total - d) // per_layer))
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += layer
    shapes.append((d,))
    left = total - sum(math.prod(s) for s in shapes)
    if left < 0:  # too small for even the final norm
        return [(total,)]
    odd = min(left, 1001)  # odd-length vectors, so that some tensors have a ragged SIMD tail
    rows, rest = divmod(left - odd, d)
    if rows:
        shapes.insert(0, (rows, d))
    shapes += [(n,) for n in (odd, rest) if n]
    return shapes


@dataclass
class Workload:
    """The shared arrays of one size."""

    shapes: list[tuple[int, ...]]
    master: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    grad32: list[torch.Tensor]
    grad16: list[torch.Tensor]
    model16: list[torch.Tensor]

    @property
    def elements(self) -> int:
        return sum(t.numel() for t in self.master)


def make_workload(total: int, seed: int = 0) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    shapes = transformer_shapes(total)

    def randn(shape, scale):
        return torch.randn(shape, generator=gen).mul_(scale)

    master = [randn(s, 0.02) for s in shapes]
    grad32 = [randn(s, 1e-3) for s in shapes]
    return Workload(
        shapes=shapes,
        master=master,
        exp_avg=[torch.zeros(s) for s in shapes],
        exp_avg_sq=[torch.zeros(s) for s in shapes],
        grad32=grad32,
        grad16=[g.to(torch.bfloat16) for g in grad32],
        model16=[m.to(torch.bfloat16) for m in master],
    )


HYPER: dict[str, Any] = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _hp() -> StepHyper:
    return StepHyper(
        lr=HYPER["lr"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
    )


# ------------------------------------------------------------------- cases


def _torch_optimizer(w: Workload, **impl) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """A torch AdamW over Parameters that alias the shared arrays, its state pre-set to them."""
    params = [torch.nn.Parameter(m) for m in w.master]  # shares storage with the masters
    opt = torch.optim.AdamW(params, **HYPER, **impl)
    for p, m, v in zip(params, w.exp_avg, w.exp_avg_sq):
        opt.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32), "exp_avg": m, "exp_avg_sq": v}
    return opt, params


def _deepspeed_class(info: dict):
    """DeepSpeedCPUAdam, or None (the reason goes into ``info``)."""
    if "deepspeed_unavailable" in info:
        return None
    try:
        start = time.perf_counter()
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415 (optional dependency)

        # the first construction JIT-builds (or loads) the CPU Adam extension: timed here, once
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(64))], adamw_mode=True, **HYPER)
        info.setdefault("deepspeed_load_s", round(time.perf_counter() - start, 2))
        import deepspeed  # noqa: PLC0415

        info["deepspeed_version"] = deepspeed.__version__
        return DeepSpeedCPUAdam
    except Exception as exc:  # ImportError, or the JIT build failing: report, do not crash
        info["deepspeed_unavailable"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return None


def build_cases(w: Workload, names: tuple[str, ...], info: dict) -> dict[str, Callable[[], None]]:
    """name -> a function doing one step of that case on the shared arrays (cases that cannot
    run here are absent; ``info["skipped"]`` says why)."""
    hp = _hp()
    cases: dict[str, Callable[[], None]] = {}
    skipped = info.setdefault("skipped", {})

    def ours(grads, outs, config: BlockConfig | None = None):
        steps = [torch.zeros((), dtype=torch.float32) for _ in w.master]
        if config is None:
            return lambda: adamw_update_(w.master, grads, w.exp_avg, w.exp_avg_sq, [], steps, hp, model_params=outs)
        return lambda: blocked_adamw_(w.master, grads, w.exp_avg, w.exp_avg_sq, [], steps, outs, hp, config=config)

    def torch_step(**impl):
        opt, params = _torch_optimizer(w, **impl)
        for p, g in zip(params, w.grad32):
            p.grad = g

        return opt.step

    def naive_mixed(step_fn, params):
        # float32 gradient buffers allocated once (the float32 gradients of the workload serve as
        # them); each step: widen into them, the float32 step, narrow into the bf16 copy.
        for p, g in zip(params, w.grad32):
            p.grad = g

        def step():
            torch._foreach_copy_(w.grad32, w.grad16)
            step_fn()
            torch._foreach_copy_(w.model16, w.master)

        return step

    ds_class = _deepspeed_class(info) if any(n.startswith("deepspeed") for n in names) else None

    def deepspeed_fp32():
        params = [torch.nn.Parameter(m) for m in w.master]
        opt = ds_class(params, adamw_mode=True, **HYPER)
        for p, m, v in zip(params, w.exp_avg, w.exp_avg_sq):
            opt.state[p] = {"step": 0, "exp_avg": m, "exp_avg_sq": v}
        for p, g in zip(params, w.grad32):
            p.grad = g
        return opt, params

    def deepspeed_native_bf16():
        # bf16 parameters updated in place, float32 moments, no master: the model copy is the state
        params = [torch.nn.Parameter(m) for m in w.model16]
        opt = ds_class(params, adamw_mode=True, fp32_optimizer_states=True, **HYPER)
        for p, m, v in zip(params, w.exp_avg, w.exp_avg_sq):
            opt.state[p] = {"step": 0, "exp_avg": m, "exp_avg_sq": v}
        for p, g in zip(params, w.grad16):
            p.grad = g
        return opt.step

    def inplace_triad(sign=[1.0]):  # noqa: B006 (state across calls)
        # a += s*b over the same arrays (12 bytes/element, no write-allocate), alternating
        # the sign so the moments come back to where they were (up to rounding).
        torch._foreach_add_(w.exp_avg, w.grad32, alpha=sign[0] * 1e-12)
        sign[0] = -sign[0]

    cases[TRIAD_CASE] = inplace_triad
    for name in names:
        if name == DEFAULT_MIXED:
            cases[name] = ours(w.grad16, w.model16)
        elif name == "ours-bf16-chunk-loop":
            cases[name] = ours(w.grad16, w.model16, BlockConfig(numba_loop=False))
        elif name == "ours-fp32":
            cases[name] = ours(w.grad32, None)
        elif name == "torch-forloop-fp32":
            cases[name] = torch_step(foreach=False, fused=False)
        elif name == "torch-foreach-fp32":
            cases[name] = torch_step(foreach=True, fused=False)
        elif name == CEILING:
            cases[name] = torch_step(fused=True)
        elif name == NAIVE:
            opt, params = _torch_optimizer(w, fused=True)
            cases[name] = naive_mixed(opt.step, params)
        elif name.startswith("deepspeed"):
            if ds_class is None:
                skipped[name] = info["deepspeed_unavailable"]
                continue
            try:
                if name == "deepspeed-fp32":
                    cases[name] = deepspeed_fp32()[0].step
                elif name == "deepspeed-fp32+casts":
                    opt, params = deepspeed_fp32()
                    cases[name] = naive_mixed(opt.step, params)
                else:
                    cases[name] = deepspeed_native_bf16()
            except Exception as exc:  # a DeepSpeed version without this mode: said, not hidden
                skipped[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        else:
            raise ValueError(f"unknown benchmark case {name!r}; choose from {', '.join(ALL_CASES)}")
    return cases


# ------------------------------------------------------------------ memory


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_step(fn: Callable[[], None]) -> tuple[float, int | None]:
    """(seconds, bytes the step's peak resident memory rose above the resident memory before it)."""
    can_reset = _reset_peak_rss()
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    if peak is None or before is None or not can_reset:
        return seconds, None
    return seconds, max(0, peak - before) * 1024


# --------------------------------------------------------------------- run


def _progress(iterable, show: bool, **kw):
    if not show:
        return iterable
    try:
        from tqdm import tqdm  # noqa: PLC0415

        return tqdm(iterable, file=sys.stderr, leave=False, **kw)
    except ImportError:  # pragma: no cover
        return iterable


def rotations(names: list[str], repeats: int) -> list[list[str]]:
    """The case order of each repetition: rotated by one each time (A B C, B C A, C A B, ...)."""
    k = len(names)
    return [names[r % k:] + names[: r % k] for r in range(repeats)] if k else [[] for _ in range(repeats)]


def _time_rotated(cases: dict[str, Callable[[], None]], warmup: int, repeats: int, desc: str, progress: bool = False):
    samples: dict[str, list[float]] = {n: [] for n in cases}
    extras: dict[str, list[int]] = {n: [] for n in cases}
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    for order in _progress(rotations(list(cases), repeats), progress, desc=desc):
        for name in order:
            seconds, extra = measure_step(cases[name])
            samples[name].append(seconds)
            if extra is not None:
                extras[name].append(extra)
    return samples, extras


def _summary(times: list[float], elements: int) -> dict:
    med = statistics.median(times)
    return {
        "ms_per_step": med * 1e3,
        "ms_min": min(times) * 1e3,
        "ms_max": max(times) * 1e3,
        "spread": (max(times) - min(times)) / med,
        "ms_all": [t * 1e3 for t in times],
        "elements_per_s": elements / med,
        "effective_gbps": BYTES_PER_ELEMENT * elements / med / 1e9,
    }


def run_size(total: int, config: BenchConfig, info: dict, progress: bool = False) -> dict:
    w = make_workload(total)
    cases = build_cases(w, config.cases, info)
    samples, extras = _time_rotated(cases, config.warmup, config.repeats, f"{_fmt_size(total)} elements", progress)
    n = w.elements
    state_bytes = sum(t.numel() * t.element_size() for t in w.master + w.exp_avg + w.exp_avg_sq)
    triad = _summary(samples.pop(TRIAD_CASE), n)
    triad_gbps = TRIAD_BYTES_PER_ELEMENT * n / (triad["ms_per_step"] / 1e3) / 1e9
    rows = {}
    for name, times in samples.items():
        row = _summary(times, n)
        row["fraction_of_inplace_triad"] = row["effective_gbps"] / triad_gbps
        row["step_extra_mib"] = max(extras[name]) / MIB if extras[name] else None
        rows[name] = row
    del cases, w
    gc.collect()  # optimizers hold reference cycles; free this size's arrays before the next
    return {
        "elements": n,
        "tensors": len(transformer_shapes(total)),
        "state_bytes": state_bytes,
        "inplace_triad_gbps": triad_gbps,
        "inplace_triad_ms": triad["ms_per_step"],
        "cases": rows,
    }


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        return os.cpu_count() or 1


def thread_scaling(total: int, config: BenchConfig, info: dict, progress: bool = False) -> dict:
    """The scaling cases at each thread count, interleaved and rotated; ms/step medians."""
    counts = config.scaling_threads or tuple(range(1, _usable_cpus() + 1))
    w = make_workload(total)
    cases = build_cases(w, tuple(c for c in SCALING_CASES if c in config.cases), info)
    before = torch.get_num_threads()
    out: dict = {"elements": w.elements, "threads": list(counts), "cases": {name: [] for name in cases}}
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            samples, _ = _time_rotated(cases, max(1, config.warmup), config.repeats, f"{threads} thread(s)", progress)
            for name, times in samples.items():
                out["cases"][name].append(_summary(times, w.elements))
    finally:
        torch.set_num_threads(before)
    del cases, w
    gc.collect()
    return out


def parity_check(elements: int) -> dict:
    """One step of the default mixed path and of the naive path from the same state: equal bits?"""
    hp = _hp()
    results = []
    for path in ("ours", "naive"):
        w = make_workload(elements, seed=1)
        steps = [torch.zeros((), dtype=torch.float32) for _ in w.master]
        if path == "ours":
            adamw_update_(w.master, w.grad16, w.exp_avg, w.exp_avg_sq, [], steps, hp, model_params=w.model16)
        else:
            opt, params = _torch_optimizer(w, fused=True)
            for p, g in zip(params, w.grad16):
                p.grad = g.float()
            opt.step()
            torch._foreach_copy_(w.model16, w.master)
        results.append(w)
    differ = 0
    for key in ("master", "exp_avg", "exp_avg_sq", "model16"):
        for a, b in zip(getattr(results[0], key), getattr(results[1], key)):
            view = torch.int16 if a.element_size() == 2 else torch.int32
            differ += int((a.view(view) != b.view(view)).sum())
    return {"elements": results[0].elements, "differing_elements": differ, "bitwise_equal": differ == 0}


def _fmt_size(n: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def machine_info() -> dict:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def targets(result: dict) -> list[dict]:
    """The default mixed path's targets per size: ratio, required, met (None: not measured)."""
    out = []
    for size in result["sizes"]:
        c = size["cases"]
        checks = []
        for label, other, need in TARGETS:
            value = c[other]["ms_per_step"] / c[DEFAULT_MIXED]["ms_per_step"] if DEFAULT_MIXED in c and other in c else None
            checks.append((f"{DEFAULT_MIXED} {label}", value, need, False))
        extra = c.get(DEFAULT_MIXED, {}).get("step_extra_mib")
        checks.append((f"{DEFAULT_MIXED} extra memory in a step (MiB, at most)", extra, MEMORY_ALLOWANCE / MIB, True))
        for label, value, need, at_most in checks:
            met = None if value is None else (value <= need if at_most else value >= need)
            out.append({"size": size["elements"], "target": label, "value": value, "required": need, "met": met})
    parity = result.get("parity")
    if parity is not None:
        out.append({"size": parity["elements"], "target": f"{DEFAULT_MIXED} bitwise equal to the naive path",
                    "value": parity["differing_elements"], "required": 0, "met": parity["bitwise_equal"]})
    return out


def run_benchmark(config: BenchConfig, *, progress: bool = False) -> dict:
    """The whole benchmark (see the module docstring); ``progress``: progress bars on stderr."""
    info = machine_info()
    bandwidth = measure_host_bandwidth(elements=config.bandwidth_elements, repeats=5)
    info["chunk_loop"] = chunk_loop_status()  # TorchScript or plain Python, compile time, fallback reason
    result: dict[str, Any] = {"machine": info, "config": asdict(config), "bandwidth": bandwidth, "sizes": []}
    if config.parity_elements:
        result["parity"] = parity_check(config.parity_elements)
    for total in config.sizes:
        result["sizes"].append(run_size(total, config, info, progress))
    if config.scaling_size:
        result["thread_scaling"] = thread_scaling(config.scaling_size, config, info, progress)
    info["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    info["numba_loop"] = numba_kernel_status()  # per variant: usable, compile and self-test seconds, reason
    result["targets"] = targets(result)
    return result


# ------------------------------------------------------------------ output


def format_report(result: dict) -> str:
    m, bw = result["machine"], result["bandwidth"]
    lines = [
        f"machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, torch {m['torch']} ({m['torch_threads']} threads), "
        f"load average {m.get('load_average_at_start')} -> {m.get('load_average_at_end')}",
        f"bandwidth ({bw['elements'] * 4 // MIB} MiB arrays, best of {bw['repeats']}): "
        f"triad {bw['triad_gbps']:.1f} GB/s, in-place triad {bw['inplace_triad_gbps']:.1f} GB/s "
        f"-> ceiling {bw['inplace_triad_gbps'] / BYTES_PER_ELEMENT:.2f} G elements/s at {BYTES_PER_ELEMENT} B/element",
    ]
    for key in ("chunk_loop", "numba_loop", "deepspeed_version", "deepspeed_load_s", "deepspeed_unavailable"):
        if key in m:
            lines.append(f"{key}: {m[key]}")
    for name, why in m.get("skipped", {}).items():
        lines.append(f"skipped {name}: {why}")
    parity = result.get("parity")
    if parity is not None:
        lines.append(f"parity ({_fmt_size(parity['elements'])} elements, one step): {DEFAULT_MIXED} vs {NAIVE}: "
                     f"{parity['differing_elements']} differing elements")
    header = (f"{'case':22s} {'ms/step':>9s} {'min-max':>15s} {'G elem/s':>9s} {'GB/s@28B':>9s} {'of triad':>9s} "
              f"{'vs ref':>7s} {'step +MiB':>9s}")
    for size in result["sizes"]:
        lines += ["", f"{_fmt_size(size['elements'])} elements in {size['tensors']} tensors "
                      f"(state {size['state_bytes'] / MIB:.0f} MiB); in-place triad in the same rotation: "
                      f"{size['inplace_triad_gbps']:.1f} GB/s = {size['inplace_triad_gbps'] / BYTES_PER_ELEMENT:.3f} "
                      f"G elements/s at {BYTES_PER_ELEMENT} B", header, "-" * len(header)]
        cases = size["cases"]
        ordered = [n for n in cases if n not in LOSSY_CASES] + [n for n in cases if n in LOSSY_CASES]
        for name in ordered:
            row = cases[name]
            if name in LOSSY_CASES and name == next(n for n in ordered if n in LOSSY_CASES):
                lines.append("  a different algorithm, without a float32 master (bf16 parameters updated in place):")
            ref = NAIVE if name in BF16_CASES else CEILING
            vs = cases[ref]["ms_per_step"] / row["ms_per_step"] if ref in cases else float("nan")
            extra = f"{row['step_extra_mib']:.1f}" if row["step_extra_mib"] is not None else "n/a"
            spread = f"{row['ms_min']:.1f}-{row['ms_max']:.1f}"
            lines.append(
                f"{name:22s} {row['ms_per_step']:9.1f} {spread:>15s} {row['elements_per_s'] / 1e9:9.3f} "
                f"{row['effective_gbps']:9.2f} {row['fraction_of_inplace_triad']:9.2f} {vs:6.2f}x {extra:>9s}"
            )
        lines.append(f"(vs ref: speed relative to {NAIVE} for bf16 cases, to {CEILING} for float32 cases)")
    scaling = result.get("thread_scaling")
    if scaling:
        lines += ["", f"thread scaling, {_fmt_size(scaling['elements'])} elements, ms/step (median):",
                  f"  {'threads':22s}" + "".join(f"{t:>9d}" for t in scaling["threads"])]
        for name, rows in scaling["cases"].items():
            lines.append(f"  {name:22s}" + "".join(f"{r['ms_per_step']:9.1f}" for r in rows))
    lines += ["", "targets:"]
    for t in result["targets"]:
        value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"  {_fmt_size(t['size']):>5s}  {t['target']:62s} {value:>7s} (need {t['required']:g}): {verdict}")
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    sizes = result["sizes"]
    names = list(sizes[0]["cases"])
    scaling = result.get("thread_scaling")
    fig, axes = plt.subplots(1, 2 if scaling else 1, figsize=(13 if scaling else 9, 4.8),
                             gridspec_kw={"width_ratios": [3, 1]} if scaling else None)
    ax = axes[0] if scaling else axes
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [k + i * width for k in range(len(sizes))]
        rows = [s["cases"].get(name) for s in sizes]
        ys = [r["elements_per_s"] / 1e9 if r else 0 for r in rows]
        # error bars: the elements/s of the slowest and the fastest repetition
        lo = [y - (s["elements"] / (r["ms_max"] / 1e3) / 1e9) if r else 0 for y, r, s in zip(ys, rows, sizes)]
        hi = [(s["elements"] / (r["ms_min"] / 1e3) / 1e9) - y if r else 0 for y, r, s in zip(ys, rows, sizes)]
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name + (" (lossy)" if name in LOSSY_CASES else ""),
               color=plt.cm.tab10(i % 10), hatch="//" if "bf16" in name else None)
    for k, s in enumerate(sizes):
        ceiling = s["inplace_triad_gbps"] / BYTES_PER_ELEMENT
        ax.hlines(ceiling, k - width, k + 0.8, colors="black", linestyles="--", linewidth=1,
                  label="in-place triad / 28 B (same rotation)" if k == 0 else None)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(sizes))])
    ax.set_xticklabels([f"{_fmt_size(s['elements'])} elements" for s in sizes])
    ax.set_ylabel("G elements / s (median; bars: fastest and slowest repetition)")
    ax.set_title(f"AdamW host step, {result['machine']['cpu']}, {result['machine']['torch_threads']} threads", fontsize=9)
    top = max([s["inplace_triad_gbps"] / BYTES_PER_ELEMENT for s in sizes]
              + [s["elements"] / (r["ms_min"] / 1e3) / 1e9 for s in sizes for r in s["cases"].values()])
    ax.set_ylim(0, top * 1.5)  # room for the legend above the bars and the ceiling
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    if scaling:
        sax = axes[1]
        for name, rows in scaling["cases"].items():
            # the triad as the step-equivalent ceiling: its bandwidth over a step's 28 bytes per element
            scale = TRIAD_BYTES_PER_ELEMENT / BYTES_PER_ELEMENT if name == TRIAD_CASE else 1.0
            label = "in-place triad / 28 B" if name == TRIAD_CASE else name
            sax.plot(scaling["threads"], [r["elements_per_s"] * scale / 1e9 for r in rows], marker="o", label=label,
                     linestyle="--" if name == TRIAD_CASE else "-", color="black" if name == TRIAD_CASE else None)
        sax.set_xlabel("torch threads")
        sax.set_xticks(scaling["threads"])
        sax.set_ylabel("G elements / s")
        sax.set_title(f"thread scaling, {_fmt_size(scaling['elements'])} elements", fontsize=9)
        sax.set_ylim(bottom=0)
        sax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
