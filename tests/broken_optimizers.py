"""Deliberately broken AdamW optimizers, each breaking exactly one clause of the contract.

``TextbookAdamW`` is a correct AdamW written out per tensor (float32 moments, a float32
master for low-precision parameters, name-matched loading inherited from OffloadAdamW),
with one overridable method per part of the rule. Each broken class overrides one of
them the way a hand edit might. ``BROKEN`` maps each class to the clauses that must flag
it (one, except where two defects are combined on purpose); the conformance tests check
that those clauses fail and no other one does. ``CORRECT`` lists optimizers written
differently from ``TextbookAdamW`` that keep the whole contract: no clause may flag them.
A class with another signature says how the checker maps it in ``CHECK_MAPPING``.

``SplitBetaAdamW`` is not broken: it is a correct AdamW with another signature
(``beta1``/``beta2``, ``epsilon``, ``wd``, ``correct_bias=False`` by default as some
older libraries had), to be driven through the checker's hyperparameter mapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offload_adamw import OffloadAdamW
from offload_adamw.distributed.node import node_share


@dataclass(frozen=True)
class GroupHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool


class TextbookAdamW(OffloadAdamW):
    """Correct AdamW, one readable per-tensor loop; every part can be overridden."""

    # ---- parts of the rule (the broken classes override exactly one)

    def group_hyper(self, group: dict[str, Any]) -> GroupHyper:
        beta1, beta2 = group["betas"]
        return GroupHyper(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], group["amsgrad"], group["maximize"])

    def skips_group(self, hp: GroupHyper) -> bool:
        return False

    def gradient_of(self, p: Tensor) -> Tensor | None:
        return p.grad

    def ignores_gradient(self, grad: Tensor) -> bool:
        return False

    def state_dtype(self, p: Tensor) -> torch.dtype:
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def keeps_master(self, p: Tensor) -> bool:
        return not (p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64))

    def begin_step(self) -> None:
        pass

    def advance_step(self, state: dict[str, Any]) -> int:
        state["step"] += 1
        return int(state["step"].item())

    def decay_before(self, theta: Tensor, hp: GroupHyper) -> None:
        theta.mul_(1 - hp.lr * hp.weight_decay)

    def decay_after(self, theta: Tensor, hp: GroupHyper) -> None:
        pass

    def moment_gradient(self, grad: Tensor, theta: Tensor, hp: GroupHyper) -> Tensor:
        return grad

    def second_moment_for_denominator(self, state: dict[str, Any], hp: GroupHyper) -> Tensor:
        if hp.amsgrad:
            torch.maximum(state["max_exp_avg_sq"], state["exp_avg_sq"], out=state["max_exp_avg_sq"])
            return state["max_exp_avg_sq"]
        return state["exp_avg_sq"]

    def bias_corrections(self, t: int, hp: GroupHyper) -> tuple[float, float]:
        return 1 - hp.beta1**t, 1 - hp.beta2**t

    def move(self, theta: Tensor, m: Tensor, v: Tensor, t: int, hp: GroupHyper) -> None:
        c1, c2 = self.bias_corrections(t, hp)
        denom = (v.sqrt() / math.sqrt(c2)).add_(hp.eps)  # eps outside the root
        theta.addcdiv_(m, denom, value=-hp.lr / c1)

    def arithmetic_dtype(self, state_dtype: torch.dtype) -> torch.dtype:
        """The dtype the step computes in (the state's; a subclass may cast to a narrower one inside its step)."""
        return state_dtype

    master_key = "master_param"
    """The state key of the master copy (one the checker knows)."""

    # ---- the loop

    def new_state(self, p: Tensor, hp: GroupHyper) -> dict[str, Any]:
        dtype = self.state_dtype(p)
        state: dict[str, Any] = {"step": torch.zeros((), dtype=torch.float32)}
        state["exp_avg"] = torch.zeros(p.shape, dtype=dtype)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype)
        if hp.amsgrad:
            state["max_exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype)
        if self.keeps_master(p):
            state[self.master_key] = p.detach().to("cpu", dtype).clone()
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.begin_step()
        for group in self.param_groups:
            hp = self.group_hyper(group)
            if self.skips_group(hp):
                continue
            for p in group["params"]:
                grad = self.gradient_of(p)
                if grad is None or self.ignores_gradient(grad):
                    continue
                state = self.state[p]
                if not state:
                    state.update(self.new_state(p, hp))
                stored = state.get(self.master_key, p)
                work_dtype = self.arithmetic_dtype(state["exp_avg"].dtype)
                # Moments and theta in the working dtype: the stored tensors themselves, or copies written back
                # after the update (a low-precision theta without a master is rounded there).
                keys = [k for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in state]
                work = {k: state[k] if state[k].dtype == work_dtype else state[k].to(work_dtype) for k in keys}
                theta = stored if stored.dtype == work_dtype else stored.to(work_dtype)
                g = grad.to(work_dtype)
                if hp.maximize:
                    g = -g
                t = self.advance_step(state)
                g_m = self.moment_gradient(g, theta, hp)
                self.decay_before(theta, hp)
                work["exp_avg"].lerp_(g_m, 1 - hp.beta1)
                work["exp_avg_sq"].mul_(hp.beta2).addcmul_(g_m, g_m, value=1 - hp.beta2)
                v = self.second_moment_for_denominator(work, hp)
                self.move(theta, work["exp_avg"], v, t, hp)
                self.decay_after(theta, hp)
                for k in keys:
                    if work[k] is not state[k]:
                        state[k].copy_(work[k])
                if theta is not stored:
                    stored.copy_(theta)
                if stored is not p:
                    self.write_parameter(p, stored)
        return loss

    def write_parameter(self, p: Tensor, master: Tensor) -> None:
        """The model parameter from its master: round to nearest even (copy_ rounds so)."""
        p.copy_(master)


# ----------------------------------------------------------------------------- clause 1

class EpsInsideRoot(TextbookAdamW):
    """sqrt(v_hat + eps) instead of sqrt(v_hat) + eps."""

    def move(self, theta, m, v, t, hp):
        c1, c2 = self.bias_corrections(t, hp)
        theta.addcdiv_(m, (v / c2 + hp.eps).sqrt(), value=-hp.lr / c1)


class NoBiasCorrection(TextbookAdamW):
    """m / (sqrt(v) + eps) without 1 - beta**t."""

    def bias_corrections(self, t, hp):
        return 1.0, 1.0


class EpsNotRescaled(TextbookAdamW):
    """The rearranged form lr*sqrt(c2)/c1 * m / (sqrt(v) + eps) that forgets to scale eps by sqrt(c2)."""

    def move(self, theta, m, v, t, hp):
        c1, c2 = self.bias_corrections(t, hp)
        theta.addcdiv_(m, v.sqrt().add_(hp.eps), value=-hp.lr * math.sqrt(c2) / c1)


class AmsgradIgnored(TextbookAdamW):
    """Accepts amsgrad=True and keeps max_exp_avg_sq, but divides by the current v."""

    def second_moment_for_denominator(self, state, hp):
        if hp.amsgrad:
            torch.maximum(state["max_exp_avg_sq"], state["exp_avg_sq"], out=state["max_exp_avg_sq"])
        return state["exp_avg_sq"]


# ----------------------------------------------------------------------------- clauses 2, 3

class L2InGradient(TextbookAdamW):
    """Adam with L2: weight_decay * theta is added to the gradient, no decoupled decay."""

    def moment_gradient(self, grad, theta, hp):
        return grad + hp.weight_decay * theta.to(grad.dtype)

    def decay_before(self, theta, hp):
        pass


class DecayAfterUpdate(TextbookAdamW):
    """Decoupled decay, but applied to the updated value."""

    def decay_before(self, theta, hp):
        pass

    def decay_after(self, theta, hp):
        theta.mul_(1 - hp.lr * hp.weight_decay)


# ----------------------------------------------------------------------------- clause 4

class SharedStepCounter(TextbookAdamW):
    """One step count for the whole optimizer (1 + the largest count), written to every updated tensor."""

    def begin_step(self):
        counts = [float(s["step"]) for s in self.state.values() if "step" in s]
        self._call_step = int(max(counts, default=0.0)) + 1

    def advance_step(self, state):
        state["step"].fill_(self._call_step)
        return self._call_step


class NoneGradAsZero(TextbookAdamW):
    """A tensor whose grad is None is updated as if its gradient were zero."""

    def gradient_of(self, p):
        return torch.zeros_like(p) if p.grad is None else p.grad


# ----------------------------------------------------------------------------- clauses 5, 6

class ZeroGradSkipped(TextbookAdamW):
    """An all-zero gradient is taken for 'no gradient' and the tensor is skipped."""

    def ignores_gradient(self, grad):
        return not bool(grad.any())


class LrZeroSkipsStep(TextbookAdamW):
    """A group with lr == 0 is skipped entirely (an early return that looked harmless)."""

    def skips_group(self, hp):
        return hp.lr == 0


# ----------------------------------------------------------------------------- clause 7

class FirstGroupHyperparameters(TextbookAdamW):
    """Every group is stepped with the hyperparameters of param_groups[0]."""

    def group_hyper(self, group):
        return super().group_hyper(self.param_groups[0])


class LrFixedAtConstruction(TextbookAdamW):
    """Uses the constructor's lr forever: schedulers and per-group lr are ignored."""

    def group_hyper(self, group):
        hp = super().group_hyper(group)
        return GroupHyper(self.defaults["lr"], hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.amsgrad, hp.maximize)


# ----------------------------------------------------------------------------- clause 8

class MomentsInParamDtype(TextbookAdamW):
    """What torch.optim.AdamW does for bf16 parameters: moments and theta in the parameter's dtype."""

    def state_dtype(self, p):
        return p.dtype

    def keeps_master(self, p):
        return False

    def load_state_dict(self, state_dict):
        # Loads as torch does for this layout: moments stay in the parameter's dtype, no master appears.
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            state.pop("master_param", None)
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(p.dtype)


class NoMasterCopy(TextbookAdamW):
    """float32 moments, but theta is updated in the parameter's own (bf16/fp16) dtype."""

    def keeps_master(self, p):
        return False

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for state in self.state.values():
            state.pop("master_param", None)  # the inherited loader adds one; this layout has none


# ----------------------------------------------------------------------------- clauses 10, 11

class StateResetOnLoad(TextbookAdamW):
    """load_state_dict restores the groups and drops every tensor's state."""

    def load_state_dict(self, state_dict):
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})


