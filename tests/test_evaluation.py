"""Held-out evaluation (grpo.pipeline.evaluation): pass@k estimator, disjoint splits, the evaluator on the real
vLLM engine, and eval inside a `train.py` run (rows at step 0, every N and the end; training unchanged by eval)."""

from __future__ import annotations

import itertools
import json
import logging
import random
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import attach
from grpo.conf import CONFIG_DIR
from grpo.pipeline.evaluation import EvalContext, Evaluator, build_evaluator, pass_at_k
from grpo.pipeline.generation import GenerationHandle
from grpo.tasks.prompts import MINI_GSM8K, DigitsTask, GSM8KTask, Prompt
from grpo.tasks.rewards import DigitFractionReward, MathAnswerReward

DIGITS = {"_target_": "grpo.tasks.prompts.DigitsTask", "prompt_chars": 8, "eval_size": 6}
DIGIT_REWARDS = {"digits": {"_target_": "grpo.tasks.rewards.DigitFractionReward", "weight": 1.0}}


# ---------------------------------------------------------------- pass@k
def brute_force_pass_at_k(correct: list[bool], k: int) -> float:
    """Share of all k-subsets of the samples that hold at least one correct sample."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("correct", [
    [False] * 6,
    [True] + [False] * 7,
    [False, True, False, False, True, False, False, False, False, True],
    [True, True, False, True, False, True, True, False],
    [True] * 5,
])
def test_pass_at_k_matches_brute_force_over_all_subsets(correct):
    n, c = len(correct), sum(correct)
    for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(correct, k), abs=1e-12), (n, c, k)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 2)]:
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)


# ---------------------------------------------------------------- held-out splits
def test_digits_held_out_split_is_fixed_and_never_sampled():
    # 2 characters: 676 possible prompts, so training draws cover every one of them that is not held out.
    task = DigitsTask(prompt_chars=2, eval_size=50)
    held = [p.text for p in task.eval_prompts()]
    assert len(set(held)) == 50 and held == [p.text for p in DigitsTask(prompt_chars=2, eval_size=50).eval_prompts()]
    drawn = {p.text for p in task.sample(random.Random(0), 20_000)}
    assert drawn.isdisjoint(held)
    assert len(drawn) == 26**2 - 50  # every other prompt is drawn: the exclusion removed exactly the held-out ones
    assert not any(task.can_sample(p) for p in task.eval_prompts())
    assert all(task.can_sample(Prompt(t)) for t in drawn)
    # The default shape: 8 characters, and the training stream is what it was before the split existed.
    default = DigitsTask()
    assert not any(default.can_sample(p) for p in default.eval_prompts())
    rng_a, rng_b = random.Random(5), random.Random(5)
    letters = "abcdefghijklmnopqrstuvwxyz"
    assert [p.text for p in default.sample(rng_a, 50)] == [
        "".join(rng_b.choice(letters) for _ in range(8)) for _ in range(50)
    ]
    with pytest.raises(ValueError, match="eval_size"):
        DigitsTask(prompt_chars=1, eval_size=20)
    with pytest.raises(ValueError, match="eval_size=0"):
        DigitsTask(eval_size=0).eval_prompts()


def test_gsm8k_held_out_split_of_rows_and_eval_file(tmp_path):
    task = GSM8KTask(eval_size=12, chat_template=False)
    all_rows = GSM8KTask(chat_template=False).rows
    held = {p.text for p in task.eval_prompts()}
    assert len(held) == 12 and len(task.rows) == len(all_rows) - 12
    assert held == {p.text for p in GSM8KTask(eval_size=12, chat_template=False).eval_prompts()}  # deterministic
    drawn = task.sample(random.Random(0), 2000)
    assert {p.text for p in drawn}.isdisjoint(held)
    assert len({p.text for p in drawn}) == len(task.rows)
    assert not any(task.can_sample(p) for p in task.eval_prompts()) and all(task.can_sample(p) for p in drawn)

    # A separate eval file: training keeps every row of its own file; an overlap is refused with a count.
    rows = [json.loads(x) for x in MINI_GSM8K.read_text().splitlines() if x.strip()]
    overlapping = tmp_path / "overlap.jsonl"
    overlapping.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    with pytest.raises(ValueError, match="3 of the 3 eval questions"):
        GSM8KTask(eval_path=str(overlapping))
    train_file, test_file = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows[5:]))
    test_file.write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    split = GSM8KTask(path=str(train_file), eval_path=str(test_file), eval_size=4, chat_template=False)
    assert len(split.rows) == len(rows) - 5 and [p.answer for p in split.eval_prompts()] == [
        GSM8KTask(path=str(test_file)).rows[i][1] for i in range(4)
    ]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no rows"):
        GSM8KTask(eval_path=str(empty))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        GSM8KTask(eval_path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="no held-out rows"):
        GSM8KTask().eval_prompts()


# ---------------------------------------------------------------- configuration
def test_build_evaluator_defaults_and_bad_input():
    local = OmegaConf.create({"task": DIGITS, "rewards": DIGIT_REWARDS, "max_new_tokens": 8})
    atropos = OmegaConf.create({"_target_": "grpo.pipeline.atropos.AtroposPipeline", "url": "http://x"})
    node = {"_target_": "grpo.pipeline.evaluation.Evaluator", "enabled": None, "task": None, "rewards": None,
            "max_new_tokens": None}
    ev = build_evaluator(OmegaConf.create(node), local)
    assert isinstance(ev, Evaluator) and ev.max_new_tokens == 8 and ev.correct_reward == "digits"
    assert build_evaluator(OmegaConf.create({**node, "enabled": False}), local) is None
    assert build_evaluator(OmegaConf.create(node), atropos) is None  # off for Atropos unless a task is named
    with pytest.raises(ValueError, match="eval.task"):
        build_evaluator(OmegaConf.create({**node, "enabled": True}), atropos)
    named = build_evaluator(OmegaConf.create({**node, "task": DIGITS, "rewards": DIGIT_REWARDS}), atropos)
    assert isinstance(named.task, DigitsTask)
    with pytest.raises(ValueError, match="eval.k"):
        build_evaluator(OmegaConf.create({**node, "k": 0}), local)
    with pytest.raises(ValueError, match="eval.k"):
        build_evaluator(OmegaConf.create({**node, "k": 9, "samples_per_prompt": 8}), local)
    with pytest.raises(ValueError, match="correct_reward"):
        build_evaluator(OmegaConf.create({**node, "correct_reward": "nope"}), local)
    # An eval task whose prompts the training task can draw: GSM8K rows held out from an eval copy only.
    gsm_train = OmegaConf.create({"task": {"_target_": "grpo.tasks.prompts.GSM8KTask", "eval_size": 0},
                                  "rewards": {"correct": {"_target_": "grpo.tasks.rewards.MathAnswerReward"}}})
    with pytest.raises(ValueError, match="12 of the 12 eval prompts"):
        build_evaluator(OmegaConf.create({**node, "task": {"_target_": "grpo.tasks.prompts.GSM8KTask",
                                                            "eval_size": 12}}), gsm_train)


@pytest.mark.parametrize("top_p", [0.0, 1.5])
def test_eval_top_p_outside_its_range_is_refused_when_the_evaluator_is_built(top_p):
    """train.py builds the evaluator before the server starts; eval.top_p=0 passed that and vLLM refused the first
    eval request (HTTP 400 traceback) after its ~25 s start-up."""
    local = OmegaConf.create({"task": DIGITS, "rewards": DIGIT_REWARDS, "max_new_tokens": 8})
    node = {"_target_": "grpo.pipeline.evaluation.Evaluator", "enabled": None, "task": None, "rewards": None,
            "max_new_tokens": None}
    with pytest.raises(ValueError, match=r"eval.top_p must be in \(0, 1\]"):
        build_evaluator(OmegaConf.create({**node, "top_p": top_p}), local)
    assert build_evaluator(OmegaConf.create({**node, "top_p": 1.0}), local).top_p == 1.0


def test_eval_max_new_tokens_0_is_refused_not_replaced_by_the_data_cap():
    """eval.max_new_tokens=0 read as unset: the run evaluated at data.max_new_tokens, silently."""
    local = OmegaConf.create({"task": DIGITS, "rewards": DIGIT_REWARDS, "max_new_tokens": 8})
    node = {"_target_": "grpo.pipeline.evaluation.Evaluator", "enabled": None, "task": None, "rewards": None}
    with pytest.raises(ValueError, match="eval.max_new_tokens"):
        build_evaluator(OmegaConf.create({**node, "max_new_tokens": 0}), local)
    assert build_evaluator(OmegaConf.create({**node, "max_new_tokens": None}), local).max_new_tokens == 8
    assert build_evaluator(OmegaConf.create({**node, "max_new_tokens": 5}), local).max_new_tokens == 5


def test_eval_time_hint_only_for_a_long_run_that_mostly_evaluates():
    from grpo.pipeline.evaluation import eval_time_hint

    assert eval_time_hint(25.0, 40.0) is None  # the default job: 61 % of a 40 s run, no advice
    assert eval_time_hint(100.0, 600.0) is None  # 17 % of a long run
    hint = eval_time_hint(300.0, 600.0)
    assert hint.startswith("eval took 50% of the run's 600 s") and "eval.every" in hint and "heldout_size" in hint


def test_due_schedule():
    ev = Evaluator(task=DigitsTask(eval_size=2), rewards={"d": DigitFractionReward()}, every=3)
    assert [s for s in range(0, 11) if ev.due(s, 10)] == [0, 3, 6, 9, 10]
    quiet = Evaluator(task=DigitsTask(eval_size=2), rewards={"d": DigitFractionReward()}, every=0,
                      before_train=False, at_end=False)
    assert [s for s in range(0, 11) if quiet.due(s, 10)] == []


# ---------------------------------------------------------------- the evaluator on the real engine
class NeverParses:
    """A reward that never finds an answer (the evaluator must warn, not report a silent 0)."""

    def __call__(self, prompt, completion):  # noqa: ARG002
        return 0.0

    def parses(self, prompt, completion):  # noqa: ARG002
        return False


@pytest.mark.vllm
def test_evaluator_against_vllm(vllm_server, tiny_qwen2_dir, tmp_path, caplog):
    from transformers import AutoTokenizer

    from grpo.inference.client import Endpoint

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    endpoint = lambda: Endpoint(vllm_server.url, None, 0)  # noqa: E731
    ctx = EvalContext(tokenizer=tok,
                      generation=GenerationHandle(endpoint), run_dir=tmp_path, seed=0, total_steps=4, max_seq_len=512)
    ev = Evaluator(task=DigitsTask(eval_size=6), rewards={"digits": DigitFractionReward()}, k=2,
                   samples_per_prompt=3, max_new_tokens=8, correct_threshold=0.5, samples_logged=2)
    ev.setup(ctx)
    first, again = ev.evaluate(0), ev.evaluate(1)
    ev.close()
    for key in ("eval/accuracy", "eval/pass@k", "eval/mean@k", "eval/reward_mean", "eval/unparsed_fraction"):
        assert 0.0 <= first[key] <= 1.0, key
    assert first["eval/prompts"] == 6 and first["eval/k"] == 2 and 1 <= first["eval/response_tokens_mean"] <= 8
    assert first["eval/weight_version"] == 0 and first["eval/seconds"] >= first["eval/generation_seconds"] > 0
    assert sorted(first) == sorted(Evaluator.metric_names)  # what train.objective=eval/... is checked against
    assert first["eval/pass@k"] >= first["eval/mean@k"]  # pass@2 of the same samples can only be higher
    # Fixed prompts, greedy and seeded samples, same weights: the same figures twice.
    timing = ("eval/seconds", "eval/generation_seconds")
    assert {k: v for k, v in first.items() if k not in timing} == {k: v for k, v in again.items() if k not in timing}
    lines = [json.loads(x) for x in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 0, 1, 1]
    assert lines[0]["prompt"] == ev.prompts[0].text and lines[0]["reward"] == DigitFractionReward()(
        ev.prompts[0], lines[0]["completion"])

    # A reward that parses nothing: a warning with the count, and the fraction in the metrics.
    blind = Evaluator(task=DigitsTask(eval_size=3), rewards={"math": NeverParses()}, k=1, samples_per_prompt=2,
                      max_new_tokens=4)
    blind.setup(ctx)
    with caplog.at_level(logging.WARNING, logger="grpo.pipeline.evaluation"):
        m = blind.evaluate(0)
    blind.close()
    assert m["eval/unparsed_fraction"] == 1.0
    assert "none of the 9 eval completions" in caplog.text


@pytest.mark.vllm
def test_sampled_every_leaves_the_samples_out_between_and_the_greedy_figures_as_they_are(vllm_server, tiny_qwen2_dir,
                                                                                        tmp_path):
    """eval.sampled_every=2 (total 4 steps): steps 0, 2 and 4 sample, step 1 and 3 generate the greedy completions
    alone, with the greedy figures of a whole evaluation of the same weights; `sampled=True` (grpo-eval) samples."""
    from transformers import AutoTokenizer

    from grpo.inference.client import Endpoint

    ctx = EvalContext(tokenizer=AutoTokenizer.from_pretrained(tiny_qwen2_dir),
                      generation=GenerationHandle(lambda: Endpoint(vllm_server.url, None, 0)),
                      run_dir=tmp_path, seed=0, total_steps=4,
                      max_seq_len=512)
    ev = Evaluator(task=DigitsTask(eval_size=6), rewards={"digits": DigitFractionReward()}, k=2, samples_per_prompt=3,
                   max_new_tokens=8, correct_threshold=0.5, sampled_every=2)
    ev.setup(ctx)
    assert [ev.samples_due(step) for step in range(5)] == [True, False, True, False, True]
    whole, greedy_only, asked = ev.evaluate(0), ev.evaluate(1), ev.evaluate(1, sampled=True)
    ev.close()
    sampled_keys = {"eval/pass@k", "eval/mean@k", "eval/k"}
    assert sampled_keys <= set(whole) and sampled_keys <= set(asked) and not sampled_keys & set(greedy_only)
    for key in ("eval/accuracy", "eval/reward_mean", "eval/response_tokens_mean", "eval/weight_version",
                "eval/prompts"):
        assert greedy_only[key] == whole[key], key
    with pytest.raises(ValueError, match="eval.sampled_every must be >= 0"):
        Evaluator(task=DigitsTask(eval_size=2), rewards={"d": DigitFractionReward()}, sampled_every=-1)


def test_math_reward_reports_what_it_parses():
    r = MathAnswerReward()
    assert r.parses(Prompt("q", "4"), "so #### 4") and not r.parses(Prompt("q", "4"), "no idea")


# ---------------------------------------------------------------- inside train.py
QUICK = ["~experiment", "data.prompts_per_step=4", "data.group_size=4", "train.micro_batch_size=8", "train.grad_accum=2",
         "logging.progress_bar=false", "train.steps=3", "train.checkpoint_every=10", "data.max_new_tokens=8",
         "data.task.eval_size=8", "eval.samples_per_prompt=4", "eval.k=2"]
# Columns of the training part of a row (timing, memory and eval columns excluded).
TRAIN_KEYS = ("reward/mean", "reward/weighted", "reward/digits", "loss", "grad_norm", "grpo/mean_ratio",
              "grpo/logprob_diff", "tokens/trained", "completion/mean_tokens", "sync/version")


def _train(server, model_dir: Path, run_dir: Path, *overrides: str, base: tuple[str, ...] = tuple(QUICK)) -> list[dict]:
    """A train.py run attached to the session's shared server (conftest.train_server), back on the initial weights:
    both runs of the on/off comparison start from the same served weights, as with servers of their own."""
    from test_train_e2e import assert_clean, metrics, run_train

    external, env = attach(server, model_dir)
    out, marker = run_train(*base, external, f"hydra.run.dir={run_dir}", *overrides, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_clean(marker)
    return metrics(run_dir)


# The eval runs: a completion is "correct" when an eighth of it is digits, so the tiny random model's sampled
# completions score above 0 and the metrics move with its weights.
EVAL_SETTINGS = ("eval.every=2", "train.objective=eval/accuracy", "eval.correct_threshold=0.1")
EVAL_METRICS = ("eval/accuracy", "eval/pass@k", "eval/mean@k", "eval/reward_mean", "eval/response_tokens_mean",
                "eval/unparsed_fraction", "eval/weight_version", "eval/prompts")


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, train_server, tiny_qwen2_dir) -> tuple[Path, list[dict]]:
    """The default: evaluations beside training (eval.background=true)."""
    run_dir = tmp_path_factory.mktemp("eval_on") / "run"
    return run_dir, _train(train_server, tiny_qwen2_dir, run_dir, *EVAL_SETTINGS)


@pytest.fixture(scope="module")
def blocking_eval_run(tmp_path_factory, train_server, tiny_qwen2_dir) -> tuple[Path, list[dict]]:
    """The same run with each evaluation waited for whole (eval.background=false)."""
    run_dir = tmp_path_factory.mktemp("eval_blocking") / "run"
    return run_dir, _train(train_server, tiny_qwen2_dir, run_dir, *EVAL_SETTINGS, "eval.background=false")


def eval_rows(rows: list[dict]) -> dict[int, dict]:
    """The evaluations of a run by step (each once)."""
    evaluated = [r for r in rows if "eval/accuracy" in r]
    assert len({r["step"] for r in evaluated}) == len(evaluated)
    return {r["step"]: r for r in evaluated}


@pytest.mark.vllm
def test_eval_rows_at_step0_every_n_and_end(eval_run):
    run_dir, rows = eval_run
    # Beside training, an evaluation's row comes when it completes: after its step's row, maybe after later ones.
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    evaluated = eval_rows(rows)
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 3]  # in step order among themselves
    assert all("reward/mean" not in r and "loss" not in r for r in evaluated.values())  # rows of their own
    for step, r in evaluated.items():
        assert {"eval/pass@k", "eval/mean@k", "eval/reward_mean", "eval/response_tokens_mean", "eval/seconds",
                "eval/generation_seconds", "time/run_seconds"} <= set(r)
        # mode=none syncs after every step: the eval after step N sampled weight version N.
        assert r["eval/weight_version"] == step
    assert rows[-1]["step"] == 3 and "eval/accuracy" in rows[-1]  # the final evaluation completed before the run
    samples = [json.loads(x) for x in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [0, 2, 3]
    assert (run_dir / "curves.png").stat().st_size > 0
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"

    from grpo.report import job_row

    row = job_row(run_dir)
    assert row["steps"] == 3
    assert row["eval_first"] == evaluated[0]["eval/accuracy"] and row["eval_last"] == evaluated[3]["eval/accuracy"]


@pytest.mark.vllm
def test_evaluation_beside_training_gives_the_blocking_figures_and_the_loop_does_not_wait(eval_run,
                                                                                          blocking_eval_run):
    """Same seed, same steps: the evaluations beside training sample the same weights (version = step) as blocking
    ones, so every figure per step is the same; the loop waited for the blocking ones whole, for those beside
    training only at the end (the last one, nothing left to overlap it with)."""
    (_, beside), (_, blocking) = eval_run, blocking_eval_run
    ev_beside, ev_blocking = eval_rows(beside), eval_rows(blocking)
    assert sorted(ev_beside) == sorted(ev_blocking) == [0, 2, 3]
    assert any(r["eval/mean@k"] > 0 for r in ev_blocking.values())  # figures that could differ
    for step in ev_blocking:
        for key in EVAL_METRICS:
            assert ev_beside[step][key] == pytest.approx(ev_blocking[step][key], rel=1e-9), (step, key)
    train_beside, train_blocking = ([r for r in rows if "loss" in r] for rows in (beside, blocking))
    for a, b in zip(train_beside, train_blocking):
        for key in TRAIN_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key)

    def waited(rows):  # the loop's waits on evaluations while it trained (the final one's excluded)
        return sum(r.get("time/eval_wait_seconds", 0.0) for r in rows if "loss" in r or r["step"] == 0)

    blocking_eval_s = sum(ev_blocking[s]["eval/seconds"] for s in (0, 2))
    assert waited(blocking) == pytest.approx(blocking_eval_s + ev_blocking[3]["eval/seconds"], rel=0.1, abs=0.05)
    beside_eval_s = sum(ev_beside[s]["eval/seconds"] for s in (0, 2))
    assert waited(beside) < 0.5 * beside_eval_s, (waited(beside), beside_eval_s)


@pytest.mark.slow  # a training run of its own on the shared server (~45 s on 2 cores)
@pytest.mark.vllm
def test_evaluations_between_sample_nothing_with_sampled_every_0_and_keep_their_greedy_accuracy(
        tmp_path, train_server, tiny_qwen2_dir, eval_run):
    """eval.sampled_every=0: the evaluation of step 2 generates the greedy completions alone (no pass@k, mean@k or
    k in its row) with the same accuracy as the run that samples at every evaluation; step 0's and the last step's
    are whole, and equal to that run's."""
    rows = _train(train_server, tiny_qwen2_dir, tmp_path / "run", *EVAL_SETTINGS, "eval.sampled_every=0")
    greedy_only, whole = eval_rows(rows), eval_rows(eval_run[1])
    assert sorted(greedy_only) == [0, 2, 3]
    sampled_keys = {"eval/pass@k", "eval/mean@k", "eval/k"}
    assert not sampled_keys & set(greedy_only[2]) and sampled_keys <= set(whole[2])
    for step in (0, 3):
        assert sampled_keys <= set(greedy_only[step]), step
    for step in (0, 2, 3):
        keys = EVAL_METRICS if step != 2 else ("eval/accuracy", "eval/reward_mean", "eval/response_tokens_mean",
                                                "eval/weight_version", "eval/prompts")
        for key in keys:
            assert greedy_only[step][key] == pytest.approx(whole[step][key], rel=1e-9), (step, key)


