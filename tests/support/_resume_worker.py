"""Train a small model for a range of steps, optionally resuming from and saving to torch.save files.

Run as a separate process by tests/test_resume.py so that nothing but the file carries state.
Usage: python _resume_worker.py DTYPE START STOP OUT [RESUME_FROM]
"""

import sys

import torch

from offload_adamw import OffloadAdamW


def build(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.SiLU(), torch.nn.LayerNorm(24), torch.nn.Linear(24, 5))
    model.to(dtype)
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.ndim <= 1]
    opt = OffloadAdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=40)
    return model, opt, sched


def main():
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
    start, stop, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    model, opt, sched = build(dtype)
    if len(sys.argv) > 5:
        ckpt = torch.load(sys.argv[5], weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(1000 + step)  # the batch is a function of the step alone
        x = torch.randn(6, 8, generator=gen).to(dtype)
        y = torch.randn(6, 5, generator=gen)
        opt.zero_grad()
        (model(x).float() - y).square().mean().backward()
        opt.step()
        sched.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, out)


if __name__ == "__main__":
    main()
