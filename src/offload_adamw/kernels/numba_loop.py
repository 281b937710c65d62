"""The mixed-precision host step as one loop compiled by numba: the default fast path, checked bit for bit.

Contract:

* :func:`plan` takes the blocked kernel's mixed tensors (float32 master, bf16 /
  fp16 / float32 gradient, optional bf16 / fp16 / float32 model copy: float32 is
  the staging copy of a float32 parameter on an accelerator) and returns, for
  each tensor it takes, the first element it leaves to the caller (a multiple
  of 64), plus the batches of work that update everything before it with exactly
  the bits of the parity definition (docs/contract.md#state-precision: torch's fused CPU
  AdamW on the float32 master fed the widened gradient, then the
  round-to-nearest cast). The caller (blocked.py) runs those batches on its
  worker threads and the last ``n % 64`` elements of each tensor, and every
  tensor this module declines, through its chunk loop.
* One pass over memory: each element's gradient is read once, master, m and v
  read and written once, the model copy written once; no temporary beyond a
  block buffer of a few KiB. On x86-64 the model copy of each 1024-element
  block is buffered and then written with streaming stores where its address is
  64-byte aligned (an sfence ends each call), so its cache lines are not read
  from memory before being overwritten: 28 bytes of traffic per bf16 element,
  what torch's fused float32 step moves. Where the model copy is the parameter
  itself (a host parameter, whose edits between steps are taken over:
  kernels/edits.py) it is read first, in the same pass: 30 bytes per element;
  its lines are then in cache, and it is written with plain stores (streaming
  stores measured 2 to 9 percent slower there, on the llama-layers mix).
* No C++ compiler: numba ships LLVM inside its wheel; it is imported at the
  first mixed step. Each variant (gradient and model-copy dtype, amsgrad,
  maximize, lerp branch, tensor lr) is compiled at its first use (1 to 3 s;
  numba's on-disk cache makes later processes faster) and then self-tested
  against ``torch._fused_adamw_`` on 64 Ki varied elements; it is used only if
  every bit agrees. Anything that fails (numba not
  installed or broken, a compile error, a differing bit) leaves the variant
  unused, with the reason kept (:func:`numba_kernel_status`) and one warning
  per variant; the chunk loop then runs, so results never change, only the
  speed. Inside a region torch.compile traces, the path steps aside silently.
* Threads: each batch is one call of a numba function compiled with
  ``nogil=True`` and no threading layer of its own (``parallel=False``): the
  caller's ``workers`` threads (the optimizer's ``host_threads``: the cores this
  rank may use, distributed/node.py) run the batches in parallel, and nothing in
  this module survives a fork in a state that could hang the child.

Why the bits are the same. torch's fused kernel computes, per vector of
elements (aten/src/ATen/native/cpu/FusedAdamKernel.cpp; whichever variant its
dispatcher runs is what the self-test compares):

    p     = theta * (1 - lr*wd)                      (skipped when wd == 0; the factor is read back from the op)
    m     = fma(c, g - m, base)                      c, base: w, m if |w| < 0.5 else w - 1, g  (w = 1 - beta1)
    v     = fma((1 - beta2) * g, g, v * beta2)       torch's build contracts this one
    denom = sqrt(v) / sqrt(1 - beta2^t) + eps        (sqrt(max(v_max, v)) with amsgrad)
    theta = p + (-lr / (1 - beta1^t)) * m / denom

with every scalar rounded from double to float32. The loop here writes the same
operations in the same order, with the two fused multiply-adds as explicit
``llvm.fma.f32`` calls and no fast-math flags, so LLVM neither contracts nor
reorders anything else (the vectorizer may change the width, which changes no
bit of an element-wise computation). bf16 is handled as its 16 bits: widening is
``bits << 16``; narrowing rounds to nearest even on the float32 bits (NaN
becomes 0xFFFF, as torch's vectorized cast writes it). fp16 uses LLVM's
``fpext``/``fptrunc`` of ``half`` (round to nearest even). torch's scalar tail
(the last ``n % 16`` elements, computed partly in double) is never run here:
the caller leaves ``n % 64`` elements to torch's op itself. A NaN result stays
NaN but may carry another payload (the stated exception of the compiled loop it
replaces). Verified on torch 2.13.0+cpu, numba 0.68, CPU capability AVX512 (AMD
Zen 4); elsewhere the self-test decides.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import platform
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import Tensor

from offload_adamw.kernels.edits import take_model_edits_

__all__ = ["ALIGN", "compiled_kernel_status", "numba_kernel_status", "plan", "variant_key"]

#: The loop covers each tensor's first ``n - n % ALIGN`` elements: whole vectors for every
#: SIMD width up to 512 bits, so torch's fused op would also have run them in its vector
#: loop; the caller runs the rest through the fused op itself.
ALIGN = 64
#: Work per batch (one numba call): at least this many elements ...
_MIN_BATCH_ELEMENTS = 64 * 1024
#: ... and at least this many batches per worker thread, so that a worker the OS
#: deschedules on a shared machine does fewer batches instead of holding up the step.
_BATCHES_PER_WORKER = 4

_CPU = torch.device("cpu")
# Set by _define_numba_pieces() on first use, so that importing this module imports neither numpy nor numba;
# declared here (annotation only, no value) for the type checker.
np: Any
carray: Any
njit: Any
_f32_at: Any
_u16_at: Any
_fma: Any
_bf16_to_f32: Any
_f32_to_bf16: Any
_f16_to_f32: Any
_f32_to_f16: Any
_stream_line: Any
_store_fence: Any
# dtype -> the kind code the kernels are specialised on
_KIND = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
#: Streaming (non-temporal) stores of the model copy: x86-64 only (an sfence orders them).
_STREAMING = platform.machine().lower() in ("x86_64", "amd64")
_BLOCK = 1024  # elements per block: the model copy of a block is buffered (2 or 4 KiB, in L1) and then streamed
_WORK_COLUMNS = 8  # master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, model copy (addresses), elements, scalar row
_SCALAR_COLUMNS = 7  # decay, lerp coefficient, 1 - beta2, beta2, sqrt(bias correction 2), eps, -step size


# --------------------------------------------------------------- numba pieces

_numba_state: dict[str, Any] = {}
_numba_lock = threading.Lock()


def _load_numba() -> str | None:
    """Import numba and define the loop's LLVM pieces, once, at the first mixed step (importing
    numba takes about 0.3 s, which a process that never steps a mixed tensor does not pay).
    Returns None, or why numba is unavailable."""
    with _numba_lock:
        if "error" not in _numba_state:
            try:
                _define_numba_pieces()
                _numba_state["error"] = None
            except Exception as exc:  # not installed, or an install that does not import
                _numba_state["error"] = f"numba is not available ({type(exc).__name__}: {exc})".splitlines()[0][:300]
        error: str | None = _numba_state["error"]
        return error


def _define_numba_pieces() -> None:
    global np, carray, njit, _f32_at, _u16_at, _fma, _bf16_to_f32, _f32_to_bf16, _stream_line, _store_fence
    global _f16_to_f32, _f32_to_f16
    import numpy as np

    # numba and llvmlite as untyped modules: their pieces are used only to build the loop
    llvm_ir: Any = importlib.import_module("llvmlite.ir")
    numba: Any = importlib.import_module("numba")
    intrinsic: Callable[[Callable[..., Any]], Any] = importlib.import_module("numba.extending").intrinsic
    carray, njit, types = numba.carray, numba.njit, numba.types

    def _pointer_intrinsic(element: Any) -> Any:
        @intrinsic
        def pointer(typingctx: Any, address: Any) -> Any:
            sig = types.CPointer(element)(types.int64)

            def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
                return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

            return sig, codegen

        return pointer

    _f32_at = _pointer_intrinsic(types.float32)
    _u16_at = _pointer_intrinsic(types.uint16)

    @intrinsic
    def _fma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
        """a * b + c rounded once (llvm.fma.f32; never split into a product and a sum)."""
        sig = types.float32(types.float32, types.float32, types.float32)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.fma(*args)

        return sig, codegen

    @intrinsic
    def _bf16_to_f32(typingctx: Any, bits: Any) -> Any:
        sig = types.float32(types.uint16)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            wide = builder.shl(builder.zext(args[0], llvm_ir.IntType(32)), llvm_ir.Constant(llvm_ir.IntType(32), 16))
            return builder.bitcast(wide, llvm_ir.FloatType())

        return sig, codegen

    @intrinsic
    def _f32_to_bf16(typingctx: Any, value: Any) -> Any:
        """Round to nearest even on the float32 bits; NaN -> 0xFFFF (torch's vectorized cast)."""
        sig = types.uint16(types.float32)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i32 = llvm_ir.IntType(32)
            bits = builder.bitcast(args[0], i32)
            lsb = builder.and_(builder.lshr(bits, llvm_ir.Constant(i32, 16)), llvm_ir.Constant(i32, 1))
            rounded = builder.lshr(builder.add(bits, builder.add(lsb, llvm_ir.Constant(i32, 0x7FFF))),
                                   llvm_ir.Constant(i32, 16))
            narrow = builder.trunc(rounded, llvm_ir.IntType(16))
            is_nan = builder.fcmp_unordered("uno", args[0], args[0])
            return builder.select(is_nan, llvm_ir.Constant(llvm_ir.IntType(16), 0xFFFF), narrow)

        return sig, codegen

    @intrinsic
    def _stream_line(typingctx: Any, destination: Any, source: Any) -> Any:
        """Copy one 64-byte line from ``source`` to the 64-byte aligned ``destination``, bypassing the cache."""
        sig = types.void(types.int64, types.intp)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            line = llvm_ir.VectorType(llvm_ir.IntType(32), 16)
            src = builder.inttoptr(args[1], line.as_pointer())
            dst = builder.inttoptr(args[0], line.as_pointer())
            value = builder.load(src, align=4)
            store = builder.store(value, dst, align=64)
            store.set_metadata("nontemporal", builder.module.add_metadata([llvm_ir.Constant(llvm_ir.IntType(32), 1)]))
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def _store_fence(typingctx: Any) -> Any:
        sig = types.void()

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            fn = builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=llvm_ir.FunctionType(llvm_ir.VoidType(), []))
            builder.call(fn, [])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def _f16_to_f32(typingctx: Any, bits: Any) -> Any:
        sig = types.float32(types.uint16)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.fpext(builder.bitcast(args[0], llvm_ir.HalfType()), llvm_ir.FloatType())

        return sig, codegen

    @intrinsic
    def _f32_to_f16(typingctx: Any, value: Any) -> Any:
        sig = types.uint16(types.float32)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(builder.fptrunc(args[0], llvm_ir.HalfType()), llvm_ir.IntType(16))

        return sig, codegen


