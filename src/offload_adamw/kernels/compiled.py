"""The mixed-precision host step as one compiled loop: opt-in, checked bit for bit before use.

Contract:

* :func:`compiled_adamw_` updates a mixed tensor (float32 master, bf16/fp16/fp32
  gradient, optional bf16/fp16/fp32 model copy: fp32 is the staging copy of a
  float32 parameter on an accelerator) over its first ``n - n % 64``
  elements with exactly the bits of the parity definition (docs/contract.md#state-precision:
  torch's fused CPU AdamW on the float32 master fed the widened gradient, then
  the round-to-nearest cast). The caller (kernel_blocked.py) runs the last
  ``n % 64`` elements and every tensor this module declines.
* One pass over memory: each element's gradient is read once (2 bytes), master,
  m and v read and written once (24 bytes), the model copy written once (2
  bytes), with no temporary at all. The blocked kernel needs three torch
  operations per chunk; here torch.compile (Inductor) generates a single loop in
  C++, so the two casts cost a few instructions inside the loop instead of two
  more trips through the cache.
* Opt-in (``OffloadAdamW(compiled_kernel=True)`` or ``BlockConfig(compiled=True)``):
  it needs a C++ compiler at run time and the first step of each variant
  compiles (seconds; :func:`compiled_kernel_status` reports the time). Anything
  that fails (no compiler, torch.compile unavailable, a compiled loop whose bits
  differ, torch.compile refusing to run) leaves the variant unused, with the
  reason kept and one warning per variant: the blocked kernel then runs, so
  results never change, only the speed. Where torch.compile would not compile
  (inside the caller's own compiled region, dynamo disabled, a non-default
  ``torch.compiler.set_stance``) the path steps aside silently.

Why the bits can be the same. torch's fused kernel computes, per vector of
elements (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, read in the disassembly
of the AVX2 variant in torch 2.13's x86 wheel; torch reports AVX512 capability
here, and whichever variant its dispatcher runs is what the self-test compares):

    p     = theta * (1 - lr*wd)                      (skipped when wd == 0; the factor is read back from the op)
    m     = fma(c, g - m, base)                      c, base: w, m if |w| < 0.5 else w - 1, g  (w = 1 - beta1)
    v     = fma((1 - beta2) * g, g, v * beta2)       the compiler contracted this one
    denom = sqrt(v) / sqrt(1 - beta2^t) + eps        (sqrt(max(v_max, v)) with amsgrad)
    theta = p + (-lr / (1 - beta1^t)) * m / denom

with every scalar rounded from double to float32. Inductor emits the same
operations; compiled with ``-ffp-contract=fast`` the compiler contracts the same
two multiply-adds (written here in the order that makes it pick the same
product for v). The decayed ``p`` must not be contracted into the last addition
(torch's build does not, because the decay sits behind the ``wd != 0`` branch),
so ``p`` gets a second, non-additive use (a NaN select that returns the same
value), which the compiler's FMA formation does not fuse. Where to contract is
the compiler's choice, in torch's build and here, so the claim is checked
rather than assumed: before its first use each variant runs a self-test against
torch's fused op on 64 Ki elements of varied magnitude (and zeros) and is used
only if every bit of master, m, v, max v and the model copy agrees (the test
data include zeros of both signs, subnormals and infinite gradients). One
exception is stated: a NaN result stays NaN but may carry another NaN payload
(the operand order of a vector add is also the compiler's choice).

Variants: (gradient dtype, model-copy dtype or none, amsgrad, maximize, lerp
branch) under one global state that torch.compile guards on (thread count,
default dtype...; the calls fix grad mode and autocast), each its own code object
and graph with dynamic sizes, so tensors of any length share one compilation and
a changed global state builds and tests a new variant rather than recompiling an
old one silently. Inductor's options that change arithmetic are pinned; after
``torch._dynamo.reset()`` the rebuilt graph is tested again before use. Verified
on torch 2.13.0+cpu with CPU capability AVX512 (Ice Lake, GCC 12); elsewhere
the self-test decides.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["COMPILED_ALIGN", "DEFAULT_MIN_ELEMENTS", "compiled_adamw_", "compiled_kernel_status", "variant_key"]

#: The compiled loop covers each tensor's first ``n - n % COMPILED_ALIGN`` elements:
#: whole vectors for every SIMD width up to 512 bits, so torch's fused op would also
#: have run them in its vector loop (its scalar tail covers only the last ``n % 8`` or
#: ``n % 16`` elements, which the caller runs through the fused op itself).
COMPILED_ALIGN = 64
#: Tensors smaller than this take the blocked kernel. Each compiled call has a fixed cost of
#: about 0.1 ms (about 35 us of Python: guards, scalars, argument parsing; then an OpenMP
#: fork/join and fresh memory streams on both cores). Measured per tensor (2 cores, bf16, tensors out of cache),
#: ns/element compiled vs blocked: 256 Ki 1.70 vs 1.11, 512 Ki 1.16 vs 1.06, 768 Ki 1.02
#: vs 1.07, 1 Mi 0.92 vs 1.09, 2 Mi 0.76 vs 1.07, 16 Mi 0.72 vs 1.05.
DEFAULT_MIN_ELEMENTS = 1024 * 1024

_GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _step_math(master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out, scalars, *, amsgrad, maximize, lerp_small):
    """One AdamW update of flat tensors, in place (see the module docstring for the bits).

    ``scalars`` (float32): decay, lerp coefficient, 1 - beta2, beta2, sqrt(bias
    correction 2), eps, -step_size. Compiled by torch.compile; never run eagerly
    (eager torch divides by a 0-dim tensor through its reciprocal and forms no FMA).
    """
    g = grad.to(torch.float32)  # exact widening
    if maximize:
        g = -g
    p = master * scalars[0]
    d = g - exp_avg
    m_new = scalars[1] * d + (exp_avg if lerp_small else g)
    v_new = scalars[2] * g * g + exp_avg_sq * scalars[3]
    if amsgrad:
        v_max = torch.maximum(max_exp_avg_sq, v_new)
        max_exp_avg_sq.copy_(v_max)
        root = v_max.sqrt()
    else:
        root = v_new.sqrt()
    denom = root / scalars[4] + scalars[5]
    theta = p + scalars[6] * m_new / denom
    # A second use of p that is not an addition: the compiler then keeps p = master * decay
    # a separately rounded product, as torch's fused op does. Same value (NaN stays NaN).
    theta = torch.where(p != p, p, theta)
    master.copy_(theta)
    exp_avg.copy_(m_new)
    exp_avg_sq.copy_(v_new)
    if out is not None:
        out.copy_(theta)  # round to nearest even


@dataclass(frozen=True)
class _Variant:
    grad_dtype: torch.dtype
    out_dtype: Optional[torch.dtype]
    amsgrad: bool
    maximize: bool
    lerp_small: bool

    def name(self) -> str:
        short = lambda d: "none" if d is None else str(d).replace("torch.", "")  # noqa: E731
        return (
            f"grad={short(self.grad_dtype)},out={short(self.out_dtype)},amsgrad={self.amsgrad},"
            f"maximize={self.maximize},lerp={'small' if self.lerp_small else 'large'}"
        )


def variant_key(grad_dtype, out_dtype, amsgrad: bool, maximize: bool, beta1: float) -> _Variant:
    """The compiled variant a tensor and its group's options need."""
    return _Variant(grad_dtype, out_dtype, bool(amsgrad), bool(maximize), abs(_f32(1 - beta1)) < 0.5)


