"""Multi-turn rollouts (grpo.tasks.environment, episodes, multi_turn, calculator): the calculator is safe, episode
limits end episodes as defined, and against the real vLLM CPU server the trajectory is exactly the server's tokens
and the environment's, environment tokens get no gradient, and trainer and sampler log-probs agree on model tokens."""

from __future__ import annotations

import random
import time

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, group_option
from grpo.conf import CONFIG_DIR
from grpo.inference.client import Completion, Endpoint
from grpo.pipeline.base import BatchShape, PipelineContext
from grpo.pipeline.episodes import EpisodeRunner
from grpo.pipeline.generation import GenerationHandle
from grpo.pipeline.multi_turn import MultiTurnPipeline
from grpo.tasks.calculator import CalculatorError, LongAnswerReward, LongArithmeticTask, evaluate
from grpo.tasks.environment import (
    FINISHED,
    MAX_TOKENS,
    MAX_TURNS,
    TURN_CUT,
    EnvironmentTask,
    Episode,
    EpisodeLimits,
    Finish,
    Reply,
    TurnRenderer,
)
from grpo.tasks.prompts import Prompt
from grpo.trainer.train_batch import IGNORE_INDEX


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2_dir)


# ---------------------------------------------------------------- the calculator
def test_calculator_computes_plus_minus_times_with_precedence():
    assert evaluate("2+3*4") == 14 and evaluate("(2+3)*4") == 20 and evaluate("-3*-2") == 6
    assert evaluate(" 12 - 5 - 1 ") == 6
    assert evaluate("123456789*987654321") == 123456789 * 987654321


@pytest.mark.parametrize("text", [
    "__import__('os').system('ls')", "2**3", "7/2", "1+", "(1", "1)", "", "9" * 61,
    "*".join(["9" * 30] * 3), "(" * 25 + "1" + ")" * 25, "1" * 201,
])
def test_calculator_refuses_anything_else(text):
    with pytest.raises(CalculatorError):
        evaluate(text)


def test_calculator_refuses_non_ascii_digits_as_its_answer_parser_does():
    # "٣*٤" is 3*4 in Arabic-Indic digits: parse_integer never reads such an answer, so the tool never computes one.
    with pytest.raises(CalculatorError):
        evaluate("\u0663*\u0664")
    assert LongAnswerReward().parses(Prompt("x", "12"), "\u0661\u0662") is False
    episode = LongArithmeticTask().start(Prompt("x", "12"))
    assert episode.step("calc: \u0663*\u0664").content.startswith("error:")


@pytest.mark.parametrize("value", [None, 12, b"1+1"])
def test_calculator_refuses_what_is_not_text_with_its_own_error(value):
    with pytest.raises(CalculatorError, match="must be text"):
        evaluate(value)


def test_a_long_turn_is_read_in_linear_time_before_the_length_limit_applies():
    # The turn pattern once backtracked quadratically over the spaces (35 s for this turn); now it is a string scan.
    episode = LongArithmeticTask().start(Prompt("x", "1"))
    start = time.perf_counter()
    reply = episode.step("calc: a" + " " * 100000 + "b")
    answer = episode.step("a" + " " * 100000 + "b")
    assert time.perf_counter() - start < 1.0
    assert reply == Reply("error: expression longer than 200 characters", "tool") and isinstance(answer, Finish)


def test_calculator_episode_answers_calls_and_ends_on_an_answer():
    task = LongArithmeticTask()
    episode = task.start(Prompt("x", "144"))
    assert episode.step("calc: 12*12") == Reply("144", "tool")
    assert episode.step("calc: 1/0").content.startswith("error:")
    assert episode.step(" 144 ") == Finish(" 144 ")
    assert episode.calls == 2
    assert LongAnswerReward()(Prompt("x", "144"), " 144 ") == 1.0
    assert LongAnswerReward()(Prompt("x", "144"), "0144") == 0.0
    # Without the tool a call is just a (wrong) answer.
    assert LongArithmeticTask(tool=False).start(Prompt("x", "1")).step("calc: 1") == Finish("calc: 1")


