"""Schemas of the data and eval groups: where rollouts come from, and the held-out evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class AtroposDataConfig:
    """data=atropos: batches from an Atropos run-api."""

    _target_: str = "grpo.pipeline.atropos.AtroposPipeline"
    # Base URL of the run-api server.
    url: str = "http://127.0.0.1:8000"
    # W&B group sent at /register.
    wandb_group: str = "grpo"
    # W&B project sent at /register.
    wandb_project: str = "grpo"
    # Seconds between /batch polls while the queue is short (doubles up to 8x on empty answers).
    poll_interval_s: float = 0.5
    # Give up with an error after this long without a batch.
    max_wait_s: float = 600.0
    # Retries of a failed request (connection error, 5xx, malformed JSON) before a clear error.
    max_retries: int = 5
    # Seconds one HTTP request to run-api may take before it counts as failed (and is retried).
    request_timeout_s: float = 60.0


@dataclass
class LocalDataConfig:
    """data=local: built-in rollouts through the inference server."""

    _target_: str = "grpo.pipeline.local.LocalRolloutPipeline"
    task: Any = MISSING
    # Reward functions by name; each has a _target_ (a class, or a function with _partial_: true) and a weight. Add
    # yours: +data.rewards.mine._target_=my_module.my_reward +data.rewards.mine._partial_=true
    rewards: dict[str, Any] = field(default_factory=dict)
    # Prompts sampled per optimizer step.
    prompts_per_step: int = 8
    # Completions per prompt (the GRPO group).
    group_size: int = 8
    # Completion length cap in tokens.
    max_new_tokens: int = 16
    # vLLM's min_tokens: EOS and stop tokens are suppressed until a completion has this many (0 = off). Forces long
    # completions (a benchmark's workload); completions of a trained model end where they would not otherwise.
    min_new_tokens: int = 0
    # Sampling temperature of the rollouts (also used by the trainer's log-probs).
    temperature: float = 1.0
    # Nucleus sampling threshold.
    top_p: float = 1.0
    # Seed each request (a re-run of the saved config draws the same rollouts). vLLM samples seeded requests one at a
    # time, which slows generation (more on a GPU host than on CPU: bench/); false samples from the engine's own stream.
    seeded_sampling: bool = True
    # Ask vLLM for each sampled token's log-prob: the PPO ratio's pi_old (loss.old_logprobs=rollout), TIS weights
    # (loss.tis_cap) and grpo/logprob_diff, the trainer-vs-sampler drift. false: every rollout trains as on-policy
    # (pi_old = the trainer's own detached log-probs, as TRL does without vLLM's importance correction), which is exact
    # only when each batch gets one update from the weights that sampled it (checked at start-up); vLLM then skips that
    # work on every decode step (bench/README.md, "Rollouts without log-probs").
    rollout_logprobs: bool = True
    # DAPO's dynamic sampling: groups whose rewards all agree (advantage 0 everywhere) are dropped and further rounds of
    # fresh prompts refill the rollout batch to prompts_per_step informative groups (data/refill_rounds,
    # data/groups_generated_per_kept). Local pipelines only; docs/algorithms.md.
    dynamic_sampling: bool = False
    # Extra generation rounds per rollout batch at most; a batch still short then trains on the informative groups it
    # has (data/refill_short_groups counts the missing ones). 0 = drop the zero-variance groups, never refill.
    max_refill_rounds: int = 3
    # Processes that grade the completions (grpo.pipeline.grading), the evaluation's too: each distinct completion of a
    # rollout batch graded once, off the thread that generates. 0 = grade in the trainer process; a math-verify reward
    # on a many-core GPU host wants a few (bench/README.md, "Reward grading in worker processes").
    reward_workers: int = 0


@dataclass
class MultiTurnDataConfig(LocalDataConfig):
    """data=calculator: built-in multi-turn rollouts (grpo.pipeline.multi_turn); `max_new_tokens` caps each model
    turn."""

    _target_: str = "grpo.pipeline.multi_turn.MultiTurnPipeline"
    # Model turns per episode.
    max_turns: int = 4
    # Tokens of a whole episode (prompt + model + environment tokens); null = model.max_seq_len. A turn cut by it, or a
    # tool answer that leaves no room for another model token, ends the episode (the last turn's text is scored).
    max_episode_tokens: Optional[int] = None
    # Discount per model turn of the episode's rewards: sum over turns k of discount**k * (the environment's reward for
    # turn k, plus the answer's reward at the last turn); 1.0 = the plain sum (the calculator gives no per-turn reward).
    turn_reward_discount: float = 1.0


@dataclass
class AgentDataConfig(LocalDataConfig):
    """data=agent_calculator: an agent written against the OpenAI API, trained through the recording endpoint
    (grpo.pipeline.agents); `max_new_tokens` caps each request's completion."""

    _target_: str = "grpo.pipeline.agents.AgentPipeline"
    # The agent: an `async def rollout(client, item)` as package.module:function.
    rollout: str = MISSING
    # Chat template the endpoint renders requests with: null = the tokenizer's own, a built-in name (chatml_tools) or
    # a Jinja file.
    chat_template: Optional[str] = None
    # Tool-call parser: json_tags (<tool_call>{"name": ..., "arguments": {...}}</tool_call>) or a vLLM tool parser's
    # name (e.g. hermes, for a model trained on its format).
    tool_parser: str = "json_tags"
    # Requests one episode may send; a later one is refused (the agent sees an HTTP 400).
    max_requests: int = 8
    # Tokens of one sample (prompt, sampled and tool tokens); null = model.max_seq_len.
    max_episode_tokens: Optional[int] = None
    # Seconds an episode's rollout may run; then it is cancelled and scores 0 (agent/rollout_errors).
    episode_timeout_s: float = 300.0


