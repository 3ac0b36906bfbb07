"""Training algorithms as small functions on tensors, each kind behind a registry of names.

- `advantages`: group scores → advantages (`train.advantage_norm`), and the advantage stage the batcher calls.
- `policy`: the policy-gradient objectives per token (`loss.objective`: PPO's clip, GSPO, CISPO), and the choice of
  pi_old.
- `kl`: per-token KL estimators (`loss.kl_estimator`).
- `aggregation`: per-token losses → one number (`loss.aggregation`).
- `schedules`: learning-rate multipliers after warm-up (`train.lr_schedule`).
- `overlong`: truncated completions masked out of the loss, DAPO's soft overlong penalty (`loss.mask_truncated`,
  `loss.overlong_buffer`).
- `entropy_control`: the entropy bonus's coefficient steered towards a target entropy (`loss.entropy_target`).

Each registry's names are the only definition of its choice set: the typed config builds its enum from them, the
components look the function up by the same name. A function registered under a new name before the config schema
is imported (`grpo.schema`) becomes a choice of its config key. This package imports nothing of grpo but its
registry, so every layer may use it.
"""
