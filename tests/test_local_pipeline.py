"""data=local against a real vLLM CPU server on the tiny model: groups, rewards, determinism, resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import group_option
from grpo.inference.client import Endpoint, InferenceClient
from grpo.pipeline.base import PipelineContext
from grpo.pipeline.generation import GenerationHandle
from grpo.pipeline.local import LocalRolloutPipeline
from grpo.tasks.prompts import DigitsTask
from grpo.tasks.rewards import DigitFractionReward
from grpo.trainer.train_batch import IGNORE_INDEX


def _data_cfg(name: str):
    """conf/data/<name>.yaml as the trainer hands it over (hydra.utils.instantiate(..., _recursive_=False))."""
    return group_option("data", name)


def _pipeline(name: str, **overrides) -> LocalRolloutPipeline:
    from hydra.utils import instantiate

    cfg = _data_cfg(name)
    for k, v in overrides.items():
        cfg[k] = v
    return instantiate(cfg, _recursive_=False)


@pytest.fixture(scope="module")
def vllm_url(vllm_server):
    """The session's shared inference server (conftest.vllm_server: grpo.inference.server on tiny-qwen2)."""
    return vllm_server.url


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2_dir)


def _ctx(tokenizer, url="http://unused", max_seq_len=512, seed=0, version=7, batch_size=16) -> PipelineContext:
    return PipelineContext(
        tokenizer=tokenizer, generation=GenerationHandle(lambda: Endpoint(url, None, version)),
        batch_size=batch_size, max_seq_len=max_seq_len, run_dir=Path("/tmp"), total_steps=10, start_step=0,
        checkpoint_every=5, seed=seed,
    )


def _check_group_shape(g: dict, group_size: int, temperature: float) -> None:
    assert len(g.tokens) == len(g.masks) == len(g.scores) == len(g.inference_logprobs) == group_size
    for tokens, masks, lps in zip(g.tokens, g.masks, g.inference_logprobs):
        assert len(tokens) == len(masks) == len(lps)
        n_prompt = masks.index(next(m for m in masks if m != IGNORE_INDEX))
        assert n_prompt > 0 and all(m == -100 for m in masks[:n_prompt])
        assert masks[n_prompt:] == tokens[n_prompt:]  # completion positions carry the token id
        assert lps[:n_prompt] == [1.0] * n_prompt
        assert all(lp <= 0.0 for lp in lps[n_prompt:])
    # Every sequence of a group shares its prompt.
    first = g.tokens[0][: g.masks[0].index(next(m for m in g.masks[0] if m != IGNORE_INDEX))]
    assert all(t[: len(first)] == first for t in g.tokens)
    assert g.temperatures == [temperature] * group_size
    assert g.advantages == [None] * group_size and g.ref_logprobs == [None] * group_size


def test_prompt_stream_is_deterministic_and_resumes(tokenizer):
    a, b = _pipeline("local_digits"), _pipeline("local_digits")
    a.setup(_ctx(tokenizer))
    b.setup(_ctx(tokenizer))
    assert a.prompts_for_step(5) == b.prompts_for_step(5)
    assert a.prompts_for_step(5) != a.prompts_for_step(6)
    c = _pipeline("local_digits")
    c.setup(_ctx(tokenizer, seed=1))
    assert c.prompts_for_step(5) != a.prompts_for_step(5)
    # Resume: a fresh pipeline restored from state_dict produces the same stream from the next step on.
    a.step = 5
    d = _pipeline("local_digits")
    d.load_state_dict(a.state_dict())
    d.setup(_ctx(tokenizer))
    assert d.state_dict() == {"step": 5}
    assert d.prompts_for_step(6) == a.prompts_for_step(6)


def test_config_errors(tokenizer):
    with pytest.raises(ValueError, match="rewards"):
        LocalRolloutPipeline(task=DigitsTask(), rewards={})
    with pytest.raises(ValueError, match="_target_"):
        LocalRolloutPipeline(task=DigitsTask(), rewards={"x": {"weight": 1.0}})
    with pytest.raises(ValueError, match="temperature"):
        LocalRolloutPipeline(task=DigitsTask(), rewards={"d": DigitFractionReward()}, temperature=0.0)
    with pytest.raises(ValueError, match=r"data.min_new_tokens must be in \[0, data.max_new_tokens=16\]"):
        LocalRolloutPipeline(task=DigitsTask(), rewards={"d": DigitFractionReward()}, min_new_tokens=17)
    p = LocalRolloutPipeline(task=DigitsTask(), rewards={"d": DigitFractionReward()}, prompts_per_step=2, group_size=2)
    with pytest.raises(ValueError, match="fewer than"):
        p.setup(_ctx(tokenizer, batch_size=8))