# ---------------------------------------------------------------- evaluation (conf/eval/)
@dataclass
class EvalConfig:
    """Held-out evaluation inside the run; see grpo.pipeline.evaluation.Evaluator."""

    _target_: str = "grpo.pipeline.evaluation.Evaluator"
    # true | false | null (on when there is a task to evaluate: the local data's own task or eval.task; off for
    # data=atropos).
    enabled: Optional[bool] = None
    # Task whose eval_prompts() are evaluated (a _target_ node like data.task); null = the training task (data.task).
    task: Any = None
    # Reward functions by name, like data.rewards; null = the training data's rewards.
    rewards: Any = None
    # Reward that decides whether a completion is correct; null = the first of the rewards.
    correct_reward: Optional[str] = None
    # A completion is correct when that reward is >= this value.
    correct_threshold: float = 1.0
    # Evaluate before the first optimizer step (a metrics row with step 0).
    before_train: bool = True
    # Evaluate after every N optimizer steps (it samples the weights synced at the end of that step); 0 = never between.
    # Rounded up to a multiple of the updates per rollout batch (train.ppo_epochs x train.mini_batches), said in the
    # log.
    every: int = 10
    # Evaluate after the last step.
    at_end: bool = True
    # The k of pass@k and mean@k.
    k: int = 4
    # Samples per prompt at eval.temperature for the unbiased pass@k estimator (n >= k).
    samples_per_prompt: int = 8
    # Which evaluations sample those (pass@k, mean@k): the steps that are multiples of N, and always step 0's and the
    # last step's; 0 = those two only; null = every evaluation. The others generate the greedy completions alone
    # (accuracy, reward, lengths): a fraction of the samples' time, which under mode=shared_vllm the run waits for
    # before each optimizer step.
    sampled_every: Optional[int] = None
    # Sampling temperature of the pass@k samples (accuracy is always greedy).
    temperature: float = 1.0
    # Nucleus sampling threshold of every eval request.
    top_p: float = 1.0
    # Completion length cap in tokens; null = data.max_new_tokens.
    max_new_tokens: Optional[int] = None
    # Base seed of the eval samples (its own: eval never draws from a training random stream).
    seed: int = 1234
    # Eval requests in flight at once (the whole eval set is sent at once through this many connections).
    max_concurrency: int = 16
    # Greedy completions of the first N eval prompts appended to <run_dir>/eval_samples.jsonl per evaluation.
    samples_logged: int = 4
    # Evaluate beside training: the eval's requests go to the server right after the sync of the step they belong to,
    # and the run waits for them only before the served weights next change (grading, pass@k and the row go on in the
    # background; the final eval completes before the run ends). false: the run waits for each whole evaluation.
    background: bool = True
    # vLLM scheduling priority of the eval's requests (the rollouts' is 0; larger = admitted later): with
    # server.scheduling_policy=priority an evaluation beside training yields the engine to the rollouts. 0 = none sent.
    priority: int = 1
    # The most eval sequences (prompts x n) in flight at once per server; null = no bound but eval.max_concurrency.
    max_in_flight: Optional[int] = None
