"""The generic properties of OffloadAdamW, each written once over the configuration table (tests/support/configs.py).

Modelled on PyTorch's ``TestOptimRenewed`` (test/test_optim.py), which crosses its generic tests with the
``OptimizerInfo`` entries of torch/testing/_internal/common_optimizers.py: here every property runs over
:data:`configs.CONFIGS` (the plain step, the transfer pipeline with kept gradients, with freed gradients, with updates
during backward, and the stream and device placements; the CPU as device), and the training properties also under
each in-process wrapper of :data:`configs.WRAPPERS` (eager, a compiled model, compiled autograd, the simulated CUDA
device). An entry that does not support a feature must refuse it with the message the table gives: the test asserts
the refusal, it never skips.

Each property makes the same calls on OffloadAdamW and on ``torch.optim.AdamW(fused=True)`` (the optimizer it is
bitwise equal to) and compares the bits (``configs.assert_bitwise_equal``), or the calls seen, or the error types:

* training: bitwise parity of parameters and moments over micro-batches (gradient accumulation), clipped by the
  optimizer's ``max_grad_norm`` or by torch's ``clip_grad_norm_`` on ``p.grad``, under every wrapper;
  ``step(closure)``; fp16 loss scaling; a ``param_groups`` swap before training, as accelerate and the Trainer do it;
  a sparse gradient refused;
* state_dict round trips, without and with ``param_names``; a load into a fresh optimizer, into one built without
  names (the names are kept, as torch keeps them), and into torch's AdamW (fused, foreach and for-loop alike), each
  continuing bit for bit;
* tensor lr and betas changed between steps as torch's schedulers change them (filled in place, the tuple replaced);
* hooks: step pre/post hooks, state_dict pre/post hooks, load_state_dict pre/post hooks, called as torch calls them;
* param_groups: a group added after steps, a group's lr and weight decay edited between steps;
* complex parameters, trained as their real views;
* error types: what the constructor refuses, and a meta-device parameter at the step, as torch's types;
* zero_grad with ``set_to_none`` True and False, and a step with no gradient (a no-op).

The table says which entries the quick tier runs (``Entry.quick``, ``Wrapper.quick``); the rest is ``-m slow``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from configs import CONFIGS, assert_bitwise_equal, crossed, params, same_bits
from offload_adamw import OffloadAdamW, OffloadGradScaler

MODE_PARAMS = params(CONFIGS)
LR = 1e-2


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _ours(params, mode: str, **kwargs) -> OffloadAdamW:
    return OffloadAdamW(params, **CONFIGS[mode].kwargs(**{"lr": LR, "weight_decay": 0.1, **kwargs}))


def _torch(params, **kwargs) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, **{"lr": LR, "weight_decay": 0.1, "fused": True, **kwargs})


def _train(model: nn.Module, opt, steps: int, start: int = 0) -> None:
    for k in range(start, start + steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(k))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    assert_bitwise_equal(dict(a.named_parameters()), dict(b.named_parameters()), "parameters")


def _assert_trained_as_torch(ours: nn.Module, opt: OffloadAdamW, theirs: nn.Module, ref: torch.optim.Optimizer,
                             seed: int = 0) -> None:
    """Parameters and both moments bitwise torch's, and training moved the parameters (from ``_model(seed)``'s)."""
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert_bitwise_equal(p, q, f"parameter {name}")
        for key in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(opt.state[p][key], ref.state[q][key], f"{key} of {name}")
    assert any(not same_bits(p, q) for p, q in zip(ours.parameters(), _model(seed).parameters())), "nothing was trained"


# ------------------------------------------------------------------- training

CLIP = 0.05  # below every step's norm: the clipping acts


def _wrapped(model: nn.Module, wrapper: str) -> nn.Module:
    # aot_eager: AOTAutograd's graphs with eager kernels, the autograd structure of inductor without C++ compilation
    return torch.compile(model, backend="aot_eager") if wrapper in ("compiled_model", "compiled_autograd") else model


def _backward(loss: torch.Tensor, wrapper: str) -> None:
    if wrapper == "compiled_autograd":
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
            loss.backward()
    else:
        loss.backward()


def _steps(model: nn.Module, opt, wrapper: str, *, accumulation: int, clip_by: str | None, ours: bool,
           steps: int = 3, no_sync: bool | None = None) -> None:
    """``steps`` steps of ``accumulation`` micro-batches; the micro-batches that only accumulate run inside
    ``opt.no_sync()`` where ``no_sync`` says (None: where the optimizer's protocol needs it, with updates during
    backward). ``clip_by``: None, "torch" (clip_grad_norm_ on the model's gradients, both sides) or "optimizer" (ours
    by max_grad_norm, torch's by clip_grad_norm_)."""
    if no_sync is None:
        no_sync = ours and opt.update_in_backward
    for k in range(steps):
        for micro in range(accumulation):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(k * accumulation + micro))
            last = micro == accumulation - 1
            with opt.no_sync() if ours and no_sync and not last else contextlib.nullcontext():
                _backward(model(x).square().sum() / accumulation, wrapper)
        if clip_by == "torch" or (clip_by == "optimizer" and not ours):
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


