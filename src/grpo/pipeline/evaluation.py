"""Held-out evaluation inside a run (conf/eval/): greedy accuracy, pass@k and mean@k on prompts training never draws.

The evaluator samples the policy through the run's own vLLM server (the run's generation handle, on clients of its own),
with sampling settings and seeds of its own: greedy (temperature 0) for accuracy, and `samples_per_prompt` seeded
samples at `temperature` for pass@k (the unbiased estimator of Chen et al. 2021) and mean@k. It never draws from a
training random stream: its prompts are the task's fixed `eval_prompts()` and its vLLM seeds are `eval.seed`.

Which weights: the trainer starts the evaluation of `step` after step `step` has finished, i.e. after that step's
sync, so the server serves the weights of the last sync at or before `step` (version `step` when
`mode.sync_every=1`). `eval/weight_version` records the version every completion was generated with. An evaluation
has two phases, `generate` (on the server, at those weights) and `score` (grading, metrics, samples); with
`eval.background` the trainer runs them beside training and waits only for `generate`, before the weights next
change (grpo.trainer.background_eval).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from grpo import faults
from grpo.config_values import CheckContext
from grpo.inference.client import Completion
from grpo.pipeline.base import data_class
from grpo.pipeline.episodes import EpisodeRunner
from grpo.pipeline.eval_settings import (
    AGENT_EVAL_KEYS,
    ATROPOS_EVAL_EXAMPLE,
    check_eval_settings,
    check_evaluator_config,
    eval_enabled,
    eval_task,
    literal_eval_rewards,
)
from grpo.pipeline.generation import GenerationHandle
from grpo.pipeline.grading import Grader, PendingGrades, picklable_specs
from grpo.pipeline.local import build_rewards
from grpo.schema.data import EvalConfig, LocalDataConfig, MultiTurnDataConfig
from grpo.tasks.environment import EnvironmentTask, EpisodeLimits
from grpo.tasks.prompts import Prompt, Task
from grpo.trainer.metrics import EVAL_SAMPLES

log = logging.getLogger(__name__)

# Above this share of the run's wall clock spent in eval, close() prints a hint ...
EVAL_TIME_HINT_FRACTION = 0.25
# ... in runs of at least this many seconds: a short run (the default job, well under a minute of training loop with
# seven evals for its curve) spends little absolute time in eval and needs no advice.
EVAL_TIME_HINT_MIN_RUN_S = 300.0


def eval_time_hint(eval_seconds: float, wall_seconds: float) -> Optional[str]:
    """The hint close() logs when eval took too large a share of a long run's wall clock; None otherwise."""
    if wall_seconds < EVAL_TIME_HINT_MIN_RUN_S or eval_seconds <= EVAL_TIME_HINT_FRACTION * wall_seconds:
        return None
    return (f"eval took {100 * eval_seconds / wall_seconds:.0f}% of the run's {wall_seconds:.0f} s: evaluate less "
            "often (eval.every), with fewer samples per prompt (eval.samples_per_prompt) or on a smaller held-out set "
            "(the task's eval_size or heldout_size)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # The product form avoids huge binomials: C(n-c, k) / C(n, k) = prod_{i=n-c+1..n} (1 - k / i).
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class EvalContext:
    """What the evaluator learns from the trainer at setup."""

    tokenizer: Any
    # How to sample the current policy (grpo.pipeline.generation; the endpoint is read anew for every call: restarts
    # move the server). The evaluator samples through clients of its own, at eval.max_concurrency.
    generation: GenerationHandle
    run_dir: Path
    # The run's training seed (recorded only: eval sampling uses `eval.seed`, so eval noise is the same across runs).
    seed: int
    total_steps: int
    max_seq_len: int
    # Optimizer steps per rollout batch (train.ppo_epochs x train.mini_batches): an evaluation can run only between
    # rollout batches, after the batch's sync.
    updates_per_batch: int = 1


@dataclass
class GeneratedEval:
    """What the generation phase of one evaluation produced (Evaluator.generate), for its scoring phase."""

    step: int
    # time.monotonic() when the generation began, and how long it took.
    started: float
    generation_seconds: float
    # (completions per prompt, the texts to grade per prompt or None: the texts their tokens decode to), greedy and
    # sampled.
    greedy: tuple[list[list[Completion]], Optional[list[list[str]]]]
    # None when this evaluation sampled nothing (eval.sampled_every).
    sampled: Optional[tuple[list[list[Completion]], Optional[list[list[str]]]]]


@dataclass
class ScoredCompletion:
    """One eval completion with its rewards."""

    completion: Completion
    text: str
    reward: float
    correct: bool
    parsed: bool


class Evaluator:
    """Evaluates the served policy on a task's held-out prompts at step 0, every `every` steps and at the end.

    Metrics of one evaluation (`evaluate(step)`): `eval/accuracy` (share of greedy completions that are correct),
    `eval/pass@k`, `eval/mean@k` (share of the sampled completions that are correct), `eval/reward_mean` (greedy),
    `eval/response_tokens_mean` (greedy), `eval/unparsed_fraction`, `eval/weight_version`, `eval/prompts`, `eval/k`,
    `eval/seconds` (from the generation's start to the metrics), `eval/generation_seconds`. A completion is correct when the reward `correct_reward` gives it >= `correct_threshold`.
    With `sampled_every` set, the evaluations it does not name generate the greedy completions alone: their metrics
    lack `eval/pass@k`, `eval/mean@k` and `eval/k` (`samples_due`).

    An environment task (grpo.tasks.environment.EnvironmentTask, data=calculator) is evaluated on whole episodes
    under the training data's limits (`max_turns`, `max_new_tokens` per turn, `max_episode_tokens`): the episode's
    answer is scored, and its model tokens are the response tokens. An agent's data (data.rollout) is evaluated by
    the subclass grpo.pipeline.agent_eval.AgentEvaluator, on the agent's own episodes.
    """

    # Every key an evaluation logs (what `train.objective=eval/...` may name; checked at start-up).
    metric_names = ("eval/accuracy", "eval/pass@k", "eval/mean@k", "eval/reward_mean", "eval/response_tokens_mean",
                    "eval/unparsed_fraction", "eval/weight_version", "eval/prompts", "eval/k", "eval/seconds",
                    "eval/generation_seconds")

    @classmethod
    def check_config(cls, cfg: Any, ctx: CheckContext) -> None:
        """The eval.* settings against the run (grpo.pipeline.eval_settings.check_evaluator_config)."""
        check_evaluator_config(cfg, ctx)

    def __init__(
        self,
        task: Any,
        rewards: Mapping[str, Any],
        every: int = EvalConfig.every,
        before_train: bool = EvalConfig.before_train,
        at_end: bool = EvalConfig.at_end,
        k: int = EvalConfig.k,
        samples_per_prompt: int = EvalConfig.samples_per_prompt,
        sampled_every: Optional[int] = None,
        temperature: float = EvalConfig.temperature,
        top_p: float = EvalConfig.top_p,
        max_new_tokens: int = LocalDataConfig.max_new_tokens,  # eval.max_new_tokens null: the data's cap
        correct_reward: Optional[str] = None,
        correct_threshold: float = EvalConfig.correct_threshold,
        seed: int = EvalConfig.seed,
        max_concurrency: int = EvalConfig.max_concurrency,
        samples_logged: int = EvalConfig.samples_logged,
        enabled: Optional[bool] = None,  # noqa: ARG002 (read by build_evaluator; accepted so the node instantiates)
        max_turns: int = MultiTurnDataConfig.max_turns,
        max_episode_tokens: Optional[int] = None,
        reward_workers: int = LocalDataConfig.reward_workers,
        background: bool = EvalConfig.background,
        priority: int = EvalConfig.priority,
        max_in_flight: Optional[int] = EvalConfig.max_in_flight,
    ) -> None:
        check_eval_settings(every, k, samples_per_prompt, sampled_every, temperature, top_p, max_new_tokens,
                            max_concurrency, samples_logged, max_in_flight)
        self.task: Task = _build(task)
        rewards = literal_eval_rewards(rewards)
        self.rewards = build_rewards(rewards)
        # Grades in worker processes (grpo.pipeline.grading; data.reward_workers, handed over by build_evaluator)
        # started by setup(); 0: in this process.
        self.grader = Grader(self.rewards, picklable_specs(rewards) if reward_workers > 0 else None, build_rewards,
                             reward_workers)
        self.correct_reward = correct_reward or next(iter(self.rewards))
        if self.correct_reward not in self.rewards:
            raise ValueError(f"eval.correct_reward={correct_reward!r} is not one of the rewards {sorted(self.rewards)}")
        self.every, self.before_train, self.at_end = int(every), bool(before_train), bool(at_end)
        self.k, self.n = int(k), int(samples_per_prompt)
        self.sampled_every = None if sampled_every is None else int(sampled_every)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.max_new_tokens, self.correct_threshold = int(max_new_tokens), float(correct_threshold)
        self.seed, self.max_concurrency, self.samples_logged = int(seed), int(max_concurrency), int(samples_logged)
        # Episode limits of an environment task (the training data's: build_evaluator passes them); null total =
        # model.max_seq_len.
        self.max_turns, self.max_episode_tokens = int(max_turns), max_episode_tokens
        # Run beside training (the trainer waits only for the generation, before the weights next change).
        self.background = bool(background)
        # vLLM's scheduling priority of every eval request (rollouts: 0; larger waits behind them) and the bound on
        # the eval's sequences in flight: both only decide when the engine runs them, never what it samples.
        self.priority = int(priority)
        self.max_in_flight = None if max_in_flight is None else int(max_in_flight)
        self.ctx: Optional[EvalContext] = None
        self.prompts: list[Prompt] = []
        self.prompt_ids: list[list[int]] = []
        self.dropped_prompts = 0
        self.total_seconds = 0.0
        self.started = time.monotonic()
        self.generation: Optional[GenerationHandle] = None

    # ------------------------------------------------------------------ lifecycle
    def setup(self, ctx: EvalContext) -> None:
        """Render and tokenize the held-out prompts once; errors (empty split, every prompt too long) stop here."""
        self.ctx = ctx
        # Clients of its own (eval.max_concurrency connections each), passing no gate: the trainer runs an
        # evaluation's generation only while no sync takes the server away (it waits for it before the next one).
        self.generation = ctx.generation.with_clients(gated=False, max_concurrency=self.max_concurrency)
        self.task.bind_tokenizer(ctx.tokenizer)
        prompts = self.task.eval_prompts()
        if not prompts:
            raise ValueError(f"{type(self.task).__name__}.eval_prompts() is empty; give the task a held-out split")
        ids = [ctx.tokenizer.encode(p.text, add_special_tokens=False) for p in prompts]
        keep = [i for i, x in enumerate(ids) if 0 < len(x) < ctx.max_seq_len]
        self.dropped_prompts = len(prompts) - len(keep)
        if not keep:
            raise ValueError(f"every eval prompt is empty or has >= model.max_seq_len={ctx.max_seq_len} tokens")
        if self.dropped_prompts:
            log.warning("eval: %d of %d held-out prompts dropped (empty or >= max_seq_len tokens)",
                        self.dropped_prompts, len(prompts))
        self.prompts, self.prompt_ids = [prompts[i] for i in keep], [ids[i] for i in keep]
        self.grader.start()
        self.started = time.monotonic()
        self.every = self.batch_grid(self.every, ctx.updates_per_batch)
        when = ("" if self.sampled_every is None else
                f" (the samples at step 0, the last step{f' and every {self.sampled_every}' if self.sampled_every else ''})")
        log.info("eval: %d held-out prompts, greedy + %d samples each (pass@%d) at temperature %g%s",
                 len(self.prompts), self.n, self.k, self.temperature, when)

    def check_disjoint(self, training_task: Task) -> None:
        """Raise when the training task could sample any eval prompt (the split would leak into training)."""
        prompts = self.task.eval_prompts()
        leaked = sum(training_task.can_sample(p) for p in prompts)
        if leaked:
            raise ValueError(
                f"{leaked} of the {len(prompts)} eval prompts of {type(self.task).__name__} can be drawn by the training "
                f"task {type(training_task).__name__}; leave eval.task null (the training task's own held-out split) or "
                "give the training task the same held-out split"
            )

    @staticmethod
    def batch_grid(every: int, updates_per_batch: int) -> int:
        """`every` rounded up to a multiple of the updates per rollout batch, said in the log when it changes: with 4
        updates per batch, eval.every=10 evaluated after the batches that reached steps 10, 20, 30 (steps 12, 20, 32,
        40, ...: no regular grid); it evaluates every 12 steps now."""
        grid = -(-every // updates_per_batch) * updates_per_batch if every > 0 and updates_per_batch > 1 else every
        if grid != every:
            log.info("eval: every %d steps (eval.every=%d rounded up to a multiple of the %d updates per rollout batch: "
                     "an evaluation runs between rollout batches, after the batch's weight sync)", grid, every,
                     updates_per_batch)
        return grid

    def due(self, step: int, total_steps: int) -> bool:
        """Step 0 when `before_train`, every `every` steps, and the last step when `at_end`."""
        if step == 0:
            return self.before_train
        return (self.at_end and step == total_steps) or (self.every > 0 and step % self.every == 0)

    def samples_due(self, step: int) -> bool:
        """Whether the evaluation of `step` samples the pass@k completions: every one with `sampled_every` null,
        else step 0's, the last step's and those of multiples of `sampled_every`."""
        if self.sampled_every is None or step == 0 or (self.ctx is not None and step >= self.ctx.total_steps):
            return True
        return self.sampled_every > 0 and step % self.sampled_every == 0

    def close(self) -> None:
        """Print a hint when a blocking eval took a large share of a long run's wall clock (eval_time_hint; one beside
        training costs the run little of its time); release the client and stop the grading workers."""
        hint = None if self.background else eval_time_hint(self.total_seconds, time.monotonic() - self.started)
        if hint:
            log.warning(hint)
        if self.generation is not None:
            self.generation.close()
            self.generation = None
        self.grader.close()

    # ------------------------------------------------------------------ one evaluation
    def evaluate(self, step: int, sampled: Optional[bool] = None) -> dict[str, float]:
        """Generate on every held-out prompt (greedy and, when `sampled`, sampled), score, append samples; returns
        `eval/*` metrics. The two phases apart: `generate` (needs the server at the step's weights) and `score` (does
        not). `sampled` None: `samples_due(step)`."""
        return self.score(self.generate(step, sampled))

    def generate(self, step: int, sampled: Optional[bool] = None) -> GeneratedEval:
        """The generation phase of the evaluation of `step`: every completion, from the weights the server serves
        now; the sampled ones when `sampled` (None: `samples_due(step)`). The only phase that needs the server (and
        its weights unchanged): a caller running it beside training must let it finish before the weights next change;
        `score` may run later, in any thread."""
        assert self.ctx is not None, "Evaluator.setup() was not called"
        sampled = self.samples_due(step) if sampled is None else sampled
        t0 = time.monotonic()
        faults.kill_server_evaluating(step, self.ctx.run_dir / "logs" / "vllm.pid")  # test-only (GRPO_FAULT)
        generation = self.generation
        longest = max(len(x) for x in self.prompt_ids)
        max_tokens = max(1, min(self.max_new_tokens, self.ctx.max_seq_len - longest))
        # score() decodes the token ids itself: the server need not compute log-probs.
        common = dict(max_tokens=max_tokens, top_p=self.top_p, logprobs=False, **self._scheduling())
        samples = None
        if isinstance(self.task, EnvironmentTask):  # whole episodes, scored on their answers
            greedy = self._episodes(1, 0.0, None)
            if sampled:
                samples = self._episodes(self.n, self.temperature, self.seed)
        else:
            # Greedy and sampled requests each send the whole eval set at once; the client bounds the concurrency.
            greedy = (generation.generate(self.prompt_ids, n=1, temperature=0.0, **common), None)
            if sampled:
                samples = (generation.generate(self.prompt_ids, n=self.n, temperature=self.temperature,
                                               seed=self.seed, **common), None)
        return GeneratedEval(step, t0, time.monotonic() - t0, greedy, samples)

    def score(self, generated: GeneratedEval) -> dict[str, float]:
        """The scoring phase: grade the completions `generate` returned, append the samples, the `eval/*` metrics
        (`eval/seconds` from the generation's start to now)."""
        # Both sets go to the grading workers at once (with data.reward_workers > 0) before either is waited for.
        greedy_grading = self._submit(*generated.greedy)
        sampled_grading = self._submit(*generated.sampled) if generated.sampled is not None else None
        greedy_scored = [per_prompt[0] for per_prompt in self._scored(generated.greedy[0], *greedy_grading)]
        sampled_scored = (self._scored(generated.sampled[0], *sampled_grading) if sampled_grading is not None
                          else None)
        metrics = self._metrics(greedy_scored, sampled_scored)
        self._write_samples(generated.step, greedy_scored)
        seconds = time.monotonic() - generated.started
        self.total_seconds += seconds
        metrics["eval/seconds"] = seconds
        metrics["eval/generation_seconds"] = generated.generation_seconds
        return metrics

    def _scheduling(self) -> dict[str, Any]:
        """The keys of every eval request that decide when the engine runs it: its priority (none sent at 0) and the
        client's bound on sequences in flight."""
        return ({"priority": self.priority} if self.priority else {}) | {"max_in_flight": self.max_in_flight}

    def _episodes(self, n: int, temperature: float, seed: Optional[int]
                  ) -> tuple[list[list[Completion]], list[list[str]]]:
        """`n` whole episodes of every held-out prompt (grpo.pipeline.episodes), each as a completion of its model
        tokens and its oldest turn's weight version, with its answer (what is scored)."""
        assert self.ctx is not None
        limits = EpisodeLimits(self.max_turns, self.max_new_tokens, self.max_episode_tokens or self.ctx.max_seq_len)

        def generate(ids: list[list[int]], n: int, max_tokens: int, seed: Optional[int]) -> list[list[Completion]]:
            return self.generation.generate(ids, n=n, max_tokens=max_tokens, temperature=temperature,
                                            top_p=self.top_p, logprobs=False, **self._scheduling(),
                                            **({} if seed is None else {"seed": seed}))

        episodes = EpisodeRunner(self.task, self.ctx.tokenizer, limits).run(
            generate, self.prompts, self.prompt_ids, n, seed, logprobs=False)
        outs = [[Completion(token_ids=[tok for r in t.turns for tok in t.tokens[r.start:r.end]], logprobs=None,
                            finish_reason=t.end, weight_version=min(r.weight_version for r in t.turns))
                 for t in per_prompt] for per_prompt in episodes]
        return outs, [[t.answer for t in per_prompt] for per_prompt in episodes]

    def _submit(self, outs: list[list[Completion]], texts: Optional[list[list[str]]] = None
                ) -> tuple[list[list[str]], PendingGrades]:
        """Start grading the completions of each prompt on `texts` (None: the texts their tokens decode to)."""
        assert self.ctx is not None, "Evaluator.setup() was not called"
        if texts is None:
            texts = [[self.ctx.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in per_prompt]
                     for per_prompt in outs]
        pairs = [(prompt, text) for prompt, per_prompt in zip(self.prompts, texts) for text in per_prompt]
        return texts, self.grader.submit(pairs, parses=True)

    def _scored(self, outs: list[list[Completion]], texts: list[list[str]], pending: PendingGrades
                ) -> list[list[ScoredCompletion]]:
        """The completions of each prompt with their grades (waits for them)."""
        grades = iter(pending.result())
        scored = []
        for per_prompt, per_texts in zip(outs, texts):
            row = []
            for completion, text in zip(per_prompt, per_texts):
                grade = next(grades)
                correct = self.correct_reward in grade.values and grade.values[self.correct_reward] >= self.correct_threshold
                row.append(ScoredCompletion(completion, text, grade.total, correct, bool(grade.parsed)))
            scored.append(row)
        return scored

    def _metrics(self, greedy: list[ScoredCompletion], sampled: Optional[list[list[ScoredCompletion]]]) -> dict[str, float]:
        """The `eval/*` metrics; `eval/pass@k`, `eval/mean@k` and `eval/k` only when the evaluation sampled."""
        everything = greedy + [s for per_prompt in sampled or [] for s in per_prompt]
        unparsed = sum(not s.parsed for s in everything)
        if unparsed == len(everything):
            log.warning("eval: none of the %d eval completions states an answer the reward can parse; accuracy "
                        "is 0 because nothing was graded (check the prompt format or the reward)", unparsed)
        versions = {s.completion.weight_version for s in everything}
        if len(versions) > 1:
            log.warning("eval: completions came from several weight versions %s (a sync ran during eval)", sorted(versions))
        metrics = {
            "eval/accuracy": sum(s.correct for s in greedy) / len(greedy),
            "eval/reward_mean": sum(s.reward for s in greedy) / len(greedy),
            "eval/response_tokens_mean": sum(len(s.completion.token_ids) for s in greedy) / len(greedy),
            "eval/unparsed_fraction": unparsed / len(everything),
            "eval/weight_version": float(min(versions)),
            "eval/prompts": float(len(greedy)),
        }
        if sampled is not None:
            metrics |= {
                "eval/pass@k": sum(pass_at_k(self.n, sum(s.correct for s in ps), self.k) for ps in sampled) / len(sampled),
                "eval/mean@k": sum(s.correct for ps in sampled for s in ps) / (self.n * len(sampled)),
                "eval/k": float(self.k),
            }
        return metrics

    def _write_samples(self, step: int, greedy: list[ScoredCompletion]) -> None:
        # The same first prompts every time, so a reader can follow one prompt's answer through training.
        with open(self.ctx.run_dir / EVAL_SAMPLES, "a", encoding="utf-8") as f:
            for prompt, s in zip(self.prompts[: self.samples_logged], greedy):
                f.write(json.dumps({
                    "step": step, "weight_version": s.completion.weight_version, "prompt": prompt.text,
                    "answer": prompt.answer, "completion": s.text, "reward": s.reward, "correct": s.correct,
                }) + "\n")


def _build(node: Any) -> Any:
    """Build an object from a `_target_` config node; pass already-built objects through."""
    if isinstance(node, Mapping) or type(node).__name__ == "DictConfig":
        from hydra.utils import instantiate

        return instantiate(node, _convert_="all")
    return node


def _episode_evaluator(data_cfg: Any) -> Optional[str]:
    """The evaluator of the training data's own episodes (`episode_evaluator` of its class: AgentPipeline's), or None."""
    return getattr(data_class(data_cfg), "episode_evaluator", None)


def _evaluator_kwargs(eval_cfg: Any, data_cfg: Any) -> dict[str, Any]:
    """What build_evaluator hands the evaluator beside `eval.*`: the data's episode limits (a multi-turn source's hold
    for its evaluation too), its grading workers (a pool of the evaluator's own) and, for an agent's data without an
    `eval.task` of its own, the agent (AgentEvaluator plays its episodes)."""
    kwargs = {k: data_cfg.get(k) for k in ("max_turns", "max_episode_tokens") if data_cfg.get(k) is not None}
    kwargs["reward_workers"] = int(data_cfg.get("reward_workers") or 0) if hasattr(data_cfg, "get") else 0
    evaluator = _episode_evaluator(data_cfg)
    if evaluator is not None and eval_cfg.get("task") is None:
        kwargs |= {k: data_cfg.get(k) for k in AGENT_EVAL_KEYS if data_cfg.get(k) is not None}
        kwargs["_target_"] = evaluator
        if not (eval_cfg.get("rewards") or data_cfg.get("rewards")):
            kwargs["reward_workers"] = 0  # the rollout's own scores: nothing to grade in workers
    return kwargs


def build_evaluator(eval_cfg: Any, data_cfg: Any) -> Optional[Evaluator]:
    """The run's evaluator from `cfg.eval`, or None when eval is off.

    `eval.enabled: null` means on when there is a task to evaluate (the local data's own task, or `eval.task`) and
    off otherwise (data=atropos). `eval.task` / `eval.rewards` / `eval.max_new_tokens` null take the training data's.
    When training is local the eval prompts are checked to be disjoint from what training can sample. An agent's
    data (data.rollout) is evaluated on whole episodes of the agent (grpo.pipeline.agent_eval) unless `eval.task`
    names prompts of its own.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    train_task = data_cfg.get("task") if hasattr(data_cfg, "get") else None
    task = eval_task(eval_cfg, data_cfg)
    if not eval_enabled(eval_cfg, data_cfg):
        return None
    if task is None:
        raise ValueError("eval.enabled=true but the training data (data=atropos) has no task to evaluate: name one "
                         f"and its rewards, e.g. {ATROPOS_EVAL_EXAMPLE}, or set eval.enabled=false")
    rewards = eval_cfg.get("rewards") or data_cfg.get("rewards")
    agent = _episode_evaluator(data_cfg) is not None and eval_cfg.get("task") is None
    if not rewards and not agent:
        raise ValueError("eval needs rewards: set eval.rewards (the training data has none), e.g. "
                         "+eval.rewards.correct._target_=grpo.tasks.rewards.MathAnswerReward")
    # Only null falls back: eval.max_new_tokens=0 must reach the evaluator's own check, not become data's cap.
    max_new = next((v for v in (eval_cfg.get("max_new_tokens"), data_cfg.get("max_new_tokens")) if v is not None),
                   LocalDataConfig.max_new_tokens)
    try:
        evaluator = instantiate(eval_cfg, task=task, rewards=rewards or None, max_new_tokens=max_new,
                                **_evaluator_kwargs(eval_cfg, data_cfg), _recursive_=False)
    except InstantiationException as e:
        # Hydra wraps the constructor's error; the user needs the message that names the key to change.
        if isinstance(e.__cause__, (ValueError, TypeError, OSError)):
            raise e.__cause__ from None
        raise
    if train_task is not None:
        try:
            evaluator.check_disjoint(_build(train_task))
        except NotImplementedError as e:  # a task of the user's making without eval_prompts or can_sample
            raise ValueError(str(e)) from None
    return evaluator