@pytest.mark.vllm
def test_summary_says_where_the_wall_clock_went(eval_run):
    """summary.json's wall_clock: from the process's start, start-up then the loop's parts then the teardown; the
    named parts account for the whole (the loop's unnamed rest, writing rows, is small)."""
    from grpo.run_summary import done_message

    run_dir, _ = eval_run
    summary = json.loads((run_dir / "summary.json").read_text())
    clock = summary["wall_clock"]
    total = clock["since_process_start_seconds"]
    named = ("startup_seconds", "generation_wait_seconds", "training_seconds", "eval_wait_seconds", "sync_seconds",
             "checkpoint_seconds", "teardown_seconds")
    assert all(clock[k] >= 0 for k in named) and clock["training_seconds"] > 0 and clock["generation_wait_seconds"] > 0
    assert sum(clock[k] for k in named) == pytest.approx(total, rel=0.05)
    assert abs(clock["other_seconds"]) < 0.05 * total
    startup = clock["startup"]
    assert startup["model_load_seconds"] > 0 and startup["before_job_seconds"] > 0
    assert sum(startup.values()) == pytest.approx(clock["startup_seconds"])
    # summary.json's wall_seconds counts from the job's start, after the interpreter's imports and the config's
    # composition (before_job).
    assert total == pytest.approx(summary["wall_seconds"] + startup["before_job_seconds"], abs=1.0)
    assert "wall clock" in done_message(run_dir) and "start-up" in done_message(run_dir)


