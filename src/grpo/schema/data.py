"""Schemas of the data and eval groups: where rollouts come from, and the held-out evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class AtroposDataConfig:
    """data=atropos: batches from an Atropos run-api."""

    _target_: str = "grpo.pipeline.atropos.AtroposPipeline"
    url: str = "http://127.0.0.1:8000"
    wandb_group: str = "grpo"
    wandb_project: str = "grpo"
    poll_interval_s: float = 0.5
    max_wait_s: float = 600.0
    max_retries: int = 5
    # Seconds one HTTP request to run-api may take before it counts as failed (and is retried).
    request_timeout_s: float = 60.0


@dataclass
class LocalDataConfig:
    """data=local: built-in rollouts through the inference server."""

    _target_: str = "grpo.pipeline.local.LocalRolloutPipeline"
    task: Any = MISSING
    rewards: dict[str, Any] = field(default_factory=dict)
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 16
    # vLLM's min_tokens: EOS and stop tokens are suppressed until a completion has this many (0 = off). Forces long
    # completions (a benchmark's workload); completions of a trained model end where they would not otherwise.
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    # Per-request sampling seeds (a re-run draws the same rollouts); false samples from the engine's own stream.
    seeded_sampling: bool = True
    # vLLM's log-prob of each sampled token (pi_old with loss.old_logprobs=rollout, TIS, grpo/logprob_diff); false
    # trains the rollouts as on-policy (pi_old = the trainer's own log-probs), for one update per synced batch.
    rollout_logprobs: bool = True
    # DAPO's dynamic sampling: drop groups whose rewards all agree and refill the batch with fresh prompts
    # (grpo.pipeline.dynamic_sampling); max_refill_rounds bounds the extra generation rounds per rollout batch.
    dynamic_sampling: bool = False
    max_refill_rounds: int = 3
    # Worker processes that grade the completions (grpo.pipeline.grading), the evaluation's too; 0 = in the trainer
    # process.
    reward_workers: int = 0


@dataclass
class MultiTurnDataConfig(LocalDataConfig):
    """data=calculator: built-in multi-turn rollouts (grpo.pipeline.multi_turn); `max_new_tokens` caps each model
    turn."""

    _target_: str = "grpo.pipeline.multi_turn.MultiTurnPipeline"
    # Model turns per episode.
    max_turns: int = 4
    # Tokens of a whole episode (prompt, model and environment tokens); null = model.max_seq_len.
    max_episode_tokens: Optional[int] = None
    # Discount per model turn of the environment's per-turn rewards and the answer's (environment.episode_return);
    # 1.0 = their plain sum.
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
    # Parser of tool calls in the model's text: json_tags (<tool_call>{...}</tool_call>) or a vLLM tool parser's name.
    tool_parser: str = "json_tags"
    # Requests one episode may send; a later one is refused (HTTP 400).
    max_requests: int = 8
    # Tokens of one sample (prompt, sampled and tool tokens); null = model.max_seq_len.
    max_episode_tokens: Optional[int] = None
    # Seconds an episode's rollout may run; then it is cancelled and scores 0.
    episode_timeout_s: float = 300.0


# ---------------------------------------------------------------- evaluation (conf/eval/)
@dataclass
class EvalConfig:
    """Held-out evaluation inside the run; see grpo.pipeline.evaluation.Evaluator."""

    _target_: str = "grpo.pipeline.evaluation.Evaluator"
    # null = on when there is a task (local data or eval.task), off for data=atropos.
    enabled: Optional[bool] = None
    # null = data.task; rewards null = data.rewards; max_new_tokens null = data.max_new_tokens.
    task: Any = None
    rewards: Any = None
    correct_reward: Optional[str] = None
    correct_threshold: float = 1.0
    before_train: bool = True
    every: int = 10
    at_end: bool = True
    k: int = 4
    samples_per_prompt: int = 8
    # The sampled completions (pass@k, mean@k) at the evaluations of steps that are multiples of N, and always at
    # step 0's and the last step's; 0 = at those two only; null = at every evaluation. The greedy accuracy is
    # evaluated at every one.
    sampled_every: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None
    seed: int = 1234
    max_concurrency: int = 16
    samples_logged: int = 4
    # Run beside training: the run waits only for the eval's generation, before the weights next change.
    background: bool = True
    # vLLM scheduling priority of the eval's requests (the rollouts' is 0; larger = admitted later): with
    # server.scheduling_policy=priority an evaluation beside training yields the engine to the rollouts. 0 = none sent.
    priority: int = 1
    # The most eval sequences (prompts x n) in flight at once per server; null = no bound but eval.max_concurrency.
    max_in_flight: Optional[int] = None
