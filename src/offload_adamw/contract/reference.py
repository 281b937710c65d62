"""The AdamW contract (docs/contract.md) as plain Python over floats.

This module is the specification in executable form. It uses only the standard
library, works in double precision, and is written for reading, not speed. Every
other update path of the project (the tensor kernel, the offloading optimizer,
the distributed path) and every optimizer put through the conformance checker is
measured against it.

Two independent formulations are given:

* :func:`adamw_step`, the recursion of docs/contract.md#one-update, one update of one
  tensor's state ``(theta, m, v, t)``.
* :func:`oracle`, which computes the moments of a whole gradient history as
  explicit weighted sums ``m_t = (1 - b1) * sum_i b1**(t - i) * g_i`` (no
  recursion) and replays theta from those sums. The two agreeing over random
  histories (a hypothesis test) is evidence that both say what the contract says.

A "tensor" here is a tuple of floats; ``t`` is that tensor's own integer count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from numbers import Real

__all__ = ["Hyper", "State", "init_state", "adamw_step", "run", "oracle", "OracleResult"]

Vector = tuple[float, ...]


def _real(name: str, value: object) -> float:
    """Return ``value`` as a float, refusing bools, non-reals and non-finite values."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    as_float = float(value)
    if not math.isfinite(as_float):
        raise ValueError(f"{name} must be finite, got {as_float!r}")
    return as_float


def _vector(name: str, values: Iterable[object]) -> Vector:
    return tuple(_real(f"{name}[{i}]", x) for i, x in enumerate(values))


