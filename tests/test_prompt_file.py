"""Issue 22.4: your own task: prompts from JSONL / parquet / a saved HF dataset, rewards from your own module."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from grpo.conf import CONFIG_DIR
from grpo.tasks.prompt_file import PromptFileTask
from grpo.tasks.prompts import Prompt

ROWS = [{"q": f"question {i}", "a": str(i), "extra": i} for i in range(5)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_rows_become_prompts_with_answers_and_sampling_is_seeded(tmp_path):
    task = PromptFileTask(str(write_jsonl(tmp_path / "p.jsonl", ROWS)), prompt_column="q", answer_column="a",
                          template="Q: {prompt}\nA:")
    a = task.sample(random.Random("s"), 20)
    assert a == task.sample(random.Random("s"), 20)
    assert {p.text for p in a} <= {f"Q: question {i}\nA:" for i in range(5)}
    assert all(p.text == f"Q: question {p.answer}\nA:" for p in a)  # each prompt keeps its own row's answer
    assert len({p.answer for p in a}) > 1


def test_parquet_and_saved_hf_dataset_read_like_jsonl(tmp_path):
    pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet")
    from_parquet = PromptFileTask(str(tmp_path / "p.parquet"), prompt_column="q", answer_column="a")
    assert from_parquet.rows == [(f"question {i}", str(i)) for i in range(5)]

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3]), "test": datasets.Dataset.from_list(ROWS[3:])})
    dd.save_to_disk(str(tmp_path / "hf"))
    task = PromptFileTask(str(tmp_path / "hf"), prompt_column="q", answer_column="a", split="train", eval_split="test")
    assert task.rows == [(f"question {i}", str(i)) for i in range(3)]
    assert task.eval_prompts() == [Prompt("question 3", "3"), Prompt("question 4", "4")]
    with pytest.raises(ValueError, match=r"splits \['test', 'train'\]; choose one with data.task.split"):
        PromptFileTask(str(tmp_path / "hf"), prompt_column="q")


def test_missing_column_is_a_clear_error_naming_it_and_the_columns_there(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(KeyError, match=r"no column 'prompt' \(data.task.prompt_column\); its columns are \['a', 'extra', 'q'\]"):
        PromptFileTask(str(path))
    with pytest.raises(KeyError, match=r"no column 'answer' \(data.task.answer_column\)"):
        PromptFileTask(str(path), prompt_column="q", answer_column="answer")
    with pytest.raises(FileNotFoundError, match="no file or directory at"):
        PromptFileTask(str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"q": "x"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not a JSON object"):
        PromptFileTask(str(tmp_path / "bad.jsonl"), prompt_column="q")


def test_a_task_or_reward_that_fails_to_build_names_its_data_key_and_the_cause(tmp_path):
    """A missing file, a missing column, a reward target that does not import, or a reward function given without
    `_partial_` is a ValueError naming the data.* key (train.py prints it as a ConfigError), not Hydra's nested
    InstantiationException."""
    from grpo.pipeline.local import LocalRolloutPipeline

    path = str(write_jsonl(tmp_path / "p.jsonl", ROWS))
    task = {"_target_": "grpo.tasks.prompt_file.PromptFileTask", "path": path, "prompt_column": "q"}
    reward = {"_target_": "grpo.tasks.rewards.DigitFractionReward"}
    with pytest.raises(ValueError, match=r"^data.task \(grpo.tasks.prompt_file.PromptFileTask\): PromptFileTask: no file"):
        LocalRolloutPipeline({**task, "path": str(tmp_path / "missing.jsonl")}, {"r": reward})
    with pytest.raises(ValueError, match=r"^data.task .*: PromptFileTask: row 0 of .* has no column 'question'"):
        LocalRolloutPipeline({**task, "prompt_column": "question"}, {"r": reward})
    with pytest.raises(ValueError, match=r"^data.rewards.r \(grpo.tasks.rewards.NoSuchReward\): Error loading"):
        LocalRolloutPipeline(task, {"r": {"_target_": "grpo.tasks.rewards.NoSuchReward"}})
    with pytest.raises(ValueError, match=r"missing 1 required positional argument.* is a function: .* set "
                                         r"data.rewards.r._partial_=true"):
        LocalRolloutPipeline(task, {"r": {"_target_": "grpo.tasks.rewards.parse_number"}})
    assert len(LocalRolloutPipeline(task, {"r": reward}).rewards) == 1  # a good config still builds


def test_eval_prompts_come_from_eval_path_or_a_clear_error(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:3])
    held_out = write_jsonl(tmp_path / "eval.jsonl", ROWS[3:])
    task = PromptFileTask(str(train), prompt_column="q", answer_column="a", eval_path=str(held_out))
    assert [p.answer for p in task.eval_prompts()] == ["3", "4"]
    with pytest.raises(ValueError, match="no held-out prompts: set data.task.eval_path"):
        PromptFileTask(str(train), prompt_column="q").eval_prompts()


def test_can_sample_says_which_rendered_prompts_training_draws(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:3])
    task = PromptFileTask(str(train), prompt_column="q", template="Q: {prompt}\nA:",
                          eval_path=str(write_jsonl(tmp_path / "eval.jsonl", ROWS[2:])))
    assert task.can_sample(Prompt("Q: question 0\nA:")) and not task.can_sample(Prompt("question 0"))
    # The evaluator's disjointness check: row 2 is in both files, so one held-out prompt could be trained on.
    assert [task.can_sample(p) for p in task.eval_prompts()] == [True, False, False]


def test_the_readme_template_example_gives_prompts_with_a_newline(tmp_path):
    """README's `data.task.template="Question: {prompt}\\nAnswer:"` was a Hydra parse error as a shell passes it (the
    shell drops the double quotes, and Hydra reads the braces as a dict); quoted for Hydra, `\\n` reached the task as
    a backslash and an n, and every prompt read 'Question: ...\\nAnswer:' on one line."""
    import re
    import shlex

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.config import register_configs

    readme = (Path(__file__).resolve().parents[1] / "docs" / "own_task.md").read_text()
    example = re.search(r"`('data\.task\.template=[^`]*)`", readme).group(1)
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["~experiment", "data=prompt_file", "data.task.path=x",
                                                      *shlex.split(example)])
    task = PromptFileTask(str(write_jsonl(tmp_path / "p.jsonl", ROWS)), prompt_column="q",
                          template=cfg.data.task.template)
    assert task.sample(random.Random("s"), 1)[0].text.startswith("Question: question ")
    assert {p.text.split("\n")[1] for p in task.sample(random.Random("s"), 5)} == {"Answer:"}
