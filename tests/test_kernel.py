"""Exactness of the host kernel against torch.optim.AdamW, bit for bit.

Table: tensor layouts (0-dim, 0-element, odd sizes, sizes around the 64-element
alignment and around the chunk size, non-contiguous) x dtypes (float32, float64,
bf16/fp16 mixed) x options (amsgrad, maximize, tensor lr, no weight decay) x
kernel variants (the default fast path: the numba loop and the chunk loop for
tails; the chunk loop alone with small chunks, Python worker threads; the
readable loop). Property: the result equals the parity definition exactly.

Parity definitions (kernels/adamw.py):
* fast path, float32/float64: ``torch.optim.AdamW(fused=True)`` on the same tensors;
* fast path, bf16/fp16 model: that optimizer on float32 copies fed the widened
  gradients, then the round-to-nearest cast;
* ``for_loop``: ``torch.optim.AdamW(foreach=False, fused=False)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from configs import assert_bitwise_equal
from offload_adamw.kernels.adamw import StepHyper, adamw_update_
from offload_adamw.kernels.blocked import CHUNK_ALIGN, BlockConfig, blocked_adamw_, naive_mixed_adamw_

STEPS = 3


@dataclass(frozen=True)
class Layout:
    name: str
    shapes: tuple
    transpose: bool = False  # give every 2-d tensor a transposed (non-contiguous) layout


LAYOUTS = [
    Layout("0-dim", ((),)),
    Layout("0-element", ((0,), (3, 0), (5,))),
    Layout("odd", ((1,), (3,), (17,), (63,), (65,), (7, 13))),
    Layout("align", ((64,), (128,), (191,), (193,), (4096 + 15,))),
    Layout("non-contiguous", ((9, 11), (64, 3), (5,)), transpose=True),
    Layout("mixed-list", ((), (0,), (130,), (33, 7), (1000,))),
]

# Variants of the fast path: the default (the numba loop up to each tensor's last multiple of
# 64 elements, the chunk loop for the rest), the numba loop on two worker threads, and the
# chunk loop alone (the fallback), whose small chunks make every layout above cross chunk
# boundaries (including chunks that are not a power of two and a ragged last chunk).
VARIANTS = {
    "default": None,
    "numba-threads2": BlockConfig(threads=2),
    "chunk64": BlockConfig(chunk_elements=64, numba_loop=False),
    "chunk192": BlockConfig(chunk_elements=192, numba_loop=False),
    "chunk100->64": BlockConfig(chunk_elements=100, numba_loop=False),
    "threads2-chunk128": BlockConfig(chunk_elements=128, threads=2, numba_loop=False),
    "python-loop-threads2-chunk128": BlockConfig(chunk_elements=128, threads=2, scripted=False, numba_loop=False),
}

OPTIONS = {
    "plain": dict(),
    "amsgrad": dict(amsgrad=True),
    "maximize": dict(maximize=True),
    "tensor-lr": dict(lr_tensor=True),
    "no-decay": dict(weight_decay=0.0),
}


def _make(layout: Layout, model_dtype: torch.dtype, seed: int):
    """Initial masters and per-step gradients (in the model dtype, as a training loop hands them over)."""
    gen = torch.Generator().manual_seed(seed)
    master_dtype = torch.float64 if model_dtype == torch.float64 else torch.float32

    def tensor(shape, dtype):
        t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        if layout.transpose and t.dim() == 2:
            t = t.t().contiguous().t()  # same shape, transposed strides
        return t

    masters = [tensor(s, master_dtype) for s in layout.shapes]
    if model_dtype != master_dtype:
        # a low-precision model's master starts as the widened model value
        masters = [m.to(model_dtype).to(master_dtype) for m in masters]
    grads = [[tensor(s, model_dtype) for s in layout.shapes] for _ in range(STEPS)]
    return masters, grads


def _hyper(opts, amsgrad_lr=1e-2):
    lr = opts.get("lr", 1e-2)
    return dict(
        lr=torch.tensor(lr) if opts.get("lr_tensor") else lr,
        betas=(opts.get("beta1", 0.9), 0.99),
        eps=1e-8,
        weight_decay=opts.get("weight_decay", 0.1),
        amsgrad=opts.get("amsgrad", False),
        maximize=opts.get("maximize", False),
    )


def _run_ours(layout, model_dtype, opts, impl, config, seed=0):
    masters, grads = _make(layout, model_dtype, seed)
    h = _hyper(opts)
    hp = StepHyper(
        lr=h["lr"], beta1=h["betas"][0], beta2=h["betas"][1], eps=h["eps"],
        weight_decay=h["weight_decay"], amsgrad=h["amsgrad"], maximize=h["maximize"],
    )
    like = torch.zeros_like  # keeps the master's strides
    m = [like(t) for t in masters]
    v = [like(t) for t in masters]
    mv = [like(t) for t in masters] if hp.amsgrad else []
    steps = [torch.zeros((), dtype=torch.float32) for _ in masters]
    mixed = masters[0].dtype != model_dtype
    outs = [torch.empty_like(t, dtype=model_dtype) for t in masters] if mixed else None
    for step_grads in grads:
        g = [x.clone() for x in step_grads]
        if config is None:
            adamw_update_(masters, g, m, v, mv, steps, hp, model_params=outs, impl=impl)
        else:
            blocked_adamw_(masters, g, m, v, mv, steps, outs, hp, config=config)
    return dict(master=masters, exp_avg=m, exp_avg_sq=v, max_exp_avg_sq=mv, step=steps, model=outs)


def _run_torch(layout, model_dtype, opts, torch_kwargs, seed=0):
    masters, grads = _make(layout, model_dtype, seed)
    params = [torch.nn.Parameter(t.clone()) for t in masters]
    opt = torch.optim.AdamW(params, **_hyper(opts), **torch_kwargs)
    outs = None
    for g in grads:
        for p, x in zip(params, g):
            p.grad = x.to(p.dtype)  # exact widening of the low-precision gradient
        opt.step()
        if masters[0].dtype != model_dtype:
            outs = [p.detach().to(model_dtype) for p in params]  # round to nearest even
    state = [opt.state[p] for p in params]
    return dict(
        master=[p.detach() for p in params],
        exp_avg=[s["exp_avg"] for s in state],
        exp_avg_sq=[s["exp_avg_sq"] for s in state],
        max_exp_avg_sq=[s["max_exp_avg_sq"] for s in state] if opts.get("amsgrad") else [],
        step=[s["step"] for s in state],
        model=outs,
    )


def _assert_bitwise(ours, ref):
    """Every state list (and the model copy, or None on both sides) bitwise equal: the suite's one helper."""
    assert_bitwise_equal(ours, ref, "state")


