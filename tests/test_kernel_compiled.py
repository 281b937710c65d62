"""The opt-in compiled host loop (kernel_compiled.py): the same bits as the parity definition.

Table: model dtypes (bf16, fp16, and float32 gradients into a bf16 copy) x options
(plain, amsgrad, maximize, no weight decay, tensor lr, beta1 < 0.5 for the other
lerp branch) on layouts whose tensors are shorter than, equal to and longer than
multiples of 64 elements. Property: bitwise equal to torch's fused AdamW on float32
copies followed by the round-to-nearest cast, as the default kernel is.

Also: the self-test refuses a loop compiled without the contracted multiply-adds
(the variant falls back, with a warning and the reason); no C++ compiler means the
default kernel runs with the same bits; sizes and storage offsets never recompile;
``OffloadAdamW(compiled_kernel=True)`` trains bit for bit like the default.
Needs a C++ compiler (torch.compile's CPU backend); skipped without one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from offload_adamw import OffloadAdamW
from offload_adamw.kernels.adamw import StepHyper
from offload_adamw.kernels.blocked import BlockConfig, blocked_adamw_
from offload_adamw.kernels.compiled import (
    COMPILED_ALIGN,
    _get,
    compiled_adamw_,
    compiled_kernel_status,
    variant_key,
)
from test_kernel import OPTIONS, Layout, _assert_bitwise, _run_ours, _run_torch

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("c++", "g++", "clang++")), reason="torch.compile's CPU backend needs a C++ compiler"
)

# Small tensors go through the compiled loop too (the default leaves them to the chunk loop).
EVERYTHING = BlockConfig(compiled=True, compiled_min_elements=COMPILED_ALIGN)
LAYOUT = Layout(
    "compiled",
    ((), (0,), (63,), (64,), (130,), (4096 + 15,), (33, 65), (65536 + 3 * 64 + 5,)),
)
COMPILED_OPTIONS = {**OPTIONS, "lerp-large": dict(beta1=0.3)}
HP = StepHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


@pytest.fixture
def coverage(monkeypatch):
    """What the compiled loop updated in each call: a list of {tensor index: elements} dicts.
    A table test whose tensors all fell back to the chunk loop would otherwise still pass."""
    import offload_adamw.kernels.compiled as kc

    calls = []
    real = kc.compiled_adamw_

    def spy(*args, **kwargs):
        done = real(*args, **kwargs)
        calls.append(dict(done))
        return done

    monkeypatch.setattr(kc, "compiled_adamw_", spy)
    return calls


def _expected_coverage():
    """{index in LAYOUT: elements} the compiled loop must update (EVERYTHING: from 64 elements up)."""
    sizes = [math.prod(shape) for shape in LAYOUT.shapes]
    return {i: n - n % COMPILED_ALIGN for i, n in enumerate(sizes) if n >= COMPILED_ALIGN}


@pytest.mark.parametrize("option", COMPILED_OPTIONS, ids=str)
def test_bf16_bitwise_equals_parity_definition(option, coverage):
    ours = _run_ours(LAYOUT, torch.bfloat16, COMPILED_OPTIONS[option], "blocked", EVERYTHING)
    ref = _run_torch(LAYOUT, torch.bfloat16, COMPILED_OPTIONS[option], dict(fused=True))
    _assert_bitwise(ours, ref)
    # ... and the compiled loop did the work (a tensor lr is left to the chunk loop by design)
    expected = {} if option == "tensor-lr" else _expected_coverage()
    assert coverage and all(done == expected for done in coverage), (coverage, expected)


def test_fp16_bitwise_equals_parity_definition(coverage):
    _assert_bitwise(
        _run_ours(LAYOUT, torch.float16, {}, "blocked", EVERYTHING),
        _run_torch(LAYOUT, torch.float16, {}, dict(fused=True)),
    )
    assert coverage and all(done == _expected_coverage() for done in coverage), coverage


def _tensors(n, grad_dtype, out_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f32 = dict(dtype=torch.float32)  # explicit: one test runs under a float64 default dtype
    master = torch.randn(n, generator=gen, **f32).bfloat16().float()
    return dict(
        master=master,
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


def _same_state(t: dict, ref: dict) -> bool:
    return all(torch.equal(t[k].view(torch.int32), ref[k].view(torch.int32)) for k in ("master", "m", "v"))


@pytest.mark.parametrize(
    "grad_dtype, out_dtype",
    [(torch.float32, torch.bfloat16), (torch.bfloat16, None), (torch.float32, torch.float32)],
)
def test_other_dtype_pairs_bitwise(grad_dtype, out_dtype):
    """float32 gradients into a bf16 copy (the pipeline under GradScaler), no model copy, and a float32
    copy (the pipeline's staging buffer of a float32 parameter on an accelerator)."""
    n = 3 * 4096 + 17
    t = _tensors(n, grad_dtype, out_dtype)
    ref = {k: (v.clone() if v is not None else None) for k, v in t.items()}
    for _ in range(3):
        blocked_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [t["out"]], HP, config=EVERYTHING)
        _reference_step(ref, HP)
    assert _same_state(t, ref)
    if out_dtype is not None:
        view = torch.int32 if out_dtype == torch.float32 else torch.int16
        assert torch.equal(t["out"].view(view), ref["master"].to(out_dtype).view(view))
    fast = [s for s in compiled_kernel_status() if s["contract"] == "fast"]
    assert fast and all(s["usable"] for s in fast), fast


