"""data=local: built-in rollouts through the inference server, no Atropos needed.

Each step samples prompts from a task, generates `group_size` completions per prompt through the inference server's
/generate (the same server and sync mode the trainer always uses), scores them with weighted reward functions and
emits the same Atropos-shaped groups run-api would, rollout log-probs included.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from grpo import faults
from grpo.config_values import CheckContext, ConfigError, instantiation_cause
from grpo.pipeline.base import DataPipeline, PipelineContext
from grpo.pipeline.dynamic_sampling import refill
from grpo.pipeline.grading import Grade, Grader, picklable_specs
from grpo.pipeline.group import Group
from grpo.schema.data import LocalDataConfig
from grpo.tasks.prompts import Prompt, Task

log = logging.getLogger(__name__)


def _instantiate(node: Any) -> Any:
    """Build an object from a `_target_` config node; pass already-built objects through."""
    if isinstance(node, Mapping) or type(node).__name__ == "DictConfig":
        from hydra.utils import instantiate

        return instantiate(node, _convert_="all")
    return node


def _build(node: Any, key: str) -> Any:
    """`_instantiate(node)` for the config key `key`: a failure (a missing file or column, a `_target_` that does not
    import, a function called without arguments) becomes a ValueError naming the key and the innermost cause,
    instead of Hydra's InstantiationException around it (which train.py would print as a stack of wrappers)."""
    from hydra.errors import InstantiationException

    try:
        return _instantiate(node)
    except InstantiationException as e:
        cause = instantiation_cause(e)
        message = str(cause.args[0]) if isinstance(cause, KeyError) and cause.args else str(cause)
        hint = ""
        if isinstance(cause, TypeError) and not node.get("_partial_", False) and _is_function(node["_target_"]):
            hint = (f"; {node['_target_']} is a function: to hand it over as the reward itself (not call it with no "
                    f"arguments), set {key}._partial_=true (+{key}._partial_=true on the command line)")
        if isinstance(cause, ImportError) or "Error locating target" in message:
            hint = (f"; {node.get('_target_')} must be importable: the modules found are those of the directory "
                    "you run in, of the folder that holds your --config-dir, and of PYTHONPATH (e.g. "
                    "PYTHONPATH=<the folder holding your module's top package>)")
        raise ValueError(f"{key} ({node.get('_target_')}): {message}{hint}") from e


def _is_function(target: str) -> bool:
    import inspect

    from hydra.utils import get_method

    try:
        return inspect.isfunction(get_method(target))
    except Exception:  # not importable or not a callable: no hint, the cause says why
        return False


def build_rewards(rewards: Mapping[str, Any]) -> dict[str, tuple[Any, float]]:
    """`{name: {_target_, weight, ...}}` (or `{name: callable}` / `{name: (callable, weight)}`) → `{name: (fn, w)}`."""
    out: dict[str, tuple[Any, float]] = {}
    for name, spec in (rewards or {}).items():
        if isinstance(spec, tuple):
            fn, weight = spec
        elif isinstance(spec, Mapping) or type(spec).__name__ == "DictConfig":
            node = dict(spec)  # shallow copy: popping `weight` must not touch the caller's config
            weight = node.pop("weight", 1.0)
            if "_target_" not in node:
                raise ValueError(f"reward {name!r} needs a _target_ (a reward class), got keys {sorted(node)}")
            fn = _build(node, f"data.rewards.{name}")
        else:
            fn, weight = spec, 1.0
        if not callable(fn):
            raise TypeError(f"reward {name!r} is a {type(fn).__name__}, not callable(prompt, completion)")
        out[str(name)] = (fn, float(weight))
    if not out:
        raise ValueError("data.rewards is empty: give at least one reward function with a weight")
    return out


def weighted_reward(rewards: Mapping[str, tuple[Any, float]], prompt: Prompt, text: str) -> tuple[float, dict[str, float]]:
    """The weighted sum of `rewards` (from build_rewards) for one completion's text, and each reward's own value."""
    values = {name: float(fn(prompt, text)) for name, (fn, _) in rewards.items()}
    return sum(weight * values[name] for name, (_, weight) in rewards.items()), values


