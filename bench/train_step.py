"""Train-step throughput and peak memory: our GRPO step against TRL's GRPO loss path, same model, batch and loss.

    python bench/train_step.py [--models tiny small] [--rounds 2] [--steps 3]

One optimizer step on one micro-batch of B sequences (prompt P tokens, completions of random length in [C/2, C]),
full fine-tuning, AdamW (lr 1e-6), gradient clip 1.0, clip eps 0.2, no KL, token-mean over the batch:

- ours: ``grpo.pipeline.batching.prepare_batch`` (outside the timed region) → ``grpo.trainer.logprobs.fused_token_loss``
  → ``grpo.trainer.loss.GRPOLoss(aggregation="token_mean")`` → backward → clip → ``build_optimizer`` AdamW step.
- trl: a real ``trl.GRPOTrainer`` (dummy reward, one-row dataset, ``loss_type="dapo"`` = token sum / tokens in the
  batch, ``beta=0``, ``temperature=1``) and its own ``compute_loss(model, inputs)`` (→ ``_compute_loss`` →
  ``_get_per_token_logps_and_entropies`` → its fused chunked LM head) on the inputs dict its
  ``_generate_and_score_completions`` would produce (``prompt_ids/mask``, ``completion_ids/mask``, ``advantages``,
  ``old_per_token_logps``, ``num_items_in_batch``) → backward → clip → torch AdamW step.

Both get the same rollout log-probs (so TRL skips its extra old-log-prob forward, as it does without vLLM) and the
same advantages; the first step's loss of both is reported as an equivalence check. Each measurement runs in its
own subprocess (clean peak RSS), alternating ours/trl ``--rounds`` times so both see the same machine load.
Trained tokens/s = loss tokens / median step seconds (forward + backward + clip + optimizer step).
Peak memory: the subprocess's max RSS (``ru_maxrss``, includes imports and model) and the step's RSS high-water
mark above the RSS before the step (a 2 ms sampler).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, RssPeak, loadavg, machine, max_rss_bytes, model_dir, run_json  # noqa: E402

SHAPES = {  # model: (B sequences, P prompt tokens, C max completion tokens)
    "tiny": (64, 32, 64),
    "small": (8, 32, 128),
}


def make_data(vocab: int, B: int, P: int, C: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, min(vocab, 250), (B, P), generator=g)
    comp = torch.randint(3, min(vocab, 250), (B, C), generator=g)
    lengths = torch.randint(C // 2, C + 1, (B,), generator=g)
    cmask = (torch.arange(C)[None, :] < lengths[:, None]).long()
    old_lp = -torch.rand(B, C, generator=g) * 3 * cmask
    scores = torch.rand(B, generator=g)
    return {"prompt": prompt, "comp": comp, "cmask": cmask, "old_lp": old_lp, "scores": scores, "lengths": lengths}


def group_advantages(scores, group: int = 8):
    s = scores.view(-1, group)
    return ((s - s.mean(1, keepdim=True)) / (s.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)


def setup(args):
    """Model, batch and the one-optimizer-step closure of ``args.impl`` on ``args.model``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    mdir = model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(mdir)
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32)
    vocab = model.config.vocab_size
    B, P, C = SHAPES[args.model]
    d = make_data(vocab, B, P, C)
    adv = group_advantages(d["scores"])
    n_tokens = int(d["cmask"].sum())

    if args.impl == "ours":
        from grpo.algorithms.aggregation import Totals
        from grpo.pipeline.batching import prepare_batch
        from grpo.trainer.logprobs import fused_token_loss
        from grpo.trainer.loss import GRPOLoss
        from grpo.trainer.loss_interface import LossInputs
        from grpo.trainer.optim import build_optimizer

        groups = []
        for g0 in range(0, B, 8):
            grp = {"tokens": [], "masks": [], "scores": [], "inference_logprobs": [], "advantages": []}
            for i in range(g0, g0 + 8):
                L = int(d["lengths"][i])
                c = d["comp"][i, :L].tolist()
                grp["tokens"].append(d["prompt"][i].tolist() + c)
                grp["masks"].append([-100] * P + c)
                grp["inference_logprobs"].append([1.0] * P + d["old_lp"][i, :L].tolist())
                grp["scores"].append(float(d["scores"][i]))
                grp["advantages"].append(float(adv[i]))
            groups.append(grp)
        batch = prepare_batch(groups, max_seq_len=P + C, micro_batch_size=B, pad_token_id=tok.pad_token_id,
                              vocab_size=vocab)  # fmt: skip
        assert batch.num_loss_tokens == n_tokens, (batch.num_loss_tokens, n_tokens)
        mb = batch.micro_batches[0]
        loss_fn = GRPOLoss(clip_eps=0.2, aggregation="token_mean")
        opt = build_optimizer(model, {"_target_": "torch.optim.AdamW", "lr": 1e-6, "weight_decay": 0.0})
        params = [p for p in model.parameters() if p.requires_grad]

        def step() -> float:
            model.train()
            opt.zero_grad(set_to_none=True)
            def loss_of(lp, with_metrics=True):
                inputs = LossInputs(lp, mb.inference_logprobs, mb.advantages, mb.loss_mask,
                                    totals=Totals(tokens=batch.num_loss_tokens, sequences=batch.num_sequences))
                return loss_fn(inputs, with_metrics=with_metrics)

            # The trainer's default path (train.fused_loss=true, train.logprob_chunk=512; GRPOTrainer._train_step).
            loss, _, _ = fused_token_loss(model, mb.input_ids, mb.attention_mask, mb.labels, mb.temperatures, loss_of, 512)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            return float(loss.detach())
    elif args.impl == "ref":
        # The Atropos reference trainer's own step (example_trainer.training.run_training_step): full [B, T, V]
        # logits, cross-entropy log-probs, per-sequence token mean, clip 1.0, optimizer step. Its data layout
        # (example_trainer.data.pad_data_to_good_offset): tokens[:-1] in, labels = masks[1:], [B, 1] advantages,
        # [B, 1, 1] temperatures, inference log-probs aligned with labels.
        from types import SimpleNamespace

        from example_trainer.training import run_training_step

        full = torch.cat([d["prompt"], d["comp"]], 1)
        labels = torch.cat([torch.full_like(d["prompt"], -100), torch.where(d["cmask"] > 0, d["comp"], -100)], 1)
        inf = torch.cat([torch.ones_like(d["prompt"], dtype=torch.float32), d["old_lp"]], 1)
        tokens, labels, inf = full[:, :-1].contiguous(), labels[:, 1:].contiguous(), inf[:, 1:].contiguous()
        config = SimpleNamespace(clip_eps=0.2, warmup_steps=0, lr=1e-6, gradient_accumulation_steps=1, device="cpu")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, weight_decay=0.0)
        temps = torch.ones(B, 1, 1)
        step_idx = [0]

        def step() -> float:
            model.train()
            m = run_training_step(model, opt, [tokens], [labels], [adv[:, None]], [temps], config, step_idx[0],
                                  inference_logprob_batches=[inf])  # fmt: skip
            step_idx[0] += 1
            return float(m.get("loss", float("nan")))
    else:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        tmp = tempfile.mkdtemp(prefix="bench_trl_")
        cfg = GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=B, num_generations=8, max_completion_length=C,
            loss_type="dapo", beta=0.0, epsilon=0.2, temperature=1.0, learning_rate=1e-6, max_grad_norm=1.0,
            use_cpu=True, bf16=False, fp16=False, report_to=[], logging_steps=1, save_strategy="no",
            disable_dropout=True,
        )  # fmt: skip
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=cfg,
                              train_dataset=Dataset.from_dict({"prompt": ["x"] * B}), processing_class=tok)  # fmt: skip
        trainer.current_gradient_accumulation_steps = 1
        tmodel = trainer.model
        inputs = {
            "prompt_ids": d["prompt"], "prompt_mask": torch.ones_like(d["prompt"]),
            "completion_ids": d["comp"] * d["cmask"] + tok.pad_token_id * (1 - d["cmask"]),
            "completion_mask": d["cmask"], "advantages": adv, "old_per_token_logps": d["old_lp"],
            "num_items_in_batch": torch.tensor(float(n_tokens)),
        }  # fmt: skip
        opt = torch.optim.AdamW([p for p in tmodel.parameters() if p.requires_grad], lr=1e-6, weight_decay=0.0)
        params = [p for p in tmodel.parameters() if p.requires_grad]

        def step() -> float:
            tmodel.train()
            opt.zero_grad(set_to_none=True)
            loss = trainer.compute_loss(tmodel, inputs)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            return float(loss.detach())

    return step, model, n_tokens, (B, P, C), vocab