MODEL_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_fast_path_bitwise_equals_torch_fused(layout, dtype, variant):
    """Every layout x dtype x kernel variant, default options, three steps."""
    model_dtype = MODEL_DTYPES[dtype]
    ours = _run_ours(layout, model_dtype, {}, "blocked", VARIANTS[variant])
    ref = _run_torch(layout, model_dtype, {}, dict(fused=True))
    _assert_bitwise(ours, ref)


@pytest.mark.parametrize("option", OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    "variant", ["default", "numba-threads2", "chunk64", "threads2-chunk128", "python-loop-threads2-chunk128"]
)
def test_fast_path_options_bitwise(option, dtype, variant):
    """Every option x dtype on layouts that cross chunk boundaries and include a non-contiguous tensor."""
    layout = Layout("mixed-list", ((), (0,), (130,), (33, 7), (1000,), (9, 11)), transpose=True)
    model_dtype = MODEL_DTYPES[dtype]
    ours = _run_ours(layout, model_dtype, OPTIONS[option], "blocked", VARIANTS[variant])
    ref = _run_torch(layout, model_dtype, OPTIONS[option], dict(fused=True))
    _assert_bitwise(ours, ref)


def test_default_chunking_on_tensors_larger_than_a_chunk():
    """The default chunk size, on sizes that are not multiples of it (nor of 64)."""
    from offload_adamw.kernels.blocked import DEFAULT_CONFIG

    c = DEFAULT_CONFIG.chunk_elements
    layout = Layout("big", ((c + 1,), (2 * c + 77,), (3, c // 3 + 5)))
    for dtype in (torch.bfloat16, torch.float16):
        for config in (None, BlockConfig(numba_loop=False)):
            _assert_bitwise(_run_ours(layout, dtype, {}, "blocked", config), _run_torch(layout, dtype, {}, dict(fused=True)))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("option", OPTIONS, ids=str)
def test_for_loop_bitwise_equals_torch_single_tensor(layout, option):
    ours = _run_ours(layout, torch.float32, OPTIONS[option], "for_loop", None)
    ref = _run_torch(layout, torch.float32, OPTIONS[option], dict(foreach=False, fused=False))
    _assert_bitwise(ours, ref)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 700), min_size=1, max_size=4),
    chunk_units=st.integers(1, 6),
    threads=st.sampled_from([0, 2]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    amsgrad=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_blocked_equals_unblocked_for_any_aligned_chunk(sizes, chunk_units, threads, dtype, amsgrad, seed):
    """Law: for every chunk size that is a multiple of 64, blocking changes no bit."""
    layout = Layout("prop", tuple((n,) for n in sizes))
    opts = dict(amsgrad=amsgrad)
    config = BlockConfig(chunk_elements=chunk_units * CHUNK_ALIGN, threads=threads, numba_loop=False)
    ours = _run_ours(layout, dtype, opts, "blocked", config, seed=seed)
    ref = _run_torch(layout, dtype, opts, dict(fused=True), seed=seed)
    _assert_bitwise(ours, ref)


def test_naive_baseline_is_the_same_arithmetic():
    """The benchmark's naive three-pass baseline computes the same bits (so the comparison is fair)."""
    layout = Layout("n", ((300,), (17, 5)))
    for dtype in (torch.bfloat16, torch.float16):
        masters, grads = _make(layout, dtype, 3)
        hp = StepHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
        m = [torch.zeros_like(t) for t in masters]
        v = [torch.zeros_like(t) for t in masters]
        steps = [torch.zeros(()) for _ in masters]
        outs = [torch.empty_like(t, dtype=dtype) for t in masters]
        for g in grads:
            naive_mixed_adamw_(masters, g, m, v, [], steps, outs, hp)
        ref = _run_torch(layout, dtype, {}, dict(fused=True), seed=3)
        _assert_bitwise(dict(master=masters, exp_avg=m, exp_avg_sq=v, step=steps, model=outs),
                        {k: ref[k] for k in ("master", "exp_avg", "exp_avg_sq", "step", "model")})


def test_worker_threads_leave_the_process_thread_count_alone():
    before = torch.get_num_threads()
    _run_ours(Layout("t", ((1000,),)), torch.bfloat16, {}, "blocked", BlockConfig(chunk_elements=128, threads=3))
    _run_ours(Layout("t", ((1000,),)), torch.bfloat16, {}, "blocked", BlockConfig(chunk_elements=128, threads=3,
                                                                                   numba_loop=False))
    assert torch.get_num_threads() == before


def _native_threads() -> set[int]:
    """This process's threads that Python did not start (torch's OpenMP team, libgomp's pools)."""
    import os
    import threading

    python = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_worker_threads_run_torch_single_threaded():
    """The chunk loop's workers run torch's ops with one thread each, and start no OpenMP team of their own.

    Torch's first parallel call in a new thread sets that thread's OpenMP team size to the process's
    (ATen's lazy_init_num_threads), so a worker that had set 1 before that call ran every chunk operation
    on a second team of its own: a fork/join per operation, and libgomp's threads beyond torch's, which
    also make libgomp shorten every team's spin-wait, torch's included."""
    import threading

    from offload_adamw.kernels import blocked

    threads = 3  # a pool of its own (pools are kept per size)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        torch.ones(1 << 20).add_(1)  # torch's own team exists before the count
        blocked._loop_function(True)  # compiled here, not in the measured step
        native = _native_threads()
        _run_ours(Layout("t", ((100_000,), (1000,))), torch.bfloat16, {}, "blocked",
                  BlockConfig(chunk_elements=1024, threads=threads, numba_loop=False))
        added = _native_threads() - native
        barrier = threading.Barrier(threads)

        def worker_threads() -> int:
            barrier.wait()  # one call on each worker
            return torch.get_num_threads()

        pool = blocked._get_pool(threads)
        seen = [f.result() for f in [pool.submit(worker_threads) for _ in range(threads)]]
    finally:
        torch.set_num_threads(before)
    assert seen == [1] * threads
    assert not added, f"the step started {len(added)} native threads beside torch's team"


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_worker_pool_survives_fork():
    """A forked child (a DataLoader worker, say) gets its own pool instead of waiting on its parent's threads."""
    import os

    layout = Layout("f", ((1000,),))
    config = BlockConfig(chunk_elements=128, threads=2, numba_loop=False)
    _run_ours(layout, torch.bfloat16, {}, "blocked", config)  # the parent's pool exists now
    ref = _run_torch(layout, torch.bfloat16, {}, dict(fused=True))
    pid = os.fork()
    if pid == 0:  # child: must finish and be exact; any failure becomes a non-zero exit
        code = 1
        try:
            # As DataLoader workers do: GNU OpenMP cannot run a parallel region in a child
            # forked after the parent ran one, so the child's own intra-op work is serial.
            torch.set_num_threads(1)
            _assert_bitwise(_run_ours(layout, torch.bfloat16, {}, "blocked", config), ref)
            code = 0
        finally:
            os._exit(code)
    deadline = __import__("time").monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if __import__("time").monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the parent's worker pool")
        __import__("time").sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def test_chunk_loop_is_compiled_here_and_falls_back_where_torchscript_is_off():
    """The TorchScript loop runs where TorchScript works; with it disabled (PYTORCH_JIT=0,
    a real switch of torch) the Python loop runs instead, says why, and is still exact."""
    import json
    import os
    import subprocess
    import sys

    from offload_adamw.kernels.blocked import chunk_loop_status

    status = chunk_loop_status()
    assert status["scripted"] and status["fallback_reason"] is None, status
    code = (
        "import json, torch\n"
        "from offload_adamw.kernels.blocked import BlockConfig, blocked_adamw_, chunk_loop_status\n"
        "from offload_adamw.kernels.adamw import StepHyper\n"
        "torch.manual_seed(0)\n"
        "m = [torch.randn(1000)]; g = [torch.randn(1000).bfloat16()]; out = [torch.empty(1000, dtype=torch.bfloat16)]\n"
        "hp = StepHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)\n"
        "blocked_adamw_(m, g, [torch.zeros(1000)], [torch.zeros(1000)], [], [torch.zeros(())], out, hp,\n"
        "               config=BlockConfig(chunk_elements=128, threads=2, numba_loop=False))\n"
        "print(json.dumps(dict(status=chunk_loop_status(), out=out[0].float().tolist())))\n"
    )
    env = dict(os.environ, PYTORCH_JIT="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    child = json.loads(res.stdout.strip().splitlines()[-1])
    assert not child["status"]["scripted"], child["status"]
    assert "PYTORCH_JIT" in child["status"]["fallback_reason"], child["status"]
    torch.manual_seed(0)
    m = [torch.randn(1000)]
    g = [torch.randn(1000).bfloat16()]
    out = [torch.empty(1000, dtype=torch.bfloat16)]
    hp = StepHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    blocked_adamw_(m, g, [torch.zeros(1000)], [torch.zeros(1000)], [], [torch.zeros(())], out, hp,
                   config=BlockConfig(chunk_elements=128, threads=2, numba_loop=False))
    assert torch.equal(torch.tensor(child["out"]), out[0].float())


# Elements pair by index whatever the strides (kernels/layout.py). Each role's tensor is given its
# own layout; the result must be torch's on a parameter laid out as torch.zeros_like lays out the
# master (its layout decides which elements torch's scalar tail computes), fed gradients of that
# layout. 3*5*7*11 = 1155 elements: the numba loop's 64-element multiple, a ragged tail and, for
# the chunk variants, several chunks.
STRIDED_SHAPE = (3, 5, 7, 11)
STRIDE_LAYOUTS = {
    "contiguous": lambda t: t.contiguous(),
    "channels-last": lambda t: t.contiguous(memory_format=torch.channels_last),
    "transposed": lambda t: t.transpose(1, 3).contiguous().transpose(1, 3),
    "strided": lambda t: torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)[..., ::2].copy_(t),
}
# role -> layout, for master, gradient, moments (m, v, max v) and model copy
STRIDE_CASES = {
    "all-channels-last": dict(master="channels-last", grad="channels-last", state="channels-last", model="channels-last"),
    "contiguous-grad": dict(master="channels-last", grad="contiguous", state="channels-last", model="channels-last"),
    "contiguous-state": dict(master="channels-last", grad="channels-last", state="contiguous", model="channels-last"),
    "contiguous-master": dict(master="contiguous", grad="channels-last", state="transposed", model="channels-last"),
    "model-copy-transposed": dict(master="channels-last", grad="channels-last", state="channels-last", model="transposed"),
    "strided-master": dict(master="strided", grad="transposed", state="strided", model="contiguous"),
    "all-different": dict(master="transposed", grad="strided", state="channels-last", model="contiguous"),
}


def _run_strided(case, model_dtype, impl, config, amsgrad):
    gen = torch.Generator().manual_seed(7)
    master_dtype = torch.float64 if model_dtype == torch.float64 else torch.float32
    mixed = model_dtype != master_dtype
    lay = {role: STRIDE_LAYOUTS[name] for role, name in STRIDE_CASES[case].items()}
    start = torch.randn(STRIDED_SHAPE, generator=gen, dtype=torch.float64).to(model_dtype).to(master_dtype)
    grads = [torch.randn(STRIDED_SHAPE, generator=gen, dtype=torch.float64).to(model_dtype) for _ in range(STEPS)]
    hp = StepHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=amsgrad)
    master = lay["master"](start.clone())
    m, v, mv = (lay["state"](torch.zeros(STRIDED_SHAPE, dtype=master_dtype)) for _ in range(3))
    out = lay["model"](torch.zeros(STRIDED_SHAPE, dtype=model_dtype)) if mixed else None
    step = torch.zeros(())
    for g in grads:
        args = ([master], [lay["grad"](g.clone())], [m], [v], [mv] if amsgrad else [], [step])
        if config is None:
            adamw_update_(*args, hp, model_params=None if out is None else [out], impl=impl)
        else:
            blocked_adamw_(*args, None if out is None else [out], hp, config=config)
    ours = dict(master=[master], exp_avg=[m], exp_avg_sq=[v], max_exp_avg_sq=[mv] if amsgrad else [], step=[step],
                model=None if out is None else [out])

    p = torch.nn.Parameter(torch.empty_like(lay["master"](start.clone())).copy_(start))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad,
                            **(dict(fused=True) if impl == "blocked" else dict(foreach=False, fused=False)))
    for g in grads:
        p.grad = torch.empty_like(p).copy_(g)
        opt.step()
    s = opt.state[p]
    ref = dict(master=[p.detach()], exp_avg=[s["exp_avg"]], exp_avg_sq=[s["exp_avg_sq"]],
               max_exp_avg_sq=[s["max_exp_avg_sq"]] if amsgrad else [], step=[s["step"]],
               model=[p.detach().to(model_dtype)] if mixed else None)
    return ours, ref


