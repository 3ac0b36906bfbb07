"""Reward grading in worker processes (data.reward_workers, grpo.pipeline.grading): the same grades as in the
trainer's process, errors that name the reward, each distinct completion graded once, no process left after close(),
and a train.py run that grades in workers."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing import active_children
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import group_option
from grpo.conf import CONFIG_DIR
from grpo.pipeline.generation import GenerationHandle
from grpo.pipeline.grading import Grader, RewardError, picklable_specs
from grpo.pipeline.local import build_rewards
from grpo.tasks.prompts import Prompt

pytest.importorskip("math_verify")

SUM = Prompt("What is 34 + 25? Reply with the final number only.", "59")
DIFF = Prompt("What is 13 - 73? Reply with the final number only.", "-60")
# Right, right as a bare number, wrong, prose, an echoed expression (not a value), empty.
TEXTS = ["34 + 25 = 59.", "59", "60", "The answer is fifty-nine, I think.", "34 + 25", ""]


def _specs() -> dict:
    """chat_arith's rewards (math-verify and the bare number) as the trainer hands them over, and a digit share."""
    rewards = OmegaConf.load(CONFIG_DIR / "data" / "chat_arith.yaml").rewards
    rewards["digits"] = {"_target_": "grpo.tasks.rewards.DigitFractionReward", "weight": 0.5}
    return rewards


def _pairs() -> list[tuple[Prompt, str]]:
    return [(p, t) for p in (SUM, DIFF) for t in TEXTS + ["-60"]]


def _grader(specs, workers: int) -> Grader:
    return Grader(build_rewards(specs), picklable_specs(specs) if workers else None, build_rewards, workers)


class Explodes:
    """A reward that raises on a completion stating 13."""

    def __call__(self, prompt: Prompt, completion: str) -> float:  # noqa: ARG002
        if "13" in completion:
            raise ValueError("cannot grade 13")
        return 0.0


class TimeoutBound:
    """A reward whose value is the timeout math-verify would run under where it is called (0: none)."""

    def __call__(self, prompt: Prompt, completion: str) -> float:  # noqa: ARG002
        from grpo.tasks.rewards import _math_verify_timeouts

        return float(_math_verify_timeouts() or 0)


class KillsItsProcess:
    """A reward whose process dies while grading (as one killed for memory would)."""

    def __call__(self, prompt: Prompt, completion: str) -> float:  # noqa: ARG002
        os._exit(3)


