"""The mixed-precision host AdamW step: one pass over memory per element.

Contract:

* :func:`blocked_adamw_` computes exactly what the parity definition of the
  project computes (docs/contract.md#state-precision, kernels/adamw.py): torch's fused CPU AdamW
  on the float32 (float64) masters fed the exactly widened gradients, then the
  round-to-nearest cast into the model dtype. Results are bitwise equal to that
  definition; only the order in which memory is visited changes.
* Elements pair by index whatever the strides: each tensor's master, gradient,
  moments and model copy are first brought to one dense layout (kernels/layout.py:
  no copy where they share it, as the state shares its parameter's).
* Tensors without a cast (float32 or float64 gradient and master, no model
  copy) go to torch's fused op unchanged, one call per dtype.
* A mixed tensor (bf16/fp16 gradient or model copy, float32 master), as its
  memory-order flat view, is updated up to its last multiple of 64 elements by the numba loop
  (numba_loop.py, the default: casts and update in one loop, self-tested bit for
  bit before first use). The rest of it, and every mixed tensor that loop
  declines (numba missing, a failed self-test, float64 masters), goes through
  the chunk loop, the portable fallback: in chunks of ``chunk_elements``
  elements the gradient chunk is widened into a reusable float32 buffer, the
  fused op runs on chunk views of master/m/v, and the chunk of the model copy is
  written, all while the chunk is still in cache. The naive way (widen the whole
  gradient, step, narrow the whole master) reads and writes every array a second
  time and allocates a full-size temporary.
* No temporary larger than one chunk per worker thread; buffers are cached per
  (thread, dtype) and reused across calls. Both loops run on the same worker
  threads, ``torch.get_num_threads()`` of them (read at each call).

Why chunk boundaries are multiples of 64 elements: torch's fused CPU kernel
splits each call into cache-line units (16 float32 or 8 float64 elements) over
its threads, runs a SIMD loop over each thread's range and a scalar loop over
the range's last ``len % vector_width`` elements (vector width <= 16 float32 on
AVX-512). With chunk boundaries on multiples of 64 every element is computed by
the same kind of loop as in one call over the whole tensor (only the tensor's
last ``numel % 16`` elements take the scalar tail, in both cases), so the
arithmetic, and hence every bit, is the same.

The step count is read-only inside the fused op (it reads ``step`` to form the
bias corrections), so it is incremented once per tensor before the first chunk
and every chunk of that tensor sees the same count.

Threading and the chunk loop: by default ``torch.get_num_threads()`` Python
worker threads each take jobs (batches of the numba loop, then batches of
consecutive chunks) from a shared queue and run torch single-threaded in them. Each batch runs through one call of
:func:`_chunk_loop`, compiled once per process with TorchScript, whose
interpreter holds no GIL: the two workers never wait for each other between a
chunk's three operations. Run as Python, every operation releases and retakes
the GIL, and on a virtual machine a thread that sleeps on the GIL costs a
wake-up of tens of microseconds each time the other holds it. TorchScript is an
interpreter of torch's IR (no compiler); it needs this file's source and is
deprecated upstream, so any failure falls back to the same loop in Python
(:func:`chunk_loop_status` says which runs, why, and the one-off compile time:
0.04 to 0.07 s measured).

Measured for the chunk loop on a quiet 2-core Ice Lake Xeon VM (AVX-512, no avx512_bf16),
64 Mi bf16 elements in a transformer's shapes, medians of 7 to 11 interleaved
steps, an in-place triad over the same arrays at 20.6 to 23 ms:

* Python loop (512 Ki chunks, the previous default) 73 to 81 ms/step; TorchScript
  loop 68 to 72 ms (128 Ki chunks). Chunk size with the TorchScript loop: 64 Ki
  71.4, 96 Ki 68.5, 128 Ki 68.2, 192 Ki 69.6, 256 Ki 70 to 73, 512 Ki 70 to 77,
  1 Mi 82 ms. Narrowing in reverse-ordered pieces (to read the master chunk from
  the most recently used end) measured 1 to 4 ms slower and was dropped; so was
  folding the narrowing of one chunk and the widening of the next into one
  ``_foreach_copy_`` (no gain).
* What a step is made of (2 workers, 128 Ki chunks): the fused op alone on chunk
  views (gradient in the cache-resident buffer) 41.6 ms, which is the memory
  bandwidth of both cores (38.7 GB/s for its 24 bytes/element, the in-place
  triad's); the widening adds 10.6 ms and the narrowing 16.5 ms (0.33 and 0.52
  ns/element/core, against 0.20 and 0.21 in cache: the bf16 gradient read and the
  read-for-ownership plus write-back of the bf16 copy stall a core that cannot
  keep enough misses in flight, one core streams only about 21 GB/s). The three
  add up (67.5 ms) because the casts are compute plus latency-bound traffic that
  does not overlap with the other core's streaming.
* ``threads=0`` (torch's intra-op threads splitting each operation) pays an
  OpenMP fork/join per operation, ruinous at small chunks on this VM: 195 ms at
  128 Ki, 116 ms at 512 Ki, 97 ms at 1 Mi. Under load (load average 8, an earlier
  measurement) it was also 25 to 30 percent slower than the workers, because a
  barrier waits for a descheduled thread while a queue gives the other worker
  more batches.

Worker threads set their own OpenMP team size to 1 once; the process-wide
setting is restored right after.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offload_adamw.kernels import layout, numba_loop
from offload_adamw.kernels.edits import take_model_edits_

__all__ = ["BlockConfig", "DEFAULT_CONFIG", "CHUNK_ALIGN", "blocked_adamw_", "naive_mixed_adamw_", "chunk_loop_status"]

#: chunk boundaries are multiples of this many elements (see the module docstring).
CHUNK_ALIGN = 64
# Work distribution among worker threads: at least this many batches per worker ...
_BATCHES_PER_WORKER = 4
# ... of at most this many chunks each.
_MAX_BATCH_CHUNKS = 16


@dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """How the blocked kernel walks memory."""

    chunk_elements: int = 128 * 1024
    """Elements per chunk of a mixed-dtype tensor (rounded down to a multiple of 64).
    Between a chunk's three operations the float32 gradient buffer and the master,
    m and v chunks pass through the core's L2: 16 bytes per element, 2 MiB at 128 Ki.
    Measured (module docstring): with the TorchScript loop and 2 workers 128 Ki is
    the optimum (64 Ki +5 percent, 512 Ki +3 to +10, 1 Mi +20); with the Python loop
    larger chunks (512 Ki to 1 Mi) were better because each chunk's GIL hand-offs
    then count less."""
    scripted: bool = True
    """Run each worker's chunk loop as TorchScript (no GIL between a chunk's operations);
    False, or where TorchScript is unavailable, the same loop runs as Python."""
    threads: int = -1
    """-1: as many Python worker threads as ``torch.get_num_threads()`` (read at each call),
    each running whole chunks with torch single-threaded; 0: no workers, torch's intra-op
    threads split each chunk's three operations; N >= 1: N Python worker threads."""
    cpus: frozenset[int] | None = None
    """The cores the worker threads run on (their affinity: a NUMA node's, distributed/node.py), the calling
    thread then taking no batches (it may run elsewhere); None: wherever the OS puts them."""
    numba_loop: bool = True
    """Run the first ``n - n % 64`` elements of each mixed tensor through the one loop compiled
    by numba (numba_loop.py): the same bits, checked by a self-test before first use, one pass
    over memory with the casts inside the loop. Where numba is missing or a variant fails its
    self-test, the chunk loop runs instead (one warning); False: always the chunk loop."""