class StateCastOnLoad(TextbookAdamW):
    """Loading casts every state tensor to its parameter's dtype (torch's default load policy)."""

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            for key, value in list(state.items()):
                if key != "step" and isinstance(value, Tensor) and value.is_floating_point():
                    state[key] = value.to(p.dtype)


class PositionalLoad(TextbookAdamW):
    """Loading ignores the saved parameter names and matches states by position."""

    def load_state_dict(self, state_dict):
        groups = [{k: v for k, v in g.items() if k != "param_names"} for g in state_dict["param_groups"]]
        super().load_state_dict({"state": state_dict["state"], "param_groups": groups})


# ----------------------------------------------------------------------------- clause 12

class NoValidation(TextbookAdamW):
    """Takes any hyperparameters: skips the constructor checks."""

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *, maximize=False, **_: Any
    ):
        self.nonfinite = "propagate"
        self.skipped_steps = 0
        self._pin_memory = False
        self.node = node_share(gather=False)
        self.host_threads = self.node.threads
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
                    "maximize": maximize, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                    "decoupled_weight_decay": True}
        torch.optim.Optimizer.__init__(self, params, defaults)


# ----------------------------------------------------------------------------- clauses 13, 14

class DeclaresSkipButPropagates(TextbookAdamW):
    """Advertises nonfinite='skip' but never looks at the gradients' finiteness."""

    def __init__(self, params, *args: Any, **kwargs: Any):
        super().__init__(params, *args, **kwargs)
        self.nonfinite = "skip"


