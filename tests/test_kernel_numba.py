"""The numba host loop (kernels/numba_loop.py): the same bits as the parity definition, and its threads.

Table: model dtypes (bf16, fp16) x options (plain, amsgrad, maximize, no weight decay,
tensor lr, beta1 < 0.5 for the other lerp branch) on layouts whose tensors are shorter
than, equal to and longer than multiples of 64 elements; the other dtype pairs
(float32 gradients into a bf16/fp16 copy, no model copy, a float32 copy: the staging
buffer of a float32 parameter on an accelerator). Property (hypothesis): for any
hyperparameters, step count and gradient scale one update equals torch's fused op bit
for bit. Also: the self-test refuses a loop that rounds v's product and sum separately;
without numba the chunk loop runs with the same bits after one warning; the decay
factor where one and two roundings differ; ``compiled_kernel=True`` is deprecated and
changes no bit.

Threads: the loop runs on ``torch.get_num_threads()`` threads, the caller's and workers (one
thread: the caller's alone), many small tensors in a few calls, starts no thread pool of its
own (no oversubscription with torch's intra-op threads); a DataLoader with ``num_workers=2``
forked after a step works; two optimizers stepping from two threads at once compute what they
compute one after the other.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from configs import assert_bitwise_equal
from offload_adamw import OffloadAdamW, numba_kernel_status
from offload_adamw.kernels import numba_loop
from offload_adamw.kernels.adamw import StepHyper
from offload_adamw.kernels.blocked import BlockConfig, blocked_adamw_
from test_kernel import OPTIONS, Layout, _assert_bitwise, _run_ours, _run_torch

pytest.importorskip("numba")

LAYOUT = Layout("numba", ((), (0,), (63,), (64,), (130,), (4096 + 15,), (33, 65), (65536 + 3 * 64 + 5,)))
NUMBA_OPTIONS = {**OPTIONS, "lerp-large": dict(beta1=0.3)}
HP = StepHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


@pytest.fixture
def coverage(monkeypatch):
    """What the numba loop took in each call: a list of {tensor index: elements} dicts.
    A table test whose tensors all fell back to the chunk loop would otherwise still pass."""
    calls = []
    real = numba_loop.plan

    def spy(*args, **kwargs):
        done, jobs = real(*args, **kwargs)
        calls.append(dict(done))
        return done, jobs

    monkeypatch.setattr(numba_loop, "plan", spy)
    return calls


def _expected_coverage():
    """{index in LAYOUT: elements} the loop must update: from 64 elements up, whole multiples of 64."""
    sizes = [math.prod(shape) for shape in LAYOUT.shapes]
    return {i: n - n % numba_loop.ALIGN for i, n in enumerate(sizes) if n >= numba_loop.ALIGN}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("option", NUMBA_OPTIONS, ids=str)
def test_bitwise_equals_parity_definition(option, dtype, coverage):
    ours = _run_ours(LAYOUT, dtype, NUMBA_OPTIONS[option], "blocked", None)
    ref = _run_torch(LAYOUT, dtype, NUMBA_OPTIONS[option], dict(fused=True))
    _assert_bitwise(ours, ref)
    assert coverage and all(done == _expected_coverage() for done in coverage), coverage


def _tensors(n, grad_dtype, out_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f32 = dict(dtype=torch.float32)
    return dict(
        master=torch.randn(n, generator=gen, **f32).bfloat16().float(),
        grad=torch.randn(n, generator=gen, **f32).to(grad_dtype),
        m=torch.zeros(n, **f32),
        v=torch.zeros(n, **f32),
        step=torch.zeros((), **f32),
        out=None if out_dtype is None else torch.empty(n, dtype=out_dtype),
    )


def _reference_step(ref: dict, hp: StepHyper) -> None:
    """The parity definition on a _tensors() dict: step + 1, torch's fused op on the widened gradient."""
    ref["step"] += 1
    torch._fused_adamw_([ref["master"]], [ref["grad"].float()], [ref["m"]], [ref["v"]], [], [ref["step"]],
                        lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
                        amsgrad=False, maximize=False)


def _assert_same_state(t: dict, ref: dict) -> None:
    """The master and both moments of a _tensors() dict bitwise equal to the reference's."""
    for key in ("master", "m", "v"):
        assert_bitwise_equal(t[key], ref[key], key)