def test_held_out_items_are_never_sampled(tokenizer):
    task = LongArithmeticTask(min_digits=1, max_digits=1, operators="*+-", heldout_size=40)
    task.bind_tokenizer(tokenizer)
    held = {p.text for p in task.eval_prompts()}
    drawn = task.sample(random.Random(0), 2000)
    assert not held & {p.text for p in drawn}
    assert all(task.can_sample(p) for p in drawn[:50]) and not any(task.can_sample(p) for p in task.eval_prompts())


# ---------------------------------------------------------------- rendering environment turns
def test_rendered_reply_continues_the_conversation_token_for_token(tokenizer):
    """prompt + model turn (ending with its end-of-turn token) + the rendered reply is what the chat template renders
    for the whole conversation: the reply is appended, earlier text is never re-rendered."""
    renderer = TurnRenderer(tokenizer)
    user = [{"role": "user", "content": "5*7="}]
    prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(
        [*user, {"role": "assistant", "content": "calc: 5*7"}, {"role": "tool", "content": "35"}], tokenize=False,
        add_generation_prompt=True)
    assert prompt + "calc: 5*7" + tokenizer.eos_token + renderer.text("tool", "35") == whole
    assert renderer.text(None, "raw text") == "raw text"


# ---------------------------------------------------------------- limits (a scripted server)
class _Scripted:
    """Stands in for the server: each call returns, for every prompt and sample, the next scripted turn (token ids,
    finish reason), cut to the call's max_tokens (then finish "length"); records each call's max_tokens."""

    def __init__(self, turns: list[tuple[list[int], str]]) -> None:
        self.turns, self.calls = turns, []

    def __call__(self, prompts, n, max_tokens, seed):
        self.calls.append(max_tokens)
        out = []
        for _ in prompts:
            per_prompt = []
            for _ in range(n):
                tokens, reason = self.turns[min(len(self.calls) - 1, len(self.turns) - 1)]
                if len(tokens) > max_tokens:
                    tokens, reason = tokens[:max_tokens], "length"
                per_prompt.append(Completion(list(tokens), [-0.5] * len(tokens), reason, weight_version=len(self.calls),
                                             last_weight_version=len(self.calls)))
            out.append(per_prompt)
        return out


class _AlwaysReplies(EnvironmentTask):
    """An environment that answers every turn with `reply` (or ends when the turn says "done")."""

    def __init__(self, reply: str = "ok") -> None:
        self.reply, self.steps = reply, 0

    def start(self, prompt: Prompt) -> Episode:
        task = self

        class _Episode(Episode):
            def step(self, turn: str):
                task.steps += 1
                return Finish(turn) if turn == "done" else Reply(task.reply, None)

        return _Episode()


def _run(tokenizer, task, limits, turns, prompt=(1, 2, 3)):
    server = _Scripted(turns)
    [[trajectory]] = EpisodeRunner(task, tokenizer, limits).run(server, [Prompt("p")], [list(prompt)], 1, 0, True)
    return trajectory, server


def test_max_turns_ends_the_episode_after_the_last_turn_and_scores_it(tokenizer):
    a, eos = tokenizer.encode("a")[0], tokenizer.eos_token_id
    t, server = _run(tokenizer, _AlwaysReplies("ok"), EpisodeLimits(3, 8, 200), [([a, eos], "stop")])
    ok = tokenizer.encode("ok")
    assert t.end == MAX_TURNS and len(t.turns) == 3 and t.answer == "a"
    # Replies after turns 1 and 2, none after the last.
    assert t.tokens == [1, 2, 3, a, eos, *ok, a, eos, *ok, a, eos]
    assert t.masks == [IGNORE_INDEX] * 3 + [a, eos] + [IGNORE_INDEX] * len(ok) + [a, eos] + [IGNORE_INDEX] * len(ok) + [a, eos]
    assert t.logprobs == [1.0] * 3 + [-0.5, -0.5] + [1.0] * len(ok) + [-0.5, -0.5] + [1.0] * len(ok) + [-0.5, -0.5]
    assert [(r.weight_version, r.last_weight_version) for r in t.turns] == [(1, 1), (2, 2), (3, 3)]


