"""Train a small causal transformer with FSDP2 + OffloadAdamW, checkpointing with offload_adamw.checkpoint (on DCP).

Launch (see examples/README-fsdp.md):

    torchrun --nproc_per_node 2 examples/fsdp_train.py                 # CPU: gloo
    torchrun --nproc_per_node 8 examples/fsdp_train.py --steps 200     # GPUs: nccl, unchanged
    torchrun --nproc_per_node 2 examples/fsdp_train.py --overlap --timeline out.png

What it shows:

* FSDP2 (``fully_shard``) shards every parameter over the ranks; OffloadAdamW keeps
  float32 state in host memory for this rank's shard only (host bytes per rank =
  1/world of the total, printed at the end).
* Gradient clipping uses the global norm over all shards (``optimizer.clip_grad_norm_``).
* ``--overlap``: each FSDP group's reduced gradient shard goes to host memory as soon as its
  reduce-scatter ends (the device gradient is freed) and the host updates that group on a worker
  thread while backward goes on (``offload_gradients=True, update_in_backward=True``). Clipping then
  happens inside the optimizer (``max_grad_norm``): the norms are taken on the device in backward's
  hooks, and the updates start when backward ends, the moment the global norm is known.
* ``--timeline out.png`` draws the last step as a Gantt chart (rank 0): when each group's gradient
  was ready, copied, updated and copied back, and where backward ended.
* Checkpoints are ``offload_adamw.checkpoint`` directories (docs/checkpoints.md, the sharded layout):
  torch.distributed.checkpoint writes one safetensors file per rank, the model and the optimizer by
  parameter name as global DTensors, with the RNG states of every rank; the directory is published
  atomically and verified (a digest of every file) before anything is loaded, and nothing is unpickled.
  ``--resume`` works at any world size, including one that differs from the one that saved.

The model, data and hyperparameters are synthetic on purpose: no downloads. The
data is a fixed random permutation to learn (token t is followed by perm[t]), so
the loss falls visibly within a few dozen steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from offload_adamw import OffloadAdamW, checkpoint


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a run depends on; the same on every rank."""

    steps: int = 40
    """Optimizer steps to reach (counted from 0, also across a resume)."""
    batch_per_rank: int = 8
    """Sequences per rank per step (the global batch is world times this)."""
    seq_len: int = 32
    """Tokens per sequence."""
    vocab: int = 97
    """Vocabulary size."""
    width: int = 64
    """Model width."""
    layers: int = 2
    """Transformer blocks (each one FSDP2 unit)."""
    lr: float = 3e-3
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    bf16: bool = False
    """Compute in bfloat16 (FSDP2 MixedPrecisionPolicy); the sharded fp32 parameters and host state stay float32."""
    ckpt_dir: str = "checkpoints/fsdp_train"
    """Directory of the checkpoints (step_<N> subdirectories)."""
    save_every: int = 20
    """Save a checkpoint every this many steps (0: only at the end)."""
    resume: bool = False
    """Continue from the newest checkpoint in ckpt_dir."""
    seed: int = 0
    """Initialisation and data seed."""
    overlap: bool = False
    """Hide the host update behind backward: freed device gradients, updates during backward, clipping inside the optimizer."""
    timeline: str = ""
    """Write the last step's timeline as a Gantt chart PNG here (rank 0); empty: none."""


class CausalLM(nn.Module):
    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                cfg.width, nhead=4, dim_feedforward=4 * cfg.width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def batch(cfg: TrainConfig, step: int, rank: int, device: torch.device) -> torch.Tensor:
    """This rank's sequences of one step: a walk through a fixed random permutation (deterministic per step and rank)."""
    perm = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(cfg.seed))
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)
    tokens = torch.empty(cfg.batch_per_rank, cfg.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (cfg.batch_per_rank,), generator=g)
    for i in range(1, cfg.seq_len + 1):
        tokens[:, i] = perm[tokens[:, i - 1]]
    return tokens.to(device)


