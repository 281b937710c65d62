"""The files of a checkpoint directory (layout 2) as tests read and rewrite them: the tensors by key, the metadata,
a rank's own state, and the seal renewed after a deliberate edit.

Keys are those ``save`` writes: ``state/model/NAME`` for a model entry, ``state/optimizer/state/NAME/KEY`` for a
parameter's optimizer state (its float32 master is ``KEY`` = ``master_param``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from offload_adamw.checkpoint import publication
from offload_adamw.checkpoint.layout import COMMIT_FILE, MANIFEST_FILE, META_FILE, SHARD_FILE, dumps, rank_files


def shard_files(path: Path) -> list[str]:
    return sorted(name for name in os.listdir(path) if SHARD_FILE.fullmatch(name))


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every rank's shard file, by key (a one-process save: whole tensors)."""
    out: dict[str, torch.Tensor] = {}
    for name in shard_files(path):
        out.update(load_file(str(path / name)))
    return out


def model_entries(path: Path) -> dict[str, torch.Tensor]:
    """The model's entries by name, as stored."""
    return {key.removeprefix("state/model/"): t for key, t in tensors(path).items() if key.startswith("state/model/")}


def optimizer_entry(path: Path, name: str, key: str) -> torch.Tensor:
    return tensors(path)[f"state/optimizer/state/{name}/{key}"]


def meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META_FILE).read_text())


def rank_state(path: Path, rank: int = 0) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the JSON, the tensors) of ``rank``'s own state: its RNG states (rank 0's also the scheduler and extra)."""
    meta_name, tensors_name = rank_files(rank)
    return json.loads((path / meta_name).read_text()), load_file(str(path / tensors_name))


def write_rank_state(path: Path, own: dict[str, Any], own_tensors: dict[str, torch.Tensor], rank: int = 0) -> None:
    """Rewrite ``rank``'s own state and renew the seal (the manifest and the commit marker vouch for it again)."""
    meta_name, tensors_name = rank_files(rank)
    save_file(own_tensors, str(path / tensors_name), metadata={"format": "offload-adamw-checkpoint"})
    (path / meta_name).write_bytes(dumps(own))
    reseal(path)


def reseal(path: Path) -> None:
    """The manifest and the commit marker renewed over every other file: an edit made on purpose passes the seal."""
    files = sorted(name for name in os.listdir(path) if name not in (MANIFEST_FILE, COMMIT_FILE))
    publication.seal(path, files, version=2)


def data_files(path: Path) -> dict[str, bytes]:
    """Every file of the checkpoint, by name, with its bytes."""
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())}


SHARD = "shard-00001-model-00001-of-00001.safetensors"
"""The one shard file of a one-process save (DCP's name: rank 0 + 1)."""
ONE_PROCESS_FILES = [SHARD, *rank_files(0), META_FILE, MANIFEST_FILE, COMMIT_FILE]
"""Every file a one-process save writes, the seal last."""