@dataclass(frozen=True)
class Hyper:
    """The hyperparameters of one parameter group for one update (lr may change per step)."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-2
    amsgrad: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        lr = _real("lr", self.lr)
        beta1 = _real("beta1", self.beta1)
        beta2 = _real("beta2", self.beta2)
        eps = _real("eps", self.eps)
        weight_decay = _real("weight_decay", self.weight_decay)
        # Written as `not lo <= x` so that NaN fails too (it is already refused above).
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= beta1 < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
        if not 0.0 < eps:
            raise ValueError(f"Invalid epsilon value: {eps} (the reference needs eps > 0)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        for flag in ("amsgrad", "maximize"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        object.__setattr__(self, "lr", lr)
        object.__setattr__(self, "beta1", beta1)
        object.__setattr__(self, "beta2", beta2)
        object.__setattr__(self, "eps", eps)
        object.__setattr__(self, "weight_decay", weight_decay)


@dataclass(frozen=True)
class State:
    """The training state of one tensor: master value, moments, its own step count."""

    theta: Vector
    m: Vector
    v: Vector
    t: int = 0
    max_v: Vector | None = None  # only with amsgrad

    def __post_init__(self) -> None:
        theta = _vector("theta", self.theta)
        m = _vector("m", self.m)
        v = _vector("v", self.v)
        if not (len(theta) == len(m) == len(v)):
            raise ValueError(f"theta, m, v must have one length, got {len(theta)}, {len(m)}, {len(v)}")
        if isinstance(self.t, bool) or not isinstance(self.t, int) or self.t < 0:
            raise ValueError(f"t must be a non-negative int, got {self.t!r}")
        for i, x in enumerate(v):
            if x < 0.0:
                raise ValueError(f"v[{i}] must be >= 0, got {x!r}")
        object.__setattr__(self, "theta", theta)
        object.__setattr__(self, "m", m)
        object.__setattr__(self, "v", v)
        if self.max_v is not None:
            max_v = _vector("max_v", self.max_v)
            if len(max_v) != len(theta):
                raise ValueError(f"max_v must have length {len(theta)}, got {len(max_v)}")
            object.__setattr__(self, "max_v", max_v)


def init_state(theta: Sequence[float], amsgrad: bool = False) -> State:
    """Zero moments and t = 0 for a tensor with master value ``theta`` (docs/contract.md#state)."""
    zeros = tuple(0.0 for _ in theta)
    return State(tuple(theta), zeros, zeros, 0, zeros if amsgrad else None)


def _finite(what: str, x: float) -> float:
    if not math.isfinite(x):
        raise ValueError(f"non-finite intermediate: {what} = {x!r}")
    return x


def adamw_step(state: State, grad: Sequence[float] | None, hp: Hyper) -> State:
    """One AdamW update of one tensor (docs/contract.md#one-update, #what-each-input-does).

    ``grad=None`` returns ``state`` itself: no decay, no moment change, t unchanged.
    Any non-finite intermediate raises ValueError naming it.
    """
    if grad is None:
        return state
    g = _vector("grad", grad)
    if len(g) != len(state.theta):
        raise ValueError(f"grad has {len(g)} elements, theta has {len(state.theta)}")
    if hp.amsgrad and state.max_v is None:
        state = replace(state, max_v=tuple(0.0 for _ in state.theta))
    if hp.maximize:
        g = tuple(-x for x in g)

    t = state.t + 1
    c1 = _finite("1 - beta1**t", 1.0 - hp.beta1**t)
    c2 = _finite("1 - beta2**t", 1.0 - hp.beta2**t)
    if c1 == 0.0:
        raise ValueError("bias correction 1 - beta1**t is zero (beta1 = 0 is fine, but this t made it vanish)")
    if c2 == 0.0:
        raise ValueError("bias correction 1 - beta2**t is zero")
    shrink = 1.0 - hp.lr * hp.weight_decay

    theta, m, v, max_v = [], [], [], []
    for i, (th_prev, m_prev, v_prev, gi) in enumerate(zip(state.theta, state.m, state.v, g)):
        decayed = _finite(f"theta[{i}] after decay", th_prev * shrink)  # decay the PRE-update value
        mi = _finite(f"m[{i}]", hp.beta1 * m_prev + (1.0 - hp.beta1) * gi)
        vi = _finite(f"v[{i}]", hp.beta2 * v_prev + (1.0 - hp.beta2) * gi * gi)
        denom_v = vi
        if hp.amsgrad:
            assert state.max_v is not None
            mv = max(state.max_v[i], vi)
            max_v.append(mv)
            denom_v = mv
        denom = _finite(f"denominator[{i}]", math.sqrt(denom_v) / math.sqrt(c2) + hp.eps)  # eps OUTSIDE the root
        th = _finite(f"theta[{i}]", decayed - (hp.lr / c1) * mi / denom)
        theta.append(th)
        m.append(mi)
        v.append(vi)
    return State(tuple(theta), tuple(m), tuple(v), t, tuple(max_v) if hp.amsgrad else state.max_v)


def run(
    state: State,
    grads: Sequence[Sequence[float] | None],
    hps: Sequence[Hyper] | Hyper,
) -> State:
    """Apply :func:`adamw_step` along a gradient history (one Hyper per step, or one for all)."""
    if isinstance(hps, Hyper):
        hps = [hps] * len(grads)
    if len(hps) != len(grads):
        raise ValueError(f"{len(grads)} gradients but {len(hps)} hyperparameter sets")
    for g, hp in zip(grads, hps):
        state = adamw_step(state, g, hp)
    return state


@dataclass(frozen=True)
class OracleResult:
    theta: Vector
    m: Vector
    v: Vector
    t: int


def oracle(
    theta0: Sequence[float],
    grads: Sequence[Sequence[float] | None],
    hps: Sequence[Hyper] | Hyper,
) -> OracleResult:
    """The same computation without the moment recursion.

    For the k-th applied gradient (None entries are not updates and are skipped),
    ``m_k = (1 - b1) * sum_{i<=k} b1**(k - i) * g_i`` and likewise ``v_k`` with
    ``b2`` and ``g_i**2``, each summed afresh from the history. Theta is then
    replayed with those sums. The moment decay rates must be the same at every
    step of the history (they are group constants in the contract); lr may vary.
    """
    if isinstance(hps, Hyper):
        hps = [hps] * len(grads)
    if len(hps) != len(grads):
        raise ValueError(f"{len(grads)} gradients but {len(hps)} hyperparameter sets")
    applied = [(_vector("grad", g), hp) for g, hp in zip(grads, hps) if g is not None]
    theta = list(_vector("theta0", theta0))
    m_now = [0.0] * len(theta)
    v_now = [0.0] * len(theta)
    max_v = [0.0] * len(theta)
    for k in range(1, len(applied) + 1):
        hp = applied[k - 1][1]
        b1, b2 = hp.beta1, hp.beta2
        sign = -1.0 if hp.maximize else 1.0
        history = [g for g, _ in applied[:k]]
        for j in range(len(theta)):
            m_now[j] = (1.0 - b1) * math.fsum(b1 ** (k - i) * sign * history[i - 1][j] for i in range(1, k + 1))
            v_now[j] = (1.0 - b2) * math.fsum(b2 ** (k - i) * history[i - 1][j] ** 2 for i in range(1, k + 1))
            max_v[j] = max(max_v[j], v_now[j])
        c1 = 1.0 - b1**k
        c2 = 1.0 - b2**k
        for j in range(len(theta)):
            m_hat = m_now[j] / c1
            v_hat = (max_v[j] if hp.amsgrad else v_now[j]) / c2
            theta[j] = theta[j] * (1.0 - hp.lr * hp.weight_decay) - hp.lr * m_hat / (math.sqrt(v_hat) + hp.eps)
            _finite(f"oracle theta[{j}]", theta[j])
    return OracleResult(tuple(theta), tuple(m_now), tuple(v_now), len(applied))
