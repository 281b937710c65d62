"""The parity table of ``offload-adamw selftest``: OffloadAdamW against ``torch.optim.AdamW(fused=True)`` on this device.

Contract:

* **Rows.** Every placement (``host``, ``stream``, ``device``, and ``mix``: the embedding and the head on the host,
  one block resident, one streamed) × gradients ``kept`` or ``freed`` (``offload_gradients``) × the update at
  ``step()`` or during backward (``update_in_backward``) × clipping off or on (``max_grad_norm``), :data:`ROWS`.
  Updates during backward need freed gradients: the kept × backward rows are refused by the optimizer by design
  and shown as skipped with that reason, never silently dropped.
* **Each row** trains :class:`TinyModel` (bf16 parameters, an embedding, two residual MLP blocks with a
  LayerNorm, a head; four parameter groups with two sets of hyperparameters) for :data:`STEPS` steps of
  :data:`ACCUMULATION` micro-batches on ``device``, from the same weights and batches as a control: the same
  model whose float32 copies are updated by ``torch.optim.AdamW(fused=True)``, fed the upcast gradients, the model
  receiving the round-to-nearest copy. Each copy lives where its group's update runs (a host group's on the CPU, a
  streamed or resident group's on ``device``): the control is torch's fused kernel on the device where the update
  runs, which is what the project promises bitwise (docs/placement.md, "The bitwise guarantee": a streamed group on
  a GPU and a host group are each bitwise their own reference, not each other). Clipping is ``max_grad_norm``
  against ``torch.nn.utils.clip_grad_norm_(model.parameters())`` on the control model's gradients.
* **Compared bitwise after every step**: each parameter, its float32 master, ``exp_avg``, ``exp_avg_sq``, the step
  count and, with clipping, the total norm. No tolerance: every row of this table is bitwise by the contract.
  A row is ``exact``, or ``differs`` with the first difference (step, parameter name, which tensor, flat and
  multi-dimensional index, both values and their bit patterns), or ``error`` (the exception, on one line);
  the row's seconds are recorded too, and for an update-during-backward row how many of the last step's buckets
  started their update before backward ended (recorded, not judged: with clipping none may, and on a tiny model
  the worker may be late).
* **Determinism**: on CUDA both sides compute their gradients with deterministic kernels and no TF32 (set for
  the run and restored after), so a difference is the optimizer's, not backward's.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from offload_adamw.optim.optimizer import OffloadAdamW

__all__ = ["Row", "ROWS", "PLACEMENTS", "STEPS", "ACCUMULATION", "CLIP_NORM", "TinyModel", "run_row", "run_table",
           "first_difference"]

PLACEMENTS = ("host", "stream", "device", "mix")
MIX = ("host", "device", "stream", "host")
"""The ``mix`` row's placement of the four groups (embedding, block 0, block 1, head)."""
STEPS = 3
"""Three steps: with update_in_backward the first step learns the order and the next two update during backward."""
ACCUMULATION = 2
"""Two micro-batches per step: gradients accumulate (in host memory when freed; inside no_sync during backward)."""
CLIP_NORM = 0.05
"""Small enough that every step of the table clips (a clip that never acts checks nothing)."""
BUCKET_BYTES = 2048
"""Several buckets per step, so that a bucket updates while the next one's gradients are in flight."""
STREAM_CHUNK_BYTES = 1 << 20
VOCAB, WIDTH, BLOCKS, BATCH, SEQ = 64, 32, 2, 4, 8


@dataclass(frozen=True)
class Row:
    """One row of the table."""

    placement: str
    freed: bool
    in_backward: bool
    clip: bool

    @property
    def name(self) -> str:
        return "/".join((self.placement, "freed" if self.freed else "kept", "backward" if self.in_backward else "step",
                         "clip" if self.clip else "noclip"))

    def skip_reason(self) -> str | None:
        if self.in_backward and not self.freed:
            return "by design: updates during backward need freed gradients"
        return None


ROWS: tuple[Row, ...] = tuple(Row(placement, freed, in_backward, clip) for placement in PLACEMENTS
                              for freed in (False, True) for in_backward in (False, True) for clip in (False, True))


