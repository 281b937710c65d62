"""The naive hand-made offload that the demo holds up against OffloadAdamW. Do not train with it.

It is what a quick edit of an AdamW loop to "move the optimizer state to the CPU" tends to
look like, and it is wrong in the two classic ways the contract (docs/contract.md) warns about:

* the moments live on the host in the *model's* dtype: with a bf16 model, ``v * 0.999`` rounds
  back to ``v`` (the second moment stops decaying), and the parameter itself is updated in bf16,
  so updates smaller than half a bf16 spacing vanish (a weight of 1.0 cannot move by less than
  about 0.002; RMSNorm weights freeze);
* weight decay is applied *after* the update, ``(1 - lr*wd) * (theta - lr*u)``, instead of to the
  pre-update value (off by ``lr**2 * wd * u`` per step).

Everything else (bias correction, eps outside the root, per-tensor step counts, grad None leaves
a tensor alone) is done correctly, so that the conformance checker can show that it flags
exactly these two defects and nothing else. It is a real ``torch.optim.Optimizer`` with a
state_dict torch can save and load.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from offload_adamw.contract.rules import check_hyperparameter_ranges

__all__ = ["NaiveOffloadAdamW"]


class NaiveOffloadAdamW(torch.optim.Optimizer):
    """AdamW with host-side moments in the parameter's dtype and decay after the update (defective on purpose)."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        check_hyperparameter_ranges(lr, betas, eps, weight_decay)
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = float(group["lr"])
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    # The "offload": host memory, but the model's dtype (bf16 for a bf16 model).
                    state["exp_avg"] = torch.zeros(p.shape, dtype=p.dtype, device="cpu")
                    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=p.dtype, device="cpu")
                grad = p.grad.to("cpu")
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                t = state["step"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1**t)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**t)).add_(group["eps"])
                update = (exp_avg / denom).to(p.device)
                p.add_(update, alpha=-step_size)
                # The classic edit: decay moved after the update.
                if group["weight_decay"] != 0:
                    p.mul_(1 - lr * group["weight_decay"])
        return loss
