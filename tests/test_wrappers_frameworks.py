"""The transfer pipeline (the CPU as device) under the real HF Trainer, accelerate and Lightning.

Each framework clips and zeroes gradients through the model's parameters: the Trainer calls
``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)`` and ``model.zero_grad()``,
accelerate ``torch.nn.utils.clip_grad_norm_`` on what it is given, Lightning on the optimizer's
parameters. With freed device gradients ``p.grad`` stands for the host gradient (accel/freed.py), so
all of it reaches the real gradient. Held, in both modes (gradients kept and freed) with accumulation
over 1 and 4 micro-batches and clipping on: the parameters are bitwise those of the same run with
torch.optim.AdamW(fused=True), and the logged gradient norm is torch's.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from configs import MODES, assert_bitwise_equal
from offload_adamw import OffloadAdamW


@pytest.fixture(autouse=True)
def _deterministic_algorithms_restored():
    """Trainer(deterministic=True) switches deterministic algorithms on for the whole process: off again after."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


#: the pipeline's modes whose p.grad the frameworks clip and zero (configs.MODES; with updates during backward
#: p.grad is refused to them: tests/test_clipping_in_backward.py)
PIPELINE_MODES = ["freed", "kept"]
LR, WD = 1e-2, 0.1
_REFERENCE: dict = {}


def _reference(key, run):
    if key not in _REFERENCE:
        _REFERENCE[key] = run()
    return _REFERENCE[key]


def _factory(mode: str | None):
    if mode is None:
        return lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    return lambda params: OffloadAdamW(params, **MODES[mode].kwargs(lr=LR, weight_decay=WD))


def _assert_bitwise(a: dict, b: dict, start: dict) -> None:
    assert_bitwise_equal(a, b, "parameters against torch.optim.AdamW(fused=True)")
    assert any(not torch.equal(a[n], start[n]) for n in a), "training did not move the parameters"


# ------------------------------------------------------------------------------ HF Trainer


def _trainer_run(tmp_path, mode, accumulation):
    pytest.importorskip("transformers")
    from transformers import Trainer

    from test_integrations_trainer import TokenWindows, params_of, tiny_llama, training_args

    model = tiny_llama()
    optimizer = _factory(mode)(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    args = training_args(
        tmp_path / f"{mode}-{accumulation}", max_steps=3, max_grad_norm=0.05, gradient_accumulation_steps=accumulation
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenWindows(), optimizers=(optimizer, scheduler))
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return params_of(model), norms


@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("mode", PIPELINE_MODES)
def test_trainer_max_grad_norm(tmp_path, mode, accumulation):
    ours, norms = _trainer_run(tmp_path, mode, accumulation)
    theirs, ref_norms = _reference(("trainer", accumulation), lambda: _trainer_run(tmp_path, None, accumulation))
    from test_integrations_trainer import params_of, tiny_llama

    _assert_bitwise(ours, theirs, params_of(tiny_llama()))
    assert norms == ref_norms and min(norms) > 0.05, "the Trainer's clipping saw other gradients than torch's"


# ------------------------------------------------------------------------------ accelerate


def _accelerate_run(mode, accumulation):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from test_integrations_accelerate import batches, tiny_model

    set_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = tiny_model()
    optimizer = _factory(mode)(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    norms = []
    for x, y in batches(3 * accumulation):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            optimizer.step()
            optimizer.zero_grad()
    params = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    accelerator.free_memory()
    return params, norms


@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("mode", PIPELINE_MODES)
def test_accelerate_clip_grad_norm(mode, accumulation):
    from test_integrations_accelerate import tiny_model

    ours, norms = _accelerate_run(mode, accumulation)
    theirs, ref_norms = _reference(("accelerate", accumulation), lambda: _accelerate_run(None, accumulation))
    _assert_bitwise(ours, theirs, {n: p.detach() for n, p in tiny_model().named_parameters()})
    assert norms == ref_norms and min(norms) > 0.5


# ------------------------------------------------------------------------------ Lightning


def _lightning_run(mode, accumulation):
    L = pytest.importorskip("lightning")
    from test_integrations_lightning import Tiny, loader, params

    class Module(Tiny):
        def configure_optimizers(self):
            return _factory(mode)(self.parameters())

    module = Module("offload")
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", devices=1, gradient_clip_val=0.5, accumulate_grad_batches=accumulation,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader())
    return params(module)


@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("mode", PIPELINE_MODES)
def test_lightning_gradient_clip_val(mode, accumulation):
    pytest.importorskip("lightning")
    from test_integrations_lightning import Tiny, params

    ours = _lightning_run(mode, accumulation)
    theirs = _reference(("lightning", accumulation), lambda: _lightning_run(None, accumulation))
    _assert_bitwise(ours, theirs, params(Tiny("offload")))


# ------------------------------------------------------------------- max_grad_norm in the step


@pytest.mark.parametrize("mode", ["plain", *PIPELINE_MODES])
def test_max_grad_norm_option_equals_clip_grad_norm_before_step(mode):
    """OffloadAdamW(max_grad_norm=...) clips inside step: bitwise torch's clip_grad_norm_ + AdamW(fused=True)."""
    from test_integrations_accelerate import batches, tiny_model

    ours, ref = tiny_model(), tiny_model()
    opt = OffloadAdamW(ours.parameters(), lr=LR, weight_decay=WD, **MODES[mode].kwargs(max_grad_norm=0.5))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    for x, y in batches(4):
        torch.nn.functional.cross_entropy(ours(x), y).backward()
        opt.step()
        ours.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref.zero_grad()
        assert torch.equal(opt.last_grad_norm, norm) and norm > 0.5
    assert_bitwise_equal(dict(ours.named_parameters()), dict(ref.named_parameters()), "parameters")


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), "1"])
def test_max_grad_norm_is_validated(bad):
    with pytest.raises(ValueError, match="max_grad_norm"):
        OffloadAdamW([torch.nn.Parameter(torch.ones(2))], max_grad_norm=bad)