def _make_kernel(grad_kind: str, out_kind: str | None, amsgrad: bool, maximize: bool, lerp_small: bool, cache: bool,
                 contract_v: bool = True, follow: bool = False) -> Any:
    """The loop of one variant, compiled by numba at its first call.

    ``work`` rows: addresses of master, gradient, m, v, max v, model copy (each at the
    row's first element), the element count (a multiple of 64) and the row of
    ``scalars`` to use. The variant's options are closure constants: numba prunes the
    branches they decide, so each variant is a straight loop that LLVM vectorizes.
    ``contract_v=False`` (tests only) rounds v's product and sum separately, a loop the
    self-test must refuse. ``follow``: the model copy holds the parameter's current value, read
    before the update; an element that differs from round(master) in its bits (a NaN equals a
    NaN) replaces its master by its widening (kernels/edits.py).
    """
    streaming = _STREAMING
    out_f32 = out_kind == "f32"

    def kernel(work: Any, scalars: Any) -> int:
        # The model copy of each block of elements is written to a small buffer first and
        # then, where the destination is 64-byte aligned, streamed to memory whole cache lines
        # at a time: a plain store would first read every line of the copy (2 or 4 more bytes
        # per element of traffic on a memory-bound step), a streaming store does not.
        block_f32 = np.empty(_BLOCK, dtype=np.float32)
        block_u16 = np.empty(_BLOCK, dtype=np.uint16)
        for r in range(work.shape[0]):
            n = work[r, 6]
            s = work[r, 7]
            decay = scalars[s, 0]
            coeff = scalars[s, 1]
            one_minus_beta2 = scalars[s, 2]
            beta2 = scalars[s, 3]
            bias_correction2_sqrt = scalars[s, 4]
            eps = scalars[s, 5]
            neg_step_size = scalars[s, 6]
            out_address = work[r, 5]
            # where the model copy was read in this pass (follow) its lines are in cache: plain stores
            stream = streaming and out_kind is not None and out_address % 64 == 0 and not follow
            for b in range(0, n, _BLOCK):
                size = min(_BLOCK, n - b)  # a multiple of 64
                # views of one block: the inner loop's index runs from 0 to size - 1, so LLVM knows it
                # is in range and non-negative and vectorizes the loop without index checks
                master = carray(_f32_at(work[r, 0] + 4 * b), size)
                exp_avg = carray(_f32_at(work[r, 2] + 4 * b), size)
                exp_avg_sq = carray(_f32_at(work[r, 3] + 4 * b), size)
                if grad_kind == "f32":
                    grad = carray(_f32_at(work[r, 1] + 4 * b), size)
                else:
                    grad = carray(_u16_at(work[r, 1] + 2 * b), size)
                if amsgrad:
                    max_exp_avg_sq = carray(_f32_at(work[r, 4] + 4 * b), size)
                else:
                    max_exp_avg_sq = exp_avg_sq  # not read
                if follow and out_f32:
                    model_f = carray(_f32_at(out_address + 4 * b), size)
                    model_h = block_u16  # not read
                elif follow:
                    model_f = block_f32  # not read
                    model_h = carray(_u16_at(out_address + 2 * b), size)
                else:
                    model_f, model_h = block_f32, block_u16  # not read
                for i in range(size):
                    if grad_kind == "f32":
                        g = grad[i]
                    elif grad_kind == "bf16":
                        g = _bf16_to_f32(grad[i])
                    else:
                        g = _f16_to_f32(grad[i])
                    if maximize:
                        g = -g
                    start = master[i]
                    if follow:
                        # the parameter's value where it is not round(master) (bits; NaN equals NaN)
                        if out_f32:
                            value = model_f[i]
                            same = (value == start and math.copysign(1.0, value) == math.copysign(1.0, start))
                        elif out_kind == "bf16":
                            bits = model_h[i]
                            value = _bf16_to_f32(bits)
                            same = bits == _f32_to_bf16(start)
                        else:
                            bits = model_h[i]
                            value = _f16_to_f32(bits)
                            same = bits == _f32_to_f16(start)
                        if not (same or (value != value and start != start)):
                            start = value
                    p = start * decay
                    m = exp_avg[i]
                    if lerp_small:
                        m_new = _fma(coeff, g - m, m)
                    else:
                        m_new = _fma(coeff, g - m, g)
                    if contract_v:
                        v_new = _fma(one_minus_beta2 * g, g, exp_avg_sq[i] * beta2)
                    else:
                        v_new = exp_avg_sq[i] * beta2 + one_minus_beta2 * g * g
                    if amsgrad:
                        old = max_exp_avg_sq[i]
                        # torch's maximum: NaN if either is NaN, else the larger (the new one on a tie)
                        v_max = old if (old > v_new or old != old) else v_new
                        max_exp_avg_sq[i] = v_max
                        root = math.sqrt(v_max)
                    else:
                        root = math.sqrt(v_new)
                    denom = root / bias_correction2_sqrt + eps
                    theta = p + neg_step_size * m_new / denom
                    master[i] = theta
                    exp_avg[i] = m_new
                    exp_avg_sq[i] = v_new
                    if out_f32:
                        block_f32[i] = theta
                    elif out_kind == "bf16":
                        block_u16[i] = _f32_to_bf16(theta)
                    elif out_kind == "f16":
                        block_u16[i] = _f32_to_f16(theta)
                if out_f32:
                    if stream:
                        for line in range(0, 4 * size, 64):
                            _stream_line(out_address + 4 * b + line, block_f32.ctypes.data + line)
                    else:
                        out_f = carray(_f32_at(out_address + 4 * b), size)
                        for j in range(size):
                            out_f[j] = block_f32[j]
                elif out_kind is not None:
                    if stream:
                        for line in range(0, 2 * size, 64):
                            _stream_line(out_address + 2 * b + line, block_u16.ctypes.data + line)
                    else:
                        out_h = carray(_u16_at(out_address + 2 * b), size)
                        for j in range(size):
                            out_h[j] = block_u16[j]
        if streaming:
            _store_fence()  # streamed lines are visible to other threads before the call returns
        return 0

    # error_model="numpy": IEEE division (x/0 is inf or NaN, as in torch), no Python exception check in the loop.
    return njit(nogil=True, cache=cache, error_model="numpy", fastmath=False, boundscheck=False)(kernel)


