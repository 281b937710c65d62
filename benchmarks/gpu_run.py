"""The GPU run: every CUDA path of OffloadAdamW checked and measured in one command, under 8 minutes.

    bash benchmarks/gpu_run.sh OUTDIR                    # on the GPU machine (its own python3, PYTHONPATH=src)
    bash benchmarks/gpu_run.sh OUTDIR --cpu-rehearsal    # here: every section that needs no CUDA, small sizes
    python3 benchmarks/gpu_run.py --plot OUTDIR/gpu_run.json   # the PNGs again, from the JSON (needs matplotlib)

Contract:

* **Sections of rows, each row time-limited.** On CUDA a section's rows run in one child process (one
  per row where a clean process matters: the ~1B model's peak memory); without CUDA all rows share one
  child. The driver kills a child's process group when its row passes the row's limit or the run's
  budget, records the row as ``timeout`` (with the figures it reported before, under ``partial``) and
  starts a new child for the rows after it, so one hang loses one row; a child that dies loses only the
  row it was in (``error: child exited with N``). A row that raises is ``error`` (the traceback is in
  the JSON), one whose check fails is ``failed``; a row that needs CUDA on a machine without it is
  ``skipped: no CUDA``; one that would start after the budget is ``skipped: time budget``.
  ``GPU_RUN_SELFTEST=1`` adds a first section whose rows hang and crash on purpose (the tests use it).
* **Outputs in OUTDIR**: ``gpu_run.json`` (``schema_version``, the machine, the sizes, every row's
  status, seconds and figures, the targets; rewritten after every row, so a killed run keeps what it
  measured), ``gpu_run.log`` (stdout, from gpu_run.sh), ``logs/*.log`` (the children's output),
  ``traces/llama-d.json.gz`` (the profiler trace of two freed-gradient steps), PNGs (``--plot``; skipped with a note
  when matplotlib is missing), and a summary table on stdout. Exit status 0 when no row failed, errored or timed out; 1 otherwise.
* **Sections.** ``pcie``: host-to-device, device-to-host and both at once from pinned memory, as one
  large copy (the peak) and as the ~1B model's tensors one by one (what the pipeline issues).
  ``gpu_tests``: ``pytest -m gpu tests``. ``parity``: small Llamas trained with OffloadAdamW against
  ``torch.optim.AdamW(fused=True)`` as the README defines parity (bitwise: float32 parameters; for bf16,
  fused AdamW on float32 copies then round-to-nearest), with several buckets, accumulation 4, gradients
  kept and freed, clipping, fp16 autocast with OffloadGradScaler, amsgrad, ``torch.compile(model)`` and
  FSDP2 at world size 1 (NCCL; gloo on the CPU); then FSDP2 at world size 1 with freed gradients and the host
  updates during backward (``update_in_backward``), float32 without clipping and bf16 with ``max_grad_norm`` and
  accumulation 4 (``set_requires_gradient_sync(False)``), against a model sharded alike whose shards fused AdamW
  updates on float32 host copies, clipped by torch's ``clip_grad_norm_`` on that model; those two rows also report
  each step's timeline overlap after the first and the buckets (one per FSDP group). ``llama``: a bf16 Llama
  of about 1B parameters, step time and peak device memory of (a) torch AdamW(fused) with float32 parameters
  and moments under bf16 autocast, (b) torch AdamW(fused) on bf16 parameters, (c) OffloadAdamW with device gradients kept,
  (d) freed, (e) freed with the host updates started during backward (update_in_backward); each row also times a
  forward+backward-only step in the same process (the exposed optimizer time is the difference) and, for (c)-(e),
  profiles two steps and reads from the device timeline how much of the gradient copies ran before backward ended and
  the copies' own bandwidth (the pipeline's CUDA events are internal and untimed, so they are not read). ``host``:
  the in-place triad and the host step over 1 to 16 threads (the default kernel through OffloadAdamW, torch fused
  float32, the naive path with preallocated float32 gradients).
* **The CPU rehearsal** runs the parity, llama and host sections with the CPU as device and small sizes
  (the pipeline's CPU mode, gloo for FSDP2); ``--quick`` shrinks them further for the test suite.
  ``--only SECTIONS`` reruns some sections (the others are ``skipped: not selected``).
* Only public APIs of the library are used (OffloadAdamW and its options, clip_grad_norm_,
  OffloadGradScaler, master_param, gradient, last_grad_norm, last_step_timeline, is_host_resident,
  measure_host_bandwidth), so its internals may change freely.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import gzip
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
MIB = 2**20


# ------------------------------------------------------------------------------------ sizes


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Everything the run allocates and repeats; the rehearsal presets shrink it."""

    budget_s: float = 430.0
    """Seconds for all rows together; a row gets at most what is left plus 15 s (the run's limit is 8 minutes)."""
    startup_limit_s: float = 90.0
    """Seconds a child may take to import and start its first row."""
    parity_steps: int = 12
    """Optimizer steps per parity row."""
    parity_accum: int = 4
    """Micro-batches per step in the accumulating parity rows."""
    parity_hidden: int = 64
    """Hidden size of the parity Llama (2 layers)."""
    parity_vocab: int = 128
    """Vocabulary of the parity Llama."""
    parity_seq: int = 32
    """Tokens per sequence in the parity rows (2 sequences per micro-batch)."""
    parity_bucket_bytes: int = 16 << 10
    """bucket_bytes of the several-buckets parity rows (the parity model has ~100 KiB to ~200 KiB of gradients)."""
    llama_hidden: int = 2048
    """Hidden size of the timed Llama (2048 x 16 layers, intermediate 5632, vocab 32000: about 1.0 B parameters)."""
    llama_layers: int = 16
    """Decoder layers of the timed Llama."""
    llama_intermediate: int = 5632
    """MLP width of the timed Llama."""
    llama_heads: int = 16
    """Attention heads (and key/value heads) of the timed Llama."""
    llama_vocab: int = 32000
    """Vocabulary of the timed Llama."""
    llama_seq: int = 1024
    """Tokens per sequence of the timed Llama."""
    llama_batch: int = 4
    """Sequences per step of the timed Llama."""
    llama_warmup: int = 2
    """Untimed steps before each timed phase (state allocation, allocator and autotuning warm-up)."""
    llama_timed: int = 5
    """Timed steps per phase (medians are reported)."""
    profile: bool = True
    """Profile two offloaded steps and read the copy overlap from the trace (on the CPU: only the trace's ranges)."""
    pcie_bytes: int = 1 << 30
    """Bytes of the single large copy that measures the link's pinned peak."""
    pcie_repeats: int = 5
    """Timed copies per direction (the best is reported)."""
    triad_elements: int = 64 * MIB
    """float32 elements per array of the host bandwidth probe."""
    host_elements: int = 128 * MIB
    """Elements of the host-step workload (a transformer's mix of tensor shapes)."""
    host_threads: tuple[int, ...] = (1, 2, 4, 8, 16)
    """torch thread counts of the host-step rows."""
    host_warmup: int = 1
    """Untimed host steps per case and thread count."""
    host_repeats: int = 3
    """Timed, interleaved host steps per case and thread count."""
    compile_rows: bool = True
    """Run the rows that torch.compile (they need a C++ compiler on the CPU; compilation takes tens of seconds)."""


GPU_SIZES = Sizes()
REHEARSAL_SIZES = Sizes(
    budget_s=420.0, parity_steps=6, parity_accum=4, parity_hidden=32, parity_vocab=64, parity_seq=16,
    parity_bucket_bytes=4 << 10, llama_hidden=64, llama_layers=2, llama_intermediate=176, llama_heads=4,
    llama_vocab=256, llama_seq=32, llama_batch=2, llama_warmup=1, llama_timed=2, triad_elements=4 * MIB,
    host_elements=4 * MIB, host_threads=(1, 2), host_warmup=1, host_repeats=2,
)
QUICK_SIZES = replace(
    REHEARSAL_SIZES, budget_s=120.0, parity_steps=3, parity_accum=2, llama_layers=1, llama_timed=1,
    triad_elements=MIB, host_elements=MIB, host_threads=(1,), host_repeats=1, compile_rows=False,
)


# -------------------------------------------------------------------------------- the rows


@dataclass(frozen=True, kw_only=True)
class Row:
    """One measurement: a row of the JSON and of the summary table."""

    name: str
    """Unique within its section."""
    limit_s: float
    """Seconds this row may run (on the GPU machine) before it is killed."""
    needs_cuda: bool = False
    """Skipped without CUDA (the CPU rehearsal)."""
    needs_compile: bool = False
    """Uses torch.compile (skipped when Sizes.compile_rows is off)."""
    args: dict = field(default_factory=dict)
    """What the row function receives."""


