"""OffloadAdamW's constructor accepts and refuses what torch.optim.AdamW does, with the same messages."""

from __future__ import annotations

import warnings

import pytest
import torch

from configs import CONFIGS, params
from offload_adamw import OffloadAdamW


def _p(*shape):
    return torch.nn.Parameter(torch.zeros(shape or (2,)))


P, Q = _p(3), _p(2)
NAN = float("nan")

BAD = {
    "negative lr": lambda cls: cls([P], lr=-1e-3),
    "NaN lr": lambda cls: cls([P], lr=NAN),
    "2-element tensor lr": lambda cls: cls([P], lr=torch.tensor([1e-3, 1e-3])),
    "tensor lr with foreach": lambda cls: cls([P], lr=torch.tensor(1e-3), foreach=True),
    "negative eps": lambda cls: cls([P], eps=-1e-8),
    "NaN eps": lambda cls: cls([P], eps=NAN),
    "beta1 = 1": lambda cls: cls([P], betas=(1.0, 0.999)),
    "negative beta1": lambda cls: cls([P], betas=(-0.1, 0.999)),
    "NaN beta2": lambda cls: cls([P], betas=(0.9, NAN)),
    "beta2 > 1": lambda cls: cls([P], betas=(0.9, 1.5)),
    "mixed float/tensor betas": lambda cls: cls([P], betas=(0.9, torch.tensor(0.999))),
    "2-element tensor beta": lambda cls: cls([P], betas=(torch.tensor([0.9, 0.9]), torch.tensor(0.999))),
    "negative weight decay": lambda cls: cls([P], weight_decay=-0.1),
    "NaN weight decay": lambda cls: cls([P], weight_decay=NAN),
    "a single tensor as params": lambda cls: cls(P),
    "empty params": lambda cls: cls([]),
    "a parameter in two groups": lambda cls: cls([{"params": [P]}, {"params": [P]}]),
    "named mixed with unnamed": lambda cls: cls([{"params": [("a", P)]}, {"params": [Q]}]),
    "fused and foreach": lambda cls: cls([P], fused=True, foreach=True),
    "non-leaf tensor": lambda cls: cls([P * 2]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_refuses_what_torch_refuses_with_the_same_message(case):
    make = BAD[case]
    with pytest.raises(Exception) as theirs:
        make(torch.optim.AdamW)
    with pytest.raises(Exception) as ours:
        make(OffloadAdamW)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("mode", params(CONFIGS))
def test_a_tensor_listed_twice_in_a_group_is_refused_by_name_in_every_mode(mode):
    # torch updates a tensor listed twice in one group twice per step and warns that this is deprecated (it will be
    # an error); the pipeline paths updated it once. Refused, naming it, before anything exists, whatever the mode.
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        torch.optim.AdamW([P, P])
    assert any("duplicate parameters" in str(w.message) for w in theirs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's deprecation warning is not given on top of the refusal
        with pytest.raises(ValueError, match=r"parameter 'w' is listed twice in param_groups\[0\]"):
            OffloadAdamW([("w", P), ("b", Q), ("w again", P)], **CONFIGS[mode].kwargs())
        with pytest.raises(ValueError, match=r"parameter 0 of param_groups\[0\] \(shape \(3,\)\) is listed twice"):
            OffloadAdamW([P, Q, P], **CONFIGS[mode].kwargs())
        opt = OffloadAdamW([Q], **CONFIGS[mode].kwargs())
        with pytest.raises(ValueError, match=r"parameter 0 of param_groups\[1\] \(shape \(3,\)\) is listed twice"):
            opt.add_param_group({"params": [P, P]})
        assert len(opt.param_groups) == 1


def test_defaults_and_group_keys_match_torch():
    ours = OffloadAdamW([P])
    theirs = torch.optim.AdamW([P])
    assert ours.defaults == theirs.defaults
    assert [{k: v for k, v in g.items() if k != "update_on"} for g in ours.param_groups] == theirs.param_groups
    # Saved, fused=None names the kernel it runs, torch's fused one (test_state_dict.py, leaving for torch).
    assert ours.state_dict()["param_groups"] == torch.optim.AdamW([P], fused=True).state_dict()["param_groups"]


def test_named_parameters_are_recorded():
    model = torch.nn.Linear(3, 2)
    sd = OffloadAdamW(model.named_parameters()).state_dict()
    assert sd["param_groups"][0]["param_names"] == ["weight", "bias"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"capturable": True}, "does not support capturable=True"),
        ({"differentiable": True}, "does not support differentiable=True"),
        ({"nonfinite": "ignore"}, "nonfinite must be one of"),
    ],
)
def test_options_that_cannot_apply_are_refused_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadAdamW([P], **kwargs)


@pytest.mark.parametrize("case", ["differentiable", "capturable", "integer parameter"])
def test_refusals_torch_raises_as_runtime_error_are_runtime_errors_too(case):
    # torch's fused AdamW refuses differentiable=True and a non-floating parameter with RuntimeError (capturable on
    # the host is refused at its step): code catching torch's error must catch ours, which stays a ValueError too.
    params = [torch.zeros(2, dtype=torch.int64)] if case == "integer parameter" else [P]
    kwargs = {} if case == "integer parameter" else {case: True}
    if case == "differentiable":
        with pytest.raises(RuntimeError):
            torch.optim.AdamW(params, fused=True, **kwargs)
    with pytest.raises(RuntimeError) as ours:
        OffloadAdamW(params, **kwargs)
    assert isinstance(ours.value, ValueError)


def test_sparse_gradient_refused_at_step_by_name():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = OffloadAdamW(emb.named_parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients \\(parameter 'weight'\\)"):
        opt.step()


def test_accepted_values_torch_accepts():
    for kwargs in ({"eps": 0.0}, {"lr": 0.0}, {"betas": (0.0, 0.0)}, {"lr": torch.tensor(1e-3)},
                   {"betas": (torch.tensor(0.9), torch.tensor(0.99))}, {"foreach": False}, {"fused": False}):
        torch.optim.AdamW([P], **kwargs)
        OffloadAdamW([P], **kwargs)
