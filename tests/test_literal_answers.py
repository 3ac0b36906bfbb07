"""math-verify evaluates expressions, so a completion that echoes the question ("73 + 84 =") equals the answer to it.
Wherever the reference answer is a number, the rewards of data=local_gsm8k and data=gsm8k require it stated as a
value, in training and in the evaluator (which never counts an echo, whatever training pays)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.conf import CONFIG_DIR
from grpo.tasks.prompts import Prompt

pytest.importorskip("math_verify")

QUESTION = "73 + 84 ="
ECHOES = ["73 + 84 =", "73 + 84", "#### 73 + 84"]
RIGHT = ["157", "73 + 84 = 157", "#### 157", "The answer is \\boxed{157}."]


def _rows(path: Path, pairs: list[tuple[int, int]]) -> str:
    path.write_text("".join(json.dumps({"question": f"{a} + {b} =", "answer": f"{a}+{b} = {a + b}\n#### {a + b}"}) + "\n"
                            for a, b in pairs), encoding="utf-8")
    return str(path)


def _cfg(data: str, tmp_path: Path, *overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.config import register_configs

    train = _rows(tmp_path / "train.jsonl", [(a, a + 11) for a in range(10, 40)])
    held = _rows(tmp_path / "test.jsonl", [(73, 84), (12, 30)])
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[f"data={data}", f"data.task.path={train}",
                                                       f"data.task.eval_path={held}", *overrides])


def _training_and_eval_grades(cfg, texts: list[str]) -> tuple[list[float], list[float]]:
    from hydra.utils import instantiate

    from grpo.pipeline.evaluation import build_evaluator

    pipe = instantiate(cfg.data, _recursive_=False)
    evaluator = build_evaluator(cfg.eval, cfg.data)
    prompt = next(p for p in evaluator.task.eval_prompts() if p.answer == "157")
    assert QUESTION in prompt.text
    correct = pipe.rewards["correct"][0]
    training = [correct(prompt, t) for t in texts]
    graded = evaluator.grader.grade([(prompt, t) for t in texts], parses=True)
    return training, [g.values[evaluator.correct_reward] for g in graded]


@pytest.mark.parametrize("data", ["local_gsm8k", "gsm8k"])
def test_an_echoed_question_scores_nothing_in_training_and_eval(data, tmp_path):
    cfg = _cfg(data, tmp_path)
    training, evaluated = _training_and_eval_grades(cfg, ECHOES + RIGHT)
    assert training == [0.0] * len(ECHOES) + [1.0] * len(RIGHT)
    assert evaluated == training


def test_the_evaluator_never_counts_an_echo_even_when_training_pays_for_it(tmp_path):
    cfg = _cfg("local_gsm8k", tmp_path, "data.rewards.correct.literal_answer=false")
    training, evaluated = _training_and_eval_grades(cfg, ECHOES + RIGHT)
    assert training == [1.0] * (len(ECHOES) + len(RIGHT))  # what the user asked training to pay
    assert evaluated == [0.0] * len(ECHOES) + [1.0] * len(RIGHT)


def test_literal_answer_auto_follows_the_reference():
    from grpo.tasks.rewards import MathVerifyReward

    auto = MathVerifyReward()
    assert auto(Prompt("q", "157"), "73 + 84") == 0.0 and auto(Prompt("q", "157"), "157") == 1.0
    assert auto(Prompt("q", "-60"), "13 - 73") == 0.0 and auto(Prompt("q", "1/2"), "\\boxed{\\frac12}") == 1.0
    # A reference that is itself an expression is graded by value: an equivalent expression scores.
    assert auto(Prompt("q", "x + 1"), "1 + x") == 1.0
    with pytest.raises(ValueError, match="literal_answer"):
        MathVerifyReward(literal_answer="sometimes")
