"""prepare_batch on Atropos groups built the way an environment builds them."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.pipeline.batching import BatchError, prepare_batch

PAD = 256
VOCAB = 259


def make_group(prompt, completions, scores, *, temperature=None, logprobs=True, **extra):
    """An Atropos group: prompt tokens masked with -100, completion tokens with their own id as mask,
    inference_logprobs 1.0 at prompt positions and the sampled log-prob at completion positions."""
    tokens, masks, lps = [], [], []
    for j, comp in enumerate(completions):
        tokens.append(list(prompt) + list(comp))
        masks.append([-100] * len(prompt) + list(comp))
        lps.append([1.0] * len(prompt) + [-0.1 * (j + 1) - 0.01 * k for k in range(len(comp))])
    g = {
        "tokens": tokens,
        "masks": masks,
        "scores": list(scores),
        "advantages": None,
        "ref_logprobs": None,
        "inference_logprobs": lps if logprobs else None,
        "generation_params": {"temperature": temperature} if temperature is not None else None,
        "overrides": None,
        "group_overrides": None,
        "messages": None,
        "env_id": 0,
    }
    g.update(extra)
    return g


def prep(groups, **kw):
    args = dict(advantage_norm="group", max_seq_len=64, micro_batch_size=8, pad_token_id=PAD, vocab_size=VOCAB)
    args.update(kw)
    return prepare_batch(groups, **args)


def test_shift_pad_and_alignment():
    g = make_group([1, 2, 3], [[10, 11], [20, 21, 22, 23]], [1.0, 0.0])
    pb = prep([g])
    (mb,) = pb.micro_batches
    assert mb.input_ids.shape == (2, 6)  # longest 7 tokens - 1
    assert mb.input_ids[0].tolist() == [1, 2, 3, 10, PAD, PAD]
    assert mb.attention_mask[0].tolist() == [1, 1, 1, 1, 0, 0]
    # labels[t] = tokens[t+1] where that token is a completion token.
    assert mb.labels[0].tolist() == [-100, -100, 10, 11, -100, -100]
    assert mb.labels[1].tolist() == [-100, -100, 20, 21, 22, 23]
    assert mb.loss_mask[1].tolist() == [0, 0, 1, 1, 1, 1]
    # inference_logprobs[t+1] goes with labels[t].
    assert mb.inference_logprobs[0, 2:4].tolist() == pytest.approx([-0.1, -0.11])
    assert mb.inference_logprobs[1, 2:6].tolist() == pytest.approx([-0.2, -0.21, -0.22, -0.23])
    assert mb.ref_logprobs is None
    assert pb.num_loss_tokens == 6 and pb.num_sequences == 2 and pb.max_completion_tokens == 4
    assert pb.metrics["tokens/trained"] == 6 and pb.metrics["tokens/total"] == 12
    assert pb.metrics["reward/mean"] == 0.5 and pb.metrics["reward/max"] == 1.0


def test_group_normalised_advantages():
    pb = prep([make_group([1, 2], [[5], [6], [7], [8]], [1.0, 0.0, 0.0, 1.0])])
    adv = pb.micro_batches[0].advantages
    assert adv.shape == (4,)
    assert adv.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)  # (r - 0.5) / 0.5


def test_advantage_norm_batch_and_none():
    groups = [make_group([1], [[5], [6]], [1.0, 0.0]), make_group([1], [[5], [6]], [3.0, 3.0])]
    none = prep(groups, advantage_norm="none").micro_batches[0].advantages
    assert none.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    batch = prep(groups, advantage_norm="batch").micro_batches[0].advantages
    std = torch.tensor([1.0, 0.0, 3.0, 3.0]).std(unbiased=False).item()
    assert batch.tolist() == pytest.approx([0.5 / std, -0.5 / std, 0.0, 0.0], rel=1e-5)
    # Identical rewards in a group: zero advantage, no blow-up.
    assert prep(groups).micro_batches[0].advantages[2:].tolist() == [0.0, 0.0]


def test_server_advantages_per_sequence_and_per_token():
    g1 = make_group([1, 2], [[5, 6], [7]], [0.0, 0.0], advantages=[0.7, -0.3])
    pb = prep([g1])
    assert pb.micro_batches[0].advantages.tolist() == pytest.approx([0.7, -0.3])
    g2 = make_group([1, 2], [[5, 6], [7]], [1.0, 0.0], advantages=[[0, 0, 0.5, 0.25], [0, 0, -1.0]])
    pb = prep([g2])
    adv = pb.micro_batches[0].advantages
    assert adv.shape == (2, 3)
    assert adv[0].tolist() == pytest.approx([0.0, 0.5, 0.25])  # advantage[t+1] goes with labels[t]
    assert adv[1].tolist() == pytest.approx([0.0, -1.0, 0.0])


def test_mixed_per_token_and_score_groups_broadcast():
    g_tok = make_group([1], [[5, 6]], [0.0], advantages=[[0.0, 0.3, 0.4]])
    g_score = make_group([1], [[5], [6]], [1.0, 0.0])
    adv = prep([g_tok, g_score]).micro_batches[0].advantages
    assert adv.shape == (3, 2)
    assert adv[0].tolist() == pytest.approx([0.3, 0.4])
    assert adv[1].tolist() == pytest.approx([1.0, 0.0], abs=1e-5)  # per-seq value on its loss tokens only


def test_temperature_precedence():
    comps = [[5], [6], [7]]
    g = make_group([1], comps, [0, 1, 0], temperature=0.7, group_overrides={"temperature": 0.5},
                   overrides=[{"temperature": 1.3}, {}, None])
    assert prep([g]).micro_batches[0].temperatures.tolist() == pytest.approx([1.3, 0.7, 0.7])
    g = make_group([1], comps, [0, 1, 0], group_overrides={"temperature": 0.5})
    assert prep([g]).micro_batches[0].temperatures.tolist() == pytest.approx([0.5] * 3)
    g = make_group([1], comps, [0, 1, 0])
    assert prep([g]).micro_batches[0].temperatures.tolist() == [1.0] * 3


def test_set_advantage_to_zero():
    g = make_group([1], [[5], [6], [7], [8]], [1.0, 0.0, 1.0, 0.0],
                   overrides=[{"set_advantage_to_zero": True}, None, {}, {"set_advantage_to_zero": False}])
    adv = prep([g]).micro_batches[0].advantages
    # The other sequences keep the advantages of the full group's statistics.
    assert adv.tolist() == pytest.approx([0.0, -1.0, 1.0, -1.0], abs=1e-5)


def test_null_inference_logprobs_become_nan_and_are_counted():
    g1 = make_group([1, 2], [[5, 6], [7]], [1.0, 0.0], logprobs=False)
    g2 = make_group([1, 2], [[5, 6], [7]], [1.0, 0.0])
    g2["inference_logprobs"][1] = None
    pb = prep([g1, g2])
    inf = pb.micro_batches[0].inference_logprobs
    assert torch.isnan(inf[0]).all() and torch.isnan(inf[1]).all() and torch.isnan(inf[3]).all()
    assert not torch.isnan(inf[2]).any()
    assert pb.metrics["data/missing_logprobs"] == 3


def test_ref_logprobs_aligned_and_nan_when_missing():
    g = make_group([1, 2], [[5, 6], [7]], [1.0, 0.0], ref_logprobs=[[0.0, 0.0, -1.0, -2.0], None])
    ref = prep([g]).micro_batches[0].ref_logprobs
    assert ref[0, 1:3].tolist() == [-1.0, -2.0] and torch.isnan(ref[1]).all()


def test_too_long_dropped_and_counted_micro_batches():
    groups = [make_group([1] * 4, [[5] * k for k in (2, 10, 3)], [1.0, 0.0, 0.5]) for _ in range(3)]
    pb = prep(groups, max_seq_len=8, micro_batch_size=4)
    assert pb.metrics["data/dropped_too_long"] == 3
    assert pb.metrics["data/sequences"] == 6 and pb.num_sequences == 6
    assert [mb.input_ids.shape[0] for mb in pb.micro_batches] == [4, 2]
    # Each micro-batch is padded to its own longest sequence.
    assert pb.micro_batches[0].input_ids.shape[1] == 6
    assert sum(mb.num_loss_tokens for mb in pb.micro_batches) == pb.num_loss_tokens == 15


def test_empty_group_dropped():
    pb = prep([make_group([1], [], []), make_group([1], [[5], [6]], [1.0, 0.0])])
    assert pb.metrics["data/dropped_groups"] == 1 and pb.metrics["data/groups"] == 1
    assert pb.num_sequences == 2


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda g: g.update(tokens=None), "tokens"),
        (lambda g: g.update(masks=None), "masks"),
        (lambda g: g.update(scores=None), "scores"),
        (lambda g: g["scores"].append(1.0), "scores"),
        (lambda g: g["masks"][1].pop(), "masks"),
        (lambda g: g["inference_logprobs"][0].pop(), "inference_logprobs"),
        (lambda g: g["inference_logprobs"][0].__setitem__(3, None), "inference_logprobs"),
        (lambda g: g.update(advantages=[1.0]), "advantages"),
        (lambda g: g.update(advantages=[[0.1, 0.2], 0.3]), "advantages"),
        (lambda g: g.update(advantages=[None, 0.3]), "advantages"),
        (lambda g: g.update(ref_logprobs=[[0.0]] * 2), "ref_logprobs"),
        (lambda g: g["tokens"][0].__setitem__(2, VOCAB), "tokens"),
        (lambda g: g["tokens"][0].__setitem__(2, -1), "tokens"),
        (lambda g: g.update(overrides=[{}]), "overrides"),
        (lambda g: g.update(generation_params={"temperature": 0}), "generation_params"),
        (lambda g: g.update(scores=[1.0, None]), "scores"),
    ],
)
def test_bad_fields_name_group_and_field(mutate, field):
    good = make_group([1, 2], [[5, 6], [7, 8]], [1.0, 0.0])
    bad = make_group([1, 2], [[5, 6], [7, 8]], [1.0, 0.0])
    mutate(bad)
    with pytest.raises(BatchError) as e:
        prep([good, bad])
    assert e.value.group == 1 and e.value.field == field
    assert "group 1" in str(e.value) and field in str(e.value)


def test_no_vocab_check_when_vocab_unknown():
    g = make_group([1], [[5000], [6]], [1.0, 0.0])
    assert prep([g], vocab_size=None).num_sequences == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="advantage_norm"):
        prep([], advantage_norm="per-group")


def test_nothing_left():
    pb = prep([make_group([1] * 10, [[5] * 10], [1.0])], max_seq_len=8)
    assert pb.micro_batches == [] and pb.num_loss_tokens == 0
    assert pb.metrics["data/dropped_groups"] == 1 and pb.metrics["data/dropped_too_long"] == 1
    assert not math.isnan(pb.metrics["reward/mean"])
