"""The memory bill of OffloadAdamW's state (docs/contract.md#memory-bill): the one count of its bytes.

Per parameter tensor of ``n`` elements the state is a float32 step count (4 bytes), ``exp_avg`` and
``exp_avg_sq`` (and ``max_exp_avg_sq`` with AMSGrad) of ``n`` elements each, and a master copy of ``n``
elements unless the parameter is its own master. The state's elements are float64 for float64
parameters (complex64/complex128 for complex ones, as torch keeps them) and float32 for every other
dtype. A parameter is its own master when it is a float32, float64 (or complex) tensor in host memory:
the update then writes into it directly.

The optimizer's pre-flight, the planner and the demo all count with :func:`tensor_state_bytes`; a
test compares it with what OffloadAdamW actually allocates. No torch here: dtypes are names.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STEP_COUNT_BYTES", "StateBytes", "is_own_master", "state_dtype_name", "tensor_state_bytes"]

#: bytes of one tensor's ``step``: a float32 0-dim tensor, an exact count below 2**24.
STEP_COUNT_BYTES = 4

#: parameter dtypes whose state keeps their dtype (each its own master in host memory); every other one has float32 state.
#: A complex parameter's state is complex, as torch's: its update runs on the real views (two elements per number).
_WIDE = ("float32", "float64", "complex64", "complex128")
#: bytes of one state element by state dtype
_ELEMENT_BYTES = {"float32": 4, "float64": 8, "complex64": 8, "complex128": 16}


def state_dtype_name(param_dtype: str) -> str:
    """The dtype of the moments and the master of a parameter of dtype ``param_dtype`` (a canonical name)."""
    return param_dtype if param_dtype in _WIDE else "float32"


def is_own_master(param_dtype: str, *, on_host: bool) -> bool:
    """Whether the parameter itself is the master: a float32, float64 (or complex64/128) tensor in host memory."""
    return on_host and param_dtype in _WIDE


@dataclass(frozen=True)
class StateBytes:
    """The state bytes of one tensor (or of several, added with ``+``), by item."""

    moments: int = 0
    """exp_avg, exp_avg_sq and, with AMSGrad, max_exp_avg_sq."""
    master: int = 0
    """The master copy (0 for a parameter that is its own master)."""
    step: int = 0
    """The step counts."""

    @property
    def total(self) -> int:
        return self.moments + self.master + self.step

    def __add__(self, other: StateBytes) -> StateBytes:
        return StateBytes(self.moments + other.moments, self.master + other.master, self.step + other.step)


def tensor_state_bytes(numel: int, param_dtype: str, *, on_host: bool, amsgrad: bool) -> StateBytes:
    """The state bytes OffloadAdamW allocates for one parameter tensor of ``numel`` elements."""
    one = numel * _ELEMENT_BYTES[state_dtype_name(param_dtype)]
    moments = one * (3 if amsgrad else 2)
    master = 0 if is_own_master(param_dtype, on_host=on_host) else one
    return StateBytes(moments=moments, master=master, step=STEP_COUNT_BYTES)
