"""The arithmetic skill task, its parser and rewards, and the warm-start model (transformers and real vLLM CPU engine)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from grpo.conf import CONFIG_DIR
from grpo.tasks.arithmetic import (
    ArithmeticCorrectReward,
    ArithmeticFormatReward,
    ArithmeticTask,
    CarelessTeacher,
    canonical_key,
    careless_answer,
    parse_answer,
)
from grpo.tasks.prompts import Prompt

REPO = Path(__file__).resolve().parents[1]


def _eval(text: str) -> int:
    """Left-to-right + / - of an expression like '47+85-12=' (independent of the task's own arithmetic)."""
    tokens, num, total, sign = text.rstrip("="), "", 0, 1
    for ch in tokens + "+":
        if ch.isdigit():
            num += ch
        else:
            total += sign * int(num)
            num, sign = "", 1 if ch == "+" else -1
    return total


# ------------------------------------------------------------------ generator and held-out set
def test_generator_is_deterministic_and_answers_are_right():
    task = ArithmeticTask()
    a = task.sample(random.Random(7), 200)
    b = ArithmeticTask().sample(random.Random(7), 200)
    assert a == b
    assert a != task.sample(random.Random(8), 200)
    for p in a:
        assert p.text.endswith("=") and " " not in p.text
        assert int(p.answer) == _eval(p.text)
        assert p.text.count("+") + p.text.count("-") == 1  # the default shape: two operands
        assert all(10 <= int(x) <= 99 for x in re.findall(r"\d+", p.text))  # of two digits each


def test_heldout_is_fixed_distinct_and_large_enough():
    task = ArithmeticTask()
    held = task.eval_prompts()
    assert len(held) == 500
    assert held == ArithmeticTask().eval_prompts()  # same list from a fresh instance
    assert len({canonical_key(p.text) for p in held}) == 500
    assert all(int(p.answer) == _eval(p.text) for p in held)
    # Difficulty varies: the held-out set mixes sums and differences, with and without a carry or borrow.
    assert {"+", "-"} <= set("".join(p.text for p in held))
    careless_right = sum(careless_answer(canonical_key(p.text)) == p.answer for p in held)
    assert 0.2 * len(held) < careless_right < 0.6 * len(held)
    # Two 3-operand items of 1-2 digits are another task shape, with its own held-out set.
    wide = ArithmeticTask(max_operands=3, min_digits=1)
    assert {p.text.count("+") + p.text.count("-") + 1 for p in wide.eval_prompts()} == {2, 3}
    assert ArithmeticTask(heldout_seed=1).eval_prompts() != held


def test_training_sampler_never_draws_a_heldout_item():
    task = ArithmeticTask()
    held = {canonical_key(p.text) for p in task.eval_prompts()}
    drawn = [canonical_key(p.text) for p in task.sample(random.Random(0), 100_000)]
    assert not held.intersection(drawn)
    # The test has teeth: the same generator without rejection does produce held-out items.
    raw = ArithmeticTask(heldout_seed=999)  # another held-out set, so the first one is not excluded
    raw_keys = {canonical_key(p.text) for p in raw.sample(random.Random(0), 100_000)}
    assert held & raw_keys


def test_bad_task_arguments_fail_clearly():
    with pytest.raises(ValueError, match="min_operands"):
        ArithmeticTask(min_operands=1)
    with pytest.raises(ValueError, match="max_digits"):
        ArithmeticTask(max_digits=0)
    with pytest.raises(ValueError, match="distinct held-out"):
        ArithmeticTask(min_operands=2, max_operands=2, min_digits=1, max_digits=1, heldout_size=500)  # only 200 items exist


# ------------------------------------------------------------------ parser
@pytest.mark.parametrize("text, value", [
    ("132", 132), ("-7", -7), ("0", 0), (" 42", 42), ("42\n", 42), ("\n 42 \n", 42), ("3996", 3996),
])
def test_parser_accepts_exactly_one_integer(text, value):
    assert parse_answer(text) == value


@pytest.mark.parametrize("text", [
    "",                  # nothing
    "12 13",             # two candidate answers
    "12\n13",            # two answers on two lines
    "maybe 12 or 13",    # hedged
    "12 or 13",
    "12?",
    "about 12",
    "12=",               # trailing junk
    "12.",
    "12.0",
    "12abc",
    "12+1",              # another expression instead of an answer
    "+12",               # sign that is not the stated format
    "012",               # leading zero
    "-0",
    "--5",
    "1,234",
    "12345678",          # digit flood
    "twelve",
    "#### 12",
])
def test_parser_rejects_everything_else(text):
    assert parse_answer(text) is None


# ------------------------------------------------------------------ rewards
def test_correct_and_format_rewards():
    correct, fmt = ArithmeticCorrectReward(), ArithmeticFormatReward()
    p = Prompt("47+85-12=", "120")
    assert correct(p, "120") == 1.0 and fmt(p, "120") == 1.0
    assert correct(p, " 120\n") == 1.0
    assert correct(p, "121") == 0.0 and fmt(p, "121") == 1.0  # well formed, wrong
    assert correct(p, "120 121") == 0.0 and fmt(p, "120 121") == 0.0  # both candidates: nothing
    assert correct(p, "121 120") == 0.0
    assert correct(p, "maybe 120") == 0.0 and fmt(p, "maybe 120") == 0.0
    assert correct(Prompt("1-9=", "-8"), "-8") == 1.0
    assert correct(Prompt("x", None), "1") == 0.0


def test_data_config_builds_the_task_and_rewards():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    from grpo.config import register_configs
    from grpo.pipeline.local import LocalRolloutPipeline

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["data=arithmetic", "model=warm_arith"])
    pipe = instantiate(cfg.data, _recursive_=False)
    assert isinstance(pipe, LocalRolloutPipeline) and isinstance(pipe.task, ArithmeticTask)
    assert set(pipe.rewards) == {"correct", "format"}
    assert pipe.rewards["format"][1] < pipe.rewards["correct"][1]
    assert cfg.model.offline == "warm-arith"
    # The config's task is the one the warm-start preset trained on: same held-out set.
    from grpo.recipes.warmstart import WARMSTART_PRESETS

    preset_task = instantiate(WARMSTART_PRESETS["warm-arith"]["task"])
    assert preset_task.eval_prompts() == pipe.task.eval_prompts()