COMPILED = ("compiled_model", "compiled_autograd")
#: (mode, wrapper, clip_by): a compiled run costs 1 to 10 s on 2 cores, so the quick tier clips the compiled runs by
#: torch's clip_grad_norm_ only (the frameworks' way, as it always did); by max_grad_norm they run under -m slow.
TRAINING = [pytest.param(*p.values, clip_by, id=f"{p.id}-{clip_by}",
                         marks=pytest.mark.slow if p.marks or (p.values[1] in COMPILED and clip_by == "optimizer") else ())
            for p in crossed(["eager", *COMPILED, "simulated"]) for clip_by in ("optimizer", "torch")]


@pytest.mark.parametrize(("mode", "wrapper", "clip_by"), TRAINING)
def test_training_with_accumulation_and_clipping_is_torch_adamw_bitwise(mode, wrapper, clip_by, request):
    """2 micro-batches a step, clipped; torch's clip_grad_norm_ on p.grad where the entry supports it (``torch_clip``),
    else its refusal."""
    if wrapper in COMPILED:
        request.getfixturevalue("fresh_dynamo")
    if wrapper == "simulated":
        request.getfixturevalue("simulated_device")
    entry = CONFIGS[mode]
    assert {"clip"} <= entry.supports and (wrapper not in COMPILED or "compile" in entry.supports)
    assert "accumulation" in entry.supports or "no_sync" in entry.supports  # _steps takes the one the entry needs
    ours, theirs = _model(), _model()
    opt = _ours(ours.parameters(), mode, max_grad_norm=CLIP if clip_by == "optimizer" else None)
    ref = _torch(theirs.parameters())
    runs = ((_wrapped(ours, wrapper), opt, True), (_wrapped(theirs, wrapper), ref, False))
    if clip_by == "torch" and "torch_clip" not in entry.supports:
        with pytest.raises(RuntimeError, match=entry.refusals["torch_clip"]):
            _steps(*runs[0][:2], wrapper, accumulation=2, clip_by=clip_by, ours=True)
        return
    for model, o, is_ours in runs:
        _steps(model, o, wrapper, accumulation=2, clip_by=clip_by, ours=is_ours)
    _assert_trained_as_torch(ours, opt, theirs, ref)


@pytest.mark.parametrize(("accumulation", "how"), [(1, "p.grad"), (4, "p.grad"), (4, "no_sync")],
                         ids=["acc1", "acc4-p.grad", "acc4-no_sync"])