@dataclass(frozen=True, kw_only=True)
class Section:
    """Rows run by one child process (or one per row)."""

    name: str
    """Key in the JSON."""
    rows: tuple[Row, ...]
    """In the order they run."""
    fresh_process: bool = False
    """One child per row on CUDA (clean peak-memory figures); on the CPU one child for all."""
    command: bool = False
    """The section is an external command (pytest), not row functions of this file."""


PARITY_CASES = {
    # name: (param dtype, accumulation, offload_gradients, clip, scaler, amsgrad, compile, fsdp, small buckets)
    "fp32-kept-acc4-buckets": ("float32", True, False, False, False, False, False, False, True),
    "fp32-freed-acc4-clip-buckets": ("float32", True, True, True, False, False, False, False, True),
    "bf16-kept-acc4-clip": ("bfloat16", True, False, True, False, False, False, False, False),
    "bf16-freed-acc4-clip-buckets": ("bfloat16", True, True, True, False, False, False, False, True),
    "fp16-autocast-scaler-freed-acc4-clip": ("float32", True, True, True, True, False, False, False, False),
    "fp16-autocast-scaler-kept": ("float32", False, False, False, True, False, False, False, False),
    "bf16-freed-amsgrad": ("bfloat16", False, True, False, False, True, False, False, True),
    "bf16-freed-acc4-compiled-model": ("bfloat16", True, True, False, False, False, True, False, False),
    "fp32-fsdp2-ws1": ("float32", True, False, False, False, False, False, True, False),
    "bf16-fsdp2-ws1": ("bfloat16", True, False, False, False, False, False, True, False),
}

FSDP_OVERLAP_CASES = {
    # FSDP2 at world size 1 with OffloadAdamW(offload_gradients=True, update_in_backward=True):
    # name: (param dtype, accumulation, max_grad_norm)
    "fp32-fsdp2-ws1-freed-inbwd": ("float32", False, False),
    "bf16-fsdp2-ws1-freed-inbwd-acc4-clip": ("bfloat16", True, True),
}

LLAMA_VARIANTS = {
    "a": "torch.optim.AdamW(fused=True), float32 params + moments, bf16 autocast (16 B/param)",
    "b": "torch.optim.AdamW(fused=True) on bf16 params",
    "c": "OffloadAdamW, bf16 params, device gradients kept",
    "d": "OffloadAdamW(offload_gradients=True), bf16 params",
    "e": "OffloadAdamW(offload_gradients=True, update_in_backward=True), bf16 params",
}


LLAMA_SHORT = {"a": "torch, fp32 master", "b": "torch, bf16", "c": "offload, kept", "d": "offload, freed",
               "e": "freed, in backward"}


def sections(sizes: Sizes) -> tuple[Section, ...]:
    parity_rows = []
    for name, case in PARITY_CASES.items():
        compiled, fsdp = case[6], case[7]
        parity_rows.append(Row(name=name, limit_s=180.0 if compiled else 90.0 if fsdp else 60.0,
                               needs_compile=compiled, args={"case": name}))
    for name in FSDP_OVERLAP_CASES:
        # A few seconds on the GPU; the limit is what a worker thread that never finishes may cost the run.
        parity_rows.append(Row(name=name, limit_s=45.0, args={"fsdp_overlap_case": name}))
    return (
        Section(name="pcie", rows=(
            Row(name="pinned-peak", limit_s=60.0, needs_cuda=True),
            Row(name="per-tensor-1b-shapes", limit_s=60.0, needs_cuda=True),
        )),
        Section(name="gpu_tests", command=True, rows=(Row(name="pytest -m gpu", limit_s=150.0, needs_cuda=True),)),
        Section(name="parity", rows=tuple(parity_rows)),
        Section(name="llama", fresh_process=True, rows=tuple(
            Row(name=f"{key}", limit_s=110.0, args={"variant": key}) for key in LLAMA_VARIANTS
        )),
        Section(name="host", rows=(
            Row(name="triad", limit_s=40.0),
            *(Row(name=f"threads-{n}", limit_s=60.0, args={"threads": n}) for n in sizes.host_threads),
        )),
    )


SELFTEST_ENV = "GPU_RUN_SELFTEST"


def all_sections(sizes: Sizes) -> tuple[Section, ...]:
    """The run's sections; with GPU_RUN_SELFTEST=1 first a section that checks the driver's own limits."""
    if os.environ.get(SELFTEST_ENV) != "1":
        return sections(sizes)
    selftest = Section(name="selftest", rows=(
        Row(name="hangs", limit_s=float(os.environ.get("GPU_RUN_SELFTEST_LIMIT", "3"))),
        Row(name="crashes", limit_s=30.0),
        Row(name="after", limit_s=30.0),
    ))
    return (selftest, *sections(sizes))


def selftest_row(ctx: Context, row: Row) -> dict:
    """Rows that misbehave on purpose: one hangs past its limit, one kills its process."""
    if row.name == "hangs":
        ctx.partial({"measured_before_the_hang": 1})
        time.sleep(3600)
    if row.name == "crashes":
        os._exit(3)
    return {"status": "ok", "pid": os.getpid()}


# ============================================================================ child side: rows


class Context:
    """What every row function sees: the sizes, the device, and a cache shared by a child's rows."""

    def __init__(self, sizes: Sizes, device: str, outdir: Path, partial: Callable[[dict], None] | None = None) -> None:
        self.sizes = sizes
        self.device = device
        self.outdir = outdir
        self.cache: dict[str, Any] = {}
        self._partial = partial

    def partial(self, figures: dict) -> None:
        """Report the figures a row has so far: kept if the row is killed later (its last phase hangs)."""
        if self._partial is not None:
            self._partial(figures)

    def sync(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()


def _same_bits(a, b) -> bool:
    import torch

    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    view = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return torch.equal(a.contiguous().view(view[a.dtype]), b.contiguous().view(view[b.dtype]))


def _max_abs(a, b) -> float:
    d = (a.detach().cpu().double() - b.detach().cpu().double()).abs()
    return float(d.max()) if d.numel() else 0.0


class _GradHolder:
    """A gradient where torch's clipping looks for one (``.grad``), wherever the tensor lives."""

    def __init__(self, grad) -> None:
        self.grad = grad


def _full(t):
    """A DTensor's whole value (world size 1: the local shard), else the tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ----------------------------------------------------------------------------------- parity


def _parity_llama(sizes: Sizes, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=sizes.parity_vocab, hidden_size=sizes.parity_hidden, intermediate_size=2 * sizes.parity_hidden,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, attn_implementation="eager",  # eager: a deterministic backward
        use_cache=False,  # training: no key/value cache (and no cache object for torch.compile to trace)
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _groups(model, amsgrad: bool) -> list[dict]:
    """Two groups with different hyperparameters: matrices with decay, the rest without."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.ndim == 2], "lr": 3e-3, "weight_decay": 0.1, "amsgrad": amsgrad},
        {"params": [p for _, p in named if p.ndim != 2], "lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.0,
         "amsgrad": amsgrad},
    ]


def _fsdp_mesh(ctx: Context):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if "mesh" not in ctx.cache:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "nccl" if ctx.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        ctx.cache["mesh"] = init_device_mesh(ctx.device, (1,))
    return ctx.cache["mesh"]