@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["default", "numba-threads2", "chunk64", "python-loop-threads2-chunk128", "for_loop"])
@pytest.mark.parametrize("case", STRIDE_CASES)
def test_elements_pair_by_index_whatever_the_strides(case, variant, dtype, amsgrad):
    impl = "for_loop" if variant == "for_loop" else "blocked"
    ours, ref = _run_strided(case, MODEL_DTYPES[dtype], impl, VARIANTS.get(variant), amsgrad)
    _assert_bitwise(ours, ref)


def test_operands_of_one_layout_are_used_without_a_copy():
    """The kernel's operands, when they share a dense layout, are the given tensors (no temporaries)."""
    from offload_adamw.kernels.layout import align

    t = torch.zeros(STRIDED_SHAPE).contiguous(memory_format=torch.channels_last)
    same = [t, torch.zeros_like(t, dtype=torch.bfloat16), torch.zeros_like(t), None]
    aligned = align(same, read=(True,) * 4, written=(True,) * 4)
    assert all(a is b for a, b in zip(aligned.tensors, same)) and not aligned.write_backs
    other = [t, torch.zeros(STRIDED_SHAPE, dtype=torch.bfloat16), torch.zeros_like(t)]
    aligned = align(other, read=(True, True, True), written=(True, False, True))
    assert aligned.tensors[0] is t and aligned.tensors[2] is other[2] and aligned.tensors[1] is not other[1]
    assert aligned.tensors[1].stride() == t.stride() and torch.equal(aligned.tensors[1], other[1])
    assert not aligned.write_backs  # the gradient is only read


