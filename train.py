"""`python train.py [overrides]` from the checkout: the same command as `grpo-train` (grpo/command.py, then
grpo/train.py; its configs are conf/ and experiments/). Usage and examples: `python train.py --help`, docs/running.md."""

from grpo.command import run

if __name__ == "__main__":
    run()
