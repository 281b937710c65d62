"""The GPU run's rows: the sizes, the table of sections and rows, and the function each row runs (in a child).

Contract: :func:`all_sections` is the run's table (the JSON's order), :func:`run_order` the order its rows
run in (by :class:`Phase`: what a cut budget loses is worth the least); each :class:`Row` is run by
its ``run`` function with a :class:`Context` and returns a JSON-ready dict whose
``status`` is ``ok`` or ``failed`` (a row that raises is recorded as ``error`` by the driver).
What every section measures: benchmarks/gpu_run.py.
"""

from __future__ import annotations

import copy
import datetime
import gc
import gzip
import json
import math
import os
import socket
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import IntEnum
from pathlib import Path
from typing import Any

from offload_adamw.benchmarking.device_trace import overlap_from_trace

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
    """Timed host steps per case and thread count, the cases in rotated order."""
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


class Phase(IntEnum):
    """When a row runs. The run goes phase by phase, so what the time budget cuts off is worth the least:
    the gpu tests, then the ~1B rows the targets read, their reference, the other ~1B rows, parity, the
    links and the host, and the row whose compilation alone can take minutes last."""

    SELFTEST = 0
    """The driver's own limits (GPU_RUN_SELFTEST=1)."""
    GPU_TESTS = 1
    """``pytest -m gpu``."""
    TARGETS = 2
    """The ~1B rows the targets read: freed gradients (and updates during backward; a streamed placement)."""
    REFERENCE = 3
    """The on-device torch AdamW with float32 masters that the targets compare with."""
    LLAMA = 4
    """The other ~1B rows."""
    PARITY = 5
    """Parity without torch.compile, a checkpoint after device steps, FSDP2."""
    LINKS_AND_HOST = 6
    """PCIe, the host's bandwidth and its threads."""
    LAST = 7
    """Parity of a torch.compile'd model."""


@dataclass(frozen=True, kw_only=True)
class Row:
    """One measurement: a row of the JSON and of the summary table."""

    name: str
    """Unique within its section."""
    limit_s: float
    """Seconds this row may run (on the GPU machine) before it is killed."""
    phase: Phase
    """When it runs (the rows of one phase in the order their sections declare them)."""
    needs_cuda: bool = False
    """Skipped without CUDA (the CPU rehearsal)."""
    needs_compile: bool = False
    """Uses torch.compile (skipped when Sizes.compile_rows is off)."""
    run: Callable[[Context, Row], dict] | None = None
    """The row function: measures in a child and returns the row's JSON (``status`` ok or failed); None for the
    row of a command section, which the driver runs itself."""
    args: dict = field(default_factory=dict)
    """What the row function reads from ``row.args``."""


@dataclass(frozen=True, kw_only=True)
class Section:
    """Rows run by one child process (or one per row)."""

    name: str
    """Key in the JSON."""
    rows: tuple[Row, ...]
    """In the order of the JSON and the summary (the run takes them by :class:`Phase`)."""
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

@dataclass(frozen=True, kw_only=True)
class LlamaVariant:
    """One optimizer set-up timed on the ~1B Llama: a row of the ``llama`` section."""

    description: str
    """What the row runs, for the JSON."""
    short: str
    """Its label in the plot."""
    phase: Phase
    """When it runs: Phase.TARGETS, REFERENCE or LLAMA."""
    torch_adamw: bool = False
    """torch.optim.AdamW(fused=True) on the device instead of OffloadAdamW."""
    param_dtype: str = "bfloat16"
    """The model's parameter dtype."""
    autocast: bool = False
    """Forward and backward under bf16 autocast (float32 parameters)."""
    options: dict = field(default_factory=dict)
    """OffloadAdamW's keyword options (besides lr and weight_decay)."""
    keep_trace: bool = False
    """Keep the profiler trace of its two profiled steps (traces/llama-KEY.json.gz)."""
    placement: str | None = None
    """Where the update runs (docs/placement.md): ``"stream"`` (one streamed group) or ``"mixed"`` (the first half of
    the decoder layers resident on the device, the second half streamed, embeddings, final norm and head on the
    host). Such a row also times ``step()`` alone (the PCIe bytes it moves over that time: the achieved bandwidth)
    and, after its timed steps, holds ``parity_steps`` more steps bitwise to torch.optim.AdamW(fused=True) on float32
    master copies where each group runs (the device for streamed and resident groups, host memory for host ones)."""
    parity_steps: int = 2
    """Steps of the parity check of a row with a placement."""