DEFAULT_CONFIG = BlockConfig()

# Per-thread float32/float64 chunk buffers: the only temporaries of the kernel.
_local = threading.local()


def _chunk_buffer(dtype: torch.dtype, elements: int) -> Tensor:
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < elements:
        buf = buffers[dtype] = torch.empty(elements, dtype=dtype)
    return buf


def _fused_kwargs(hp: Any) -> dict[str, Any]:
    return dict(
        lr=hp.lr,
        beta1=hp.beta1,
        beta2=hp.beta2,
        weight_decay=hp.weight_decay,
        eps=hp.eps,
        amsgrad=hp.amsgrad,
        maximize=hp.maximize,
    )


def _is_blockable(i: int, masters: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                  exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor],
                  model_params: Sequence[Tensor | None] | None, amsgrad: bool) -> bool:
    out = model_params[i] if model_params is not None else None
    return (masters[i].is_cpu and grads[i].is_cpu and exp_avgs[i].is_cpu and exp_avg_sqs[i].is_cpu
            and (not amsgrad or max_exp_avg_sqs[i].is_cpu) and (out is None or out.is_cpu))


def _chunk_loop(
    masters: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    outs: list[Tensor | None],
    follow: list[bool],
    tensor_index: list[int],
    starts: list[int],
    stops: list[int],
    buffer: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
) -> list[Tensor]:
    """Chunks k = 0..: take the model copy's edits (where ``follow[i]``) -> widen grad -> fused step on
    master/m/v views -> narrow into the model copy.

    Tensors are flat; chunk k is ``[starts[k], stops[k])`` of tensor ``tensor_index[k]``;
    ``buffer`` (the master dtype, at least one chunk long) receives the widened gradient.
    Written in the subset of Python that TorchScript compiles (see :func:`_loop_function`).
    Returns the last chunk's master view: TorchScript drops a call whose effects nothing
    reads, and the fused op's effects are on list elements, so they are made to be read.
    """
    empty: list[Tensor] = []
    last: list[Tensor] = empty
    for k in range(len(tensor_index)):
        i = tensor_index[k]
        a = starts[k]
        b = stops[k]
        theta = [masters[i][a:b]]
        out = outs[i]
        if out is not None and follow[i]:
            take_model_edits_(theta[0], out[a:b])  # the update starts from the edited parameter
        g = grads[i][a:b]
        if g.dtype != buffer.dtype:
            widened = buffer[: b - a]
            widened.copy_(g)  # exact widening
            g = widened
        torch._fused_adamw_(
            theta,
            [g],
            [exp_avgs[i][a:b]],
            [exp_avg_sqs[i][a:b]],
            [max_exp_avg_sqs[i][a:b]] if amsgrad else empty,
            [steps[i]],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=amsgrad,
            maximize=maximize,
        )
        if out is not None:
            out[a:b].copy_(theta[0])  # round to nearest even
        last = theta
    return last


