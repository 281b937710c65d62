"""Complex parameters train as torch's AdamW trains them: as their ``torch.view_as_real`` views (issue 37).

torch's loops (single-tensor and foreach) view a complex parameter, its gradient and its moments as real tensors
with a last dimension of 2 and run the real update on them; its fused AdamW refuses complex parameters. So:

* ``fused=False``: bitwise torch's single-tensor AdamW on the complex parameters;
* the default (the fused kernel): bitwise torch's fused AdamW on the ``view_as_real`` copies, which is how torch's
  loops treat them (torch's own suite checks a complex run against its real view, test_complex);
* the state is complex, as torch's, and a state_dict moves either way;
* modes that cannot hold them refuse them by name at construction, before any update.
"""

from __future__ import annotations

import copy

import pytest
import torch

from configs import MODES, assert_bitwise_equal
from offload_adamw import OffloadAdamW

STEPS = 12


def _complex_params(dtype=torch.complex64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    real = {torch.complex64: torch.float32, torch.complex128: torch.float64}[dtype]
    shapes = {"phase": (5, 3), "gain": (7,), "scalar": ()}
    return {n: torch.nn.Parameter(torch.complex(torch.randn(s, generator=gen, dtype=real),
                                                torch.randn(s, generator=gen, dtype=real))) for n, s in shapes.items()}


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.complex(torch.randn(p.shape, generator=gen, dtype=p.real.dtype),
                             torch.randn(p.shape, generator=gen, dtype=p.real.dtype)) for n, p in params.items()}


def _train(params, opt, steps=STEPS, start=0):
    for k in range(start, start + steps):
        for n, g in _grads(params, 100 + k).items():
            params[n].grad = g.clone()
        opt.step()


def _real_copies(params):
    return {n: torch.nn.Parameter(torch.view_as_real(p.detach()).clone()) for n, p in params.items()}


def _train_real(params, opt, steps=STEPS, start=0):
    as_complex = {n: torch.view_as_complex(p.detach()) for n, p in params.items()}
    for k in range(start, start + steps):
        for n, g in _grads(as_complex, 100 + k).items():
            params[n].grad = torch.view_as_real(g).clone()
        opt.step()


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_fused_false_is_bitwise_torch_single_tensor_adamw_on_complex_parameters(dtype, amsgrad):
    ours, theirs = _complex_params(dtype), _complex_params(dtype)
    kwargs = dict(lr=0.01, weight_decay=0.1, amsgrad=amsgrad)
    opt = OffloadAdamW(list(ours.items()), fused=False, **kwargs)
    ref = torch.optim.AdamW(list(theirs.values()), foreach=False, fused=False, **kwargs)
    _train(ours, opt)
    _train(theirs, ref)
    for n in ours:
        assert ours[n].dtype == dtype, n
        assert_bitwise_equal(ours[n].detach(), theirs[n].detach(), n)
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            mine, torchs = opt.state[ours[n]][key], ref.state[theirs[n]][key]
            assert mine.dtype == dtype
            assert_bitwise_equal(mine, torchs, f"{key} of {n}")


@pytest.mark.parametrize("mode", ["plain", "maximize"])
def test_default_is_bitwise_torch_fused_adamw_on_the_real_views(mode):
    extra = {"maximize": True} if mode == "maximize" else {}
    ours = _complex_params()
    real = _real_copies(ours)
    opt = OffloadAdamW(list(ours.items()), lr=0.01, **extra)
    ref = torch.optim.AdamW(list(real.values()), lr=0.01, fused=True, **extra)
    _train(ours, opt)
    _train_real(real, ref)
    for n in ours:
        assert_bitwise_equal(torch.view_as_real(ours[n].detach()), real[n].detach(), n)
        assert_bitwise_equal(torch.view_as_real(opt.state[ours[n]]["exp_avg_sq"]), ref.state[real[n]]["exp_avg_sq"],
                             f"exp_avg_sq of {n}")


def test_complex_state_dict_moves_to_torch_and_back_and_continues_exactly():
    ours = _complex_params()
    opt = OffloadAdamW(list(ours.items()), lr=0.01, fused=False)
    _train(ours, opt, 4)
    theirs = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ours.items()}
    ref = torch.optim.AdamW(list(theirs.items()), lr=0.01, foreach=False, fused=False)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    back = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ours.items()}
    again = OffloadAdamW(list(back.items()), lr=0.01, fused=False)
    again.load_state_dict(copy.deepcopy(ref.state_dict()))
    for params, optimizer in ((ours, opt), (theirs, ref), (back, again)):
        _train(params, optimizer, 4, start=4)
    for n in ours:
        assert_bitwise_equal(ours[n].detach(), theirs[n].detach(), n)
        assert_bitwise_equal(back[n].detach(), theirs[n].detach(), f"{n} after the way back")


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex32_is_refused_by_name():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex32))
    with pytest.raises(ValueError, match="parameter 'half'.*complex32"):
        OffloadAdamW([("half", p)])


def _loss(z, x):
    return (z * x).real.sum() + 0.1 * (z.conj() * z).real.square().sum()


@pytest.mark.filterwarnings("ignore:an OffloadAdamW was dropped between backward and step")  # the refused one
@pytest.mark.parametrize("mode", ["freed", "update_in_backward"])
def test_complex_parameters_with_freed_gradients_on_the_simulated_device(mode, simulated_device):
    # The copies of a complex gradient to the host and of the parameter back land late into poisoned buffers on the
    # simulated CUDA device (training them as their real views there, in every mode: the generic property of
    # tests/test_optim_info.py under the simulated wrapper); with updates during backward an edit through p.data is
    # then seen by the device fingerprint of the complex parameter (its real view's bytes).
    from offload_adamw.accel import streams

    gen = torch.Generator().manual_seed(5)
    params = {n: torch.nn.Parameter(torch.complex(torch.randn(s, generator=gen), torch.randn(s, generator=gen)))
              for n, s in (("z", (40, 3)), ("w", (9,)))}
    opt = OffloadAdamW(list(params.items()), **MODES[mode].kwargs(lr=0.01, bucket_bytes=1))
    assert all(streams.is_device_tensor(p) for p in params.values())
    for k in range(3):
        x = torch.complex(torch.randn(3, generator=gen), torch.randn(3, generator=gen))
        (_loss(params["z"], x) + _loss(params["w"], x[:1])).backward()
        if k < 2:
            opt.step()
            opt.zero_grad()
    if mode == "update_in_backward":
        params["w"].data[4] *= 1j  # a quarter turn of one element, through .data
        with pytest.raises(RuntimeError, match="parameter 'w' was changed between backward and step"):
            opt.step()
