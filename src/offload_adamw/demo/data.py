"""A byte-level language-modelling corpus built from the Python standard library's own sources.

Contract:

* The text is the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``: present on every
  machine that runs Python, so the demo needs no download.
* Deterministic for a given Python installation and :class:`CorpusConfig`: files are listed in
  sorted order, shuffled with ``seed``, and split by *file* into train and validation (a file is
  never in both, so validation text is unseen text, not a neighbour of a training window).
* Tokens are bytes (vocabulary 256). A batch is ``(inputs, targets)`` of shape
  ``(batch_size, seq_len)`` with ``targets`` the inputs shifted by one byte; window offsets come
  from a ``torch.Generator`` seeded by the caller, so two runs that ask for the same batches get
  identical tensors.
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["VOCAB_SIZE", "CorpusConfig", "ByteCorpus", "load_corpus", "stdlib_source_files"]

#: one token per byte value
VOCAB_SIZE = 256


@dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    """Which bytes of the standard library make up the corpus, and how they are split."""

    max_bytes: int = 4_000_000
    """Stop reading files once this many bytes are collected (keeps start-up under a second)."""
    val_fraction: float = 0.1
    """Share of the collected files (by count) held out for validation."""
    seed: int = 0
    """Seed of the file shuffle that decides which files are read and which are validation."""
    root: str | None = None
    """Directory to read instead of the standard library (tests use a small temporary tree)."""


@dataclass(frozen=True)
class ByteCorpus:
    """Train and validation byte streams, each a 1-D uint8 tensor."""

    train: Tensor
    val: Tensor
    train_files: int
    val_files: int
    root: str

    def batch(self, split: str, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """One batch of random windows from ``split`` ("train" or "val"), as int64 token ids."""
        data = self._split(split)
        if data.numel() < seq_len + 2:
            raise ValueError(f"the {split} split has {data.numel()} bytes, fewer than seq_len + 2 = {seq_len + 2}")
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
        offsets = torch.arange(seq_len + 1)
        windows = data[starts[:, None] + offsets[None, :]].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def batches(self, split: str, count: int, batch_size: int, seq_len: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
        """``count`` batches from ``split``, the same ones for the same ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        for _ in range(count):
            yield self.batch(split, batch_size, seq_len, generator)

    def _split(self, split: str) -> Tensor:
        if split == "train":
            return self.train
        if split == "val":
            return self.val
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")


def stdlib_source_files(root: str | None = None) -> list[Path]:
    """The ``.py`` files of the standard library (or of ``root``), sorted, without site-packages."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = []
    for path in base.rglob("*.py"):
        parts = path.relative_to(base).parts
        # Third-party packages installed into the interpreter are not the standard library.
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        if path.is_file():
            files.append(path)
    return sorted(files)


def load_corpus(config: CorpusConfig = CorpusConfig()) -> ByteCorpus:
    """Read, shuffle and split the sources into a :class:`ByteCorpus`."""
    files = stdlib_source_files(config.root)
    if len(files) < 2:
        raise FileNotFoundError(f"need at least two .py files under {config.root or sysconfig.get_paths()['stdlib']}")
    random.Random(config.seed).shuffle(files)
    chunks: list[bytes] = []
    total = 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue  # an unreadable file (permissions, broken link) is simply not part of the corpus
        if not data:
            continue
        chunks.append(data)
        total += len(data)
        if total >= config.max_bytes:
            break
    if len(chunks) < 2:
        raise FileNotFoundError("fewer than two readable, non-empty source files")
    n_val = max(1, round(len(chunks) * config.val_fraction))
    val_chunks, train_chunks = chunks[:n_val], chunks[n_val:]
    return ByteCorpus(
        train=torch.frombuffer(bytearray(b"\n".join(train_chunks)), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(b"\n".join(val_chunks)), dtype=torch.uint8),
        train_files=len(train_chunks),
        val_files=len(val_chunks),
        root=str(config.root or sysconfig.get_paths()["stdlib"]),
    )
