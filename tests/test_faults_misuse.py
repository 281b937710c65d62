"""Fault and misuse: what users do to parameters and optimizers between steps, held to torch.optim.AdamW.

Each case is either exact (bitwise what torch's AdamW computes for the same calls, or the parity
definition of docs/contract.md for low-precision models) or refused before anything changes, with a
message that names the parameter and says what to do. Tables of configurations crossed with the
properties they must keep:

* non-contiguous parameters (channels_last convolutions, transposed views, strided slices) x
  gradient layouts x dtypes x kernels: results independent of the layout, state laid out like the
  parameter (as ``torch.zeros_like``), state_dicts interchangeable with torch's in both directions;
* a model cast after some steps (``model.float()`` of a bf16 model, ...) x kernels: refused at the
  next step as torch refuses it, before any change, and the remedy it names works;
* edits of a low-precision parameter between steps (``load_state_dict``, ``clamp_``, a pruning mask,
  ``.data`` writes, ``copy_``) x dtypes x paths: the next update starts from the edited parameter,
  element by element, also through a state_dict or a checkpoint saved after the edit;
* invalid entries put into ``opt.state_dict()`` and loaded: refused, the live state untouched;
* ``copy.deepcopy``, pickle and ``torch.save`` of the optimizer x configurations: a copy that steps
  exactly as an optimizer never copied, the original unaffected;
* where the host state is pinned: only when asked.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from _parity import same_bits
from offload_adamw import OffloadAdamW

STEPS = 4

# ----------------------------------------------------------------- non-contiguous parameters


def conv_channels_last(dtype: torch.dtype) -> list[nn.Parameter]:
    """PyTorch's performance advice for CNNs: ``model.to(memory_format=torch.channels_last)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 3)).to(dtype).to(memory_format=torch.channels_last)
    return list(model.parameters())


def transposed_view(dtype: torch.dtype) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(1)
    return [nn.Parameter(torch.randn(40, 70, generator=gen).to(dtype).t()), nn.Parameter(torch.randn(9, generator=gen).to(dtype))]


def strided_slice(dtype: torch.dtype) -> list[nn.Parameter]:
    """Not dense at all: every other column of a larger tensor."""
    gen = torch.Generator().manual_seed(2)
    return [nn.Parameter(torch.randn(30, 80, generator=gen).to(dtype)[:, ::2])]


