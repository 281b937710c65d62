"""OffloadAdamW returned from a real PyTorch Lightning ``configure_optimizers`` (CPU).

Lightning installs here without touching torch (``pip install --dry-run lightning`` only adds
lightning, pytorch-lightning, torchmetrics, lightning-utilities and aiohttp's dependencies), so it
is in the ``test`` extra; the module is skipped where it is absent.

Properties, against torch.optim.AdamW(fused=True) in the same module, bitwise: training with a
scheduler and ``gradient_clip_val``; a mid-run checkpoint written by ModelCheckpoint and continued
with ``fit(ckpt_path=...)`` ends where the uninterrupted run ends.
"""

from __future__ import annotations

import warnings

import pytest
import torch

L = pytest.importorskip("lightning")

from offload_adamw import OffloadAdamW  # noqa: E402


@pytest.fixture(autouse=True)
def _deterministic_algorithms_restored():
    """Trainer(deterministic=True) switches deterministic algorithms on for the whole process: off again after."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


STEPS = 6


class Tiny(L.LightningModule):
    def __init__(self, optimizer: str):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        self.optimizer_name = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        if self.optimizer_name == "offload":
            optimizer = OffloadAdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=2 * STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader():
    # One epoch is STEPS batches, so the mid-run checkpoint falls on an epoch boundary: Lightning
    # restarts a plain DataLoader from its first batch on resume, which is then the right batch.
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * STEPS, 16, generator=g), torch.randint(0, 4, (8 * STEPS,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


def fit(module: Tiny, max_steps: int, ckpt_path=None, checkpoint_dir=None) -> L.Trainer:
    """Fit on CPU; with ``checkpoint_dir`` a ModelCheckpoint saves every STEPS steps, as a preemptible job does."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = [ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=STEPS, save_top_k=-1)] if checkpoint_dir else []
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, gradient_clip_val=0.5, logger=False,
        enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the dataloader does not have many workers": irrelevant here
        trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer


def params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_configure_optimizers_with_offload_adamw_matches_torch():
    ours, theirs = Tiny("offload"), Tiny("torch")
    start = params(ours)
    trainer = fit(ours, STEPS)
    fit(theirs, STEPS)
    assert isinstance(trainer.optimizers[0], OffloadAdamW)
    assert trainer.global_step == STEPS
    a, b = params(ours), params(theirs)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert any(not torch.equal(a[n], start[n]) for n in a)


def test_checkpoint_resume_continues_bitwise(tmp_path):
    straight = Tiny("offload")
    fit(straight, 2 * STEPS, checkpoint_dir=tmp_path)
    middle = tmp_path / f"epoch=0-step={STEPS}.ckpt"
    assert middle.is_file(), sorted(p.name for p in tmp_path.iterdir())

    resumed = Tiny("offload")  # a fresh process: fresh module, fresh optimizer
    resumed_trainer = fit(resumed, 2 * STEPS, ckpt_path=str(middle))
    assert resumed_trainer.global_step == 2 * STEPS
    a, b = params(straight), params(resumed)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    opt = resumed_trainer.optimizers[0]
    assert isinstance(opt, OffloadAdamW)
    assert all(float(s["step"]) == 2 * STEPS and s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