_script_lock = threading.Lock()
_script_state: dict[str, Any] = {}


def _self_test(fn: Callable[..., Any]) -> bool:
    """Does ``fn`` compute the Python loop's bits (widen, no model copy, amsgrad, model copy, edits taken)?"""
    gen = torch.Generator().manual_seed(0)
    results: list[list[Tensor | None]] = []
    for loop in (_chunk_loop, fn):
        n = 3 * CHUNK_ALIGN + 5
        master = [torch.randn(n, generator=gen) for _ in range(2)]
        grads = [torch.randn(n, generator=gen).to(torch.bfloat16), torch.randn(n, generator=gen)]
        m = [torch.zeros(n), torch.zeros(n)]
        v = [torch.zeros(n), torch.zeros(n)]
        mv = [torch.zeros(n), torch.zeros(n)]
        steps = [torch.ones(()), torch.ones(())]
        outs: list[Tensor | None] = [None, master[1].to(torch.bfloat16)]
        chunks = [(i, a, min(a + 2 * CHUNK_ALIGN, n)) for i in (0, 1) for a in range(0, n, 2 * CHUNK_ALIGN)]
        for amsgrad in (False, True):
            edits = outs[1]
            assert edits is not None
            edits[::7] = 0.25  # an edit of the parameter between two updates
            loop(master, grads, m, v, mv, steps, outs, [False, True], [c[0] for c in chunks], [c[1] for c in chunks],
                 [c[2] for c in chunks], torch.empty(2 * CHUNK_ALIGN), 1e-2, 0.9, 0.99, 0.1, 1e-8, amsgrad, False)
        results.append([*master, *m, *v, *mv, outs[1]])
        gen.manual_seed(0)
    return all(torch.equal(x, y) for x, y in zip(*results))