def test_a_turn_cut_at_max_new_tokens_ends_the_episode_unanswered(tokenizer):
    task = _AlwaysReplies()
    t, server = _run(tokenizer, task, EpisodeLimits(4, 3, 200), [(tokenizer.encode("abcdef"), "stop")])
    assert t.end == TURN_CUT and t.answer == "abc" and len(t.turns) == 1 and task.steps == 0
    assert server.calls == [3]


def test_finish_ends_the_episode_with_its_answer(tokenizer):
    eos = tokenizer.eos_token_id
    t, _ = _run(tokenizer, _AlwaysReplies(), EpisodeLimits(4, 8, 200),
                [(tokenizer.encode("x") + [eos], "stop"), (tokenizer.encode("done") + [eos], "stop")])
    assert t.end == FINISHED and t.answer == "done" and len(t.turns) == 2


def test_max_episode_tokens_bounds_every_turn_and_refuses_a_reply_that_does_not_fit(tokenizer):
    eos = tokenizer.eos_token_id
    # A reply of 20 tokens after a 3-token prompt and a 2-token turn leaves no room within 25: the episode ends.
    t, server = _run(tokenizer, _AlwaysReplies("r" * 20), EpisodeLimits(4, 8, 25), [(tokenizer.encode("x") + [eos], "stop")])
    assert t.end == MAX_TOKENS and t.answer == "x" and len(t.tokens) == 5 and server.calls == [8]
    # Room for the replies: each turn's budget is what the total leaves (8, 8, then 25 - 18 = 7), and a turn cut by
    # the total, not by max_new_tokens, ends the episode as max_tokens, exactly at the limit.
    t, server = _run(tokenizer, _AlwaysReplies("r" * 5), EpisodeLimits(4, 8, 25),
                     [(tokenizer.encode("x") + [eos], "stop"), (tokenizer.encode("yy") + [eos], "stop"),
                      (tokenizer.encode("z" * 9), "stop")])
    assert server.calls == [8, 8, 7]
    assert t.end == MAX_TOKENS and len(t.tokens) == 25 and t.answer == "z" * 7


class _RewardsEachTurn(EnvironmentTask):
    """Replies to each turn with a reward of 0.25 and ends on "done" with a reward of 1.0."""

    def start(self, prompt: Prompt) -> Episode:
        class _Episode(Episode):
            def step(self, turn: str):
                return Finish(turn, reward=1.0) if turn == "done" else Reply("ok", None, reward=0.25)

        return _Episode()


class _AnswerIsDone:
    def __call__(self, prompt, completion):
        return 2.0 if completion == "done" else 0.0


