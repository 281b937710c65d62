"""Clipping with updates during backward, and freed DTensor gradients under FSDP2: the edge cases.

Each test states what must hold (the project's rule: torch.optim.AdamW's exact result for the same user
calls, or a clear refusal); the single-device ones run with the CPU as device (transfer pipeline on CPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from _parity import same_bits
from offload_adamw import OffloadAdamW

WIDTH = 16
BLOCKS = 4
LR = 1e-2
WD = 0.1
CLIP = 0.05  # below every norm below: the clipping acts


class Blocks(nn.Module):
    def __init__(self, reentrant: bool = False, extra: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(BLOCKS)
        )
        self.reentrant = reentrant
        self.extra = nn.Linear(WIDTH, WIDTH) if extra else None

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if self.reentrant and i > 0:
                x = x + checkpoint(block, x, use_reentrant=True)
            else:
                x = x + block(x)
        if use_extra:
            assert self.extra is not None
            x = x + self.extra(x)
        return x


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(32, WIDTH, generator=g) for _ in range(n)]


def _pair(clip: float | None = CLIP, **model_kw):
    torch.manual_seed(0)
    reference = Blocks(**model_kw)
    model = copy.deepcopy(reference)
    theirs = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD, fused=True)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    ours = OffloadAdamW(model.parameters(), lr=LR, weight_decay=WD, offload_gradients=True, update_in_backward=True,
                        bucket_bytes=block_bytes, max_grad_norm=clip)
    return reference, theirs, model, ours


def _loss(model: nn.Module, x: torch.Tensor, **kw) -> torch.Tensor:
    return model(x, **kw).square().mean()


def _torch_step(model: nn.Module, opt, clip: float | None = CLIP):
    norm = None if clip is None else torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return norm


def _assert_same(reference: nn.Module, model: nn.Module) -> None:
    differing = [name for (name, p), q in zip(reference.named_parameters(), model.parameters())
                 if not same_bits(p.detach(), q.detach())]
    assert not differing, f"differs from torch.optim.AdamW(fused=True) + clip_grad_norm_: {differing}"


def _warm(reference, theirs, model, ours, steps: int = 2, clip: float | None = CLIP) -> None:
    """Steps that leave update_in_backward's updater armed (the order of a backward is known)."""
    for x in _batches(steps):
        _loss(reference, x).backward()
        _torch_step(reference, theirs, clip)
        theirs.zero_grad()
        _loss(model, x).backward()
        ours.step()
        ours.zero_grad()


# ----------------------------------------------------------------------------- clipping during backward


def test_clipped_first_step_over_two_backwards_without_no_sync_is_torch_or_refused() -> None:
    """Two backwards before the first step (no no_sync): the norm must be the accumulated gradient's."""
    reference, theirs, model, ours = _pair()
    xs = _batches(2)
    for x in xs:
        _loss(reference, x).backward()
    _torch_step(reference, theirs)
    for x in xs:
        _loss(model, x).backward()
    try:
        ours.step()
    except RuntimeError as error:
        assert "no_sync" in str(error), error
        return
    _assert_same(reference, model)


def test_clipped_first_step_after_a_gradient_is_cleared_is_torch() -> None:
    """p.grad = None after backward: torch's clipping (at the step) no longer counts that gradient."""
    reference, theirs, model, ours = _pair()
    x = _batches(1)[0]
    _loss(reference, x).backward()
    reference.blocks[0][0].weight.grad = None
    _torch_step(reference, theirs)
    _loss(model, x).backward()
    model.blocks[0][0].weight.grad = None
    ours.step()
    _assert_same(reference, model)


def test_clipped_first_step_with_a_gradient_assigned_by_hand_is_torch_or_refused() -> None:
    """A gradient replaced by hand after backward: torch clips with its norm."""
    reference, theirs, model, ours = _pair()
    x = _batches(1)[0]
    new = torch.full_like(reference.blocks[1][0].weight, 3.0)
    _loss(reference, x).backward()
    reference.blocks[1][0].weight.grad = new.clone()
    _torch_step(reference, theirs)
    _loss(model, x).backward()
    model.blocks[1][0].weight.grad = new.clone()
    try:
        ours.step()
    except RuntimeError as error:
        assert "backward" in str(error), error
        return
    _assert_same(reference, model)