class TinyModel(nn.Module):
    """An embedding, residual MLP blocks with a LayerNorm, and a head: every kind of tensor an LLM has, tiny."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids[:, :-1])
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _groups(model: TinyModel, placement: str) -> list[dict[str, Any]]:
    """Four groups in the model's parameter order (so the total norm reduces in the same order on both sides)."""
    places = MIX if placement == "mix" else (placement,) * 4
    modules = [model.embed, *model.blocks, model.head]
    groups: list[dict[str, Any]] = []
    for k, (module, where) in enumerate(zip(modules, places)):
        hyper = {"lr": 1e-2, "weight_decay": 0.1} if k % 2 else {"lr": 3e-3, "betas": (0.8, 0.95), "weight_decay": 0.0}
        groups.append({"params": list(module.parameters()), "update_on": where, **hyper})
    return groups


def _batches(device: torch.device, seed: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(device) for _ in range(STEPS * ACCUMULATION)]


@contextlib.contextmanager
def _deterministic(device: torch.device) -> Iterator[None]:
    """On CUDA, deterministic kernels and no TF32 while the table runs, as they were afterwards (the CPU's kernels
    give both sides the same gradients already: nothing is changed there)."""
    if device.type != "cuda":
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode needs it
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[2], before[3]
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


_INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
           torch.float16: torch.int16}


def first_difference(a: Tensor, b: Tensor) -> dict[str, Any] | None:
    """None when ``a`` (ours) and ``b`` (torch's) have the same shape, dtype and bits; else the first difference."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"why": f"shape/dtype {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"}
    if a.numel() == 0:
        return None
    if a.dtype not in _INT_OF:
        differs = (a != b).reshape(-1)
        bits_a = bits_b = None
    else:
        ia, ib = a.contiguous().view(_INT_OF[a.dtype]).reshape(-1), b.contiguous().view(_INT_OF[b.dtype]).reshape(-1)
        differs = ia != ib
    where = torch.nonzero(differs)
    if where.numel() == 0:
        return None
    flat = int(where[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    ours, theirs = a.reshape(-1)[flat], b.reshape(-1)[flat]
    if a.dtype in _INT_OF:
        width = a.element_size() * 2
        mask = (1 << (8 * a.element_size())) - 1
        bits_a = f"0x{int(ia[flat]) & mask:0{width}x}"
        bits_b = f"0x{int(ib[flat]) & mask:0{width}x}"
    return {"flat_index": flat, "index": list(index), "ours": ours.item(), "torch": theirs.item(),
            "ours_bits": bits_a, "torch_bits": bits_b, "elements_differing": int(where.shape[0])}


class _Control:
    """torch.optim.AdamW(fused=True) on float32 copies, each where its group's update runs."""

    def __init__(self, model: TinyModel, placement: str, device: torch.device) -> None:
        self.model = model
        self.copies: dict[Tensor, nn.Parameter] = {}
        by_device: dict[torch.device, list[dict[str, Any]]] = {}
        for group in _groups(model, placement):
            runs_on = torch.device("cpu") if group["update_on"] == "host" else device
            params = []
            for p in group["params"]:
                self.copies[p] = nn.Parameter(p.detach().to(runs_on, torch.float32, copy=True))
                params.append(self.copies[p])
            hyper = {k: v for k, v in group.items() if k not in ("params", "update_on")}
            by_device.setdefault(runs_on, []).append({**hyper, "params": params})
        # one optimizer per device: torch's fused AdamW takes the tensors of one device per call
        self.optimizers = [torch.optim.AdamW(groups, fused=True) for groups in by_device.values()]

    def step(self, clip: bool) -> Tensor | None:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_NORM) if clip else None
        for p, master in self.copies.items():
            master.grad = None if p.grad is None else p.grad.to(master.device, torch.float32)
        for opt in self.optimizers:
            opt.step()
        with torch.no_grad():
            for p, master in self.copies.items():
                p.copy_(master)  # round to nearest into the model's dtype
        self.model.zero_grad(set_to_none=True)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return norm

    def state(self, p: Tensor) -> dict[str, Any]:
        master = self.copies[p]
        for opt in self.optimizers:
            if master in opt.state:
                return {"master": master, **opt.state[master]}
        return {"master": master}