LAYOUTS: dict[str, Callable[[torch.dtype], list[nn.Parameter]]] = {
    "conv-channels-last": conv_channels_last,
    "transposed-view": transposed_view,
    "strided-slice": strided_slice,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
# How the user's gradient is laid out: as autograd leaves it (like the parameter), or contiguous
# (a gradient set by hand, ``p.grad = g.contiguous()``).
GRAD_LAYOUTS = ("like-param", "contiguous")


def dense_copies(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Copies laid out as ``torch.zeros_like`` lays the parameters out: the same layout for a dense one.

    The reference is torch's fused AdamW on tensors of this layout with gradients of this layout, as
    autograd hands them over: its fused op computes the last ``numel % 16`` elements in memory order
    with a scalar tail whose last bits may differ, so the layout decides which elements those are.
    """
    return [nn.Parameter(torch.empty_like(p).copy_(p.detach())) for p in params]


def scripted_grad(index: int, step: int, p: torch.Tensor, layout: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * index + step)
    g = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.1).to(p.dtype)
    return torch.empty_like(p).copy_(g) if layout == "like-param" else g.contiguous()


def train(opt: torch.optim.Optimizer, params: list[nn.Parameter], grad_layout: str, steps=range(STEPS)) -> None:
    for step in steps:
        for i, p in enumerate(params):
            p.grad = scripted_grad(i, step, p, grad_layout)
        opt.step()


def assert_same_values(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal element by element (by index, whatever the layouts), in bits."""
    assert same_bits(a, b), f"{what}: values differ"


def assert_state_like_param(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    for p in params:
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.stride() == torch.zeros_like(p).stride(), (key, value.stride(), p.stride())


@dataclass(frozen=True)
class Kernel:
    name: str
    options: dict


KERNELS = [Kernel("fused", {}), Kernel("for-loop", {"fused": False})]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("grad_layout", GRAD_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_contiguous_parameters_step_as_their_dense_copies(layout, dtype, grad_layout, kernel):
    """Neither a non-dense parameter nor the gradient's layout changes a bit; the state is laid out like the parameter."""
    params = LAYOUTS[layout](DTYPES[dtype])
    ref_params = dense_copies(params)
    opt = OffloadAdamW(params, lr=1e-2, weight_decay=0.1, **kernel.options)
    ref = OffloadAdamW(ref_params, lr=1e-2, weight_decay=0.1, **kernel.options)
    train(opt, params, grad_layout)
    train(ref, ref_params, "like-param")
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_same_values(p, q, f"parameter {i}")
        for key in opt.state[p]:
            assert_same_values(opt.state[p][key], ref.state[q][key], f"parameter {i} {key}")
    assert_state_like_param(opt, params)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_contiguous_wide_parameters_equal_torch_adamw(layout, dtype, kernel):
    """float32/float64: bitwise torch.optim.AdamW (fused, or its single-tensor loop) on the same parameters."""
    params = LAYOUTS[layout](DTYPES[dtype])
    torch_params = dense_copies(params)
    opt = OffloadAdamW(params, lr=1e-2, weight_decay=0.1, **kernel.options)
    torch_options = {"fused": True} if kernel.name == "fused" else {"foreach": False, "fused": False}
    ref = torch.optim.AdamW(torch_params, lr=1e-2, weight_decay=0.1, **torch_options)
    train(opt, params, "contiguous")  # a gradient set by hand, of another layout than its parameter
    train(ref, torch_params, "like-param")
    for i, (p, q) in enumerate(zip(params, torch_params)):
        assert_same_values(p, q, f"parameter {i}")
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_same_values(opt.state[p][key], ref.state[q][key], f"parameter {i} {key}")


def test_channels_last_convnet_with_autograd_equals_torch_fused():
    """A real backward through a channels_last network: gradients as autograd lays them out."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    twin = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    twin.load_state_dict(model.state_dict())
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    x = torch.randn(2, 3, 9, 9).to(memory_format=torch.channels_last)
    for _ in range(STEPS):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_same_values(p, q, name)
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][key].stride() == ref.state[q][key].stride(), (name, key)
            assert_same_values(opt.state[p][key], ref.state[q][key], f"{name} {key}")


@pytest.mark.parametrize("direction", ["torch-to-ours", "ours-to-torch"])
@pytest.mark.parametrize("layout", ["conv-channels-last", "transposed-view"])
def test_state_dicts_move_between_torch_and_ours_for_non_contiguous_parameters(layout, direction):
    """k steps with one optimizer, its state_dict loaded into the other, which continues: exactly torch's uninterrupted run."""
    params = LAYOUTS[layout](torch.float32)
    twin = [nn.Parameter(p.detach().clone()) for p in params]  # same values and layout
    uninterrupted = [nn.Parameter(p.detach().clone()) for p in params]
    classes = (torch.optim.AdamW, OffloadAdamW)
    first_cls, second_cls = classes if direction == "torch-to-ours" else classes[::-1]
    # fused=True on both sides: a loaded state_dict brings its groups' options, and torch's fused=None is its for-loop
    first = first_cls(params, lr=1e-2, fused=True)
    train(first, params, "like-param", range(2))
    for p, q in zip(params, twin):
        q.data.copy_(p.detach())
    second = second_cls(twin, lr=1e-2, fused=True)
    # as through a file: torch's load keeps the given tensors, which the first optimizer would go on updating
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    train(second, twin, "like-param", range(2, 2 + STEPS))
    ref = torch.optim.AdamW(uninterrupted, lr=1e-2, fused=True)
    train(ref, uninterrupted, "like-param", range(2 + STEPS))
    for i, (p, q) in enumerate(zip(twin, uninterrupted)):
        assert_same_values(p, q, f"parameter {i}")
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_same_values(second.state[p][key], ref.state[q][key], f"parameter {i} {key}")


# ----------------------------------------------------------------- a model cast after some steps


def snapshot(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> dict:
    out: dict = {f"param/{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        for key, value in opt.state.get(p, {}).items():
            out[f"state/{i}/{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def assert_unchanged(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        a, b = before[key], after[key]
        assert (same_bits(a, b) if isinstance(a, torch.Tensor) else a == b), f"{key} changed"


def linear_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(70, 30), nn.Linear(30, 5)).to(dtype)


def backward(model: nn.Module) -> None:
    first = next(model.parameters())
    x = torch.linspace(-1, 1, 140).reshape(2, 70).to(first.device, first.dtype)
    model(x).float().square().mean().backward()


# (dtype trained in, dtype cast to): torch's AdamW refuses the next step for each (its state has the old dtype).
REFUSED_CASTS = {
    "bf16-to-fp32": (torch.bfloat16, torch.float32),  # the master would go on, stale, and no parameter would move
    "fp16-to-fp32": (torch.float16, torch.float32),
    "fp32-to-bf16": (torch.float32, torch.bfloat16),  # no master: the update would write the bf16 parameter
    "fp32-to-fp64": (torch.float32, torch.float64),
    "fp64-to-fp32": (torch.float64, torch.float32),
    "bf16-to-fp64": (torch.bfloat16, torch.float64),
}


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("cast", REFUSED_CASTS)
def test_a_cast_after_steps_is_refused_before_any_update(cast, kernel):
    source, target = REFUSED_CASTS[cast]
    model = linear_model(source)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, **kernel.options)
    for _ in range(2):
        opt.zero_grad()
        backward(model)
        opt.step()
    model.to(target)
    opt.zero_grad()
    backward(model)
    params = list(model.parameters())
    before = snapshot(opt, params)
    with pytest.raises(RuntimeError, match=r"parameter 0 of param_groups\[0\].*changed dtype") as refusal:
        opt.step()
    assert "load_state_dict(opt.state_dict())" in str(refusal.value) and "nothing was changed" in str(refusal.value)
    assert_unchanged(before, snapshot(opt, params))


def test_after_a_refused_cast_reloading_the_state_carries_the_master_over():
    """The remedy the refusal names: the float32 master becomes the float32 parameter, moments kept, and
    the next steps are torch's AdamW continuing from that state."""
    model = linear_model(torch.bfloat16)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, fused=True)
    for _ in range(2):
        opt.zero_grad()
        backward(model)
        opt.step()
    masters = [opt.master_value(p).clone() for p in model.parameters()]
    model.float()
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(opt.state_dict())
    for p, master in zip(model.parameters(), masters):
        assert_same_values(p, master, "parameter after the reload")
        assert "master_param" not in opt.state[p]
    twin = copy.deepcopy(model)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    ref.load_state_dict(saved)
    for m, o in ((model, opt), (twin, ref)):
        for _ in range(2):
            o.zero_grad()
            backward(m)
            o.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_same_values(p, q, name)


# ----------------------------------------------------------------- edits of a low-precision model between steps


def _edit_load_state_dict(model: nn.Module) -> None:
    other = linear_model(torch.float32)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5).add_(0.01)
    model.load_state_dict({k: v.to(next(model.parameters()).dtype) for k, v in other.state_dict().items()})


def _edit_clamp(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)


def _edit_prune(model: nn.Module) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            mask = (torch.arange(p.numel()).reshape(p.shape) % (3 + i)) != 0
            p.mul_(mask)


def _edit_data_clamp(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.clamp_(-0.05, 0.05)  # .data: no version counter moves


def _edit_copy(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.linspace(-0.3, 0.3, p.numel()).reshape(p.shape))


def _edit_zero_entries(model: nn.Module) -> None:
    """Entries set to zero through an indexing view (the sign of zero and NaNs are in the kernels' tables)."""
    for p in model.parameters():
        p.data.view(-1)[::7] = 0.0


EDITS = {
    "load_state_dict": _edit_load_state_dict,
    "clamp_": _edit_clamp,
    "pruning-mask": _edit_prune,
    "data.clamp_": _edit_data_clamp,
    "copy_": _edit_copy,
    "zero-entries": _edit_zero_entries,
}
EDIT_PATHS = {
    "fused": {},
    "for-loop": {"fused": False},
    "pipeline-on-cpu": {"transfer_pipeline": True},
}


def followed(master: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The rule, written independently of the optimizer: an element of ``p`` whose bits differ from
    round(master) (a NaN equals a NaN) replaces its master by its exact widening."""
    rounded = master.to(p.dtype)
    bits = {2: torch.int16, 4: torch.int32}[p.element_size()]
    differ = (rounded.view(bits) != p.detach().view(bits)) & ~(rounded.isnan() & p.isnan())
    return torch.where(differ, p.detach().to(master.dtype), master)


@pytest.mark.parametrize("path", EDIT_PATHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_of_a_low_precision_parameter_is_what_the_next_update_starts_from(edit, dtype, path):
    """The master follows the edited parameter, element by element: the run is the float32 parity run
    whose masters took the edit where the parameter differs from round(master)."""
    model = linear_model(DTYPES[dtype])
    opt = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **EDIT_PATHS[path])
    params = list(model.parameters())
    ref_params = [nn.Parameter(p.detach().float()) for p in params]
    torch_options = {"foreach": False, "fused": False} if path == "for-loop" else {"fused": True}
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, **torch_options)
    for step in range(5):
        if step == 2:
            EDITS[edit](model)
            for p, q in zip(params, ref_params):
                q.data.copy_(followed(q.detach(), p))
            for p, q in zip(params, ref_params):  # between steps, the master already shows the edit
                assert_same_values(opt.master_value(p), q, "master after the edit")
        opt.zero_grad()
        backward(model)
        for p, q in zip(params, ref_params):
            q.grad = opt.gradient(p).float()
        opt.step()
        ref.step()
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_same_values(opt.master_value(p), q, f"master {i}")
        assert_same_values(p, q.detach().to(p.dtype), f"parameter {i}")


@pytest.mark.parametrize("edit", ["pruning-mask", "data.clamp_"])
def test_an_edit_survives_a_state_dict_round_trip_and_a_checkpoint(edit, tmp_path):
    """Saved between the edit and the next step, the state holds the edited masters: a resume continues
    the edited run, and the elements left alone keep their float32 masters."""
    from offload_adamw import checkpoint

    model = linear_model(torch.bfloat16)
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        backward(model)
        opt.step()
    masters = [opt.master_value(p).clone() for p in model.parameters()]
    EDITS[edit](model)
    expected = [followed(m, p) for m, p in zip(masters, model.parameters())]
    kept = [followed(m, p) == m for m, p in zip(masters, model.parameters())]
    assert any(bool((~k).any()) for k in kept) and all(bool(k.any()) for k in kept)  # some elements edited, some not
    saved = copy.deepcopy(opt.state_dict())
    path = checkpoint.save(tmp_path / "ckpt", model, opt)
    for source in ("state_dict", "checkpoint"):
        twin = linear_model(torch.bfloat16)
        twin_opt = OffloadAdamW(twin.parameters(), lr=1e-2)
        if source == "state_dict":
            twin.load_state_dict(model.state_dict())
            twin_opt.load_state_dict(copy.deepcopy(saved))
        else:
            checkpoint.load(path, twin, twin_opt)
        for p, want in zip(twin.parameters(), expected):
            assert_same_values(twin_opt.master_value(p), want, f"{source}: master")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("edit", ["pruning-mask", "data.clamp_", "load_state_dict"])
def test_an_edit_of_a_device_parameter_on_the_plain_step_is_what_the_next_update_starts_from(edit, dtype):
    """The plain step (no transfer pipeline, as under FSDP2 with kept gradients) reads each device
    parameter back before its update: the same rule as for host parameters."""
    model = linear_model(DTYPES[dtype]).cuda()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, transfer_pipeline=False)
    params = list(model.parameters())
    ref_params = [nn.Parameter(p.detach().float().cpu()) for p in params]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(4):
        if step == 2:
            EDITS[edit](model)
            for p, q in zip(params, ref_params):
                q.data.copy_(followed(q.detach(), p.detach().cpu()))
        opt.zero_grad()
        backward(model)
        for p, q in zip(params, ref_params):
            q.grad = p.grad.float().cpu()
        opt.step()
        ref.step()
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert_same_values(opt.master_value(p), q, f"master {i}")
        assert_same_values(p.cpu(), q.detach().to(p.dtype), f"parameter {i}")


# ----------------------------------------------------------------- a refused load changes nothing

# An entry of opt.state_dict() replaced by something no run reaches: (key, replacement for the tensor).
INVALID_ENTRIES = {
    "nan-exp_avg": ("exp_avg", lambda t: torch.full_like(t, float("nan"))),
    "negative-exp_avg_sq": ("exp_avg_sq", lambda t: -torch.ones_like(t)),
    "fractional-step": ("step", lambda t: torch.tensor(2.5)),
    "wrong-shape-master": ("master_param", lambda t: torch.zeros(3)),
    "not-a-tensor": ("exp_avg", lambda t: "zeros"),
}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("entry", INVALID_ENTRIES)
def test_a_refused_load_leaves_the_optimizer_as_it_was(entry, dtype):
    """Replacing a tensor of opt.state_dict() and loading it: refused, and the live state is untouched."""
    from offload_adamw import StateDictMismatch

    key, replace = INVALID_ENTRIES[entry]
    model = linear_model(DTYPES[dtype])
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        backward(model)
        opt.step()
    if key == "master_param" and dtype == "fp32":
        key = "exp_avg_sq"  # a float32 host parameter is its own master
    params = list(model.parameters())
    before = snapshot(opt, params)
    sd = opt.state_dict()
    sd["state"][0][key] = replace(sd["state"][0][key])
    with pytest.raises(StateDictMismatch, match="nothing was changed"):
        opt.load_state_dict(sd)
    assert_unchanged(before, snapshot(opt, params))
    opt.zero_grad()
    backward(model)
    opt.step()  # and it trains on


# ----------------------------------------------------------------- copies and pickles of the optimizer


def _copy_deepcopy(opt):
    return copy.deepcopy(opt)


def _copy_pickle(opt):
    import pickle

    return pickle.loads(pickle.dumps(opt))


def _copy_torch_save(opt):
    import io

    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": _copy_deepcopy, "pickle": _copy_pickle, "torch.save": _copy_torch_save}
COPIED_CONFIGS = {
    "plain-fp32": (torch.float32, {}),
    "plain-bf16-options": (torch.bfloat16, {"max_grad_norm": 0.5, "nonfinite": "skip", "amsgrad": True}),
    "for-loop-bf16": (torch.bfloat16, {"fused": False}),
    "pipeline": (torch.bfloat16, {"transfer_pipeline": True, "bucket_bytes": 4096}),
    "freed-gradients": (torch.float32, {"offload_gradients": True, "max_grad_norm": 1.0}),
    "update-in-backward": (torch.bfloat16, {"offload_gradients": True, "update_in_backward": True}),
}


def _params_of(dtype: torch.dtype) -> list[nn.Parameter]:
    return list(linear_model(dtype).parameters())


def _forward_backward(params: list[torch.Tensor], step: int) -> None:
    """The model as a function of the optimizer's own parameters, so that a copied optimizer is driven alike."""
    w1, b1, w2, b2 = params
    x = torch.linspace(-1, 1, 140).reshape(2, 70).to(w1.dtype) * (1 + step)
    y = nn.functional.linear(nn.functional.linear(x, w1, b1).relu(), w2, b2)
    y.float().square().mean().backward()


def _train_steps(opt: torch.optim.Optimizer, steps) -> None:
    params = opt.param_groups[0]["params"]
    for step in steps:
        opt.zero_grad()
        _forward_backward(params, step)
        opt.step()


def _copy_cases():
    for how in COPIES:
        for config in COPIED_CONFIGS:
            yield pytest.param(how, config, id=f"{how}-{config}")


@pytest.mark.parametrize("how,config", list(_copy_cases()))
def test_a_copied_optimizer_steps_exactly_like_the_original(how, config):
    """A copy (deepcopy, pickle, torch.save) made between steps is an optimizer of its own, with copies of
    the parameters as torch's; both go on exactly as an optimizer never copied, with the same options."""
    dtype, options = COPIED_CONFIGS[config]
    original = OffloadAdamW(_params_of(dtype), lr=1e-2, **options)
    untouched = OffloadAdamW(_params_of(dtype), lr=1e-2, **options)
    for opt in (original, untouched):
        _train_steps(opt, range(2))
        opt.zero_grad()  # a step boundary (freed gradients are refused before it: the next test)
    twin = COPIES[how](original)
    assert type(twin) is OffloadAdamW
    assert [p is q for p, q in zip(twin.param_groups[0]["params"], original.param_groups[0]["params"])] == [False] * 4
    for name in ("nonfinite", "max_grad_norm", "skipped_steps", "offload_gradients", "update_in_backward"):
        assert getattr(twin, name) == getattr(original, name), name
    assert (twin.transfer_pipeline is None) == (original.transfer_pipeline is None)
    assert twin.transfer_pipeline is not original.transfer_pipeline or twin.transfer_pipeline is None
    for opt in (original, twin, untouched):
        _train_steps(opt, range(2, 5))
    for opt in (original, twin):
        for i, (p, q) in enumerate(zip(opt.param_groups[0]["params"], untouched.param_groups[0]["params"])):
            assert_same_values(p, q, f"parameter {i}")
            for key, value in untouched.state[q].items():
                assert_same_values(opt.state[p][key], value, f"parameter {i} {key}")


def test_copying_between_backward_and_step_with_freed_gradients_is_refused():
    """The gradients live in the pipeline's host buffers, which a copy does not take: refused, nothing changed."""
    asked, untouched = (OffloadAdamW(_params_of(torch.float32), lr=1e-2, offload_gradients=True) for _ in range(2))
    for opt in (asked, untouched):
        _train_steps(opt, range(1))
        _forward_backward(opt.param_groups[0]["params"], 1)
    with pytest.raises(RuntimeError, match="step boundary"):
        copy.deepcopy(asked)
    for opt in (asked, untouched):
        opt.step()
        opt.zero_grad()
    for p, q in zip(asked.param_groups[0]["params"], untouched.param_groups[0]["params"]):
        assert_same_values(p, q, "parameter")
    copy.deepcopy(asked)  # at the step boundary


# ----------------------------------------------------------------- where the host state is pinned

# (pin_memory, an accelerator present) -> pinned, or the refusal. Pinning pays only for asynchronous copies
# and nothing copies the state so: the pipeline's own buffers carry the transfers, the plain step copies
# synchronously. The decision is tested here; the pinning itself needs an accelerator.
PIN_DECISIONS = [
    (None, True, False),
    (None, False, False),
    (False, True, False),
    (False, False, False),
    (True, True, True),
    (True, False, ValueError),
]


@pytest.mark.parametrize("pin_memory,accelerator,expected", PIN_DECISIONS)
def test_the_state_is_pinned_only_when_asked(pin_memory, accelerator, expected):
    from offload_adamw.optim.state import pins_state

    if expected is ValueError:
        with pytest.raises(ValueError, match="pin_memory=True needs an accelerator"):
            pins_state(pin_memory, accelerator=accelerator)
    else:
        assert pins_state(pin_memory, accelerator=accelerator) is expected


@pytest.mark.parametrize("options", [{}, {"transfer_pipeline": True}], ids=["plain-step", "pipeline"])
def test_with_cuda_present_the_default_pins_no_state(monkeypatch, options):
    """The constructor's decision where CUDA is present (FSDP2 with kept gradients runs the plain step):
    no state is pinned, so a step allocates it pageable (here, where pinning would fail, it simply runs)."""
    from offload_adamw.optim import state as host_state

    monkeypatch.setattr(host_state, "pinned_allocator_available", lambda: True)
    model = linear_model(torch.bfloat16)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, **options)
    backward(model)
    opt.step()
    assert opt.pinned_bytes() == 0
    assert not any(t.is_pinned() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))


def test_pin_memory_true_without_an_accelerator_is_refused_at_construction():
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present")
    with pytest.raises(ValueError, match="pin_memory=True needs an accelerator"):
        OffloadAdamW(linear_model(torch.float32).parameters(), pin_memory=True)
