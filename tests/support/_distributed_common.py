"""Shared pieces of the distributed tests: a small causal transformer, its data, training loops.

Used by ``_distributed_worker.py`` (the 2-process gloo run) and by
``test_distributed.py`` (the single-process side of the resharding checks), so
that both sides train exactly the same model on exactly the same batches.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

VOCAB = 61  # odd on purpose: the embedding and the head shard unevenly over 2 ranks (31 + 30 rows)
WIDTH = 32
SEQ = 8
ROWS_PER_RANK = 2
STEPS = 20
LR = 3e-3
WEIGHT_DECAY = 0.1

#: fp32 tolerances of the project (COMMON.md); the same numbers as torch's own fp32 defaults for allclose tests.
RTOL = 1.3e-6
ATOL = 1e-5


class TinyCausalLM(nn.Module):
    """Embedding, two pre-norm transformer blocks with a causal mask, final norm, untied head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=48, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        torch.random.set_rng_state(generator_state)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def batch(step: int, rank: int | None, world: int = 2) -> torch.Tensor:
    """Tokens of one step: rank ``rank``'s rows, or (rank None) all ranks' rows concatenated in rank order."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = torch.randint(0, VOCAB, (world * ROWS_PER_RANK, SEQ + 1), generator=g)
    if rank is None:
        return rows
    return rows[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int | None, clip: float | None = None
) -> list[float]:
    """``steps`` optimizer steps on ``batch(step, rank)``; with ``clip``, torch's clip_grad_norm_ before each step.

    Returns the loss of each step (this rank's rows only when ``rank`` is given).
    """
    losses = []
    for step in steps:
        loss = loss_of(model, batch(step, rank))
        loss.backward()
        losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a whole (gathered) tensor, by name; DDP's ``module.`` prefix dropped."""
    out = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = value.detach().clone()
    return out


def spawn_ranks(worker: Callable[..., None], *args: Any, world: int = 2, simulated_seed: int | None = None) -> None:
    """Run ``worker(rank, port, *args)`` in ``world`` processes, with a free TCP port for their rendezvous; with
    ``simulated_seed``, each rank first installs a simulated CUDA device of its own rank's index."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if simulated_seed is None:
        mp.spawn(worker, args=(port, *args), nprocs=world, join=True)
    else:
        mp.spawn(_on_simulated_device, args=(port, simulated_seed, worker, *args), nprocs=world, join=True)


#: the simulated CUDA device this rank installed (``--simulated-device``), or None
SIMULATED: list[Any] = []


def _on_simulated_device(rank: int, port: int, seed: int, worker: Callable[..., None], *args: Any) -> None:
    """Rank ``rank`` on the simulated CUDA device of index ``rank`` (offload_adamw.testing.simulated_cuda): the
    production stream lane, copies landing late, a device index other than 0 on rank 1."""
    from offload_adamw.testing.simulated_cuda import install

    SIMULATED.append(install(seed * 10 + rank, index=rank))
    worker(rank, port, *args)


def join_gloo(rank: int, port: int, world: int, *, timeout_s: float | None = 60.0) -> None:
    """This spawned rank joins the gloo group of ``world`` ranks at ``port``, with one intra-op thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, **({} if timeout is None else {"timeout": timeout}))


class CaseResults:
    """The cases of a 2-rank worker on one rank: ``{case: {"ok", "error", "measured"}}`` in ``path``, written at the
    start and after each case (a rank that dies later keeps what it found), the ranks meeting at a barrier between cases."""

    def __init__(self, path: Path, only: Sequence[str]) -> None:
        self.path, self.only = path, list(only)
        self.results: dict[str, dict] = {}
        self.write()  # the file is there even when no case is selected

    def run(self, name: str, check: Callable[..., Any], *args: Any) -> None:
        """``check(*args, measured)`` passes unless it raises."""
        self._record(name, lambda measured: check(*args, measured) and None)

    def judge(self, name: str, case: Callable[..., list[str]], *args: Any) -> None:
        """``case(*args, measured)`` returns what it found wrong (nothing: the case passes)."""
        self._record(name, lambda measured: case(*args, measured))

    def _record(self, name: str, body: Callable[[dict], list[str] | None]) -> None:
        if self.only and name not in self.only:
            return
        measured: dict = {}
        try:
            bad = body(measured) or []
            if SIMULATED:  # what the simulated device saw during the case fails it
                bad = [*bad, *(f"simulated CUDA hazard: {h}" for h in SIMULATED[0].take_hazards()[:3])]
            self.results[name] = {"ok": not bad, "error": "; ".join(bad[:6]), "measured": measured}
        except Exception:
            self.results[name] = {"ok": False, "error": traceback.format_exc()[-3000:], "measured": measured}
        self.write()
        with contextlib.suppress(Exception):
            dist.barrier()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.results, indent=1, default=str))


def worker_main(worker: Callable[..., None], *, world: int, quick: Sequence[str] | None = None) -> None:
    """A worker script's entry: ``--out DIR --only CASE...`` (and ``--quick``, the ``quick`` cases), then
    ``worker(rank, port, out, only)`` on ``world`` spawned ranks."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", default=[], help="the cases to run (default: all)")
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help="only the quick cases")
    parser.add_argument("--simulated-device", type=int, default=None, metavar="SEED",
                        help="run each rank on a simulated CUDA device of its rank's index, with this seed")
    args = parser.parse_args()
    only = args.only or (list(quick) if quick is not None and args.quick else [])
    spawn_ranks(worker, args.out, only, world=world, simulated_seed=args.simulated_device)
