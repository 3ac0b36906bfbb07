"""The tasks, environments and rewards a run trains on (conf/data/ `task:`, `rewards:`): what a user reads and copies
to write their own. The rollout machinery that drives them is grpo.pipeline."""
