"""Model FLOPs of a training update and the device's peak, for `perf/tflops` and `perf/mfu` (pure: no torch).

Per update, summed over its sequences (T = a sequence's length in forward tokens, padding excluded):

    dense      6 * N_body * T                          forward 2, backward 4 FLOPs per weight and token
    attention  12 * layers * (heads * head_dim) * T^2   QK^T and AV: 2 matmuls x 2 FLOPs x T keys per token, x3 for
                                                        backward (PaLM's convention: the causal half is not discounted)
    head       6 * hidden * vocab * loss tokens         the output projection runs only where a label carries loss
    recompute  + 2 * N_body * T + 4 * layers * (heads * head_dim) * T^2   with activation checkpointing (the
                                                        decoder's forward runs again in backward)

N_body are the decoder blocks' matmul weights per token, from the model config (q, k, v, o and a gated MLP);
embeddings are a lookup, not FLOPs. Frozen weights (layer selection, LoRA) are counted as if trained, the usual MFU
convention, so figures compare across modes and frameworks. `perf/mfu` is the achieved rate over the device's dense
peak for the training dtype (`peak_tflops`); null where the peak is unknown (CPU, unlisted GPUs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

# Dense (no sparsity) peak TFLOPS per GPU: (bf16/fp16 tensor cores, fp32 without TF32), from NVIDIA's data sheets.
# Matched as substrings of torch.cuda.get_device_name(), in this order (the H100 variants before plain "H100").
PEAK_TFLOPS: tuple[tuple[str, tuple[float, float]], ...] = (
    ("H200", (989.0, 67.0)),
    ("H100 NVL", (835.0, 60.0)),
    ("H100 PCIe", (756.0, 51.0)),
    ("H100", (989.0, 67.0)),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100", (312.0, 19.5)),
)


def peak_tflops(device_name: Optional[str], half_precision: bool) -> Optional[float]:
    """Dense peak TFLOPS of a GPU named `device_name` (bf16/fp16 when `half_precision`, else fp32); None for a CPU
    (`device_name` None) or a GPU not in `PEAK_TFLOPS`."""
    if device_name is None:
        return None
    for key, (half, single) in PEAK_TFLOPS:
        if key in device_name:
            return half if half_precision else single
    return None


@dataclass(frozen=True)
class ModelFlops:
    """What the FLOP count needs of a decoder-only transformer (Llama / Qwen2 / Qwen3 shapes)."""

    body_params: int
    head_params: int
    layers: int
    attn_width: int

    @classmethod
    def from_config(cls, config: Any) -> "ModelFlops":
        """From a transformers config (its text config for multimodal ones)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        attn = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
        mlp = 3 * hidden * int(config.intermediate_size)  # gate, up, down
        return cls(body_params=layers * (attn + mlp), head_params=hidden * int(config.vocab_size), layers=layers,
                   attn_width=heads * head_dim)

    def train_flops(self, lengths: Sequence[int], loss_tokens: int, recompute: bool = False) -> float:
        """FLOPs of one forward + backward over sequences of `lengths` tokens with `loss_tokens` trained tokens."""
        tokens = sum(lengths)
        squares = sum(t * t for t in lengths)
        dense, attention = 2.0 * self.body_params * tokens, 4.0 * self.layers * self.attn_width * squares
        total = 3.0 * (dense + attention) + 6.0 * self.head_params * loss_tokens
        return total + (dense + attention if recompute else 0.0)


def perf_metrics(flops: float, seconds: float, peak: Optional[float]) -> dict[str, float]:
    """`perf/tflops` (achieved, per device) and `perf/mfu` (over `peak` TFLOPS; NaN, null in metrics.jsonl, when the
    peak is unknown: CPU)."""
    tflops = flops / max(seconds, 1e-9) / 1e12
    return {"perf/tflops": tflops, "perf/mfu": tflops / peak if peak else math.nan}


def pad_fraction(lengths_per_micro_batch: Sequence[Sequence[int]], packed: bool) -> float:
    """Share of the forward passes' tokens that are padding: each micro-batch runs `rows x longest` tokens padded,
    the sum of its lengths packed (0 then)."""
    real = sum(sum(lens) for lens in lengths_per_micro_batch)
    run = real if packed else sum(len(lens) * max(lens, default=0) for lens in lengths_per_micro_batch)
    return 1.0 - real / run if run else 0.0