def test_max_grad_norm_switched_on_between_steps_clips_every_update() -> None:
    """opt.max_grad_norm set after a step (it was None): the next step is clipped throughout."""
    reference, theirs, model, ours = _pair(clip=None)
    _warm(reference, theirs, model, ours, clip=None)
    ours.max_grad_norm = CLIP
    x = _batches(3)[2]
    _loss(reference, x).backward()
    _torch_step(reference, theirs, CLIP)
    _loss(model, x).backward()
    ours.step()
    _assert_same(reference, model)


def test_max_grad_norm_changed_between_backward_and_step_is_honoured_or_refused() -> None:
    """Changed after backward, before step(): torch clips with the new value (at the step)."""
    reference, theirs, model, ours = _pair()
    x = _batches(1)[0]
    _loss(reference, x).backward()
    _torch_step(reference, theirs, CLIP / 2)
    _loss(model, x).backward()
    ours.max_grad_norm = CLIP / 2
    try:
        ours.step()
    except RuntimeError as error:
        assert "max_grad_norm" in str(error), error
        return
    _assert_same(reference, model)


def test_max_grad_norm_changed_after_early_updates_is_refused() -> None:
    """From the second step the updates run during backward with the old max_grad_norm: step() must say so."""
    reference, theirs, model, ours = _pair()
    _warm(reference, theirs, model, ours)
    _loss(model, _batches(3)[2]).backward()
    ours.max_grad_norm = CLIP / 2
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        ours.step()


def test_clipped_first_step_after_a_discarded_backward_counts_only_the_kept_gradients() -> None:
    """backward, opt.zero_grad() (batch discarded), a backward that reaches fewer parameters, step."""
    reference, theirs, model, ours = _pair(extra=True)
    x, y = _batches(2)
    _loss(reference, y).backward()
    _torch_step(reference, theirs)
    _loss(model, x, use_extra=True).backward()
    ours.zero_grad()
    _loss(model, y).backward()
    ours.step()
    _assert_same(reference, model)


def test_clipping_with_reentrant_checkpointing_is_torch() -> None:
    """Reentrant activation checkpointing runs nested backwards: the coefficient must wait for the outer one."""
    reference, theirs, model, ours = _pair(reentrant=True)
    _warm(reference, theirs, model, ours, steps=3)
    _assert_same(reference, model)


def test_cleared_gradient_after_early_updates_is_refused() -> None:
    """p.grad = None after backward: torch does not update p, but its update already ran during backward."""
    reference, theirs, model, ours = _pair(clip=None)
    _warm(reference, theirs, model, ours, clip=None)
    x = _batches(3)[2]
    _loss(reference, x).backward()
    reference.blocks[0][0].weight.grad = None
    theirs.step()
    _loss(model, x).backward()
    model.blocks[0][0].weight.grad = None
    try:
        ours.step()
    except RuntimeError as error:
        assert "update_in_backward" in str(error), error
        return
    _assert_same(reference, model)


@pytest.mark.parametrize("clip", [None, CLIP])
def test_model_zero_grad_after_each_step_under_update_in_backward_is_torch(clip) -> None:
    """model.zero_grad() after step() (HF Trainer's call): the next backward drops the old host gradients."""
    reference, theirs, model, ours = _pair(clip=clip)
    for x in _batches(3):
        _loss(reference, x).backward()
        _torch_step(reference, theirs, clip)
        reference.zero_grad()
        _loss(model, x).backward()
        ours.step()
        model.zero_grad()
    _assert_same(reference, model)