def _deterministic(dev: str) -> None:
    """Both sides of a parity row compute their gradients alike: no TF32, deterministic kernels."""
    import torch

    if dev == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def parity_row(ctx: Context, case: str) -> dict:
    """OffloadAdamW against torch AdamW(fused=True) on host float32 copies, the same user calls on both sides."""
    import torch

    from offload_adamw import OffloadAdamW, OffloadGradScaler, is_host_resident

    dtype_name, accumulate, freed, clip, scaler, amsgrad, compiled, fsdp, small_buckets = PARITY_CASES[case]
    sizes, dev = ctx.sizes, ctx.device
    dtype = getattr(torch, dtype_name)
    accum = sizes.parity_accum if accumulate else 1
    clip_norm = 0.05  # small enough that most steps clip
    inf_at = 2 if sizes.parity_steps > 3 else 1  # a step whose scaled loss is infinite: both scalers skip it
    _deterministic(dev)

    net_b = _parity_llama(sizes, seed=0).to(device=dev, dtype=dtype)  # the reference's model
    net_a = copy.deepcopy(net_b)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        mesh = _fsdp_mesh(ctx)
        for layer in net_a.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(net_a, mesh=mesh)
    kw = {"offload_gradients": freed}
    if not fsdp:
        kw["transfer_pipeline"] = True  # on the CPU rehearsal too
        if small_buckets:
            kw["bucket_bytes"] = sizes.parity_bucket_bytes
    opt_a = OffloadAdamW(_groups(net_a, amsgrad), **kw)
    # Reference: float32 copies in host memory (where OffloadAdamW's masters live), torch's fused op.
    params_b = [p for g in _groups(net_b, amsgrad) for p in g["params"]]
    copies = {p: torch.nn.Parameter(p.detach().to("cpu", torch.float32, copy=True)) for p in params_b}
    ref_opt = torch.optim.AdamW(
        [{**g, "params": [copies[p] for p in g["params"]]} for g in _groups(net_b, amsgrad)], fused=True
    )
    run_a, run_b = net_a, net_b
    if compiled:
        run_a, run_b = torch.compile(net_a), torch.compile(net_b)
    scaler_a = scaler_b = None
    if scaler:
        kw_s = {"init_scale": 2.0**12, "growth_interval": 3}
        scaler_a, scaler_b = OffloadGradScaler(dev, **kw_s), torch.amp.GradScaler(dev, **kw_s)
    gen = torch.Generator().manual_seed(1)
    first_grads_equal: bool | None = None
    norms_equal = True
    scales_equal = True
    for step in range(sizes.parity_steps):
        for micro in range(accum):
            ids = torch.randint(0, sizes.parity_vocab, (2, sizes.parity_seq), generator=gen).to(dev)
            for model, sc in ((run_a, scaler_a), (run_b, scaler_b)):
                with torch.autocast(dev, dtype=torch.float16, enabled=sc is not None):
                    loss = model(input_ids=ids, labels=ids).loss / accum
                if sc is not None:
                    loss = sc.scale(loss)
                    if step == inf_at and micro == 0:
                        loss = loss * math.inf
                loss.backward()
        # With freed gradients p.grad is a storage-less stand-in for the host buffer, never device memory.
        if freed and any(p.grad is not None and not is_host_resident(p.grad) for p in net_a.parameters()):
            return {"status": "failed", "why": "offload_gradients left a gradient on the device", "step": step}
        # The reference's gradients where OffloadAdamW holds them: on the device when kept, a host
        # copy in the gradient's dtype when freed (clipping reduces them where they are).
        live_b = [p.grad if not freed else p.grad.detach().to("cpu", copy=True) for p in params_b]
        if first_grads_equal is None:
            params_a = [p for g in opt_a.param_groups for p in g["params"]]
            first_grads_equal = all(
                _same_bits(_full(opt_a.gradient(pa)), gb) for pa, gb in zip(params_a, live_b)
            )
        if scaler:
            for p in params_b:  # float32 parameters: the copies take the gradients unchanged
                copies[p].grad = p.grad.detach().to("cpu", torch.float32, copy=True)
            scaler_a.unscale_(opt_a)
            scaler_b.unscale_(ref_opt)
            if clip:
                norm_a = opt_a.clip_grad_norm_(clip_norm)
                norm_b = torch.nn.utils.clip_grad_norm_([copies[p] for p in params_b], clip_norm)
                norms_equal &= _same_bits(_full(norm_a).float(), norm_b.float())
            scaler_a.step(opt_a)
            scaler_a.update()
            scaler_b.step(ref_opt)
            scaler_b.update()
            scales_equal &= scaler_a.get_scale() == scaler_b.get_scale()
        else:
            if clip:
                norm_a = opt_a.clip_grad_norm_(clip_norm)
                norm_b = torch.nn.utils.clip_grad_norm_([_GradHolder(g) for g in live_b], clip_norm)
                norms_equal &= _same_bits(_full(norm_a).float(), norm_b.float())
            for p, g in zip(params_b, live_b):
                copies[p].grad = g.detach().to("cpu", torch.float32, copy=True)
            opt_a.step()
            ref_opt.step()
        with torch.no_grad():
            for p in params_b:
                p.copy_(copies[p])  # round-to-nearest for bf16, exact for float32
        set_to_none = step % 4 != 1
        opt_a.zero_grad(set_to_none=set_to_none)
        net_b.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
    ctx.sync()
    params_a = [p for g in opt_a.param_groups for p in g["params"]]
    mismatches: list[str] = []
    worst = 0.0
    for index, (pa, pb) in enumerate(zip(params_a, params_b)):
        whole = _full(pa)
        if not _same_bits(whole, pb):
            mismatches.append(f"param {index}")
            worst = max(worst, _max_abs(whole, pb))
        sa, sb = opt_a.state.get(pa, {}), ref_opt.state.get(copies[pb], {})
        if bool(sa) != bool(sb):
            mismatches.append(f"state presence {index}")
            continue
        for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in sb and not _same_bits(_full(sa[key]), sb[key]):
                mismatches.append(f"{key} {index}")
        if not _same_bits(_full(opt_a.master_param(pa)).cpu(), copies[pb]):
            mismatches.append(f"master {index}")
    bitwise = not mismatches and norms_equal and scales_equal
    out = {
        "status": "ok" if bitwise else "failed",
        "bitwise": bitwise,
        "device": dev,
        "dtype": dtype_name,
        "accumulation": accum,
        "offload_gradients": freed,
        "clip": clip,
        "scaler": scaler,
        "amsgrad": amsgrad,
        "compiled_model": compiled,
        "fsdp2_world_size_1": fsdp,
        "bucket_bytes": kw.get("bucket_bytes", "default"),
        "steps": sizes.parity_steps,
        "first_step_gradients_bitwise": bool(first_grads_equal),
        "clip_norms_bitwise": norms_equal if clip else None,
        "loss_scales_equal": scales_equal if scaler else None,
        "mismatches": mismatches[:20],
        "mismatch_count": len(mismatches),
        "max_abs_param_diff": worst,
    }
    if dev == "cuda":
        out["tensor_count"] = len(params_a)
    return out


