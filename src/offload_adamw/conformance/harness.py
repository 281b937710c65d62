"""How the conformance checker drives a candidate optimizer: building, stepping, observing, comparing.

Contract:

* A candidate is a factory ``factory(params, **hyperparameters) -> optimizer``. The
  checker speaks canonical AdamW hyperparameters (``lr``, ``betas``, ``eps``,
  ``weight_decay``, ``amsgrad``, ``maximize``); a :class:`HyperMapping` renames them
  for candidates with other signatures and adds fixed keyword arguments.
* Parameters are handed over with their names (``[(name, tensor), ...]``, accepted by
  torch>=2.6 optimizers) when the candidate takes them, else as plain tensors; the
  first construction decides and the choice is kept for the whole check.
* What the checker observes of a parameter is its master value: ``opt.master_param(p)``
  where the candidate has that method, else ``opt.state[p]["master_param"]``, else the
  parameter itself. Observations are float64 CPU copies.
* Nothing here touches the global RNG: data come from seeded generators and are
  rounded to values that bfloat16 and float16 hold exactly, so that every precision
  sees the same numbers.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from offload_adamw.contract import reference

__all__ = [
    "NotApplicable",
    "HyperMapping",
    "Harness",
    "Tolerance",
    "tolerance_for",
    "compare",
    "compare_band",
    "snap",
    "random_values",
    "hyper",
    "state_dtypes",
    "moment_dtypes",
    "state_tensors",
    "save_bytes",
    "load_bytes",
]

Grads = Mapping[str, Tensor | None]


class NotApplicable(Exception):
    """Raised inside a clause when the candidate cannot be asked the clause's question."""


class SetupError(AttributeError):
    """A set-up method named by the caller does not exist on the candidate's optimizer."""


CANONICAL_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
# Values that may be left out when the candidate has no such argument (mapped to None).
NEUTRAL = {"weight_decay": 0.0, "amsgrad": False, "maximize": False}
# Left out whatever their value when mapped to None: the candidate uses its own (clauses whose
# question depends on the exact value ask ``accepts`` first).
OWN_VALUE = ("eps",)
# Flags passed only when switched on, so that candidates without them need no mapping.
FLAGS = ("amsgrad", "maximize")


@dataclass(frozen=True, kw_only=True)
class HyperMapping:
    """How canonical AdamW hyperparameters reach a candidate's constructor and param groups."""

    names: Mapping[str, Any] = field(default_factory=dict)
    """canonical name -> the candidate's name; ``"betas"`` may map to two names
    (``["beta1", "beta2"]``); ``None`` means the candidate has no such argument."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """fixed keyword arguments for every construction (e.g. ``{"correct_bias": True}``)."""

    def __post_init__(self) -> None:
        for key, target in self.names.items():
            if key not in CANONICAL_KEYS:
                raise ValueError(f"mapping: unknown hyperparameter {key!r}; known: {', '.join(CANONICAL_KEYS)}")
            if target is None or isinstance(target, str):
                continue
            if (
                key == "betas"
                and isinstance(target, (list, tuple))
                and len(target) == 2
                and all(isinstance(t, str) for t in target)
            ):
                continue
            raise ValueError(
                f"mapping: {key!r} must map to a name, null" + (" or two names" if key == "betas" else "") + f", got {target!r}"
            )
        if self.names.get("lr", "lr") is None:
            raise ValueError("mapping: 'lr' cannot be null: every clause needs a learning rate")

    def accepts(self, key: str) -> bool:
        return self.names.get(key, key) is not None

    def translate(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Canonical values -> the candidate's keyword arguments (without ``extra``)."""
        out: dict[str, Any] = {}
        for key, value in values.items():
            if key in FLAGS and value is False:
                continue
            target = self.names.get(key, key)
            if target is None:
                if key in OWN_VALUE or NEUTRAL.get(key, object()) == value:
                    continue
                raise NotApplicable(f"the candidate has no {key} argument (mapped to null)")
            if isinstance(target, (list, tuple)):
                out[target[0]], out[target[1]] = value
            else:
                out[target] = value
        return out

    def lr_key(self) -> str:
        return self.names.get("lr", "lr")


