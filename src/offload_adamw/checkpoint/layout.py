"""What a checkpoint directory holds: its format tag and version, its file names, its JSON encoding.

Shared by the codec, the atomic publication and the store; imports nothing of the package and no torch.
"""

from __future__ import annotations

import json
import re
from typing import Any

FORMAT = "offload-adamw-checkpoint"
VERSION = 1
"""Layout 1, the one-process layout of earlier versions: read (``load``, ``verify``, ``latest``), never written."""
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
AUX_FILE = "aux.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
COMMIT_FILE = "COMMIT"
DATA_FILES = (MODEL_FILE, OPTIMIZER_FILE, AUX_FILE, META_FILE)
CHECKPOINT_FILES = frozenset({*DATA_FILES, MANIFEST_FILE, COMMIT_FILE})
"""Every file a save of the one-process layout (version 1) wrote into a checkpoint directory, and nothing else."""

SHARDED_VERSION = 2
"""The layout built on torch.distributed.checkpoint, what every save writes (one process, DDP, FSDP2): every rank's
tensors as safetensors, the rest as JSON."""
SHARD_FILE = re.compile(r"shard-[0-9]{5}-model-[0-9]{5}-of-[0-9]{5}\.safetensors")
"""A rank's tensors as DCP's safetensors writer names them (its rank + 1 first), offsets in the header."""
RANK_FILE = re.compile(r"rank-[0-9]{5}\.(json|safetensors)")
"""A rank's own state (its RNG states): JSON and the tensors it refers to."""


def rank_files(rank: int) -> tuple[str, str]:
    """(the JSON, the safetensors file) of ``rank``'s own state."""
    return f"rank-{rank:05d}.json", f"rank-{rank:05d}.safetensors"


def written_by_a_save(name: str) -> bool:
    """Whether a save (of either layout) writes a file of this name into a checkpoint directory."""
    return name in CHECKPOINT_FILES or SHARD_FILE.fullmatch(name) is not None or RANK_FILE.fullmatch(name) is not None


def dumps(obj: Any) -> bytes:
    """The bytes of every JSON file of a checkpoint (non-finite floats allowed, as Python's json writes them)."""
    return json.dumps(obj, indent=1, allow_nan=True).encode()


def is_count(x: Any) -> bool:
    """Whether ``x`` is a JSON size or count: a non-negative integer, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
