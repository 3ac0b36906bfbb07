"""The sync strategy of torchrun ranks > 0 (FSDP2): no server of their own; each weight sync is their share of
the gathers rank 0's strategy performs (`SyncStrategy.fsdp_gather`), run in the same order."""

from __future__ import annotations

from typing import Literal

import torch.nn as nn

from grpo.sync.base import SyncStrategy
from grpo.weights.params import drain_full_params, full_state_dict, full_trainable_params


class FollowerSync(SyncStrategy):
    """Ranks > 0: joins the full-weight gathers of rank 0's sync and keeps nothing; it serves nothing (no
    `server_launch`: rank 0's server is the run's).

    `gather` is rank 0's strategy's `fsdp_gather`: "params" (mode=broadcast: `iter_full_params`), "state_dict"
    (mode=none: `full_state_dict`) or "adapter" (the LoRA modes: `full_trainable_params`, the adapter alone)."""

    mode_name = "follower"

    def __init__(self, sync_every: int = 1, gather: Literal["params", "state_dict", "adapter"] = "params",
                 uses_lora: bool = False) -> None:
        super().__init__(sync_every)
        # Rank 0's mode trains a LoRA adapter: this rank's model must be built the same way (its shards and
        # collectives match rank 0's), and so must the KL reference (the adapter switched off).
        self.uses_lora = uses_lora
        if gather not in ("params", "state_dict", "adapter"):
            raise ValueError(f"gather must be 'params', 'state_dict' or 'adapter', got {gather!r}")
        self.gather = gather

    def sync(self, model: nn.Module, step: int) -> dict[str, float]:
        if self.gather == "state_dict":
            full_state_dict(model)  # empty here; rank 0 gets the tensors
        elif self.gather == "adapter":
            full_trainable_params(model)  # empty here; rank 0 gets the adapter
        else:
            drain_full_params(model)
        self.version += 1
        return {"sync/seconds": 0.0, "sync/version": float(self.version)}
