"""README "Your own task": a task class of your own making, plugged in by a data option in your config dir
(examples/my_task/conf/data/repeat_words.yaml). The README said a class with `sample(rng, n)` plugs in through
`data.task._target_=...`; done literally, the data option's other task keys went to the class ("RepeatTask() takes
no arguments"), and a class that is not a `Task` died after vLLM's start-up with an AttributeError
(`bind_tokenizer`)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from grpo.config import register_configs, validate
from grpo.pipeline.evaluation import build_evaluator
from grpo.pipeline.tasks import Prompt, Task

REPO = Path(__file__).resolve().parents[1]
register_configs()


def test_the_readme_task_class_example_composes_builds_samples_and_is_evaluated(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # python train.py imports from the checkout root (examples.my_task...)
    monkeypatch.delitem(sys.modules, "examples", raising=False)  # a namespace package found anew from REPO
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        # --config-dir examples/my_task/conf '~experiment' data=repeat_words, as the README's command
        overrides = [f"hydra.searchpath=[file://{REPO / 'examples/my_task/conf'}]", "~experiment", "data=repeat_words"]
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
        validate(cfg, tmp_path / "run")
    assert dict(cfg.data.task) == {"_target_": "examples.my_task.my_words.RepeatWords", "held_out": 4}

    pipeline = instantiate(cfg.data, _recursive_=False)  # as train.py's build_data
    task = pipeline.task
    assert isinstance(task, Task)  # bind_tokenizer and the rest of what the pipeline and the evaluator call
    task.bind_tokenizer(None)
    drawn = task.sample(random.Random(0), 64)
    assert len(drawn) == 64 and all(p.text == f"Repeat the word: {p.answer}\n" for p in drawn)
    assert task.sample(random.Random(0), 64) == drawn  # from the rng only: a resume draws the same prompts

    evaluator = build_evaluator(cfg.eval, cfg.data)  # eval on by default: held-out words, disjoint from training
    assert evaluator is not None
    held_out = {p.answer for p in evaluator.task.eval_prompts()}
    assert len(held_out) == 4 and not held_out & {p.answer for p in drawn}
    assert set(pipeline.rewards) == {"exact", "characters"}
    assert_accuracy_is_the_exact_answer(evaluator)


def assert_accuracy_is_the_exact_answer(evaluator) -> None:
    """Held-out accuracy judges the answer: with the shaped reward (the first, before) "nnnnnnnn" for "window" was
    correct, all its letters being the word's (the example's 0.000 -> 0.250 was such completions)."""
    fn, _ = evaluator.rewards[evaluator.correct_reward]
    window = Prompt("Repeat the word: window\n", answer="window")
    assert fn(window, "window\n") >= evaluator.correct_threshold
    assert fn(window, "nnnnnnnn") < evaluator.correct_threshold


def test_the_example_experiment_judges_held_out_accuracy_by_the_exact_answer(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        # python train.py --config-dir examples/my_task/conf experiment=my_task (from the checkout root)
        overrides = [f"hydra.searchpath=[file://{REPO / 'examples/my_task/conf'}]", "experiment=my_task"]
        cfg = compose(config_name="train", overrides=overrides)
    monkeypatch.chdir(REPO)  # the experiment's file paths are relative to where you run
    evaluator = build_evaluator(cfg.eval, cfg.data)
    assert evaluator.correct_reward == "exact"
    assert_accuracy_is_the_exact_answer(evaluator)