@pytest.mark.vllm
def test_training_metrics_identical_with_eval_on_and_off(eval_run, tmp_path, train_server, tiny_qwen2_dir):
    _, with_eval = eval_run
    # eval=off with eval settings beside it is refused (they would be ignored): the run without eval drops them.
    without = _train(train_server, tiny_qwen2_dir, tmp_path / "off", "eval=off",
                     base=tuple(o for o in QUICK if not o.startswith("eval.")))
    assert [r["step"] for r in without] == [1, 2, 3]
    assert not any(k.startswith("eval/") for r in without for k in r)
    trained = [r for r in with_eval if "loss" in r]
    assert len(trained) == 3
    for a, b in zip(trained, without):
        for key in TRAIN_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key)


def test_objective_selects_last_eval_value(tmp_path):
    from grpo.run_summary import check_objective, objective_value

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "eval/accuracy": 0.1}, {"step": 1, "reward/mean": 0.5},
        {"step": 2, "reward/mean": 0.7, "eval/accuracy": 0.4}, {"step": 3, "reward/mean": 0.9}]))
    assert objective_value(tmp_path, None, 0.8) == 0.8  # default: the last-10 training reward given
    assert objective_value(tmp_path, "eval/accuracy", 0.8) == 0.4
    with pytest.raises(ValueError, match="eval/pass@k"):
        objective_value(tmp_path, "eval/pass@k", 0.8)
    with pytest.raises(ValueError, match="eval is off"):
        check_objective("eval/accuracy", eval_enabled=False)
    check_objective("eval/accuracy", eval_enabled=True)