def hyper(lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
          amsgrad: bool = False, maximize: bool = False) -> dict[str, Any]:
    """Canonical hyperparameters of one group (a plain dict, so that invalid values can be built too)."""
    return {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad, "maximize": maximize}


def as_reference(values: Mapping[str, Any]) -> reference.Hyper:
    beta1, beta2 = values["betas"]
    return reference.Hyper(lr=values["lr"], beta1=beta1, beta2=beta2, eps=values["eps"],
                           weight_decay=values["weight_decay"], amsgrad=values["amsgrad"], maximize=values["maximize"])


# ----------------------------------------------------------------------------- data

def snap(values: Tensor) -> Tensor:
    """Round to the nearest bfloat16 value (float64 result); such values are exact in every float dtype used."""
    return values.to(torch.bfloat16).to(torch.float64)


def random_values(seed: int, shape: Sequence[int], low: float, high: float, *, signed: bool = True) -> Tensor:
    """Magnitudes uniform in [low, high], random signs; never exactly zero. float64, snapped."""
    gen = torch.Generator().manual_seed(seed)
    mags = low + (high - low) * torch.rand(tuple(shape), generator=gen, dtype=torch.float64)
    if signed:
        signs = torch.where(torch.rand(tuple(shape), generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
        mags = mags * signs
    return snap(mags)


# ----------------------------------------------------------------------------- comparing

@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


_TOLERANCES = {
    torch.float64: Tolerance(1e-10, 1e-12),
    torch.float32: Tolerance(1.3e-6, 1e-5),
    # one unit in the last place, relative, for a handful of roundings
    torch.bfloat16: Tolerance(2.0**-7, 2.0**-8),
    torch.float16: Tolerance(2.0**-10, 2.0**-11),
}


def tolerance_for(dtype: torch.dtype, *, steps: int = 1) -> Tolerance:
    """Tolerance for values of ``dtype`` after ``steps`` roundings that may accumulate."""
    base = _TOLERANCES.get(dtype, _TOLERANCES[torch.float32])
    grow = max(1.0, math.sqrt(steps))
    return Tolerance(base.rtol * grow, base.atol * grow)


def compare(actual: Tensor, expected: Tensor, tol: Tolerance) -> tuple[bool, float]:
    """(within tolerance, deviation), deviation = max |a - e| / max(|e|, 1e-3) (inf for non-finite)."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        return False, math.inf
    if a.numel() == 0:
        return True, 0.0
    diff = (a - e).abs()
    both_same_nonfinite = (~torch.isfinite(a)) & (~torch.isfinite(e)) & ((a == e) | (a.isnan() & e.isnan()))
    diff = torch.where(both_same_nonfinite, torch.zeros_like(diff), torch.nan_to_num(diff, nan=math.inf, posinf=math.inf))
    ok = bool((diff <= tol.atol + tol.rtol * torch.nan_to_num(e.abs(), posinf=0.0)).all())
    scale = torch.clamp(torch.nan_to_num(e.abs(), nan=0.0, posinf=0.0), min=1e-3)
    deviation = float((diff / scale).max())
    return ok, deviation


def compare_band(actual: Tensor, low: Tensor, high: Tensor, tol: Tolerance) -> tuple[bool, float]:
    """:func:`compare` against the nearest point of the interval ``low`` and ``high`` span, element by element
    (a candidate whose own eps is unknown lies between the references of the smallest and the largest eps)."""
    a = actual.detach().to("cpu", torch.float64)
    lo, hi = (t.detach().to("cpu", torch.float64) for t in (low, high))
    if a.shape != lo.shape:
        return False, math.inf
    return compare(a, torch.clamp(a, torch.minimum(lo, hi), torch.maximum(lo, hi)), tol)


# ----------------------------------------------------------------------------- driving

class Harness:
    """Builds, steps and observes optimizers made by one candidate factory."""

    def __init__(self, factory: Callable[..., Any], mapping: HyperMapping, *, device: str | torch.device = "cpu",
                 setup: Sequence[str] = ()):
        self.factory = factory
        self.mapping = mapping
        self.device = torch.device(device)
        self.setup = tuple(setup)
        self.named: bool | None = None  # decided by the first successful construction

    # -- construction

    def params(
        self, values: Mapping[str, Tensor], dtype: torch.dtype, device: torch.device | None = None
    ) -> dict[str, torch.nn.Parameter]:
        """Fresh parameters, one per name, with the given (float64) values cast to ``dtype``."""
        dev = self.device if device is None else device
        return {name: torch.nn.Parameter(v.detach().to(dev, dtype).clone()) for name, v in values.items()}

    def build(self, params: Mapping[str, Tensor] | Sequence[tuple[str, Tensor]], values: Mapping[str, Any],
              *, groups: Sequence[tuple[Mapping[str, Tensor], Mapping[str, Any]]] = (), **extra: Any) -> Any:
        """An optimizer over ``params`` (constructor hyperparameters ``values``), plus further groups
        each with its own hyperparameters. ``extra`` are further keyword arguments (after the mapping)."""
        kwargs = {**self.mapping.translate(values), **dict(self.mapping.extra), **extra}
        items = list(params.items()) if isinstance(params, Mapping) else list(params)
        group_items = [(list(g.items()), self.mapping.translate(gv)) for g, gv in groups]

        def argument(named: bool) -> Any:
            first = items if named else [p for _, p in items]
            if not group_items:
                return first
            out = [{"params": first}]
            for g_items, g_kwargs in group_items:
                out.append({"params": g_items if named else [p for _, p in g_items], **g_kwargs})
            return out

        if self.named is False:
            return self.prepare(self.factory(argument(False), **kwargs))
        try:
            opt = self.factory(argument(True), **kwargs)
        except Exception:
            if self.named is True:
                raise
            opt = self.factory(argument(False), **kwargs)  # the plain-tensor error, if any, is the one shown
            self.named = False
            return self.prepare(opt)
        self.named = True
        return self.prepare(opt)

    def prepare(self, opt: Any) -> Any:
        """Call the candidate's set-up methods (``setup``, e.g. ``train`` for schedule-free optimizers)."""
        for name in self.setup:
            method = getattr(opt, name, None)
            if not callable(method):
                raise SetupError(f"setup {name!r}: the candidate's optimizer has no method {name!r}")
            method()
        return opt

    # -- stepping

    @staticmethod
    def set_grads(params: Mapping[str, Tensor], grads: Grads) -> None:
        for name, p in params.items():
            g = grads.get(name)
            # A fresh copy each step: some optimizers modify the gradient in place (maximize, unscale).
            p.grad = None if g is None else g.detach().to(p.device, p.dtype).clone()

    def step(self, opt: Any, params: Mapping[str, Tensor], grads: Grads) -> None:
        self.set_grads(params, grads)
        opt.step()

    def run(self, opt: Any, params: Mapping[str, Tensor], grad_seq: Sequence[Grads],
            before: Callable[[int], None] | None = None) -> list[dict[str, Tensor]]:
        """Step through ``grad_seq``; observations of every parameter after each step."""
        seen = []
        for k, grads in enumerate(grad_seq):
            if before is not None:
                before(k)
            self.step(opt, params, grads)
            seen.append(self.observe_all(opt, params))
        return seen

    # -- observing

    @staticmethod
    def master(opt: Any, p: Tensor) -> Tensor | None:
        """The candidate's separate master copy of ``p``, or None when it keeps none (or hides it)."""
        getter = getattr(opt, "master_param", None)
        if callable(getter):
            # A master is a tensor the optimizer keeps: asked twice, it answers with the same
            # storage. A getter that returns a fresh converted copy (no master kept) does not.
            first, second = getter(p), getter(p)
            if (isinstance(first, Tensor) and isinstance(second, Tensor) and first.data_ptr() == second.data_ptr()
                    and first.data_ptr() != p.data_ptr()):
                return first
            return None
        state = getattr(opt, "state", None)
        try:
            m = state[p].get("master_param") if state is not None and p in state else None
        except Exception:
            return None
        return m if isinstance(m, Tensor) else None

    def observe(self, opt: Any, p: Tensor) -> Tensor:
        m = self.master(opt, p)
        src = p if m is None else m
        return src.detach().to("cpu", torch.float64).clone()

    def observe_all(self, opt: Any, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {name: self.observe(opt, p) for name, p in params.items()}

    def observed_dtype(self, opt: Any, params: Mapping[str, Tensor]) -> torch.dtype:
        """The narrowest dtype among the observed tensors and the parameter-sized state (the tolerance follows it).

        A formula clause compares at the precision the candidate computes in: float32 moments
        on float64 parameters give float32 roundings, which are the precision clause's finding,
        not a wrong formula. Integer (quantized) state counts as bfloat16.
        """
        dtypes = []
        for p in params.values():
            m = self.master(opt, p)
            dtypes.append((p if m is None else m).dtype)
            dtypes.extend(d if d.is_floating_point else torch.bfloat16 for d in moment_dtypes(opt, p).values())
        return narrowest(dtypes)

    # -- lr

    def set_lr(self, opt: Any, lr: float, group: int | None = None) -> None:
        """Write ``lr`` into the param groups; a tensor lr is filled in place (it stays a tensor)."""
        key = self.mapping.lr_key()
        groups = opt.param_groups if group is None else [opt.param_groups[group]]
        for g in groups:
            if isinstance(g.get(key), Tensor):
                g[key].fill_(lr)
            else:
                g[key] = lr


def save_bytes(state_dict: Any) -> bytes:
    """A state_dict serialized by torch.save (what a checkpoint holds)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return buffer.getvalue()


def load_bytes(data: bytes) -> Any:
    """A fresh state_dict from :func:`save_bytes` output: every load gets tensors of its own.

    torch's ``load_state_dict`` keeps tensors of matching dtype and device as they are, so
    two optimizers loaded from one state_dict object would share m, v and step.
    """
    return torch.load(io.BytesIO(data), weights_only=False)


_FLOAT_ORDER = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def narrowest(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The narrowest floating dtype (float16 < bfloat16 < float32 < float64); others count as float32."""
    return min(dtypes, key=lambda d: _FLOAT_ORDER.index(d) if d in _FLOAT_ORDER else 2)


def dtype_bits(dtype: torch.dtype) -> int:
    """Bits of precision a state dtype keeps per element (its mantissa for floats, its width for integers)."""
    if dtype.is_floating_point:
        return round(-math.log2(torch.finfo(dtype).eps)) + 1
    return torch.iinfo(dtype).bits if dtype != torch.bool else 1


def state_tensors(entry: Any, prefix: str = "", depth: int = 0) -> dict[str, Tensor]:
    """Every tensor in one parameter's state, found inside nested dicts, lists, tuples and objects."""
    out: dict[str, Tensor] = {}
    if depth > 5:
        return out
    if isinstance(entry, Tensor):
        out[prefix or "<state>"] = entry
    elif isinstance(entry, Mapping):
        for k, v in entry.items():
            out.update(state_tensors(v, f"{prefix}.{k}" if prefix else str(k), depth + 1))
    elif isinstance(entry, (list, tuple)):
        for i, v in enumerate(entry):
            out.update(state_tensors(v, f"{prefix}[{i}]", depth + 1))
    elif hasattr(entry, "__dict__") and not callable(entry):
        for k, v in vars(entry).items():
            out.update(state_tensors(v, f"{prefix}.{k}" if prefix else k, depth + 1))
    return out


def _state_entry(opt: Any, p: Tensor) -> Any:
    state = getattr(opt, "state", None)
    try:
        return state.get(p, {}) if state is not None else {}
    except Exception:
        return {}


def state_dtypes(opt: Any, params: Mapping[str, Tensor]) -> dict[str, dict[str, torch.dtype]]:
    """name -> {state key (dotted for nested containers) -> dtype} for the tensors of each parameter's state."""
    return {name: {k: v.dtype for k, v in state_tensors(_state_entry(opt, p)).items()} for name, p in params.items()}


def moment_dtypes(opt: Any, p: Tensor) -> dict[str, torch.dtype]:
    """key -> dtype of the parameter-sized state tensors of ``p`` (moments, master; quantized codes at least half
    its size), leaving out scalars such as the step count and per-block scales."""
    size = p.numel()
    return {k: v.dtype for k, v in state_tensors(_state_entry(opt, p)).items()
            if size > 1 and v.numel() * 2 >= size and v.numel() > 1 and v.dtype != torch.bool}  # a mask is no moment
