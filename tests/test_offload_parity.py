"""Bitwise parity of the transfer pipeline (offload.py) over 50 steps of a small transformer.

A tiny LlamaForCausalLM (random init) plus an auxiliary head is trained twice from
the same weights on the same batches: once with OffloadAdamW running the
pipeline with the CPU as device, once with the reference of issue #2:

* float32 model: ``torch.optim.AdamW(fused=True)`` on the model itself;
* bfloat16 model: ``torch.optim.AdamW(fused=True)`` on float32 copies fed the
  upcast gradients, the model receiving the round-to-nearest copy.

Every configuration of the table crosses gradient accumulation (1, 4),
``offload_gradients`` (kept / freed), clipping (OffloadAdamW.clip_grad_norm_
against torch.nn.utils.clip_grad_norm_ on the reference's gradients) and the
fp16 GradScaler (with and without unscale_, with one forced found_inf skip),
and always has a frozen embedding, a layer unfrozen at step 20, a head whose
gradient is None at every third step, two parameter groups (one with amsgrad)
and zero_grad alternating set_to_none. Parameters, moments, masters, step
counts, clip norms and the loss scale must be bitwise equal.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from offload_adamw import OffloadAdamW, OffloadGradScaler, is_host_resident  # noqa: E402

STEPS = 50
UNFREEZE_AT = 20
INF_AT = 7  # a step whose scaled loss is made infinite: GradScaler must skip it exactly
CHECK_EVERY = 10


@dataclass(frozen=True, kw_only=True)
class Case:
    """One row of the parity table."""

    dtype: torch.dtype
    """Model parameter dtype."""
    accum: int
    """Micro-batches per optimizer step."""
    freed: bool
    """offload_gradients: device gradients freed, accumulated in host memory."""
    clip: bool = False
    """Clip the gradient norm to CLIP_NORM before every step."""
    scaler: str = "none"
    """'none', 'step' (GradScaler unscales inside step) or 'unscale' (explicit unscale_ first)."""

    @property
    def id(self) -> str:
        dt = {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.dtype]
        return (
            f"{dt}-acc{self.accum}-{'freed' if self.freed else 'kept'}-"
            f"{'clip' if self.clip else 'noclip'}-scaler_{self.scaler}"
        )


CLIP_NORM = 0.05  # small enough that most steps really clip

CASES = [
    Case(dtype=torch.float32, accum=1, freed=False),
    Case(dtype=torch.float32, accum=4, freed=True, clip=True),
    Case(dtype=torch.float32, accum=1, freed=True, scaler="step"),
    Case(dtype=torch.float32, accum=4, freed=False, clip=True, scaler="unscale"),
    Case(dtype=torch.float32, accum=4, freed=True, clip=True, scaler="unscale"),
    Case(dtype=torch.bfloat16, accum=1, freed=True),
    Case(dtype=torch.bfloat16, accum=4, freed=False, clip=True),
    Case(dtype=torch.bfloat16, accum=4, freed=True, clip=True),
]


class Net(nn.Module):
    """A tiny Llama plus an auxiliary head that only some steps use (its gradient is None otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        cfg = transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
            tie_word_embeddings=False, attn_implementation="eager",
        )
        self.llama = transformers.LlamaForCausalLM(cfg)
        self.aux = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor, use_aux: bool) -> torch.Tensor:
        loss = self.llama(input_ids=ids, labels=ids).loss
        if use_aux:
            loss = loss + self.aux(self.llama.model.embed_tokens(ids)).float().square().mean()
        return loss