_CPU = torch.device("cpu")


def _f32(x: float) -> float:
    """x rounded to float32 (as ``static_cast<float>`` of a double)."""
    return torch.tensor(x, dtype=torch.float64, device=_CPU).to(torch.float32).item()


@functools.lru_cache(maxsize=256)
def _decay_factor(lr: float, weight_decay: float) -> float:
    """The float32 factor ``1 - lr * weight_decay`` exactly as torch's fused op has it.

    Read back from the op itself: on a parameter of ones with zero gradient and moments
    the update leaves ``1 * factor``. Its build may compute ``1 - lr * wd`` in double with
    one rounding (a fused multiply-add: torch 2.13's x86 build does) or with two; the two
    differ in float32 for about one (lr, wd) pair in 2**29, too rare for the self-test to
    see, so the constant is taken from the op instead of recomputed.
    """
    ones = torch.ones(2 * COMPILED_ALIGN, dtype=torch.float32, device=_CPU)
    zeros = [torch.zeros(2 * COMPILED_ALIGN, dtype=torch.float32, device=_CPU) for _ in range(3)]
    torch._fused_adamw_(
        [ones], [zeros[0]], [zeros[1]], [zeros[2]], [], [torch.ones((), dtype=torch.float32, device=_CPU)],
        lr=lr, beta1=0.9, beta2=0.999, weight_decay=weight_decay, eps=1e-8, amsgrad=False, maximize=False,
    )
    return ones[0].item()