class Counted:
    """A reward that appends each completion it grades to a file of its own (calls counted across processes)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, prompt: Prompt, completion: str) -> float:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{prompt.answer}|{completion}\n")
        return float(completion == prompt.answer)


def test_workers_grade_as_the_trainer_process_does():
    specs = _specs()
    here, pooled = _grader(specs, 0), _grader(specs, 2)
    try:
        expected = here.grade(_pairs(), parses=True)
        assert pooled.grade(_pairs(), parses=True) == expected
        assert pooled.grade(_pairs()) == here.grade(_pairs())  # parsed is None when not asked
    finally:
        pooled.close()
    # The figures the grades must have: right answers score 1 (plus the weighted format and digit shares).
    by_pair = dict(zip(_pairs(), expected))
    assert by_pair[(SUM, "34 + 25 = 59.")].values["correct"] == 1.0
    assert by_pair[(SUM, "59")].total == pytest.approx(1.0 + 0.1 + 0.5)
    assert by_pair[(SUM, "60")].values["correct"] == 0.0 and by_pair[(SUM, "60")].parsed
    assert by_pair[(DIFF, "-60")].values["correct"] == 1.0
    assert by_pair[(SUM, "34 + 25")].values["correct"] == 0.0  # literal_answer: an expression is not a value
    assert by_pair[(SUM, "")].total == 0.0 and not by_pair[(SUM, "")].parsed


def test_workers_grade_under_math_verify_timeouts_name_a_reward_that_raises_and_end_at_close():
    specs = {"ok": {"_target_": "grpo.tasks.rewards.BareNumberReward"},
             "fragile": {"_target_": "test_reward_workers.Explodes", "weight": 0.5},
             "bound": {"_target_": "test_reward_workers.TimeoutBound", "weight": 0.0}}
    before = {p.pid for p in active_children()}
    grader = _grader(specs, 2)
    try:
        grades = grader.grade([(DIFF, "12"), (DIFF, "14")])
        assert [g.total for g in grades] == [1.0, 1.0]
        # Graded on the worker's main thread: math-verify's SIGALRM timeouts hold (5 s), unlike on a producer thread.
        assert [g.values["bound"] for g in grades] == [5.0, 5.0]
        with pytest.raises(RewardError, match=r"reward 'fragile' \(Explodes\) raised ValueError: cannot grade 13"):
            grader.grade([(DIFF, "12"), (DIFF, "13")])
        workers = {p.pid for p in active_children()} - before
        assert len(workers) == 2
    finally:
        grader.close()
    assert not workers & {p.pid for p in active_children()}
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_that_dies_is_an_error_not_a_zero_reward():
    grader = _grader({"dies": {"_target_": "test_reward_workers.KillsItsProcess"}}, 1)
    try:
        with pytest.raises(RewardError, match="reward worker process died"):
            grader.grade([(SUM, "59")])
    finally:
        grader.close()


def test_a_reward_the_workers_cannot_receive_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="data.rewards.inline .*reward_workers=0"):
        picklable_specs({"inline": lambda prompt, completion: 0.0})


@pytest.mark.parametrize("workers", [0, 2])
def test_identical_completions_are_graded_once_per_batch_and_counted_per_completion(tmp_path, workers):
    calls = tmp_path / "calls.txt"
    specs = {"counted": {"_target_": "test_reward_workers.Counted", "path": str(calls)}}
    grader = _grader(specs, workers)
    # A converged group (8 x "59"), a group with two distinct texts, and the same text under another prompt.
    pairs = [(SUM, "59")] * 8 + [(DIFF, "-60")] * 5 + [(DIFF, "60")] * 3 + [(DIFF, "59")]
    try:
        pending = grader.submit(pairs)
        grades = pending.result()
    finally:
        grader.close()
    assert sorted(calls.read_text().splitlines()) == ["-60|-60", "-60|59", "-60|60", "59|59"]
    assert pending.distinct == 4
    assert [g.total for g in grades] == [1.0] * 8 + [1.0] * 5 + [0.0] * 3 + [0.0]


# ---------------------------------------------------------------- against the CPU server
@pytest.mark.vllm
def test_rollouts_graded_in_workers_equal_those_graded_in_process(vllm_server, tiny_qwen2_dir):
    """data=arithmetic (an exact-integer reward) through the session's server, seeded: the same groups, scores and
    reward metrics with data.reward_workers=2 as with 0."""
    from hydra.utils import instantiate
    from transformers import AutoTokenizer

    from grpo.inference.client import Endpoint
    from grpo.pipeline.base import PipelineContext

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)

    def batch(workers: int):
        cfg = group_option("data", "arithmetic")
        cfg.prompts_per_step, cfg.group_size, cfg.reward_workers = 4, 4, workers
        pipe = instantiate(cfg, _recursive_=False)
        pipe.setup(PipelineContext(tokenizer=tokenizer,
                                   generation=GenerationHandle(lambda: Endpoint(vllm_server.url, None, 0)),
                                   batch_size=16, max_seq_len=512, run_dir=Path("/tmp"), total_steps=4, start_step=0,
                                   checkpoint_every=5, seed=0))
        try:
            return pipe.rollout_batch(1)
        finally:
            pipe.close()

    (groups0, metrics0), (groups2, metrics2) = batch(0), batch(2)
    assert [(g.tokens, g.scores) for g in groups0] == [(g.tokens, g.scores) for g in groups2]
    timing = ("generation/seconds", "generation/tokens_per_s", "data/grading_seconds")
    assert {k: v for k, v in metrics0.items() if k not in timing} == {
        k: v for k, v in metrics2.items() if k not in timing}
    assert set(metrics0) == set(metrics2)
    assert {"reward/correct", "reward/format", "data/graded_fraction", "data/grading_seconds"} <= set(metrics2)
    assert 0 < metrics2["data/graded_fraction"] <= 1


@pytest.mark.vllm
def test_a_run_grading_in_workers_trains_evaluates_and_leaves_no_process(tmp_path, train_server, tiny_qwen2_dir):
    from test_evaluation import QUICK, _train

    rows = _train(train_server, tiny_qwen2_dir, tmp_path / "run", "data=arithmetic", "data.reward_workers=2",
                  "train.steps=2", "eval.every=0",
                  base=tuple(o for o in QUICK if not o.startswith(("data.task.", "train.steps"))) + (
                      "data.task.heldout_size=8",))
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        assert {"reward/correct", "reward/format", "reward/weighted", "data/graded_fraction", "loss"} <= set(r)
    evaluated = [r for r in rows if "eval/accuracy" in r]  # rows of their own (evaluation beside training)
    assert [r["step"] for r in evaluated] == [0, 2]
    assert all({"eval/accuracy", "eval/pass@k", "eval/unparsed_fraction"} <= set(r) for r in evaluated)


def test_the_workers_start_before_setup_also_under_the_asynchronous_wrapper():
    """The run starts the data's reward workers before it waits for vLLM (`DataPipeline.start_workers`, called by
    grpo.build.build_trainer), not in `setup` after the model's load: a local pipeline's grader spawns them then,
    through AsyncRollouts too, and close() ends them."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    from grpo.config import register_configs
    from grpo.pipeline.rollout_queue import AsyncRollouts

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["data=arithmetic", "data.reward_workers=1"])
    inner = instantiate(cfg.data, _recursive_=False)
    data = AsyncRollouts(inner, 1)
    before = set(active_children())
    assert inner.grader.pool is None
    try:
        data.start_workers()
        assert inner.grader.pool is not None and set(active_children()) - before
    finally:
        data.close()
    assert inner.grader.pool is None and not set(active_children()) - before


def test_a_trainer_whose_workers_grade_never_imports_math_verify_and_one_that_grades_does(tmp_path):
    """math-verify (sympy) is imported by the process that grades, at its first grading: with data.reward_workers the
    trainer's process builds its rewards without the import (seconds before its vLLM launch on a GPU host), and a
    process that grades imports it then and grades as before."""
    code = """
import sys
from omegaconf import OmegaConf
from grpo.conf import CONFIG_DIR
from grpo.pipeline.grading import Grader, picklable_specs
from grpo.pipeline.local import build_rewards
from grpo.tasks.prompts import Prompt
specs = OmegaConf.load(CONFIG_DIR / "data" / "chat_arith.yaml").rewards
rewards = build_rewards(specs)
pool = Grader(rewards, picklable_specs(specs), build_rewards, 1)
print("built", "math_verify" in sys.modules)
grades = pool.grade([(Prompt("What is 34 + 25?", "59"), "34 + 25 = 59.")])
pool.close()
print("workers graded", grades[0].values["correct"], "math_verify" in sys.modules)
grades = Grader(rewards).grade([(Prompt("What is 34 + 25?", "59"), "34 + 25 = 59.")])
print("graded here", grades[0].values["correct"], "math_verify" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["built False", "workers graded 1.0 False", "graded here 1.0 True"]