def _shard(t):
    """A DTensor's local shard (world size 1: all of it), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def fsdp_overlap_row(ctx: Context, case: str) -> dict:
    """FSDP2 at world size 1, freed gradients, host updates during backward: against FSDP2 + torch AdamW(fused=True).

    Both models are the parity Llama sharded alike (each decoder layer and the root: one FSDP group each) on the
    same one-rank mesh, and get the same user calls: a micro-batch that only accumulates runs with
    ``set_requires_gradient_sync(False)`` on both. The reference is the README's parity: torch's fused AdamW on
    float32 host copies of the reference's local shards (where OffloadAdamW's masters live; the CUDA fused kernel
    rounds differently), the result copied back into the shards (round-to-nearest for bf16); the clipped row clips
    the reference with torch's ``clip_grad_norm_`` over its device gradients in the optimizer's parameter order,
    while ours clips with ``max_grad_norm`` (the norms taken on the device in the hooks, the updates started when
    backward ends). Reported besides bitwise equality: each step's timeline overlap after the first (the first knows
    no order of gradients yet, so nothing runs in it early) and the number of buckets, one per FSDP group.
    """
    import torch
    from torch.distributed.fsdp import fully_shard

    from offload_adamw import OffloadAdamW, is_host_resident

    dtype_name, accumulate, clip = FSDP_OVERLAP_CASES[case]
    sizes, dev = ctx.sizes, ctx.device
    dtype = getattr(torch, dtype_name)
    accum = sizes.parity_accum if accumulate else 1
    clip_norm = 0.05 if clip else None  # small enough that most steps clip
    _deterministic(dev)
    mesh = _fsdp_mesh(ctx)
    net_b = _parity_llama(sizes, seed=0).to(device=dev, dtype=dtype)  # the reference's model
    net_a = copy.deepcopy(net_b)
    for net in (net_a, net_b):
        for layer in net.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    fsdp_groups = len(net_a.model.layers) + 1
    opt_a = OffloadAdamW(_groups(net_a, False), offload_gradients=True, update_in_backward=True, max_grad_norm=clip_norm)
    params_b = [p for g in _groups(net_b, False) for p in g["params"]]
    copies = {p: torch.nn.Parameter(_shard(p.detach()).to("cpu", torch.float32, copy=True)) for p in params_b}
    ref_opt = torch.optim.AdamW(
        [{**g, "params": [copies[p] for p in g["params"]]} for g in _groups(net_b, False)], fused=True
    )
    gen = torch.Generator().manual_seed(1)
    first_grads_equal: bool | None = None
    norms_equal = True
    overlaps: list[float] = []
    buckets: list[int] = []
    for step in range(sizes.parity_steps):
        for micro in range(accum):
            ids = torch.randint(0, sizes.parity_vocab, (2, sizes.parity_seq), generator=gen).to(dev)
            for model in (net_a, net_b):
                model.set_requires_gradient_sync(micro == accum - 1)
                loss = model(input_ids=ids, labels=ids).loss / accum
                loss.backward()
        if any(p.grad is not None and not is_host_resident(p.grad) for p in net_a.parameters()):
            return {"status": "failed", "why": "offload_gradients left a gradient on the device", "step": step}
        params_a = [p for g in opt_a.param_groups for p in g["params"]]
        if first_grads_equal is None:
            # Only the first step's gradients can be read: in later steps their updates ran during backward.
            first_grads_equal = all(
                _same_bits(_shard(opt_a.gradient(pa)), _shard(pb.grad)) for pa, pb in zip(params_a, params_b)
            )
        if clip_norm is not None:
            norm_b = torch.nn.utils.clip_grad_norm_(params_b, clip_norm)
        for p in params_b:
            copies[p].grad = _shard(p.grad).detach().to("cpu", torch.float32, copy=True)
        opt_a.step()
        ref_opt.step()
        if clip_norm is not None:
            norms_equal &= opt_a.last_grad_norm is not None and _same_bits(
                _full(opt_a.last_grad_norm).float(), _full(norm_b).float())
        with torch.no_grad():
            for p in params_b:
                _shard(p).copy_(copies[p])  # round-to-nearest for bf16, exact for float32
        timeline = opt_a.last_step_timeline()
        if timeline is not None:
            buckets.append(len(timeline.buckets))
            if step > 0:
                overlaps.append(timeline.overlap)
        opt_a.zero_grad(set_to_none=True)
        net_b.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    ctx.sync()
    params_a = [p for g in opt_a.param_groups for p in g["params"]]
    mismatches: list[str] = []
    worst = 0.0
    for index, (pa, pb) in enumerate(zip(params_a, params_b)):
        shard_a, shard_b = _shard(pa.detach()), _shard(pb.detach())
        if not _same_bits(shard_a, shard_b):
            mismatches.append(f"param {index}")
            worst = max(worst, _max_abs(shard_a, shard_b))
        sa, sb = opt_a.state.get(pa, {}), ref_opt.state.get(copies[pb], {})
        if bool(sa) != bool(sb):
            mismatches.append(f"state presence {index}")
            continue
        for key in ("step", "exp_avg", "exp_avg_sq"):
            if key in sb and not _same_bits(_shard(sa[key]), sb[key]):
                mismatches.append(f"{key} {index}")
        if not _same_bits(_shard(opt_a.master_param(pa)).cpu(), copies[pb]):
            mismatches.append(f"master {index}")
    bitwise = not mismatches and norms_equal
    one_bucket_per_group = bool(buckets) and all(n == fsdp_groups for n in buckets)
    out: dict[str, Any] = {
        "status": "ok" if bitwise and one_bucket_per_group else "failed",
        "bitwise": bitwise,
        "device": dev,
        "dtype": dtype_name,
        "accumulation": accum,
        "offload_gradients": True,
        "update_in_backward": True,
        "max_grad_norm": clip_norm,
        "fsdp2_world_size_1": True,
        "steps": sizes.parity_steps,
        "first_step_gradients_bitwise": bool(first_grads_equal),
        "clip_norms_bitwise": norms_equal if clip else None,
        "mismatches": mismatches[:20],
        "mismatch_count": len(mismatches),
        "max_abs_param_diff": worst,
        "fsdp_groups": fsdp_groups,
        "buckets": buckets[-1] if buckets else None,
        "one_bucket_per_fsdp_group": one_bucket_per_group,
        # The share of host-update time that ran before backward ended (host clock), steps 2..n.
        "timeline_overlap_after_first_step": overlaps,
        "timeline_overlap_median": statistics.median(overlaps) if overlaps else None,
    }
    if not one_bucket_per_group:
        out["why"] = f"buckets per step {buckets}, expected one per FSDP group ({fsdp_groups})"
    if not clip and overlaps and max(overlaps) <= 0.0:
        out["note"] = "no host update started before backward ended in any step after the first"
    return out


# ------------------------------------------------------------------------------------ llama


def _llama(sizes: Sizes, device: str, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=sizes.llama_vocab, hidden_size=sizes.llama_hidden, intermediate_size=sizes.llama_intermediate,
        num_hidden_layers=sizes.llama_layers, num_attention_heads=sizes.llama_heads,
        num_key_value_heads=sizes.llama_heads, max_position_embeddings=max(2048, sizes.llama_seq),
        tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False,
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype on the device: no float32 copy first
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model


def _memory(ctx: Context) -> dict:
    import torch

    if ctx.device != "cuda":
        return {}
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(), "peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def _reset_memory(ctx: Context) -> None:
    import torch

    gc.collect()
    if ctx.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def llama_row(ctx: Context, variant: str) -> dict:
    """One optimizer set-up on the ~1B model: forward+backward alone, then full steps; time and peak memory."""
    import torch

    from offload_adamw import OffloadAdamW

    sizes, dev = ctx.sizes, ctx.device
    param_dtype = torch.float32 if variant == "a" else torch.bfloat16
    model = _llama(sizes, dev, param_dtype)
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, sizes.llama_vocab, (sizes.llama_batch, sizes.llama_seq), generator=gen).to(dev)
               for _ in range(4)]
    autocast = variant == "a"

    def forward_backward(i: int) -> None:
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=batches[i % len(batches)], labels=batches[i % len(batches)]).loss
        loss.backward()

    def timed(n: int, step: Callable[[int], None]) -> list[float]:
        times = []
        for i in range(n):
            ctx.sync()
            start = time.perf_counter()
            step(i)
            ctx.sync()
            times.append(time.perf_counter() - start)
        return times

    def fb_only(i: int) -> None:
        forward_backward(i)
        model.zero_grad(set_to_none=True)

    timed(sizes.llama_warmup, fb_only)
    _reset_memory(ctx)
    fb_times = timed(sizes.llama_timed, fb_only)
    fb_memory = _memory(ctx)

    if variant in ("a", "b"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    else:
        opt = OffloadAdamW(model.parameters(), lr=1e-4, weight_decay=0.1, offload_gradients=variant in ("d", "e"),
                           update_in_backward=variant == "e")

    def full_step(i: int) -> None:
        forward_backward(i)
        opt.step()
        opt.zero_grad(set_to_none=True)

    started = time.perf_counter()
    timed(1, full_step)  # state allocation (host state and pinned buffers for OffloadAdamW)
    first_step_s = time.perf_counter() - started
    timed(max(0, sizes.llama_warmup - 1), full_step)
    _reset_memory(ctx)
    step_times = timed(sizes.llama_timed, full_step)
    step_memory = _memory(ctx)
    out: dict[str, Any] = {
        "status": "ok",
        "variant": LLAMA_VARIANTS[variant],
        "device": dev,
        "parameters": n_params,
        "tokens_per_step": sizes.llama_batch * sizes.llama_seq,
        "forward_backward_s_median": statistics.median(fb_times),
        "forward_backward_s_all": fb_times,
        "step_s_median": statistics.median(step_times),
        "step_s_all": step_times,
        "first_step_s": first_step_s,
        "exposed_optimizer_s": statistics.median(step_times) - statistics.median(fb_times),
        "forward_backward_memory": fb_memory,
        "step_memory": step_memory,
    }
    if step_memory:
        out["optimizer_share_bytes"] = step_memory["peak_allocated_bytes"] - fb_memory["peak_allocated_bytes"]
        out["optimizer_share_reserved_bytes"] = step_memory["peak_reserved_bytes"] - fb_memory["peak_reserved_bytes"]
    if isinstance(opt, OffloadAdamW):
        out["host_state_bytes"] = opt.host_state_bytes()
        out["pinned_bytes"] = opt.pinned_bytes()
        from offload_adamw import numba_kernel_status

        out["numba_loop"] = numba_kernel_status()
        timeline = opt.last_step_timeline()
        if timeline is not None:
            # Host monotonic times: the host update's share that ran before the last gradient hook.
            out["timeline_overlap"] = timeline.overlap
            out["timeline"] = timeline.as_dict()
        if sizes.profile:
            ctx.partial(out)
            try:
                out["overlap"] = _profile_overlap(
                    ctx, forward_backward, opt, keep_trace=f"llama-{variant}" if variant == "d" else None
                )
            except Exception:  # noqa: BLE001 - the timed figures stand without it
                out["overlap"] = {"measured": False, "why": traceback.format_exc()[-2000:]}
            out["overlap"]["method"] = OVERLAP_METHOD
    return out


OVERLAP_METHOD = ("torch.profiler device timeline of two steps (the pipeline's own CUDA events are recorded "
                  "without timing and are internal, so they are not read)")


def _profile_overlap(ctx: Context, forward_backward, opt, keep_trace: str | None) -> dict:
    """Two profiled steps: when the gradient copies ran against the end of backward, and their bandwidth."""
    from torch.profiler import ProfilerActivity, profile, record_function

    ctx.sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(2):
            with record_function(f"fwd_bwd#{i}"):
                forward_backward(i)
            with record_function(f"step#{i}"):
                opt.step()
                opt.zero_grad(set_to_none=True)
        ctx.sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        text = path.read_text()
    if keep_trace:
        traces = ctx.outdir / "traces"
        traces.mkdir(parents=True, exist_ok=True)
        with gzip.open(traces / f"{keep_trace}.json.gz", "wt") as f:
            f.write(text)
    return overlap_from_trace(json.loads(text))


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _intersection_us(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the part of ``intervals`` (union) that ``cover`` (union) also covers."""
    merged: list[list[float]] = []
    for a, b in sorted(cover):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = 0.0
    for a, b in sorted(intervals):
        for c, d in merged:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                total += hi - lo
    return total


