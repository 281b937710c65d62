"""The host AdamW step against the baselines a careful engineer would write (``offload-adamw bench``).

Contract: in one run the benchmark

1. measures the machine's memory bandwidth (STREAM triad and in-place triad,
   :mod:`offload_adamw.benchmarking.bandwidth`) once, before the sizes;
2. checks, on a 1 Mi-element workload, that the default mixed step gives
   bitwise the same master, moments and bf16 copy as the naive path (the
   parity definition), and reports the result;
3. per size (elements in a transformer's mix of tensor shapes), and per named
   mix of shapes (``mixes``, :data:`~offload_adamw.benchmarking.workload.MIXES`:
   ``llama-layers``, 50.5 M elements in 30 tensors shaped like a Llama layer's),
   times one optimizer step of each case below after ``warmup`` untimed steps;
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
   missed and a PNG chart (:mod:`offload_adamw.benchmarking.host_step_report`).

Cases (all on the same float32 master, m and v; the mixed cases read bf16
gradients and write a bf16 model copy):

* ``ours-bf16``: the default mixed path (``kernels.adamw.adamw_update_``: the
  numba loop, the chunk loop for tails); ``ours-bf16-chunk-loop``: the chunk
  loop alone (the fallback where numba is unavailable); ``ours-fp32``: float32
  gradients and parameters (torch's fused op, as torch.optim.AdamW runs it);
* ``ours-bf16-host-model``: ``OffloadAdamW.step()`` on a bf16 model in host
  memory, as users run it: every per-tensor check of the step, and the kernel
  reading each parameter first to take its edits since the last step
  (docs/contract.md#edits-between-steps: 30 bytes per element). It has a master
  and a model of its own, which only it writes, so its parameters hold
  round(master) as in training and no element is taken as edited;
  ``ours-bf16-staging``: ``OffloadAdamW.update_group`` with a staging buffer per
  tensor and no edits to take, as the transfer pipeline calls it for a device
  model's bucket (the staging buffers written, never read);
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
bf16 copy), about 20 bytes per element for all cases together (6 more for the
host model's own master and parameters); values drift from case to case, which
does not change the work done.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from offload_adamw.benchmarking.bandwidth import measure_host_bandwidth
from offload_adamw.benchmarking.bitwise import differing_elements
from offload_adamw.benchmarking.machine import machine_info
from offload_adamw.benchmarking.timing import summary, time_rotated, usable_cpus
from offload_adamw.benchmarking.workload import (
    HYPER,
    MIB,
    MIXES,
    Workload,
    format_size,
    make_workload,
    step_hyper,
    transformer_shapes,
)
from offload_adamw.contract.rules import MASTER_KEY
from offload_adamw.kernels.adamw import adamw_update_
from offload_adamw.kernels.blocked import BlockConfig, blocked_adamw_, chunk_loop_status
from offload_adamw.kernels.numba_loop import numba_kernel_status
from offload_adamw.optim.optimizer import OffloadAdamW

MEMORY_ALLOWANCE = 64 * MIB  # what a step may allocate beyond its state

TRIAD_CASE = "inplace-triad"  # timed in the same rotation: the ceiling under the same conditions
TRIAD_BYTES_PER_ELEMENT = 12
DEFAULT_MIXED = "ours-bf16"
HOST_MODEL = "ours-bf16-host-model"
STAGING = "ours-bf16-staging"
NAIVE = "torch-naive-bf16"
CEILING = "torch-fused-fp32"
LOSSY_CASES = ("deepspeed-bf16-native",)
BF16_CASES = (DEFAULT_MIXED, HOST_MODEL, STAGING, "ours-bf16-chunk-loop", NAIVE, "deepspeed-fp32+casts",
              "deepspeed-bf16-native")
ALL_CASES = (
    DEFAULT_MIXED,
    HOST_MODEL,
    STAGING,
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
    mixes: tuple[str, ...] = ("llama-layers",)
    """Named mixes of tensor shapes (workload.MIXES) timed after the sizes, like a size."""


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
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # an optional dependency: imported where it is used

        # the first construction JIT-builds (or loads) the CPU Adam extension: timed here, once
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(64))], adamw_mode=True, **HYPER)
        info.setdefault("deepspeed_load_s", round(time.perf_counter() - start, 2))
        import deepspeed

        info["deepspeed_version"] = deepspeed.__version__
        return DeepSpeedCPUAdam
    except Exception as exc:  # ImportError, or the JIT build failing: report, do not crash
        info["deepspeed_unavailable"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return None


def build_cases(w: Workload, names: tuple[str, ...], info: dict) -> dict[str, Callable[[], None]]:
    """name -> a function doing one step of that case on the shared arrays (cases that cannot
    run here are absent; ``info["skipped"]`` says why)."""
    hp = step_hyper()
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

    def offload_optimizer(params: list[torch.nn.Parameter], master: list[torch.Tensor]) -> OffloadAdamW:
        """OffloadAdamW over ``params`` with its state set to ``master`` and the shared moments."""
        opt = OffloadAdamW(params, **HYPER)
        for p, theta, m, v in zip(params, master, w.exp_avg, w.exp_avg_sq):
            opt.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32), "exp_avg": m, "exp_avg_sq": v,
                            MASTER_KEY: theta}
        return opt

    def host_model():
        # its own master and bf16 parameters (round of it), written by no other case: no element is an edit
        master = [m.clone() for m in w.master]
        params = [torch.nn.Parameter(m.to(torch.bfloat16)) for m in master]
        for p, g in zip(params, w.grad16):
            p.grad = g
        return offload_optimizer(params, master).step

    def staging():
        # the pipeline's call for a device model's bucket: (parameter, host gradient, staging buffer), the
        # staging buffer receiving round(master); here the bf16 copy of the workload serves as staging
        params = [torch.nn.Parameter(torch.empty_like(m)) for m in w.model16]
        opt = offload_optimizer(params, w.master)
        updates = list(zip(params, w.grad16, w.model16))
        current = [False] * len(updates)
        return lambda: opt.update_group(0, updates, current=current)

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
        elif name == HOST_MODEL:
            cases[name] = host_model()
        elif name == STAGING:
            cases[name] = staging()
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


# --------------------------------------------------------------------- run


def run_size(total: int, config: BenchConfig, info: dict, progress: bool = False, mix: str | None = None) -> dict:
    """One size (or, with ``mix``, the named mix of shapes: ``total`` is then ignored), every case rotated."""
    shapes = MIXES[mix] if mix is not None else transformer_shapes(total)
    w = make_workload(total, shapes=shapes)
    cases = build_cases(w, config.cases, info)
    label = f"{mix} mix" if mix is not None else f"{format_size(total)} elements"
    samples, extras = time_rotated(cases, config.warmup, config.repeats, label, progress)
    n = w.elements
    state_bytes = sum(t.numel() * t.element_size() for t in w.master + w.exp_avg + w.exp_avg_sq)
    triad = summary(samples.pop(TRIAD_CASE), n)
    triad_gbps = TRIAD_BYTES_PER_ELEMENT * n / (triad["ms_per_step"] / 1e3) / 1e9
    rows = {}
    for name, times in samples.items():
        row = summary(times, n)
        row["fraction_of_inplace_triad"] = row["effective_gbps"] / triad_gbps
        row["step_extra_mib"] = max(extras[name]) / MIB if extras[name] else None
        rows[name] = row
    del cases, w
    gc.collect()  # optimizers hold reference cycles; free this size's arrays before the next
    return {
        "elements": n,
        "tensors": len(shapes),
        "mix": mix,
        "state_bytes": state_bytes,
        "inplace_triad_gbps": triad_gbps,
        "inplace_triad_ms": triad["ms_per_step"],
        "cases": rows,
    }


def thread_scaling(total: int, config: BenchConfig, info: dict, progress: bool = False) -> dict:
    """The scaling cases at each thread count, interleaved and rotated; ms/step medians."""
    counts = config.scaling_threads or tuple(range(1, usable_cpus() + 1))
    w = make_workload(total)
    cases = build_cases(w, tuple(c for c in SCALING_CASES if c in config.cases), info)
    before = torch.get_num_threads()
    out: dict = {"elements": w.elements, "threads": list(counts), "cases": {name: [] for name in cases}}
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            samples, _ = time_rotated(cases, max(1, config.warmup), config.repeats, f"{threads} thread(s)", progress)
            for name, times in samples.items():
                out["cases"][name].append(summary(times, w.elements))
    finally:
        torch.set_num_threads(before)
    del cases, w
    gc.collect()
    return out


def parity_check(elements: int) -> dict:
    """One step of the default mixed path and of the naive path from the same state: equal bits?"""
    hp = step_hyper()
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
            differ += differing_elements(a, b)
    return {"elements": results[0].elements, "differing_elements": differ, "bitwise_equal": differ == 0}


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
            out.append({"size": size["elements"], "mix": size.get("mix"), "target": label, "value": value,
                        "required": need, "met": met})
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
    for mix in config.mixes:
        result["sizes"].append(run_size(0, config, info, progress, mix=mix))
    if config.scaling_size:
        result["thread_scaling"] = thread_scaling(config.scaling_size, config, info, progress)
    info["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    info["numba_loop"] = numba_kernel_status()  # per variant: usable, compile and self-test seconds, reason
    result["targets"] = targets(result)
    return result