class AmpClaimIgnoresFoundInf(TextbookAdamW):
    """Tells GradScaler it handles scaling itself (so GradScaler neither unscales nor skips), then ignores found_inf."""

    _step_supports_amp_scaling = True


class AmpUnscalesIgnoresFoundInf(TextbookAdamW):
    """AMP-aware the modern way: unscales by the ``grad_scale`` GradScaler hands over, never looks at ``found_inf``."""

    _step_supports_amp_scaling = True

    def gradient_of(self, p):
        scale = getattr(self, "grad_scale", None)
        if p.grad is None or scale is None:
            return p.grad
        return p.grad / scale.to(p.grad.device, p.grad.dtype)


# ----------------------------------------------------------------------------- precision (clause 8) without a formula error

class Float32State(TextbookAdamW):
    """A correct formula with float32 state for every parameter: float64 parameters are computed in float32."""

    def state_dtype(self, p):
        return torch.float32


def _toward_zero(master: Tensor, dtype: torch.dtype) -> Tensor:
    nearest = master.to(dtype)
    toward_zero = torch.nextafter(nearest, torch.zeros_like(nearest))
    return torch.where(nearest.to(master.dtype).abs() > master.abs(), toward_zero, nearest)


class TruncatedMaster(TextbookAdamW):
    """A float32 master narrowed to the bf16/fp16 parameter by truncation instead of round-to-nearest-even."""

    def write_parameter(self, p, master):
        p.copy_(_toward_zero(master, p.dtype))