def worker(args) -> dict:
    import torch

    step, model, n_tokens, (B, P, C), vocab = setup(args)
    rss_before_first = max_rss_bytes()
    with RssPeak() as m:
        first_loss = step()  # also the warm-up
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {
        "impl": args.impl, "model": args.model, "B": B, "P": P, "C": C, "loss_tokens": n_tokens,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "vocab": vocab,
        "first_loss": first_loss, "times": times, "step_s": statistics.median(times),
        "tokens_per_s": n_tokens / statistics.median(times),
        "step_peak_mib": (m.peak - m.start) / 2**20, "max_rss_mib": max_rss_bytes() / 2**20,
        "max_rss_before_step_mib": rss_before_first / 2**20, "torch_threads": torch.get_num_threads(),
        "loadavg_end": loadavg(),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"])
    p.add_argument("--rounds", type=int, default=2, help="ours/trl alternations per model")
    p.add_argument("--steps", type=int, default=3, help="timed steps per subprocess (after one warm-up step)")
    p.add_argument("--impls", nargs="+", default=["ours", "trl", "ref"],
                   help="ours, trl (TRL GRPOTrainer.compute_loss), ref (atropos-grpo's run_training_step)")
    p.add_argument("--impl", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--interleaved", action="store_true",
                   help="time only: all --impls in ONE process, their steps alternated (A,B,C,A,B,C,...), so a noisy "
                        "machine's load hits every side alike; peak memory needs the subprocess mode")
    p.add_argument("--out", default=str(RESULTS / "train_step.json"))
    args = p.parse_args(argv)
    if args.impl:
        print(json.dumps(worker(args)))
        return {}
    if args.interleaved:
        return interleaved(args)

    runs = []
    for model in args.models:
        model_dir(model)  # build once, outside the measured subprocesses
        for r in range(args.rounds):
            impls = list(args.impls) if r % 2 == 0 else list(reversed(args.impls))
            for impl in impls:
                res = run_json([sys.executable, __file__, "--impl", impl, "--model", model, "--steps", str(args.steps)])
                res["round"] = r
                print(f"  {model:5} {impl:4} round {r}: {res['step_s']:.3f} s/step  {res['tokens_per_s']:8.0f} tok/s  "
                      f"max RSS {res['max_rss_mib']:.0f} MiB  step peak +{res['step_peak_mib']:.0f} MiB  "
                      f"loss {res['first_loss']:.6f}  load {res['loadavg_end']:.1f}", flush=True)  # fmt: skip
                runs.append(res)
    rows, rows_ref = [], []
    for model in args.models:
        agg = {}
        for impl in args.impls:
            rs = [x for x in runs if x["model"] == model and x["impl"] == impl]
            times = [t for x in rs for t in x["times"]]
            agg[impl] = {
                "step_s": statistics.median(times), "tokens_per_s": rs[0]["loss_tokens"] / statistics.median(times),
                "max_rss_mib": max(x["max_rss_mib"] for x in rs), "step_peak_mib": max(x["step_peak_mib"] for x in rs),
                "first_loss": rs[0]["first_loss"],
            }  # fmt: skip
        o, t = agg["ours"], agg.get("trl")
        if "ref" in agg:
            rf = agg["ref"]
            rows_ref.append({"model": model, "shape": "B={} P={} C<={}".format(*SHAPES[model]), "ours": o, "ref": rf,
                             "throughput_ratio": o["tokens_per_s"] / rf["tokens_per_s"],
                             "max_rss_ratio": o["max_rss_mib"] / rf["max_rss_mib"]})  # fmt: skip
        if t is None:
            continue
        rows.append({
            "model": model, "shape": "B={} P={} C<={}".format(*SHAPES[model]), "loss_tokens": runs[0]["loss_tokens"]
            if runs[0]["model"] == model else next(x["loss_tokens"] for x in runs if x["model"] == model),
            "ours": o, "trl": t, "throughput_ratio": o["tokens_per_s"] / t["tokens_per_s"],
            "max_rss_ratio": o["max_rss_mib"] / t["max_rss_mib"], "step_peak_ratio": o["step_peak_mib"] / max(t["step_peak_mib"], 1e-9),
            "loss_abs_diff": abs(o["first_loss"] - t["first_loss"]),
        })  # fmt: skip
    result = {"bench": "train_step", "machine": machine(), "command": "python bench/train_step.py " + " ".join(argv or sys.argv[1:]),
              "rows": rows, "rows_ref": rows_ref, "runs": runs}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result


def interleaved(args) -> dict:
    import types

    out = {"bench": "train_step_interleaved", "command": "python bench/train_step.py --interleaved " + " ".join(sys.argv[1:]),
           "rows": []}  # fmt: skip
    for model in args.models:
        steps = {}
        for impl in args.impls:
            fn, _, n_tokens, shape, _ = setup(types.SimpleNamespace(impl=impl, model=model))
            fn()  # warm-up
            steps[impl] = fn
        times = {impl: [] for impl in args.impls}
        for r in range(args.steps):
            for impl in (args.impls if r % 2 == 0 else args.impls[::-1]):
                t0 = time.perf_counter()
                steps[impl]()
                times[impl].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"model": model, "shape": "B={} P={} C<={}".format(*shape), "loss_tokens": n_tokens, "times": times,
               "tokens_per_s": {k: n_tokens / v for k, v in med.items()},
               "ratio_vs": {k: med[k] / med["ours"] for k in med if k != "ours"}, "loadavg_end": loadavg()}  # fmt: skip
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    out["machine"] = machine()
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return out


