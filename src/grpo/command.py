"""The `grpo-train` command and `python train.py`: first the command's preloaded vLLM server process starts
(grpo.inference.preload: vLLM's imports run beside the trainer's own), then the trainer's entry, `grpo.train.run`.

Importing this module starts the command's preload: only the entry points import it (`grpo.train` is the module to
import from your own code).
"""

import sys

from grpo.inference import preload

preload.start(sys.argv[1:])

from grpo.train import run  # noqa: E402 - after the preload's start: the trainer's imports (torch) run beside it

__all__ = ["run"]