def test_an_objective_that_names_no_metric_is_a_config_error_at_start_up_not_after_the_run(tmp_path):
    """Before, `train.objective=eval/acuracy` trained the whole run, then ended in a ValueError traceback that also
    turned the completed run's summary.json into 'failed'; `eval=off train.objective=eval/accuracy` was a traceback."""
    from grpo.config_values import ConfigError
    from grpo.run_summary import check_objective, objective_value

    with pytest.raises(ConfigError, match="train.objective=eval/acuracy is not a metric the evaluator logs; did you "
                                          "mean eval/accuracy"):
        check_objective("eval/acuracy", True, Evaluator.metric_names)
    with pytest.raises(ConfigError, match="eval is off"):
        check_objective("eval/accuracy", False, Evaluator.metric_names)
    check_objective("grpo/kl", True, Evaluator.metric_names)  # a training metric: known only once logged
    # README calls the default objective last10_reward_mean; named so, the whole run trained before it failed.
    with pytest.raises(ConfigError, match=re.escape("train.objective=last10_reward_mean is not a metrics key: "
                                                    "last10_reward_mean is a figure of summary.json, not a metrics "
                                                    "key; the default train.objective=null is last10_reward_mean")):
        check_objective("last10_reward_mean", True, Evaluator.metric_names)
    with pytest.raises(ConfigError, match="train.objective=reward is not a metrics key: metrics keys are loss, "):
        check_objective("reward", True, Evaluator.metric_names)
    check_objective("loss", True, Evaluator.metric_names)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "grpo/kl": 0.1}) + "\n")
    with pytest.raises(ConfigError, match=r"no row of .* has this key \(the run itself completed\); did you mean "
                                          r"grpo/kl\?"):
        objective_value(tmp_path, "grpo/k1", None)


def test_the_atropos_eval_the_error_suggests_composes_and_builds():
    """data=atropos eval.enabled=true said "name one, e.g. eval.task._target_=..."; typed as said, Hydra refused it
    (eval.task is null: "Could not override 'eval.task._target_'"), then the eval had no rewards and GSM8K no held-out
    rows. The suggestion now composes and builds an evaluator as it stands."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["data=atropos", "eval.enabled=true"])
        with pytest.raises(ValueError, match="no task to evaluate") as e:
            build_evaluator(cfg.eval, cfg.data)
        suggested = str(e.value).split("e.g. ", 1)[1].split(", or set", 1)[0].split()
        cfg = compose(config_name="train", overrides=["data=atropos", "eval.enabled=true", *suggested])
    evaluator = build_evaluator(cfg.eval, cfg.data)
    assert evaluator.correct_reward == "correct" and len(evaluator.task.eval_prompts()) > 0