@pytest.mark.parametrize("discount", [1.0, 0.5])
def test_per_turn_rewards_are_recorded_and_folded_into_the_episode_score(tokenizer, discount):
    eos = tokenizer.eos_token_id
    x, done = tokenizer.encode("x") + [eos], tokenizer.encode("done") + [eos]
    # Two episodes of one group: x, x, done (three turns) and x cut at max_turns=2 (two turns, never finished).
    long, _ = _run(tokenizer, _RewardsEachTurn(), EpisodeLimits(3, 8, 200), [(x, "stop"), (x, "stop"), (done, "stop")])
    short, _ = _run(tokenizer, _RewardsEachTurn(), EpisodeLimits(2, 8, 200), [(x, "stop")])
    assert [r.reward for r in long.turns] == [0.25, 0.25, 1.0] and long.end == FINISHED
    # The reply to the last turn is not appended (max_turns), but the environment gave its reward.
    assert [r.reward for r in short.turns] == [0.25, 0.25] and short.end == MAX_TURNS
    pipeline = MultiTurnPipeline(_RewardsEachTurn(), {"done": (_AnswerIsDone(), 1.0)}, prompts_per_step=1,
                                 group_size=2, max_new_tokens=8, max_turns=3, turn_reward_discount=discount)
    [group], metrics = pipeline._groups([[long, short]])
    # sum_k discount**k r_k, the answer's reward (2.0 for "done") at the last turn.
    assert group.scores == [0.25 + discount * 0.25 + discount**2 * (1.0 + 2.0), 0.25 + discount * 0.25]
    assert metrics["reward/weighted"] == 1.0  # the answers' rewards alone: 2.0 and 0.0


def test_a_turn_reward_discount_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="turn_reward_discount must be in"):
        MultiTurnPipeline(_RewardsEachTurn(), {"done": (_AnswerIsDone(), 1.0)}, prompts_per_step=1, group_size=2,
                          max_new_tokens=8, turn_reward_discount=0.0)


# ---------------------------------------------------------------- against the real server
class _Counting(EnvironmentTask):
    """A test environment on chat prompts: replies "turn <k>" as a tool message to turn k; ends when the turn
    says nothing (empty text)."""

    def __init__(self) -> None:
        self.tokenizer = None

    def bind_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def sample(self, rng, n):
        return [Prompt(self.tokenizer.apply_chat_template([{"role": "user", "content": f"count {rng.randint(0, 10**9)}"}],
                                                          tokenize=False, add_generation_prompt=True), "0")
                for _ in range(n)]

    def start(self, prompt):
        class _Episode(Episode):
            turns = 0

            def step(self, turn):
                self.turns += 1
                return Reply(f"turn {self.turns}") if turn.strip() else Finish(turn)

        return _Episode()


class _ZeroReward:
    def __call__(self, prompt, completion):
        return float(len(completion) % 3)  # any spread, so groups carry advantages


def _multi_turn_pipeline(url, tokenizer, tiny_qwen2_dir, **kw):
    pipeline = MultiTurnPipeline(_Counting(), {"r": (_ZeroReward(), 1.0)}, prompts_per_step=kw.pop("prompts", 12),
                                 group_size=4, max_new_tokens=kw.pop("max_new_tokens", 48), max_turns=3, **kw)
    pipeline.setup(PipelineContext(
        tokenizer=tokenizer,
        generation=GenerationHandle(lambda: Endpoint(url, str(tiny_qwen2_dir), 0)), batch_size=8, max_seq_len=512,
        run_dir=REPO, total_steps=10, start_step=0, checkpoint_every=0, seed=0,
        batch_shape=BatchShape(micro_batch_size=64, max_seq_len=512, pad_token_id=tokenizer.pad_token_id)))
    return pipeline


@pytest.fixture(scope="module")
def played(vllm_server, tokenizer, tiny_qwen2_dir):
    """Step 0's episodes, with every /generate answer the server gave them recorded by its request's tokens."""
    pipeline = _multi_turn_pipeline(vllm_server.url, tokenizer, tiny_qwen2_dir)
    answers: dict[tuple, list[Completion]] = {}
    real = pipeline._generate

    def recording(prompts, n, max_tokens, seed):
        outs = real(prompts, n, max_tokens, seed)
        for ids, completions in zip(prompts, outs):
            answers[tuple(ids)] = completions
        return outs

    prompts, ids, _ = pipeline._tokenized_prompts(0)
    episodes = pipeline.runner.run(recording, prompts, ids, 4, 1234, True)
    groups, metrics = pipeline._groups(episodes)
    yield pipeline, episodes, answers, groups
    pipeline.close()