@pytest.mark.parametrize(
    "grad_dtype, out_dtype",
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, None), (torch.float16, None),
     (torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
    ids=str,
)
def test_other_dtype_pairs_bitwise(grad_dtype, out_dtype, coverage):
    """float32 gradients into a low-precision copy (the pipeline under GradScaler), no model copy, and a
    float32 copy (the pipeline's staging buffer of a float32 parameter on an accelerator)."""
    n = 3 * 4096 + 17
    t = _tensors(n, grad_dtype, out_dtype)
    ref = {k: (v.clone() if v is not None else None) for k, v in t.items()}
    for _ in range(3):
        blocked_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [t["out"]], HP)
        _reference_step(ref, HP)
    _assert_same_state(t, ref)
    if out_dtype is not None:
        assert_bitwise_equal(t["out"], ref["master"].to(out_dtype), "out")
    assert coverage == [{0: 3 * 4096}] * 3
    used = [s for s in numba_kernel_status() if s["variant"].startswith(f"grad={str(grad_dtype)[6:]},")]
    assert used and all(s["usable"] for s in used), used


def test_model_copy_at_an_unaligned_address_is_exact():
    """Streaming stores need 64-byte aligned lines; a copy that starts elsewhere takes plain stores."""
    n = 8192
    t = _tensors(n, torch.bfloat16, torch.bfloat16)
    storage = torch.empty(n + 3, dtype=torch.bfloat16)
    t["out"] = storage[3:]  # 6 bytes past an aligned address
    ref = {k: (v.clone() if v is not None else None) for k, v in t.items()}
    blocked_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [t["out"]], HP)
    _reference_step(ref, HP)
    _assert_same_state(t, ref)
    assert_bitwise_equal(t["out"], ref["master"].bfloat16(), "out")


def test_autograd_sees_the_parameter_change_as_after_an_in_place_op():
    """A graph that saved a parameter before the step must refuse backward afterwards, as with torch's
    AdamW (the loop writes through raw addresses, so it bumps the version counters itself)."""
    for config in (None, BlockConfig(numba_loop=False)):
        p = torch.nn.Parameter(torch.randn(4096).to(torch.bfloat16))
        loss = (p * p).float().sum()  # saves p itself for backward
        t = _tensors(4096, torch.bfloat16, None)
        kwargs = {} if config is None else dict(config=config)
        blocked_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [p.detach()], HP, **kwargs)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_self_test_refuses_a_loop_that_rounds_v_twice():
    """With v's product and sum rounded separately, where torch rounds once, the self-test must say so."""
    assert numba_loop.available() is None  # numba imported (alone, this test is the first to build a loop)
    variant = numba_loop.variant_key(torch.bfloat16, torch.bfloat16, False, False, 0.9)
    kernel = numba_loop._make_kernel("bf16", "bf16", False, False, True, cache=False, contract_v=False)
    why = numba_loop._self_test(kernel, variant)
    assert why is not None and "differs from torch" in why, why
    good = numba_loop._make_kernel("bf16", "bf16", False, False, True, cache=False)
    assert numba_loop._self_test(good, variant) is None


@pytest.mark.parametrize("out", ["bf16", "f16", "f32"])
def test_self_test_refuses_a_loop_that_ignores_the_model_copys_edits(out):
    """A variant that takes edits is self-tested on an edited model copy: a loop that does not read it fails."""
    assert numba_loop.available() is None
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[out]
    variant = numba_loop.variant_key(torch.bfloat16, dtype, False, False, 0.9, follow=True)
    blind = numba_loop._make_kernel("bf16", out, False, False, True, cache=False, follow=False)
    why = numba_loop._self_test(blind, variant)
    assert why is not None and "master" in why, why
    good = numba_loop._make_kernel("bf16", out, False, False, True, cache=False, follow=True)
    assert numba_loop._self_test(good, variant) is None


# (lr, wd) pairs where float32(1 - lr*wd) differs between one rounding (torch's x86 build: a
# fused multiply-add in double) and two (the formula in Python).
DECAY_PAIRS = [
    (0.0035334642445518593, 0.24254536782830927),
    (0.12336377035795751, 0.07688624060818675),
    (0.024199493043513796, 0.1702573380511733),
]