def _loop_function(scripted: bool) -> Callable[..., Any]:
    """The chunk loop: TorchScript-compiled once per process when possible, else the Python function.

    Why TorchScript: its interpreter runs the whole loop without the GIL, so two worker
    threads never wait for each other between a chunk's three operations (measured
    below). It is an interpreter of torch's own IR, no compiler is involved; it needs
    the module's source file and is deprecated upstream, so any failure to compile, or
    a compiled loop that does not reproduce the Python loop's bits on a small self-test,
    falls back to the Python loop, and the reason is kept (:func:`chunk_loop_status`).
    """
    if not scripted:
        return _chunk_loop
    with _script_lock:
        if "loop" not in _script_state:
            start = time.perf_counter()
            loop, reason = _chunk_loop, None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # TorchScript's deprecation notice
                    compiled = torch.jit.script(_chunk_loop)
                if not isinstance(compiled, torch.jit.ScriptFunction):
                    reason = "TorchScript is disabled (PYTORCH_JIT=0)"
                elif "aten::_fused_adamw_" not in str(compiled.graph):
                    reason = "TorchScript dropped the fused AdamW call"
                elif not _self_test(compiled):
                    reason = "the compiled loop did not reproduce the Python loop's bits"
                else:
                    loop = compiled
            except Exception as exc:  # no source file, TorchScript removed or broken: Python loop
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            _script_state.update(loop=loop, seconds=time.perf_counter() - start, fallback_reason=reason)
        loop_function: Callable[..., Any] = _script_state["loop"]
        return loop_function


def chunk_loop_status() -> dict[str, Any]:
    """How the chunk loop runs in this process: ``scripted`` (bool), ``compile_seconds``
    (the one-off TorchScript compilation and self-test), ``fallback_reason`` (None when scripted)."""
    _loop_function(True)
    return {
        "scripted": _script_state["loop"] is not _chunk_loop,
        "compile_seconds": _script_state["seconds"],
        "fallback_reason": _script_state["fallback_reason"],
    }


_pools: dict[tuple[int, frozenset[int] | None], ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def _forget_pools_after_fork() -> None:
    # A forked child (e.g. a DataLoader worker) inherits the pool objects but not their
    # threads: submitting to one would wait forever. The child builds its own on demand.
    global _pools, _pool_lock
    _pools, _pool_lock = {}, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_after_fork)


def _single_threaded_worker_init() -> None:
    # at::set_num_threads sets this OS thread's OpenMP team size; the caller
    # restores the process-wide value afterwards (see _get_pool). Torch's first
    # parallel call in a thread (get_num_threads is one) sets that thread's team size
    # to the process-wide value, once per thread (ATen's lazy_init_num_threads), so it
    # must come before our 1: made after it, that first chunk operation undid the 1, and
    # every worker ran its chunk operations on an OpenMP team of its own (a fork/join per
    # operation, and libgomp threads beyond the cores, which shortens every team's
    # spin-wait, torch's own included).
    torch.get_num_threads()
    torch.set_num_threads(1)


