"""The mixed-precision host step as one compiled loop: opt-in, checked bit for bit before use.

Contract:

* :func:`compiled_adamw_` updates a mixed tensor (float32 master, bf16/fp16/fp32
  gradient, optional bf16/fp16 model copy) over its first ``n - n % 64``
  elements with exactly the bits of the parity definition (CONTRACT.md section
  5: torch's fused CPU AdamW on the float32 master fed the widened gradient, then
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
  differ) leaves the variant unused, with the reason kept and one warning: the
  blocked kernel then runs, so results never change, only the speed.

Why the bits can be the same. torch's fused kernel computes, per vector of
elements (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, read in the disassembly
of torch 2.13's AVX2 build):

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
only if every bit of master, m, v, max v and the model copy agrees. One
exception is stated, not tested: a NaN result stays NaN but may carry another
NaN payload (the operand order of a vector add is also the compiler's choice).

Variants: (gradient dtype, model-copy dtype or none, amsgrad, maximize, lerp
branch), each its own compiled graph with dynamic sizes, so tensors of any
length share one compilation.
"""

from __future__ import annotations

import functools
import math
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
#: Tensors smaller than this take the blocked kernel. Each compiled call pays about 33 us
#: of Python (guards, argument parsing) plus an OpenMP fork/join and the start of fresh
#: memory streams on both cores. Measured per tensor (2 cores, bf16, tensors out of cache),
#: ns/element compiled vs blocked: 256 Ki 1.70 vs 1.11, 512 Ki 1.16 vs 1.06, 768 Ki 1.02
#: vs 1.07, 1 Mi 0.92 vs 1.09, 2 Mi 0.76 vs 1.07, 16 Mi 0.72 vs 1.05.
DEFAULT_MIN_ELEMENTS = 1024 * 1024

_GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float16)


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


def _f32(x: float) -> float:
    """x rounded to float32 (as ``static_cast<float>`` of a double)."""
    return torch.tensor(x, dtype=torch.float64).to(torch.float32).item()