# ------------------------------------------------------------------ variants


@dataclass(frozen=True)
class _Variant:
    grad_dtype: torch.dtype
    out_dtype: torch.dtype | None
    amsgrad: bool
    maximize: bool
    lerp_small: bool
    tensor_lr: bool
    follow: bool = False

    def name(self) -> str:
        def short(d: torch.dtype | None) -> str:
            return "none" if d is None else str(d).replace("torch.", "")

        return (
            f"grad={short(self.grad_dtype)},out={short(self.out_dtype)},amsgrad={self.amsgrad},"
            f"maximize={self.maximize},lerp={'small' if self.lerp_small else 'large'},"
            f"lr={'tensor' if self.tensor_lr else 'float'}" + (",edits=taken" if self.follow else "")
        )


def _float_cache(maxsize: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``functools.lru_cache`` for functions of floats, keyed by each argument's value and sign: 0.0 == -0.0
    would share one entry, and whichever came first would answer for both (their float32 bits differ)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.lru_cache(maxsize=maxsize)
        def cached(signs: tuple[bool, ...], *args: float) -> Any:
            return fn(*args)

        @functools.wraps(fn)
        def call(*args: float) -> Any:
            return cached(tuple(math.copysign(1.0, a) < 0 for a in args), *args)

        return call

    return wrap


@_float_cache(maxsize=1024)
def _f32(x: float) -> float:
    """x rounded to float32 (as ``static_cast<float>`` of a double)."""
    return torch.tensor(x, dtype=torch.float64, device=_CPU).to(torch.float32).item()


def variant_key(grad_dtype: torch.dtype, out_dtype: torch.dtype | None, amsgrad: bool, maximize: bool, beta1: float,
                tensor_lr: bool = False, follow: bool = False) -> _Variant:
    """The loop variant a tensor and its group's options need."""
    return _Variant(grad_dtype, out_dtype, bool(amsgrad), bool(maximize), abs(_f32(1 - beta1)) < 0.5, bool(tensor_lr),
                    bool(follow))


@_float_cache(maxsize=256)
def _decay_factor(lr: float, weight_decay: float) -> float:
    """The float32 factor ``1 - lr * weight_decay`` exactly as torch's fused op has it.

    Read back from the op itself: on a parameter of ones with zero gradient and moments
    the update leaves ``1 * factor``. Its build may compute ``1 - lr * wd`` in double with
    one rounding (a fused multiply-add: torch 2.13's x86 build does) or with two; the two
    differ in float32 for about one (lr, wd) pair in 2**29, too rare for a self-test to
    see, so the constant is taken from the op instead of recomputed.
    """
    ones = torch.ones(2 * ALIGN, dtype=torch.float32, device=_CPU)
    zeros = [torch.zeros(2 * ALIGN, dtype=torch.float32, device=_CPU) for _ in range(3)]
    torch._fused_adamw_(
        [ones], [zeros[0]], [zeros[1]], [zeros[2]], [], [torch.ones((), dtype=torch.float32, device=_CPU)],
        lr=lr, beta1=0.9, beta2=0.999, weight_decay=weight_decay, eps=1e-8, amsgrad=False, maximize=False,
    )
    return ones[0].item()


@_float_cache(maxsize=1024)
def _scalars(step: float, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float) -> tuple[float, ...]:
    """The float32 constants of torch's fused kernel at this step, computed as it does (in double)."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    w = _f32(1 - beta1)
    coeff = w if abs(w) < 0.5 else _f32(w - 1.0)  # float32 subtraction, exact for w in [0.5, 1]
    return (_decay_factor(lr, weight_decay), coeff, _f32(1 - beta2), _f32(beta2), _f32(math.sqrt(bias_correction2)),
            _f32(eps), _f32(-step_size))


def _reason(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _address(t: Tensor, start: int) -> int:
    return t.data_ptr() + start * t.element_size()


def _run(kernel: Callable[..., Any], rows: Sequence[Sequence[int]], scalars: Sequence[Sequence[float]]) -> None:
    kernel(np.array(rows, dtype=np.int64).reshape(-1, _WORK_COLUMNS),
           np.array(scalars, dtype=np.float32).reshape(-1, _SCALAR_COLUMNS))


class _Entry:
    """One variant: its compiled loop, or the reason it is not used."""

    def __init__(self, variant: _Variant):
        self.variant = variant
        self.kernel: Callable[..., Any] | None = None
        self.reason: str | None = _load_numba()
        self.seconds = 0.0
        if self.reason is not None:
            return
        start = time.perf_counter()
        try:
            args = (_KIND[variant.grad_dtype], None if variant.out_dtype is None else _KIND[variant.out_dtype],
                    variant.amsgrad, variant.maximize, variant.lerp_small)
            try:
                kernel = _make_kernel(*args, cache=True, follow=variant.follow)
            except RuntimeError:  # numba found no writable cache directory: compile in memory each process
                kernel = _make_kernel(*args, cache=False, follow=variant.follow)
            why = _self_test(kernel, variant)
            self.kernel, self.reason = (None, why) if why else (kernel, None)
        except Exception as exc:  # a numba or LLVM error: not used
            self.kernel, self.reason = None, _reason(exc)
        self.seconds = time.perf_counter() - start


def _self_test(kernel: Callable[..., Any], variant: _Variant) -> str | None:
    """Run the loop and torch's fused op on the same data; None when all bits agree, else what differed.

    64 Ki elements over seven decades of magnitude, with exact zeros, -0.0, subnormal
    masters, moments and gradients, infinite gradients (NaN results compare as NaN:
    their payload is the documented exception), in two calls (two work rows, two
    step counts), the second at a storage offset.
    """
    n = 64 * 1024
    f32: dict[str, Any] = dict(dtype=torch.float32, device=_CPU)
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
    hyper: dict[str, Any] = dict(lr=3e-3, beta1=beta1, beta2=0.999, weight_decay=0.1, eps=1e-8)
    half = n // 2 + ALIGN  # two rows of unequal length, the second starting mid-tensor
    steps = (5.0, 1000.0)

    model = None
    if variant.follow and variant.out_dtype is not None:
        # the parameter as the last update left it (round(master)), then edited: values, the sign of a
        # zero, a NaN where the master is finite; and a NaN of another payload where the master is NaN
        # (not an edit)
        master[11::113] = math.nan
        model = master.to(variant.out_dtype, copy=True)
        model[9::61] = (model[9::61].float() * 1.5 + 0.25).to(variant.out_dtype)
        model[4::178] = 0.0
        model[12::127] = math.nan
        bits = torch.int16 if model.element_size() == 2 else torch.int32
        other_nan = {torch.bfloat16: 0x7FC1, torch.float16: 0x7E01, torch.float32: 0x7FC00001}[variant.out_dtype]
        model.view(bits)[11::113] = other_nan
    ref = [master.clone(), exp_avg.clone(), exp_avg_sq.clone(), max_exp_avg_sq.clone()]
    if model is not None:
        take_model_edits_(ref[0], model)
    lr = torch.tensor(hyper["lr"], dtype=torch.float32) if variant.tensor_lr else hyper["lr"]
    for (a, b), step in zip(((0, half), (half, n)), steps):
        torch._fused_adamw_(
            [ref[0][a:b]], [grad[a:b].float()], [ref[1][a:b]], [ref[2][a:b]], [ref[3][a:b]] if variant.amsgrad else [],
            [torch.tensor(step, **f32)], amsgrad=variant.amsgrad, maximize=variant.maximize,
            **{**hyper, "lr": lr},
        )
    ref_copy = ref[0].to(variant.out_dtype) if variant.out_dtype is not None else None

    ours = [master.clone(), exp_avg.clone(), exp_avg_sq.clone(), max_exp_avg_sq.clone()]
    out = torch.empty(n, dtype=variant.out_dtype, device=_CPU) if variant.out_dtype is not None else None
    if model is not None and out is not None:
        out.copy_(model)
    lr_value = float(lr.item()) if isinstance(lr, Tensor) else lr
    rows: list[list[int]] = []
    scalars: list[tuple[float, ...]] = []
    for k, ((a, b), step) in enumerate(zip(((0, half), (half, n)), steps)):
        scalars.append(_scalars(step, lr_value, beta1, hyper["beta2"], hyper["weight_decay"], hyper["eps"]))
        rows.append([_address(ours[0], a), _address(grad, a), _address(ours[1], a), _address(ours[2], a),
                     _address(ours[3], a), 0 if out is None else _address(out, a), b - a, k])
    _run(kernel, rows, scalars)

    names = ["master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "model copy"]
    for name, mine, theirs in zip(names, [*ours, out], [*ref, ref_copy]):
        if mine is None or theirs is None or (name == "max_exp_avg_sq" and not variant.amsgrad):
            continue
        view = torch.int16 if mine.element_size() == 2 else torch.int32
        differ = int(((mine.view(view) != theirs.view(view)) & ~(mine.isnan() & theirs.isnan())).sum())
        if differ:
            return f"the numba loop differs from torch's fused AdamW in {differ} of {n} elements of {name}"
    return None


_lock = threading.Lock()
_variants: dict[_Variant, _Entry] = {}
_warned: set[_Variant] = set()


def _forget_lock_after_fork() -> None:
    # A child forked while another thread compiled a variant would inherit the lock held forever.
    global _lock, _numba_lock
    _lock, _numba_lock = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_lock_after_fork)


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside this package and torch (the user's step call)."""
    inside = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(torch.__file__)))
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _get(variant: _Variant) -> _Entry:
    with _lock:
        entry = _variants.get(variant)
        if entry is None:
            entry = _variants[variant] = _Entry(variant)
        warn = entry.kernel is None and variant not in _warned
        if warn:
            _warned.add(variant)
    if warn:
        warnings.warn(
            f"offload_adamw: the numba host loop is not used for {variant.name()} ({entry.reason}); "
            "the chunk loop runs instead, with the same results, slower",
            RuntimeWarning,
            stacklevel=_caller_stacklevel(),
        )
    return entry


