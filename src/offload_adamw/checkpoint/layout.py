"""What a checkpoint directory holds: its format tag and version, its file names, its JSON encoding.

Shared by the codec, the atomic publication and the store; imports nothing of the package and no torch.
"""

from __future__ import annotations

import json
from typing import Any

FORMAT = "offload-adamw-checkpoint"
VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
AUX_FILE = "aux.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
COMMIT_FILE = "COMMIT"
DATA_FILES = (MODEL_FILE, OPTIMIZER_FILE, AUX_FILE, META_FILE)
CHECKPOINT_FILES = frozenset({*DATA_FILES, MANIFEST_FILE, COMMIT_FILE})
"""Every file a save writes into a checkpoint directory, and nothing else."""


def dumps(obj: Any) -> bytes:
    """The bytes of every JSON file of a checkpoint (non-finite floats allowed, as Python's json writes them)."""
    return json.dumps(obj, indent=1, allow_nan=True).encode()


def is_count(x: Any) -> bool:
    """Whether ``x`` is a JSON size or count: a non-negative integer, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