def overlap_from_trace(trace: dict, step: int = 0) -> dict:
    """From a Kineto (chrome) trace of ``fwd_bwd#i`` / ``step#i`` ranges, step ``step``'s copy timeline.

    Backward ends at the last kernel launched inside ``fwd_bwd#{step}``. The gradient copies are the
    device-to-host memcpys launched from the start of ``fwd_bwd#{step}`` to the end of ``step#{step}``;
    the parameter copies the host-to-device memcpys launched in ``step#{step}``. Reported: how much of
    the gradient copies' busy time lay before backward's end (the overlap), the tail after it, both
    directions' bytes and bandwidth while busy, and how much of the parameter copies overlapped kernels.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") == "user_annotation"}
    fb, st = ranges.get(f"fwd_bwd#{step}"), ranges.get(f"step#{step}")
    if fb is None or st is None:
        return {"measured": False, "why": f"no fwd_bwd#{step}/step#{step} ranges in the trace"}
    launch_ts = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = e["ts"]
    device_events = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]

    def launched_in(e, window) -> bool:
        ts = launch_ts.get(e.get("args", {}).get("correlation"))
        return ts is not None and window[0] <= ts <= window[1]

    def span(e) -> tuple[float, float]:
        return (e["ts"], e["ts"] + e.get("dur", 0))

    kernels = [e for e in device_events if e.get("cat") == "kernel"]
    bwd = [span(e) for e in kernels if launched_in(e, fb)]
    if not bwd:
        return {"measured": False, "why": "no kernels correlated with the fwd_bwd range", "events": len(events)}
    backward_end = max(b for _, b in bwd)
    compute_streams = sorted({e.get("args", {}).get("stream") for e in kernels if launched_in(e, fb)} - {None})
    memcpys = [e for e in device_events if e.get("cat") == "gpu_memcpy"]
    d2h = [e for e in memcpys if "DtoH" in e["name"] and launched_in(e, (fb[0], st[1]))]
    h2d = [e for e in memcpys if "HtoD" in e["name"] and launched_in(e, st)]
    out: dict[str, Any] = {"measured": True, "backward_end_us": backward_end, "compute_streams": compute_streams}
    for tag, copies in (("d2h", d2h), ("h2d", h2d)):
        spans = [span(e) for e in copies]
        busy = _union_us(spans)
        nbytes = sum(int(e.get("args", {}).get("bytes", 0) or 0) for e in copies)
        out[f"{tag}_copies"] = len(copies)
        out[f"{tag}_streams"] = sorted({e.get("args", {}).get("stream") for e in copies} - {None})
        out[f"{tag}_bytes"] = nbytes
        out[f"{tag}_busy_us"] = busy
        out[f"{tag}_GBps_while_busy"] = nbytes / busy / 1e3 if busy > 0 and nbytes else None
        out[f"{tag}_first_start_us"] = min((a for a, _ in spans), default=None)
        out[f"{tag}_last_end_us"] = max((b for _, b in spans), default=None)
    d2h_spans = [span(e) for e in d2h]
    before = _intersection_us(d2h_spans, [(-math.inf, backward_end)])
    out["d2h_busy_before_backward_end_us"] = before
    out["d2h_overlap_fraction"] = before / out["d2h_busy_us"] if out["d2h_busy_us"] > 0 else None
    out["d2h_tail_after_backward_us"] = max(0.0, out["d2h_last_end_us"] - backward_end) if d2h_spans else None
    kernel_spans = [span(e) for e in kernels if e.get("args", {}).get("stream") in compute_streams]
    h2d_spans = [span(e) for e in h2d]
    out["h2d_overlapped_with_kernels_us"] = _intersection_us(h2d_spans, kernel_spans)
    out["step_range_us"] = st[1] - st[0]
    out["forward_backward_range_us"] = fb[1] - fb[0]
    return out


# ------------------------------------------------------------------------------------- pcie


def _best_copy_s(pairs: list[tuple[Any, Any]], repeats: int, streams: list) -> float:
    """Best seconds of copying every (dst, src) pair of each stream's list, all streams started together."""
    import torch

    best = math.inf
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        ends = []
        for stream, work in zip(streams, pairs):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                for dst, src in work:
                    dst.copy_(src, non_blocking=True)
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                ends.append(end)
        torch.cuda.synchronize()
        best = min(best, max(start.elapsed_time(e) for e in ends) / 1e3)
    return best


def pcie_row(ctx: Context, kind: str) -> dict:
    import torch

    sizes = ctx.sizes
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    if kind == "peak":
        n = sizes.pcie_bytes
        host_a = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        host_b = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev_a = torch.empty(n, dtype=torch.uint8, device="cuda")
        dev_b = torch.empty(n, dtype=torch.uint8, device="cuda")
        h2d = n / _best_copy_s([[(dev_a, host_a)]], sizes.pcie_repeats, [s1])
        d2h = n / _best_copy_s([[(host_b, dev_b)]], sizes.pcie_repeats, [s1])
        both = 2 * n / _best_copy_s([[(dev_a, host_a)], [(host_b, dev_b)]], sizes.pcie_repeats, [s1, s2])
        return {"status": "ok", "bytes": n, "h2d_GBps": h2d / 1e9, "d2h_GBps": d2h / 1e9, "both_GBps": both / 1e9,
                "pinned_with": "torch pin_memory=True"}
    # The ~1B model's tensors one by one, between views of one pinned flat buffer and device tensors:
    # the pattern of the pipeline's per-tensor copies.
    shapes = [tuple(p.shape) for p in _llama(sizes, "meta", torch.bfloat16).parameters()]
    total = sum(math.prod(s) for s in shapes)
    flat = torch.empty(total, dtype=torch.bfloat16, pin_memory=True)
    flat_back = torch.empty(total, dtype=torch.bfloat16, pin_memory=True)
    views, views_back, offset = [], [], 0
    for s in shapes:
        views.append(flat[offset:offset + math.prod(s)].view(s))
        views_back.append(flat_back[offset:offset + math.prod(s)].view(s))
        offset += math.prod(s)
    device = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    nbytes = 2 * total
    repeats = max(2, sizes.pcie_repeats // 2)
    h2d = nbytes / _best_copy_s([list(zip(device, views))], repeats, [s1])
    d2h = nbytes / _best_copy_s([list(zip(views_back, device))], repeats, [s1])
    both = 2 * nbytes / _best_copy_s([list(zip(device, views)), list(zip(views_back, device))], repeats, [s1, s2])
    return {"status": "ok", "tensors": len(shapes), "bytes": nbytes, "h2d_GBps": h2d / 1e9, "d2h_GBps": d2h / 1e9,
            "both_GBps": both / 1e9}


# ------------------------------------------------------------------------------------- host


def host_triad(ctx: Context) -> dict:
    from offload_adamw import measure_host_bandwidth

    result = measure_host_bandwidth(elements=ctx.sizes.triad_elements, repeats=5)
    return {"status": "ok", **result}


def _host_workload(ctx: Context) -> dict:
    """The three host-step cases on one shape mix (built once per child)."""
    import torch

    from offload_adamw import OffloadAdamW
    from offload_adamw.benchmarking.workload import transformer_shapes

    if "host" in ctx.cache:
        return ctx.cache["host"]
    shapes = transformer_shapes(ctx.sizes.host_elements)
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(s, generator=gen).mul_(0.02) for s in shapes]
    grads16 = [torch.randn(s, generator=gen).mul_(1e-3).to(torch.bfloat16) for s in shapes]
    hyper = {"lr": 1e-4, "weight_decay": 0.01}

    # the default kernel, through the optimizer: bf16 parameters and gradients, float32 host state
    params16 = [torch.nn.Parameter(m.to(torch.bfloat16)) for m in masters]
    for p, g in zip(params16, grads16):
        p.grad = g
    ours = OffloadAdamW(params16, pin_memory=False, **hyper)

    # torch's fused AdamW on float32 parameters and gradients
    params32 = [torch.nn.Parameter(m.clone()) for m in masters]
    for p, g in zip(params32, grads16):
        p.grad = g.float()
    fused = torch.optim.AdamW(params32, fused=True, **hyper)

    # the naive mixed path with preallocated float32 gradients: widen into them, fused step, narrow back
    naive32 = [torch.nn.Parameter(m.clone()) for m in masters]
    for p in naive32:
        p.grad = torch.empty_like(p)
    naive16 = [m.to(torch.bfloat16) for m in masters]
    naive = torch.optim.AdamW(naive32, fused=True, **hyper)

    def naive_step() -> None:
        for p, g in zip(naive32, grads16):
            p.grad.copy_(g)
        naive.step()
        with torch.no_grad():
            for out, p in zip(naive16, naive32):
                out.copy_(p)

    cases = {"ours-bf16 (default kernel)": ours.step, "torch-fused-fp32": fused.step,
             "naive-bf16-preallocated": naive_step}
    ctx.cache["host"] = {"cases": cases, "elements": sum(m.numel() for m in masters), "tensors": len(shapes)}
    return ctx.cache["host"]


