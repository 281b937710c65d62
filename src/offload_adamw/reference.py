"""The public path of the contract's reference: :mod:`offload_adamw.contract.reference`, re-exported."""

from offload_adamw.contract.reference import *  # noqa: F403
from offload_adamw.contract.reference import __all__  # noqa: F401