@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_gradient_accumulation_is_torch_adamw_bitwise(mode, accumulation, how):
    """Micro-batches accumulated into p.grad (``accumulation``), or inside opt.no_sync() but for the last
    (``no_sync``); an entry that takes one gradient per step refuses the second."""
    entry = CONFIGS[mode]
    feature = "no_sync" if how == "no_sync" else "accumulation"
    ours, theirs = _model(), _model()
    opt, ref = _ours(ours.parameters(), mode), _torch(theirs.parameters())
    if accumulation > 1 and feature not in entry.supports:
        _steps(ours, opt, "eager", accumulation=1, clip_by=None, ours=True, steps=1)  # the buckets are known
        with pytest.raises(RuntimeError, match=entry.refusals[feature]):
            _steps(ours, opt, "eager", accumulation=accumulation, clip_by=None, ours=True, steps=1, no_sync=False)
        return
    _steps(ours, opt, "eager", accumulation=accumulation, clip_by=None, ours=True, steps=4, no_sync=how == "no_sync")
    _steps(theirs, ref, "eager", accumulation=accumulation, clip_by=None, ours=False, steps=4)
    _assert_trained_as_torch(ours, opt, theirs, ref)


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_a_step_with_a_closure_is_torch_adamw_bitwise(mode):
    assert "closure" in CONFIGS[mode].supports
    ours, theirs = _model(), _model()
    opt, ref = _ours(ours.parameters(), mode), _torch(theirs.parameters())
    for model, o in ((ours, opt), (theirs, ref)):
        for k in range(3):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(k))

            def closure(model=model, o=o, x=x):
                o.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                return loss

            loss = o.step(closure)
            assert loss is not None and loss.requires_grad, "step(closure) returns the closure's loss"
    _assert_trained_as_torch(ours, opt, theirs, ref)


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_fp16_loss_scaling_is_torch_gradscaler_or_refused(mode):
    """OffloadGradScaler against torch's GradScaler over AdamW(fused=True), one step made infinite and skipped."""
    entry = CONFIGS[mode]
    ours, theirs = _model(), _model()
    opt, ref = _ours(ours.parameters(), mode), _torch(theirs.parameters())
    kw = dict(init_scale=2.0**12, growth_interval=2)
    scalers = (OffloadGradScaler("cpu", **kw), torch.amp.GradScaler("cpu", **kw))
    if "scaler" not in entry.supports:
        with pytest.raises(RuntimeError, match=entry.refusals["scaler"]):
            scalers[0].scale(ours(torch.ones(5, 6)).square().mean()).backward()
            scalers[0].step(opt)
        return
    for model, o, scaler in ((ours, opt, scalers[0]), (theirs, ref, scalers[1])):
        for k in range(5):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(k))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = scaler.scale(model(x).float().square().mean())
            (loss * float("inf") if k == 2 else loss).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    assert scalers[0].get_scale() == scalers[1].get_scale() and len(opt.state) == len(ref.state)
    _assert_trained_as_torch(ours, opt, theirs, ref)


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_a_sparse_gradient_is_refused_before_anything_changes(mode):
    entry = CONFIGS[mode]
    assert "sparse" not in entry.supports  # torch's fused AdamW refuses them too
    embedding = nn.Embedding(5, 3, sparse=True)
    before = embedding.weight.detach().clone()
    opt = _ours(embedding.named_parameters(), mode)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=entry.refusals["sparse"]) as refused:
        opt.step()
    assert "'weight'" in str(refused.value), "the refusal names the parameter"
    assert_bitwise_equal(embedding.weight, before, "the embedding after the refused step")
    assert not opt.state


def _swap(opt: torch.optim.Optimizer, new: nn.Module) -> None:
    """What accelerate's fsdp2_switch_optimizer_parameters does: each group's list replaced by the new parameters."""
    mapping = iter(list(new.parameters()))
    for group in opt.param_groups:
        group["params"] = [next(mapping) for _ in group["params"]]


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_training_after_a_param_groups_swap_is_torch_adamw(mode):
    """Built over one model, its parameters then swapped for another's (tests/test_param_swap.py: what the pipeline
    keeps of the originals): training the new parameters is torch's, bit for bit."""
    ours, theirs = _model(1), _model(1)
    opt, ref = _ours(_model().parameters(), mode), _torch(_model().parameters())
    _swap(opt, ours)
    _swap(ref, theirs)
    for model, o in ((ours, opt), (theirs, ref)):
        _train(model, o, 4)
    _assert_trained_as_torch(ours, opt, theirs, ref, seed=1)


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
    _assert_same_params(resumed, theirs)


def _mixed_run(mode: str, steps: int = 4) -> dict:
    """bf16 parameters in two groups (one with amsgrad), 2 micro-batches a step, a branch without gradient every
    other step; the state_dict after ``steps`` steps."""
    from test_offload import Mixed, _x

    torch.manual_seed(0)
    model = Mixed(torch.bfloat16)
    opt = OffloadAdamW([{"params": [model.a.weight, model.b.weight], "weight_decay": 0.1},
                        {"params": [model.a.bias, model.b.bias, model.c.weight], "amsgrad": True}], **CONFIGS[mode].kwargs())
    for step in range(steps):
        for micro in range(2):
            with opt.no_sync() if opt.update_in_backward and micro == 0 else contextlib.nullcontext():
                model(_x(10 * step + micro), (True, step % 2 == 0, True)).backward()
        opt.step()
        opt.zero_grad()
    return opt.state_dict()


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_the_state_dict_is_the_plain_steps_in_every_configuration(mode):
    """Layout, hyperparameters, dtypes, devices and bits: what a configuration saves is what the plain step saves."""
    plain, other = _mixed_run("plain"), _mixed_run(mode)
    assert other["param_groups"] == plain["param_groups"]
    assert_bitwise_equal(other["state"], plain["state"], "state")
    for pid, entry in plain["state"].items():
        assert all(value.device == other["state"][pid][key].device for key, value in entry.items()), pid


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
    _assert_same_params(leaving, theirs)


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
    for kind, model in leaving.items():
        assert_bitwise_equal(dict(model.named_parameters()), dict(theirs.named_parameters()), f"parameters ({kind})")


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
    _assert_same_params(ours, theirs)


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
    _assert_same_params(ours, theirs)


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
    _assert_same_params(ours, theirs)
    assert len(opt.state) == len(ref.state) == 4