def test_trajectory_is_the_servers_tokens_and_the_environments_token_for_token(played, tokenizer):
    pipeline, episodes, answers, _ = played
    renderer = TurnRenderer(tokenizer)
    multi = 0
    for per_prompt in episodes:
        for j, t in enumerate(per_prompt):
            seq, masks, lps = list(t.tokens[: t.prompt_length]), [IGNORE_INDEX] * t.prompt_length, [1.0] * t.prompt_length
            for k in range(len(t.turns)):
                c = answers[tuple(seq)][j if k == 0 else 0]
                seq, masks, lps = seq + c.token_ids, masks + c.token_ids, lps + c.logprobs
                if k + 1 < len(t.turns):  # the environment answered this turn
                    env = renderer.tokens("tool", f"turn {k + 1}")
                    seq, masks, lps = seq + env, masks + [IGNORE_INDEX] * len(env), lps + [1.0] * len(env)
            assert (t.tokens, t.masks, t.logprobs) == (seq, masks, lps)
            multi += len(t.turns) > 1
    assert multi > 0, "no episode got past its first turn: the test proves nothing about environment tokens"


def test_environment_tokens_get_no_gradient_and_sampler_logprobs_match_the_trainers(played, tiny_qwen2_dir):
    """Through the batcher and GRPOLoss: the loss mask is 0 at environment positions and the loss's gradient wrt the
    logits there is zero; at model tokens the trainer's fp32 log-probs equal vLLM's."""
    from conftest import loss_gradient_through_batch, untrained_between_trained

    _, episodes, _, groups = played
    multi = [g for g, per in zip(groups, episodes) if any(len(t.turns) > 1 for t in per)]
    batch, logits, logprobs = loss_gradient_through_batch(multi, tiny_qwen2_dir)
    # Environment positions: inside the sequence (attention 1), after the first model token, not trained.
    env = untrained_between_trained(batch.loss_mask)
    assert env.any(), "no environment token between model turns"
    assert (batch.labels[env] == IGNORE_INDEX).all()
    assert logits.grad[env].abs().max() == 0
    assert logits.grad[batch.loss_mask > 0].abs().max() > 0
    diff = (logprobs.detach() - batch.inference_logprobs)[batch.loss_mask > 0].abs()
    assert diff.max() < 1e-3 and diff.mean() < 1e-4, (diff.max(), diff.mean())


def test_groups_record_per_turn_versions_and_steps_replay_exactly(vllm_server, tokenizer, tiny_qwen2_dir):
    """A step's episodes are a function of (seed, step): a pipeline resumed at step 2 plays step 2's episodes token
    for token, and no episode of steps 0-1 comes again (a resume replays none twice)."""
    first = _multi_turn_pipeline(vllm_server.url, tokenizer, tiny_qwen2_dir, prompts=4, max_new_tokens=16)
    seen = [first.next_groups(step) for step in range(3)]
    resumed = _multi_turn_pipeline(vllm_server.url, tokenizer, tiny_qwen2_dir, prompts=4, max_new_tokens=16)
    resumed.load_state_dict(first.state_dict() | {"step": 1})
    again = resumed.next_groups(2)
    assert [g.tokens for g in again] == [g.tokens for g in seen[2]]
    before = {tuple(t) for groups in seen[:2] for g in groups for t in g.tokens}
    assert not before & {tuple(t) for g in again for t in g.tokens}
    for g in again:
        assert len(g.turn_versions) == len(g) and all(per for per in g.turn_versions)
        assert g.weight_version == min(v for per in g.turn_versions for v, _ in per)
    metrics = first.metrics()
    assert {"episode/turns_mean", "episode/end_turn_cut_fraction", "episode/environment_tokens_mean"} <= set(metrics)
    first.close()
    resumed.close()


