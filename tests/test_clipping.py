"""clip_grad_norm_ (optim/policy.py) against torch.nn.utils.clip_grad_norm_ on the same gradients, bitwise.

Table: every way of naming the gradients (an OffloadAdamW without pipeline, with
kept and with freed device gradients, a torch optimizer, a parameter list, one
tensor) crossed with norm types and max norms drawn by hypothesis; plus the
empty case and error_if_nonfinite.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from offload_adamw import OffloadAdamW, clip_grad_norm_

SHAPES = [(5, 3), (7,), (), (2, 2, 2)]
TARGETS = ["offload_plain", "offload_kept", "offload_freed", "offload_method", "torch_optimizer", "param_list", "one_tensor"]


def _params(dtype: torch.dtype) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES]


def _target(kind: str, params: list[nn.Parameter]):
    if kind == "offload_plain":
        return OffloadAdamW(params)
    if kind in ("offload_kept", "offload_method"):
        return OffloadAdamW(params, transfer_pipeline=True)
    if kind == "offload_freed":
        return OffloadAdamW(params, transfer_pipeline=True, offload_gradients=True)
    if kind == "torch_optimizer":
        return torch.optim.AdamW(params)
    if kind == "param_list":
        return params
    return params[0]


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(TARGETS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    norm_type=st.sampled_from([2.0, 1.0, float("inf"), 3.0]),
    max_norm=st.floats(1e-3, 10.0),
    seed=st.integers(0, 2**16),
    missing=st.integers(0, len(SHAPES) - 1),
)
def test_clip_equals_torch_on_the_same_gradients(kind, dtype, norm_type, max_norm, seed, missing) -> None:
    gen = torch.Generator().manual_seed(seed)
    grads = [
        None if i == missing and kind != "one_tensor" else torch.randn(s, generator=gen).to(dtype) for i, s in enumerate(SHAPES)
    ]
    ours, theirs = _params(dtype), _params(dtype)
    target = _target(kind, ours)
    for p, q, g in zip(ours, theirs, grads):
        p.grad = None if g is None else g.clone()
        q.grad = None if g is None else g.clone()
    if kind == "offload_method":
        norm = target.clip_grad_norm_(max_norm, norm_type)
    else:
        norm = clip_grad_norm_(target, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs[:1] if kind == "one_tensor" else theirs, max_norm, norm_type)
    assert torch.equal(norm, expected)
    for i, (p, q) in enumerate(zip(ours, theirs)):
        mine = target.gradient(p) if isinstance(target, OffloadAdamW) else p.grad
        if kind == "one_tensor" and i > 0:
            continue
        assert (mine is None) == (q.grad is None)
        if mine is not None:
            assert torch.equal(mine, q.grad), f"gradient {i} clipped differently"


@pytest.mark.parametrize("kind", TARGETS)
def test_no_gradients_gives_zero(kind: str) -> None:
    target = _target(kind, _params(torch.float32))
    norm = target.clip_grad_norm_(1.0) if kind == "offload_method" else clip_grad_norm_(target, 1.0)
    assert torch.equal(norm, torch.tensor(0.0))


@pytest.mark.parametrize("kind", ["offload_freed", "offload_kept", "param_list"])
def test_nonfinite_norm_raises_like_torch(kind: str) -> None:
    params = _params(torch.float32)
    target = _target(kind, params)
    for p in params:
        p.grad = torch.ones_like(p)
    params[1].grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(target, 1.0, error_if_nonfinite=True)