@functools.lru_cache(maxsize=256)
def _decay_factor(lr: float, weight_decay: float) -> float:
    """The float32 factor ``1 - lr * weight_decay`` exactly as torch's fused op has it.

    Read back from the op itself: on a parameter of ones with zero gradient and moments
    the update leaves ``1 * factor``. Its build may compute ``1 - lr * wd`` in double with
    one rounding (a fused multiply-add: this machine's AVX2 kernel does) or with two;
    the two differ in float32 for about one (lr, wd) pair in 2**29, too rare for the
    self-test to see, so the constant is taken from the op instead of recomputed.
    """
    ones = torch.ones(2 * COMPILED_ALIGN)
    zeros = [torch.zeros(2 * COMPILED_ALIGN) for _ in range(3)]
    torch._fused_adamw_(
        [ones], [zeros[0]], [zeros[1]], [zeros[2]], [], [torch.ones(())],
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
    return torch.tensor(values, dtype=torch.float64).to(torch.float32)


class _Compiled:
    """One variant: its compiled function, or the reason it is not used."""

    def __init__(self, variant: _Variant, contract: str):
        self.variant = variant
        self.fn = None
        self.reason: Optional[str] = None
        self.seconds = 0.0
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                # compiling touches deprecated TorchScript helpers inside torch: not the user's concern
                warnings.simplefilter("ignore", DeprecationWarning)
                self.fn, self.reason = self._compile(variant, contract)
        except Exception as exc:  # no compiler, no torch.compile, an Inductor error: not used
            self.reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        self.seconds = time.perf_counter() - start

    @staticmethod
    def _compile(variant: _Variant, contract: str):
        """(compiled function, None) when it passes the self-test, else (None, what differed)."""
        import torch._dynamo  # noqa: F401  (ImportError where torch.compile is absent)

        # A code object of its own per variant: torch.compile keeps one cache per code
        # object, so variants never count against each other's recompilation limit.
        code = _step_math.__code__.replace(co_name=f"_step_math_{abs(hash(variant))}")
        fn = types.FunctionType(code, _step_math.__globals__, code.co_name)
        fn.__kwdefaults__ = dict(amsgrad=variant.amsgrad, maximize=variant.maximize, lerp_small=variant.lerp_small)
        compiled = torch.compile(
            fn, dynamic=True, fullgraph=True, options={"cpp.enable_floating_point_contract_flag": contract}
        )
        ok, why = _self_test(compiled, variant)
        return (compiled, None) if ok else (None, why)


def _self_test(fn, variant: _Variant) -> tuple[bool, str]:
    """Run ``fn`` and torch's fused op on the same data; (all bits equal, what differed)."""
    n = 64 * 1024
    gen = torch.Generator().manual_seed(1234)
    scale = torch.logspace(-6, 1, n, dtype=torch.float64)[torch.randperm(n, generator=gen)]
    master = (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(variant.out_dtype or torch.float32).float()
    grad = (torch.randn(n, generator=gen, dtype=torch.float64) * scale.flip(0)).to(variant.grad_dtype)
    grad[::97] = 0
    exp_avg = torch.randn(n, generator=gen) * 1e-3
    exp_avg_sq = torch.rand(n, generator=gen) * 1e-4
    exp_avg_sq[::101] = 0
    max_exp_avg_sq = exp_avg_sq * torch.rand(n, generator=gen) * 2
    beta1 = 0.9 if variant.lerp_small else 0.3
    hyper = dict(lr=3e-3, beta1=beta1, beta2=0.999, weight_decay=0.1, eps=1e-8)
    step = 5.0

    ref = [master.clone(), exp_avg.clone(), exp_avg_sq.clone(), max_exp_avg_sq.clone()]
    torch._fused_adamw_(
        [ref[0]], [grad.float()], [ref[1]], [ref[2]], [ref[3]] if variant.amsgrad else [],
        [torch.tensor(step)], amsgrad=variant.amsgrad, maximize=variant.maximize, **hyper,
    )
    ref.append(ref[0].to(variant.out_dtype) if variant.out_dtype is not None else None)

    ours = [master.clone(), exp_avg.clone(), exp_avg_sq.clone(), max_exp_avg_sq.clone()]
    out = torch.empty(n, dtype=variant.out_dtype) if variant.out_dtype is not None else None
    fn(ours[0], grad, ours[1], ours[2], ours[3] if variant.amsgrad else None, out, _scalars(step, **hyper))
    ours.append(out)

    names = ["master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "model copy"]
    for name, a, b in zip(names, ours, ref):
        if b is None or (name == "max_exp_avg_sq" and not variant.amsgrad):
            continue
        view = torch.int16 if a.element_size() == 2 else torch.int32
        differ = int((a.view(view) != b.view(view)).sum())
        if differ:
            return False, f"the compiled loop differs from torch's fused AdamW in {differ} of {n} elements of {name}"
    return True, ""


_lock = threading.Lock()
_variants: dict[tuple[_Variant, str], _Compiled] = {}
_warned: set = set()


def _get(variant: _Variant, contract: str = "fast") -> _Compiled:
    with _lock:
        entry = _variants.get((variant, contract))
        if entry is None:
            entry = _variants[(variant, contract)] = _Compiled(variant, contract)
            if entry.fn is None and entry.reason not in _warned:
                _warned.add(entry.reason)
                warnings.warn(
                    f"offload_adamw: the compiled host kernel is not used for {variant.name()} "
                    f"({entry.reason}); the blocked kernel runs instead, with the same results",
                    RuntimeWarning,
                    stacklevel=4,
                )
        return entry


def _compiler_active() -> bool:
    """False where torch.compile would run the function eagerly (different bits): dynamo
    disabled, or a stance other than the default (``torch.compiler.set_stance``)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return True  # not imported yet: compiling imports it, and the self-test checks the result
    if getattr(dynamo.config, "disable", False):
        return False
    stance = getattr(getattr(dynamo, "eval_frame", None), "_stance", None)
    return stance is None or getattr(stance, "stance", "default") == "default"


def compiled_kernel_status() -> list[dict]:
    """Each variant compiled so far in this process: name, usable, compile (and self-test) seconds, reason."""
    with _lock:
        return [
            dict(variant=v.name(), contract=c, usable=e.fn is not None, compile_seconds=e.seconds, reason=e.reason)
            for (v, c), e in _variants.items()
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
        entry = _get(variant, contract)
        if entry.fn is None:
            continue
        step = float(steps[i].item())
        scalars = scalars_at.get(step)
        if scalars is None:
            scalars = scalars_at[step] = _scalars(
                step, float(hp.lr), float(hp.beta1), float(hp.beta2), float(hp.weight_decay), float(hp.eps)
            )
        flat = lambda t: t.view(-1)[:stop]  # noqa: E731
        entry.fn(
            flat(master),
            flat(grads[i]),
            flat(exp_avgs[i]),
            flat(exp_avg_sqs[i]),
            flat(max_exp_avg_sqs[i]) if hp.amsgrad else None,
            None if out is None else flat(out),
            scalars,
        )
        done[i] = stop
    return done