def host_threads(ctx: Context, threads: int) -> dict:
    import torch

    work = _host_workload(ctx)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        samples: dict[str, list[float]] = {name: [] for name in work["cases"]}
        for _ in range(ctx.sizes.host_warmup):
            for fn in work["cases"].values():
                fn()
        for _ in range(ctx.sizes.host_repeats):
            for name, fn in work["cases"].items():  # interleaved, so machine noise hits every case alike
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    n = work["elements"]
    cases = {}
    for name, times in samples.items():
        med = statistics.median(times)
        cases[name] = {"ms_per_step": med * 1e3, "ms_all": [t * 1e3 for t in times],
                       "GBps_at_28B": 28 * n / med / 1e9}
    return {"status": "ok", "threads": threads, "elements": n, "tensors": work["tensors"], "cases": cases}


ROW_FUNCTIONS: dict[str, Callable[..., dict]] = {
    "parity": lambda ctx, row: (fsdp_overlap_row(ctx, row.args["fsdp_overlap_case"]) if "fsdp_overlap_case" in row.args
                                else parity_row(ctx, **row.args)),
    "llama": lambda ctx, row: llama_row(ctx, **row.args),
    "pcie": lambda ctx, row: pcie_row(ctx, "peak" if row.name == "pinned-peak" else "per-tensor"),
    "host": lambda ctx, row: host_triad(ctx) if row.name == "triad" else host_threads(ctx, **row.args),
    "selftest": selftest_row,
}


def _emit(events: Path, record: dict) -> None:
    with events.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def child_main(work: list[tuple[str, str]], sizes: Sizes, device: str, outdir: Path, events: Path) -> int:
    """Run ``(section, row)`` items in order, reporting each start and result to ``events``."""
    if any(section != "selftest" for section, _ in work):
        import torch  # imported before the first row starts its clock

        if device == "cuda":
            torch.cuda.set_device(0)

    current: list[tuple[str, str]] = []
    ctx = Context(sizes, device, outdir, partial=lambda figures: _emit(
        events, {"section": current[-1][0], "row": current[-1][1], "event": "partial", "result": figures}))
    rows = {(s.name, r.name): r for s in all_sections(sizes) for r in s.rows}
    for section_name, name in work:
        current.append((section_name, name))
        _emit(events, {"section": section_name, "row": name, "event": "start"})
        started = time.perf_counter()
        try:
            result = ROW_FUNCTIONS[section_name](ctx, rows[section_name, name])
        except Exception:  # noqa: BLE001 - recorded; the next row still runs
            result = {"status": "error", "error": traceback.format_exc()}
        result["seconds"] = time.perf_counter() - started
        _emit(events, {"section": section_name, "row": name, "event": "done", "result": result})
        gc.collect()
    if "mesh" in ctx.cache:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0


# ============================================================================ driver side


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=10)


def _child_env() -> dict:
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return env


class Driver:
    """Runs the sections, enforces the limits, writes the JSON after every row."""

    def __init__(self, outdir: Path, sizes: Sizes, *, cuda: bool, mode: str, sizes_name: str, only: set | None) -> None:
        self.outdir = outdir
        self.sizes = sizes
        self.cuda = cuda
        self.device = "cuda" if cuda else "cpu"
        self.only = only
        self.started = time.monotonic()
        self.deadline = self.started + sizes.budget_s
        (outdir / "logs").mkdir(parents=True, exist_ok=True)
        self.result: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "mode": mode,
            "sizes_preset": sizes_name,
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(cuda),
            "sizes": asdict(sizes),
            "sections": {},
        }

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.result["elapsed_s"] = time.monotonic() - self.started
        self.result["targets"] = targets(self.result)
        path = self.outdir / "gpu_run.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        os.replace(tmp, path)

    def record(self, section: str, row: str, result: dict) -> None:
        self.result["sections"][section]["rows"][row] = result
        status = result.get("status", "?")
        print(f"[{time.monotonic() - self.started:6.1f} s] {section}/{row}: {status}"
              f" ({result.get('seconds', 0.0):.1f} s) {headline(section, row, result)}", flush=True)
        self.save()

    def run(self) -> dict:
        """Every section in order; the rows without CUDA all in one child (one start-up for the rehearsal)."""
        batches: list[tuple[str, list[tuple[str, Row]]]] = []
        for section in all_sections(self.sizes):
            rows = self.result["sections"].setdefault(section.name, {"rows": {}})["rows"]
            pending = []
            for row in section.rows:
                rows[row.name] = {"status": "not run"}
                if self.only is not None and section.name not in self.only:
                    rows[row.name] = {"status": "skipped: not selected (--only)"}
                elif row.needs_cuda and not self.cuda:
                    rows[row.name] = {"status": "skipped: no CUDA"}
                elif row.needs_compile and not self.sizes.compile_rows:
                    rows[row.name] = {"status": "skipped: compile rows off (--quick)"}
                else:
                    pending.append((section.name, row))
            if section.command:
                batches += [("command", [item]) for item in pending]
            elif section.fresh_process and self.cuda:
                batches += [(section.name, [item]) for item in pending]
            elif pending:
                if not self.cuda and batches and batches[-1][0] == "cpu":
                    batches[-1][1].extend(pending)
                else:
                    batches.append(("cpu" if not self.cuda else section.name, pending))
        self.save()
        for kind, items in batches:
            if kind == "command":
                self.run_pytest(*items[0])
            else:
                self.run_rows(kind if kind != "cpu" else "cpu-rehearsal", items)
        self.result["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.save()
        return self.result

    def run_rows(self, log_name: str, items: list[tuple[str, Row]]) -> None:
        """Rows in one child; on a timeout or a crash, the rows after it in a new child."""
        log_path = self.outdir / "logs" / f"{log_name}.log"
        while items:
            if self.left() <= 0:
                for section, row in items:
                    self.record(section, row.name, {"status": "skipped: time budget"})
                return
            events = self.outdir / "logs" / f".{log_name}.events"
            events.unlink(missing_ok=True)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child",
                   json.dumps([[section, row.name] for section, row in items]),
                   "--sizes-json", json.dumps(asdict(self.sizes)), "--device", self.device, str(self.outdir)]
            log = log_path.open("a")
            log.write(f"\n=== {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} "
                      f"rows {[f'{s}/{r.name}' for s, r in items]}\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**_child_env(), "GPU_RUN_EVENTS": str(events)}, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            spawned = last_event = time.monotonic()
            seen = 0
            current: tuple[str, Row, float] | None = None
            done: set[tuple[str, str]] = set()
            partial: dict[tuple[str, str], dict] = {}
            by_key = {(section, row.name): row for section, row in items}
            killed: tuple[str, Row] | None = None
            killed_why = ""
            while True:
                finished = proc.poll() is not None
                lines = events.read_text().splitlines() if events.exists() else []
                for line in lines[seen:]:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        break  # a line being written: read it next time
                    seen += 1
                    last_event = time.monotonic()
                    key = (rec["section"], rec["row"])
                    if rec["event"] == "partial":
                        partial[key] = rec["result"]
                    elif rec["event"] == "start":
                        current = (key[0], by_key[key], time.monotonic())
                    else:
                        done.add(key)
                        current = None
                        self.record(key[0], key[1], rec["result"])
                if finished:
                    break
                now = time.monotonic()
                if current is None:
                    waiting = [(s, r) for s, r in items if (s, r.name) not in done]
                    if now - last_event > self.sizes.startup_limit_s:
                        if not waiting:  # every row reported: the child hangs on its way out, nothing is lost
                            _kill_group(proc)
                            break
                        killed = waiting[0]
                        killed_why = f"timeout: no row started within {self.sizes.startup_limit_s:.0f} s"
                    elif now > self.deadline + 15:
                        killed_why = "time budget"
                else:
                    section, row, since = current
                    limit = min(row.limit_s, max(5.0, self.deadline + 15 - since))
                    if now - since > limit:
                        killed, killed_why = (section, row), f"timeout: over {limit:.0f} s"
                if killed_why:
                    _kill_group(proc)
                    break
                time.sleep(0.2)
            log.close()
            events.unlink(missing_ok=True)
            remaining = [(s, r) for s, r in items if (s, r.name) not in done]
            lost: tuple[str, Row] | None = None
            if killed is not None:
                lost, status = killed, killed_why
            elif killed_why:  # the budget ran out between rows
                for section, row in remaining:
                    self.record(section, row.name, {"status": "skipped: time budget"})
                return
            elif remaining:  # the child died inside a row, or before its first
                lost = (current[0], current[1]) if current is not None else remaining[0]
                where = "" if current is not None else " before the row started"
                status = f"error: child exited with {proc.returncode}{where}"
            if lost is not None:
                record = {"status": status, "seconds": time.monotonic() - spawned, "log_tail": _tail(log_path)}
                if (lost[0], lost[1].name) in partial:
                    record["partial"] = partial[lost[0], lost[1].name]  # what the row measured before it was lost
                self.record(lost[0], lost[1].name, record)
                remaining = [(s, r) for s, r in remaining if (s, r.name) != (lost[0], lost[1].name)]
            items = remaining

    def run_pytest(self, section: str, row: Row) -> None:
        if self.left() <= 0:
            self.record(section, row.name, {"status": "skipped: time budget"})
            return
        limit = min(row.limit_s, max(5.0, self.left()))
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider"]
        log_path = self.outdir / "logs" / f"{section}.log"
        started = time.monotonic()
        with log_path.open("a") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
        tail = _tail(log_path)
        counts = parse_pytest_summary(tail)
        if rc is None:
            status = f"timeout: over {limit:.0f} s"
        elif rc == 0 and counts.get("failed", 0) == 0 and counts.get("errors", 0) == 0:
            status = "ok"
        else:
            status = "failed"
        self.record(section, row.name, {"status": status, "returncode": rc, "counts": counts,
                                             "seconds": time.monotonic() - started, "command": " ".join(cmd[1:]),
                                             "log_tail": tail if status != "ok" else tail[-600:]})


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def parse_pytest_summary(text: str) -> dict[str, int]:
    """'3 passed, 2 skipped, 1 failed in 4.2s' -> {'passed': 3, 'skipped': 2, 'failed': 1}."""
    import re

    counts: dict[str, int] = {}
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", ln)]
    if lines:
        for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)", lines[-1]):
            counts["errors" if word.startswith("error") else word] = int(number)
    return counts


