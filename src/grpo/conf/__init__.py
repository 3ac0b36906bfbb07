"""The shipped config tree: train.yaml (Hydra's primary config) and its groups, experiment/ among them. A package,
so that Hydra finds it inside an installed wheel (pkg://grpo.conf) as in the checkout: grpo-train and
`python train.py` compose these very files."""

from pathlib import Path

# Where the shipped configs lie (for the checks that read them before Hydra composes, and for compose() callers).
CONFIG_DIR = Path(__file__).resolve().parent
