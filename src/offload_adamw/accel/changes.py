"""What may change between a backward whose updates ran and ``step()``: hyperparameters and parameters.

Contract (docs/update-in-backward.md#the-protocol-what-is-refused-and-when):

* :class:`Snapshot` keeps, when a backward begins, every group's hyperparameters an update reads
  (:data:`HYPER_KEYS`; a tensor, which torch's schedulers fill in place, cloned without a wait for its device)
  and the optimizer's own settings (:data:`OPTIMIZER_KEYS`); :meth:`Snapshot.changes` names each that differs
  now (values compared, a NaN equal to a NaN).
* :func:`mark` marks a parameter after its update: its version counter and data pointer, which every torch
  operation on it moves, and, for a tensor in host memory, a fingerprint of its bits (:func:`fingerprint`),
  since a write through ``p.data`` moves no version counter. The fingerprint is taken by the update as it
  leaves the parameter, on the worker thread while backward goes on (:func:`values_of`), and stays a tensor
  (no value is read back); the version counter and the data pointer when backward has ended (whatever
  backward itself did to them, FSDP2's resharding or our own landings, is not an edit). :func:`changed` tells
  whether a parameter is no longer as marked (one more read of it, at ``step()``). On an accelerator
  only the version counter and the data pointer tell, as for edits between steps
  (docs/contract.md#edits-between-steps): reading every parameter back would cost a copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from offload_adamw.accel import streams

__all__ = ["HYPER_KEYS", "Mark", "OPTIMIZER_KEYS", "Snapshot", "changed", "fingerprint", "hyper_of", "mark", "values_of"]

#: the keys of a group an update reads, in the order a refusal names them
HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "fused")
#: the optimizer's own settings the updates of a step read
OPTIMIZER_KEYS = ("max_grad_norm", "nonfinite")


def _value(x: Any) -> Any:
    """A hyperparameter by value: a tensor (lr, betas) as its number, so that a tensor filled in place is seen."""
    if isinstance(x, Tensor):
        return float(x.detach().to("cpu").reshape(()).item()) if x.numel() == 1 else tuple(x.detach().to("cpu").tolist())
    if isinstance(x, (tuple, list)):
        return tuple(_value(y) for y in x)
    return x


def _same(a: Any, b: Any) -> bool:
    return bool(a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b))


def hyper_of(group: dict[str, Any]) -> tuple:
    """The values an update reads from its group (tensors by value)."""
    return tuple(_value(group.get(key)) for key in HYPER_KEYS)


def _kept(x: Any) -> Any:
    """``x`` as it is now: a tensor (filled in place by torch's schedulers) cloned, without a wait for its device."""
    if isinstance(x, Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return tuple(_kept(y) for y in x)
    return x


class Snapshot:
    """The hyperparameters of every group and the optimizer's settings when a backward began."""

    __slots__ = ("groups", "settings")

    def __init__(self, optimizer: Any) -> None:
        self.groups = [tuple(_kept(group.get(key)) for key in HYPER_KEYS) for group in optimizer.param_groups]
        self.settings = tuple(_kept(getattr(optimizer, key, None)) for key in OPTIMIZER_KEYS)

    def changes(self, optimizer: Any) -> list[str]:
        """What differs now, each as 'param_groups[i]['key'] ... (from old to new)'; empty when nothing does."""
        out = []
        for gi, (kept, group) in enumerate(zip(self.groups, optimizer.param_groups)):
            before = tuple(_value(x) for x in kept)
            for key, old, new in zip(HYPER_KEYS, before, hyper_of(group)):
                if not _same(old, new):
                    out.append(f"param_groups[{gi}][{key!r}] changed between backward and step() (from {old!r} to {new!r})")
        if len(self.groups) != len(optimizer.param_groups):
            out.append(f"param_groups changed between backward and step() ({len(self.groups)} groups, now "
                       f"{len(optimizer.param_groups)})")
        for key, kept_setting in zip(OPTIMIZER_KEYS, self.settings):
            old, new = _value(kept_setting), _value(getattr(optimizer, key, None))
            if not _same(old, new):
                out.append(f"{key} changed between backward and step() (from {old!r} to {new!r})")
        return out


#: (version counter, data pointer, fingerprint or None) of a parameter after its update
Mark = tuple[int, int, Tensor | None]


def fingerprint(t: Tensor) -> Tensor:
    """The wrapping int64 sum of ``t``'s bytes read as 8-byte words (the last, shorter word byte by byte), as a
    tensor: a change of any element changes it (a sum over a group), unless other changes cancel it exactly or
    only elements are swapped. One read of the tensor at memory speed (a third of a host update's time)."""
    flat = t.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    raw = flat.reshape(-1).view(torch.uint8)
    words = raw.numel() // 8 * 8
    try:
        head = raw[:words].view(torch.int64).sum()
    except RuntimeError:  # a tensor whose storage offset is not a multiple of 8 bytes
        head = raw[:words].clone().view(torch.int64).sum()
    return torch.stack([head, raw[words:].to(torch.int64).sum()])


def _in_host_memory(local: Tensor) -> bool:
    return local.device.type == "cpu" and not streams.is_device_tensor(local)


def values_of(local: Tensor) -> Tensor | None:
    """The fingerprint of ``local`` where it lives in host memory (the update takes it as it leaves the tensor),
    else None."""
    return fingerprint(local) if _in_host_memory(local) else None


def mark(local: Tensor, values: Tensor | None) -> Mark:
    """What tells a later edit of ``local`` (a parameter's local tensor) apart: its version counter and data pointer
    now, and ``values``, its fingerprint from :func:`values_of` (see the module contract)."""
    return local._version, local.data_ptr(), values


def changed(local: Tensor, before: Mark) -> bool:
    """Whether ``local`` is no longer as :func:`mark` found it."""
    version, pointer, sums = before
    if local._version != version or local.data_ptr() != pointer:
        return True
    return sums is not None and not torch.equal(fingerprint(local), sums)
