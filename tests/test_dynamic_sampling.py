"""Issue 40: DAPO's dynamic sampling (grpo.pipeline.dynamic_sampling): zero-variance groups are never trained, the
refill is bounded and counted; on hand-made groups, then through the local pipeline against the shared vLLM server,
synchronously and inside AsyncRollouts."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import pytest

from grpo.inference.client import Endpoint
from grpo.pipeline.base import BatchShape, PipelineContext
from grpo.pipeline.batching import prepare_batch
from grpo.pipeline.dynamic_sampling import informative, refill
from grpo.pipeline.generation import GenerationHandle
from grpo.pipeline.group import Group
from grpo.pipeline.local import LocalRolloutPipeline
from grpo.pipeline.rollout_queue import AsyncRollouts
from grpo.tasks.prompts import DigitsTask


def _group(scores: list[float]) -> Group:
    n = len(scores)
    return Group.sampled([1, 2], [[3, 4]] * n, [[-0.5, -0.5]] * n, scores, 1.0, weight_version=0)


class Script:
    """generate(round, prompts): hands out groups from a list of rounds (each a list of score lists), recording the
    prompts asked for; past the script every group scores alike."""

    def __init__(self, rounds: list[list[list[float]]]):
        self.rounds = rounds
        self.asked: list[tuple[int, int]] = []

    def __call__(self, refill_round: int, prompts: int) -> list[Group]:
        self.asked.append((refill_round, prompts))
        scripted = self.rounds[refill_round] if refill_round < len(self.rounds) else []
        scores = (scripted + [[1.0, 1.0]] * prompts)[:prompts]
        return [_group(s) for s in scores]


def test_zero_variance_groups_are_dropped_and_the_batch_refilled():
    # Round 0: 2 of 4 informative (rate 1/2), so round 1 asks for the 2 missing / 0.5 = 4 prompts (at most 4).
    script = Script([[[0, 1], [1, 1], [0, 0], [1, 0]], [[1, 1], [0.5, 1], [0, 1], [0, 1]]])
    out = refill(script, target=4, max_rounds=3)
    assert script.asked == [(0, 4), (1, 4)]
    assert all(informative(g) for g in out.groups) and len(out.groups) == 4
    assert [g.scores for g in out.groups] == [[0, 1], [1, 0], [0.5, 1], [0, 1]]  # generation order, trimmed
    m = out.metrics()
    assert m["data/refill_rounds"] == 1 and m["data/groups_generated_per_kept"] == 8 / 4
    assert m["data/zero_variance_groups_dropped"] == 3 and m["data/refill_short_groups"] == 0
    # What the batcher then trains has no zero-advantage group.
    batch = prepare_batch(out.groups, max_seq_len=8, micro_batch_size=4, pad_token_id=0)
    assert batch.metrics["data/zero_advantage_groups"] == 0 and batch.num_sequences == 8


def test_the_refill_stops_after_its_bound_and_trains_what_it_has():
    script = Script([[[0, 1], [1, 1], [1, 1], [1, 1]]])  # then every group scores alike
    out = refill(script, target=4, max_rounds=2)
    assert [r for r, _ in script.asked] == [0, 1, 2]  # the first round and two refills, no more
    assert [g.scores for g in out.groups] == [[0, 1]]
    m = out.metrics()
    assert m["data/refill_rounds"] == 2 and m["data/refill_short_groups"] == 3
    # Nothing informative at all: no group, and a ratio that is unknown rather than a number.
    nothing = refill(Script([]), target=4, max_rounds=0)
    assert nothing.groups == [] and nothing.metrics()["data/refill_short_groups"] == 4
    assert math.isnan(nothing.metrics()["data/groups_generated_per_kept"])


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="data.max_refill_rounds must be >= 0"):
        LocalRolloutPipeline(DigitsTask(), {"r": lambda p, c: 1.0}, max_refill_rounds=-1)


def _pipeline(reward, tokenizer, url, rounds=2) -> LocalRolloutPipeline:
    pipe = LocalRolloutPipeline(DigitsTask(), {"r": reward}, prompts_per_step=4, group_size=4, max_new_tokens=8,
                                dynamic_sampling=True, max_refill_rounds=rounds)
    pipe.setup(PipelineContext(
        tokenizer=tokenizer,
        generation=GenerationHandle(lambda: Endpoint(url, None, 0)), batch_size=16, max_seq_len=128,
        run_dir=Path("/tmp"), total_steps=4, start_step=0, checkpoint_every=5, seed=0,
        batch_shape=BatchShape(micro_batch_size=8, max_seq_len=128, pad_token_id=tokenizer.pad_token_id),
    ))
    return pipe


def _odd_checksum(prompt, completion: str) -> float:
    """A reward that splits most groups of sampled completions, and leaves some groups all alike."""
    return float(zlib.crc32(completion.encode()) % 2)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2_dir)


@pytest.mark.vllm
def test_the_local_pipeline_trains_only_informative_groups_sync_and_async(vllm_server, tokenizer):
    pipe = _pipeline(_odd_checksum, tokenizer, vllm_server.url)
    groups = pipe.next_groups(0)
    m = pipe.metrics()
    assert 0 < len(groups) <= 4 and all(informative(g) for g in groups)
    assert m["data/refill_rounds"] <= 2 and m["data/groups_generated_per_kept"] >= 1
    assert len(groups) + m["data/refill_short_groups"] == 4
    # The same batch again draws the same prompts and samples (seeded per round): a resume regenerates it.
    assert [g.tokens for g in pipe.next_groups(0)] == [g.tokens for g in groups]

    src = AsyncRollouts(pipe, 1)
    src.setup(pipe.ctx)
    try:
        batch = src.next_batch(0)
        assert batch.metrics["data/zero_advantage_groups"] == 0 and batch.num_sequences == 4 * len(groups)
        assert "data/refill_rounds" in src.metrics()
    finally:
        src.close()
    pipe.close()


@pytest.mark.vllm
def test_the_local_pipeline_stops_refilling_at_the_bound(vllm_server, tokenizer):
    pipe = _pipeline(lambda prompt, completion: 1.0, tokenizer, vllm_server.url, rounds=1)
    assert pipe.next_groups(0) == []
    m = pipe.metrics()
    assert m["data/refill_rounds"] == 1 and m["data/zero_variance_groups_dropped"] == 8  # 4 prompts, then 4 more
    assert m["data/refill_short_groups"] == 4
    pipe.close()
