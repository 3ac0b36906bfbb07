"""Multi-turn rollouts: the built-in pipeline with an environment (data=calculator; grpo.tasks.environment).

Each step samples prompts from an `EnvironmentTask` as `LocalRolloutPipeline` does (a pure function of seed and step),
plays `group_size` episodes per prompt through the run's server (grpo.pipeline.episodes) and scores each episode's
answer with the run's rewards. A group's sequences are the trajectories: the prompt, then the model's turns (in the
loss, with the sampler's log-probs) and the environment's tokens (masked out of the loss, as the prompt is).

What composes: groups, several updates per batch, asynchronous rollouts (the producer thread calls `rollout_batch`;
each turn passes the server's gate, so a sync lands between turns, and every turn records its weight versions),
`train.padding_free`, `train.prefix_sharing` (the shared prefix is the prompt, before the first model token), FSDP2
(rank 0 generates) and every sync mode (the generation handle reads the endpoint anew every turn).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Optional

from grpo import faults
from grpo.inference.client import Completion
from grpo.pipeline.base import PipelineContext
from grpo.pipeline.episodes import EpisodeRunner, episode_metrics
from grpo.pipeline.group import Group
from grpo.pipeline.local import LocalRolloutPipeline
from grpo.schema.data import MultiTurnDataConfig
from grpo.tasks.environment import MAX_TOKENS, TURN_CUT, EnvironmentTask, EpisodeLimits, Trajectory, episode_return


class MultiTurnPipeline(LocalRolloutPipeline):
    """`prompts_per_step` prompts x `group_size` episodes per step; `max_new_tokens` caps each model turn,
    `max_turns` the model turns of an episode and `max_episode_tokens` its whole sequence (null: model.max_seq_len).
    What happens at each limit: grpo.tasks.environment. An episode's score is `episode_return` of its answer's
    weighted reward and the environment's per-turn rewards, discounted by `turn_reward_discount` per turn."""

    # An episode says whether it was cut at a limit, but has no single completion limit (loss.overlong_buffer).
    reports_completion_limit = False

    def __init__(self, task: Any, rewards: Mapping[str, Any], max_turns: int = MultiTurnDataConfig.max_turns,
                 max_episode_tokens: Optional[int] = None,
                 turn_reward_discount: float = MultiTurnDataConfig.turn_reward_discount, **local: Any) -> None:
        """`local`: every other key of `LocalRolloutPipeline` (prompts_per_step, group_size, max_new_tokens, ...)."""
        if local.get("dynamic_sampling"):  # rollout_batch below plays one round of episodes, no refill rounds
            raise ValueError("data.dynamic_sampling is not built for multi-turn episodes yet; set it to false")
        super().__init__(task, rewards, **local)
        if not isinstance(self.task, EnvironmentTask):
            raise ValueError(f"data.task ({type(self.task).__name__}) is not an environment: a multi-turn task "
                             "subclasses grpo.tasks.environment.EnvironmentTask (docs/multi_turn.md)")
        if max_turns < 1:
            raise ValueError(f"data.max_turns must be >= 1, got {max_turns}")
        if max_episode_tokens is not None and max_episode_tokens < 2:
            raise ValueError(f"data.max_episode_tokens must be >= 2 or null (model.max_seq_len), got {max_episode_tokens}")
        if not 0.0 < turn_reward_discount <= 1.0:
            raise ValueError(f"data.turn_reward_discount must be in (0, 1] (1.0: the plain sum of the turns' rewards), "
                             f"got {turn_reward_discount}")
        self.max_turns = int(max_turns)
        self.turn_reward_discount = float(turn_reward_discount)
        self.max_episode_tokens = max_episode_tokens
        self.runner: Optional[EpisodeRunner] = None

    def setup(self, ctx: PipelineContext) -> None:
        super().setup(ctx)
        total = self.max_episode_tokens if self.max_episode_tokens is not None else ctx.max_seq_len
        if total > ctx.max_seq_len:
            raise ValueError(f"data.max_episode_tokens={total} is more than model.max_seq_len={ctx.max_seq_len}: the "
                             "batcher would drop every longer episode; lower it or leave it null")
        self.runner = EpisodeRunner(self.task, ctx.tokenizer, self.limits(total), lock=self._lock)

    def limits(self, max_seq_len: int) -> EpisodeLimits:
        """The episode limits, `max_episode_tokens` defaulting to `max_seq_len`."""
        total = self.max_episode_tokens if self.max_episode_tokens is not None else max_seq_len
        return EpisodeLimits(self.max_turns, self.max_new_tokens, total)

    def rollout_batch(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """The groups of rollout batch `step` (whole episodes) and its metrics; changes nothing on `self`."""
        ctx, runner = self.ctx, self.runner
        assert ctx is not None and runner is not None, "MultiTurnPipeline.setup() was not called"
        prompts, ids, dropped_long = self._tokenized_prompts(step)
        fits = [i for i, x in enumerate(ids) if len(x) < runner.limits.max_episode_tokens]
        if not fits:
            raise ValueError(f"every prompt of step {step} has >= data.max_episode_tokens tokens")
        dropped_long += len(ids) - len(fits)
        prompts, ids = [prompts[i] for i in fits], [ids[i] for i in fits]
        faults.kill_server_generating(step + 1, Path(ctx.run_dir) / "logs" / "vllm.pid")
        t0 = time.monotonic()
        episodes = runner.run(self._generate, prompts, ids, self.group_size, self._sampling_seed(step).get("seed"),
                              self.rollout_logprobs)
        gen_s = time.monotonic() - t0
        flat = [t for group in episodes for t in group]
        groups, reward_metrics = self._groups(episodes)
        model_tokens = sum(t.model_tokens for t in flat)
        metrics = {
            **reward_metrics,
            **episode_metrics(flat),
            "completion/mean_tokens": model_tokens / len(flat),
            "completion/max_tokens": float(max(t.model_tokens for t in flat)),
            "completion/truncated_fraction": sum(t.end in (TURN_CUT, MAX_TOKENS) for t in flat) / len(flat),
            "generation/seconds": gen_s,
            "generation/tokens_per_s": model_tokens / gen_s if gen_s > 0 else 0.0,
            "data/dropped_prompts_too_long": float(dropped_long),
        }
        return groups, metrics

    def _generate(self, prompt_ids: list[list[int]], n: int, max_tokens: int, seed: Optional[int]) -> list[list[Completion]]:
        """One round of model turns from the policy served now (the run's generation handle: through the server's
        gate, at the endpoint read anew, every turn's weight versions checked)."""
        return self.ctx.generation.generate(
            prompt_ids, n=n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            logprobs=self.rollout_logprobs, **({} if seed is None else {"seed": seed}),
        )

    def _groups(self, episodes: list[list[Trajectory]]) -> tuple[list[Group], dict[str, float]]:
        """Each prompt's episodes as one group, scored by `episode_return` (the rewards on their answers and the
        environment's per-turn rewards); the reward metrics (`reward/weighted`: the answers' alone)."""
        grades = iter(self.grader.grade([(t.prompt, t.answer) for trajectories in episodes for t in trajectories]))
        per_reward: dict[str, list[float]] = {name: [] for name in self.rewards}
        totals: list[float] = []
        groups = []
        for trajectories in episodes:
            scores = []
            for t in trajectories:
                grade = next(grades)
                for name, value in grade.values.items():
                    per_reward[name].append(value)
                totals.append(grade.total)
                scores.append(episode_return(grade.total, [r.reward for r in t.turns], self.turn_reward_discount))
            groups.append(trajectory_group(trajectories, scores, self.temperature))
        metrics = {**{f"reward/{name}": sum(v) / len(v) for name, v in per_reward.items()},
                   "reward/weighted": sum(totals) / len(totals)}
        return groups, metrics


def trajectory_group(trajectories: list[Trajectory], scores: list[float], temperature: float) -> Group:
    """The group of one prompt's episodes: tokens and masks as played, the sampler's log-probs, and the weight
    versions of every turn (`turn_versions`; the group's `weight_version` is the oldest turn's admission version,
    `last_weight_version` the newest turn's finish version)."""
    n = len(trajectories)
    turn_versions = [[(r.weight_version, r.last_weight_version) for r in t.turns] for t in trajectories]
    return Group(
        tokens=[list(t.tokens) for t in trajectories], masks=[list(t.masks) for t in trajectories],
        scores=[float(s) for s in scores], advantages=[None] * n,
        inference_logprobs=[None if t.logprobs is None else list(t.logprobs) for t in trajectories],
        ref_logprobs=[None] * n, temperatures=[float(temperature)] * n, zero_advantage=[False] * n,
        weight_version=min(v for per in turn_versions for v, _ in per),
        last_weight_version=max(v for per in turn_versions for _, v in per),
        turn_versions=turn_versions,
        # An episode cut at a turn's or the episode's token limit (loss.mask_truncated); no single completion limit,
        # so no max_new_tokens (loss.overlong_buffer is refused).
        truncated=[t.end in (TURN_CUT, MAX_TOKENS) for t in trajectories],
    )
