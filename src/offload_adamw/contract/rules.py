"""The names and rules every part of the project shares (docs/contract.md#state, #what-each-input-does, #validation).

One source for each: the keys of a tensor's state, the keys of an AdamW parameter group, the
non-finite policies, torch's range checks. No torch here: the checker's report, the planner and
the audit of a saved state_dict use these without it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ADAMW_GROUP_KEYS",
    "MASTER_KEY",
    "MOMENT_KEYS",
    "NONFINITE_POLICIES",
    "STATE_KEYS",
    "check_hyperparameter_ranges",
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
#: what a step does with an inf or NaN gradient: update anyway (torch), skip the whole step, raise.
NONFINITE_POLICIES = ("propagate", "skip", "raise")


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
