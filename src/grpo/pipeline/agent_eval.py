"""Held-out evaluation of an agent (data.rollout; docs/agents.md): whole agent episodes on the task's held-out items.

`AgentEvaluator` is the run's evaluator (grpo.pipeline.evaluation) when the training data is an agent's episodes and
`eval.task` is null: each held-out item is played by the agent itself, through a recording endpoint of the
evaluator's own (grpo.pipeline.agent_endpoint) in front of the run's server, once greedily (temperature 0, for
`eval/accuracy`) and `eval.samples_per_prompt` times at `eval.temperature` with seeds from `eval.seed` (pass@k,
mean@k). An episode is correct when its score (the number the rollout returned, or its text graded by the data's
rewards) is at least `eval.correct_threshold`; an episode whose rollout raised or timed out scores 0 and counts as
unparsed. Its response tokens are the tokens sampled over all its requests.

The agent sees the evaluation's sampling settings as the run's: a request that asks for a temperature or top_p of its
own is refused (HTTP 400), as in training.
"""

from __future__ import annotations

import copy
import hashlib
import threading
import time
from typing import Any, Mapping, Optional

from grpo.inference.client import Completion
from grpo.pipeline.agent_endpoint import AgentEndpoint, SamplingRules
from grpo.pipeline.agents import PlayedEpisode, load_rollout, play_all
from grpo.pipeline.chat_prompts import ChatPrompts
from grpo.pipeline.evaluation import EvalContext, Evaluator, GeneratedEval, ScoredCompletion
from grpo.pipeline.tool_calls import JSON_TAGS, ToolParser

# The reward name of an agent that returns its score (data.rewards empty): its "reward" is that score.
ROLLOUT_SCORE = "rollout_score"


def _rollout_score(prompt: Any, completion: str) -> float:
    raise ValueError("the agent returned text, but data.rewards is empty: give rewards to score it, or return the "
                     "episode's score as a number")


