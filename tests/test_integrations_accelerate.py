"""OffloadAdamW through the real accelerate (CPU): prepare, train, clip, save_state / load_state.

Each property is checked against the same loop with torch.optim.AdamW(fused=True), bitwise.
"""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402

from offload_adamw import OffloadAdamW  # noqa: E402

STEPS = 6


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def train(optimizer_factory, *, steps: int = STEPS, max_norm: float | None = 0.5, state_dir=None, resume_dir=None):
    """Train with accelerate; optionally save_state after ``steps`` or load_state before training."""
    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = tiny_model()
    optimizer = optimizer_factory(model.parameters())
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=2 * STEPS)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    data = batches(2 * STEPS)
    done = 0
    if resume_dir is not None:
        accelerator.load_state(str(resume_dir))
        done = STEPS
    norms = []
    for x, y in data[done : done + steps]:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        if max_norm is not None:
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    if state_dir is not None:
        accelerator.save_state(str(state_dir))
    accelerator.free_memory()
    return {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}, optimizer, norms


def offload(params):
    return OffloadAdamW(params, lr=1e-2, weight_decay=0.1)


def torch_fused(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


@pytest.mark.parametrize("max_norm", [0.5, None], ids=["clipped", "unclipped"])
def test_prepare_trains_and_matches_torch_adamw(max_norm):
    ours, optimizer, norms = train(offload, max_norm=max_norm)
    theirs, _, _ = train(torch_fused, max_norm=max_norm)
    # accelerate wraps the optimizer; the wrapped one is ours and holds float32 host state.
    assert isinstance(optimizer.optimizer, OffloadAdamW)
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.optimizer.state.values())
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    start = dict(tiny_model().named_parameters())
    assert any(not torch.equal(ours[n], start[n].detach()) for n in ours)
    if max_norm is not None:
        assert min(norms) > max_norm  # clipping was exercised at every step


def test_save_state_load_state_continues_bitwise(tmp_path):
    straight, _, _ = train(offload, steps=2 * STEPS)
    train(offload, steps=STEPS, state_dir=tmp_path / "state")
    resumed, _, _ = train(offload, steps=STEPS, resume_dir=tmp_path / "state")
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