def _get_pool(size: int, cpus: frozenset[int] | None = None) -> ThreadPoolExecutor:
    """The pool of ``size`` workers on ``cpus``, made once per size and cores and kept: two optimizers stepping
    from two threads under different thread counts never shut down a pool the other is using."""
    with _pool_lock:
        pool = _pools.get((size, cpus))
        if pool is None:
            before = torch.get_num_threads()
            pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="offload-adamw")
            barrier = threading.Barrier(size)

            def init() -> None:
                _single_threaded_worker_init()
                if cpus is not None:
                    os.sched_setaffinity(0, cpus)  # on Linux, this thread's own affinity
                barrier.wait()  # every worker runs init exactly once

            for f in [pool.submit(init) for _ in range(size)]:
                f.result()
            torch.set_num_threads(before)  # workers keep 1, the process keeps its setting
            _pools[(size, cpus)] = pool
        return pool


def blocked_adamw_(
    masters: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    model_params: Sequence[Tensor | None] | None,
    hp: Any,
    *,
    config: BlockConfig = DEFAULT_CONFIG,
    take_model_edits: Sequence[bool] | None = None,
    threads: int | None = None,
    cpus: frozenset[int] | None = None,
) -> None:
    """One AdamW update of every tensor, bitwise equal to the parity definition (see module docstring).

    Elements pair by index whatever the strides (kernels/layout.py): each tensor's operands are
    brought to its master's layout first, without a copy where they share it already. Where
    ``take_model_edits[i]``, the model copy holds the parameter's current value and its edited
    elements replace their masters before the update (kernels/edits.py). ``threads`` and ``cpus``, where
    given, replace ``config.threads`` and ``config.cpus`` (the optimizer's ``host_threads`` and NUMA node).
    """
    n = len(masters)
    follow = [bool(f) for f in take_model_edits] if take_model_edits is not None else [False] * n
    outs: list[Tensor | None] | None = list(model_params) if model_params is not None else None
    column: list[list[Any]] = [list(masters), list(grads), list(exp_avgs), list(exp_avg_sqs),
                               list(max_exp_avg_sqs) if hp.amsgrad else [None] * n]
    aligned: list[layout.Aligned] = []
    for i in range(n):
        # Row-major operands (a row-major parameter's state, autograd's gradient of it) already pair by index:
        # layout.align would hand them back unchanged. Asked here, without building its operand lists, because a
        # step of many small tensors pays this per tensor (benchmarks/fixed_cost.py).
        out = outs[i] if outs is not None else None
        if (column[0][i].is_contiguous() and column[1][i].is_contiguous() and column[2][i].is_contiguous()
                and column[3][i].is_contiguous() and (not hp.amsgrad or column[4][i].is_contiguous())
                and (out is None or out.is_contiguous())):
            continue
        a = layout.align([c[i] for c in column] + [out], read=(True, True, True, True, True, follow[i]),
                         written=(True, False, True, True, True, True))
        for k, c in enumerate(column):
            c[i] = a.tensors[k]
        if outs is not None:
            outs[i] = a.tensors[5]
        aligned.append(a)
    _aligned_adamw_(column[0], column[1], column[2], column[3], column[4] if hp.amsgrad else [], list(steps), outs,
                    follow, hp, _with_workers(config, threads, cpus))
    for a in aligned:
        a.write_back()


@functools.lru_cache(maxsize=64)
def _with_workers(config: BlockConfig, threads: int | None, cpus: frozenset[int] | None) -> BlockConfig:
    """``config`` with ``threads`` and ``cpus`` where given (made once per combination, not at every step)."""
    if (threads is None or threads == config.threads) and (cpus is None or cpus == config.cpus):
        return config
    return dataclasses.replace(config, threads=config.threads if threads is None else threads,
                               cpus=config.cpus if cpus is None else cpus)