def machine_info(cuda: bool) -> dict:
    import torch

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["host_memory_bytes"] = int(line.split()[1]) * 1024
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_bytes"] = props.total_memory
        info["gpu_count"] = torch.cuda.device_count()
        with contextlib.suppress(Exception):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.max,pcie.link.width.max",
                                  "--format=csv,noheader"], check=False, capture_output=True, text=True, timeout=10)
            info["nvidia_smi"] = smi.stdout.strip()
    from importlib import metadata

    for package in ("transformers", "numpy", "matplotlib"):
        with contextlib.suppress(Exception):
            info[package] = metadata.version(package)
    with contextlib.suppress(Exception):
        git = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=10)
        if git.returncode == 0:
            info["commit"] = git.stdout.strip()
    return info


# ------------------------------------------------------------------------------ targets, table


def _row(result: dict, section: str, row: str) -> dict:
    r = result.get("sections", {}).get(section, {}).get("rows", {}).get(row, {})
    return r if r.get("status") in ("ok", "failed") else {}


def targets(result: dict) -> list[dict]:
    """The issue's targets, reported against (not tuned to). met is None where a figure is missing."""
    out = []
    rehearsal = result.get("mode", "gpu") != "gpu"

    def add(name: str, value: float | None, required: str, met: bool | None) -> None:
        if rehearsal:  # tiny CPU stand-ins say nothing about the targets
            met = None
        out.append({"target": name, "value": value, "required": required, "met": met})

    a, d = _row(result, "llama", "a"), _row(result, "llama", "d")
    ratio = d["step_s_median"] / a["step_s_median"] if a and d else None
    add("llama (d) freed step time / (a) fp32-master torch AdamW", ratio, "<= 1.15", None if ratio is None else ratio <= 1.15)
    share = d.get("optimizer_share_bytes") if d else None
    param_bytes = 2 * d["parameters"] if d else None
    add("llama (d) optimizer share of peak device memory, GiB", None if share is None else share / GIB,
        "about 0 (<= 5% of the bf16 parameter bytes)", None if share is None else share <= 0.05 * param_bytes)
    peak = _row(result, "pcie", "pinned-peak")
    per_tensor = _row(result, "pcie", "per-tensor-1b-shapes")
    overlap = d.get("overlap", {}) if d else {}
    for tag in ("h2d", "d2h"):
        p = peak.get(f"{tag}_GBps")
        t = per_tensor.get(f"{tag}_GBps")
        frac = t / p if p and t else None
        add(f"pcie {tag}: per-tensor copies of the 1B shapes / pinned peak", frac, ">= 0.80",
            None if frac is None else frac >= 0.8)
        busy = overlap.get(f"{tag}_GBps_while_busy")
        frac = busy / p if p and busy else None
        add(f"pcie {tag}: the pipeline's own copies in (d) (profiler, while busy) / pinned peak", frac, ">= 0.80",
            None if frac is None else frac >= 0.8)
    return out


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def headline(section: str, row: str, r: dict) -> str:
    """The row's key figures, one line (empty where the row has none)."""
    if r.get("status") not in ("ok", "failed"):
        return ""
    try:
        return _headline(section, row, r)
    except (KeyError, TypeError, ValueError):
        return "(figures incomplete: see the JSON)"


def _headline(section: str, row: str, r: dict) -> str:
    if section == "parity":
        text = (f"bitwise={r.get('bitwise')} grads@1={r.get('first_step_gradients_bitwise')} "
                f"clip={r.get('clip_norms_bitwise')} scale={r.get('loss_scales_equal')} "
                f"mismatches={r.get('mismatch_count')} max|d|={r.get('max_abs_param_diff', 0):.2e}")
        if "buckets" in r:  # the rows with host updates during backward
            median = r.get("timeline_overlap_median")
            text += f" buckets={r['buckets']}/{r.get('fsdp_groups')} overlap={'-' if median is None else f'{median:.2f}'}"
        return text
    if section == "llama":
        sm = r.get("step_memory", {})
        text = (f"{r['parameters'] / 1e9:.3f} B params; step {r['step_s_median'] * 1e3:.0f} ms, fwd+bwd "
                f"{r['forward_backward_s_median'] * 1e3:.0f} ms, exposed {r['exposed_optimizer_s'] * 1e3:.0f} ms")
        if sm:
            text += (f"; peak alloc {_gb(sm['peak_allocated_bytes'])} GiB, reserved {_gb(sm['peak_reserved_bytes'])} GiB,"
                     f" optimizer share {_gb(r.get('optimizer_share_bytes'))} GiB")
        ov = r.get("overlap", {})
        if ov.get("measured"):
            frac = ov.get("d2h_overlap_fraction")
            text += (f"; d2h before end of backward {'-' if frac is None else f'{frac:.0%}'},"
                     f" tail {(ov.get('d2h_tail_after_backward_us') or 0) / 1e3:.1f} ms")
        return text
    if section == "pcie":
        return f"h2d {r['h2d_GBps']:.1f} GB/s, d2h {r['d2h_GBps']:.1f} GB/s, both {r['both_GBps']:.1f} GB/s"
    if section == "host":
        if row == "triad":
            return f"in-place triad {r['inplace_triad_gbps']:.1f} GB/s, triad {r['triad_gbps']:.1f} GB/s ({r['threads']} threads)"
        return ", ".join(f"{name} {c['ms_per_step']:.1f} ms" for name, c in r["cases"].items())
    if section == "gpu_tests":
        return ", ".join(f"{v} {k}" for k, v in r.get("counts", {}).items())
    return ""


