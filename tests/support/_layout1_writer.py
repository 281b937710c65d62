"""The writer of the old one-process layout (version 1: model / optimizer / aux safetensors, meta.json), kept for
tests only: ``checkpoint.save`` writes layout 2 for every run, and ``checkpoint.load`` still reads layout-1
checkpoints that earlier versions wrote (:mod:`offload_adamw.checkpoint.store`'s read-only path). The tests of
that path (loading, malformed metadata, conversion) need such checkpoints made at test time; this is the writer
main shipped until layout 2 became the only one, with the same files, bytes and seal.

    save_layout1(path, model, optimizer, scheduler=None, extra=None, *, step=None, rng=True) -> Path
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from offload_adamw.checkpoint import codec, publication
from offload_adamw.checkpoint.codec import encode
from offload_adamw.checkpoint.errors import CheckpointError
from offload_adamw.checkpoint.layout import (
    AUX_FILE,
    DATA_FILES,
    FORMAT,
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    VERSION,
    dumps,
)
from offload_adamw.checkpoint.publication import TMP_TAG
from offload_adamw.checkpoint.sharded import _rng_states
from offload_adamw.contract.rules import MASTER_KEY

_KEY_SEP = "::"


def _model_entries(model: torch.nn.Module) -> tuple[dict[str, Tensor], dict[str, str], dict[str, Tensor]]:
    """(canonical name -> tensor, alias -> canonical name, every name -> tensor) of the model's state."""
    everything = model.state_dict(keep_vars=True)
    canonical: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, value in everything.items():
        if not isinstance(value, Tensor):
            raise CheckpointError(
                f"model state {name!r} is a {type(value).__name__}, not a tensor; it cannot be saved without pickling"
            )
        if id(value) in first_name:
            aliases[name] = first_name[id(value)]  # a tied weight: stored once
            continue
        first_name[id(value)] = name
        canonical[name] = value
    return canonical, aliases, everything


def save_layout1(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any = None,
    extra: Any = None, *, step: int | None = None, rng: bool = True,
) -> Path:
    """A layout-1 checkpoint directory at ``path`` (which must not exist), published atomically; its path."""
    final = Path(path).absolute()
    if os.path.lexists(final):
        raise CheckpointError(f"{final} exists")
    contents = _gather(model, optimizer, scheduler, extra, step=step, rng=rng)
    final.parent.mkdir(parents=True, exist_ok=True)
    _write_and_publish(final, contents, False)
    publication.fsync_path(final.parent, directory=True)
    return final


@dataclass
class _Contents:
    """Everything a checkpoint directory will hold, gathered before the disk is touched."""

    model: dict[str, Tensor]
    optimizer: dict[str, Tensor]
    aux: dict[str, Tensor]
    meta: bytes


def _gather(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any, extra: Any, *, step: int | None, rng: bool
) -> _Contents:
    """Every tensor and the metadata, encoded: an unsaveable object fails here, before the disk is touched."""
    canonical, aliases, _ = _model_entries(model)
    optimizer_tensors: dict[str, Tensor] = {}
    aux: dict[str, Tensor] = {}
    optimized, optimizer_meta = _gather_optimizer(optimizer, canonical, optimizer_tensors, aux)
    model_tensors, entries = _gather_model(canonical, optimizer, optimized)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(_largest_step(optimizer) if step is None else step),
        "torch": torch.__version__,
        "model": entries,
        "aliases": aliases,
        "optimizer": optimizer_meta,
        "scheduler": None
        if scheduler is None
        else {"class": type(scheduler).__name__, "state": encode(scheduler.state_dict(), aux, "scheduler")},
        "rng": _rng_states(aux) if rng else None,
        "extra": encode(extra, aux, "extra"),
    }
    return _Contents(model=model_tensors, optimizer=optimizer_tensors, aux=aux, meta=dumps(meta))


def _gather_optimizer(
    optimizer: torch.optim.Optimizer | None, canonical: dict[str, Tensor], tensors: dict[str, Tensor], aux: dict[str, Tensor]
) -> tuple[set[int], dict[str, Any] | None]:
    """(ids of the optimized tensors, the optimizer's metadata): groups by name, states keyed "<name>::<key>"."""
    if optimizer is None:
        return set(), None
    name_of = {id(t): name for name, t in canonical.items()}
    optimized: set[int] = set()
    groups: list[dict[str, Any]] = []
    states: dict[str, Any] = {}
    for gi, group in enumerate(optimizer.param_groups):
        names = []
        for index, p in enumerate(group["params"]):
            name = name_of.get(id(p))
            if name is None:
                raise CheckpointError(
                    f"parameter {index} of optimizer group {gi} (shape {tuple(p.shape)}) is not in "
                    "model.state_dict(): every optimized tensor needs a name"
                )
            names.append(name)
            optimized.add(id(p))
            state = optimizer.state.get(p)
            if state:
                states[name] = {
                    key: encode(value, tensors, f"{name}{_KEY_SEP}{key}")
                    for key, value in state.items()
                    if key != MASTER_KEY  # the master is the model entry
                }
        hyper = {k: encode(v, aux, f"optimizer/{gi}/{k}") for k, v in group.items() if k not in ("params", "param_names")}
        groups.append({"param_names": names, "hyper": hyper})
    return optimized, {"class": type(optimizer).__name__, "groups": groups, "states": states}


def _gather_model(
    canonical: dict[str, Tensor], optimizer: torch.optim.Optimizer | None, optimized: set[int]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(the stored tensor of each model entry, its metadata): an optimized tensor with a master is stored as that."""
    has_masters = optimizer is not None and hasattr(optimizer, "master_value")
    tensors: dict[str, Tensor] = {}
    entries: dict[str, Any] = {}
    for name, value in canonical.items():
        # has_masters: the optimizer defines master_value
        stored = cast(Any, optimizer).master_value(value) if has_masters and id(value) in optimized else value
        tensors[name] = stored
        entries[name] = {
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "stored_dtype": str(stored.dtype).removeprefix("torch."),
        }
    return tensors, entries


def _largest_step(optimizer: torch.optim.Optimizer | None) -> int:
    counts = [
        int(s["step"])
        for s in (optimizer.state.values() if optimizer is not None else ())
        if isinstance(s.get("step"), (Tensor, int, float))
    ]
    return max(counts, default=0)


def _write_and_publish(final: Path, contents: _Contents, overwrite: bool) -> Path | None:
    """Write a locked temporary, seal it, publish it onto ``final``; return where the replaced one now is.

    Any failure removes the temporary and raises :class:`CheckpointError`; ``final`` is then as it was.
    """
    tmp = publication.temporary_name(final, TMP_TAG)
    lock = None
    try:
        tmp.mkdir()
        lock = publication.lock(tmp)
        codec.write_tensors(tmp / MODEL_FILE, contents.model)
        codec.write_tensors(tmp / OPTIMIZER_FILE, contents.optimizer)
        codec.write_tensors(tmp / AUX_FILE, contents.aux)
        publication.write_bytes(tmp / META_FILE, contents.meta)
        # without overwrite, a ``final`` another save (or anyone) created after _check_target looked is refused
        previous = publication.seal_and_publish(tmp, final, DATA_FILES, replace=overwrite)
    except Exception as exc:
        publication.unlock(lock)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(
            f"could not write checkpoint {final}: {exc}; nothing was published and any previous checkpoint there is intact"
        ) from exc
    except BaseException:
        publication.unlock(lock)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publication.unlock(lock)
    return previous


