"""offload-adamw: AdamW with float32 state in host memory that provably computes AdamW.

This module only re-exports. Names are resolved on first use (PEP 562), so that
``import offload_adamw`` and ``offload-adamw --help`` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from offload_adamw._version import __version__

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "OffloadAdamW": "offload_adamw.optim.optimizer",
    "StateDictMismatch": "offload_adamw.optim.loading",
    "HostMemoryError": "offload_adamw.optim.preflight",
    "named_param_groups": "offload_adamw.optim.named_groups",
    "param_groups": "offload_adamw.optim.named_groups",
    "Rule": "offload_adamw.optim.named_groups",
    "ParamGroupError": "offload_adamw.optim.named_groups",
    "OffloadGradScaler": "offload_adamw.accel.amp",
    "clip_grad_norm_": "offload_adamw.optim.policy",
    "HostResidentGradient": "offload_adamw.accel.freed",
    "is_host_resident": "offload_adamw.accel.freed",
    "numba_kernel_status": "offload_adamw.kernels.numba_loop",
    "compiled_kernel_status": "offload_adamw.kernels.numba_loop",
    "plan": "offload_adamw.planning.planner",
    "predict_host_optimizer_bytes": "offload_adamw.planning.planner",
    "ModelConfig": "offload_adamw.planning.models",
    "HardwareConfig": "offload_adamw.planning.planner",
    "TrainingConfig": "offload_adamw.planning.planner",
    "measure_host_bandwidth": "offload_adamw.benchmarking.bandwidth",
    "audit": "offload_adamw.auditing.audit",
    "audit_state_dict": "offload_adamw.auditing.audit",
    "AuditReport": "offload_adamw.auditing.audit",
    "AuditFinding": "offload_adamw.auditing.audit",
    "Finding": "offload_adamw.auditing.audit",
    "check_conformance": "offload_adamw.conformance.checker",
    "CandidateLoadError": "offload_adamw.conformance.checker",
    "CheckpointError": "offload_adamw.checkpoint.store",
    "CheckpointCorrupt": "offload_adamw.checkpoint.store",
    "CheckpointMismatch": "offload_adamw.checkpoint.store",
    "LoadReport": "offload_adamw.checkpoint.store",
    "trainer_optimizer": "offload_adamw.integrations.hf",
}
# attribute name in the defining module, where it differs from the public name
_RENAMED = {"check_conformance": "check", "Finding": "AuditFinding", "param_groups": "named_param_groups"}
# subpackages reachable as attributes (offload_adamw.checkpoint.save, ...)
_SUBMODULES = ("checkpoint", "conformance", "reference", "contract", "kernels", "optim", "accel", "distributed",
               "benchmarking", "planning", "auditing", "integrations", "demo", "cli")

__all__ = ["__version__", *_EXPORTS]  # noqa: PLE0604 - the names are the keys of _EXPORTS, all strings


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), _RENAMED.get(name, name))
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"offload_adamw.{name}")
    raise AttributeError(f"module 'offload_adamw' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, *_SUBMODULES])


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    # re-exports: __all__ (built from _EXPORTS) lists them, which ruff cannot see, hence the F401 noqa
    from offload_adamw.accel.amp import OffloadGradScaler  # noqa: F401
    from offload_adamw.accel.freed import HostResidentGradient, is_host_resident  # noqa: F401
    from offload_adamw.auditing.audit import AuditFinding, AuditReport, audit, audit_state_dict  # noqa: F401
    from offload_adamw.auditing.audit import AuditFinding as Finding  # noqa: F401
    from offload_adamw.benchmarking.bandwidth import measure_host_bandwidth  # noqa: F401
    from offload_adamw.checkpoint.store import CheckpointCorrupt, CheckpointError, CheckpointMismatch, LoadReport  # noqa: F401
    from offload_adamw.conformance.checker import CandidateLoadError  # noqa: F401
    from offload_adamw.conformance.checker import check as check_conformance  # noqa: F401
    from offload_adamw.integrations.hf import trainer_optimizer  # noqa: F401
    from offload_adamw.kernels.numba_loop import compiled_kernel_status, numba_kernel_status  # noqa: F401
    from offload_adamw.optim.loading import StateDictMismatch  # noqa: F401
    from offload_adamw.optim.named_groups import ParamGroupError, Rule, named_param_groups  # noqa: F401
    from offload_adamw.optim.named_groups import named_param_groups as param_groups  # noqa: F401
    from offload_adamw.optim.optimizer import OffloadAdamW  # noqa: F401
    from offload_adamw.optim.policy import clip_grad_norm_  # noqa: F401
    from offload_adamw.optim.preflight import HostMemoryError  # noqa: F401
    from offload_adamw.planning.models import ModelConfig  # noqa: F401
    from offload_adamw.planning.planner import (  # noqa: F401
        HardwareConfig,
        TrainingConfig,
        plan,
        predict_host_optimizer_bytes,
    )