def check_sampling(temperature: float, top_p: float, max_new_tokens: int, min_new_tokens: int) -> None:
    """The rollouts' sampling settings: ValueError naming the data.* key out of range."""
    if temperature <= 0:
        raise ValueError(f"data.temperature must be > 0 (the loss divides logits by it), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"data.top_p must be in (0, 1] (1 = the whole distribution), got {top_p}")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"data.min_new_tokens must be in [0, data.max_new_tokens={max_new_tokens}] (vLLM's "
                         f"min_tokens: no EOS before that many tokens), got {min_new_tokens}")


def check_local_config(cfg: Any, experiment: Optional[str] = None) -> None:
    """A local rollout pipeline generates at least the sequences one rollout batch trains on, and its completion caps
    fit model.max_seq_len (`cfg`: the run's config; LocalRolloutPipeline.check_config)."""
    # The pipeline and the evaluator cap a completion at the length bound minus its prompt: cut, silently.
    bounds = (("model.max_seq_len", cfg.model.max_seq_len), ("server.max_model_len", cfg.server.get("max_model_len")))
    for key, max_new in (("data", cfg.data.get("max_new_tokens")), ("eval", cfg.eval.get("max_new_tokens"))):
        for bound, max_len in bounds:
            if max_new is not None and max_len is not None and max_new >= max_len:
                raise ConfigError(
                    f"{key}.max_new_tokens={max_new} cannot be reached: {bound}={max_len} bounds prompt + completion "
                    f"(a prompt has at least one token); raise {bound} or lower {key}.max_new_tokens"
                )
    # A multi-turn episode (data=calculator) is bounded by data.max_episode_tokens as a sequence is by these.
    max_episode = cfg.data.get("max_episode_tokens")
    for bound, max_len in bounds:
        if max_episode is not None and max_len is not None and max_episode > max_len:
            raise ConfigError(f"data.max_episode_tokens={max_episode} is more than {bound}={max_len}, which bounds "
                              f"a whole episode; lower data.max_episode_tokens (null = model.max_seq_len) or raise {bound}")
    if "max_turns" in cfg.data and cfg.data.get("dynamic_sampling", LocalDataConfig.dynamic_sampling):
        raise ConfigError("data.dynamic_sampling=true is not built for multi-turn episodes yet (the episode runner "
                          "plays one round per step); set data.dynamic_sampling=false")
    per_step = int(cfg.data.get("prompts_per_step", 0)) * int(cfg.data.get("group_size", 0))
    needed = cfg.train.micro_batch_size * cfg.train.grad_accum
    if per_step < needed:
        raise ConfigError(
            f"data.prompts_per_step x data.group_size = {per_step} sequences per step, fewer than the {needed} of "
            "train.micro_batch_size x train.grad_accum; raise data.prompts_per_step or data.group_size, or lower "
            "train.micro_batch_size or train.grad_accum"
            + (f" (experiment={experiment} sets the batch for its own data; '~experiment' gives the bare config)"
               if experiment else "")
        )


class LocalRolloutPipeline(DataPipeline):
    """Generates and scores its own groups each step: `prompts_per_step` prompts x `group_size` completions.

    The prompt stream is a pure function of (seed, step), so a resumed run sees exactly the prompts it would have
    seen. Each group carries the server's weight versions: `weight_version` when its requests were admitted (at most
    that of any token) and `last_weight_version` when they finished (at least that of any token).

    `rollout_batch` may run in several threads at once (AsyncRollouts with `train.rollout_batches_in_flight` > 1):
    the run's generation handle gives each thread its own HTTP client, and the tokenizer is used under a lock.
    """

    concurrent_batches = True
    reports_truncation = True
    reports_completion_limit = True
    supports_async_rollouts = True

    @classmethod
    def check_config(cls, cfg: Any, ctx: CheckContext) -> None:
        """check_local_config, then every source's checks."""
        check_local_config(cfg, ctx.experiment)
        super().check_config(cfg, ctx)

    @classmethod
    def sequences_per_step(cls, data_cfg: Any) -> Optional[int]:
        """data.prompts_per_step x data.group_size: each step trains every sequence it generates."""
        return int(data_cfg.get("prompts_per_step", 0)) * int(data_cfg.get("group_size", 0))

    def __init__(
        self,
        task: Any,
        rewards: Mapping[str, Any],
        prompts_per_step: int = LocalDataConfig.prompts_per_step,
        group_size: int = LocalDataConfig.group_size,
        max_new_tokens: int = LocalDataConfig.max_new_tokens,
        temperature: float = LocalDataConfig.temperature,
        top_p: float = LocalDataConfig.top_p,
        seeded_sampling: bool = LocalDataConfig.seeded_sampling,
        rollout_logprobs: bool = LocalDataConfig.rollout_logprobs,
        dynamic_sampling: bool = LocalDataConfig.dynamic_sampling,
        max_refill_rounds: int = LocalDataConfig.max_refill_rounds,
        reward_workers: int = LocalDataConfig.reward_workers,
        min_new_tokens: int = LocalDataConfig.min_new_tokens,
    ) -> None:
        if prompts_per_step < 1 or group_size < 1 or max_new_tokens < 1:
            raise ValueError(
                "data.prompts_per_step, data.group_size and data.max_new_tokens must be >= 1, got "
                f"{prompts_per_step}, {group_size}, {max_new_tokens}"
            )
        if group_size < 2:
            raise ValueError("data.group_size=1 gives every completion advantage 0 (its reward is compared with the other "
                             "completions of its prompt, and there are none), so nothing trains; use data.group_size >= 2")
        check_sampling(temperature, top_p, max_new_tokens, min_new_tokens)
        if max_refill_rounds < 0:
            raise ValueError(f"data.max_refill_rounds must be >= 0 (0 = drop zero-variance groups, never refill), "
                             f"got {max_refill_rounds}")
        self.task: Task = _build(task, "data.task")
        if not callable(getattr(self.task, "sample", None)):
            raise ValueError(f"data.task ({type(self.task).__name__}) has no sample(rng, n) method; a task subclasses "
                             "grpo.tasks.prompts.Task (docs/own_task.md, 'A task of your own making')")
        self.rewards = build_rewards(rewards)
        # Grades the completions (grpo.pipeline.grading), in `reward_workers` processes started by setup() (0: in
        # this process). The workers build the rewards from plain specs, checked here: a reward that cannot reach
        # them fails before the server starts.
        self.grader = Grader(self.rewards, picklable_specs(rewards) if reward_workers > 0 else None, build_rewards,
                             reward_workers)
        self.prompts_per_step = int(prompts_per_step)
        self.group_size = int(group_size)
        self.max_new_tokens = int(max_new_tokens)
        self.min_new_tokens = int(min_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seeded_sampling = bool(seeded_sampling)
        self.rollout_logprobs = bool(rollout_logprobs)
        # DAPO's dynamic sampling (grpo.pipeline.dynamic_sampling): groups whose rewards all agree are dropped and
        # fresh prompts refill the batch, at most max_refill_rounds extra generation rounds.
        self.dynamic_sampling = bool(dynamic_sampling)
        self.max_refill_rounds = int(max_refill_rounds)
        self.ctx: Optional[PipelineContext] = None
        # Guards the tokenizer (a Rust tokenizer may refuse concurrent use) when several threads generate.
        self._lock = threading.Lock()
        self.step: Optional[int] = None
        self.last_metrics: dict[str, float] = {}

    def start_workers(self) -> None:
        self.grader.start()  # data.reward_workers spawned processes: their imports take seconds

    def setup(self, ctx: PipelineContext) -> None:
        per_step = self.prompts_per_step * self.group_size
        if per_step < ctx.batch_size:
            raise ValueError(
                f"data.prompts_per_step x data.group_size = {per_step} sequences per step, fewer than the "
                f"{ctx.batch_size} of train.micro_batch_size x train.grad_accum"
            )
        self.ctx = ctx
        self.task.bind_tokenizer(ctx.tokenizer)
        self.grader.start()

    def prompts_for_step(self, step: int, refill_round: int = 0, count: Optional[int] = None) -> list[Prompt]:
        """The prompts of optimizer step `step` (`count`, default data.prompts_per_step): a pure function of (seed,
        step), and of the round for dynamic sampling's refill rounds (round 0 is the step's own prompts)."""
        assert self.ctx is not None, "LocalRolloutPipeline.setup() was not called"
        # A string seed hashes deterministically (sha512), and seed/step pairs never collide as seed + step would.
        key = f"grpo-local:{self.ctx.seed}:{step}" + (f":refill:{refill_round}" if refill_round else "")
        return self.task.sample(random.Random(key), self.prompts_per_step if count is None else count)

    def _tokenized_prompts(self, step: int, refill_round: int = 0, count: Optional[int] = None
                           ) -> tuple[list[Prompt], list[list[int]], int]:
        """The step's prompts that fit max_seq_len, their token ids, and how many were dropped as too long."""
        ctx = self.ctx
        prompts = self.prompts_for_step(step, refill_round, count)
        # add_special_tokens=False: chat templates already carry their special tokens; plain prompts need none.
        with self._lock:
            ids = [ctx.tokenizer.encode(p.text, add_special_tokens=False) for p in prompts]
        keep = [i for i, x in enumerate(ids) if 0 < len(x) < ctx.max_seq_len]
        if not keep:
            raise ValueError(f"every prompt of step {step} is empty or has >= max_seq_len={ctx.max_seq_len} tokens")
        return [prompts[i] for i in keep], [ids[i] for i in keep], len(ids) - len(keep)

    def next_groups(self, step: int) -> list[Group]:
        groups, self.last_metrics = self.rollout_batch(step)
        self.step = step
        return groups

    def rollout_batch(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """The groups of rollout batch `step` and its generation metrics; changes nothing on `self` (threads may call
        it at once). With dynamic sampling, only groups whose rewards differ, refilled by further rounds."""
        ctx = self.ctx
        assert ctx is not None, "LocalRolloutPipeline.setup() was not called"
        faults.kill_server_generating(step + 1, Path(ctx.run_dir) / "logs" / "vllm.pid")
        scorer = _Scorer(self.rewards)
        totals = {"seconds": 0.0, "dropped_long": 0, "grading_seconds": 0.0}

        def generate(refill_round: int, count: int) -> list[Group]:
            return self._generate_round(step, refill_round, count, scorer, totals)

        refill_metrics: dict[str, float] = {}
        if self.dynamic_sampling:
            refilled = refill(generate, self.prompts_per_step, self.max_refill_rounds)
            groups, refill_metrics = refilled.groups, refilled.metrics()
        else:
            groups = generate(0, self.prompts_per_step)
        gen_s = totals["seconds"]
        metrics = {
            **scorer.metrics(),
            "generation/seconds": gen_s,
            "generation/tokens_per_s": scorer.tokens / gen_s if gen_s > 0 else 0.0,
            "data/dropped_prompts_too_long": float(totals["dropped_long"]),
            "data/grading_seconds": totals["grading_seconds"],
            **refill_metrics,
        }
        return groups, metrics

    def _generate_round(self, step: int, refill_round: int, count: int, scorer: "_Scorer", totals: dict[str, Any]
                        ) -> list[Group]:
        """One generation round of rollout batch `step`: `count` prompts, `group_size` completions each, graded into
        groups; adds its generation and grading seconds and too-long prompts to `totals`."""
        ctx = self.ctx
        prompts, ids, dropped_long = self._tokenized_prompts(step, refill_round, count)
        # Completions never push a sequence past max_seq_len (it would be dropped by the batcher).
        max_tokens = min(self.max_new_tokens, ctx.max_seq_len - max(len(x) for x in ids))
        t0 = time.monotonic()
        outs = ctx.generation.generate(
            ids, n=self.group_size, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            logprobs=self.rollout_logprobs, **self._sampling_seed(step, refill_round), **self._min_tokens(max_tokens),
        )
        t1 = time.monotonic()
        totals["seconds"] += t1 - t0
        totals["dropped_long"] += dropped_long
        grades = self._grade(prompts, outs, scorer)
        totals["grading_seconds"] += time.monotonic() - t1
        return [self._group(prompt_ids, completions, grades[i * self.group_size:(i + 1) * self.group_size], max_tokens)
                for i, (prompt_ids, completions) in enumerate(zip(ids, outs))]

    def _grade(self, prompts: list[Prompt], outs: list[list[Any]], scorer: "_Scorer") -> list[Grade]:
        """The grades of every completion of `outs` (prompt by prompt), recorded in `scorer`."""
        # Graded on the text the tokens decode to, without special tokens (EOS is not an answer character). Decoded
        # here, once, so the requests ask the server not to detokenize (6 % of generation on the CPU engine).
        with self._lock:
            pairs = [(prompt, self.ctx.tokenizer.decode(c.token_ids, skip_special_tokens=True))
                     for prompt, completions in zip(prompts, outs) for c in completions]
        pending = self.grader.submit(pairs)
        grades = pending.result()
        scorer.graded += pending.distinct
        for completion, grade in zip((c for completions in outs for c in completions), grades):
            scorer.record(completion, grade)
        return grades

    def _min_tokens(self, max_tokens: int) -> dict[str, int]:
        """vLLM's `min_tokens` of a request when data.min_new_tokens is set (never above this round's cap)."""
        return {"min_tokens": min(self.min_new_tokens, max_tokens)} if self.min_new_tokens > 0 else {}

    def _sampling_seed(self, step: int, refill_round: int = 0) -> dict[str, int]:
        """The step's base seed, or nothing when seeded_sampling is off.

        Seeded, a run re-run from its saved config draws the same rollouts (same weights, same server settings), so
        its first step reproduces; the client gives each prompt its own seeds from this base. vLLM draws seeded
        requests one by one with their own generators, so unseeded sampling is faster (5 % of generation on CPU, up
        to a quarter on a GPU host: bench/gpu/README.md).
        """
        if not self.seeded_sampling:
            return {}
        # A refill round's base lies 2^20 steps on (no run has that many), so its streams are its own.
        return {"seed": (self.ctx.seed * 1_000_003 + step + (refill_round << 20)) % (2**31)}

    def _group(self, prompt_ids: list[int], completions: list, grades: list[Grade], max_tokens: int) -> Group:
        group = Group.sampled(
            prompt_ids, [c.token_ids for c in completions], [c.logprobs for c in completions],
            [g.total for g in grades], self.temperature,
            # The server's versions when the requests were admitted and when they finished: a sync that landed
            # during generation (asynchronous rollouts) makes them differ.
            weight_version=min(c.weight_version for c in completions),
            # What loss.mask_truncated and loss.overlong_buffer act on (grpo.algorithms.overlong).
            truncated=[c.finish_reason == "length" for c in completions], max_new_tokens=max_tokens,
        )
        group.last_weight_version = max(c.last_weight_version for c in completions)
        return group

    def close(self) -> None:
        self.grader.close()


class _Scorer:
    """Keeps one rollout batch's reward and length figures, per completion (a completion graded once for several
    identical ones counts as each of them)."""

    def __init__(self, rewards: dict[str, tuple[Any, float]]) -> None:
        self.per_reward: dict[str, list[float]] = {name: [] for name in rewards}
        self.totals: list[float] = []
        self.lengths: list[int] = []
        self.truncated = 0
        # Distinct (prompt, text) pairs graded (grpo.pipeline.grading deduplicates within a round).
        self.graded = 0

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def record(self, completion: Any, grade: Grade) -> None:
        for name, r in grade.values.items():
            self.per_reward[name].append(r)
        self.totals.append(grade.total)
        self.lengths.append(len(completion.token_ids))
        self.truncated += completion.finish_reason == "length"

    def metrics(self) -> dict[str, float]:
        n = len(self.lengths)
        return {
            **{f"reward/{name}": sum(v) / len(v) for name, v in self.per_reward.items()},
            "reward/weighted": sum(self.totals) / n,
            "completion/mean_tokens": self.tokens / n,
            "completion/max_tokens": float(max(self.lengths)),
            "completion/truncated_fraction": self.truncated / n,
            "data/graded_fraction": self.graded / n,
        }
