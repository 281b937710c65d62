"""OffloadAdamW: parameter groups, state placement, the one update path, loading, the pre-flight."""

from offload_adamw.optim.loading import StateDictMismatch
from offload_adamw.optim.named_groups import ParamGroupError, Rule, named_param_groups
from offload_adamw.optim.optimizer import OffloadAdamW
from offload_adamw.optim.preflight import HostMemoryError

__all__ = ["HostMemoryError", "OffloadAdamW", "ParamGroupError", "Rule", "StateDictMismatch", "named_param_groups"]