def summary_table(result: dict) -> str:
    m = result["machine"]
    lines = [
        (f"GPU run ({result['mode']}, sizes {result['sizes_preset']}): {m.get('gpu', 'no GPU')}, {m.get('cpu', '?')} "
         f"x{m.get('logical_cpus')}, torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), {result['started_utc']}, "
         f"{result.get('elapsed_s', 0):.0f} s"),
        f"{'section/row':44} {'status':36} {'s':>6}  figures",
    ]
    for section, body in result["sections"].items():
        for row, r in body["rows"].items():
            lines.append(f"{section + '/' + row:44} {str(r.get('status'))[:36]:36} {r.get('seconds', 0):6.1f}  "
                         f"{headline(section, row, r)}")
    lines.append("")
    lines.append("targets (reported against, not tuned to):")
    for t in result.get("targets", []):
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        if t["met"] is None and t["value"] is not None:
            verdict = "not a GPU figure (rehearsal)"
        lines.append(f"  {t['target']:78} {value:>8} ({t['required']}): {verdict}")
    return "\n".join(lines)


def bad_rows(result: dict) -> list[str]:
    return [f"{s}/{r}" for s, body in result["sections"].items() for r, v in body["rows"].items()
            if not (v.get("status") == "ok" or str(v.get("status", "")).startswith("skipped"))]


# ------------------------------------------------------------------------------------ plots


def plot(json_path: Path) -> list[str]:
    """PNGs next to the JSON; returns the notes (what was drawn or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["matplotlib is not installed: no PNGs (run `python benchmarks/gpu_run.py --plot gpu_run.json` where it is)"]
    result = json.loads(json_path.read_text())
    notes = []
    out = json_path.parent
    title = f"{result['machine'].get('gpu', 'CPU rehearsal')}, torch {result['machine'].get('torch')}"

    llama = {k: v for k, v in result["sections"].get("llama", {}).get("rows", {}).items() if v.get("status") == "ok"}
    if llama:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        keys = list(llama)
        labels = [f"({k}) {LLAMA_SHORT.get(k, k)}" for k in keys]
        x = list(range(len(keys)))
        ax1.bar(x, [llama[k]["step_s_median"] * 1e3 for k in keys], 0.6, label="full step")
        ax1.bar(x, [llama[k]["forward_backward_s_median"] * 1e3 for k in keys], 0.3, label="forward+backward only")
        ax1.set_xticks(x, labels, fontsize=7, rotation=15)
        ax1.set_ylim(0, 1.3 * max(max(llama[k]["step_s_median"], llama[k]["forward_backward_s_median"]) for k in keys) * 1e3)
        ax1.set_ylabel("ms per step (median)")
        ax1.set_title("step time", fontsize=9)
        ax1.legend(fontsize=8)
        if all(llama[k].get("step_memory") for k in keys):
            alloc = [llama[k]["step_memory"]["peak_allocated_bytes"] / GIB for k in keys]
            reserved = [llama[k]["step_memory"]["peak_reserved_bytes"] / GIB for k in keys]
            fbm = [llama[k]["forward_backward_memory"]["peak_allocated_bytes"] / GIB for k in keys]
            ax2.bar([i - 0.27 for i in x], fbm, 0.27, label="fwd+bwd only, allocated")
            ax2.bar(list(x), alloc, 0.27, label="full step, allocated")
            ax2.bar([i + 0.27 for i in x], reserved, 0.27, label="full step, reserved")
            ax2.set_xticks(x, labels, fontsize=7, rotation=15)
            ax2.set_ylim(0, 1.3 * max(reserved + alloc + fbm))
            ax2.set_ylabel("peak device memory, GiB")
            ax2.legend(fontsize=8)
        else:
            ax2.text(0.5, 0.5, "no device memory figures (CPU)", ha="center", transform=ax2.transAxes)
        ax2.set_title("peak device memory", fontsize=9)
        params = llama[keys[0]]["parameters"]
        fig.suptitle(f"Llama, {params / 1e9:.3f} B parameters, {llama[keys[0]]['tokens_per_step']} tokens per step; {title}",
                     fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "gpu_run_llama.png", dpi=120)
        plt.close(fig)
        notes.append(str(out / "gpu_run_llama.png"))

    host = result["sections"].get("host", {}).get("rows", {})
    sweep = sorted((v for k, v in host.items() if k.startswith("threads-") and v.get("status") == "ok"),
                   key=lambda v: v["threads"])
    if sweep:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for name in sweep[0]["cases"]:
            ax.plot([v["threads"] for v in sweep], [v["cases"][name]["GBps_at_28B"] for v in sweep], marker="o", label=name)
        triad = host.get("triad", {})
        if triad.get("status") == "ok":
            ax.axhline(triad["inplace_triad_gbps"], color="black", linestyle="--", linewidth=1,
                       label=f"in-place triad, {triad['threads']} threads")
        ax.set_xscale("log", base=2)
        ax.set_xticks([v["threads"] for v in sweep], [str(v["threads"]) for v in sweep])
        ax.set_xlabel("torch threads")
        ax.set_ylabel("GB/s at 28 B/element (median)")
        ax.set_title(f"host AdamW step, {sweep[0]['elements'] / 2**20:.0f} Mi elements\n{result['machine'].get('cpu', '')}",
                     fontsize=8)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "gpu_run_host_threads.png", dpi=120)
        plt.close(fig)
        notes.append(str(out / "gpu_run_host_threads.png"))

    pcie = {k: v for k, v in result["sections"].get("pcie", {}).get("rows", {}).items() if v.get("status") == "ok"}
    if pcie:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        kinds = ["h2d_GBps", "d2h_GBps", "both_GBps"]
        for i, (name, r) in enumerate(pcie.items()):
            ax.bar([k + i * 0.4 for k in range(3)], [r[k] for k in kinds], 0.4, label=name)
        ax.set_xticks([k + 0.2 for k in range(3)], ["host->device", "device->host", "both at once"])
        ax.set_ylabel("GB/s (best)")
        ax.set_title(f"PCIe from pinned memory\n{title}", fontsize=8)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "gpu_run_pcie.png", dpi=120)
        plt.close(fig)
        notes.append(str(out / "gpu_run_pcie.png"))
    if not notes:
        notes.append("nothing to plot (no llama, host or pcie rows finished)")
    return notes


# ------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, nargs="?", help="where the JSON, logs, traces and PNGs go")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run what needs no CUDA with the CPU as device and small sizes; CUDA rows are skipped")
    parser.add_argument("--quick", action="store_true", help="with --cpu-rehearsal: tiny sizes, no compile rows (tests)")
    parser.add_argument("--only", help="comma-separated sections to run (pcie, gpu_tests, parity, llama, host)")
    parser.add_argument("--budget-s", type=float, help="override the run's time budget in seconds")
    parser.add_argument("--plot", type=Path, metavar="GPU_RUN_JSON", help="only draw the PNGs from a JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sizes-json", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.plot is not None:
        for note in plot(args.plot):
            print(f"plot: {note}")
        return 0
    if args.outdir is None:
        parser.error("OUTDIR is required")
    if args.child:
        raw = json.loads(args.sizes_json)
        raw["host_threads"] = tuple(raw["host_threads"])
        work = [tuple(item) for item in json.loads(args.child)]
        return child_main(work, Sizes(**raw), args.device, args.outdir, Path(os.environ["GPU_RUN_EVENTS"]))

    only = None
    if args.only:
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        names = [s.name for s in all_sections(GPU_SIZES)]
        unknown = only - set(names)
        if unknown:
            parser.error(f"unknown section(s) {sorted(unknown)}; choose from {names}")
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_rehearsal
    if not cuda and not args.cpu_rehearsal:
        print("gpu_run: no CUDA device; use --cpu-rehearsal to rehearse the run on the CPU", file=sys.stderr)
        return 2
    if args.quick and not args.cpu_rehearsal:
        parser.error("--quick is for --cpu-rehearsal (the GPU run uses its full sizes)")
    sizes, name = (GPU_SIZES, "gpu") if cuda else (QUICK_SIZES, "quick") if args.quick else (REHEARSAL_SIZES, "rehearsal")
    if args.budget_s is not None:
        if not args.budget_s > 0:
            parser.error("--budget-s must be positive")
        sizes = replace(sizes, budget_s=args.budget_s)
    args.outdir.mkdir(parents=True, exist_ok=True)
    driver = Driver(args.outdir, sizes, cuda=cuda, mode="gpu" if cuda else "cpu-rehearsal", sizes_name=name, only=only)
    result = driver.run()
    print()
    print(summary_table(result))
    bad = bad_rows(result)
    print(f"\nJSON: {args.outdir / 'gpu_run.json'}; logs: {args.outdir / 'logs'}")
    if bad:
        print(f"rows not ok: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