def test_covers_multiples_of_64_and_leaves_the_rest_untouched():
    sizes = [100, 64, 4096 + 15, 7]
    ts = [_tensors(n, torch.bfloat16, torch.bfloat16, seed=n) for n in sizes]
    for t in ts:
        t["step"] += 1
    before = [t["master"].clone() for t in ts]
    done = compiled_adamw_(
        [t["master"] for t in ts], [t["grad"] for t in ts], [t["m"] for t in ts], [t["v"] for t in ts], [],
        [t["step"] for t in ts], [t["out"] for t in ts], HP, range(len(ts)), min_elements=128,
    )
    assert done == {2: 4096}  # 100 and 64 are below min_elements (128); 7 has no whole 64-element block
    for i, t in enumerate(ts):
        stop = done.get(i, 0)
        assert not torch.equal(t["master"][:stop], before[i][:stop]) or stop == 0
        assert torch.equal(t["master"][stop:], before[i][stop:]), f"tensor {i} changed past {stop}"
        assert torch.equal(t["m"][stop:], torch.zeros(sizes[i] - stop))


def test_tensor_lr_is_left_to_the_blocked_kernel():
    t = _tensors(4096, torch.bfloat16, torch.bfloat16)
    t["step"] += 1
    hp = StepHyper(lr=torch.tensor(1e-2), beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    done = compiled_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [t["out"]], hp, [0],
                           min_elements=64)
    assert done == {}


def test_self_test_refuses_a_loop_without_the_contracted_multiply_adds():
    """Compiled with -ffp-contract=off the loop rounds m and v twice where torch rounds once:
    the self-test must catch it, and the variant must not be used."""
    variant = variant_key(torch.bfloat16, torch.bfloat16, False, False, 0.9)
    with pytest.warns(RuntimeWarning, match="differs from torch's fused AdamW"):
        entry = _get(variant, contract="off")
    assert entry.fn is None and "differs" in entry.reason
    t = _tensors(4096, torch.bfloat16, torch.bfloat16)
    t["step"] += 1
    done = compiled_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [t["out"]], HP, [0],
                           min_elements=64, contract="off")
    assert done == {}


