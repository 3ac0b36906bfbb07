"""Train with an advantage estimator of your own: register it, then run the trainer's entry point.

    python examples/own_estimator/train_with_my_estimator.py train.advantage_norm=best_gets_one

The registration must come before anything imports the config schema (`grpo.train` does), because the schema's
`train.advantage_norm` choices are the estimators registered at that moment; any other override of
`python train.py` works here too.
"""

import torch

from grpo.algorithms.advantages import ADVANTAGE_ESTIMATORS


@ADVANTAGE_ESTIMATORS.register("best_gets_one")
def best_gets_one(scores: torch.Tensor, batch_scores: torch.Tensor) -> torch.Tensor:
    """1 for the group's best-scoring samples, 0 for the rest (a toy: no baseline below the best)."""
    return (scores == scores.max()).to(scores.dtype)


if __name__ == "__main__":
    from grpo.train import run

    run()
