"""Padding-free micro-batches and token-budget micro-batches: packed forwards give the padded path's log-probs, loss
and gradients; a token-budget split gives the fixed split's loss and gradients for every loss aggregation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from grpo.pipeline.batching import prepare_batch
from grpo.pipeline.group import Group
from grpo.schema import TrainConfig
from grpo.trainer.hidden_states import packed_inputs
from grpo.trainer.logprobs import fused_token_loss, naive_token_entropy, token_logprobs
from grpo.trainer.loop import GRPOTrainer
from grpo.trainer.loss import GRPOLoss
from grpo.trainer.loss_interface import LossInputs
from grpo.trainer.metrics import NullMetrics
from grpo.trainer.minibatch import token_budget_groups, token_budget_split, update_plan
from grpo.trainer.train_batch import IGNORE_INDEX, BatchSource


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _ragged(vocab, lengths=(7, 19, 1, 12), seed=0):
    """Right-padded rows of `lengths` real tokens, prompt (first 3 labels) ignored, padding ignored."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(3, vocab, (B, T), generator=g)
    labels = torch.randint(3, vocab, (B, T), generator=g)
    attn = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        attn[b, :n] = 1
        ids[b, n:] = 0
        labels[b, n:] = IGNORE_INDEX
    labels[:, :3] = IGNORE_INDEX
    labels[2, 0] = 5  # the one-token row still carries a label
    return ids, attn, labels, torch.tensor([1.0, 0.7, 1.0, 1.3])


def _grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_packed_inputs_concatenate_rows_and_restart_positions():
    ids = torch.tensor([[5, 6, 7], [8, 0, 0], [9, 10, 0]])
    attn = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    packed, pos = packed_inputs(ids, attn)
    assert packed.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert pos.tolist() == [[0, 1, 2, 0, 0, 1]]