def numba_kernel_status() -> list[dict[str, Any]]:
    """Each variant built so far in this process: name, usable, compile (and self-test) seconds,
    reason, and the CPU capability torch dispatches its kernels to (the self-test's ground)."""
    capability = torch.backends.cpu.get_cpu_capability()
    with _lock:
        return [
            dict(variant=v.name(), usable=e.kernel is not None, compile_seconds=e.seconds, reason=e.reason,
                 cpu_capability=capability)
            for v, e in _variants.items()
        ]


def compiled_kernel_status() -> list[dict[str, Any]]:
    """Deprecated name of :func:`numba_kernel_status` (the torch.compile loop it reported on is gone:
    the numba loop is the default and as fast)."""
    warnings.warn("offload_adamw.compiled_kernel_status() is deprecated; use numba_kernel_status()",
                  DeprecationWarning, stacklevel=2)
    return numba_kernel_status()


def available() -> str | None:
    """None where numba imports, else why not."""
    return _load_numba()


def plan(
    masters: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    model_params: Sequence[Tensor | None] | None,
    hp: Any,
    indices: Sequence[int],
    *,
    workers: int,
    take_model_edits: Sequence[bool] | None = None,
) -> tuple[dict[int, int], list[Callable[[], None]]]:
    """The loop's share of the tensors ``indices`` (already stepped: ``steps[i]`` holds t).

    Returns ({i: first element not updated by the batches}, batches). Running every batch
    (in any order, on any threads, each once) updates each listed tensor's first
    ``done[i]`` elements (a multiple of 64); tensors absent from ``done`` are left to the
    caller (among them any whose master or moments are not float32, which the loop reads as float32).
    Where ``take_model_edits[i]``, the loop takes the model copy's edits first (kernels/edits.py).
    The inputs are the blocked kernel's: dense host tensors, the operands of each tensor in one layout,
    read and written in memory order from their first element (the k-th element in memory of each pairs
    with the k-th of the others).
    """
    done: dict[int, int] = {}
    if torch.compiler.is_compiling():
        return done, []  # traced by torch.compile: raw addresses mean nothing there
    tensor_lr = isinstance(hp.lr, Tensor)
    lr = float(hp.lr.item()) if tensor_lr else float(hp.lr)  # torch's tensor-lr overload reads it as a double
    hyper = (lr, float(hp.beta1), float(hp.beta2), float(hp.weight_decay), float(hp.eps))
    options = (bool(hp.amsgrad), bool(hp.maximize), abs(_f32(1 - hyper[1])) < 0.5, tensor_lr)
    entries: dict[tuple[Any, ...], _Entry | None] = {}  # (grad dtype, out dtype, edits taken) -> the variant's entry
    scalar_rows: dict[float, int] = {}
    scalars: list[tuple[float, ...]] = []
    pieces: dict[tuple[Any, ...], list[tuple[int, int, int]]] = {}  # (grad, out dtype, edits) -> [(tensor, elements, scalar row)]
    # Every tensor's step count, read in one call (an .item() per tensor is a microsecond each, at every step): the
    # same float32 values.
    try:
        counts = torch.stack([steps[i] for i in indices]).tolist()
    except RuntimeError:  # counts of different shapes (a load makes 0-d float32 ones; only a count assigned into
        # opt.state by hand has another shape): one at a time
        counts = [steps[i].item() for i in indices]
    float32 = torch.float32
    for i, step in zip(indices, counts):
        master = masters[i]
        n = master.numel()
        stop = n - n % ALIGN
        if stop == 0:
            continue
        out = model_params[i] if model_params is not None else None
        follow = bool(take_model_edits[i]) if take_model_edits is not None and out is not None else False
        dtypes = (grads[i].dtype, None if out is None else out.dtype, follow)
        if (master.dtype != float32 or dtypes[0] not in _KIND or (out is not None and dtypes[1] not in _KIND)
                or exp_avgs[i].dtype != float32 or exp_avg_sqs[i].dtype != float32
                or (hp.amsgrad and max_exp_avg_sqs[i].dtype != float32)):
            continue  # the loop reads float32 masters and moments (their addresses are stepped by 4 bytes below)
        if dtypes not in entries:
            variant = _Variant(dtypes[0], dtypes[1], *options, follow=follow)
            entry = _variants.get(variant) or _get(variant)
            entries[dtypes] = entry if entry.kernel is not None else None
        if entries[dtypes] is None:
            continue
        row = scalar_rows.get(step)
        if row is None:
            try:
                values = _scalars(float(step), *hyper)
            except ArithmeticError:  # a step count of 0 (1 - beta1**0 == 0): torch's op says what that gives
                continue
            row = scalar_rows[step] = len(scalars)
            scalars.append(values)
        pieces.setdefault(dtypes, []).append((i, stop, row))
        done[i] = stop
    if not done:
        return done, []

    total = sum(stop for work in pieces.values() for _, stop, _ in work)
    batch_elements = max(_MIN_BATCH_ELEMENTS, total // (_BATCHES_PER_WORKER * max(1, workers)))
    batch_elements -= batch_elements % ALIGN
    batches: list[Callable[[], None]] = []
    for dtypes, work in pieces.items():
        loop_entry = entries[dtypes]
        assert loop_entry is not None and loop_entry.kernel is not None  # dtypes without a kernel were skipped above
        kernel = loop_entry.kernel
        rows: list[list[int]] = []
        room = batch_elements
        # bytes per element of each operand, the same for every tensor of these dtypes (0: absent)
        sizes = [4, dtypes[0].itemsize, 4, 4, 4 if hp.amsgrad else 0, 0 if dtypes[1] is None else dtypes[1].itemsize]
        for i, stop, row_scalars in work:
            out = model_params[i] if model_params is not None else None
            # the first address of each operand; an absent one stays at address 0
            bases = [masters[i].data_ptr(), grads[i].data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(),
                     max_exp_avg_sqs[i].data_ptr() if hp.amsgrad else 0, 0 if out is None else out.data_ptr()]
            start = 0
            while start < stop:
                take = min(stop - start, room)
                # a tensor's first row starts at its bases (most tensors fit whole in a batch: one row each)
                rows.append([*bases, take, row_scalars] if start == 0 else
                            [a + start * size if a else 0 for a, size in zip(bases, sizes)] + [take, row_scalars])
                start += take
                room -= take
                if room == 0:
                    batches.append(functools.partial(_run, kernel, rows, scalars))
                    rows, room = [], batch_elements
        if rows:
            batches.append(functools.partial(_run, kernel, rows, scalars))
    return done, batches