def test_a_second_backward_reaching_a_parameter_the_first_did_not_is_refused_by_name() -> None:
    """Step 2+: backward (its updates run, clipped), then a backward through a parameter the first did not reach."""
    _, _, model, ours = _pair(extra=True)
    for use_extra in (True, False):  # every parameter has state, and the order of a backward without extra is known
        _loss(model, _batches(1)[0], use_extra=use_extra).backward()
        ours.step()
        ours.zero_grad()
    x, y = _batches(2)
    _loss(model, x).backward()
    model.extra(y).square().mean().backward()
    with pytest.raises(RuntimeError, match="more than one backward"):
        ours.step()


def test_a_trainable_parameter_that_never_gets_a_gradient_leaves_updates_during_backward_on() -> None:
    """A trainable parameter no backward reaches (an unused head) gets no state; the others' updates still overlap."""
    _, _, model, ours = _pair(clip=None, extra=True)
    for x in _batches(3):
        _loss(model, x).backward()
        ours.step()
        ours.zero_grad()
    pipeline = ours.transfer_pipeline
    assert pipeline is not None and pipeline.armed(), "the next step's updates wait for step()"


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises (an out-of-memory in the middle of backward, say)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


def test_a_failed_backward_does_not_switch_off_the_clip_coefficient_for_good() -> None:
    """A backward that raised after some hooks ran, the batch dropped (zero_grad): later backwards take the coefficient."""
    _, _, model, ours = _pair()
    xs = _batches(4)
    for x in xs[:2]:
        _loss(model, x).backward()
        ours.step()
        ours.zero_grad()
    h = xs[2] + model.blocks[0](xs[2])
    h = _FailingBackward.apply(h)
    for block in model.blocks[1:]:
        h = h + block(h)
    with pytest.raises(RuntimeError, match="on purpose"):
        h.square().mean().backward()
    ours.zero_grad()
    _loss(model, xs[3]).backward()
    # The gate opens only with the coefficient taken (last_grad_norm is the step's, written when step() runs).
    assert ours.transfer_pipeline.gate_taken(), "no clip coefficient when backward ended: the step clips alone, without overlap"
    ours.step()


# ----------------------------------------------------------------------------- what held up (kept as regressions)


def test_a_parameter_first_reached_in_a_later_step_is_clipped_with_the_rest() -> None:
    reference, theirs, model, ours = _pair(extra=True)
    _warm(reference, theirs, model, ours)
    for step, x in enumerate(_batches(3)):
        _loss(reference, x, use_extra=step != 1).backward()
        _torch_step(reference, theirs)
        theirs.zero_grad()
        _loss(model, x, use_extra=step != 1).backward()
        ours.step()
        ours.zero_grad()
    _assert_same(reference, model)


def test_last_grad_norm_is_torchs_from_the_first_step() -> None:
    reference, theirs, model, ours = _pair()
    for x in _batches(3):
        _loss(reference, x).backward()
        norm = _torch_step(reference, theirs)
        theirs.zero_grad()
        _loss(model, x).backward()
        ours.step()
        ours.zero_grad()
        assert ours.last_grad_norm is not None and norm is not None and same_bits(ours.last_grad_norm, norm)
    _assert_same(reference, model)


def test_mixed_dtypes_clip_as_the_step_clips() -> None:
    """bf16 and fp32 parameters: the in-backward norm and coefficient equal the step's clipping (torch's grouping)."""
    torch.manual_seed(0)
    a = Blocks()
    a.blocks[0].to(torch.bfloat16)
    a.blocks[2].to(torch.bfloat16)

    class Cast(nn.Module):
        def __init__(self, inner: Blocks) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            for block in self.inner.blocks:
                dtype = block[0].weight.dtype
                x = x + block(x.to(dtype)).float()
            return x

    b = copy.deepcopy(a)
    c = copy.deepcopy(a)
    Cast(c)(_batches(1)[0]).square().mean().backward()
    torch_norm = torch.nn.utils.clip_grad_norm_(c.parameters(), CLIP)
    at_step = OffloadAdamW(a.parameters(), lr=LR, weight_decay=WD, offload_gradients=True, max_grad_norm=CLIP)
    during = OffloadAdamW(b.parameters(), lr=LR, weight_decay=WD, offload_gradients=True, update_in_backward=True,
                          max_grad_norm=CLIP, bucket_bytes=1 << 12)
    for x in _batches(3):
        Cast(a)(x).square().mean().backward()
        at_step.step()
        at_step.zero_grad()
        Cast(b)(x).square().mean().backward()
        during.step()
        during.zero_grad()
        assert same_bits(at_step.last_grad_norm, during.last_grad_norm)
        if torch_norm is not None:
            assert same_bits(during.last_grad_norm, torch_norm), "torch's get_total_norm over the same gradients"
            torch_norm = None
    _assert_same(a, b)


