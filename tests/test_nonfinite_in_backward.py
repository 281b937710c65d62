"""update_in_backward with a non-finite policy and clipping (offload_gradients=True): each case is a
combination that once trained wrong, hung or refused confusingly, kept as a test that it is torch's result (or the
reference OffloadAdamW(update_in_backward=False)'s) or a clear refusal before any update."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "support" / "_nonfinite_in_backward_worker.py"
sys.path.insert(0, str(WORKER.parent))
from _nonfinite_in_backward_worker import CASES as FSDP_CASES  # noqa: E402
from _quick import only, table  # noqa: E402

#: what CI runs (the rest is slow): the clipped skip under FSDP2, and DDP's with a parameter outside it
FSDP_QUICK = ["uib_clip_skip_gate_opens_under_fsdp2",
              "ddp_uib_skip_with_inf_in_a_parameter_outside_ddp_on_one_rank_keeps_the_replicas_equal"]

# ----------------------------------------------------------------------------- FSDP2, 2 gloo ranks (one run of the worker)


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory, request) -> list[dict]:
    out = tmp_path_factory.mktemp("nonfinite_fsdp")
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(out), *only(request.config, FSDP_QUICK)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", table(FSDP_CASES, list(FSDP_CASES), FSDP_QUICK))
def test_fsdp2_update_in_backward_nonfinite_is_the_reference(fsdp_results, case: str) -> None:
    for rank, result in enumerate(fsdp_results):
        assert result[case]["ok"], f"rank {rank}: {result[case]['error']}"


# ----------------------------------------------------------------------------- one process, the CPU as device

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _parity import same_bits  # noqa: E402
from offload_adamw import OffloadAdamW  # noqa: E402

WIDTH = 32


class Side(nn.Module):
    """Blocks every micro-batch runs, and a side layer only the first micro-batch of a step runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.side = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        if side:
            x = x + self.side(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return x


def _side_steps(ours: bool, uib: bool, poisoned_step: int | None, **kw) -> tuple[Side, OffloadAdamW | None, str | None]:
    """Two micro-batches a step, the first inside no_sync() (ours) and the only one through the side layer; an inf
    reaches the side layer's gradient through backward in ``poisoned_step``. Returns the model, the optimizer and
    the name of the error step() raised (the reference: torch's AdamW, with clipping by clip_grad_norm_)."""
    model = Side()
    step_of = [0]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if step_of[0] == poisoned_step:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad

    model.side.weight.register_hook(poison)
    if ours:
        opt = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, offload_gradients=True,
                           update_in_backward=uib, bucket_bytes=WIDTH * WIDTH * 4, **kw)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(3)
    error = None
    for step in range(3):
        step_of[0] = step
        for micro in range(2):
            x = torch.randn(16, WIDTH, generator=g)
            context = opt.no_sync() if ours and micro == 0 else torch.enable_grad()
            with context:
                model(x, side=micro == 0).square().mean().backward()
        if not ours and kw.get("max_grad_norm") is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), kw["max_grad_norm"])
        try:
            opt.step()
        except (RuntimeError, FloatingPointError) as e:
            error = f"{type(e).__name__}: {e}"
            break
        opt.zero_grad()
    return model, opt, error


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_an_inf_in_a_gradient_accumulated_only_inside_no_sync_is_the_policys(policy: str) -> None:
    """A layer only the no_sync() micro-batches reach: no hook counts its gradient in the synchronising backward,
    so its inf must keep the updates waiting for step(), which then skips (or raises) before any update."""
    reference, ref_opt, ref_error = _side_steps(True, False, 1, nonfinite=policy)
    model, opt, error = _side_steps(True, True, 1, nonfinite=policy)
    assert (error is None) == (ref_error is None), f"update_in_backward: {error}; reference: {ref_error}"
    if error is not None:
        assert error.startswith("FloatingPointError"), error
    assert opt.skipped_steps == ref_opt.skipped_steps
    for a, b in zip(reference.parameters(), model.parameters()):
        assert same_bits(a.detach(), b.detach())


