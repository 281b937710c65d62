"""OffloadAdamW with torch.compile: the compiled model, compiled autograd and a compiled ``opt.step``.

* ``torch.compile(opt.step)``: the step is excluded from tracing (``torch._dynamo.disable``) and runs
  eagerly, so a compiled step is the eager step.
* ``torch.compile(model)``: the compiled backward is one autograd node; the parameters' post-accumulate
  hooks fire after it, as autograd accumulates each gradient, so the pipeline sees every gradient.
* Compiled autograd: the pipeline's hook bodies are excluded from tracing and run as opaque calls;
  the accumulation compiled autograd traces into a freed gradient's stand-in adds onto the host buffer.

Each case: the plain step, gradients kept and freed; 2 micro-batches and clipping on the model; bitwise
against the same compiled model trained by torch.optim.AdamW(fused=True). The compiled model and compiled autograd
are wrappers of the configuration table (tests/support/configs.py): their runs in every configuration are the generic
training property of tests/test_optim_info.py; here the compiled ``opt.step`` (inductor) and, ``slow``, an inductor
run of the model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from configs import MODES, assert_bitwise_equal
from offload_adamw import OffloadAdamW

#: the modes whose optimizer the compiled step and the inductor runs take (updates during backward: the generic
#: property, tests/test_optim_info.py)
COMPILED_MODES = ["freed", "kept", "plain"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _x(i: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(i))


def _train(mode: str, *, compile_model: bool, compiled_autograd: bool, compile_step: bool, backend: str = "aot_eager"):
    ours, ref = _model(), _model()
    opt = OffloadAdamW(ours.parameters(), **MODES[mode].kwargs(lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    step = torch.compile(opt.step, backend=backend) if compile_step else opt.step
    runs = [(ours, step, opt), (ref, ref_opt.step, ref_opt)]
    if compile_model:
        runs = [(torch.compile(m, backend=backend), s, o) for m, s, o in runs]
    for i in range(3):
        for model, step_fn, o in runs:
            for micro in range(2):
                loss = model(_x(i * 2 + micro)).square().sum()
                if compiled_autograd:
                    with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)):
                        loss.backward()
                else:
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            step_fn()
            o.zero_grad()
    assert_bitwise_equal(dict(ours.named_parameters()), dict(ref.named_parameters()), "parameters")
    start = _model()
    assert any(not torch.equal(p, q) for p, q in zip(ours.parameters(), start.parameters()))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", COMPILED_MODES)
def test_compiled_step_runs_eagerly(mode):
    _train(mode, compile_model=False, compiled_autograd=False, compile_step=True, backend="inductor")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kept", "freed"])
def test_compiled_model_with_inductor(mode):
    _train(mode, compile_model=True, compiled_autograd=False, compile_step=True, backend="inductor")