# Edits of the model copy between updates (kernels/edits.py): where take_model_edits[i], an element of
# the model copy whose bits differ from round(master) (a NaN equals a NaN; -0.0 and 0.0 differ) replaces
# its master before the update. Table: kernel variants x model dtypes (fp32: the staging copy of a
# float32 device parameter) x layouts; property: the run equals torch's on the masters edited by the
# rule, which is written out here independently.
EDIT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32-staging": torch.float32}


def _rule(master, model):
    bits = {2: torch.int16, 4: torch.int32}[model.element_size()]
    rounded = master.to(model.dtype)
    differ = (rounded.view(bits) != model.view(bits)) & ~(rounded.isnan() & model.isnan())
    return torch.where(differ, model.to(master.dtype), master)


def _edited_pair(model_dtype, layout_name):
    gen = torch.Generator().manual_seed(11)
    lay = STRIDE_LAYOUTS[layout_name]
    master = torch.randn(STRIDED_SHAPE, generator=gen).to(model_dtype).float()
    flat = master.view(-1)
    flat[3::50] = -0.0
    flat[5::97] = float("nan")
    model = master.to(model_dtype, copy=True)
    mflat = model.view(-1)
    mflat[::61] = (mflat[::61].float() * 1.5 + 0.25).to(model_dtype)  # values edited
    mflat[3::100] = 0.0  # -0.0 -> 0.0 on every other one: an edit of the sign
    mflat[7::89] = float("nan")  # a NaN where the master is finite: an edit
    bits = torch.int16 if model.element_size() == 2 else torch.int32
    mflat.view(bits)[5::97] = {2: 0x7E01 if model_dtype == torch.float16 else 0x7FC1, 4: 0x7FC00001}[model.element_size()]
    return lay(master), lay(model)