def test_a_gradient_accumulated_only_inside_no_sync_is_clipped_with_the_rest() -> None:
    """The same layer with max_grad_norm: its norm is not the hooks'; the step must clip as torch does, not run the
    others early with a coefficient that left it out and then refuse."""
    reference, _, ref_error = _side_steps(False, False, None, max_grad_norm=0.05)
    model, _, error = _side_steps(True, True, None, max_grad_norm=0.05)
    assert ref_error is None and error is None, error
    for a, b in zip(reference.parameters(), model.parameters()):
        assert same_bits(a.detach(), b.detach())


def test_a_forward_between_backward_and_step_reads_the_parameters_torch_reads() -> None:
    """A no_grad forward after backward, before step() (a metric, an EMA read): torch's parameters are still the
    old ones. With update_in_backward the worker updates them meanwhile (whole or in part): the output must be
    torch's, or the forward refused."""
    import time

    outputs: dict[bool, list] = {}
    refused = []
    for ours in (False, True):
        model = Side()
        if ours:
            opt = OffloadAdamW(model.parameters(), lr=1e-2, offload_gradients=True, update_in_backward=True,
                               bucket_bytes=WIDTH * WIDTH * 4)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        g = torch.Generator().manual_seed(5)
        seen = []
        for _ in range(3):
            model(torch.randn(16, WIDTH, generator=g), side=True).square().mean().backward()
            time.sleep(0.2)  # the worker's updates have ended by now
            with torch.no_grad():
                try:
                    seen.append(model(torch.ones(4, WIDTH), side=True))
                except RuntimeError as error:
                    assert ours and "opt.step() must come next" in str(error), error
                    refused.append(str(error))
                    seen.append(None)
            opt.step()
            opt.zero_grad()
        outputs[ours] = seen
    for step, (a, b) in enumerate(zip(outputs[False], outputs[True])):
        assert b is None or same_bits(a, b), f"step {step}: the forward read parameters updated before step()"
    assert refused, "from the second step on the updates run during backward: the forward must be refused"


def test_nonfinite_switched_on_between_backward_and_step_after_early_updates_is_refused() -> None:
    """nonfinite="skip" set after a backward whose updates already ran ungated (the policy was "propagate"): an inf
    they consumed was never counted, so the step can neither skip nor pretend it checked; it must refuse, as a
    max_grad_norm changed in that window is refused."""
    model = Side()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, offload_gradients=True, update_in_backward=True,
                       bucket_bytes=WIDTH * WIDTH * 4)
    poisoned = [False]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if poisoned[0]:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad

    model.blocks[3].weight.register_hook(poison)  # the first gradient of backward: its bucket runs early
    g = torch.Generator().manual_seed(9)
    for step in range(2):
        poisoned[0] = step == 1
        model(torch.randn(16, WIDTH, generator=g), side=True).square().mean().backward()
        if step == 1:
            opt.nonfinite = "skip"
            with pytest.raises(RuntimeError, match="nonfinite"):
                opt.step()
            return
        opt.step()
        opt.zero_grad()


def test_last_grad_norm_of_a_skipped_clipped_step_is_the_reference() -> None:
    """max_grad_norm with nonfinite="skip": the skipped step's last_grad_norm is the one without update_in_backward
    (the non-finite total norm), not the previous step's."""
    norms = {}
    for uib in (False, True):
        model = Side()
        opt = OffloadAdamW(model.parameters(), lr=1e-2, offload_gradients=True, update_in_backward=uib,
                           bucket_bytes=WIDTH * WIDTH * 4, max_grad_norm=0.05, nonfinite="skip")
        step_of = [0]

        def poison(grad: torch.Tensor, step_of=step_of) -> torch.Tensor:
            if step_of[0] == 2:
                grad = grad.clone()
                grad[0, 0] = float("inf")
            return grad

        model.blocks[3].weight.register_hook(poison)
        g = torch.Generator().manual_seed(11)
        seen = []
        for step in range(3):
            step_of[0] = step
            model(torch.randn(16, WIDTH, generator=g), side=True).square().mean().backward()
            opt.step()
            opt.zero_grad()
            seen.append(float(opt.last_grad_norm))
        norms[uib] = (seen, opt.skipped_steps)
    assert norms[True] == norms[False]