@pytest.mark.vllm
def test_digits_groups_through_vllm(vllm_url, tokenizer):
    from grpo.pipeline.batching import prepare_batch

    pipe = _pipeline("local_digits", prompts_per_step=4, group_size=4, temperature=0.8)
    pipe.setup(_ctx(tokenizer, vllm_url, version=7))
    served = InferenceClient(vllm_url).weight_version()
    groups = pipe.next_groups(0)
    assert len(groups) == 4
    reward = DigitFractionReward()
    prompts = pipe.prompts_for_step(0)
    for g, prompt in zip(groups, prompts):
        _check_group_shape(g, 4, 0.8)
        # The server's own versions at admission and at finish (no sync landed meanwhile), not the endpoint's.
        assert g.weight_version == g.last_weight_version == served
        n_prompt = g.masks[0].count(IGNORE_INDEX)
        assert tokenizer.decode(g.tokens[0][:n_prompt]) == prompt.text
        for tokens, score in zip(g.tokens, g.scores):
            text = tokenizer.decode(tokens[n_prompt:], skip_special_tokens=True)
            assert score == pytest.approx(reward(prompt, text))
            assert len(tokens) - n_prompt <= 16
    m = pipe.last_metrics
    assert 0.0 <= m["reward/digits"] <= 1.0 and m["reward/weighted"] == pytest.approx(m["reward/digits"])
    assert m["generation/seconds"] > 0 and 1 <= m["completion/mean_tokens"] <= 16

    batch = prepare_batch(groups, max_seq_len=512, micro_batch_size=8, pad_token_id=tokenizer.pad_token_id,
                          vocab_size=len(tokenizer))
    assert batch.num_sequences == 16 and len(batch.micro_batches) == 2
    assert batch.metrics["data/missing_logprobs"] == 0 and batch.metrics["data/dropped_too_long"] == 0
    pipe.close()


@pytest.mark.vllm
def test_min_new_tokens_forces_every_completion_to_the_cap(vllm_url, tokenizer):
    """data.min_new_tokens (vLLM's min_tokens): no completion ends before it, where the same seeded step without it
    has completions that stop early (the tiny model samples EOS)."""
    lengths = {}
    for floor in (0, 48):
        pipe = _pipeline("local_digits", prompts_per_step=4, group_size=4, max_new_tokens=48, min_new_tokens=floor)
        pipe.setup(_ctx(tokenizer, vllm_url))
        groups = pipe.next_groups(2)
        lengths[floor] = [len(t) - g.masks[i].count(IGNORE_INDEX) for g in groups for i, t in enumerate(g.tokens)]
        pipe.close()
    assert min(lengths[0]) < 48
    assert lengths[48] == [48] * 16