# ------------------------------------------------------------------ warm-start model
@pytest.fixture(scope="module")
def warm_arith_dir():
    """The warm-start model (built once and cached by content hash: ~1-4 min on 2 CPU cores on a fresh cache)."""
    from grpo.recipes.warmstart import build_warmstart_dir

    return build_warmstart_dir("warm-arith", seed=0, progress=False)


def test_warmstart_cache_key_follows_the_task_data(monkeypatch):
    import copy

    from grpo.recipes import warmstart

    base = warmstart.warmstart_path("warm-arith")
    assert base == warmstart.warmstart_path("warm-arith")  # stable
    assert warmstart.warmstart_path("warm-arith", seed=1) != base
    presets = copy.deepcopy(warmstart.WARMSTART_PRESETS)
    presets["warm-arith"]["task"]["heldout_seed"] = 1  # another held-out set: other SFT data, another model
    monkeypatch.setattr(warmstart, "WARMSTART_PRESETS", presets)
    assert warmstart.warmstart_path("warm-arith") != base
    with pytest.raises(ValueError, match="unknown warm-start preset"):
        warmstart.warmstart_path("warm-nothing")


def test_warmstart_command_names_the_preset_for_a_misspelt_one(capsys):
    """Before, `python -m grpo.recipes.warmstart warm_arith` (the model option's spelling) ended in a ValueError
    traceback."""
    from grpo.recipes import warmstart

    with pytest.raises(SystemExit) as stop:
        warmstart.main(["warm_arith"])
    assert stop.value.code == 2
    assert "error: unknown preset 'warm_arith'; did you mean warm-arith?" in capsys.readouterr().err


