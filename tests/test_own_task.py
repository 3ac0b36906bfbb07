"""docs/own_task.md's example, examples/my_task: your prompts file and reward functions (experiment=my_task), the same
run from the command line alone, and a task class of your own (data=sums).

Issue 44.13: the example taught reward hacking. Its shaped reward (the share of the answer word's letters in the
completion) was climbed by printing `eeeeeeee`, the command-line version kept only that reward and so reported a
held-out accuracy 0.000 -> 0.750 for it, the command line and the experiment differed (60 steps against 30, one
reward against two), and the YAML the docs showed was not the file. Now the example learns the arithmetic skill from
an exact-answer reward, judged on held-out items the model never saw.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from conftest import attach
from grpo.conf import CONFIG_DIR
from grpo.config import register_configs, validate
from grpo.pipeline.evaluation import build_evaluator
from grpo.tasks.arithmetic import ArithmeticTask
from grpo.tasks.prompts import Prompt, Task
from test_readme import bash_blocks, commands
from test_train_e2e import QUICK_SETTINGS, assert_clean, metrics

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "my_task"
PAGE = REPO / "docs" / "own_task.md"
register_configs()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def compose_job(args: list[str]) -> dict:
    """The composed config of `python train.py <args>` (what `--cfg job --resolve` prints), from the checkout root."""
    out = subprocess.run([sys.executable, "train.py", *args, "--cfg", "job", "--resolve"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return yaml.safe_load(out.stdout)


def page_command(*needles: str) -> list[str]:
    """The one command of the page's bash blocks that contains every needle."""
    found = [argv for block in bash_blocks(PAGE.read_text()) for argv in commands(block)
             if all(n in shlex.join(argv) for n in needles)]
    assert len(found) == 1, found
    return found[0]