@pytest.mark.parametrize("lr, weight_decay", DECAY_PAIRS)
def test_decay_factor_where_one_and_two_roundings_differ(lr, weight_decay, coverage):
    from fractions import Fraction

    one = torch.tensor(float(Fraction(1) - Fraction(lr) * Fraction(weight_decay)), dtype=torch.float64).float()
    two = torch.tensor(1 - lr * weight_decay, dtype=torch.float64).float()
    assert one != two  # the pair is a real witness
    hp = StepHyper(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=weight_decay)
    t = _tensors(4096, torch.bfloat16, torch.bfloat16, seed=3)
    ref = {k: (v.clone() if v is not None else None) for k, v in t.items()}
    blocked_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [t["out"]], hp)
    _reference_step(ref, hp)
    _assert_same_state(t, ref)
    assert coverage == [{0: 4096}]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40).map(lambda k: 64 * k),
    lr=st.one_of(st.just(0.0), st.floats(1e-7, 1.0)),
    beta1=st.one_of(st.just(0.0), st.floats(0.0, 0.999)),
    beta2=st.one_of(st.just(0.0), st.floats(0.0, 0.99999)),
    eps=st.one_of(st.just(0.0), st.floats(1e-12, 1e-3)),
    weight_decay=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    step=st.integers(1, 5000),
    log_scale=st.floats(-20.0, 10.0),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_hyperparameters_and_magnitudes_give_torchs_bits(
    n, lr, beta1, beta2, eps, weight_decay, step, log_scale, amsgrad, maximize, dtype, seed
):
    """The law behind the tables: for any hyperparameters in torch's accepted ranges, step count
    and gradient scale, one update by the numba loop equals torch's fused op bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    f32 = torch.float32  # explicit: nothing here may depend on the process's default dtype
    master = torch.randn(n, generator=gen, dtype=f32).to(dtype).float()
    grad = (torch.randn(n, generator=gen, dtype=f32) * 2.0**log_scale).to(dtype)
    m = torch.randn(n, generator=gen, dtype=f32) * 2.0**log_scale * 0.1
    v = torch.rand(n, generator=gen, dtype=f32) * 4.0**log_scale
    mv = v * 2
    hp = StepHyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                   maximize=maximize)
    ours = [master.clone(), m.clone(), v.clone(), mv.clone()]
    out = torch.empty(n, dtype=dtype)
    steps = [torch.tensor(float(step))]
    done, jobs = numba_loop.plan([ours[0]], [grad], [ours[1]], [ours[2]], [ours[3]], steps, [out], hp, [0], workers=1)
    assert done == {0: n}
    for job in jobs:
        job()
    ref = [master.clone(), m.clone(), v.clone(), mv.clone()]
    torch._fused_adamw_([ref[0]], [grad.float()], [ref[1]], [ref[2]], [ref[3]] if amsgrad else [],
                        [torch.tensor(float(step))], lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                        eps=eps, amsgrad=amsgrad, maximize=maximize)
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), ours, ref):
        if name == "max_exp_avg_sq" and not amsgrad:
            continue
        differ = (a.view(torch.int32) != b.view(torch.int32)) & ~(a.isnan() & b.isnan())
        assert not differ.any(), (name, int(differ.sum()))
    expected = ref[0].to(dtype)
    assert torch.equal(out.view(torch.int16)[~expected.isnan()], expected.view(torch.int16)[~expected.isnan()])
    assert torch.equal(out.isnan(), expected.isnan())


def test_tensors_left_to_the_chunk_loop_are_untouched():
    """plan() takes whole multiples of 64 elements; the rest, and what it declines, stays as it was."""
    sizes = [100, 64, 4096 + 15, 7]
    ts = [_tensors(n, torch.bfloat16, torch.bfloat16, seed=n) for n in sizes]
    ts.append(_tensors(256, torch.bfloat16, torch.bfloat16, seed=9))
    ts[-1]["master"] = ts[-1]["master"].double()  # float64 master: declined
    for t in ts:
        t["step"] += 1
    before = [t["master"].clone() for t in ts]
    done, jobs = numba_loop.plan(
        [t["master"] for t in ts], [t["grad"] for t in ts], [t["m"] for t in ts], [t["v"] for t in ts], [],
        [t["step"] for t in ts], [t["out"] for t in ts], HP, range(len(ts)), workers=2,
    )
    assert done == {0: 64, 1: 64, 2: 4096}
    for job in jobs:
        job()
    for i, t in enumerate(ts):
        stop = done.get(i, 0)
        assert stop == 0 or not torch.equal(t["master"][:stop], before[i][:stop])
        assert torch.equal(t["master"][stop:], before[i][stop:]), f"tensor {i} changed past {stop}"


@pytest.mark.parametrize("moment", ["m", "v", "max"])
def test_moments_not_float32_are_declined_not_read_as_float32(moment):
    """The loop steps through masters and moments as float32: a tensor with a float64 moment (the optimizer never
    makes one; a direct caller of the kernel may) is left to the chunk loop, whose fused op refuses the mix by name,
    instead of having its float64 bytes read and written as float32 (silently wrong numbers). "max" is amsgrad's
    running maximum of v."""
    t = _tensors(256, torch.bfloat16, torch.bfloat16, seed=3)
    t["max"] = torch.zeros(256)
    t[moment] = t[moment].double()
    t["step"] += 1
    hp = dataclasses.replace(HP, amsgrad=True) if moment == "max" else HP
    maxes = [t["max"]] if hp.amsgrad else []
    done, jobs = numba_loop.plan([t["master"]], [t["grad"]], [t["m"]], [t["v"]], maxes, [t["step"]], [t["out"]], hp,
                                 [0], workers=1)
    assert (done, jobs) == ({}, [])
    with pytest.raises(RuntimeError, match="Double"):
        blocked_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], maxes, [t["step"]], [t["out"]], hp)


def _train(**options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 300), torch.nn.GELU(), torch.nn.Linear(300, 33), torch.nn.LayerNorm(33)
    ).to(torch.bfloat16)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **options)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    x = torch.randn(16, 256).bfloat16()
    for _ in range(4):
        model(x).float().square().mean().backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    return model


def test_compiled_kernel_option_is_deprecated_and_changes_no_bit():
    a = _train()
    with pytest.warns(DeprecationWarning, match="compiled_kernel"):
        b = _train(compiled_kernel=True)
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert_bitwise_equal(x, y, name)
    with pytest.warns(DeprecationWarning, match="numba_kernel_status"):
        from offload_adamw import compiled_kernel_status

        assert compiled_kernel_status() == numba_kernel_status()


FALLBACK = textwrap.dedent(
    """
    import hashlib, json, sys, warnings
    if sys.argv[1] == "without":
        sys.modules["numba"] = None  # `import numba` raises ImportError, as where it is not installed
    import torch
    from offload_adamw import OffloadAdamW, numba_kernel_status
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1 << 16).to(torch.bfloat16))
    q = torch.nn.Parameter(torch.randn(1000).to(torch.float16))
    opt = OffloadAdamW([p, q], lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            p.grad = torch.randn(p.shape).to(torch.bfloat16)
            q.grad = torch.randn(q.shape).to(torch.float16)
            opt.step()
    ours = [str(w.message) for w in caught if "offload_adamw" in str(w.message)]
    bits = hashlib.sha256(p.detach().view(torch.int16).numpy().tobytes() + q.detach().view(torch.int16).numpy().tobytes())
    print(json.dumps(dict(status=numba_kernel_status(), warnings=ours, bits=bits.hexdigest())))
    """
)


@pytest.mark.slow  # a fresh process without numba (8 s); the chunk loop's bits are test_kernel's in CI
def test_without_numba_the_chunk_loop_runs_with_the_same_bits_after_one_warning():
    def run(mode):
        out = subprocess.run([sys.executable, "-c", FALLBACK, mode], capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    without, default = run("without"), run("with")
    assert len(without["warnings"]) == 2, without["warnings"]  # one per variant (bf16, fp16), not per step
    assert all("numba is not available" in w and "chunk loop runs instead" in w for w in without["warnings"])
    assert without["status"] and not any(s["usable"] for s in without["status"])
    assert default["warnings"] == [] and all(s["usable"] for s in default["status"])
    assert without["bits"] == default["bits"]


# ------------------------------------------------------------------- threads


@pytest.fixture
def batch_threads(monkeypatch):
    """The thread that ran each batch of the numba loop."""
    seen = []
    real = numba_loop._run

    def spy(*args):
        seen.append(threading.current_thread())
        return real(*args)

    monkeypatch.setattr(numba_loop, "_run", spy)
    return seen


def _big_step(config=None):
    t = _tensors(1 << 20, torch.bfloat16, torch.bfloat16, seed=1)
    ref = {k: (v.clone() if v is not None else None) for k, v in t.items()}
    kwargs = {} if config is None else dict(config=config)
    blocked_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [t["out"]], HP, **kwargs)
    _reference_step(ref, HP)
    _assert_same_state(t, ref)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_torch_set_num_threads_is_honoured(threads, batch_threads):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        _big_step()
    finally:
        torch.set_num_threads(before)
    assert len(batch_threads) >= 4 * threads  # enough batches for every worker to take some
    if threads == 1:
        assert set(batch_threads) == {threading.main_thread()}  # no pool at all: the caller's thread
    else:  # the pool's workers and the calling thread, which takes batches too: never more than torch's count
        caller = threading.current_thread()
        assert all(t.name.startswith("offload-adamw") or t is caller for t in batch_threads)
        assert 1 <= len(set(batch_threads)) <= threads


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("follow", [False, True], ids=["staging", "edits-taken"])
def test_many_small_tensors_are_batched_into_few_loop_calls_with_the_same_bits(threads, follow, batch_threads, coverage):
    """300 tensors of 64 to 5000 elements (some ragged, one 0-dim, some of another layout): a few calls of
    the loop cover all of them, each tensor's bits are the parity definition's, and the ragged tails go
    through the chunk loop."""
    gen = torch.Generator().manual_seed(5)
    sizes = [int(x) for x in torch.randint(64, 5000, (300,), generator=gen)]
    ts = [_tensors(n, torch.bfloat16, torch.bfloat16, seed=k) for k, n in enumerate(sizes)]
    ts.append(_tensors(1, torch.bfloat16, torch.bfloat16, seed=999))
    ts[0] = {k: (v.reshape(1, -1) if v is not None and v.dim() else v) for k, v in ts[0].items()}  # a size-1 dimension
    for t in ts:
        t["out"].copy_(t["master"])  # the model copy holds round(master): no element is an edit
    refs = [{k: (v.clone() if v is not None else None) for k, v in t.items()} for t in ts]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for _ in range(2):
            blocked_adamw_([t["master"] for t in ts], [t["grad"] for t in ts], [t["m"] for t in ts], [t["v"] for t in ts],
                           [], [t["step"] for t in ts], [t["out"] for t in ts], HP,
                           take_model_edits=[follow] * len(ts))
            for ref in refs:
                _reference_step(ref, HP)
    finally:
        torch.set_num_threads(before)
    for t, ref in zip(ts, refs):
        _assert_same_state(t, ref)
        assert_bitwise_equal(t["out"], ref["master"].to(torch.bfloat16), "out")
    total = sum(n - n % numba_loop.ALIGN for n in sizes)
    assert all(len(done) == sum(n >= numba_loop.ALIGN for n in sizes) for done in coverage)
    # every batch covers at least 64 Ki elements (or the rest): far fewer calls than tensors
    assert len(batch_threads) <= 2 * (total // (64 * 1024) + 1) < len(ts) / 10


def test_an_error_in_a_batch_reaches_the_caller_after_every_worker_stopped(monkeypatch):
    real = numba_loop._run
    calls = []
    running = []

    def failing(*args):
        calls.append(threading.current_thread())
        if len(calls) == 3:
            raise RuntimeError("batch 3 failed")
        running.append(1)
        try:
            return real(*args)
        finally:
            running.pop()

    monkeypatch.setattr(numba_loop, "_run", failing)
    t = _tensors(1 << 20, torch.bfloat16, torch.bfloat16, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="batch 3 failed"):
            blocked_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [t["out"]], HP)
    finally:
        torch.set_num_threads(before)
    assert not running  # no batch still writing when the error came back


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_no_thread_pool_beyond_torchs_thread_count():
    """The loop has no threading layer of its own: a step adds at most the worker threads (one per
    torch thread, made once) to the process, never a numba or OpenMP pool on top of torch's."""
    import numba.np.ufunc.parallel as numba_parallel

    _big_step()  # the pool of torch.get_num_threads() workers exists from now on
    tasks = _tasks()
    for _ in range(3):
        _big_step()
    assert _tasks() <= tasks
    assert not numba_parallel._is_initialized  # numba never started its own workers


def _setup(seed, dtype, amsgrad):
    """bf16/fp16 parameters (one large enough for several batches, a ragged one, a small one) and 4
    steps of gradients, made here so that no forward pass (whose bits depend on threads) is involved."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (300_000, 4096 + 7, 64)]
    grads = [[torch.randn(p.shape, generator=gen).to(dtype) for p in params] for _ in range(4)]
    return params, grads, dict(lr=1e-3, weight_decay=0.1, amsgrad=amsgrad, maximize=amsgrad)


def _steps(params, grads, options):
    opt = OffloadAdamW(params, **options)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in params]


class _StepInWorker(torch.utils.data.Dataset):
    """Each item: the parameters after OffloadAdamW's steps inside the DataLoader worker."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return _steps(*_setup(1, torch.bfloat16, False))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_dataloader_workers_forked_after_a_step(batch_threads):
    """The parent has stepped (its pool and numba's compiled loops exist); DataLoader workers forked
    from it then step themselves (a fresh pool in each child) and get exactly the parent's bits."""
    expected = _steps(*_setup(1, torch.bfloat16, False))
    assert batch_threads  # the parent ran the numba loop before forking
    loader = torch.utils.data.DataLoader(_StepInWorker(), batch_size=None, num_workers=2,
                                         multiprocessing_context="fork", timeout=120)
    items = list(loader)
    assert len(items) == 4
    for i, item in enumerate(items):
        assert_bitwise_equal(item, expected, f"parameters of item {i}")


def test_two_optimizers_stepping_from_two_threads():
    """Two OffloadAdamW instances stepping concurrently (and compiling their first variants at
    the same moment) compute exactly what they compute one after the other."""
    setups = [(2, torch.bfloat16, True), (3, torch.float16, True)]
    alone = [_steps(*_setup(*s)) for s in setups]
    results, errors = [None, None], []

    def worker(k):
        try:
            results[k] = _steps(*_setup(*setups[k]))
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for k in range(2):
        assert results[k] is not None, f"optimizer {k} did not finish"
        assert_bitwise_equal(results[k], alone[k], f"parameters of optimizer {k}")


def test_traced_by_torch_compile_the_loop_steps_aside():
    """Inside a region torch.compile traces, raw addresses mean nothing: plan() takes no tensor."""
    t = _tensors(4096, torch.bfloat16, torch.bfloat16)
    t["step"] += 1
    args = ([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [t["out"]], HP, [0])

    def taken():
        done, _ = numba_loop.plan(*args, workers=1)
        return torch.tensor(len(done))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert int(torch.compile(taken, backend="eager")()) == 0
    assert int(taken()) == 1


def test_float32_constants_keep_the_sign_of_zero_whatever_was_rounded_before() -> None:
    """The kernel's float32 constants are cached by value; 0.0 == -0.0, so a cache keyed by the value alone
    handed -0.0 back for 0.0 once -0.0 was rounded first (an lr of 0 gives a step size of -0.0), and the loop's
    lerp coefficient for beta1 = 0 turned -0.0: exp_avg got -0.0 where torch's fused op writes 0.0."""
    assert math.copysign(1.0, numba_loop._f32(-0.0)) == -1.0
    assert math.copysign(1.0, numba_loop._f32(0.0)) == 1.0
    assert math.copysign(1.0, numba_loop._f32(-0.0)) == -1.0
    scalars = numba_loop._scalars(1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert math.copysign(1.0, scalars[1]) == 1.0, "the lerp coefficient of beta1 = 0 is +0.0, as torch computes it"
    for lr in (0.0, -0.0):  # the cache answers each sign with that sign's own constants
        args = (1.0, lr, 0.5, 0.5, 0.1, 1e-8)
        cached, fresh = numba_loop._scalars(*args), numba_loop._scalars.__wrapped__(*args)
        assert [math.copysign(1.0, x) for x in cached] == [math.copysign(1.0, x) for x in fresh] and cached == fresh
