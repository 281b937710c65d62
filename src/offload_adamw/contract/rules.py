"""The names and rules every part of the project shares (docs/contract.md#state, #what-each-input-does, #validation).

One source for each: the keys of a tensor's state, the keys of an AdamW parameter group, the
non-finite policies, the placements of an update (docs/placement.md), torch's range checks. No torch
here: the checker's report, the planner and the audit of a saved state_dict use these without it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ADAMW_GROUP_KEYS",
    "Unsupported",
    "MASTER_KEY",
    "MOMENT_KEYS",
    "NONFINITE_POLICIES",
    "PLACEMENTS",
    "PLACEMENT_KEY",
    "STATE_KEYS",
    "check_hyperparameter_ranges",
    "check_placement",
]

#: the float32 (float64) master copy of a parameter that is not its own master.
MASTER_KEY = "master_param"
#: the moments, in the order torch.optim.AdamW creates them (max_exp_avg_sq only with amsgrad).
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
#: every key a tensor's state may hold.
STATE_KEYS = ("step", *MOMENT_KEYS, MASTER_KEY)
#: keys of torch.optim.AdamW's parameter groups, in torch's order.
ADAMW_GROUP_KEYS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)
class Unsupported(ValueError, RuntimeError):
    """An input OffloadAdamW refuses where torch's fused AdamW raises RuntimeError (a meta parameter at its step,
    ``differentiable=True``, a non-floating parameter) or that cannot apply to state in host memory
    (``capturable=True``): both a RuntimeError, so that code catching torch's error catches it, and the
    ValueError this project raised before."""


#: what a step does with an inf or NaN gradient: update anyway (torch), skip the whole step, raise.
NONFINITE_POLICIES = ("propagate", "skip", "raise")
#: the parameter-group key (and constructor keyword) that says where a group's update runs (docs/placement.md).
#: It is where this process runs the update, not state: ``state_dict()`` leaves it out and a load keeps the
#: optimizer's own, so a resume may change placement.
PLACEMENT_KEY = "update_on"
#: where an update runs: on the host (state in host memory, the host kernel), streamed (state in host memory,
#: streamed through a ring of device buffers, updated on the device), on the device (state on the device).
PLACEMENTS = ("host", "stream", "device")


def check_placement(value: Any, where: str) -> str:
    """``value`` when it is one of :data:`PLACEMENTS`, else ValueError naming ``where`` (a group, the constructor)."""
    if not (isinstance(value, str) and value in PLACEMENTS):
        raise ValueError(f"{where}: {PLACEMENT_KEY} must be one of {PLACEMENTS}, got {value!r}")
    return value


def check_hyperparameter_ranges(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """torch.optim.Adam's range checks, in its order and words; written ``not lo <= x`` so NaN fails too."""
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