# ----------------------------------------------------------------------------- FSDP2, 2 gloo ranks (one run of the worker)

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

FSDP_WORKER = Path(__file__).resolve().parent / "support" / "_clipping_in_backward_fsdp_worker.py"
sys.path.insert(0, str(FSDP_WORKER.parent))
from _clipping_in_backward_fsdp_worker import CASES as FSDP_CASES  # noqa: E402
from _quick import only, table  # noqa: E402

#: what CI runs (the rest is slow): freed gradients between steps, clipping during backward with a skipped group and
#: a frozen layer, bf16 parameters, the non-finite skip across ranks, a DCP resume
FSDP_QUICK = ["model_zero_grad_between_steps_is_torch", "uib_clip_with_a_group_skipped_in_one_step_and_a_frozen_layer_is_torch",
              "freed_clip_bf16_params_bf16_reduce_is_torch", "nonfinite_skip_with_inf_on_one_rank_skips_every_rank",
              "dcp_get_set_optimizer_state_dict_with_freed_gradients_resumes_exactly"]


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory, request) -> list[dict]:
    out = tmp_path_factory.mktemp("clipping_fsdp")
    proc = subprocess.run([sys.executable, str(FSDP_WORKER), "--out", str(out), *only(request.config, FSDP_QUICK)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", table(FSDP_CASES, list(FSDP_CASES), FSDP_QUICK))
def test_fsdp2_freed_gradients_are_torch_or_clearly_refused(fsdp_results, case: str) -> None:
    for rank, result in enumerate(fsdp_results):
        assert result[case]["ok"], f"rank {rank}: {result[case]['error']}"


def test_max_grad_norm_switched_off_between_backward_and_step_does_not_clip() -> None:
    """max_grad_norm = None after backward, before the first step(): torch does not clip that step."""
    reference, theirs, model, ours = _pair()
    x = _batches(1)[0]
    _loss(reference, x).backward()
    theirs.step()
    _loss(model, x).backward()
    ours.max_grad_norm = None
    ours.step()
    _assert_same(reference, model)


def test_clipped_steps_without_zero_grad_accumulate_as_torch() -> None:
    """No zero_grad between steps (gradients accumulate across steps, as torch's do): clipped by the sums' norm."""
    reference, theirs, model, ours = _pair()
    for x in _batches(4):
        _loss(reference, x).backward()
        _torch_step(reference, theirs)
        _loss(model, x).backward()
        ours.step()
    _assert_same(reference, model)


@pytest.mark.parametrize("block", [0, 3])
@pytest.mark.parametrize("clip", [None, CLIP])
def test_a_parameter_unfrozen_after_two_steps_is_torch(block: int, clip) -> None:
    """Unfrozen at step 3: first (block 3) or last (block 0) in backward; its state is created at the step."""
    reference, theirs, model, ours = _pair(clip=clip)
    for m in (reference, model):
        m.blocks[block][0].weight.requires_grad_(False)
    for step, x in enumerate(_batches(5)):
        if step == 3:
            for m in (reference, model):
                m.blocks[block][0].weight.requires_grad_(True)
        _loss(reference, x).backward()
        _torch_step(reference, theirs, clip)
        theirs.zero_grad()
        _loss(model, x).backward()
        ours.step()
        ours.zero_grad()
    _assert_same(reference, model)