class AgentEvaluator(Evaluator):
    """The evaluator of an agent's episodes (module docstring). `rollout`, `chat_template`, `tool_parser`,
    `max_requests` and `episode_timeout_s` are the training data's; the rest is `Evaluator`'s."""

    def __init__(self, rollout: Any, chat_template: Optional[str] = None, tool_parser: str = JSON_TAGS,
                 max_requests: int = 8, episode_timeout_s: float = 300.0,
                 rewards: Optional[Mapping[str, Any]] = None, **evaluator: Any) -> None:
        super().__init__(rewards=rewards or {ROLLOUT_SCORE: (_rollout_score, 1.0)}, **evaluator)
        self.rollout = load_rollout(rollout)
        self.chat_template, self.tool_parser_name = chat_template, tool_parser
        self.max_requests, self.episode_timeout_s = int(max_requests), float(episode_timeout_s)
        # One endpoint per temperature (greedy, sampled): the temperature is each one's sampling rule.
        self._endpoints: dict[float, AgentEndpoint] = {}

    def setup(self, ctx: EvalContext) -> None:
        super().setup(ctx)
        # A tokenizer of its own: an evaluation beside training must not share the training endpoint's (a fast
        # tokenizer used from two threads at once fails with "Already borrowed").
        tokenizer = copy.deepcopy(ctx.tokenizer)
        prompts, parser, lock = ChatPrompts(tokenizer, self.chat_template), ToolParser(self.tool_parser_name,
                                                                                        tokenizer), threading.Lock()
        total = self.max_episode_tokens or ctx.max_seq_len
        for temperature in {0.0, self.temperature}:
            rules = SamplingRules(temperature, self.top_p, self.max_new_tokens, total)
            # As many sampling threads as the client has connections (eval.max_concurrency).
            endpoint = AgentEndpoint(prompts, parser, self._sampler(temperature), rules, model_name="policy",
                                     lock=lock, workers=self.max_concurrency)
            endpoint.start()
            self._endpoints[temperature] = endpoint

    def close(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.close()
        self._endpoints = {}
        super().close()

    def _sampler(self, temperature: float) -> Any:
        def sample(prompt_ids: list[int], max_tokens: int, seed: Optional[int], extra: dict[str, Any]) -> Completion:
            assert self.generation is not None, "AgentEvaluator.setup() was not called"
            outs = self.generation.generate([prompt_ids], n=1, max_tokens=max_tokens, temperature=temperature,
                                            top_p=self.top_p, logprobs=False,
                                            **({} if seed is None else {"seed": seed}), **extra)
            return outs[0][0]

        return sample

    def _episode_seed(self, item: int, sample: int) -> int:
        return int(hashlib.sha256(f"grpo-agent-eval:{self.seed}:{item}:{sample}".encode()).hexdigest()[:8], 16) % 2**31

    def _play(self, temperature: float, n: int, seeded: bool) -> list[list[PlayedEpisode]]:
        """`n` episodes of every held-out item at `temperature`; result[i] are item i's."""
        endpoint = self._endpoints[temperature]
        jobs = [(item, endpoint.open_episode(self._episode_seed(i, g) if seeded else None, self.max_requests))
                for i, item in enumerate(self.prompts) for g in range(n)]
        flat = endpoint.run(play_all(endpoint, self.rollout, jobs, self.episode_timeout_s)).result()
        return [flat[i * n:(i + 1) * n] for i in range(len(self.prompts))]

    def generate(self, step: int, sampled: Optional[bool] = None) -> GeneratedEval:
        """The episodes of the evaluation of `step` (greedy, and sampled when due), played at the weights served
        now; `GeneratedEval.greedy` / `.sampled` hold the played episodes per item."""
        assert self.ctx is not None, "AgentEvaluator.setup() was not called"
        sampled = self.samples_due(step) if sampled is None else sampled
        t0 = time.monotonic()
        # Read here, on the caller's thread, before the agents' requests (on the endpoints' threads) read it: a weight
        # update still landing in the background lands first (grpo.sync.save_and_reload's endpoint).
        self.generation.endpoint()
        greedy = self._play(0.0, 1, seeded=False)
        samples = self._play(self.temperature, self.n, seeded=True) if sampled else None
        return GeneratedEval(step, t0, time.monotonic() - t0, greedy, samples)

    def score(self, generated: GeneratedEval) -> dict[str, float]:
        """Each episode's score (the rollout's number, or its text graded), the `eval/*` metrics, the samples."""
        greedy = [per_item[0] for per_item in self._scored_episodes(generated.greedy)]
        sampled = self._scored_episodes(generated.sampled) if generated.sampled is not None else None
        metrics = self._metrics(greedy, sampled)
        self._write_samples(generated.step, greedy)
        seconds = time.monotonic() - generated.started
        self.total_seconds += seconds
        return metrics | {"eval/seconds": seconds, "eval/generation_seconds": generated.generation_seconds}

    def _scored_episodes(self, played: Any) -> list[list[ScoredCompletion]]:
        texts = [p for per_item in played for p in per_item if p.error is None and isinstance(p.result, str)]
        grades = dict(zip(map(id, texts), self.grader.grade([(p.item, p.result) for p in texts], parses=True))) if texts else {}
        return [[self._scored(p, grades.get(id(p))) for p in per_item] for per_item in played]

    def _scored(self, p: PlayedEpisode, grade: Any) -> ScoredCompletion:
        tokens = [t for c in p.log.calls for t in c.completion_ids]
        version = min((c.weight_version for c in p.log.calls), default=-1)
        completion = Completion(tokens, None, p.log.calls[-1].finish_reason if p.log.calls else None,
                                weight_version=version)
        assert self.ctx is not None
        text = p.result if isinstance(p.result, str) else " | ".join(
            self.ctx.tokenizer.decode(list(c.completion_ids), skip_special_tokens=True) for c in p.log.calls)
        if grade is not None:
            value = grade.values.get(self.correct_reward, 0.0)
            return ScoredCompletion(completion, text, grade.total, value >= self.correct_threshold, bool(grade.parsed))
        if p.error is not None or isinstance(p.result, bool) or not isinstance(p.result, (int, float)):
            return ScoredCompletion(completion, text, 0.0, False, False)
        score = float(p.result)
        return ScoredCompletion(completion, text, score, score >= self.correct_threshold, True)