def test_sizes_and_storage_offsets_do_not_recompile():
    from torch._dynamo.utils import counters

    buffer = _tensors(1 << 16, torch.bfloat16, torch.bfloat16)
    buffer["step"] += 1

    def run(offset, n):
        sl = lambda t: t[offset : offset + n]  # noqa: E731  (views at a storage offset)
        compiled_adamw_([sl(buffer["master"])], [sl(buffer["grad"])], [sl(buffer["m"])], [sl(buffer["v"])], [],
                        [buffer["step"]], [sl(buffer["out"])], HP, [0], min_elements=64)

    run(0, 4096)
    graphs = counters["stats"]["unique_graphs"]
    for offset, n in [(0, 64), (64, 128), (640, 30000), (1 << 15, 1 << 15), (3, 1000)]:
        run(offset, n)
    assert counters["stats"]["unique_graphs"] == graphs


def _train(compiled: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1100), torch.nn.GELU(), torch.nn.Linear(1100, 33), torch.nn.LayerNorm(33)
    ).to(torch.bfloat16)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, compiled_kernel=compiled)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
    x = torch.randn(16, 1024).bfloat16()
    for step in range(6):
        model(x).float().square().mean().backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt


def test_optimizer_option_trains_bit_for_bit_like_the_default(coverage):
    a, _ = _train(False)
    assert coverage == []
    b, opt = _train(True)
    # the 1100 x 1024 weight (1.1 Mi elements) goes through the compiled loop at every step
    assert len(coverage) == 6 and all(1024 * 1100 in done.values() for done in coverage), coverage
    assert opt.kernel_impl(opt.param_groups[0]) == "compiled"
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)), name
    used = [s for s in compiled_kernel_status() if s["contract"] == "fast"]
    assert used and all(s["usable"] for s in used)


def test_fused_false_still_picks_the_readable_loop():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = OffloadAdamW([p], compiled_kernel=True, fused=False)
    assert opt.kernel_impl(opt.param_groups[0]) == "for_loop"


FALLBACK = textwrap.dedent(
    """
    import hashlib, json, warnings, torch
    from offload_adamw import OffloadAdamW
    from offload_adamw.kernels.compiled import compiled_kernel_status
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1 << 20).to(torch.bfloat16))
    opt = OffloadAdamW([p], lr=1e-2, compiled_kernel=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            p.grad = torch.randn(p.shape).to(torch.bfloat16)
            opt.step()
    ours = [str(w.message) for w in caught if "offload_adamw" in str(w.message)]
    print(json.dumps(dict(status=compiled_kernel_status(), warnings=ours,
                          bits=hashlib.sha256(p.detach().view(torch.int16).numpy().tobytes()).hexdigest())))
    """
)


def test_without_a_compiler_the_default_kernel_runs_with_the_same_bits(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    broken = json.loads(out.stdout.strip().splitlines()[-1])
    assert broken["status"] and not broken["status"][0]["usable"]
    assert "compiler" in broken["status"][0]["reason"].lower(), broken["status"]
    assert len(broken["warnings"]) == 1 and "blocked kernel runs instead" in broken["warnings"][0]

    script = FALLBACK.replace("compiled_kernel=True", "compiled_kernel=False")
    default = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=True)
    assert json.loads(default.stdout.strip().splitlines()[-1])["bits"] == broken["bits"]


