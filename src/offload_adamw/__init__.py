"""offload-adamw: AdamW with float32 state in host memory that provably computes AdamW."""

from ._version import __version__
from .optimizer import OffloadAdamW, StateDictMismatch
from .planner import HardwareConfig, ModelConfig, TrainingConfig, plan, predict_host_optimizer_bytes
from .param_groups import ParamGroupError, Rule, param_groups
from .audit import AuditReport, Finding, audit, audit_state_dict
from .offload import OffloadGradScaler
from .clipping import clip_grad_norm_
from .conformance import CandidateLoadError, check as check_conformance
from .checkpoint import CheckpointCorrupt, CheckpointError, CheckpointMismatch, LoadReport
from .preflight import HostMemoryError
from .bandwidth import measure_host_bandwidth
from .kernel_compiled import compiled_kernel_status

__all__ = [
    "__version__",
    "OffloadAdamW",
    "StateDictMismatch",
    "plan",
    "predict_host_optimizer_bytes",
    "ModelConfig",
    "HardwareConfig",
    "TrainingConfig",
    "param_groups",
    "Rule",
    "ParamGroupError",
    "audit",
    "audit_state_dict",
    "AuditReport",
    "Finding",
    "OffloadGradScaler",
    "clip_grad_norm_",
    "check_conformance",
    "CandidateLoadError",
    "CheckpointError",
    "CheckpointCorrupt",
    "CheckpointMismatch",
    "LoadReport",
    "HostMemoryError",
    "measure_host_bandwidth",
    "compiled_kernel_status",
]