def table(result: dict) -> str:
    lines = ["| model | batch | loss tokens | ours tok/s | TRL tok/s | ratio | ours max RSS MiB | TRL max RSS MiB "
             "| ours step peak MiB | TRL step peak MiB | |loss diff| |", "|" + "---|" * 11]
    for r in result["rows"]:
        o, t = r["ours"], r["trl"]
        lines.append(f"| {r['model']} | {r['shape']} | {r['loss_tokens']} | {o['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} "
                     f"| {r['throughput_ratio']:.2f}x | {o['max_rss_mib']:.0f} | {t['max_rss_mib']:.0f} "
                     f"| {o['step_peak_mib']:.0f} | {t['step_peak_mib']:.0f} | {r['loss_abs_diff']:.1e} |")  # fmt: skip
    if result.get("rows_ref"):
        lines += ["", "| model | batch | ours tok/s | atropos-grpo step tok/s | ratio | ours max RSS MiB | ref max RSS MiB "
                  "| ours step peak MiB | ref step peak MiB |", "|" + "---|" * 9]  # fmt: skip
        for r in result["rows_ref"]:
            o, f = r["ours"], r["ref"]
            lines.append(f"| {r['model']} | {r['shape']} | {o['tokens_per_s']:.0f} | {f['tokens_per_s']:.0f} "
                         f"| {r['throughput_ratio']:.2f}x | {o['max_rss_mib']:.0f} | {f['max_rss_mib']:.0f} "
                         f"| {o['step_peak_mib']:.0f} | {f['step_peak_mib']:.0f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
