"""Train an agent written against the OpenAI API (data=agent_calculator; docs/agents.md).

The user writes one coroutine, ``async def rollout(client, item) -> float | str``: `client` is an
``openai.AsyncOpenAI`` pointed at the episode's URL on the run's recording endpoint (grpo.pipeline.agent_endpoint),
`item` one of the task's prompts (its `text` and reference `answer`). It talks to the model as to any OpenAI server,
tools and all, and returns the episode's score (a number), or the text of its answer for the run's rewards
(`data.rewards`) to score.

Each step plays `group_size` episodes of each of `prompts_per_step` items, all at once on the endpoint's loop. Every
request an episode sent is recorded token for token, and the episode becomes training samples
(grpo.pipeline.agent_samples): a conversation that grows request by request is one sample, the sampled tokens in the
loss and everything else (prompt, tool results, template markers) masked; a request whose prompt does not extend the
earlier ones (a prefix break) starts another sample. A group holds the samples of one item's episodes, each with its
episode's score (an episode of two samples counts twice in the group's baseline).

An episode whose rollout raises (or runs past `episode_timeout_s`) scores 0: its samples still train, the error is
counted (`agent/rollout_errors`) and the first one logged; a batch whose every episode failed raises it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from grpo.inference.client import Completion
from grpo.pipeline.agent_endpoint import AgentEndpoint, EpisodeLog, SamplingRules
from grpo.pipeline.agent_samples import EpisodeSamples, episode_samples
from grpo.pipeline.base import PipelineContext
from grpo.pipeline.chat_prompts import ChatPrompts
from grpo.pipeline.group import Group
from grpo.pipeline.local import LocalRolloutPipeline
from grpo.pipeline.tool_calls import JSON_TAGS, ToolParser
from grpo.schema.data import AgentDataConfig
from grpo.tasks.prompts import Prompt

log = logging.getLogger(__name__)

Rollout = Callable[[Any, Prompt], Any]
NO_REWARDS = "rollout_score"


def load_rollout(path: Any) -> Rollout:
    """The coroutine function at `path` (``package.module:function`` or ``package.module.function``; a function
    itself is taken as it is)."""
    if callable(path):
        fn = path
    else:
        module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"data.rollout={path!r}: no function there ({e}); name an async def rollout(client, "
                             "item) as package.module:function") from e
    if not asyncio.iscoroutinefunction(fn):
        raise ValueError(f"data.rollout={path!r} is not an async function: write `async def rollout(client, item)`")
    return fn


def _unscored(prompt: Prompt, completion: str) -> float:
    raise ValueError("the rollout returned text, but data.rewards is empty: give rewards to score it, or return "
                     "the episode's score as a number")


@dataclass
class PlayedEpisode:
    """One episode: its item, what its requests recorded, its samples, the rollout's result or error."""

    item: Prompt
    log: EpisodeLog
    samples: EpisodeSamples
    result: Any = None
    error: Optional[BaseException] = None


async def play_episode(endpoint: AgentEndpoint, rollout: Rollout, item: Prompt, episode: EpisodeLog,
                       timeout_s: float) -> PlayedEpisode:
    """One episode of `rollout` on `item` at `episode`'s URL of `endpoint`, within `timeout_s`; the rollout's error
    (or timeout) is kept on the result, not raised."""
    import openai

    client = openai.AsyncOpenAI(base_url=endpoint.base_url(episode), api_key="grpo", max_retries=0, timeout=timeout_s)
    played = PlayedEpisode(item, episode, EpisodeSamples([]))
    try:
        played.result = await asyncio.wait_for(rollout(client, item), timeout_s)
    except Exception as e:  # the agent's own error: counted and logged by the caller
        played.error = e
    finally:
        await client.close()
        endpoint.close_episode(episode)
    played.samples = episode_samples(episode.calls)
    return played


async def play_all(endpoint: AgentEndpoint, rollout: Rollout, jobs: list[tuple[Prompt, EpisodeLog]],
                   timeout_s: float) -> list[PlayedEpisode]:
    """`play_episode` of every (item, episode) of `jobs`, all at once; in the order of `jobs`."""
    return list(await asyncio.gather(*(play_episode(endpoint, rollout, item, episode, timeout_s)
                                       for item, episode in jobs)))


