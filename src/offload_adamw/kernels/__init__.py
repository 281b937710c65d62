"""The update math over host tensors (docs/contract.md#one-update, #precision-and-placement):
pure functions, no state of their own.
"""

from offload_adamw.kernels.adamw import IMPLEMENTATIONS, StepHyper, adamw_update_

__all__ = ["IMPLEMENTATIONS", "StepHyper", "adamw_update_"]