def _aligned_adamw_(
    masters: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    model_params: list[Tensor | None] | None,
    follow: list[bool],
    hp: Any,
    config: BlockConfig,
) -> None:
    """:func:`blocked_adamw_` on operands that share one dense layout per tensor."""
    kwargs = _fused_kwargs(hp)
    chunk = max(CHUNK_ALIGN, config.chunk_elements // CHUNK_ALIGN * CHUNK_ALIGN)
    # Tensors that need no cast go to one fused call per dtype (exactly what torch's
    # fused AdamW does); mixed host tensors are blocked; the rest (empty or off the host)
    # take the simple three-pass way.
    plain: dict[torch.dtype, list[int]] = {}
    blocked: list[int] = []
    simple: list[int] = []
    for i, theta in enumerate(masters):
        out = model_params[i] if model_params is not None else None
        mixed = grads[i].dtype != theta.dtype or out is not None
        if not mixed:
            plain.setdefault(theta.dtype, []).append(i)
        elif theta.numel() > 0 and _is_blockable(
            i, masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, hp.amsgrad
        ):
            blocked.append(i)
        else:
            simple.append(i)

    torch._foreach_add_(steps, 1)

    if len(plain) == 1 and not blocked and not simple:
        # Every tensor plain and of one dtype (float32 host parameters, their own masters): the one fused call,
        # over the lists as they are (the per-tensor work of the general case below is fixed cost per step).
        torch._fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if hp.amsgrad else [], steps,
                            **kwargs)
        return

    for idx in plain.values():
        torch._fused_adamw_(
            [masters[i] for i in idx],
            [grads[i] for i in idx],
            [exp_avgs[i] for i in idx],
            [exp_avg_sqs[i] for i in idx],
            [max_exp_avg_sqs[i] for i in idx] if hp.amsgrad else [],
            [steps[i] for i in idx],
            **kwargs,
        )

    for i in simple:
        theta = masters[i]
        out = model_params[i] if model_params is not None else None
        if out is not None and follow[i]:
            take_model_edits_(theta, out)
        torch._fused_adamw_(
            [theta],
            [grads[i] if grads[i].dtype == theta.dtype else grads[i].to(theta.dtype)],
            [exp_avgs[i]],
            [exp_avg_sqs[i]],
            [max_exp_avg_sqs[i]] if hp.amsgrad else [],
            [steps[i]],
            **kwargs,
        )
        if out is not None:
            out.copy_(theta)

    if not blocked:
        return
    threads = torch.get_num_threads() if config.threads < 0 else config.threads
    # The numba loop reads each blocked tensor through raw addresses in memory order (its operands
    # share one dense layout, so the k-th element in memory of each belongs to the same index); the
    # chunk loop below slices memory-order flat views, made only for the tensors it runs.
    steps_list = list(steps)
    outs: list[Tensor | None] = list(model_params) if model_params is not None else [None] * len(masters)
    # The numba loop updates each tensor up to a multiple of 64 elements and says where it
    # stopped; the chunk loop below does the rest (the same bits) and whatever it declines.
    start_at: dict[int, int] = {}
    jobs: list[Callable[[], None]] = []
    if config.numba_loop:
        start_at, jobs = numba_loop.plan(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps_list, outs, hp,
                                         blocked, workers=threads, take_model_edits=follow)
        # The loop writes through raw addresses: tell autograd, as an in-place torch op would, so that
        # a graph that saved a parameter before the step refuses to run backward on the new values.
        done = list(start_at)  # one list per operand: a generator of tuples costs a microsecond a tensor
        written = ([masters[i] for i in done] + [exp_avgs[i] for i in done] + [exp_avg_sqs[i] for i in done]
                   + ([max_exp_avg_sqs[i] for i in done] if hp.amsgrad else [])
                   + [out for out in (outs[i] for i in done) if out is not None])
        if written:
            torch.autograd.graph.increment_version(written)
    rest = [i for i in blocked if start_at.get(i, 0) < masters[i].numel()]
    is_rest = set(rest)

    def flat_views(tensors: Sequence[Tensor | None]) -> list[Any]:
        return [layout.flat(t) if i in is_rest and t is not None else t for i, t in enumerate(tensors)]

    flat: list[list[Any]] = [
        flat_views(masters), flat_views(grads), flat_views(exp_avgs), flat_views(exp_avg_sqs),
        flat_views(max_exp_avg_sqs) if hp.amsgrad else [], steps_list, flat_views(outs),
    ] if rest else []
    loop: Any  # the scripted or the Python loop, called with the unpacked lists below
    lr: float | Tensor
    if isinstance(hp.lr, Tensor):
        # TorchScript's loop takes a float lr; a tensor lr keeps the Python loop, which passes
        # it to the fused op unchanged (torch's own overload for it).
        loop, lr = _chunk_loop, hp.lr
    else:
        loop, lr = _loop_function(config.scripted), float(hp.lr)
    scalars = (lr, float(hp.beta1), float(hp.beta2), float(hp.weight_decay), float(hp.eps),
               bool(hp.amsgrad), bool(hp.maximize))
    # Chunks of tensors with the same master dtype (one buffer dtype per loop call).
    by_dtype: dict[torch.dtype, list[tuple[int, int, int]]] = {}
    for i in rest:
        n = masters[i].numel()
        by_dtype.setdefault(masters[i].dtype, []).extend(
            (i, a, min(a + chunk, n)) for a in range(start_at.get(i, 0), n, chunk)
        )

    def run(dtype: torch.dtype, batch: list[tuple[int, int, int]]) -> None:
        buffer = _chunk_buffer(dtype, chunk)
        loop(*flat, follow, [c[0] for c in batch], [c[1] for c in batch], [c[2] for c in batch], buffer, *scalars)

    cpus = config.cpus
    if threads == 0 or (cpus is None and threads == 1 and torch.get_num_threads() == 1):
        for job in jobs:
            job()
        for dtype, work in by_dtype.items():
            run(dtype, work)
        return

    # Workers pull jobs (numba batches first, then batches of consecutive chunks) from shared
    # iterators (next() on a list iterator is atomic under the GIL), so a worker that the OS
    # deschedules simply does fewer of them; a few batches per worker keep that balance while
    # each loop call covers many chunks. The calling thread takes numba batches too (they run
    # no torch op, so its own intra-op threads never start): one worker fewer to wake per step.
    chunk_jobs: list[Callable[[], None]] = []
    for dtype, work in by_dtype.items():
        size = max(1, min(_MAX_BATCH_CHUNKS, len(work) // (_BATCHES_PER_WORKER * threads)))
        chunk_jobs.extend(functools.partial(run, dtype, work[k : k + size]) for k in range(0, len(work), size))
    if not jobs and not chunk_jobs:
        return
    pending, pending_chunks = iter(jobs), iter(chunk_jobs)

    def drain() -> None:
        for job in pending:
            job()
        for job in pending_chunks:
            job()

    caller_works = cpus is None and not chunk_jobs
    helpers = min(threads, len(jobs) + len(chunk_jobs)) - (1 if caller_works else 0)
    futures = [_get_pool(threads, cpus).submit(drain) for _ in range(helpers)] if helpers > 0 else []
    try:
        if caller_works:
            for job in pending:
                job()
    finally:  # the workers are done with the tensors before the caller sees them again, or an error
        for f in futures:
            f.result()


def naive_mixed_adamw_(masters: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                       exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor],
                       model_params: Sequence[Tensor | None] | None, hp: Any) -> None:
    """The three-pass way (widen every gradient, one fused step, narrow every master): the baseline."""
    kwargs = _fused_kwargs(hp)
    torch._foreach_add_(list(steps), 1)
    torch._fused_adamw_(
        list(masters),
        [g if g.dtype == m.dtype else g.to(m.dtype) for g, m in zip(grads, masters)],
        list(exp_avgs),
        list(exp_avg_sqs),
        list(max_exp_avg_sqs) if hp.amsgrad else [],
        list(steps),
        **kwargs,
    )
    if model_params is not None:
        for out, theta in zip(model_params, masters):
            if out is not None:
                out.copy_(theta)