@pytest.mark.parametrize("attn", [None, "varlen"])
@pytest.mark.parametrize("preset", ["tiny_qwen2_dir", "tiny_llama_dir"])
def test_packed_logprobs_and_gradients_equal_the_padded_path(preset, attn, request):
    """Default SDPA (block-diagonal mask from the restarting positions) and varlen (per-sequence SDPA on CPU)."""
    from grpo.models.loading import set_attention

    model = _model(request.getfixturevalue(preset))
    set_attention(model, attn)
    ids, attn, labels, temps = _ragged(model.config.vocab_size)
    out = {}
    for packed in (False, True):
        lp = token_logprobs(model, ids, attn, labels, temps, chunk_size=8, packed=packed)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        out[packed] = (lp.detach(), _grads(model))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-5)
    assert (out[True][0][labels == IGNORE_INDEX] == 0).all()
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_packed_fused_loss_equals_the_padded_path(tiny_qwen2_dir, aggregation):
    model = _model(tiny_qwen2_dir)
    ids, attn, labels, temps = _ragged(model.config.vocab_size, seed=1)
    mask = (labels != IGNORE_INDEX).float()
    rollout = torch.full(mask.shape, -5.0)
    loss_fn = GRPOLoss(aggregation=aggregation, kl_coef=0.05, kl_reference="rollout")
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])

    def loss_of(lp, with_metrics=True):
        return loss_fn(LossInputs(lp, rollout, adv, mask), with_metrics=with_metrics)

    out = {}
    for packed in (False, True):
        loss, metrics, _ = fused_token_loss(model, ids, attn, labels, temps, loss_of, chunk_size=8, packed=packed)
        loss.backward()
        out[packed] = (float(loss.detach()), metrics, _grads(model))
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-5, abs=1e-7)
    assert out[True][1]["grpo/kl"] == pytest.approx(out[False][1]["grpo/kl"], rel=1e-4, abs=1e-7)
    for name, g in out[False][2].items():
        torch.testing.assert_close(out[True][2][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_token_budget_groups_respect_the_budget_and_keep_every_row():
    lengths = [5, 40, 12, 12, 3, 80, 7, 30]
    for packed in (False, True):
        groups = token_budget_groups(lengths, 60, padding_free=packed)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            cost = sum(lengths[i] for i in g) if packed else len(g) * max(lengths[i] for i in g)
            assert cost <= 60 or len(g) == 1  # only a row over the budget stands alone above it
        assert [5] in groups  # the 80-token row
    assert token_budget_groups([10, 10, 10], 30) == [[0, 1, 2]]


def test_token_budget_cost_is_rows_times_longest_padded_and_the_sum_packed():
    assert token_budget_groups([4, 10, 4, 4], 24) == [[1, 0], [2, 3]]  # 2 x 10, then 2 x 4
    assert token_budget_groups([4, 10, 4, 4], 24, padding_free=True) == [[1, 0, 2, 3]]  # 22 tokens


# --------------------------------------------------------------------- the trainer: fixed split vs token budget
def _groups(seed: int, n_groups: int = 3, group_size: int = 4) -> list[Group]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_groups):
        prompt = torch.randint(3, 250, (4 + k,), generator=g).tolist()
        comps = [torch.randint(3, 250, (2 + 5 * j + k,), generator=g).tolist() for j in range(group_size)]
        lps = [[-2.0 - 0.1 * i for i in range(len(c))] for c in comps]
        out.append(Group.sampled(prompt, comps, lps, [float(j % 2) + 0.3 * k for j in range(group_size)], 1.0))
    return out


class _Unused(BatchSource):
    def next_batch(self, step):
        raise AssertionError("not used")


def update_trainer(model, loss_fn, reference=None, **train) -> GRPOTrainer:
    """A GRPOTrainer whose updates run on batches the test hands it (no data source, sync or optimizer movement);
    `reference`: the KL penalty's ReferencePolicy."""
    cfg = OmegaConf.structured(TrainConfig(**{"steps": 1, "micro_batch_size": 3, "grad_accum": 4, **train}))
    sync = SimpleNamespace(version=0, prepare_step=lambda step: None, serves_weights_in_place=False)
    return GRPOTrainer(train_cfg=cfg, model=model, tokenizer=None, optimizer=torch.optim.SGD(model.parameters(), 0.0),
                       scheduler=None, loss_fn=loss_fn, pipeline=_Unused(), sync=sync, checkpoints=None,
                       metrics=NullMetrics(), device=torch.device("cpu"), reference=reference)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("padding_free", [False, True])
def test_token_budget_split_gives_the_fixed_split_loss_and_gradients(tiny_qwen2_dir, aggregation, padding_free):
    model = _model(tiny_qwen2_dir)
    loss_fn = GRPOLoss(aggregation=aggregation, kl_coef=0.02, kl_reference="rollout")
    batch = prepare_batch(_groups(0), max_seq_len=64, micro_batch_size=3, pad_token_id=0)
    fixed = update_trainer(model, loss_fn)
    loss_fixed, metrics_fixed = fixed.forward_backward(batch)
    grads_fixed = _grads(model)
    budget = update_trainer(model, loss_fn, max_tokens_per_micro_batch=40, padding_free=padding_free)
    (_, split), = budget.plan(batch)
    assert len(split.micro_batches) != len(batch.micro_batches)  # the budget did re-split the rows
    assert split.num_loss_tokens == batch.num_loss_tokens and split.num_sequences == batch.num_sequences
    loss_split, metrics_split = budget.forward_backward(split)
    assert loss_split == pytest.approx(loss_fixed, rel=1e-5, abs=1e-7)
    assert metrics_split["grpo/kl"] == pytest.approx(metrics_fixed["grpo/kl"], rel=1e-4, abs=1e-7)
    assert metrics_split["grpo/entropy"] == pytest.approx(metrics_fixed["grpo/entropy"], rel=1e-5)
    for name, g in grads_fixed.items():
        torch.testing.assert_close(model.get_parameter(name).grad, g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("fused_loss", [True, False])
def test_the_step_reports_the_policys_mean_entropy_over_its_loss_tokens(tiny_qwen2_dir, fused_loss):
    """`grpo/entropy`: the mean over the step's loss tokens of each token's entropy at its sampling temperature,
    whichever log-prob path ran (fused loss or not), equal to the full-softmax computation over the whole batch."""
    model = _model(tiny_qwen2_dir)
    batch = prepare_batch(_groups(0), max_seq_len=64, micro_batch_size=3, pad_token_id=0)
    assert len(batch.micro_batches) > 1
    trainer = update_trainer(model, GRPOLoss(), fused_loss=fused_loss)
    _, metrics = trainer.forward_backward(batch)
    total = count = 0.0
    for mb in batch.micro_batches:
        with torch.no_grad():
            entropy = naive_token_entropy(model, mb.input_ids, mb.attention_mask, mb.labels, mb.temperatures)
        total += float((entropy * mb.loss_mask).sum())
        count += float(mb.loss_mask.sum())
    assert metrics["grpo/entropy"] == pytest.approx(total / count, rel=1e-5)
    assert 0 < metrics["grpo/entropy"] < math.log(model.config.vocab_size)
    # train.entropy_metric=false leaves it out, and nothing else changes.
    model.zero_grad(set_to_none=True)
    _, without = update_trainer(model, GRPOLoss(), fused_loss=fused_loss, entropy_metric=False).forward_backward(batch)
    assert without.keys() == metrics.keys() - {"grpo/entropy"}
    assert without["grpo/kl"] == metrics["grpo/kl"] and without["grpo/mean_ratio"] == metrics["grpo/mean_ratio"]


def test_an_entropy_bonus_gives_the_same_gradients_on_every_log_prob_path(tiny_qwen2_dir):
    """loss.entropy_coef through the trainer: the fused loss, the unfused path, padding-free and prefix-shared
    forwards all give the gradients of one computation (the bonus's included), with grpo/entropy logged even when
    train.entropy_metric=false; the bonus changes them."""
    model = _model(tiny_qwen2_dir)
    batch = prepare_batch(_groups(0), max_seq_len=64, micro_batch_size=3, pad_token_id=0)
    loss_fn = GRPOLoss(entropy_coef=0.05, aggregation="seq_mean_token_mean")
    results = []
    for train in (dict(fused_loss=True), dict(fused_loss=False), dict(padding_free=True, entropy_metric=False),
                  dict(prefix_sharing=True, fused_loss=False)):
        loss, metrics = update_trainer(model, loss_fn, **train).forward_backward(batch)
        results.append((loss, metrics["grpo/entropy"], _grads(model)))
    (loss0, entropy0, grads0), *others = results
    for loss, entropy, grads in others:
        assert loss == pytest.approx(loss0, rel=1e-5, abs=1e-7) and entropy == pytest.approx(entropy0, rel=1e-5)
        for name, g in grads0.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    loss_plain, _ = update_trainer(model, GRPOLoss(aggregation="seq_mean_token_mean")).forward_backward(batch)
    assert loss0 < loss_plain  # the bonus (positive entropies) lowers the loss
    plain = _grads(model)
    assert max(float((plain[n] - g).abs().max()) for n, g in grads0.items()) > 1e-5


def test_token_budget_applies_to_mini_batches_too():
    batch = prepare_batch(_groups(1), max_seq_len=64, micro_batch_size=3, pad_token_id=0)
    plan = update_plan(batch, ppo_epochs=1, mini_batches=2, seed=0, batch_number=0, max_tokens=30)
    assert sum(m.num_sequences for _, m in plan) == batch.num_sequences
    for _, mini in plan:
        for mb in mini.micro_batches:
            assert mb.num_sequences == 1 or mb.input_ids.numel() <= 30
    single = token_budget_split(batch, 10**6)
    assert len(single.micro_batches) == 1 and single.metrics is batch.metrics


def test_update_reports_pad_fraction_and_tflops(tiny_qwen2_dir):
    model = _model(tiny_qwen2_dir)
    batch = prepare_batch(_groups(2), max_seq_len=64, micro_batch_size=3, pad_token_id=0)
    fixed = update_trainer(model, GRPOLoss())
    m = fixed.perf(batch, seconds=0.5)
    assert 0 < m["batch/pad_fraction"] < 1 and m["perf/tflops"] > 0 and math.isnan(m["perf/mfu"])  # CPU: no peak
    packed = update_trainer(model, GRPOLoss(), padding_free=True)
    assert packed.perf(batch, seconds=0.5)["batch/pad_fraction"] == 0.0


# --------------------------------------------------------------------- the attention kernel of packed rows
@pytest.mark.parametrize("attn", ["eager", "flex_attention"])
def test_packed_rows_keep_attention_per_sequence_under_other_kernels(tiny_qwen2_dir, attn):
    """model.attn_implementation: eager (explicit block-diagonal mask) and FlexAttention (document mask; forward
    only here, CPU has no flex backward) give the padded SDPA path's log-probs on packed rows."""
    from grpo.models.loading import set_attention

    model = _model(tiny_qwen2_dir)
    ids, attn_mask, labels, temps = _ragged(model.config.vocab_size)
    sel = labels != IGNORE_INDEX
    with torch.no_grad():
        padded = token_logprobs(model, ids, attn_mask, labels, temps)
        # set_attention refuses flex on a CPU trainer (no backward there); its forward runs, so switch directly.
        if attn == "eager":
            set_attention(model, attn)
        else:
            model.set_attn_implementation(attn)
        assert model.config._attn_implementation == attn
        packed = token_logprobs(model, ids, attn_mask, labels, temps, packed=True)
    assert torch.allclose(packed[sel], padded[sel], atol=1e-5)


def test_packed_boundaries_are_the_cumulative_lengths_of_the_non_empty_rows():
    from grpo.trainer.hidden_states import packed_boundaries

    attn = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    b = packed_boundaries(attn)
    assert b["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and b["cu_seq_lens_q"].dtype == torch.int32
    assert b["max_length_q"] == 4 and b["cu_seq_lens_k"] is b["cu_seq_lens_q"]


def test_varlen_attention_without_boundaries_reads_them_from_positions_and_keeps_padding_masks(tiny_qwen2_dir):
    """A packed row passed with position ids only, and an unpacked left-padded batch with its 2D mask, give SDPA's
    log-probs: the kernel never lets a token see another sequence or a pad."""
    from grpo.models.loading import set_attention
    from grpo.trainer.hidden_states import backbone_and_head

    model = _model(tiny_qwen2_dir)
    ids, attn_mask, labels, temps = _ragged(model.config.vocab_size)
    left_ids, left_mask = torch.zeros_like(ids), torch.zeros_like(attn_mask)
    for b, n in enumerate(attn_mask.sum(1).tolist()):  # the same rows, left-padded
        left_ids[b, ids.shape[1] - n:], left_mask[b, ids.shape[1] - n:] = ids[b, :n], 1
    with torch.no_grad():
        want_left = model(input_ids=left_ids, attention_mask=left_mask).logits
        packed_ids, positions = packed_inputs(ids, attn_mask)
        want_packed = backbone_and_head(model)[0](input_ids=packed_ids, position_ids=positions,
                                                 use_cache=False).last_hidden_state
        set_attention(model, "varlen")
        got_left = model(input_ids=left_ids, attention_mask=left_mask).logits
        got_packed = backbone_and_head(model)[0](input_ids=packed_ids, position_ids=positions,
                                                use_cache=False).last_hidden_state
    real = left_mask.bool()
    torch.testing.assert_close(got_left[real], want_left[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(got_packed, want_packed, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the flash varlen kernel)")
def test_varlen_flash_kernel_gives_the_padded_paths_logprobs_and_gradients_on_cuda(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    from grpo.models.loading import set_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.bfloat16).cuda()
    ids, attn, labels, temps = (t.cuda() for t in _ragged(model.config.vocab_size))
    out = {}
    for packed, kernel in ((False, "sdpa"), (True, "varlen")):
        set_attention(model, kernel)
        lp = token_logprobs(model, ids, attn, labels, temps, chunk_size=8, packed=packed)
        (lp * torch.linspace(-1, 1, lp.numel(), device="cuda").view_as(lp)).sum().backward()
        out[packed] = (lp.detach().float(), _grads(model))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=2e-2)  # bf16
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name].float(), g.float(), rtol=5e-2, atol=5e-3, msg=name)


def test_flex_attention_is_refused_for_a_cpu_trainer(tiny_qwen2_dir):
    from grpo.models.loading import set_attention

    model = _model(tiny_qwen2_dir)
    with pytest.raises(ValueError, match="only on CUDA"):
        set_attention(model, "flex_attention")
    with pytest.raises(ValueError, match="not one of"):
        set_attention(model, "flash")
    set_attention(model, None)  # null keeps the loaded kernel
    assert model.config._attn_implementation == "sdpa"


def test_out_of_memory_in_an_update_says_which_micro_batch_and_what_to_lower(tiny_qwen2_dir):
    """A device OOM inside the forward/backward (raised here by the loss, as CUDA would raise it mid-backward)
    becomes an error naming the update's largest micro-batch and the knobs that lower the peak."""
    from grpo.trainer.out_of_memory import TrainerOutOfMemoryError

    class OutOfMemoryLoss(GRPOLoss):
        def __call__(self, *args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 182.00 MiB.")

    model = _model(tiny_qwen2_dir)
    batch = prepare_batch(_groups(3), max_seq_len=64, micro_batch_size=3, pad_token_id=0)
    largest = max(batch.micro_batches, key=lambda mb: mb.input_ids.numel())
    longest = int(largest.attention_mask.sum(dim=1).max())
    with pytest.raises(TrainerOutOfMemoryError) as e:
        update_trainer(model, OutOfMemoryLoss()).update(batch)
    msg = str(e.value)
    assert (f"step 1: out of device memory in the forward/backward of a micro-batch of {3 * longest} tokens "
            f"(3 sequences x {longest} tokens, padded)") in msg
    for knob in ("train.micro_batch_size", "train.max_tokens_per_micro_batch", "model.gradient_checkpointing=true",
                 "server.gpu_memory_utilization"):
        assert knob in msg
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)


def test_compiled_decoder_blocks_give_the_eager_logprobs_and_gradients(tiny_qwen2_dir):
    """model.compile: torch.compile per block, under gradient checkpointing, packed varlen rows of two different
    lengths (dynamic shapes: the second does not recompile into something else)."""
    from grpo.models.loading import compile_decoder_layers, set_attention

    out = {}
    for compiled in (False, True):
        model = _model(tiny_qwen2_dir)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        set_attention(model, "varlen")
        if compiled:
            assert compile_decoder_layers(model) == model.config.num_hidden_layers
        for seed, lengths in enumerate([(7, 19, 1, 12), (9, 30, 4, 2)]):
            ids, attn, labels, temps = _ragged(model.config.vocab_size, lengths=lengths, seed=seed)
            lp = token_logprobs(model, ids, attn, labels, temps, chunk_size=8, packed=True)
            (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
            out[compiled, seed] = (lp.detach(), _grads(model))
    for seed in (0, 1):
        torch.testing.assert_close(out[True, seed][0], out[False, seed][0], rtol=0, atol=1e-5)
        for name, g in out[False, seed][1].items():
            torch.testing.assert_close(out[True, seed][1][name], g, rtol=1e-4, atol=1e-6, msg=name)