def setup() -> tuple[torch.device, object]:
    """Process group and 1-D device mesh: nccl on GPUs, gloo on CPU; torchrun provides rank and world."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return device, mesh


def build(cfg: TrainConfig, device: torch.device, mesh) -> tuple[nn.Module, OffloadAdamW]:
    torch.manual_seed(cfg.seed)  # every rank initialises the same full model before sharding
    model = CausalLM(cfg).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # The parameters are now DTensors; the optimizer keeps host state for the local shards only.
    if cfg.overlap:
        optimizer = OffloadAdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, offload_gradients=True,
            update_in_backward=True, max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm > 0 else None,
        )
    else:
        # A timeline needs the transfer pipeline (kept gradients: each shard is fetched at the step).
        optimizer = OffloadAdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                 transfer_pipeline=True if cfg.timeline else None)
    return model, optimizer


def save(model: nn.Module, optimizer: OffloadAdamW, ckpt_dir: Path, step: int) -> Path:
    """A checkpoint of this rank's shards (every rank calls it), loadable at any world size."""
    return checkpoint.save(ckpt_dir / f"step_{step}", model, optimizer, step=step)


def load(model: nn.Module, optimizer: OffloadAdamW, path: Path) -> int:
    """Verified first, then resharded into this run's layout by parameter name; the saved step."""
    report = checkpoint.load(path, model, optimizer)
    return int(report.step or 0)


def main(argv: list[str] | None = None) -> int:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true", default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    parser.add_argument("--json", action="store_true", help="print one JSON summary line (rank 0) instead of tables")
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(defaults)})

    device, mesh = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(cfg, device, mesh)
    ckpt_dir = Path(cfg.ckpt_dir)
    start = 0
    if cfg.resume and (found := checkpoint.latest(ckpt_dir)) is not None:
        start = load(model, optimizer, found)
        if rank == 0 and not args.json:
            print(f"resumed from {found} at step {start} (saved by any world size; this run has {world})")

    progress = range(start, cfg.steps)
    if rank == 0 and not args.json:
        from tqdm import tqdm

        progress = tqdm(progress, desc=f"FSDP2 x{world} + OffloadAdamW", unit="step")
    losses: list[float] = []
    grad_norm = float("nan")
    started = time.perf_counter()
    for step in progress:
        tokens = batch(cfg, step, rank, device)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        if cfg.max_grad_norm > 0 and not cfg.overlap:
            grad_norm = float(optimizer.clip_grad_norm_(cfg.max_grad_norm))  # global over every shard
        optimizer.step()
        if cfg.overlap and optimizer.last_grad_norm is not None:
            norm = optimizer.last_grad_norm  # taken during backward, global over every shard
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.SUM)
        losses.append(float(mean_loss) / world)
        if rank == 0 and not args.json:
            progress.set_postfix(loss=f"{losses[-1]:.4f}", grad_norm=f"{grad_norm:.3f}")
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            save(model, optimizer, ckpt_dir, step + 1)
    elapsed = time.perf_counter() - started
    timeline = optimizer.last_step_timeline() if losses else None
    if rank == 0 and cfg.timeline and timeline is not None:
        mode = "updates during backward" if cfg.overlap else "updates at step()"
        timeline.gantt_png(cfg.timeline, title=f"FSDP2 x{world}, rank 0, {mode}: overlap {timeline.overlap:.2f}")
    final = save(model, optimizer, ckpt_dir, cfg.steps) if cfg.steps > start else None

    # Per-rank host state: what this rank's shards cost, gathered to rank 0 for one table.
    mine = {
        "rank": rank,
        "host_state_bytes": optimizer.host_state_bytes(),
        "local_elements": sum(p.to_local().numel() for p in model.parameters()),
    }
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        total = sum(r["host_state_bytes"] for r in every)
        summary = {
            "world": world,
            "backend": dist.get_backend(),
            "steps": [start, cfg.steps],
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "seconds": round(elapsed, 3),
            "checkpoint": str(final) if final else None,
            "ranks": every,
            "host_state_bytes_total": total,
            "overlap": None if timeline is None else round(timeline.overlap, 3),
            "timeline": cfg.timeline or None,
        }
        if args.json:
            print(json.dumps(summary))
        else:
            if losses:
                print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over steps {start}..{cfg.steps} in {elapsed:.1f} s")
            print(f"{'rank':>4}  {'host state bytes':>16}  {'share':>6}  {'local elements':>14}")
            for r in every:
                share = r["host_state_bytes"] / total if total else 0.0
                print(f"{r['rank']:>4}  {r['host_state_bytes']:>16,}  {share:>6.1%}  {r['local_elements']:>14,}")
            if timeline is not None:
                print(f"last step: {timeline.overlap:.0%} of the host update ran before backward ended")
            if cfg.timeline and timeline is not None:
                print(f"timeline: {cfg.timeline}")
            if final:
                print(f"checkpoint: {final}")
    # Every rank past its last collective before any tears its process group down: a rank whose peer has already
    # closed its gloo connections can abort at exit ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