def _scalars(step: float, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float) -> Tensor:
    """The float32 constants of torch's fused kernel at this step, computed as it does (in double)."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    w = _f32(1 - beta1)
    coeff = w if abs(w) < 0.5 else _f32(w - 1.0)  # float32 subtraction, exact for w in [0.5, 1]
    values = [_decay_factor(lr, weight_decay), coeff, 1 - beta2, beta2, math.sqrt(bias_correction2), eps, -step_size]
    return torch.tensor(values, dtype=torch.float64, device=_CPU).to(torch.float32)


def _cache_entries(code) -> Optional[int]:
    """How many graphs torch.compile holds for ``code`` (None where torch does not say)."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(code))
    except Exception:
        return None


def _global_state() -> Optional[str]:
    """The global state torch.compile guards on (grad mode, autocast, threads, default dtype...)."""
    try:
        return torch._C._dynamo.guards.GlobalStateGuard().__getstate__()
    except Exception:
        return None


def _reason(exc: BaseException) -> str:
    """A one-line reason that names the real cause (torch.compile wraps errors in others)."""
    parts = []
    while exc is not None and len(parts) < 3:
        text = " ".join(str(exc).split())
        parts.append(f"{type(exc).__name__}: {text}"[:200])
        exc = exc.__cause__
    return " <- ".join(parts)


class _Compiled:
    """One variant under one global state: its compiled function, or the reason it is not used.

    Every graph it runs has passed the self-test: a variant is built per global state that
    torch.compile guards on (so a change of thread count or default dtype builds and tests
    a new one instead of recompiling silently), and where torch.compile dropped its graphs
    (``torch._dynamo.reset()``) the self-test runs again before the next use.
    """

    def __init__(self, variant: _Variant, contract: str, state: Optional[str]):
        self.variant = variant
        self.fn = None
        self.code = None
        self.graphs: Optional[int] = None
        self.reason: Optional[str] = None
        self.seconds = 0.0
        start = time.perf_counter()
        try:
            import torch._dynamo  # noqa: F401  (ImportError where torch.compile is absent)

            # A code object of its own per variant and state: torch.compile keeps one cache
            # per code object, so variants never count against each other's recompile limit.
            tag = abs(hash((variant, contract, state)))
            self.code = _step_math.__code__.replace(co_name=f"_step_math_{tag}")
            fn = types.FunctionType(self.code, _step_math.__globals__, self.code.co_name)
            fn.__kwdefaults__ = dict(amsgrad=variant.amsgrad, maximize=variant.maximize, lerp_small=variant.lerp_small)
            options = {
                "cpp.enable_floating_point_contract_flag": contract,
                "cpp.enable_unsafe_math_opt_flag": False,  # whatever the process-wide setting says
            }
            self.fn = torch.compile(fn, dynamic=True, fullgraph=True, options=options)
            self.check()
        except Exception as exc:  # no compiler, no torch.compile, an Inductor error: not used
            self.fn, self.reason = None, _reason(exc)
        self.seconds = time.perf_counter() - start

    def check(self) -> None:
        """Run the self-test (compiling if needed); on a difference the variant is not used."""
        with warnings.catch_warnings():
            # compiling touches deprecated TorchScript helpers inside torch: not the user's concern
            warnings.simplefilter("ignore", DeprecationWarning)
            why = _self_test(self.fn, self.variant)
        if why:
            self.fn, self.reason = None, why
        else:
            self.graphs = _cache_entries(self.code)

    def usable(self) -> bool:
        """Usable, after testing again any graph torch.compile built since the last self-test."""
        if self.fn is not None and self.graphs is not None and _cache_entries(self.code) != self.graphs:
            try:
                self.check()
            except Exception as exc:
                self.fn, self.reason = None, _reason(exc)
        return self.fn is not None