def test_an_eager_stance_is_declined_rather_than_run_with_other_bits():
    """Under torch.compiler.set_stance("force_eager") torch.compile runs the Python function
    eagerly (other roundings): the compiled path must step aside, the chunk loop runs."""
    t = _tensors(4096, torch.bfloat16, torch.bfloat16)
    t["step"] += 1
    args = ([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [t["out"]], HP, [0])
    assert compiled_adamw_(*args, min_elements=64) == {0: 4096}
    with torch.compiler.set_stance("force_eager"):
        assert compiled_adamw_(*args, min_elements=64) == {}


def _train_pipelined(compiled: bool):
    """An fp16 model through the CPU-as-device pipeline: freed gradients, loss scaling (the
    step then divides the gradients into float32: the float32-gradient variant)."""
    from offload_adamw import OffloadGradScaler

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1100), torch.nn.Tanh(), torch.nn.Linear(1100, 7)).half()
    opt = OffloadAdamW(model.parameters(), lr=1e-3, transfer_pipeline=True, offload_gradients=True,
                       compiled_kernel=compiled)
    scaler = OffloadGradScaler("cpu", init_scale=2.0**8)
    x = torch.randn(8, 1024).half()
    for _ in range(4):
        scaler.scale(model(x).float().square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, opt


def test_pipeline_with_loss_scaling_is_bit_for_bit_the_default():
    a, opt_a = _train_pipelined(False)
    b, opt_b = _train_pipelined(True)
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)), name
        sa, sb = opt_a.state[x], opt_b.state[y]
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert torch.equal(sa[key].view(torch.int32), sb[key].view(torch.int32)), (name, key)
    assert any(s["variant"].startswith("grad=float32,out=float16") and s["usable"] for s in compiled_kernel_status())


