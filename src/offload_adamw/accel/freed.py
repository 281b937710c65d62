"""What ``p.grad`` holds while a parameter's gradient lives in host memory only (``offload_gradients=True``).

Contract:

* After backward's hook has moved a gradient to its host buffer, ``p.grad`` is a
  :class:`HostResidentGradient`: a tensor of the parameter's shape, dtype and device that owns no
  memory (a wrapper without storage); for a DTensor parameter (FSDP2) it is a DTensor with the
  gradient's mesh and placements whose local tensor is that wrapper, so torch's DTensor clipping
  still reduces the norm across ranks. Code that reads ``p.grad`` therefore still sees that the
  parameter has a gradient, and what it does to it reaches the host buffer, the gradient itself:

  - the norms ``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm`` compute
    (``linalg_vector_norm``, ``_foreach_norm``) are computed on the host buffer, with the same op;
  - the in-place scaling of ``clip_grads_with_norm_`` (``mul_``, ``_foreach_mul_``) scales the host
    buffer; GradScaler's ``_amp_foreach_non_finite_check_and_unscale_`` unscales and checks it;
  - ``zero_`` / ``_foreach_zero_`` (``zero_grad(set_to_none=False)``) zero it;
  - an in-place ``add_`` of a gradient into it (FSDP2's accumulation of a reduced micro-batch, autograd's
    accumulation as compiled autograd traces it) adds onto the host buffer, in the gradient's dtype, as
    autograd's accumulation does, through the owner's ``accumulate`` (the pipeline copies the addend to
    the host without blocking and adds it on its accumulator thread);
  - ``p.grad = None`` (``model.zero_grad()``, what HF Trainer calls) is seen by the pipeline at the
    next backward or step, which then clears the host gradient as well.

  So ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, ``model.zero_grad()`` and the
  clipping of HF Trainer, accelerate and Lightning act on the real gradient.
* Any other operation raises a RuntimeError that names the operation and says what to call
  instead: nothing reads a gradient that is not there and silently gets something else.
* Norms computed here are host tensors moved to the parameter's device (as torch returns them); with
  an accelerator the host's summation order can differ from the device's in the last bits of the norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["HostResidentGradient", "is_host_resident"]

_aten = torch.ops.aten

_READS = {_aten.linalg_vector_norm.default, _aten._foreach_norm.Scalar}
_SCALES = {_aten.mul_.Tensor, _aten.mul_.Scalar, _aten._foreach_mul_.Tensor, _aten._foreach_mul_.Scalar, _aten._foreach_mul_.List}
_ZEROES = {_aten.zero_.default, _aten._foreach_zero_.default}
_UNSCALE = _aten._amp_foreach_non_finite_check_and_unscale_.default
_DETACH = {_aten.detach_.default}


class HostResidentGradient(Tensor):
    """Stands in ``p.grad`` for a gradient that lives in a host buffer (see the module contract)."""

    @staticmethod
    def __new__(cls, like: Tensor, resolve: Callable[[], Tensor], describe: Callable[[], str],
                zero: Callable[[], None] | None = None,
                accumulate: Callable[[Tensor], None] | None = None) -> HostResidentGradient:
        return Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device, requires_grad=False)

    def __init__(self, like: Tensor, resolve: Callable[[], Tensor], describe: Callable[[], str],
                 zero: Callable[[], None] | None = None, accumulate: Callable[[Tensor], None] | None = None) -> None:
        self._resolve = resolve  # -> the complete host gradient (waits for its copies)
        self._describe = describe
        self._zero = zero  # zeroes the host gradient (zero_grad(set_to_none=False)); None: through _resolve
        self._accumulate = accumulate  # adds a device tensor onto the host gradient (FSDP2's accumulation); None: here

    # torch's stub gives Tensor.__repr__ a tensor_contents keyword, which only torch's own printing passes
    def __repr__(self) -> str:  # type: ignore[override]  # no data to print: say where it is
        return f"HostResidentGradient(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}: in host memory)"

    # torch's documented way to turn off __torch_function__ for a subclass; its stub types it as a plain function
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DETACH:
            return args[0]
        holders: list[HostResidentGradient] = []

        def host(x: Any) -> Any:
            if isinstance(x, HostResidentGradient):
                holders.append(x)
                return x._resolve()
            if isinstance(x, Tensor) and x.device.type != "cpu":
                return x.to("cpu")  # a clip coefficient or scale on the device
            if isinstance(x, (list, tuple)):
                return type(x)(host(y) for y in x)
            return x

        if func in _READS:
            out = func(*host(args), **{k: host(v) for k, v in kwargs.items()})
            device = holders[0].device
            return [t.to(device) for t in out] if isinstance(out, (list, tuple)) else out.to(device)
        if func in _ZEROES and all(x._zero is not None for x in _flat(args) if isinstance(x, HostResidentGradient)):
            for x in _flat(args):
                if isinstance(x, HostResidentGradient) and x._zero is not None:
                    x._zero()
            return None if func.__name__.startswith("_foreach") else args[0]
        if func in _SCALES or func in _ZEROES:
            func(*host(args), **{k: host(v) for k, v in kwargs.items()})
            return None if func.__name__.startswith("_foreach") else args[0]
        into, other = (args[0], args[1]) if func is _aten.add_.Tensor else (None, None)
        if isinstance(into, HostResidentGradient) and isinstance(other, Tensor) and not isinstance(other, HostResidentGradient):
            # Accumulation into p.grad that did not pass the pipeline's pre-accumulation hook (FSDP2's reduced
            # micro-batch, compiled autograd's in-place add): the same add, old + new in the gradient's dtype.
            if into._accumulate is not None and not kwargs:
                into._accumulate(other.detach())
            else:
                into._resolve().add_(other.detach().to("cpu"), **kwargs)
            return into
        if func is _UNSCALE:
            grads, found_inf, inv_scale = args
            host_found = torch.zeros((), dtype=torch.float32)
            func(host(list(grads)), host_found, inv_scale.detach().to("cpu", torch.float32))
            found_inf.add_(host_found.to(found_inf.device))
            return None
        culprit = next((x for x in _flat(args) if isinstance(x, HostResidentGradient)), None)
        where = culprit._describe() if culprit is not None else "a parameter"
        raise RuntimeError(
            f"the gradient of {where} lives in host memory (OffloadAdamW offload_gradients=True) and p.grad only "
            f"stands for it; {func} cannot run on it. Read it with opt.gradient(p) or opt.gradient_tensors(); "
            "clip with torch.nn.utils.clip_grad_norm_, opt.clip_grad_norm_ or OffloadAdamW(max_grad_norm=...); "
            "under DistributedDataParallel call opt.attach(ddp_model) before the first backward; "
            "or use offload_gradients=False"
        )


def _flat(x: Any):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    else:
        yield x


def is_host_resident(grad: Any) -> bool:
    """Whether ``grad`` (a ``p.grad``) stands for a gradient held in host memory.

    A DTensor gradient (FSDP2) stands for one when its local tensor does: the DTensor keeps the mesh and
    placements, so torch's clipping still reduces the norm across ranks, while the shard is in host memory.
    """
    return isinstance(grad, HostResidentGradient) or isinstance(getattr(grad, "_local_tensor", None), HostResidentGradient)