class Float32Arithmetic(TextbookAdamW):
    """float64 state for float64 parameters, but each step computed in float32: the moments and theta are cast
    to float32 inside the step and the results written back (the formula is right; the precision is not)."""

    def arithmetic_dtype(self, state_dtype):
        return torch.float32 if state_dtype == torch.float64 else state_dtype


class HiddenMasterAdamW(TextbookAdamW):
    """Correct AdamW whose float32 master sits under a state key of its own, with no ``master_param``: the checker
    sees only the rounded bf16/fp16 parameter (as with optimizers that name their master otherwise)."""

    master_key = "shadow_fp32"

    def master_param(self, p):
        return None


class HiddenTruncatedMaster(HiddenMasterAdamW):
    """A hidden float32 master narrowed to the bf16/fp16 parameter by truncation instead of round-to-nearest-even."""

    def write_parameter(self, p, master):
        p.copy_(_toward_zero(master, p.dtype))


def _stochastically_rounded(master: Tensor, dtype: torch.dtype) -> Tensor:
    """``master`` narrowed to ``dtype`` by stochastic rounding, drawing from torch's global RNG."""
    lower = master.to(dtype)
    wide = lower.to(master.dtype)
    toward = torch.where(wide < master, torch.full_like(wide, math.inf), torch.full_like(wide, -math.inf)).to(dtype)
    other = torch.nextafter(lower, toward)
    gap = (other.to(master.dtype) - wide).abs()
    chance = torch.where(gap > 0, (master - wide).abs() / gap, torch.zeros_like(gap))
    return torch.where(torch.rand_like(master) < chance, other, lower)


class StochasticRoundingMaster(TextbookAdamW):
    """A float32 master narrowed to the bf16/fp16 parameter by stochastic rounding from torch's global RNG
    (the round trip of its state is exact; the RNG draws continue from wherever the RNG is)."""

    def write_parameter(self, p, master):
        p.copy_(_stochastically_rounded(master, p.dtype))


# ----------------------------------------------------------------------------- one defect on float32 state

class Float32StateSharedStepCounter(Float32State, SharedStepCounter):
    """float32 state (clause 8 at float64) and one step count for all tensors (clause 4)."""


class Float32StateLrFixed(Float32State, LrFixedAtConstruction):
    """float32 state (clause 8 at float64) and the constructor's lr forever (clause 7)."""


class Float32StateZeroGradSkipped(Float32State, ZeroGradSkipped):
    """float32 state (clause 8 at float64) and zero gradients skipped (clause 5)."""


class Float32StateAmpIgnoresFoundInf(Float32State, AmpUnscalesIgnoresFoundInf):
    """float32 state (clause 8 at float64) and GradScaler's found_inf ignored (clause 14)."""


# ----------------------------------------------------------------------------- rules that are not AdamW's