# ---------------------------------------------------------------------- complex


@pytest.mark.parametrize(("mode", "wrapper"), crossed(["eager", "simulated"]))
def test_complex_parameters_train_as_their_real_views(mode, wrapper, request):
    # torch's test_complex: a complex parameter trains as its view_as_real does. On the simulated device the copies
    # of its gradient to the host and of the parameter back land late, into poisoned buffers.
    assert "complex" in CONFIGS[mode].supports
    if wrapper == "simulated":
        request.getfixturevalue("simulated_device")
    gen = torch.Generator().manual_seed(4)
    start = torch.complex(torch.randn(40, 4, generator=gen), torch.randn(40, 4, generator=gen))
    z = nn.Parameter(start.clone())
    opt = _ours([z], mode)
    r = nn.Parameter(torch.view_as_real(start).clone())
    ref = _torch([r])
    for k in range(4):
        x = torch.complex(torch.randn(4, generator=gen), torch.randn(4, generator=gen))
        (z @ x).abs().square().sum().backward()
        opt.step()
        opt.zero_grad()
        w = torch.view_as_complex(r.detach()).clone().requires_grad_()
        (w @ x).abs().square().sum().backward()
        r.grad = torch.view_as_real(w.grad)
        ref.step()
        assert_bitwise_equal(torch.view_as_real(z.detach()), r.detach(), f"the real view after step {k}")


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
            OffloadAdamW([nn.Parameter(torch.zeros(2))], **CONFIGS[mode].kwargs(**kwargs))
        assert isinstance(ours.value, type(theirs.value)) and str(ours.value) == str(theirs.value), kwargs
    # A meta parameter: torch's fused AdamW raises RuntimeError at its step (test_fused_error_on_params_on_meta).
    with torch.device("meta"):
        meta = nn.Linear(2, 3)
    opt = OffloadAdamW(meta.parameters(), **CONFIGS[mode].kwargs())
    with torch.device("meta"):
        for p in meta.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="meta device"):
        opt.step()


# ---------------------------------------------------------------- zero_grad, no-ops


def zero_grad_run(mode: str, set_to_none: bool) -> None:
    """zero_grad both ways and steps without gradients, as torch's fused AdamW: a step with no gradient anywhere is a
    no-op that makes no state; every other step has no backward, only what zero_grad left behind (None, or zeros that
    still decay and move the moments); a backward inside no_sync() then zero_grad leaves None or zeros, as torch's.
    (tests/test_simulated_suites.py runs it on the simulated device with seeds of its own.)"""
    ours, theirs = _model(), _model()
    opt, ref = _ours(ours.parameters(), mode), _torch(theirs.parameters())
    for o in (opt, ref):
        o.step()  # torch's test_step_is_noop_when_params_have_no_grad
        assert not o.state
    for step in range(4):
        for model, o in ((ours, opt), (theirs, ref)):
            if step % 2 == 0:
                model(torch.randn(5, 6, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            o.step()
            o.zero_grad(set_to_none=set_to_none)
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            g = opt.gradient(p)
            assert (g is None) == (q.grad is None), f"step {step}: {name}'s gradient is None in one optimizer only"
            if g is not None:
                assert_bitwise_equal(g, q.grad, f"step {step}: the gradient zero_grad left of {name}")
    for model, o in ((ours, opt), (theirs, ref)):
        # With updates during backward every backward outside no_sync() is followed by step() (its protocol).
        with opt.no_sync() if o is opt else contextlib.nullcontext():
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
    _assert_same_params(ours, theirs)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert_bitwise_equal(opt.state[p]["step"], ref.state[q]["step"], "step count")
    assert repr(opt).startswith("OffloadAdamW (")  # torch's test_optimizer_can_be_printed


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize(("mode", "wrapper"), crossed(["eager", "simulated"]))
def test_zero_grad_and_steps_without_gradients_are_torchs(mode, wrapper, set_to_none, request):
    if wrapper == "simulated":
        request.getfixturevalue("simulated_device")
    zero_grad_run(mode, set_to_none)
