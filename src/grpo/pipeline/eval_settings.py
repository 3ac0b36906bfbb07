"""The held-out evaluator's own settings (conf/eval/): whether the run evaluates, the eval.* values it refuses (its
start-up checks against the run: `check_evaluator_config`), and the rewards it grades with (a math-verify reward
always grades literally, so that an echoed question never counts as correct)."""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

from hydra.utils import get_class

from grpo.config_values import CheckContext, ConfigError
from grpo.tasks.rewards import MathVerifyReward

log = logging.getLogger("grpo.pipeline.evaluation")


# The training data's settings an agent's evaluation plays its episodes with (grpo.pipeline.agent_eval).
AGENT_EVAL_KEYS = ("rollout", "chat_template", "tool_parser", "max_requests", "episode_timeout_s")

# An eval of its own for data=atropos, as typed on the command line: eval.task and eval.rewards are null in the
# config, so their keys need the + of a key Hydra adds (without it: "Could not override 'eval.task._target_'").
ATROPOS_EVAL_EXAMPLE = ("+eval.task._target_=grpo.tasks.prompts.GSM8KTask +eval.task.eval_size=12 "
                        "+eval.rewards.correct._target_=grpo.tasks.rewards.MathAnswerReward")


def eval_task(eval_cfg: Any, data_cfg: Any) -> Any:
    """The task node evaluated: `eval.task`, else the training data's (None for data=atropos)."""
    train_task = data_cfg.get("task") if hasattr(data_cfg, "get") else None
    return eval_cfg.get("task") or train_task


def eval_enabled(eval_cfg: Any, data_cfg: Any) -> bool:
    """Whether the run evaluates: `eval.enabled`, or when null, whether there is a task to evaluate."""
    enabled = eval_cfg.get("enabled")
    if enabled is None:
        return eval_task(eval_cfg, data_cfg) is not None
    return bool(enabled)


def check_evaluator_config(cfg: Any, ctx: CheckContext) -> None:
    """The evaluator's start-up checks (`Evaluator.check_config`): eval settings a run that does not evaluate would
    ignore, and a priority the server would refuse."""
    check_eval_settings_used(cfg, ctx)
    check_eval_priority(cfg)


def check_eval_settings_used(cfg: Any, ctx: CheckContext) -> None:
    """`eval.*` on the command line of a run that does not evaluate (eval=off, or data=atropos without eval.task):
    the evaluator is never built, so `eval.every=5` would be silently ignored. Not in a sweep."""
    given = [o for o in ctx.overrides if o.lstrip("+~").startswith("eval.")
             and not o.lstrip("+~").startswith(("eval.enabled=", "eval.task"))]
    if not given or ctx.multirun or eval_enabled(cfg.eval, cfg.data):
        return
    if cfg.eval.get("enabled") is False:
        why, fix = "eval.enabled=false (eval=off)", "drop eval=off (or set eval.enabled=true)"
    else:
        why, fix = "the training data (data=atropos) has no task to evaluate", f"name one: {ATROPOS_EVAL_EXAMPLE}"
    raise ConfigError(f"{' '.join(given)} would be ignored: this run does not evaluate, as {why}; to evaluate {fix}, "
                      "else drop the eval settings")


def check_eval_priority(cfg: Any) -> None:
    """`eval.priority` (a request's vLLM scheduling priority) with a server the run launches that schedules first come,
    first served (`server.scheduling_policy`, or --scheduling-policy in server.extra_args): vLLM would ignore the
    priority, so the server refuses it, and the run would stop at its first evaluation. A server started elsewhere
    answers for itself."""
    if not cfg.eval.get("priority") or not eval_enabled(cfg.eval, cfg.data):
        return
    if cfg.server.get("external_url") or cfg.server.get("external_urls"):
        return
    policy, extra = cfg.server.get("scheduling_policy"), [str(a) for a in cfg.server.get("extra_args") or []]
    for i, arg in enumerate(extra):  # vLLM takes the last one given
        if arg == "--scheduling-policy" and i + 1 < len(extra):
            policy = extra[i + 1]
        elif arg.startswith("--scheduling-policy="):
            policy = arg.split("=", 1)[1]
    if str(policy) != "priority":
        raise ConfigError(f"eval.priority={cfg.eval.priority} needs a server that schedules by priority, and this "
                          f"run's schedules {policy or 'fcfs'!r}: set server.scheduling_policy=priority, or "
                          "eval.priority=0 (the evaluation's requests then compete with the rollouts')")


def check_eval_settings(every: int, k: int, samples_per_prompt: int, sampled_every: Optional[int],
                        temperature: float, top_p: float, max_new_tokens: int, max_concurrency: int,
                        samples_logged: int, max_in_flight: Optional[int] = None) -> None:
    """The evaluator's own settings, refused with the eval.* key to change (ValueError: build_evaluator makes it a
    ConfigError)."""
    if k < 1 or samples_per_prompt < k:
        raise ValueError(f"eval.k must be >= 1 and <= eval.samples_per_prompt, got k={k}, "
                         f"samples_per_prompt={samples_per_prompt}")
    if temperature <= 0:
        raise ValueError(f"eval.temperature must be > 0 (it is the pass@k sampling temperature), got {temperature}")
    if not 0 < top_p <= 1:  # vLLM refuses it on the first eval request, after the server's start-up
        raise ValueError(f"eval.top_p must be in (0, 1] (1 = the whole distribution), got {top_p}")
    if sampled_every is not None and sampled_every < 0:
        raise ValueError(f"eval.sampled_every must be >= 0 (0: the sampled completions at step 0's and the last "
                         f"step's evaluations only; null: at every one), got {sampled_every}")
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError(f"eval.max_in_flight must be >= 1 (sequences in flight) or null (no bound), got {max_in_flight}")
    if every < 0 or max_new_tokens < 1 or max_concurrency < 1 or samples_logged < 0:
        raise ValueError("eval.every, eval.samples_logged must be >= 0 and eval.max_new_tokens, "
                         f"eval.max_concurrency >= 1, got {every}, {samples_logged}, {max_new_tokens}, {max_concurrency}")


def literal_eval_rewards(rewards: Mapping[str, Any]) -> dict[str, Any]:
    """`rewards` as the evaluator grades with them: a math-verify reward that training runs with
    `literal_answer: false` grades held-out answers literally wherever the reference is a value ("auto"), so that an
    echoed question ("73 + 84 =", which math-verify evaluates to the answer) never counts as correct."""
    out: dict[str, Any] = {}
    for name, spec in rewards.items():
        if isinstance(spec, tuple) or not (isinstance(spec, Mapping) or type(spec).__name__ == "DictConfig"):
            fn = spec[0] if isinstance(spec, tuple) else spec
            if isinstance(fn, MathVerifyReward) and fn.literal_answer is False:
                raise ValueError(f"eval reward {name!r} is a MathVerifyReward with literal_answer=False, which counts an "
                                 "echoed question as correct: give the evaluator one with literal_answer='auto'")
            out[str(name)] = spec
            continue
        target = spec.get("_target_")
        try:
            is_math_verify = bool(target) and issubclass(get_class(str(target)), MathVerifyReward)
        except Exception:  # not importable here: build_rewards names the problem
            is_math_verify = False
        if is_math_verify and spec.get("literal_answer") is False:
            log.info("eval: reward %r grades answers literally (literal_answer=auto): an echoed question never counts "
                     "as correct, whatever training's literal_answer=false pays", name)
            spec = {**dict(spec), "literal_answer": "auto"}
        out[str(name)] = spec
    return out
