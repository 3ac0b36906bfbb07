"""Runs multi-turn episodes (grpo.tasks.environment) against the run's inference server, turn by turn.

All episodes of a call advance together: each round sends every unfinished episode's token ids to /generate in
batched requests (the first round one request per prompt with `n` samples, so a group shares its prompt's prefix
cache), then asks each episode's environment for its answer. The caller's `generate` function reads the endpoint and
passes the server's gate anew for every round, so a sync may land between two turns of an episode; each turn records
the weight versions it was generated under.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, defaultdict
from contextlib import AbstractContextManager
from typing import Any, Callable, Optional, Sequence

from grpo.inference.client import Completion
from grpo.tasks.environment import (
    END_REASONS,
    FINISHED,
    MAX_TOKENS,
    MAX_TURNS,
    TURN_CUT,
    EnvironmentTask,
    EpisodeLimits,
    Finish,
    Trajectory,
    TurnRenderer,
)
from grpo.tasks.prompts import Prompt

# generate(prompt token ids, n, max_tokens, seed or None) -> n completions per prompt, in order.
GenerateFn = Callable[[list[list[int]], int, int, Optional[int]], list[list[Completion]]]


def round_seed(base: Optional[int], turn: int, bucket: int) -> Optional[int]:
    """The base seed of one /generate call of round `turn`: a function of (base, turn, bucket), so a re-run draws the
    same episodes, and rounds never reuse one another's seeds."""
    if base is None:
        return None
    digest = hashlib.sha256(f"grpo-episode:{base}:{turn}:{bucket}".encode()).hexdigest()
    return int(digest[:8], 16) % (2**31)


class EpisodeRunner:
    """Plays episodes of `task` to their end under `limits`. `lock` guards the tokenizer and the environments when
    several threads run episodes at once (a Rust tokenizer may refuse concurrent use)."""

    def __init__(self, task: EnvironmentTask, tokenizer: Any, limits: EpisodeLimits,
                 lock: Optional[AbstractContextManager] = None) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.limits = limits
        self.renderer = TurnRenderer(tokenizer)
        self.lock = lock if lock is not None else threading.Lock()

    def run(self, generate: GenerateFn, prompts: Sequence[Prompt], prompt_ids: Sequence[list[int]], n: int,
            seed: Optional[int], logprobs: bool) -> list[list[Trajectory]]:
        """`n` episodes of each prompt, played to their end; result[i] are prompt i's, in sample order."""
        too_long = [len(ids) for ids in prompt_ids if len(ids) >= self.limits.max_episode_tokens]
        if too_long:
            raise ValueError(f"a prompt of {too_long[0]} tokens leaves no room for a model turn within "
                             f"max_episode_tokens={self.limits.max_episode_tokens}")
        with self.lock:
            episodes = [[Trajectory.start(p, self.task.start(p), list(ids), logprobs) for _ in range(n)]
                        for p, ids in zip(prompts, prompt_ids)]
        # Round 0: one request of n samples per prompt (the samples of a group share its prompt's prefix).
        self._round(generate, [(list(ids), group) for ids, group in zip(prompt_ids, episodes)], n, seed, 0)
        turn = 1
        while True:
            active = [t for group in episodes for t in group if not t.done]
            if not active:
                return episodes
            self._round(generate, [(list(t.tokens), [t]) for t in active], 1, seed, turn)
            turn += 1

    def _budget(self, length: int) -> int:
        return min(self.limits.max_turn_tokens, self.limits.max_episode_tokens - length)

    def _round(self, generate: GenerateFn, requests: list[tuple[list[int], list[Trajectory]]], n: int,
               seed: Optional[int], turn: int) -> None:
        """One model turn for each request's episodes: requests of the same token budget go in one call."""
        buckets: dict[int, list[tuple[list[int], list[Trajectory]]]] = defaultdict(list)
        for ids, trajectories in requests:
            buckets[self._budget(len(ids))].append((ids, trajectories))
        for b, (budget, batch) in enumerate(sorted(buckets.items())):
            outs = generate([ids for ids, _ in batch], n, budget, round_seed(seed, turn, b))
            if len(outs) != len(batch) or any(len(o) != n for o in outs):
                raise RuntimeError(f"inference server returned {[len(o) for o in outs]} completions for "
                                   f"{len(batch)} prompts of {n} samples")
            with self.lock:
                for (_, trajectories), completions in zip(batch, outs):
                    for trajectory, completion in zip(trajectories, completions):
                        self._advance(trajectory, completion, budget)

    def _advance(self, t: Trajectory, c: Completion, budget: int) -> None:
        """Append the model's turn, then the environment's answer, or end the episode at a limit."""
        t.add_model_turn(list(c.token_ids), c.logprobs, c.finish_reason, (c.weight_version, c.last_weight_version))
        text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if c.finish_reason == "length":
            # Cut mid-turn: the environment is not asked about half a turn; the cut text is scored.
            cut_by_total = budget < self.limits.max_turn_tokens
            t.end, t.answer = (MAX_TOKENS if cut_by_total else TURN_CUT), text
            return
        reply = t.episode.step(text)
        t.turns[-1].reward = float(reply.reward)
        if isinstance(reply, Finish):
            t.end, t.answer = FINISHED, reply.answer
            return
        if len(t.turns) >= self.limits.max_turns:
            t.end, t.answer = MAX_TURNS, text
            return
        tokens = self.renderer.tokens(reply.role, reply.content)
        if len(t.tokens) + len(tokens) + 1 > self.limits.max_episode_tokens:
            t.end, t.answer = MAX_TOKENS, text
            return
        t.add_environment_tokens(tokens)


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """`episode/*` figures of a batch of finished episodes: turns, tokens by kind, how each ended, and the share whose
    turns came from more than one weight version (a sync landed between them)."""
    n = len(trajectories)
    ends = Counter(t.end for t in trajectories)
    mixed = sum(len({(r.weight_version, r.last_weight_version) for r in t.turns}) > 1
                or any(r.weight_version != r.last_weight_version for r in t.turns) for t in trajectories)
    return {
        "episode/turns_mean": sum(len(t.turns) for t in trajectories) / n,
        "episode/turns_max": float(max(len(t.turns) for t in trajectories)),
        "episode/model_tokens_mean": sum(t.model_tokens for t in trajectories) / n,
        "episode/environment_tokens_mean": sum(t.environment_tokens for t in trajectories) / n,
        "episode/tokens_max": float(max(len(t.tokens) for t in trajectories)),
        **{f"episode/end_{reason}_fraction": ends.get(reason, 0) / n for reason in END_REASONS},
        "episode/mixed_version_fraction": mixed / n,
        "episode/turn_reward_mean": sum(r.reward for t in trajectories for r in t.turns) / n,
    }
