"""Between an accelerator and the host: the transfer pipeline, pinned host memory, loss scaling."""

from offload_adamw.accel.amp import OffloadGradScaler
from offload_adamw.accel.host_memory import HostArena
from offload_adamw.accel.pipeline import GradientPipeline, PipelineConfig, Wiring

__all__ = ["GradientPipeline", "HostArena", "OffloadGradScaler", "PipelineConfig", "Wiring"]
