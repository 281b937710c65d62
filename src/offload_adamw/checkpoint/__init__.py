"""Crash-safe, name-verified checkpoints (:mod:`offload_adamw.checkpoint.store`): ``save``, ``load``, ``latest``, ``resolve``;
one format (layout 2, on torch.distributed.checkpoint) for one process, DDP and FSDP2."""

from offload_adamw.checkpoint.store import (
    COMMIT_FILE,
    ENV_EXCHANGE,
    FORMAT,
    MANIFEST_FILE,
    META_FILE,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    LoadReport,
    latest,
    load,
    resolve,
    save,
    verify,
)

__all__ = [
    "COMMIT_FILE",
    "ENV_EXCHANGE",
    "FORMAT",
    "MANIFEST_FILE",
    "META_FILE",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "LoadReport",
    "latest",
    "load",
    "resolve",
    "save",
    "verify",
]
