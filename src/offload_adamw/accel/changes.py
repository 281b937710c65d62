"""What may change between a backward whose updates ran and ``step()``: hyperparameters and parameters.

Contract (docs/update-in-backward.md#the-protocol-what-is-refused-and-when):

* :class:`Snapshot` keeps, when a backward begins, every group's hyperparameters an update reads
  (:data:`HYPER_KEYS`; a tensor, which torch's schedulers fill in place, cloned without a wait for its device)
  and the optimizer's own settings (:data:`OPTIMIZER_KEYS`); :meth:`Snapshot.changes` names each that differs
  now (values compared, a NaN equal to a NaN).
* :func:`mark` marks a parameter after its update: its version counter and data pointer, which every torch
  operation on it moves, and a fingerprint of its bits, since a write through ``p.data`` moves no version
  counter. For a tensor in host memory (:func:`fingerprint`) the update takes it as it leaves the parameter, on
  the worker thread while backward goes on. For a tensor on an accelerator (the transfer engine tells which;
  :meth:`DeviceFingerprints.take`) it is computed on the device, on the current stream, once that stream has
  waited for the update's copies back (the caller orders it), and stays there: no value is read back. The version
  counter and the data pointer are taken when backward has ended (whatever backward itself did to them, FSDP2's
  resharding or our own landings, is not an edit).
* :func:`changed` tells which marked parameters are no longer as marked, at ``step()``: a host fingerprint is
  compared at once, the device fingerprints of a device all together, with one read back of one small tensor
  per device (one synchronisation per step, not one per parameter).
* A fingerprint is not a proof. Both are sums modulo 2**64 of the tensor's bytes read as 64-bit words (a tail
  shorter than a word byte by byte): an edit of one word always changes them. The host one is the plain sum (an
  edit that only swaps words, or whose changes cancel exactly, is not seen); the device one adds a sum weighted
  by each word's position (row and column of a view of the words as rows of :data:`COLUMNS`), so that swaps are
  seen too; an edit goes unseen only if its changes cancel in both sums exactly (docs/update-in-backward.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["COLUMNS", "DeviceFingerprints", "HYPER_KEYS", "Mark", "OPTIMIZER_KEYS", "Snapshot", "changed", "fingerprint",
           "hyper_of", "mark"]

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

    def __init__(self, groups: list[dict[str, Any]], settings: Any) -> None:
        self.groups = [tuple(_kept(group.get(key)) for key in HYPER_KEYS) for group in groups]
        self.settings = tuple(_kept(getattr(settings, key, None)) for key in OPTIMIZER_KEYS)

    def changes(self, groups: list[dict[str, Any]], settings: Any) -> list[str]:
        """What differs now, each as 'param_groups[i]['key'] ... (from old to new)'; empty when nothing does."""
        out = []
        for gi, (kept, group) in enumerate(zip(self.groups, groups)):
            before = tuple(_value(x) for x in kept)
            for key, old, new in zip(HYPER_KEYS, before, hyper_of(group)):
                if not _same(old, new):
                    out.append(f"param_groups[{gi}][{key!r}] changed between backward and step() (from {old!r} to {new!r})")
        if len(self.groups) != len(groups):
            out.append(f"param_groups changed between backward and step() ({len(self.groups)} groups, now "
                       f"{len(groups)})")
        for key, kept_setting in zip(OPTIMIZER_KEYS, self.settings):
            old, new = _value(kept_setting), _value(getattr(settings, key, None))
            if not _same(old, new):
                out.append(f"{key} changed between backward and step() (from {old!r} to {new!r})")
        return out


#: (version counter, data pointer, host fingerprint or None, device fingerprint or None) of a parameter after its update
Mark = tuple[int, int, Tensor | None, Tensor | None]

#: 64-bit words per row of the device fingerprint's view of a tensor as (rows, COLUMNS) words
COLUMNS = 4096
#: the weight of a word's column against its row's: odd, with its bits spread (2**64 over the golden ratio)
_COLUMN_WEIGHT = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    """``x`` modulo 2**64 as the int64 with those bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def _bytes(t: Tensor) -> Tensor:
    """``t``'s bytes as a 1-D uint8 tensor, in memory order: a view where ``t`` is dense (contiguous, or a permutation
    of contiguous such as channels_last), else a copy."""
    flat = t.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    if not flat.is_contiguous():
        strides = flat.stride()
        flat = flat.permute(sorted(range(flat.dim()), key=lambda d: -strides[d]))
    return flat.reshape(-1).view(torch.uint8)


