"""DTensor (FSDP2) shards and torch.distributed.checkpoint support for OffloadAdamW."""

from offload_adamw.distributed.dtensor import (
    any_rank,
    as_dtensor_like,
    inside_dcp_state_init,
    is_dtensor,
    local_grad,
    local_shard_of,
    local_tensor,
    wrap_state_dict_post_hook,
)

__all__ = [
    "any_rank",
    "as_dtensor_like",
    "inside_dcp_state_init",
    "is_dtensor",
    "local_grad",
    "local_shard_of",
    "local_tensor",
    "wrap_state_dict_post_hook",
]
