"""What an out-of-memory error in an update tells the user: the micro-batch that ran out (as its forward runs it),
the device's free memory, and the settings that lower the peak."""

from __future__ import annotations

import torch

from grpo.trainer.minibatch import forward_tokens
from grpo.trainer.train_batch import PreparedBatch


class TrainerOutOfMemoryError(RuntimeError):
    """A micro-batch's forward/backward ran out of device memory; the message names the knobs that lower the peak."""


def out_of_memory_advice(batch: PreparedBatch, step: int, device: torch.device, padding_free: bool = False,
                         shared: bool = False) -> str:
    """What ran out of memory (the update's largest micro-batch as its forward runs it, the device's free memory)
    and what to change."""
    shapes = [(mb.num_sequences, *forward_tokens(mb, padding_free, shared)) for mb in batch.micro_batches]
    sequences, rows, width = max(shapes, key=lambda s: s[1] * s[2])
    layout = ("packed into one row" if padding_free and not shared else
              f"as {rows} shared-prompt rows x {width} tokens" if shared else f"x {width} tokens, padded")
    free = ""
    if device.type == "cuda":
        free_b, total_b = torch.cuda.mem_get_info(device)
        free = f"; {free_b / 2**30:.1f} of the GPU's {total_b / 2**30:.1f} GiB are free now"
    return (
        f"step {step}: out of device memory in the forward/backward of a micro-batch of {rows * width} tokens "
        f"({sequences} sequences {layout}){free}. Lower the peak with a smaller train.micro_batch_size (a larger "
        "train.grad_accum keeps the batch) or train.max_tokens_per_micro_batch budget, "
        "model.gradient_checkpointing=true, or, when vLLM shares this GPU, a smaller server.gpu_memory_utilization"
    )