def _same_or_both_nan(a, b, what):
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    differ = (a.contiguous().view(bits) != b.contiguous().view(bits)) & ~(a.isnan() & b.isnan())
    assert int(differ.sum()) == 0, f"{what}: {int(differ.sum())} element(s) differ"


@pytest.mark.parametrize("layout_name", ["contiguous", "channels-last"])
@pytest.mark.parametrize("dtype", EDIT_DTYPES)
@pytest.mark.parametrize("variant", ["default", "numba-threads2", "chunk64", "python-loop-threads2-chunk128", "for_loop"])
def test_edits_of_the_model_copy_replace_their_masters(variant, dtype, layout_name):
    model_dtype = EDIT_DTYPES[dtype]
    master, model = _edited_pair(model_dtype, layout_name)
    expected_start = _rule(master, model)
    impl = "for_loop" if variant == "for_loop" else "blocked"
    hp = StepHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(12)
    grads = [torch.empty_like(master, dtype=torch.bfloat16).copy_(torch.randn(STRIDED_SHAPE, generator=gen))
             for _ in range(2)]
    m, v, step = torch.zeros_like(master), torch.zeros_like(master), torch.zeros(())
    for g in grads:  # the second update finds the model copy as the first left it: nothing to take
        args = ([master], [g], [m], [v], [], [step])
        if VARIANTS.get(variant) is None:
            adamw_update_(*args, hp, model_params=[model], take_model_edits=[True], impl=impl)
        else:
            blocked_adamw_(*args, [model], hp, config=VARIANTS[variant], take_model_edits=[True])

    p = torch.nn.Parameter(expected_start.clone())
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                            **(dict(fused=True) if impl == "blocked" else dict(foreach=False, fused=False)))
    for g in grads:
        p.grad = g.float()
        opt.step()
    _same_or_both_nan(master, p.detach(), "master")
    _same_or_both_nan(m, opt.state[p]["exp_avg"], "exp_avg")
    _same_or_both_nan(v, opt.state[p]["exp_avg_sq"], "exp_avg_sq")
    _same_or_both_nan(model, p.detach().to(model_dtype), "model copy")


def test_without_take_model_edits_the_model_copy_is_only_written():
    """A staging buffer of unknown content (take_model_edits False) never reaches the master."""
    master, model = _edited_pair(torch.bfloat16, "contiguous")
    start = master.clone()
    hp = StepHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    g = torch.zeros_like(master)
    adamw_update_([master], [g], [torch.zeros_like(master)], [torch.zeros_like(master)], [], [torch.zeros(())], hp,
                  model_params=[model])
    _same_or_both_nan(master, start, "master")  # zero gradient, no decay: the update leaves it