class SignMomentumTakesEps(TextbookAdamW):
    """theta <- s*theta - lr*sign(m) (a sign-of-momentum rule); it takes eps, as AdamW's signature has it, and
    never uses it. Its cold state steps lr*sign(tiny) on a tiny gradient and nothing on a zero one."""

    def __init__(self, params, *args: Any, **kwargs: Any):
        super().__init__(params, *args, **kwargs)
        self.nonfinite = None  # sign(NaN) is 0 here: it declares no non-finite policy

    def move(self, theta, m, v, t, hp):
        theta.add_(torch.sign(m), alpha=-hp.lr)


class SignMomentumNoEps(SignMomentumTakesEps):
    """The same rule with a signature that has no eps (nor amsgrad, maximize): checked with those mapped to null."""

    CHECK_MAPPING = {"eps": None, "amsgrad": None, "maximize": None}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-2):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


def _trust_ratio(theta: Tensor, update: Tensor, eps: float) -> float:
    """|theta| / (|update| + eps), 1 where theta is zero (LAMB's layer-wise scaling)."""
    weight_norm = float(theta.norm())
    return 1.0 if weight_norm == 0 else weight_norm / (float(update.norm()) + eps)


class TrustRatioDecoupled(TextbookAdamW):
    """A LAMB-like step: the Adam direction scaled by |theta| / |direction|, after a decoupled decay of theta."""

    def move(self, theta, m, v, t, hp):
        c1, c2 = self.bias_corrections(t, hp)
        direction = (m / c1) / ((v / c2).sqrt().add_(hp.eps))
        theta.add_(direction, alpha=-hp.lr * _trust_ratio(theta, direction, hp.eps))


class TrustRatioDecayInside(TrustRatioDecoupled):
    """LAMB as its paper writes it: the decay wd*theta is added to the direction, and the trust ratio scales
    both: the decay is not the decoupled lr*wd*theta."""

    def decay_before(self, theta, hp):
        pass

    def move(self, theta, m, v, t, hp):
        c1, c2 = self.bias_corrections(t, hp)
        direction = (m / c1) / ((v / c2).sqrt().add_(hp.eps)) + hp.weight_decay * theta
        theta.add_(direction, alpha=-hp.lr * _trust_ratio(theta, direction, hp.eps))


class DecayLrCapped(HiddenMasterAdamW):
    """The decay uses the learning rate capped at 0.08 (a 'stability' cap): above it, theta decays by less than
    lr*wd*theta. Its master is hidden, so that a bf16 run shows only the rounded parameter."""

    def decay_before(self, theta, hp):
        theta.mul_(1 - min(hp.lr, 0.08) * hp.weight_decay)


class DecayScaledByRmsOfV(TextbookAdamW):
    """Decoupled decay divided by sqrt of the mean bias-corrected v over every tensor that has a gradient
    (taken before the update, with this step's gradient in it): a decay scaled by a statistic of v."""

    def begin_step(self):
        total, count = 0.0, 0
        for group in self.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                t = int(state["step"].item()) + 1 if state else 1
                v = state["exp_avg_sq"].double() if state else torch.zeros(p.shape, dtype=torch.float64)
                g = p.grad.double()
                total += float(((beta2 * v + (1 - beta2) * g * g) / (1 - beta2**t)).sum())
                count += p.numel()
        self._rms_of_v = math.sqrt(total / count) + 1e-8 if count else 1.0

    def decay_before(self, theta, hp):
        theta.mul_(1 - hp.lr * hp.weight_decay / self._rms_of_v)


# ----------------------------------------------------------------------------- schedules

class LrReadOnce(TextbookAdamW):
    """Reads each group's lr at its first step and keeps it (a schedule set afterwards is ignored)."""

    def group_hyper(self, group):
        hp = super().group_hyper(group)
        cache = self.__dict__.setdefault("_first_lr", {})
        lr = cache.setdefault(id(group), hp.lr)
        return GroupHyper(lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.amsgrad, hp.maximize)


# ----------------------------------------------------------------------------- correct, written otherwise

