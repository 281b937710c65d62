"""``max_grad_norm=`` reduces the per-tensor norms in the model's parameter order, whatever the groups' order.

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (the HF Trainer's and accelerate's clipping)
stacks the norms in ``model.parameters()`` order; the Trainer's decay / no-decay groups list them in another,
and the last bit of the total norm depends on the order. Properties, on every path (plain step, kept and freed
gradients, updates during backward), with the model found by the optimizer and with ``opt.clip_order(model)``:
``last_grad_norm`` is torch's total norm bitwise at every step and the parameters are bitwise those of torch's
AdamW(fused) after torch's clipping of the model. The orders differ in the last bit of the norm for this model
(checked, so the test can fail). The 2-rank FSDP2 version is in test_integrations_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from offload_adamw import OffloadAdamW
from offload_adamw.integrations.hf import trainer_param_groups
from test_integrations_trainer import tiny_llama

LR, WD, CLIP, STEPS = 1e-2, 0.1, 0.05, 6
PATHS = {
    "plain": {},
    "kept": {"transfer_pipeline": True},
    "freed": {"offload_gradients": True},
    "update_in_backward": {"offload_gradients": True, "update_in_backward": True},
}


def loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(step))
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("given", [False, True], ids=["model_found", "clip_order_given"])
@pytest.mark.parametrize("path", PATHS)
def test_max_grad_norm_is_torchs_clipping_of_the_model_whatever_the_group_order(path, given):
    model, reference = tiny_llama(), tiny_llama()
    opt = OffloadAdamW(trainer_param_groups(model, WD), lr=LR, max_grad_norm=CLIP, **PATHS[path])
    if given:
        opt.clip_order(model)
    ref_groups = trainer_param_groups(reference, WD)
    ref_opt = torch.optim.AdamW(ref_groups, lr=LR, fused=True)
    group_order = [p for g in ref_groups for p in g["params"]]
    assert [id(p) for p in group_order] != [id(p) for p in reference.parameters()], "the groups are in the model's order"
    orders_differ = False
    for step in range(STEPS):
        loss(model, step).backward()
        opt.step()
        opt.zero_grad()
        loss(reference, step).backward()
        by_groups = torch.nn.utils.get_total_norm([p.grad for p in group_order])
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        orders_differ |= not torch.equal(by_groups, norm)
        ref_opt.step()
        ref_opt.zero_grad()
        assert opt.last_grad_norm is not None and torch.equal(opt.last_grad_norm, norm), (
            f"step {step}: last_grad_norm {opt.last_grad_norm} is not torch's {norm}")
    assert orders_differ, "the two orders give the same norm bits here: the test could not fail"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_clip_order_takes_a_module():
    opt = OffloadAdamW(tiny_llama().parameters())
    with pytest.raises(TypeError, match="clip_order takes the model"):
        opt.clip_order([torch.zeros(1)])  # type: ignore[arg-type]


def test_without_a_model_holding_every_parameter_the_order_is_the_groups():
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    opt = OffloadAdamW([{"params": [b.weight, a.weight]}, {"params": [b.bias, a.bias]}])
    ids = lambda params: [id(p) for p in params]  # noqa: E731
    assert ids(opt.clip_parameters()) == ids([b.weight, a.weight, b.bias, a.bias])
    both = torch.nn.ModuleList([a, b])  # now one module holds them all
    assert ids(opt.clip_parameters()) == ids([b.weight, a.weight, b.bias, a.bias]), "searched again without a change"
    opt.clip_order(both)
    assert ids(opt.clip_parameters()) == ids([a.weight, a.bias, b.weight, b.bias])


@pytest.mark.parametrize("path", ["plain", "kept", "freed"])
def test_a_step_that_takes_no_norm_does_not_look_for_the_model(monkeypatch, path) -> None:
    """Without ``max_grad_norm`` (and without updates during backward, whose hooks always take the norms) the step
    reads no norm, so it has no order to find: the search walks every live object once (optim/clip_order.py)."""
    from offload_adamw.optim import clip_order

    searched: list[int] = []
    real = clip_order.ClipOrder._compute

    def counted(self, params):
        searched.append(len(params))
        return real(self, params)

    monkeypatch.setattr(clip_order.ClipOrder, "_compute", counted)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = OffloadAdamW(model.parameters(), **PATHS[path])
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert searched == [], "looked for the model's order without a norm to take"
