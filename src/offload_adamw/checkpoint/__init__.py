"""Crash-safe, name-verified checkpoints (:mod:`offload_adamw.checkpoint.store`): ``save``, ``load``, ``latest``."""

from offload_adamw.checkpoint.store import (
    AUX_FILE,
    COMMIT_FILE,
    DATA_FILES,
    FORMAT,
    MANIFEST_FILE,
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    LoadReport,
    latest,
    load,
    save,
    verify,
)

__all__ = [
    "AUX_FILE",
    "COMMIT_FILE",
    "DATA_FILES",
    "FORMAT",
    "MANIFEST_FILE",
    "META_FILE",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "LoadReport",
    "latest",
    "load",
    "save",
    "verify",
]