class ReorderedAdamW(TextbookAdamW):
    """The same rule in torch's fused order: lr*sqrt(c2)/c1 * m / (sqrt(v) + eps*sqrt(c2)), decay as a separate add."""

    def decay_before(self, theta, hp):
        theta.add_(theta, alpha=-hp.lr * hp.weight_decay)

    def move(self, theta, m, v, t, hp):
        c1, c2 = self.bias_corrections(t, hp)
        denom = v.sqrt().add_(hp.eps * math.sqrt(c2))
        theta.addcdiv_(m, denom, value=-hp.lr * math.sqrt(c2) / c1)


class SwallowsKeywords(TextbookAdamW):
    """Correct AdamW without amsgrad whose constructor takes any keyword and ignores what it does not know."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, maximize=False, **_: Any):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)


# ----------------------------------------------------------------------------- another signature

class SplitBetaAdamW(TextbookAdamW):
    """A correct AdamW with the signature (lr, beta1, beta2, epsilon, wd, correct_bias) and those group keys."""

    def __init__(self, params, lr=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-6, wd=0.0, correct_bias=False):
        for name, value, ok in (("lr", lr, lr >= 0), ("beta1", beta1, 0 <= beta1 < 1), ("beta2", beta2, 0 <= beta2 < 1),
                                ("epsilon", epsilon, epsilon >= 0), ("wd", wd, wd >= 0)):
            if not ok:  # written so that NaN fails too
                raise ValueError(f"invalid {name}: {value}")
        self.nonfinite = "propagate"
        self.skipped_steps = 0
        self._pin_memory = False
        self.node = node_share(gather=False)
        self.host_threads = self.node.threads
        defaults = {"lr": lr, "beta1": beta1, "beta2": beta2, "epsilon": epsilon, "wd": wd, "correct_bias": correct_bias,
                    "amsgrad": False, "maximize": False}
        torch.optim.Optimizer.__init__(self, params, defaults)

    def group_hyper(self, group):
        return GroupHyper(group["lr"], group["beta1"], group["beta2"], group["epsilon"], group["wd"], False, False)

    def bias_corrections(self, t, hp):
        group_flags = {g["correct_bias"] for g in self.param_groups}
        return super().bias_corrections(t, hp) if all(group_flags) else (1.0, 1.0)


SPLIT_BETA_MAPPING = {"betas": ["beta1", "beta2"], "eps": "epsilon", "weight_decay": "wd", "amsgrad": None, "maximize": None}

#: broken class -> the clauses that must fail (and no other)
BROKEN: dict[type, tuple[int, ...]] = {
    EpsInsideRoot: (1,),
    NoBiasCorrection: (1,),
    EpsNotRescaled: (1,),
    AmsgradIgnored: (1,),
    L2InGradient: (2,),
    DecayAfterUpdate: (3,),
    SharedStepCounter: (4,),
    NoneGradAsZero: (4,),
    ZeroGradSkipped: (5,),
    LrZeroSkipsStep: (6,),
    FirstGroupHyperparameters: (7,),
    LrFixedAtConstruction: (7,),
    LrReadOnce: (7,),
    MomentsInParamDtype: (8,),
    NoMasterCopy: (8,),
    Float32State: (8,),
    TruncatedMaster: (8,),
    Float32Arithmetic: (8,),
    HiddenTruncatedMaster: (8,),
    StochasticRoundingMaster: (8,),
    SignMomentumTakesEps: (1,),
    SignMomentumNoEps: (1,),
    TrustRatioDecoupled: (1,),
    TrustRatioDecayInside: (1, 2),
    DecayLrCapped: (2,),
    DecayScaledByRmsOfV: (2,),
    StateResetOnLoad: (10,),
    StateCastOnLoad: (10,),
    PositionalLoad: (11,),
    NoValidation: (12,),
    DeclaresSkipButPropagates: (13,),
    AmpClaimIgnoresFoundInf: (14,),
    AmpUnscalesIgnoresFoundInf: (14,),
    Float32StateSharedStepCounter: (4, 8),
    Float32StateLrFixed: (7, 8),
    Float32StateZeroGradSkipped: (5, 8),
    Float32StateAmpIgnoresFoundInf: (8, 14),
}

#: optimizers that keep the whole contract although written differently
CORRECT: tuple[type, ...] = (TextbookAdamW, ReorderedAdamW, HiddenMasterAdamW)