def _compare(step: int, ours: TinyModel, opt: OffloadAdamW, theirs: TinyModel,
             control: _Control) -> dict[str, Any] | None:
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        state = opt.state.get(p, {})
        expected = control.state(q)
        pairs: list[tuple[str, Any, Any]] = [("parameter", p, q), ("master", opt.master_param(p), expected["master"])]
        pairs += [(key, state.get(key), expected.get(key)) for key in ("exp_avg", "exp_avg_sq", "step")]
        for what, a, b in pairs:
            if a is None or b is None:
                if (a is None) != (b is None):
                    return {"step": step, "parameter": name, "tensor": what,
                            "why": f"{'ours' if a is None else 'torch'} has no {what}"}
                continue
            if what == "step":
                if float(a) != float(b):
                    return {"step": step, "parameter": name, "tensor": what, "ours": float(a), "torch": float(b)}
                continue
            found = first_difference(a, b)
            if found is not None:
                return {"step": step, "parameter": name, "tensor": what, **found}
    return None


def run_row(row: Row, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """One row: ``{"row", "placement", "gradients", "update", "clip", "status", "seconds", "difference"}``."""
    result: dict[str, Any] = {"row": row.name, "placement": row.placement, "gradients": "freed" if row.freed else "kept",
                              "update": "backward" if row.in_backward else "step", "clip": row.clip,
                              "compared": "bitwise", "difference": None}
    reason = row.skip_reason()
    if reason is not None:
        return {**result, "status": "skipped", "why": reason, "seconds": 0.0}
    start = time.perf_counter()
    try:
        seen: dict[str, Any] = {}
        with _deterministic(device):
            difference = _train(row, device, seed, seen)
        result.update(status="exact" if difference is None else "differs", difference=difference, **seen)
    except Exception as exc:  # a row that raises is a result of the table: the other rows still run
        text = f"{type(exc).__name__}: {exc}".splitlines()
        result.update(status="error", why=text[0] if text else type(exc).__name__)
    result["seconds"] = time.perf_counter() - start
    return result


def _train(row: Row, device: torch.device, seed: int, seen: dict[str, Any]) -> dict[str, Any] | None:
    torch.manual_seed(seed)
    theirs = TinyModel().to(device, torch.bfloat16)
    ours = copy.deepcopy(theirs)
    control = _Control(theirs, row.placement, device)
    opt = OffloadAdamW(_groups(ours, row.placement), transfer_pipeline=True, offload_gradients=row.freed,
                       update_in_backward=row.in_backward, max_grad_norm=CLIP_NORM if row.clip else None,
                       bucket_bytes=BUCKET_BYTES, stream_chunk_bytes=STREAM_CHUNK_BYTES)
    batches = _batches(device, seed + 1)
    try:
        for step in range(STEPS):
            for micro in range(ACCUMULATION):
                ids = batches[step * ACCUMULATION + micro]
                last = micro == ACCUMULATION - 1
                # micro-batches that only accumulate start no update during backward: no_sync says so
                with opt.no_sync() if row.in_backward and not last else contextlib.nullcontext():
                    (ours(ids) / ACCUMULATION).backward()
                (theirs(ids) / ACCUMULATION).backward()
            norm = control.step(row.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if row.clip:
                assert norm is not None
                if opt.last_grad_norm is None:
                    return {"step": step, "parameter": "(all)", "tensor": "clip norm", "why": "ours has no norm"}
                if float(norm) <= CLIP_NORM:
                    raise RuntimeError(f"step {step}: the clipping did not act (norm {float(norm):.3g}); the row checks "
                                       "nothing: CLIP_NORM must be smaller")
                found = first_difference(opt.last_grad_norm.reshape(()), norm.reshape(()))
                if found is not None:
                    return {"step": step, "parameter": "(all)", "tensor": "clip norm", **found}
            difference = _compare(step, ours, opt, theirs, control)
            if difference is not None:
                return difference
        timeline = opt.last_step_timeline() if row.in_backward else None
        if timeline is not None:  # said, not judged: on a tiny model the worker may start only after backward
            seen["buckets"] = len(timeline.buckets)
            seen["buckets_started_in_backward"] = sum(b.update_start < timeline.backward_end for b in timeline.buckets)
    finally:
        del opt  # its pipeline's buffers and threads go before the next row starts
    return None


def run_table(device: torch.device, rows: tuple[Row, ...] = ROWS,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Every row of ``rows`` on ``device``, each reported to ``on_row`` as it ends."""
    results = []
    for k, row in enumerate(rows):
        # a row's seed is its place in the whole table, so that a row run alone (--rows) sees the same numbers
        result = run_row(row, device, seed=ROWS.index(row) if row in ROWS else k)
        results.append(result)
        if on_row is not None:
            on_row(result)
    return results