# A placement of the update ("stream", mixed) is one more entry here, its grouping in `placement`; Phase.TARGETS
# for one the targets read.
LLAMA_VARIANTS: dict[str, LlamaVariant] = {
    "a": LlamaVariant(description="torch.optim.AdamW(fused=True), float32 params + moments, bf16 autocast (16 B/param)",
                      short="torch, fp32 master", phase=Phase.REFERENCE, torch_adamw=True, param_dtype="float32", autocast=True),
    "b": LlamaVariant(description="torch.optim.AdamW(fused=True) on bf16 params", short="torch, bf16", phase=Phase.LLAMA,
                      torch_adamw=True),
    "c": LlamaVariant(description="OffloadAdamW, bf16 params, device gradients kept", short="offload, kept",
                      phase=Phase.LLAMA),
    "d": LlamaVariant(description="OffloadAdamW(offload_gradients=True), bf16 params", short="offload, freed",
                      phase=Phase.TARGETS, options={"offload_gradients": True}, keep_trace=True),
    "e": LlamaVariant(description="OffloadAdamW(offload_gradients=True, update_in_backward=True), bf16 params",
                      short="freed, in backward", phase=Phase.TARGETS,
                      options={"offload_gradients": True, "update_in_backward": True}),
    "f": LlamaVariant(description="OffloadAdamW(offload_gradients=True, update_in_backward=True, max_grad_norm=1.0), "
                                  "bf16 params", short="freed, in backward, clipped", phase=Phase.TARGETS,
                      options={"offload_gradients": True, "update_in_backward": True, "max_grad_norm": 1.0}),
    "g": LlamaVariant(description="OffloadAdamW(update_on='stream'), bf16 params: float32 master and moments in pinned "
                                  "host memory, streamed through a ring of device buffers and updated on the GPU",
                      short="streamed", phase=Phase.TARGETS, placement="stream"),
    "h": LlamaVariant(description="OffloadAdamW, bf16 params: the first half of the decoder layers resident "
                                  "(update_on='device'), the second half streamed, embeddings, norm and head on the host",
                      short="mixed placement", phase=Phase.TARGETS, placement="mixed"),
}