@pytest.mark.vllm
def test_rollout_batches_from_two_threads_at_once_keep_each_batch_its_own(vllm_url, tokenizer):
    """rollout_batches_in_flight=2 calls rollout_batch from two threads: each batch holds its own step's prompts and
    metrics, and each thread has its own client."""
    import threading

    pipe = _pipeline("local_digits", prompts_per_step=4, group_size=4, max_new_tokens=12)
    pipe.setup(_ctx(tokenizer, vllm_url))
    results: dict[int, tuple] = {}
    clients: dict[int, object] = {}
    start = threading.Barrier(2)

    def generate(step: int) -> None:
        start.wait()
        results[step] = pipe.rollout_batch(step)
        clients[step] = pipe.ctx.generation.client()  # the client this thread generated with

    threads = [threading.Thread(target=generate, args=(step,)) for step in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert sorted(results) == [3, 4]
        assert clients[3] is not clients[4]
        for step, (groups, metrics) in results.items():
            prompts = pipe.prompts_for_step(step)
            assert [tokenizer.decode(g.tokens[0][: g.masks[0].count(IGNORE_INDEX)]) for g in groups] == \
                [p.text for p in prompts]
            assert metrics["generation/seconds"] > 0
            tokens = sum(len(t) - m.count(IGNORE_INDEX) for g in groups for t, m in zip(g.tokens, g.masks))
            assert metrics["completion/mean_tokens"] == pytest.approx(tokens / 16)
        assert pipe.step is None and pipe.last_metrics == {}  # rollout_batch leaves the pipeline's own record alone
    finally:
        pipe.close()


@pytest.mark.vllm
def test_seeded_sampling_repeats_the_step_and_unseeded_does_not(vllm_url, tokenizer):
    def tokens_of_step_0(seeded: bool) -> list:
        pipe = _pipeline("local_digits", prompts_per_step=2, group_size=4, max_new_tokens=12, seeded_sampling=seeded)
        pipe.setup(_ctx(tokenizer, vllm_url, batch_size=8))
        try:
            return [g.tokens for g in pipe.next_groups(0)]
        finally:
            pipe.close()

    # Seeded (the default): the same step draws the same completions from the same weights.
    assert tokens_of_step_0(True) == tokens_of_step_0(True)
    # Unseeded: the engine's own random stream moves on, so 8 completions of 12 tokens come out different.
    assert tokens_of_step_0(False) != tokens_of_step_0(False)


@pytest.mark.vllm
def test_rollouts_without_log_probs_sample_the_same_tokens_and_train_as_on_policy(vllm_url, tokenizer):
    import torch

    from grpo.pipeline.batching import prepare_batch
    from grpo.trainer.loss import GRPOLoss
    from grpo.trainer.loss_interface import LossInputs

    def step_0(rollout_logprobs: bool) -> list:
        pipe = _pipeline("local_digits", prompts_per_step=2, group_size=4, max_new_tokens=12,
                         rollout_logprobs=rollout_logprobs)
        pipe.setup(_ctx(tokenizer, vllm_url, batch_size=8))
        try:
            return pipe.next_groups(0)
        finally:
            pipe.close()

    with_lp, without = step_0(True), step_0(False)
    # Seeded: the log-probs change nothing of what is sampled, and the scores follow the tokens.
    assert [g.tokens for g in without] == [g.tokens for g in with_lp]
    assert [g.scores for g in without] == [g.scores for g in with_lp]
    assert all(lp is None for g in without for lp in g.inference_logprobs)
    assert all(lp is not None for g in with_lp for lp in g.inference_logprobs)
    batch = prepare_batch(without, max_seq_len=512, micro_batch_size=8, pad_token_id=tokenizer.pad_token_id,
                          vocab_size=len(tokenizer))
    assert batch.metrics["data/missing_logprobs"] == 8
    mb = batch.micro_batches[0]
    assert bool(torch.isnan(mb.inference_logprobs[mb.loss_mask > 0]).all())
    # The loss then takes pi_old = its own log-probs: the ratio is exactly 1 at every token, as TRL's one update.
    logprobs = torch.randn(mb.loss_mask.shape, requires_grad=True).clamp(max=0)
    _, m = GRPOLoss()(LossInputs(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask), with_metrics=True)
    assert m["grpo/mean_ratio"] == 1.0 and m["grpo/logprob_diff"] == 0.0 and m["grpo/clipped_fraction"] == 0.0


@pytest.mark.vllm
def test_gsm8k_groups_and_length_cap(vllm_url, tokenizer):
    from grpo.pipeline.batching import prepare_batch

    # max_seq_len leaves room for only a few completion tokens after the longest chat-rendered prompt.
    pipe = _pipeline("local_gsm8k", prompts_per_step=2, group_size=4, max_new_tokens=64)
    pipe.setup(_ctx(tokenizer, vllm_url, batch_size=8))
    longest = max(len(tokenizer.encode(p.text, add_special_tokens=False)) for p in pipe.prompts_for_step(3))
    pipe.ctx.max_seq_len = longest + 5
    groups = pipe.next_groups(3)
    for g in groups:
        _check_group_shape(g, 4, 1.0)
        assert all(len(t) <= longest + 5 for t in g.tokens)
        assert all(s in (0.0, 0.1, 1.0, 1.1) for s in g.scores)
    assert set(pipe.last_metrics) >= {"reward/correct", "reward/format"}
    text = tokenizer.decode(groups[0].tokens[0])
    assert text.startswith("<|im_start|>user\n") and "####" in text
    prepare_batch(groups, max_seq_len=longest + 5, micro_batch_size=8, pad_token_id=tokenizer.pad_token_id)