def _self_test(fn, variant: _Variant) -> Optional[str]:
    """Run ``fn`` and torch's fused op on the same data; None when all bits agree, else what differed.

    64 Ki elements over seven decades of magnitude, with exact zeros, -0.0, subnormal
    masters, moments and gradients, and infinite gradients (NaN results compare as NaN:
    their payload is the documented exception).
    """
    n = 64 * 1024
    f32 = dict(dtype=torch.float32, device=_CPU)
    gen = torch.Generator(device=_CPU).manual_seed(1234)
    scale = torch.logspace(-6, 1, n, dtype=torch.float64, device=_CPU)[torch.randperm(n, generator=gen, device=_CPU)]
    master = (torch.randn(n, generator=gen, dtype=torch.float64, device=_CPU) * scale).to(variant.out_dtype or torch.float32)
    master = master.float()
    grad = (torch.randn(n, generator=gen, dtype=torch.float64, device=_CPU) * scale.flip(0)).to(variant.grad_dtype)
    exp_avg = torch.randn(n, generator=gen, **f32) * 1e-3
    exp_avg_sq = torch.rand(n, generator=gen, **f32) * 1e-4
    max_exp_avg_sq = exp_avg_sq * torch.rand(n, generator=gen, **f32) * 2
    tiny = torch.finfo(torch.float32).tiny
    grad[::97] = 0
    grad[1::97] = -0.0
    grad[2::997] = math.inf
    grad[3::991] = -math.inf
    master[4::89] = -0.0
    master[5::83] = tiny / 8  # subnormal
    exp_avg[6::79] = -tiny / 4
    exp_avg_sq[::101] = 0
    exp_avg_sq[7::73] = tiny / 2
    if variant.grad_dtype == torch.float32:
        grad[8::71] = tiny / 16
    beta1 = 0.9 if variant.lerp_small else 0.3
    hyper = dict(lr=3e-3, beta1=beta1, beta2=0.999, weight_decay=0.1, eps=1e-8)
    step = 5.0

    ref = [master.clone(), exp_avg.clone(), exp_avg_sq.clone(), max_exp_avg_sq.clone()]
    torch._fused_adamw_(
        [ref[0]], [grad.float()], [ref[1]], [ref[2]], [ref[3]] if variant.amsgrad else [],
        [torch.tensor(step, **f32)], amsgrad=variant.amsgrad, maximize=variant.maximize, **hyper,
    )
    ref.append(ref[0].to(variant.out_dtype) if variant.out_dtype is not None else None)

    ours = [master.clone(), exp_avg.clone(), exp_avg_sq.clone(), max_exp_avg_sq.clone()]
    out = torch.empty(n, dtype=variant.out_dtype, device=_CPU) if variant.out_dtype is not None else None
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        fn(ours[0], grad, ours[1], ours[2], ours[3] if variant.amsgrad else None, out, _scalars(step, **hyper))
    ours.append(out)

    names = ["master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "model copy"]
    for name, a, b in zip(names, ours, ref):
        if b is None or (name == "max_exp_avg_sq" and not variant.amsgrad):
            continue
        view = torch.int16 if a.element_size() == 2 else torch.int32
        differ = int(((a.view(view) != b.view(view)) & ~(a.isnan() & b.isnan())).sum())
        if differ:
            return f"the compiled loop differs from torch's fused AdamW in {differ} of {n} elements of {name}"
    return None


_lock = threading.Lock()
_variants: dict[tuple, _Compiled] = {}
_warned: set = set()


def _forget_lock_after_fork() -> None:
    # A child forked while another thread compiled would inherit the lock held forever.
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_lock_after_fork)


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside this package and torch (the user's step call)."""
    inside = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _warn_once(variant: _Variant, contract: str, reason: Optional[str]) -> None:
    if (variant, contract) in _warned:
        return
    _warned.add((variant, contract))
    warnings.warn(
        f"offload_adamw: the compiled host kernel is not used for {variant.name()} "
        f"({reason}); the blocked kernel runs instead, with the same results",
        RuntimeWarning,
        stacklevel=_caller_stacklevel(),
    )


def _get(variant: _Variant, contract: str = "fast", state: Optional[str] = None) -> _Compiled:
    with _lock:
        entry = _variants.get((variant, contract, state))
        if entry is None:
            entry = _variants[(variant, contract, state)] = _Compiled(variant, contract, state)
        if not entry.usable():
            _warn_once(variant, contract, entry.reason)
        return entry


def _compiler_active() -> bool:
    """False where torch.compile would not compile this loop: inside the caller's own
    compiled region (``torch.compile(opt.step)``: the step is traced, not run), dynamo
    disabled (``TORCHDYNAMO_DISABLE=1``), or a stance other than the default
    (``torch.compiler.set_stance``), where it would run the function eagerly, with other
    roundings. The path then steps aside silently: the chunk loop runs, same bits."""
    if torch.compiler.is_compiling():
        return False
    try:
        import torch._dynamo as dynamo  # a real import: waits for one in progress in another thread
    except Exception:
        return True  # the variant's build will record why torch.compile is unusable
    if dynamo.config.disable:
        return False
    stance = getattr(dynamo.eval_frame, "_stance", None)
    return stance is None or getattr(stance, "stance", "default") == "default"


def compiled_kernel_status() -> list[dict]:
    """Each variant built so far in this process: name, usable, compile (and self-test) seconds,
    reason, and the CPU capability torch dispatches its kernels to (the self-test's ground)."""
    capability = torch.backends.cpu.get_cpu_capability()
    with _lock:
        return [
            dict(variant=v.name(), contract=c, usable=e.fn is not None, compile_seconds=e.seconds, reason=e.reason,
                 cpu_capability=capability)
            for (v, c, _state), e in _variants.items()
        ]


def compiled_adamw_(
    masters: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    model_params: Optional[Sequence[Optional[Tensor]]],
    hp,
    indices: Sequence[int],
    *,
    min_elements: int = DEFAULT_MIN_ELEMENTS,
    contract: str = "fast",
) -> dict[int, int]:
    """Update the compiled part of the tensors ``indices`` (already stepped: ``steps[i]`` holds t).

    Returns {i: first element not yet updated} for each tensor it updated (a multiple
    of 64); tensors it declines are absent and untouched. The inputs are the
    blocked kernel's: contiguous host tensors, float32 masters.
    """
    done: dict[int, int] = {}
    if isinstance(hp.lr, Tensor):
        return done  # torch's tensor-lr overload: left to the blocked kernel
    if not _compiler_active():
        return done
    scalars_at: dict[float, Tensor] = {}
    # One fixed grad and autocast mode for every call, so that torch.compile's guards on them
    # never see a change; the rest of its guarded global state selects the variant.
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        state = _global_state()
        for i in indices:
            master = masters[i]
            n = master.numel()
            stop = n - n % COMPILED_ALIGN
            out = model_params[i] if model_params is not None else None
            if (
                stop < max(min_elements, COMPILED_ALIGN)
                or master.dtype != torch.float32
                or grads[i].dtype not in _GRAD_DTYPES
                or (out is not None and out.dtype not in _OUT_DTYPES)
            ):
                continue
            variant = variant_key(grads[i].dtype, None if out is None else out.dtype, hp.amsgrad, hp.maximize, hp.beta1)
            entry = _get(variant, contract, state)
            if entry.fn is None:
                continue
            step = float(steps[i].item())
            scalars = scalars_at.get(step)
            if scalars is None:
                scalars = scalars_at[step] = _scalars(
                    step, float(hp.lr), float(hp.beta1), float(hp.beta2), float(hp.weight_decay), float(hp.eps)
                )
            flat = lambda t: t.view(-1)[:stop]  # noqa: E731
            try:
                entry.fn(
                    flat(master),
                    flat(grads[i]),
                    flat(exp_avgs[i]),
                    flat(exp_avg_sqs[i]),
                    flat(max_exp_avg_sqs[i]) if hp.amsgrad else None,
                    None if out is None else flat(out),
                    scalars,
                )
            except Exception as exc:
                # torch.compile refused to run (a recompile forbidden by the user's dynamo
                # settings, say): raised before the graph ran, so this tensor is untouched
                # and the chunk loop takes it.
                with _lock:
                    entry.fn, entry.reason = None, _reason(exc)
                _warn_once(variant, contract, entry.reason)
                continue
            done[i] = stop
            with _lock:
                if entry.usable():  # torch.compile may have built another graph during the call: tested
                    continue
            # Not expected (the guarded global state selects the variant), but said, not hidden.
            warnings.warn(
                f"offload_adamw: torch.compile rebuilt the host loop for {variant.name()} during a step and the "
                f"new graph failed the self-test ({entry.reason}); this step of one tensor may differ from torch's "
                "fused AdamW in the last bit, and the blocked kernel runs from now on",
                RuntimeWarning,
                stacklevel=_caller_stacklevel(),
            )
    return done