from hypothesis import given, settings, strategies as st  # noqa: E402


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
    seed=st.integers(0, 2**31 - 1),
)
def test_any_hyperparameters_and_magnitudes_give_torchs_bits(
    n, lr, beta1, beta2, eps, weight_decay, step, log_scale, amsgrad, seed
):
    """The law behind the tables: for any hyperparameters in torch's accepted ranges, step
    count and gradient scale, one compiled update equals torch's fused op bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen).bfloat16().float()
    grad = (torch.randn(n, generator=gen) * 2.0**log_scale).bfloat16()
    m = torch.randn(n, generator=gen) * 2.0**log_scale * 0.1
    v = torch.rand(n, generator=gen) * 4.0**log_scale
    mv = v * 2
    hp = StepHyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
    ours = [master.clone(), m.clone(), v.clone(), mv.clone()]
    out = torch.empty(n, dtype=torch.bfloat16)
    steps = [torch.tensor(float(step))]
    done = compiled_adamw_([ours[0]], [grad], [ours[1]], [ours[2]], [ours[3]], steps, [out], hp, [0], min_elements=64)
    assert done == {0: n}
    ref = [master.clone(), m.clone(), v.clone(), mv.clone()]
    torch._fused_adamw_([ref[0]], [grad.float()], [ref[1]], [ref[2]], [ref[3]] if amsgrad else [],
                        [torch.tensor(float(step))], lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                        eps=eps, amsgrad=amsgrad, maximize=False)
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), ours, ref):
        if name == "max_exp_avg_sq" and not amsgrad:
            continue
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name
    assert torch.equal(out.view(torch.int16), ref[0].bfloat16().view(torch.int16))


# ------------------------------------------------------- torch.compile's life cycle
# (findings of a review: each of these once crashed a step or gave other bits silently)


def _bits_after_one_step(n=8192, **config):
    t = _tensors(n, torch.bfloat16, torch.bfloat16, seed=7)
    ref = {k: (v.clone() if v is not None else None) for k, v in t.items()}
    blocked_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [t["out"]], HP,
                   config=BlockConfig(compiled=True, compiled_min_elements=64, **config))
    _reference_step(ref, HP)
    return _same_state(t, ref)


def test_a_global_state_change_builds_and_tests_a_new_graph_with_pinned_options(coverage):
    """Before: a thread-count change recompiled the tested graph under whatever Inductor settings the
    user had by then (unsafe math: 10,940 of 131,072 elements differed, still reported usable)."""
    import torch._inductor.config as inductor_config

    assert _bits_after_one_step()
    threads = torch.get_num_threads()
    before = len(compiled_kernel_status())
    try:
        with inductor_config.patch({"cpp.enable_unsafe_math_opt_flag": True}):
            torch.set_num_threads(1)
            assert _bits_after_one_step()
    finally:
        torch.set_num_threads(threads)
    assert len(compiled_kernel_status()) == before + 1  # a variant of its own, self-tested
    assert all(done == {0: 8192} for done in coverage), coverage


def test_after_dynamo_reset_the_rebuilt_graph_is_tested_before_use(coverage):
    import torch._dynamo

    assert _bits_after_one_step()
    torch._dynamo.reset()
    assert _bits_after_one_step()
    assert all(done == {0: 8192} for done in coverage), coverage


def test_a_users_ban_on_recompiling_does_not_break_the_step():
    """error_on_recompile (a user policing their own model) once made opt.step() raise mid-update."""
    import torch._dynamo

    assert _bits_after_one_step()
    threads = torch.get_num_threads()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            torch.set_num_threads(1)
            assert _bits_after_one_step()
            with torch.enable_grad():
                assert _bits_after_one_step()
    finally:
        torch.set_num_threads(threads)


def test_a_float64_default_dtype_does_not_disable_the_loop(coverage):
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert _bits_after_one_step()
    finally:
        torch.set_default_dtype(previous)
    assert all(done == {0: 8192} for done in coverage), coverage


def test_inside_a_compiled_region_the_loop_steps_aside():
    """torch.compile(opt.step): the step is traced, not run; the loop must not build (and fail)
    its self-test there, which once turned it off for the rest of the process."""
    t = _tensors(4096, torch.float16, torch.float16, seed=5)
    t["step"] += 1
    hp = StepHyper(lr=1e-2, beta1=0.3, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=True, maximize=True)
    mv = torch.zeros(4096)
    before = len(compiled_kernel_status())
    traced = torch.compile(
        lambda: compiled_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [mv], [t["step"]], [t["out"]],
                                hp, [0], min_elements=64)
    )
    assert traced() == {}
    assert len(compiled_kernel_status()) == before  # nothing built while tracing
    # run eagerly, the same call compiles its variant and updates the tensor
    assert compiled_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [mv], [t["step"]], [t["out"]], hp, [0],
                           min_elements=64) == {0: 4096}


RACE = textwrap.dedent(
    """
    import sys, threading, torch
    from offload_adamw.kernels.compiled import _compiler_active
    assert "torch._dynamo" not in sys.modules
    errors, done = [], threading.Event()
    def poll():
        while not done.is_set():
            try:
                _compiler_active()
            except Exception as exc:
                errors.append(repr(exc)); return
    t = threading.Thread(target=poll); t.start()
    import torch._dynamo
    done.set(); t.join()
    print(len(errors))
    """
)


def test_first_use_while_another_thread_imports_dynamo_does_not_crash():
    out = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "0", out.stdout + out.stderr[-2000:]


# (lr, wd) pairs where float32(1 - lr*wd) differs between one rounding (torch's x86 build: a
# fused multiply-add in double) and two (the formula in Python); found by a reviewer's search.
DECAY_PAIRS = [
    (0.0035334642445518593, 0.24254536782830927),
    (0.12336377035795751, 0.07688624060818675),
    (0.024199493043513796, 0.1702573380511733),
]


@pytest.mark.parametrize("lr, weight_decay", DECAY_PAIRS)
def test_decay_factor_where_one_and_two_roundings_differ(lr, weight_decay):
    from fractions import Fraction

    one = torch.tensor(float(Fraction(1) - Fraction(lr) * Fraction(weight_decay)), dtype=torch.float64).float()
    two = torch.tensor(1 - lr * weight_decay, dtype=torch.float64).float()
    assert one != two  # the pair is a real witness
    hp = StepHyper(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=weight_decay)
    t = _tensors(4096, torch.bfloat16, torch.bfloat16, seed=3)
    ref = {k: (v.clone() if v is not None else None) for k, v in t.items()}
    t["step"] += 1
    assert compiled_adamw_([t["master"]], [t["grad"]], [t["m"]], [t["v"]], [], [t["step"]], [t["out"]], hp, [0],
                           min_elements=64) == {0: 4096}
    _reference_step(ref, hp)
    assert _same_state(t, ref)