def test_the_calculator_data_option_builds_and_refuses_a_task_that_is_no_environment():
    from hydra.utils import instantiate

    cfg = group_option("data", "calculator")
    pipeline = instantiate(cfg, _recursive_=False)
    assert isinstance(pipeline, MultiTurnPipeline) and pipeline.max_turns == 3
    cfg.task = {"_target_": "grpo.tasks.prompts.DigitsTask"}
    with pytest.raises(Exception, match="not an environment"):  # Hydra wraps the ValueError
        instantiate(cfg, _recursive_=False)


@pytest.mark.parametrize("overrides, needle", [
    (["data.max_episode_tokens=600"], "data.max_episode_tokens=600 is more than model.max_seq_len=512"),
    (["data.max_episode_tokens=300", "server.max_model_len=256"],
     "data.max_episode_tokens=300 is more than server.max_model_len=256"),
    (["data.max_episode_tokens=300"], None),
    # data=calculator composes the local pipeline's dynamic-sampling keys; refilling is not built for episodes.
    (["data.dynamic_sampling=true"], "data.dynamic_sampling=true is not built for multi-turn episodes"),
])
def test_start_up_refuses_an_episode_bound_past_the_sequence_bounds(overrides, needle):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.config import ConfigError, register_configs
    from grpo.config.validate import check_data

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=calculator_tiny", *overrides])
    if needle is None:
        check_data(cfg)
        return
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    assert needle in str(e.value)


