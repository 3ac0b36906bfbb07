"""Hydra plugin of the grpo project: the committed experiments (experiments/ at the checkout's root, grpo/experiments/
in a wheel) composed as the config group `experiment` of the shipped config tree."""
