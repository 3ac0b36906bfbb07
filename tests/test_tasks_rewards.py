"""Built-in tasks and reward functions on hand-written examples."""

from __future__ import annotations

import json
import random

import pytest

from grpo.tasks.prompts import MINI_GSM8K, DigitsTask, GSM8KTask, Prompt, gsm8k_final_answer
from grpo.tasks.rewards import (
    AnswerFormatReward,
    DigitFractionReward,
    MathAnswerReward,
    last_number,
    parse_number,
)


def test_digit_fraction():
    r, p = DigitFractionReward(), Prompt("abc")
    assert r(p, "") == 0.0
    assert r(p, "1234") == 1.0
    assert r(p, "ab12") == 0.5
    assert r(p, "x 9") == pytest.approx(1 / 3)
    assert r(p, "٣٤") == 0.0  # Arabic-Indic digits are not ASCII digits


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("so the answer is 42", "42", 1.0),
        ("6*7 = 42\n#### 42", "42", 1.0),
        ("first 10, then 41", "42", 0.0),
        ("42 apples, then 7 left", "42", 0.0),  # the last number counts
        ("It costs $1,234.", "1234", 1.0),
        ("The total is 12.50 dollars", "12.5", 1.0),
        ("#### -5", "-5", 1.0),
        ("\\boxed{18}", "18", 1.0),
        ("no number here", "3", 0.0),
        ("", "3", 0.0),
    ],
)
def test_math_answer(completion, answer, expected):
    assert MathAnswerReward()(Prompt("q", answer), completion) == expected


def test_math_answer_without_reference():
    assert MathAnswerReward()(Prompt("q", None), "42") == 0.0


def test_answer_format():
    r, p = AnswerFormatReward(), Prompt("q", "7")
    assert r(p, "work...\n#### 7") == 1.0
    assert r(p, "#### 1,000") == 1.0
    assert r(p, "The answer is \\boxed{12}.") == 1.0
    assert r(p, "The answer is 7") == 0.0
    assert r(p, "#### seven") == 0.0


def test_number_parsing():
    assert parse_number("$1,000") == 1000.0
    assert parse_number("7.") == 7.0
    assert parse_number("abc") is None
    assert last_number("a 1 b -2.5 c") == -2.5
    assert gsm8k_final_answer("He pays 3*4=<<3*4=12>>12 dollars.\n#### 1,200") == "1200"


def test_digits_task_is_deterministic():
    t = DigitsTask(prompt_chars=6)
    a, b = t.sample(random.Random(3), 5), t.sample(random.Random(3), 5)
    assert a == b and len(a) == 5
    assert all(len(p.text) == 6 and p.text.isalpha() and p.text.islower() and p.answer is None for p in a)
    assert t.sample(random.Random(4), 5) != a
    with pytest.raises(ValueError):
        DigitsTask(prompt_chars=0)


def test_shipped_gsm8k_set_is_consistent():
    rows = [json.loads(line) for line in MINI_GSM8K.read_text().splitlines()]
    assert len(rows) >= 50
    reward = MathAnswerReward()
    for row in rows:
        # The worked solution itself scores full marks: its last number is the final answer.
        final = gsm8k_final_answer(row["answer"])
        assert reward(Prompt(row["question"], final), row["answer"]) == 1.0
        assert AnswerFormatReward()(Prompt(row["question"], final), row["answer"]) == 1.0


def test_gsm8k_task_plain_and_chat(tmp_path, tiny_qwen2_dir):
    from transformers import AutoTokenizer

    path = tmp_path / "mini.jsonl"
    path.write_text(
        json.dumps({"question": "What is 2 + 3?", "answer": "2+3=<<2+3=5>>5\n#### 5"}) + "\n\n"
        + json.dumps({"question": "What is 1,000 + 1?", "answer": "#### 1,001"}) + "\n"
    )
    task = GSM8KTask(path=str(path), chat_template=True)
    prompts = task.sample(random.Random(0), 20)
    assert {p.answer for p in prompts} == {"5", "1001"}
    assert all(p.text.endswith("Answer:") and "####" in p.text for p in prompts)  # no tokenizer yet: plain text
    task.bind_tokenizer(AutoTokenizer.from_pretrained(tiny_qwen2_dir))
    chat = task.sample(random.Random(0), 2)
    assert chat[0].text.startswith("<|im_start|>user\n") and chat[0].text.endswith("<|im_start|>assistant\n")
    assert task.sample(random.Random(0), 2) == chat
    plain = GSM8KTask(path=str(path), chat_template=False)
    plain.bind_tokenizer(AutoTokenizer.from_pretrained(tiny_qwen2_dir))
    assert plain.sample(random.Random(0), 1)[0].text.endswith("Answer:")
    assert len(GSM8KTask().rows) >= 50  # path=None: the shipped offline set


def test_gsm8k_task_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        GSM8KTask(path=str(tmp_path / "nowhere.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        GSM8KTask(path=str(bad))
    no_number = tmp_path / "nonum.jsonl"
    no_number.write_text('{"question": "q", "answer": "#### many"}\n')
    with pytest.raises(ValueError, match="numeric final answer"):
        GSM8KTask(path=str(no_number))