@pytest.mark.slow  # builds the warm-start model on a fresh cache (2-4 min on 2 cores): outside CI's 30-minute budget
def test_warmstart_loads_in_transformers_at_its_stated_accuracy(warm_arith_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.recipes.warmstart import generate_answers, read_metadata

    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (warm_arith_dir / name).exists(), name
    meta = read_metadata(warm_arith_dir)
    stated = meta["heldout_greedy_accuracy"]
    assert 0.05 <= stated <= 0.40  # part of the skill: room for GRPO, not zero advantages
    assert 0.0 < meta["sampled_groups_with_variance"]
    tok = AutoTokenizer.from_pretrained(warm_arith_dir)
    model = AutoModelForCausalLM.from_pretrained(warm_arith_dir, dtype=torch.float32).eval()
    task, reward = ArithmeticTask(), ArithmeticCorrectReward()
    held = task.eval_prompts()
    answers = generate_answers(model, tok, [p.text for p in held], max_new_tokens=8)
    accuracy = sum(reward(p, a) for p, a in zip(held, answers)) / len(held)
    assert abs(accuracy - stated) <= 0.05, (accuracy, stated)


@pytest.mark.vllm
@pytest.mark.slow  # same model build as above
def test_warmstart_serves_in_vllm_at_its_stated_accuracy(warm_arith_dir, tmp_path):
    from transformers import AutoTokenizer

    from conftest import server_cfg
    from grpo.inference.client import InferenceClient
    from grpo.inference.process import VLLMServer
    from grpo.recipes.warmstart import read_metadata

    stated = read_metadata(warm_arith_dir)["heldout_greedy_accuracy"]
    tok = AutoTokenizer.from_pretrained(warm_arith_dir)
    task, reward = ArithmeticTask(), ArithmeticCorrectReward()
    held = task.eval_prompts()
    ids = [tok.encode(p.text, add_special_tokens=False) for p in held]
    # 5 % of RAM (~1.2 GiB) is plenty of KV cache for 0.6 M parameters; 20 % fails when other servers share the box.
    server = VLLMServer(warm_arith_dir, server_cfg(kv_cache_gb=0.25), tmp_path / "vllm.log",
                        served_model_name="warm-arith")
    server.start()
    client = InferenceClient(server.url)
    try:
        greedy = client.generate(ids, n=1, max_tokens=8, temperature=0.0, model="warm-arith")
        right = [reward(p, tok.decode(g[0].token_ids, skip_special_tokens=True)) for p, g in zip(held, greedy)]
        accuracy = sum(right) / len(right)
        assert abs(accuracy - stated) <= 0.05, (accuracy, stated)
        # Sampled groups at the task's temperature disagree (GRPO gets non-zero advantages).
        groups = client.generate(ids[:64], n=8, max_tokens=8, temperature=1.0, model="warm-arith", seed=0)
        scores = [[reward(p, tok.decode(c.token_ids, skip_special_tokens=True)) for c in g]
                  for p, g in zip(held[:64], groups)]
        assert sum(max(s) != min(s) for s in scores) >= 8
    finally:
        client.close()
        server.stop()


def test_training_can_sample_says_what_it_draws_so_eval_on_arithmetic_starts():
    """The evaluation component checks its held-out set against what training can draw (`can_sample`)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.config import register_configs
    from grpo.pipeline.evaluation import build_evaluator

    task = ArithmeticTask()
    assert not any(task.can_sample(p) for p in task.eval_prompts())
    drawn = task.sample(random.Random(3), 200)
    assert all(task.can_sample(p) for p in drawn)
    assert not task.can_sample(Prompt("1+2+3+4="))  # four operands: not this task's shape
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["data=arithmetic", "model=warm_arith"])
    evaluator = build_evaluator(cfg.eval, cfg.data)
    assert evaluator is not None


# ------------------------------------------------------------------ the careless teacher of the warm-up
def test_careless_answer_drops_carries_and_borrows_only():
    assert careless_answer("12+34") == "46"  # no carry: right
    assert careless_answer("47+85") == "22"  # 7+5 and 4+8+(no carry) -> 2, 2 (right: 132)
    assert careless_answer("52-27") == "35"  # |2-7|, |5-2| without the borrow (right: 25)
    assert careless_answer("27-89") == "-62"  # 89-27 needs no borrow: right, with the sign
    assert careless_answer("30-75") == "-45"  # 75-30: right


def test_careless_teacher_mixes_right_and_careless_answers_at_its_share():
    task = ArithmeticTask()
    prompts = task.sample(random.Random(0), 2000)
    teacher = CarelessTeacher(share=0.8)
    rng = random.Random(1)
    answers = [teacher(p, rng) for p in prompts]
    hard = [(p, a) for p, a in zip(prompts, answers) if careless_answer(canonical_key(p.text)) != p.answer]
    right_on_hard = sum(a == p.answer for p, a in hard) / len(hard)
    assert 0.15 < right_on_hard < 0.25  # 1 - share of the items that need a carry or a borrow
    assert all(a == p.answer for p, a in zip(prompts, answers) if careless_answer(canonical_key(p.text)) == p.answer)
    with pytest.raises(ValueError, match="share"):
        CarelessTeacher(share=1.5)