def _whole_words(raw: Tensor) -> Tensor:
    """``raw``'s whole 64-bit words as int64 (the bytes after them, fewer than 8, left out)."""
    whole = raw.numel() // 8 * 8
    try:
        return raw[:whole].view(torch.int64)
    except RuntimeError:  # a tensor whose storage offset is not a multiple of 8 bytes
        return raw[:whole].clone().view(torch.int64)


def fingerprint(t: Tensor) -> Tensor:
    """The wrapping int64 sum of ``t``'s bytes read as 8-byte words (the last, shorter word byte by byte), as a
    tensor: a change of any element changes it (a sum over a group), unless other changes cancel it exactly or
    only elements are swapped. One read of the tensor at memory speed (a third of a host update's time)."""
    raw = _bytes(t)
    return torch.stack([_whole_words(raw).sum(), raw[raw.numel() // 8 * 8:].to(torch.int64).sum()])


class DeviceFingerprints:
    """Fingerprints of accelerator tensors, computed and kept on their device (see the module contract).

    The tensor's bytes are read as ``R`` whole rows of :data:`COLUMNS` 64-bit words ``w[r, c]`` and a last, partial
    row ``v[j]``: the words left over, then each byte after the last whole word as a word of its own. The fingerprint
    is the pair, modulo 2**64, (sum of every ``w`` and ``v``, sum of ``(r + 1 + K * (c + 1)) * w[r, c]`` and of
    ``(R + 1 + K * (j + 1)) * v[j]``), ``K`` an odd constant. It is computed from the row sums and the column sums of
    the whole rows (two reads of the tensor, two reductions) and the last row's words one by one, with weights kept
    per device and size. The tensors of a device without a whole row (most of a model's tensors: biases, norms) are
    taken together, in a few kernels for all of them (their launches are most of the cost of small tensors).
    """

    def __init__(self) -> None:
        self._weights: dict[tuple[torch.device, int, int], Tensor] = {}
        self._batches: dict[tuple[torch.device, tuple[int, ...]], tuple[Tensor, Tensor]] = {}  # weights, bounds

    def take(self, t: Tensor) -> Tensor:
        """The fingerprint of ``t`` as an int64 tensor of 2 elements on ``t``'s device, computed on its current stream
        (nothing is read back)."""
        return self.take_all([t])[0]

    def take_all(self, tensors: list[Tensor]) -> list[Tensor]:
        """:meth:`take` of each tensor (those of a device without a whole row together)."""
        by_device: dict[torch.device, list[int]] = {}
        for k, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(k)
        out: list[Tensor] = [torch.empty(0)] * len(tensors)
        for members in by_device.values():
            for k, sums in zip(members, self._stacked([tensors[k] for k in members]).unbind(0)):
                out[k] = sums
        return out

    def _stacked(self, tensors: list[Tensor]) -> Tensor:
        """(len(tensors), 2): the fingerprints of tensors of one device."""
        out: list[Tensor | None] = [None] * len(tensors)
        small: dict[torch.device, list[tuple[int, Tensor, Tensor]]] = {}
        for k, t in enumerate(tensors):
            raw = _bytes(t)
            words, tail = _whole_words(raw), raw[raw.numel() // 8 * 8:]
            rows = words.numel() // COLUMNS
            if not rows:
                small.setdefault(t.device, []).append((k, words, tail))
                continue
            head = words[:rows * COLUMNS].view(rows, COLUMNS)
            rest = torch.cat([words[rows * COLUMNS:], tail.to(torch.int64)])
            weights = self._weights_for(t.device, rows, rest.numel())
            out[k] = (torch.cat([head.sum(1), head.sum(0), rest]).unsqueeze(0) * weights).sum(1)
        for device, members in small.items():
            for k, sums in zip([k for k, _, _ in members], self._take_small(device, members).unbind(0)):
                out[k] = sums
        return torch.stack([t for t in out if t is not None])

    def _take_small(self, device: torch.device, members: list[tuple[int, Tensor, Tensor]]) -> Tensor:
        """(len(members), 2): each member's words and tail bytes, all in one row, weighed and summed per member."""
        tails = [tail for _, _, tail in members if tail.numel()]
        wide = iter(torch.cat(tails).to(torch.int64).split([t.numel() for t in tails]) if tails else [])
        parts = [part for _, words, tail in members for part in ((words, next(wide)) if tail.numel() else (words,))]
        lengths = tuple(words.numel() + tail.numel() for _, words, tail in members)
        key = (device, lengths)
        if key not in self._batches:
            if len(self._batches) >= 8:  # the sets of parameters a step marks vary little: keep a few
                self._batches.clear()
            weights = torch.cat([self._weights_for(device, 0, n) for n in lengths], dim=1)
            ends = torch.tensor(lengths).cumsum(0)  # each member's sums: running sums at its end less at its start
            self._batches[key] = (weights, torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(device))
        weights, bounds = self._batches[key]
        running = (torch.cat(parts).unsqueeze(0) * weights).cumsum(1)  # modulo 2**64: differences stay exact
        running = torch.cat([torch.zeros(2, 1, dtype=torch.int64, device=device), running], dim=1)
        return (running[:, bounds[1:]] - running[:, bounds[:-1]]).t()

    def _weights_for(self, device: torch.device, rows: int, rest: int) -> Tensor:
        """(2, rows + COLUMNS + rest) int64 weights, or (2, rest) without rows: the first line sums the words (row sums
        and the last row's words), the second weighs each by ``c(i)``."""
        key = (device, rows, rest)
        weights = self._weights.get(key)
        if weights is None:
            last = [_signed(rows + 1 + _COLUMN_WEIGHT * (j + 1)) for j in range(rest)]
            plain = torch.ones(rest, dtype=torch.int64)
            weighed = torch.tensor(last, dtype=torch.int64)
            if rows:
                plain = torch.cat([torch.ones(rows, dtype=torch.int64), torch.zeros(COLUMNS, dtype=torch.int64), plain])
                weighed = torch.cat([torch.arange(1, rows + 1, dtype=torch.int64),
                                     torch.tensor([_signed(_COLUMN_WEIGHT * (c + 1)) for c in range(COLUMNS)],
                                                  dtype=torch.int64), weighed])
            weights = self._weights[key] = torch.stack([plain, weighed]).to(device)
        return weights

    def changed(self, items: list[tuple[Tensor, Tensor]]) -> list[bool]:
        """For each (tensor, its fingerprint as taken before), whether the tensor's fingerprint differs now: all the
        tensors of a device compared in one stacked comparison, read back once per device."""
        out = [False] * len(items)
        by_device: dict[torch.device, list[int]] = {}
        for k, (t, _) in enumerate(items):
            by_device.setdefault(t.device, []).append(k)
        for members in by_device.values():
            now = self._stacked([items[k][0] for k in members])
            before = torch.stack([items[k][1] for k in members])
            for k, differs in zip(members, (now != before).any(1).tolist()):  # the one read back of this device
                out[k] = bool(differs)
        return out


def mark(local: Tensor, values: Tensor | None, device_values: Tensor | None = None) -> Mark:
    """What tells a later edit of ``local`` (a parameter's local tensor) apart: its version counter and data pointer
    now, ``values``, its host fingerprint from :func:`fingerprint`, and ``device_values``, its device fingerprint from
    :meth:`DeviceFingerprints.take` (see the module contract)."""
    return local._version, local.data_ptr(), values, device_values


def changed(marked: list[tuple[Tensor, Mark]], fingerprints: DeviceFingerprints | None = None) -> list[bool]:
    """For each (parameter's local tensor, its mark), whether it is no longer as :func:`mark` found it; the device
    fingerprints are compared together (one read back per device)."""
    out = [False] * len(marked)
    on_devices: list[int] = []
    for k, (local, (version, pointer, sums, device_sums)) in enumerate(marked):
        if local._version != version or local.data_ptr() != pointer:
            out[k] = True
        elif sums is not None:
            out[k] = not torch.equal(fingerprint(local), sums)
        elif device_sums is not None:
            on_devices.append(k)
    if on_devices:
        assert fingerprints is not None  # who took the device fingerprints compares them
        items = []
        for k in on_devices:
            local, (*_, device_sums) = marked[k]
            assert device_sums is not None
            items.append((local, device_sums))
        for k, differs in zip(on_devices, fingerprints.changed(items)):
            out[k] = differs
    return out