class AgentPipeline(LocalRolloutPipeline):
    """`prompts_per_step` items x `group_size` episodes of `rollout` per step (module docstring). `chat_template`:
    null for the tokenizer's own, a built-in name (chatml_tools) or a Jinja file; `tool_parser`: json_tags or a vLLM
    tool parser's name; `max_episode_tokens` caps each sample (null: model.max_seq_len); `max_requests` the requests
    of an episode (a later one is refused)."""

    reports_completion_limit = False
    episode_evaluator = "grpo.pipeline.agent_eval.AgentEvaluator"

    def __init__(self, task: Any, rollout: Any, rewards: Optional[Mapping[str, Any]] = None,
                 chat_template: Optional[str] = None, tool_parser: str = JSON_TAGS,
                 max_requests: int = AgentDataConfig.max_requests, max_episode_tokens: Optional[int] = None,
                 episode_timeout_s: float = AgentDataConfig.episode_timeout_s, **local: Any) -> None:
        if local.get("dynamic_sampling"):
            raise ValueError("data.dynamic_sampling is not built for agent episodes yet; set it to false")
        self.has_rewards = bool(rewards)
        super().__init__(task, rewards if rewards else {NO_REWARDS: (_unscored, 1.0)}, **local)
        if max_requests < 1 or episode_timeout_s <= 0:
            raise ValueError(f"data.max_requests must be >= 1 and data.episode_timeout_s > 0, got {max_requests}, "
                             f"{episode_timeout_s}")
        self.rollout = load_rollout(rollout)
        self.chat_template, self.tool_parser_name = chat_template, tool_parser
        self.max_requests, self.episode_timeout_s = int(max_requests), float(episode_timeout_s)
        self.max_episode_tokens = max_episode_tokens
        self.endpoint: Optional[AgentEndpoint] = None

    def setup(self, ctx: PipelineContext) -> None:
        super().setup(ctx)
        # The openai SDK's HTTP client logs every request at INFO: thousands of lines a step.
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        total = self.max_episode_tokens if self.max_episode_tokens is not None else ctx.max_seq_len
        if total > ctx.max_seq_len:
            raise ValueError(f"data.max_episode_tokens={total} is more than model.max_seq_len={ctx.max_seq_len}")
        rules = SamplingRules(self.temperature, self.top_p, self.max_new_tokens, total)
        prompts = ChatPrompts(ctx.tokenizer, self.chat_template)
        parser = ToolParser(self.tool_parser_name, ctx.tokenizer)
        self.endpoint = AgentEndpoint(prompts, parser, self._sample, rules, model_name="policy", lock=self._lock)
        self.endpoint.start()

    def _sample(self, prompt_ids: list[int], max_tokens: int, seed: Optional[int], extra: dict[str, Any]
                ) -> Completion:
        """One request's sample from the policy served now (the run's generation handle checks its log-probs and
        weight versions, which an agent's request records)."""
        return self.ctx.generation.generate(
            [prompt_ids], n=1, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            logprobs=self.rollout_logprobs, **({} if seed is None else {"seed": seed}), **extra)[0][0]

    def _episode_seed(self, step: int, item: int, sample: int) -> Optional[int]:
        base = self._sampling_seed(step).get("seed")
        if base is None:
            return None
        return int(hashlib.sha256(f"grpo-agent:{base}:{item}:{sample}".encode()).hexdigest()[:8], 16) % (2**31)

    async def _play_all(self, jobs: list[tuple[Prompt, EpisodeLog]]) -> list[PlayedEpisode]:
        assert self.endpoint is not None
        return await play_all(self.endpoint, self.rollout, jobs, self.episode_timeout_s)

    def play(self, items: list[Prompt], step: int) -> list[list[PlayedEpisode]]:
        """`group_size` episodes of each item, played to their end; result[i] are item i's."""
        endpoint = self.endpoint
        assert endpoint is not None, "AgentPipeline.setup() was not called"
        jobs = [(item, endpoint.open_episode(self._episode_seed(step, i, g), self.max_requests))
                for i, item in enumerate(items) for g in range(self.group_size)]
        flat = endpoint.run(self._play_all(jobs)).result()
        return [flat[i * self.group_size:(i + 1) * self.group_size] for i in range(len(items))]

    def rollout_batch(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """The groups of rollout batch `step` (every sample of every episode) and its metrics."""
        assert self.ctx is not None, "AgentPipeline.setup() was not called"
        t0 = time.monotonic()
        played = self.play(self.prompts_for_step(step), step)
        gen_s = time.monotonic() - t0
        flat = [p for per_item in played for p in per_item]
        errors = [p.error for p in flat if p.error is not None]
        if len(errors) == len(flat):
            raise RuntimeError(f"every episode of step {step} failed; the first: {errors[0]!r}") from errors[0]
        if errors:
            log.warning("%d of %d agent episodes of step %d failed (scored 0); the first: %r", len(errors), len(flat),
                        step, errors[0])
        scores = self._scores(flat)
        groups = [g for g in (self._group(per_item, scores) for per_item in played) if g is not None]
        if not groups:
            raise RuntimeError(f"no episode of step {step} sent a request to the model: nothing to train on")
        return groups, self._metrics(flat, scores, gen_s)

    def _scores(self, flat: list[PlayedEpisode]) -> dict[int, float]:
        """Each episode's score (by id()): the number its rollout returned, its text graded by data.rewards, or 0."""
        scores = {id(p): 0.0 for p in flat}
        texts = [p for p in flat if p.error is None and isinstance(p.result, str)]
        for p in flat:
            if p.error is None and not isinstance(p.result, str):
                if not isinstance(p.result, (int, float)) or isinstance(p.result, bool):
                    raise TypeError(f"the rollout returned {type(p.result).__name__}; return the episode's score "
                                    "(a number) or its answer's text")
                scores[id(p)] = float(p.result)
        if texts:
            for p, grade in zip(texts, self.grader.grade([(p.item, p.result) for p in texts])):
                scores[id(p)] = grade.total
        return scores

    def _group(self, episodes: list[PlayedEpisode], scores: dict[int, float]) -> Optional[Group]:
        rows = [(s, scores[id(p)], p.log) for p in episodes for s in p.samples.samples]
        if not rows:
            return None
        versions = [(c.weight_version, c.last_weight_version) for p in episodes for c in p.log.calls]
        n = len(rows)
        return Group(
            tokens=[s.tokens for s, _, _ in rows], masks=[s.masks for s, _, _ in rows],
            scores=[score for _, score, _ in rows], advantages=[None] * n,
            inference_logprobs=[s.logprobs for s, _, _ in rows], ref_logprobs=[None] * n,
            temperatures=[self.temperature] * n, zero_advantage=[False] * n,
            weight_version=min(v for v, _ in versions), last_weight_version=max(v for _, v in versions),
            truncated=[s.truncated for s, _, _ in rows],
        )

    def _metrics(self, flat: list[PlayedEpisode], scores: dict[int, float], gen_s: float) -> dict[str, float]:
        n = len(flat)
        calls = [c for p in flat for c in p.log.calls]
        sampled = sum(len(c.completion_ids) for c in calls)
        samples = [s for p in flat for s in p.samples.samples]
        return {
            "reward/weighted": sum(scores.values()) / n,
            "agent/requests_mean": len(calls) / n,
            "agent/refused_requests": float(sum(p.log.refused for p in flat)),
            "agent/tool_calls_mean": sum(p.log.tool_calls for p in flat) / n,
            "agent/prefix_breaks": float(sum(p.samples.breaks for p in flat)),
            "agent/samples_per_episode": len(samples) / n,
            "agent/rollout_errors": float(sum(p.error is not None for p in flat)),
            "agent/episodes_without_requests": float(sum(not p.log.calls for p in flat)),
            "completion/mean_tokens": sampled / max(1, len(calls)),
            "completion/truncated_fraction": sum(c.finish_reason == "length" for c in calls) / max(1, len(calls)),
            "generation/seconds": gen_s,
            "generation/tokens_per_s": sampled / gen_s if gen_s > 0 else 0.0,
        }

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        super().close()