def _placement_groups(model: Any, placement: str) -> list[dict]:
    """The param_groups of a row's placement (LlamaVariant.placement)."""
    if placement == "stream":
        return [{"params": list(model.parameters()), "update_on": "stream"}]
    layers = model.model.layers
    resident = [p for layer in layers[:len(layers) // 2] for p in layer.parameters()]
    streamed = [p for layer in layers[len(layers) // 2:] for p in layer.parameters()]
    placed = {id(p) for p in resident + streamed}
    rest = [p for p in model.parameters() if id(p) not in placed]
    groups = [{"params": resident, "update_on": "device"}, {"params": streamed, "update_on": "stream"},
              {"params": rest, "update_on": "host"}]
    return [g for g in groups if g["params"]]


def _placement_parity(ctx: Context, opt: Any, forward_backward: Callable[[int], None], steps: int) -> dict:
    """``steps`` more steps of ``opt`` beside torch.optim.AdamW(fused=True) on float32 copies of its masters and
    moments, on the device for streamed and resident groups and in host memory for host ones, fed the same
    (upcast) gradients: parameters, masters and moments bitwise after each step."""
    import torch

    from offload_adamw.benchmarking.bitwise import same_bits

    copies: dict[Any, Any] = {}
    references = []
    for group in opt.param_groups:
        where = "cpu" if group["update_on"] == "host" else ctx.device
        hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")}
        group_copies = []
        for p in group["params"]:
            copies[p] = torch.nn.Parameter(opt.master_value(p).detach().to(where, torch.float32, copy=True))
            group_copies.append(copies[p])
        reference = torch.optim.AdamW([{"params": group_copies, **hyper}], fused=True)
        for p in group["params"]:
            state = opt.state[p]
            reference.state[copies[p]] = {key: state[key].detach().to(where, torch.float32, copy=True)
                                          for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq") if key in state}
        references.append(reference)
    mismatches: list[str] = []
    for i in range(steps):
        forward_backward(i)
        for p, c in copies.items():
            c.grad = p.grad.detach().to(c.device, torch.float32, copy=True)
        opt.step()
        for reference in references:
            reference.step()
        opt.zero_grad(set_to_none=True)
        ctx.sync()
        for index, (p, c) in enumerate(copies.items()):
            if not same_bits(p.detach(), c.detach().to(p.device, p.dtype)):
                mismatches.append(f"step {i} param {index}")
            if not same_bits(opt.master_value(p).detach().cpu(), c.detach().cpu()):
                mismatches.append(f"step {i} master {index}")
            theirs = next(r.state[c] for r in references if c in r.state)
            if not same_bits(opt.state[p]["exp_avg_sq"].cpu(), theirs["exp_avg_sq"].cpu()):
                mismatches.append(f"step {i} exp_avg_sq {index}")
    return {"bitwise": not mismatches, "steps": steps, "mismatch_count": len(mismatches), "mismatches": mismatches[:20],
            "reference": f"torch.optim.AdamW(fused=True) on float32 masters ({ctx.device} for streamed and resident "
                         "groups, host memory for host groups)"}


def sections(sizes: Sizes) -> tuple[Section, ...]:
    parity_rows = []
    for name, case in PARITY_CASES.items():
        compiled, fsdp = case[6], case[7]
        parity_rows.append(Row(name=name, limit_s=180.0 if compiled else 90.0 if fsdp else 60.0,
                               phase=Phase.LAST if compiled else Phase.PARITY, needs_compile=compiled, run=parity_row,
                               args={"case": name}))
    # a checkpoint in a process that ran device steps: a load that fails there loses a user's run
    parity_rows.insert(0, Row(name="bf16-freed-checkpoint-resume", limit_s=60.0, phase=Phase.PARITY, run=checkpoint_row))
    for name in FSDP_OVERLAP_CASES:
        # A few seconds on the GPU; the limit is what a worker thread that never finishes may cost the run.
        parity_rows.append(Row(name=name, limit_s=45.0, phase=Phase.PARITY, run=fsdp_overlap_row, args={"case": name}))
    return (
        Section(name="gpu_tests", command=True, rows=(
            Row(name="pytest -m gpu", limit_s=150.0, phase=Phase.GPU_TESTS, needs_cuda=True),
        )),
        Section(name="llama", fresh_process=True, rows=tuple(
            Row(name=key, limit_s=110.0, phase=variant.phase, run=llama_row, args={"variant": key})
            for key, variant in LLAMA_VARIANTS.items()
        )),
        Section(name="parity", rows=tuple(parity_rows)),
        Section(name="pcie", rows=(
            Row(name="pinned-peak", limit_s=60.0, phase=Phase.LINKS_AND_HOST, needs_cuda=True, run=pcie_row,
                args={"kind": "peak"}),
            Row(name="per-tensor-1b-shapes", limit_s=60.0, phase=Phase.LINKS_AND_HOST, needs_cuda=True, run=pcie_row,
                args={"kind": "per-tensor"}),
        )),
        Section(name="host", rows=(
            Row(name="triad", limit_s=40.0, phase=Phase.LINKS_AND_HOST, run=host_triad),
            *(Row(name=f"threads-{n}", limit_s=60.0, phase=Phase.LINKS_AND_HOST, run=host_threads, args={"threads": n})
              for n in sizes.host_threads),
        )),
    )


def run_order(sections: tuple[Section, ...]) -> list[tuple[Section, Row]]:
    """Every row of ``sections`` in the order the run takes them: by :class:`Phase`, then as declared."""
    return sorted(((section, row) for section in sections for row in section.rows), key=lambda item: item[1].phase)

SELFTEST_ENV = "GPU_RUN_SELFTEST"


def all_sections(sizes: Sizes) -> tuple[Section, ...]:
    """The run's sections; with GPU_RUN_SELFTEST=1 first a section that checks the driver's own limits."""
    if os.environ.get(SELFTEST_ENV) != "1":
        return sections(sizes)
    selftest = Section(name="selftest", rows=(
        Row(name="hangs", limit_s=float(os.environ.get("GPU_RUN_SELFTEST_LIMIT", "3")), phase=Phase.SELFTEST,
            run=selftest_row),
        Row(name="crashes", limit_s=30.0, phase=Phase.SELFTEST, run=selftest_row),
        Row(name="after", limit_s=30.0, phase=Phase.SELFTEST, run=selftest_row),
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


def parity_row(ctx: Context, row: Row) -> dict:
    """OffloadAdamW against torch AdamW(fused=True) on host float32 copies, the same user calls on both sides."""
    case = row.args["case"]
    import torch

    from offload_adamw import OffloadAdamW, OffloadGradScaler, is_host_resident
    from offload_adamw.accel.clipping import clip_gradients_
    from offload_adamw.benchmarking.bitwise import max_abs_difference, same_bits

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
                same_bits(_full(opt_a.gradient(pa)), gb) for pa, gb in zip(params_a, live_b)
            )
        if scaler:
            for p in params_b:  # float32 parameters: the copies take the gradients unchanged
                copies[p].grad = p.grad.detach().to("cpu", torch.float32, copy=True)
            scaler_a.unscale_(opt_a)
            scaler_b.unscale_(ref_opt)
            if clip:
                norm_a = opt_a.clip_grad_norm_(clip_norm)
                norm_b = torch.nn.utils.clip_grad_norm_([copies[p] for p in params_b], clip_norm)
                norms_equal &= same_bits(_full(norm_a).float(), norm_b.float())
            scaler_a.step(opt_a)
            scaler_a.update()
            scaler_b.step(ref_opt)
            scaler_b.update()
            scales_equal &= scaler_a.get_scale() == scaler_b.get_scale()
        else:
            if clip:
                norm_a = opt_a.clip_grad_norm_(clip_norm)
                norm_b = clip_gradients_(live_b, clip_norm)  # torch's get_total_norm and clip_grads_with_norm_
                norms_equal &= same_bits(_full(norm_a).float(), norm_b.float())
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
        if not same_bits(whole, pb):
            mismatches.append(f"param {index}")
            worst = max(worst, max_abs_difference(whole, pb))
        sa, sb = opt_a.state.get(pa, {}), ref_opt.state.get(copies[pb], {})
        if bool(sa) != bool(sb):
            mismatches.append(f"state presence {index}")
            continue
        for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in sb and not same_bits(_full(sa[key]), sb[key]):
                mismatches.append(f"{key} {index}")
        if not same_bits(_full(opt_a.master_param(pa)).cpu(), copies[pb]):
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


def checkpoint_row(ctx: Context, row: Row) -> dict:
    """offload_adamw.checkpoint after device steps: saved mid-run, loaded into a fresh model, optimizer and
    scheduler, both runs continue bitwise alike, and the RNG states (the device's too) come back.

    The parity Llama in bf16 with freed gradients (the transfer pipeline; on the CPU rehearsal its CPU
    mode), two parameter groups and a LambdaLR schedule. Between the save and the load the RNG is moved
    on, so that only the load can bring it back.
    """
    import torch

    from offload_adamw import OffloadAdamW, checkpoint
    from offload_adamw.benchmarking.bitwise import same_bits

    sizes, dev = ctx.sizes, ctx.device
    _deterministic(dev)
    before_save, after_load = max(2, sizes.parity_steps // 2), 2
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, sizes.parity_vocab, (2, sizes.parity_seq), generator=gen)
               for _ in range(before_save + after_load)]

    def build(seed: int) -> tuple[Any, Any, Any]:
        model = _parity_llama(sizes, seed=seed).to(device=dev, dtype=torch.bfloat16)
        opt = OffloadAdamW(_groups(model, False), offload_gradients=True, transfer_pipeline=True)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + t))

    def train(run: tuple[Any, Any, Any], ids: Any) -> None:
        model, opt, sched = run
        ids = ids.to(dev)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    original = build(0)
    for ids in batches[:before_save]:
        train(original, ids)
    ctx.sync()
    rng_cpu = torch.get_rng_state()
    rng_device = torch.cuda.get_rng_state() if dev == "cuda" else None
    with tempfile.TemporaryDirectory(dir=ctx.outdir) as tmp:
        path = checkpoint.save(Path(tmp) / "checkpoint", *original, step=before_save)
        saved_files = sorted(p.name for p in path.iterdir())
        torch.manual_seed(12345)  # moves the CPU and the device generators on
        restored = build(1)
        report = checkpoint.load(path, *restored)
    rng_back = torch.equal(torch.get_rng_state(), rng_cpu) and (
        rng_device is None or torch.equal(torch.cuda.get_rng_state(), rng_device))
    for ids in batches[before_save:]:
        train(original, ids)
        train(restored, ids)
    ctx.sync()
    mismatches: list[str] = []
    opt_a, opt_b = original[1], restored[1]
    params_a = [p for g in opt_a.param_groups for p in g["params"]]
    params_b = [p for g in opt_b.param_groups for p in g["params"]]
    for index, (pa, pb) in enumerate(zip(params_a, params_b)):
        if not same_bits(pa, pb):
            mismatches.append(f"param {index}")
        if not same_bits(opt_a.master_param(pa), opt_b.master_param(pb)):
            mismatches.append(f"master {index}")
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        for key in ("step", "exp_avg", "exp_avg_sq"):
            if key in sa and not (key in sb and same_bits(sa[key], sb[key])):
                mismatches.append(f"{key} {index}")
    same_schedule = original[2].get_last_lr() == restored[2].get_last_lr()
    ok = not mismatches and rng_back and same_schedule and not report.problems
    return {
        "status": "ok" if ok else "failed",
        "device": dev,
        "steps_before_save": before_save,
        "steps_after_load": after_load,
        "saved_files": saved_files,
        "load_problems": report.problems,
        "optimizer_restored": report.optimizer_restored,
        "continuation_bitwise": not mismatches,
        "mismatches": mismatches[:20],
        "mismatch_count": len(mismatches),
        "rng_restored": rng_back,
        "device_rng_saved": rng_device is not None,
        "schedule_restored": same_schedule,
    }


def _shard(t):
    """A DTensor's local shard (world size 1: all of it), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def fsdp_overlap_row(ctx: Context, row: Row) -> dict:
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
    from offload_adamw.benchmarking.bitwise import max_abs_difference, same_bits

    dtype_name, accumulate, clip = FSDP_OVERLAP_CASES[row.args["case"]]
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
                same_bits(_shard(opt_a.gradient(pa)), _shard(pb.grad)) for pa, pb in zip(params_a, params_b)
            )
        if clip_norm is not None:
            norm_b = torch.nn.utils.clip_grad_norm_(params_b, clip_norm)
        for p in params_b:
            copies[p].grad = _shard(p.grad).detach().to("cpu", torch.float32, copy=True)
        opt_a.step()
        ref_opt.step()
        if clip_norm is not None:
            norms_equal &= opt_a.last_grad_norm is not None and same_bits(
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
        if not same_bits(shard_a, shard_b):
            mismatches.append(f"param {index}")
            worst = max(worst, max_abs_difference(shard_a, shard_b))
        sa, sb = opt_a.state.get(pa, {}), ref_opt.state.get(copies[pb], {})
        if bool(sa) != bool(sb):
            mismatches.append(f"state presence {index}")
            continue
        for key in ("step", "exp_avg", "exp_avg_sq"):
            if key in sb and not same_bits(_shard(sa[key]), sb[key]):
                mismatches.append(f"{key} {index}")
        if not same_bits(_shard(opt_a.master_param(pa)).cpu(), copies[pb]):
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


def llama_row(ctx: Context, row: Row) -> dict:
    """One optimizer set-up on the ~1B model: forward+backward alone, then full steps; time and peak memory."""
    import torch

    from offload_adamw import OffloadAdamW

    sizes, dev = ctx.sizes, ctx.device
    key = row.args["variant"]
    variant = LLAMA_VARIANTS[key]
    model = _llama(sizes, dev, getattr(torch, variant.param_dtype))
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, sizes.llama_vocab, (sizes.llama_batch, sizes.llama_seq), generator=gen).to(dev)
               for _ in range(4)]
    autocast = variant.autocast

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

    opt: Any
    if variant.torch_adamw:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    elif variant.placement is not None:
        opt = OffloadAdamW(_placement_groups(model, variant.placement), lr=1e-4, weight_decay=0.1, **variant.options)
    else:
        opt = OffloadAdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **variant.options)

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
        "variant": variant.description,
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
        from offload_adamw.benchmarking.placement import traffic

        out["host_state_bytes"] = opt.host_state_bytes()
        out["pinned_bytes"] = opt.pinned_bytes()
        out["device_buffer_bytes"] = opt.device_buffer_bytes()
        out.update(traffic(opt))  # PCIe bytes of one step (counted from the state held), host-memory bytes
        if variant.placement is not None:
            out["placements"] = [g["update_on"] for g in opt.param_groups]
            forward_backward(0)
            step_only = timed(sizes.llama_timed, lambda i: opt.step())  # the same gradients, stepped again
            opt.zero_grad(set_to_none=True)
            out["optimizer_step_s_median"] = statistics.median(step_only)
            out["pcie_GBps_achieved"] = out["transfer_bytes_per_step"] / statistics.median(step_only) / 1e9
            ctx.partial(out)
            out["parity"] = _placement_parity(ctx, opt, forward_backward, variant.parity_steps)
            if not out["parity"]["bitwise"]:
                out["status"] = "failed"
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
                    ctx, forward_backward, opt, keep_trace=f"llama-{key}" if variant.keep_trace else None
                )
            except Exception:  # the timed figures stand without it
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


def pcie_row(ctx: Context, row: Row) -> dict:
    """Pinned host <-> device copies: one large copy (``kind`` peak) or the ~1B model's tensors one by one."""
    import torch

    kind = row.args["kind"]
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


def host_triad(ctx: Context, row: Row) -> dict:
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


def host_threads(ctx: Context, row: Row) -> dict:
    """The host-step cases at ``threads`` torch threads, timed as ``offload-adamw bench`` times them (rotated)."""
    import torch

    from offload_adamw.benchmarking.timing import summary, time_rotated

    threads = row.args["threads"]
    work = _host_workload(ctx)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        samples, _ = time_rotated(work["cases"], ctx.sizes.host_warmup, ctx.sizes.host_repeats, f"{threads} thread(s)")
    finally:
        torch.set_num_threads(previous)
    n = work["elements"]
    cases = {}
    for name, times in samples.items():
        figures = summary(times, n)
        cases[name] = {"ms_per_step": figures["ms_per_step"], "ms_all": figures["ms_all"],
                       "GBps_at_28B": figures["effective_gbps"]}
    return {"status": "ok", "threads": threads, "elements": n, "tensors": work["tensors"], "cases": cases}
