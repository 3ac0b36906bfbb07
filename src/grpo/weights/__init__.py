"""Weights on disk and in memory, below both the trainer and the sync strategies.

- `grpo.weights.hf_dir`: Hugging Face weight directories written atomically (what checkpoints and every file-based
  sync mode publish) and read back.
- `grpo.weights.params`: full parameters of a possibly FSDP2-sharded model (detection, gathers).
"""