def groups(net: Net) -> list[dict]:
    named = list(net.named_parameters())
    matrices = [p for n, p in named if p.ndim == 2 and not n.startswith("aux")]
    rest = [p for n, p in named if not (p.ndim == 2 and not n.startswith("aux"))]
    return [
        {"params": matrices, "lr": 3e-3, "weight_decay": 0.1},
        {"params": rest, "lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.0, "amsgrad": True},
    ]


def frozen(net: Net) -> tuple[nn.Parameter, nn.Parameter]:
    """(always frozen, frozen until UNFREEZE_AT)."""
    return net.llama.model.embed_tokens.weight, net.llama.model.layers[1].mlp.down_proj.weight


def batch(step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, 32, (2, 8), generator=gen)


class Reference:
    """torch.optim.AdamW(fused=True), on float32 copies for a low-precision model (issue #2's definition)."""

    def __init__(self, net: Net) -> None:
        self.net = net
        self.low = next(net.parameters()).dtype != torch.float32
        self.params = list(net.parameters())
        if self.low:
            self.copies = {p: nn.Parameter(p.detach().float(), requires_grad=p.requires_grad) for p in self.params}
            self.opt = torch.optim.AdamW(
                [{**g, "params": [self.copies[p] for p in g["params"]]} for g in groups(net)], fused=True
            )
        else:
            self.copies = {p: p for p in self.params}
            self.opt = torch.optim.AdamW(groups(net), fused=True)

    def load_grads(self) -> None:
        if self.low:
            for p in self.params:
                self.copies[p].grad = None if p.grad is None else p.grad.float()

    def after_step(self) -> None:
        if self.low:
            with torch.no_grad():
                for p in self.params:
                    p.copy_(self.copies[p])

    def zero_grad(self, set_to_none: bool) -> None:
        self.net.zero_grad(set_to_none=set_to_none)
        self.opt.zero_grad(set_to_none=set_to_none)


def assert_same(net_a: Net, opt_a: OffloadAdamW, ref: Reference, where: str) -> None:
    for (name, pa), pb in zip(net_a.named_parameters(), ref.params):
        assert torch.equal(pa, pb), f"{where}: parameter {name} differs"
        sa, sb = opt_a.state.get(pa, {}), ref.opt.state.get(ref.copies[pb], {})
        assert bool(sa) == bool(sb), f"{where}: {name} has state in one optimizer only"
        if not sb:
            continue
        for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in sb:
                assert torch.equal(sa[key], sb[key]), f"{where}: {key} of {name} differs"
        if ref.low:
            assert torch.equal(sa["master_param"], ref.copies[pb]), f"{where}: master of {name} differs"


def run_case(case: Case, bucket_bytes: int = 32 << 20, update_on: tuple[str, str] = ("host", "host"),
             **options) -> None:
    """One row of the table; ``update_on`` places the two groups (docs/placement.md), ``options`` go to OffloadAdamW."""
    torch.manual_seed(0)
    net_b = Net().to(case.dtype)
    net_a = copy.deepcopy(net_b)
    for net in (net_a, net_b):
        always, later = frozen(net)
        always.requires_grad_(False)
        later.requires_grad_(False)
    ref = Reference(net_b)
    placed = [{**g, "update_on": where} for g, where in zip(groups(net_a), update_on)]
    opt_a = OffloadAdamW(placed, transfer_pipeline=True, offload_gradients=case.freed, bucket_bytes=bucket_bytes, **options)
    on_host = {p for g, where in zip(placed, update_on) if where == "host" for p in g["params"]}
    scaler_a = scaler_b = None
    if case.scaler != "none":
        kw = dict(init_scale=2.0**12, growth_interval=6)
        scaler_a, scaler_b = OffloadGradScaler("cpu", **kw), torch.amp.GradScaler("cpu", **kw)

    for step in range(STEPS):
        if step == UNFREEZE_AT:
            for net in (net_a, net_b):
                frozen(net)[1].requires_grad_(True)
            ref.copies[frozen(net_b)[1]].requires_grad_(True)
        for micro in range(case.accum):
            ids = batch(step, micro)
            use_aux = step % 3 != 0
            for net, scaler in ((net_a, scaler_a), (net_b, scaler_b)):
                with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
                    loss = net(ids, use_aux) / case.accum
                if scaler is not None:
                    loss = scaler.scale(loss)
                    if step == INF_AT and micro == 0:
                        loss = loss * math.inf
                loss.backward()
        if case.freed:  # a host group's gradients are freed; a streamed or resident group's never leave the device
            freed = all(p.grad is None or is_host_resident(p.grad) == (p in on_host) for p in net_a.parameters())
            assert freed, "offload_gradients left a device gradient of a host group, or moved one of another group"
        if case.scaler == "unscale":
            scaler_a.unscale_(opt_a)
            scaler_b.unscale_(ref.opt)
        if case.clip:
            norm_a = opt_a.clip_grad_norm_(CLIP_NORM)
            # The same gradients in the same order (the optimizer's param_groups order): the total norm
            # reduces the per-tensor norms in that order, so another order may differ in the last bit.
            norm_b = torch.nn.utils.clip_grad_norm_([p for g in groups(net_b) for p in g["params"]], CLIP_NORM)
            torch.testing.assert_close(norm_a, norm_b, rtol=0, atol=0, equal_nan=True, msg=f"step {step}: clip norm")
        ref.load_grads()
        if scaler_a is not None:
            before = copy.deepcopy(opt_a.state_dict()) if step == INF_AT else None
            scale_before = scaler_a.get_scale()
            scaler_a.step(opt_a)
            scaler_a.update()
            scaler_b.step(ref.opt)
            scaler_b.update()
            assert scaler_a.get_scale() == scaler_b.get_scale(), f"step {step}: loss scales diverged"
            if before is not None:
                after = opt_a.state_dict()
                assert scaler_a.get_scale() < scale_before, "the infinite step did not back the scale off"
                assert len(before["state"]) > 0
                for pid, st in before["state"].items():
                    for key, value in st.items():
                        assert torch.equal(value, after["state"][pid][key]), "a found_inf step changed the state"
        else:
            opt_a.step()
            ref.opt.step()
        ref.after_step()
        set_to_none = step % 4 != 1
        opt_a.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none)
        if step % CHECK_EVERY == CHECK_EVERY - 1:
            assert_same(net_a, opt_a, ref, f"{case.id} after step {step}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_pipeline_matches_fused_adamw_bitwise(case: Case) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: threads only add noise to the runtime
    try:
        run_case(case)
    finally:
        torch.set_num_threads(threads)