def test_atropos_multi_turn_groups_train_on_the_assistant_segments_only(vllm_server, tiny_qwen2_dir, tokenizer,
                                                                        tmp_path):
    """A BaseEnv of our own (tests/multi_turn_env.py) sends groups of several assistant segments with user messages
    between them through the real run-api: the trainer's batch trains exactly the assistant tokens (the user
    messages' labels are -100 and their loss mask 0), with the sampler's log-probs, which equal the trainer's."""
    import os
    import signal
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from grpo.pipeline.atropos import AtroposPipeline
    from grpo.pipeline.batching import prepare_batch
    from multi_turn_env import TURNS, user_message
    from test_atropos_pipeline import _start_run_api, _stop

    api, url = _start_run_api(tmp_path)
    env = None
    try:
        pipe = AtroposPipeline(url=url, poll_interval_s=0.1, max_wait_s=240, max_retries=2)
        pipe.setup(PipelineContext(
            tokenizer=tokenizer,
            generation=GenerationHandle(lambda: Endpoint("http://unused", None, 0)), batch_size=8, max_seq_len=512,
            run_dir=tmp_path, total_steps=2, start_step=0, checkpoint_every=5, seed=0))
        cmd = [sys.executable, str(REPO / "tests" / "multi_turn_env.py"), "serve", f"--env.rollout_server_url={url}",
               "--env.tokenizer_name=tiny-qwen2", "--env.group_size=4", "--env.max_new_tokens=8",
               "--env.ensure_scores_are_not_same=false", f"--openai.base_url={vllm_server.url}/v1"]
        with open(tmp_path / "env.log", "wb") as log:
            env = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        groups = pipe.next_groups(0)
        assert sum(len(g.tokens) for g in groups) == 8, (tmp_path / "env.log").read_text()[-3000:]
    finally:
        if env is not None and env.poll() is None:
            os.killpg(env.pid, signal.SIGTERM)
            env.wait(30)
        _stop(api)
    renderer = TurnRenderer(tokenizer)
    for g in groups:
        for tokens, masks in zip(g.tokens, g.masks):
            # prompt, then TURNS assistant segments separated by the rendered user messages, all masked.
            segments, start = [], None
            for i, m in enumerate(masks + [IGNORE_INDEX]):
                if m != IGNORE_INDEX and start is None:
                    start = i
                elif m == IGNORE_INDEX and start is not None:
                    segments.append((start, i))
                    start = None
            assert len(segments) == TURNS
            for k, ((_, end), (nxt, _)) in enumerate(zip(segments, segments[1:]), start=1):
                assert tokens[end:nxt] == renderer.tokens("user", user_message(k))
    batch = prepare_batch(groups, max_seq_len=512, micro_batch_size=64, pad_token_id=0).micro_batches[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    trained = batch.loss_mask > 0
    for b, (tokens, masks) in enumerate((t, m) for g in groups for t, m in zip(g.tokens, g.masks)):
        # Label t is token t + 1: trained exactly where the environment marked an assistant token.
        assert trained[b, : len(tokens) - 1].tolist() == [m != IGNORE_INDEX for m in masks[1:]]
    logprobs = torch.log_softmax(logits / batch.temperatures[:, None, None], -1).gather(
        -1, batch.labels.clamp(min=0)[..., None])[..., 0]
    assert (logprobs - batch.inference_logprobs)[trained].abs().max() < 1e-3


# ---------------------------------------------------------------- the calculator's warm start (model=warm_calc)
def test_the_calculator_teacher_trains_the_model_turns_only_and_copies_the_tools_value(tokenizer):
    """A teacher episode that calls: `calc: <expression>` and the answer are labelled, the tool's message is not; the
    answer is the tool's value."""
    import random as _random

    from grpo.tasks.calculator import CalculatorTeacher

    task = LongArithmeticTask()
    task.bind_tokenizer(tokenizer)
    prompt = task.sample(_random.Random(0), 1)[0]
    ids, labels = CalculatorTeacher(call_share=1.0, plain_share=0.0).episode(task, prompt, _random.Random(0), tokenizer)
    trained = tokenizer.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    assert trained == f"calc: {task.expression_of(prompt)}<|im_end|>{prompt.answer}<|im_end|>"
    masked_after_call = tokenizer.decode([t for t, lab in zip(ids, labels) if lab == IGNORE_INDEX][len(
        tokenizer.encode(prompt.text, add_special_tokens=False)):])
    assert masked_after_call == TurnRenderer(tokenizer).text("tool", prompt.answer)
    plain, plain_labels = CalculatorTeacher(call_share=1.0, plain_share=1.0).episode(task, prompt, _random.Random(0),
                                                                                     tokenizer)
    assert "calc:" not in tokenizer.decode(plain) and tokenizer.decode(
        [t for t, lab in zip(plain, plain_labels) if lab != IGNORE_INDEX]) == f"{prompt.answer}<|im_end|>"


@pytest.mark.slow  # ~10 s on an idle host (a model built, trained 4 steps, measured), 26 s on a loaded one
def test_calculator_tiny_trains_the_warm_start_built_on_the_configs_task(monkeypatch, tmp_path):
    """experiment=calculator_tiny's model is the warm-calc preset, built on data=calculator's own task (same
    held-out set); a preset of two phases (shortened here) builds with an episode teacher and records its measure."""
    import copy
    import json as _json

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    from grpo.config import register_configs
    from grpo.recipes import warmstart

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=calculator_tiny"])
    assert cfg.model.offline == "warm-calc"
    preset = copy.deepcopy(warmstart.WARMSTART_PRESETS["warm-calc"])
    task = instantiate(OmegaConf.to_container(cfg.data.task))
    assert instantiate(preset["task"]).eval_prompts() == task.eval_prompts()
    preset["task"]["heldout_size"] = 4
    for phase in preset["phases"]:
        phase["sft"].update(steps=2, batch_size=4)
    preset["measure"].update(sample_prompts=2, sample_n=2, max_new_tokens=4)
    monkeypatch.setattr(warmstart, "WARMSTART_PRESETS", {**warmstart.WARMSTART_PRESETS, "warm-calc": preset})
    built = warmstart.build_warmstart_dir("warm-calc", out_dir=tmp_path / "warm", progress=False)
    meta = _json.loads((built / "warmstart.json").read_text())
    assert [p["sft"]["steps"] for p in meta["spec"]["phases"]] == [2, 2] and "heldout_greedy_accuracy" in meta