def test_the_yaml_the_page_shows_is_the_experiment_file():
    shown = re.findall(r"^```yaml\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)
    assert (EXAMPLE / "conf" / "experiment" / "my_task.yaml").read_text() in shown


def test_the_command_line_version_composes_the_same_config_as_the_experiment():
    argv = page_command("'~experiment'", "data=prompt_file")  # as the shell passes it: the quotes are gone
    assert argv[:2] == ["python", "train.py"]
    from_cli = compose_job(argv[2:])
    from_experiment = compose_job(["--config-dir", "examples/my_task/conf", "experiment=my_task"])
    # The experiment's files resolve against its config dir, its functions import from the folder that holds it;
    # the command line names the same files from the checkout root, the same functions by their path from there.
    for key in ("path", "eval_path"):
        assert Path(from_experiment["data"]["task"][key]) == REPO / from_cli["data"]["task"][key]
        from_experiment["data"]["task"][key] = from_cli["data"]["task"][key]
    for name in ("exact", "format"):
        target = from_experiment["data"]["rewards"][name]["_target_"]
        assert from_cli["data"]["rewards"][name]["_target_"] == f"examples.my_task.{target}"
        from_experiment["data"]["rewards"][name]["_target_"] = f"examples.my_task.{target}"
    assert from_cli == from_experiment
    assert from_experiment["model"]["offline"] == "warm-arith" and from_experiment["name"] == "my_task"


def test_the_example_files_hold_out_items_the_warm_start_never_saw():
    train, held_out = read_jsonl(EXAMPLE / "prompts.jsonl"), read_jsonl(EXAMPLE / "eval_prompts.jsonl")
    assert len(train) == 2000 and len(held_out) == 500
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    task = ArithmeticTask()  # the warm-start model's supervised data never holds one of its held-out items
    assert all(task.is_heldout(r["question"]) for r in held_out)
    for row in train + held_out:  # the reference answers are right
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", row["question"]).groups()
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_only_the_right_answer_earns_the_reward_that_judges_held_out_accuracy():
    from examples.my_task.my_rewards import exact_answer, one_integer

    p = Prompt("47+85=", answer="132")
    assert exact_answer(p, "132") == 1.0 and exact_answer(p, " 132\n") == 1.0
    for hack in ("", "eeeeeeee", "1320", "132 132", "13", "132=", "+132", "22"):
        assert exact_answer(p, hack) == 0.0, hack
    assert one_integer(p, "22") == 1.0 and one_integer(p, "-7") == 1.0  # right or wrong: the format only
    assert one_integer(p, "12 13") == 0.0 and one_integer(p, "007") == 0.0 and one_integer(p, "") == 0.0


def test_the_example_experiment_judges_held_out_accuracy_by_the_exact_answer(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(EXAMPLE))  # what train.py does for --config-dir: the folder holding it
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        # python train.py --config-dir examples/my_task/conf experiment=my_task
        overrides = [f"hydra.searchpath=[file://{EXAMPLE / 'conf'}]", "experiment=my_task"]
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    monkeypatch.chdir(tmp_path)  # the experiment's files resolve against its config dir, not where you run
    evaluator = build_evaluator(cfg.eval, cfg.data)
    assert evaluator.correct_reward == "exact"
    assert len(evaluator.task.eval_prompts()) == 500
    fn, _ = evaluator.rewards[evaluator.correct_reward]
    assert fn(Prompt("47+85=", answer="132"), "132") >= evaluator.correct_threshold
    assert fn(Prompt("47+85=", answer="132"), "22") < evaluator.correct_threshold
    pipeline = instantiate(cfg.data, _recursive_=False)
    assert {name: w for name, (_, w) in pipeline.rewards.items()} == {"exact": 1.0, "format": 0.1}


def test_the_task_class_example_composes_builds_samples_and_is_evaluated(tmp_path, monkeypatch):
    """The page's task-class command. Before, `data.task._target_=...` on the command line handed the data option's
    other task keys to the class ("takes no arguments"), and a class that is not a `Task` died after vLLM's start-up
    (`bind_tokenizer`)."""
    argv = page_command("data=sums")
    monkeypatch.syspath_prepend(str(EXAMPLE))  # train.py puts the folder holding --config-dir on the path
    monkeypatch.chdir(tmp_path)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        config_dir = argv[argv.index("--config-dir") + 1]
        overrides = [f"hydra.searchpath=[file://{REPO / config_dir}]",
                     *argv[argv.index("--config-dir") + 2:]]
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
        validate(cfg, tmp_path / "run")
    assert dict(cfg.data.task) == {"_target_": "my_sums.SumsAndDifferences",
                                   "eval_path": str(EXAMPLE / "eval_prompts.jsonl")}

    pipeline = instantiate(cfg.data, _recursive_=False)  # as train.py's build_data
    task = pipeline.task
    assert isinstance(task, Task)  # bind_tokenizer and the rest of what the pipeline and the evaluator call
    task.bind_tokenizer(None)
    drawn = task.sample(random.Random(0), 256)
    assert len(drawn) == 256 and task.sample(random.Random(0), 256) == drawn  # from the rng only
    assert all(re.fullmatch(r"\d\d[+-]\d\d=", p.text) for p in drawn)

    evaluator = build_evaluator(cfg.eval, cfg.data)  # eval on by default: the held-out file, disjoint from training
    assert evaluator is not None and evaluator.correct_reward in (None, "exact")
    held_out = {p.text for p in evaluator.task.eval_prompts()}
    assert len(held_out) == 500 and not held_out & {p.text for p in drawn}
    assert not any(task.can_sample(p) for p in evaluator.task.eval_prompts())
    assert set(pipeline.rewards) == {"exact", "format"}


def test_a_target_that_does_not_import_says_where_modules_are_found():
    """Before: "No module named 'examples'", with no word of where modules are looked for."""
    from grpo.pipeline.local import build_rewards

    with pytest.raises(ValueError) as e:
        build_rewards({"mine": {"_target_": "no_such_module_of_yours.reward", "_partial_": True}})
    message = str(e.value)
    assert message.startswith("data.rewards.mine (no_such_module_of_yours.reward): ")
    for where in ("the directory you run in", "the folder that holds your --config-dir", "PYTHONPATH="):
        assert where in message


@pytest.mark.vllm
def test_the_example_task_trains_two_steps_with_the_real_engine(tmp_path, train_server, tiny_qwen2_dir):
    # On the session's shared vLLM server (conftest.train_server, back on the initial weights): what is tested is the
    # user's task and rewards in a real run (model=tiny_qwen2: the weights that server holds; learning is measured
    # in bench/README.md, "Your own task"); a run's own server start and stop are tested in tests/test_train_e2e.py.
    # Run as `cd ~ && grpo-train --config-dir <checkout>/examples/my_task/conf experiment=my_task` (the console
    # script's code, with only the package on the path, from a directory outside the checkout): the example's files
    # resolve against its config dir and its reward module imports from the folder holding it. Before, the files
    # were looked for under the working directory and `examples.my_task.my_rewards` did not import.
    import grpo

    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    run = tmp_path / "run"
    external, server_env = attach(train_server, tiny_qwen2_dir)
    marker = f"GRPO_TEST_{uuid.uuid4().hex}"
    env = dict(os.environ, **server_env, GRPO_TEST_MARKER=marker, PYTHONUNBUFFERED="1",
               PYTHONPATH=str(Path(grpo.__file__).resolve().parents[1]))
    out = subprocess.run(
        # Evaluation left on (the default, as a user runs it): the held-out file is read, checked against the
        # training prompts, and scored before the first step and after the last.
        [sys.executable, "-c", "from grpo.train import run; run()", "--config-dir", str(EXAMPLE / "conf"),
         "experiment=my_task", "model=tiny_qwen2",
         *[s for s in QUICK_SETTINGS if s != "eval=off"], "eval.samples_per_prompt=2", "eval.k=2",
         "train.steps=2", external, f"hydra.run.dir={run}"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert_clean(marker)
    rows = metrics(run)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    evaluated = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evaluated] == [0, 2] and all(r["eval/prompts"] == 500 for r in evaluated)
    for r in (r for r in rows if "loss" in r):
        assert 0.0 <= r["reward/exact"] <= 1.0 and 0.0 <= r["reward/format"] <= 1.0
        assert r["reward/weighted"] == pytest.approx(r["reward/exact"] + 0.1 * r["reward/format"], abs=1e-6)
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
