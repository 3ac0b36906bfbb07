"""Hydra launcher plugin of the grpo project (`hydra/launcher=grpo_parallel`): a sweep's jobs several at once on one
host, each worker on a GPU group of its own (docs/sweeps.md)."""
