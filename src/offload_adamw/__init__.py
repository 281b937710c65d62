"""offload-adamw: AdamW with float32 state in host memory that provably computes AdamW."""

from ._version import __version__
from .optimizer import OffloadAdamW, StateDictMismatch

__all__ = ["__version__", "OffloadAdamW", "StateDictMismatch"]
