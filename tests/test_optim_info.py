"""torch's optimizer suite, as properties of OffloadAdamW in every mode, with torch.optim.AdamW as the control.

Modelled on what PyTorch's ``TestOptimRenewed`` (test/test_optim.py, over the ``OptimizerInfo`` entries of
torch/testing/_internal/common_optimizers.py) checks of an optimizer, written here for OffloadAdamW and run over
one configuration table, :data:`MODES`: the plain step, the transfer pipeline with kept gradients, with freed
gradients, with updates during backward, and each placement of the update (host, stream, device; the CPU as device).

Each property makes the same calls on OffloadAdamW and on ``torch.optim.AdamW(fused=True)`` (the optimizer it is
bitwise equal to) and compares the bits, or the calls seen, or the error types:

* state_dict round trips, without and with ``param_names``; a load into a fresh optimizer, into one built without
  names (the names are kept, as torch keeps them), and into torch's AdamW (fused, foreach and for-loop alike), each
  continuing bit for bit;
* tensor lr and betas changed between steps as torch's schedulers change them (filled in place, the tuple replaced);
* hooks: step pre/post hooks, state_dict pre/post hooks, load_state_dict pre/post hooks, called as torch calls them;
* param_groups: a group added after steps, a group's lr and weight decay edited between steps;
* complex parameters, trained as their real views;
* error types: what the constructor refuses, and a meta-device parameter at the step, as torch's types;
* zero_grad with ``set_to_none`` True and False, and a step with no gradient (a no-op).

The table's last column says which modes the quick tier runs (all of them: about 3 s in all).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _parity import same_bits
from offload_adamw import OffloadAdamW

#: OffloadAdamW's modes: (keyword arguments, whether the quick tier runs it). The whole table takes about 3 s on
#: 2 cores, so the quick tier runs all of it; a mode that grows slow is marked False here (then ``-m slow``).
MODES: dict[str, tuple[dict, bool]] = {
    "plain": ({}, True),
    "kept": ({"transfer_pipeline": True}, True),
    "freed": ({"offload_gradients": True}, True),
    "update in backward": ({"offload_gradients": True, "update_in_backward": True, "bucket_bytes": 1}, True),
    "stream": ({"update_on": "stream"}, True),
    "device": ({"update_on": "device"}, True),
}
MODE_PARAMS = [pytest.param(m, marks=() if quick else pytest.mark.slow) for m, (_, quick) in MODES.items()]
LR = 1e-2


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _ours(params, mode: str, **kwargs) -> OffloadAdamW:
    return OffloadAdamW(params, **{"lr": LR, "weight_decay": 0.1, **MODES[mode][0], **kwargs})


def _torch(params, **kwargs) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, **{"lr": LR, "weight_decay": 0.1, "fused": True, **kwargs})


def _train(model: nn.Module, opt, steps: int, start: int = 0) -> None:
    for k in range(start, start + steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(k))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    return all(same_bits(p.detach(), q.detach()) for p, q in zip(a.parameters(), b.parameters()))


# ------------------------------------------------------------------- state_dict


@pytest.mark.parametrize("named", [False, True], ids=["positions", "names"])
@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_state_dict_round_trip_into_a_fresh_optimizer_continues_exactly(mode, named):
    ours, theirs = _model(), _model()
    params = (lambda m: m.named_parameters()) if named else (lambda m: m.parameters())
    opt, ref = _ours(params(ours), mode), _torch(params(theirs))
    _train(ours, opt, 3)
    _train(theirs, ref, 3)
    saved = opt.state_dict()
    assert saved["param_groups"] == ref.state_dict()["param_groups"]  # torch's layout (fused, names)
    assert opt.state_dict().keys() == saved.keys() and opt.state_dict()["param_groups"] == saved["param_groups"]
    resumed = copy.deepcopy(ours)
    again = _ours(params(resumed), mode)
    again.load_state_dict(copy.deepcopy(saved))
    assert again.state_dict()["param_groups"] == saved["param_groups"]
    _train(resumed, again, 2, start=3)
    _train(theirs, ref, 2, start=3)
    assert _same_params(resumed, theirs)


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_named_state_dict_loads_into_optimizers_without_names_and_keeps_them(mode):
    # torch's test_can_load_from_to_named_state_dict: names saved, loaded by an optimizer built without them, kept.
    ours, theirs = _model(), _model()
    opt, ref = _ours(ours.named_parameters(), mode), _torch(theirs.named_parameters())
    _train(ours, opt, 2)
    _train(theirs, ref, 2)
    names = [n for n, _ in ours.named_parameters()]
    for target, control in ((_ours(copy.deepcopy(ours).parameters(), mode), _torch(copy.deepcopy(theirs).parameters())),):
        target.load_state_dict(copy.deepcopy(opt.state_dict()))
        control.load_state_dict(copy.deepcopy(ref.state_dict()))
        assert target.state_dict()["param_groups"][0]["param_names"] == names
        assert control.state_dict()["param_groups"][0]["param_names"] == names


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_a_state_dict_leaves_for_torch_and_continues_exactly(mode):
    ours, theirs = _model(), _model()
    opt, ref = _ours(ours.parameters(), mode), _torch(theirs.parameters())
    _train(ours, opt, 3)
    _train(theirs, ref, 3)
    leaving = copy.deepcopy(ours)
    torch_after = torch.optim.AdamW(leaving.parameters(), lr=LR, weight_decay=0.1)  # torch's defaults
    torch_after.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(leaving, torch_after, 2, start=3)
    _train(theirs, ref, 2, start=3)
    assert _same_params(leaving, theirs)


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_a_state_dict_continues_exactly_in_each_of_torchs_implementations(mode):
    # issue 37: the state_dict carried fused=None, which torch adopts on load (1.5e-8 from the run it continues). Into
    # torch's fused, foreach and for-loop AdamW alike, the continuation is torch's fused run, bit for bit.
    ours, theirs = _model(), _model()
    opt, ref = _ours(ours.parameters(), mode), _torch(theirs.parameters())
    _train(ours, opt, 3)
    _train(theirs, ref, 3)
    leaving = {kind: copy.deepcopy(ours) for kind in ("fused", "foreach", "for-loop")}
    kwargs = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    for kind, model in leaving.items():
        after = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, **kwargs[kind])
        after.load_state_dict(copy.deepcopy(opt.state_dict()))
        _train(model, after, 2, start=3)
    _train(theirs, ref, 2, start=3)
    assert all(_same_params(model, theirs) for model in leaving.values())


@pytest.mark.parametrize("schedule", ["filled in place", "OneCycleLR", "CyclicLR"])
@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_tensor_betas_changed_between_steps_are_honoured_as_torch(mode, schedule):
    # Tensor lr and betas, changed after each step() as torch's schedulers change them (a tensor filled in place; the
    # betas tuple replaced by OneCycleLR and CyclicLR with momentum): every step as torch's fused AdamW.
    ours, theirs = _model(), _model()
    opt = _ours(ours.parameters(), mode, betas=(torch.tensor(0.9), torch.tensor(0.999)), lr=torch.tensor(LR))
    ref = _torch(theirs.parameters(), betas=(torch.tensor(0.9), torch.tensor(0.999)), lr=torch.tensor(LR))
    for model, o in ((ours, opt), (theirs, ref)):
        s = {"filled in place": lambda o: None,
             "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=10),
             "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(
                 o, base_lr=1e-3, max_lr=5e-2, step_size_up=2, base_momentum=0.8, max_momentum=0.9)}[schedule](o)
        for k in range(5):
            _train(model, o, 1, start=k)
            if s is not None:
                s.step()
            else:
                o.param_groups[0]["betas"][0].fill_(0.9 - 0.02 * (k + 1))
                o.param_groups[0]["betas"][1].fill_(0.999 - 0.001 * (k + 1))
    assert _same_params(ours, theirs)


# ------------------------------------------------------------------------ hooks


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_hooks_are_called_as_torch_calls_them(mode):
    seen: dict[str, list] = {"ours": [], "torch": []}
    ours, theirs = _model(), _model()
    pairs = {"ours": (ours, _ours(ours.parameters(), mode)), "torch": (theirs, _torch(theirs.parameters()))}
    for key, (_, o) in pairs.items():
        log = seen[key]
        o.register_step_pre_hook(lambda opt, args, kwargs, log=log: log.append("step pre"))
        o.register_step_post_hook(lambda opt, args, kwargs, log=log: log.append("step post"))
        o.register_state_dict_pre_hook(lambda opt, log=log: log.append("state_dict pre"))

        def post(opt, sd, log=log):
            log.append("state_dict post")
            sd["extra"] = "kept"
            return sd

        o.register_state_dict_post_hook(post)

        def load_pre(opt, sd, log=log):
            log.append("load pre")
            sd = dict(sd)
            sd.pop("extra", None)
            return sd

        o.register_load_state_dict_pre_hook(load_pre)
        o.register_load_state_dict_post_hook(lambda opt, log=log: log.append("load post"))
    for model, o in pairs.values():
        _train(model, o, 2)
        sd = o.state_dict()
        assert sd["extra"] == "kept"
        o.load_state_dict(copy.deepcopy(sd))
        _train(model, o, 1, start=2)
    assert seen["ours"] == seen["torch"]
    assert _same_params(ours, theirs)


# ----------------------------------------------------------------- param_groups


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_a_group_added_after_steps_and_groups_edited_between_steps_train_as_torch(mode):
    ours, theirs = _model(), _model()
    opt = _ours([{"params": ours[0].parameters()}], mode)
    ref = _torch([{"params": theirs[0].parameters()}])
    for model, o in ((ours, opt), (theirs, ref)):
        _train(model, o, 2)
        o.add_param_group({"params": list(model[2].parameters()), "lr": 3e-3, "weight_decay": 0.0})
        _train(model, o, 2, start=2)
        o.param_groups[0]["lr"] = 5e-3  # between steps, as a scheduler does after step()
        o.param_groups[1]["weight_decay"] = 0.2
        _train(model, o, 2, start=4)
    assert _same_params(ours, theirs)
    assert len(opt.state) == len(ref.state) == 4


# ---------------------------------------------------------------------- complex


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_complex_parameters_train_as_their_real_views(mode):
    # torch's test_complex: a complex parameter trains as its view_as_real does.
    gen = torch.Generator().manual_seed(4)
    start = torch.complex(torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen))
    z = nn.Parameter(start.clone())
    opt = _ours([z], mode)
    r = nn.Parameter(torch.view_as_real(start).clone())
    ref = _torch([r])
    for k in range(3):
        x = torch.complex(torch.randn(4, generator=gen), torch.randn(4, generator=gen))
        (z @ x).abs().square().sum().backward()
        opt.step()
        opt.zero_grad()
        w = torch.view_as_complex(r.detach()).clone().requires_grad_()
        (w @ x).abs().square().sum().backward()
        r.grad = torch.view_as_real(w.grad)
        ref.step()
        assert same_bits(torch.view_as_real(z.detach()), r.detach()), k


# ---------------------------------------------------------------------- errors


BAD_KWARGS = [
    {"lr": -1.0}, {"betas": (1.0, 0.0)}, {"weight_decay": -1}, {"eps": -1e-8},
    {"lr": torch.tensor(0.001), "foreach": True}, {"betas": (0.9, torch.tensor(0.99))},
    {"betas": (torch.tensor(0.9), torch.tensor(0.99)), "foreach": True}, {"foreach": True, "fused": True},
]


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_errors_have_torchs_types(mode):
    for kwargs in BAD_KWARGS:
        with pytest.raises(Exception) as theirs:
            torch.optim.AdamW([nn.Parameter(torch.zeros(2))], **kwargs)
        with pytest.raises(Exception) as ours:
            OffloadAdamW([nn.Parameter(torch.zeros(2))], **{**MODES[mode][0], **kwargs})
        assert isinstance(ours.value, type(theirs.value)) and str(ours.value) == str(theirs.value), kwargs
    # A meta parameter: torch's fused AdamW raises RuntimeError at its step (test_fused_error_on_params_on_meta).
    with torch.device("meta"):
        meta = nn.Linear(2, 3)
    opt = OffloadAdamW(meta.parameters(), **MODES[mode][0])
    with torch.device("meta"):
        for p in meta.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="meta device"):
        opt.step()


# ---------------------------------------------------------------- zero_grad, no-ops


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_zero_grad_and_steps_without_gradients_are_torchs(mode, set_to_none):
    ours, theirs = _model(), _model()
    opt, ref = _ours(ours.parameters(), mode), _torch(theirs.parameters())
    for model, o in ((ours, opt), (theirs, ref)):
        o.step()  # no gradient anywhere: a no-op, no state (torch's test_step_is_noop_when_params_have_no_grad)
        assert not o.state
        _train(model, o, 2)
        # With updates during backward every backward outside no_sync() is followed by step() (its protocol).
        with opt.no_sync() if o is opt else _Nothing():
            model(torch.ones(5, 6)).square().mean().backward()
        o.zero_grad(set_to_none=set_to_none)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        if set_to_none:
            assert p.grad is None and q.grad is None
        else:
            assert torch.equal(opt.gradient(p), q.grad) and not q.grad.any()
    if not set_to_none:
        opt.step()  # zero gradients still decay and move the moments, as in torch (test_step_is_noop_for_zero_grads)
        ref.step()
    assert _same_params(ours, theirs)
    assert repr(opt).startswith("OffloadAdamW (")  # torch's test_optimizer_can_be_printed


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
