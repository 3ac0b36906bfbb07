"""`grpo-train`: the Hydra app of train.py as a console script, runnable from any directory.

    grpo-train                                                  # the default job, run dir under ./outputs
    grpo-train --config-dir ./my_conf experiment=my_task        # your own configs beside the shipped ones
    grpo-train --cfg job mode=lora_only                         # print the composed config

The package ships the app and its configs: `grpo/train.py` and `grpo/conf/` are the checkout's `train.py` and
`conf/` (symlinks in the source tree, copied into wheels), so an installed trainer composes exactly the configs
`python train.py` does, wherever it runs. `--config-dir` adds a directory searched before the shipped one.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    """Run train.py's Hydra app with the current directory importable (for `_target_`s in your own modules)."""
    # A console script's sys.path starts at its bin dir; `python train.py` and `python -m` start at the script's
    # or the current directory. Put the current directory first so `_target_: my_rewards.fn` works as documented.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from grpo.train import run

    run()


if __name__ == "__main__":
    main()
