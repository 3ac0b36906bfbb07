"""TRL's ``GRPOTrainer`` on the arithmetic skill task, mirroring ``experiment=arith_grpo``: held-out accuracy vs time.

    python bench/trl_arith.py --seed S [--steps 400] [--eval-every 50] [--out bench/results/trl_arith_sS.json]
    python bench/trl_arith.py --seed 0 --steps 6 --eval-every 3 --out /tmp/trl_arith_smoke.json   # smoke test

Ours is ``python train.py experiment=arith_grpo train.seed=S``; ``bench/arith_curves.py`` plots both (README "Skill
task"). Every setting is read from the same composed Hydra config as ours (``experiment=arith_grpo``, plus any
``--override key=value``), so a change to the experiment moves both sides:

- model: the cached warm-start directory of ``model=warm_arith`` (``grpo.recipes.warmstart.warmstart_path``; never
  rebuilt here), float32, full fine-tuning, on CPU;
- prompts: exactly ours, step by step: optimizer step b (0-based) trains on
  ``ArithmeticTask.sample(random.Random(f"grpo-local:{seed}:{b}"), prompts_per_step)`` (what
  ``LocalRolloutPipeline.prompts_for_step`` draws), as a dataset read in order (``shuffle_dataset=False``); training
  never draws a held-out item by construction of the task;
- rewards: our two reward classes (``data.rewards``) wrapped as TRL reward functions, with our weights
  (``reward_weights``, summed then normalised as ours);
- batch: ``num_generations`` = group size (8), ``per_device_train_batch_size`` = micro-batch (64),
  ``gradient_accumulation_steps`` = grad_accum (2), so ``steps_per_generation`` = 2 and ``generation_batch_size`` =
  128 = 16 prompts x 8: one generation and one optimizer step per 16 groups, as ours;
- generation: ``max_completion_length`` = ``data.max_new_tokens``, temperature, top_p 1, top_k 0, no chat template
  (raw ``"12+34="`` prompts); with transformers' ``generate`` (``use_vllm=False``, the default here; ``--vllm`` tries
  TRL's colocated vLLM, which does not run with the CPU engine installed here: README "Skill task");
- optimizer: ours, handed to TRL (``optimizers=``): ``torch.optim.AdamW`` (lr, betas, eps, weight decay and
  ``fused`` of ``optimizer``) and our own ``LambdaLR`` (``grpo.trainer.optim.build_scheduler``: warm-up
  (k+1)/(w+1), then constant), grad-norm clip ``train.max_grad_norm``;
- loss: ``beta=0`` (no KL, no reference model), ``epsilon`` = ``loss.clip_eps``, ``loss_type="dapo"`` (sum over the
  step's tokens / the step's token count = our ``token_mean``), ``scale_rewards="group"`` (our
  ``advantage_norm=group``), one update per batch (``num_iterations=1``).

- what this comparison does not set is TRL's own default, except where ours differs and TRL has a setting:
  gradient checkpointing as ours (``gradient_checkpointing`` = ``model.gradient_checkpointing``, off in the
  experiments; TRL's default is on), and with ``--vllm`` its sampler in ours' dtype (``--vllm-dtype``, default
  ``server.dtype``, handed to TRL's ``LLM`` by ``sample_in``: TRL 1.16 has no setting for it). Its importance-sampling
  correction (``vllm_importance_sampling_correction``) stays at TRL's default, on.

`differences()` lists what TRL does not let us match, true for the CPU set-up or, with ``--vllm``, for the GPU run;
the JSON carries it, with the settings above as they ran.

``--checkpoints DIR`` saves TRL's model at every evaluation step and the last (``DIR/checkpoint-N``, the save time
kept off the clock), so that our evaluator scores both sides:
``grpo-eval experiment=<experiment> --initial DIR --out trl_eval.json`` (``bench/gpu/README.md``, "How to run the
comparison").

Held-out evaluation (a ``TrainerCallback``): at step 0 (before the first generation) and every ``--eval-every``
optimizer steps and after the last, greedy decoding with transformers (``grpo.recipes.warmstart.generate_answers``)
on the task's 500 ``eval_prompts()``, correct = our correctness reward (``data.rewards``' first) >= 1, the same
token cap as our evaluator (``min(max_new_tokens, max_seq_len - longest prompt)``). Eval time is excluded from the
time axis on both sides: each row has ``time/train_seconds`` (since ``on_train_begin``, eval excluded: the x axis),
``time/run_seconds`` (eval included, the definition of ours in metrics.jsonl) and ``eval/seconds``.
``bench/arith_curves.py`` subtracts our cumulative ``eval/seconds`` from our ``time/run_seconds`` the same way.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

# The wall clock from process start (time/process_seconds in each row).
PROCESS_START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, loadavg, machine, max_rss_bytes  # noqa: E402

# What TRL 1.16 does not let us match (or what we chose not to), for the JSON and bench/README.md: those of every
# run, then those of the CPU set-up (transformers generate()) or of the GPU run (--vllm: TRL's colocated vLLM).
DIFFERENCES = [
    "advantage std: TRL divides by the group's sample std (Bessel, n-1 = 7) + 1e-4; ours by the population std "
    "(n = 8) + 1e-6 -> TRL's advantages are sqrt(7/8) = 0.935x ours (same sign and ranking; Adam mostly "
    "normalises the scale away, the grad-norm clip does not)",
    "time origin: ours time/run_seconds starts when the training loop starts (vLLM server already up, its "
    "start-up in summary.json's wall_seconds); TRL's at on_train_begin (model loaded, trainer built); each TRL row "
    "also has time/process_seconds (since this script started) for the wall clock from process start",
    "per-step logging and checkpoints: TRL computes and logs its own metrics each step (logging_steps=1); ours "
    "writes a metrics.jsonl row each step and checkpoints every train.checkpoint_every steps and at the end (inside "
    "our loop time); TRL saves only with --checkpoints (at its evaluation steps, the save time kept off its clock "
    "as its evaluation time is)",
]
CPU_DIFFERENCES = [
    "sampling seeds: ours vLLM's per-request sampling; TRL torch's RNG seeded by --seed (GRPOConfig.seed)",
    "pi_old of the PPO ratio: ours = the rollout log-probs from vLLM (loss.old_logprobs=rollout), so the ratio "
    "starts at exp(trainer - sampler log-prob) and the clip can act on engine mismatch; TRL (transformers "
    "generation, num_iterations=1) = the trainer's own log-probs detached, ratio exactly 1, the clip never acts",
    "generation engine: ours vLLM CPU engine in a server process (weights synced every step, sync time in our "
    "loop time); TRL transformers generate() in the training process (no sync); sampling streams differ, so "
    "the sampled completions differ even at identical weights",
    "held-out eval: ours greedy through vLLM (plus pass@4 samples, also excluded from time); TRL side greedy with "
    "transformers generate() on the same 500 items and the same correctness reward (tie-breaking of equal logits "
    "may differ between engines); eval time excluded from the time axis on both sides",
    "threads: both use torch's default (all cores) unless --threads is given; ours also runs the vLLM CPU engine "
    "as a second process on the same cores",
]
# With --vllm (a GPU): both sides generate with vLLM on the same GPU.
GPU_DIFFERENCES = [
    "generation engine: ours a vLLM server process on the same GPU sharing the trainer's weights "
    "(mode=shared_vllm: one copy, no transfer); TRL vLLM colocated in the training process "
    "(vllm_mode=colocate), the weights copied into it every generation batch; both sample in --vllm-dtype "
    "(default: ours, server.dtype), which this harness hands to TRL's LLM (TRL 1.16 has no dtype setting; left "
    "to itself, dtype='auto', vLLM samples a float32 model in bfloat16)",
    "importance correction and pi_old: ours takes the PPO ratio against the rollout log-probs from vLLM "
    "(loss.old_logprobs=rollout: the clip acts on engine mismatch and on the step of staleness) and no separate "
    "importance weight; TRL (num_iterations=1) takes the ratio against its own detached log-probs (exactly 1, the "
    "clip never acts) and corrects for the sampler with its default vllm_importance_sampling_correction=True "
    "(sequence_mask: each sequence weighted by its trainer/vLLM probability ratio, masked above 3.0)",
    "sampling seeds: ours vLLM's, per request when data.seeded_sampling (else unseeded); TRL's colocated engine's "
    "seed (0, the process index), whatever --seed",
    "reward grading: ours in data.reward_workers processes beside generation; TRL calls the same reward classes "
    "in the training process after each generation batch",
    "held-out eval inside each run: ours greedy + pass@k through its vLLM server; TRL's callback greedy with "
    "transformers generate() on the same items and correctness reward. The comparable figures: with --checkpoints, "
    "grpo-eval evaluates TRL's checkpoints with our evaluator (vLLM greedy + pass@k, the same grading and seeds)",
]


def config_differences(cfg) -> list[str]:
    """The differences that follow from our composed experiment (its async rollouts, its work-saving switches)."""
    out = []
    if int(cfg.train.max_staleness) > 0:
        out.append(f"rollouts: ours asynchronous (train.max_staleness={int(cfg.train.max_staleness)}: each batch may be "
                   "generated by weights that many optimizer steps old, the next batch generating while this one "
                   "trains); TRL synchronous (each batch generated by the current weights)")
    if int(cfg.train.get("rollout_batches_in_flight", 1)) > 1:
        out.append(f"rollout batches generating at once: ours {int(cfg.train.rollout_batches_in_flight)} "
                   "(train.rollout_batches_in_flight; each still within train.max_staleness), TRL one")
    if cfg.train.get("prefix_sharing") or cfg.train.get("skip_zero_advantage"):
        out.append("work per step: ours forwards each prompt once for its group (train.prefix_sharing) and leaves "
                   "groups whose rewards all agree out of the forward passes (train.skip_zero_advantage): the same "
                   "loss and gradients with less work; TRL forwards every sequence")
    return out


def differences(cfg, vllm: bool) -> list[str]:
    """Every difference between TRL's run and ours that the results carry: true for the CPU set-up or, with
    `vllm`, for the GPU run."""
    return [*DIFFERENCES, *(GPU_DIFFERENCES if vllm else CPU_DIFFERENCES), *config_differences(cfg)]


def trl_settings(cfg, *, steps: int, eval_every: int, seed: int, vllm: bool, checkpoints: str | None,
                 reward_weights: list[float], use_cpu: bool) -> dict:
    """TRL's GRPOConfig arguments mirroring our composed config (the module docstring says how each maps)."""
    opt, loss = cfg.optimizer, cfg.loss
    colocated = {}
    if vllm:
        # TRL's own default for its importance-sampling correction (on) stays: the comparison does not set it.
        colocated = {"use_vllm": True, "vllm_mode": "colocate",
                     "vllm_gpu_memory_utilization": float(cfg.server.gpu_memory_utilization),
                     "vllm_max_model_length": int(cfg.model.max_seq_len)}
    saving = {"save_strategy": "no"}
    if checkpoints:
        # At the evaluation steps (and the last, Trainer's own rule), the model alone: what grpo-eval reads.
        saving = {"save_strategy": "steps", "save_steps": eval_every, "save_only_model": True}
    return dict(
        output_dir=checkpoints or tempfile.mkdtemp(prefix="bench_trl_arith_"),
        per_device_train_batch_size=int(cfg.train.micro_batch_size),
        gradient_accumulation_steps=int(cfg.train.grad_accum),
        num_generations=int(cfg.data.group_size), max_completion_length=int(cfg.data.max_new_tokens),
        temperature=float(cfg.data.temperature), top_p=float(cfg.data.top_p), top_k=0,
        # For the record: the optimizer and schedule handed over in main() are what runs.
        learning_rate=float(opt.lr), adam_beta1=float(opt.betas[0]), adam_beta2=float(opt.betas[1]),
        adam_epsilon=float(opt.eps), weight_decay=float(opt.weight_decay), warmup_steps=int(cfg.train.warmup_steps),
        lr_scheduler_type=str(cfg.train.lr_schedule),
        max_grad_norm=float(cfg.train.max_grad_norm), loss_type="dapo", beta=0.0, epsilon=float(loss.clip_eps),
        epsilon_high=float(loss.clip_eps_high if loss.clip_eps_high is not None else loss.clip_eps),
        num_iterations=1, scale_rewards="group", reward_weights=reward_weights, mask_truncated_completions=False,
        max_steps=steps, use_cpu=use_cpu, bf16=False, fp16=False, report_to=[], logging_steps=1, **saving,
        # Recompute activations as ours does (model.gradient_checkpointing; TRL's own default is on).
        gradient_checkpointing=bool(cfg.model.gradient_checkpointing),
        seed=seed, disable_dropout=True, shuffle_dataset=False, remove_unused_columns=False, **colocated,
    )


def sample_in(dtype: str) -> None:
    """Have TRL's colocated vLLM sample in `dtype`: TRL 1.16 builds its `LLM` without a dtype (vLLM's 'auto', which
    turns a float32 model into bfloat16), so the harness hands it ours; 'auto' leaves TRL's own."""
    if dtype == "auto":
        return
    generation = importlib.import_module("trl.generation.vllm_generation")  # where TRL's colocate mode finds LLM
    llm = generation.LLM

    def llm_in_dtype(*args, **kwargs):
        return llm(*args, **{**kwargs, "dtype": dtype})

    generation.LLM = llm_in_dtype


def compose_ours(overrides: list[str], experiment: str = "arith_grpo"):
    """The composed config of ``experiment=<experiment>`` (as ``train.py`` sees it) with ``overrides``."""
    from hydra import compose, initialize_config_dir

    from grpo.config import register_configs

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose(config_name="train", overrides=[f"experiment={experiment}", *overrides])


def model_directory(cfg) -> Path:
    """The model directory of ``cfg.model``: the cached warm-start directory (never built here: build it with
    ``python -m grpo.recipes.warmstart warm-arith``), or the packaged real model (built on first use)."""
    from grpo.recipes.initial_weights import resolve_model_dir
    from grpo.recipes.warmstart import WARMSTART_PRESETS, warmstart_path

    if cfg.model.offline in WARMSTART_PRESETS:
        path = warmstart_path(cfg.model.offline, int(cfg.model.seed))
        if not (path / "config.json").exists():
            raise SystemExit(f"{path} is not built: run `python -m grpo.recipes.warmstart {cfg.model.offline}` first")
        return path
    return Path(resolve_model_dir(cfg.model))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="= ours train.seed: same prompts per step; TRL's torch seed")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: ours, train.steps = 400)")
    ap.add_argument("--eval-every", type=int, default=None, help="default: ours, eval.every = 50")
    ap.add_argument("--out", default=None, help="default bench/results/trl_arith_s<seed>.json")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--vllm", action="store_true", help="TRL's colocated vLLM (use_vllm=True, vllm_mode=colocate)")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override of our config (repeat)")
    ap.add_argument("--experiment", default="arith_grpo", help="our experiment to mirror (e.g. smollm2_chat_arith_shared "
                    "on a GPU, with --vllm)")
    ap.add_argument("--vllm-dtype", default=None,
                    help="with --vllm: the dtype TRL's vLLM samples in (default: ours, server.dtype; 'auto' = TRL's "
                         "own, which samples a float32 model in bfloat16)")
    ap.add_argument("--checkpoints", default=None, metavar="DIR",
                    help="save TRL's model at every evaluation step and the last into DIR/checkpoint-N (for grpo-eval; "
                         "save time kept off the clock)")
    ap.add_argument("--check-eval", nargs="+", metavar="MODEL_DIR", default=None,
                    help="only evaluate these model dirs (e.g. our checkpoints) with this side's evaluator and exit")
    args = ap.parse_args(argv)
    if args.vllm:  # vLLM's external launcher (TRL's colocate mode) joins a torch.distributed group: one process, rank 0
        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": "29517"}.items():
            os.environ.setdefault(k, v)
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo.models.loading import load_tokenizer
    from grpo.pipeline.local import build_rewards
    from grpo.recipes.warmstart import generate_answers, score
    from grpo.tasks.prompts import Prompt
    from grpo.trainer.optim import build_scheduler

    cfg = compose_ours([f"train.seed={args.seed}", *args.override], args.experiment)
    steps = int(args.steps or cfg.train.steps)
    eval_every = int(args.eval_every or cfg.eval.every)
    out = Path(args.out or RESULTS / f"trl_{args.experiment}_s{args.seed}.json")
    from hydra.utils import instantiate

    task = instantiate(cfg.data.task)
    rewards = build_rewards(cfg.data.rewards)
    correct_name = cfg.eval.correct_reward or next(iter(rewards))
    correct_fn = rewards[correct_name][0]
    mdir = model_directory(cfg)
    tok = load_tokenizer(str(mdir))
    task.bind_tokenizer(tok)  # chat tasks render through the tokenizer's template, as ours does at setup
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32)
    if torch.cuda.is_available():
        model = model.cuda()
    heldout = task.eval_prompts()
    longest = max(len(tok.encode(p.text, add_special_tokens=False)) for p in heldout)
    eval_tokens = max(1, min(int(cfg.eval.max_new_tokens or cfg.data.max_new_tokens), int(cfg.model.max_seq_len) - longest))

    def evaluate(m) -> dict:
        t0 = time.perf_counter()
        was_training = m.training
        m.eval()
        completions = generate_answers(m, tok, [p.text for p in heldout], eval_tokens)
        m.train(was_training)
        right = [s >= float(cfg.eval.correct_threshold) for s in score(correct_fn, heldout, completions)]
        return {"eval/accuracy": sum(right) / len(right), "eval/prompts": len(right),
                "eval/seconds": time.perf_counter() - t0, "eval/samples": completions[:4]}

    if args.check_eval:
        checks = {d: evaluate(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)) for d in [str(mdir), *args.check_eval]}
        for d, r in checks.items():
            print(f"{r['eval/accuracy']:.3f}  ({r['eval/seconds']:.2f} s)  {d}")
        return checks

    # Our prompt stream, step by step (LocalRolloutPipeline.prompts_for_step), read in order by TRL.
    per_step = int(cfg.data.prompts_per_step)
    prompts = [p for b in range(steps) for p in task.sample(random.Random(f"grpo-local:{args.seed}:{b}"), per_step)]
    dataset = Dataset.from_dict({"prompt": [p.text for p in prompts], "answer": [p.answer for p in prompts]})

    seen_batches: list[list[str]] = []  # the distinct prompts of each generation batch, to check the order

    def as_trl(name, fn):
        def reward(prompts, completions, answer, **kw):
            if name == next(iter(rewards)):
                seen_batches.append(sorted(set(prompts)))
            return [float(fn(Prompt(p, a), c)) for p, c, a in zip(prompts, completions, answer)]

        reward.__name__ = name
        return reward

    reward_funcs = [as_trl(name, fn) for name, (fn, _) in rewards.items()]
    reward_weights = [float(w) for _, w in rewards.values()]

    class HeldOut(TrainerCallback):
        """Held-out greedy accuracy at step 0, every `eval_every` steps and at the end; eval time kept off the clock."""

        def __init__(self):
            self.rows, self.step_seconds, self.t0, self.eval_total, self.last = [], [], None, 0.0, None
            self.save_total = 0.0

        def _eval(self, step, m):
            train_s = time.perf_counter() - self.t0 - self.eval_total
            row = {"step": step, **evaluate(m), "loadavg": loadavg()}
            self.eval_total += row["eval/seconds"]
            row["time/train_seconds"] = train_s
            row["time/run_seconds"] = time.perf_counter() - self.t0
            row["time/process_seconds"] = time.perf_counter() - PROCESS_START
            # The checkpoint saves (--checkpoints) so far, inside time/process_seconds: what a wall-clock ratio subtracts.
            row["time/save_seconds"] = self.save_total
            self.rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "eval/samples"}), flush=True)

        def on_train_begin(self, a, state, control, model=None, **kw):
            self.t0 = time.perf_counter()
            self._eval(0, model)
            self.last = time.perf_counter()

        def on_step_end(self, a, state, control, model=None, **kw):
            now = time.perf_counter()
            self.step_seconds.append(now - self.last)
            if state.global_step % eval_every == 0 or state.global_step == state.max_steps:
                self._eval(state.global_step, model)
            self.last = time.perf_counter()

        def on_save(self, a, state, control, **kw):
            # Trainer saves after on_step_end: the save (--checkpoints) is kept off the clock as evaluation is.
            seconds = time.perf_counter() - self.last
            self.save_total += seconds
            self.eval_total += seconds
            self.last = time.perf_counter()

    heldout_cb = HeldOut()
    opt = cfg.optimizer
    # The same AdamW kernel as ours: optimizer.fused (null = torch's default).
    fused = {} if opt.get("fused") is None else {"fused": bool(opt.fused)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(opt.lr), betas=tuple(float(b) for b in opt.betas),
                                  eps=float(opt.eps), weight_decay=float(opt.weight_decay), **fused)
    scheduler = build_scheduler(optimizer, cfg.train.lr_schedule, int(cfg.train.warmup_steps), steps)
    if str(opt._target_) != "torch.optim.AdamW":
        raise SystemExit(f"optimizer {opt._target_}: this benchmark mirrors torch.optim.AdamW only")
    loss = cfg.loss
    if loss.aggregation != "token_mean" or loss.kl_coef or loss.dual_clip or loss.tis_cap or cfg.train.ppo_epochs != 1 \
            or cfg.train.mini_batches != 1 or cfg.train.advantage_norm != "group":
        raise SystemExit("this benchmark maps loss=grpo (token_mean, no KL/dual clip/TIS), one update per batch and "
                         "advantage_norm=group only")
    vllm_dtype = str(args.vllm_dtype or cfg.server.dtype)
    if args.vllm:
        sample_in(vllm_dtype)
    trl_cfg = trl_settings(cfg, steps=steps, eval_every=eval_every, seed=args.seed, vllm=args.vllm,
                           checkpoints=args.checkpoints, reward_weights=reward_weights,
                           use_cpu=not torch.cuda.is_available())
    config = GRPOConfig(**trl_cfg)
    assert config.steps_per_generation == int(cfg.train.grad_accum), config.steps_per_generation
    assert not args.vllm or config.vllm_importance_sampling_correction  # TRL's default, left on
    assert config.generation_batch_size == per_step * int(cfg.data.group_size), config.generation_batch_size
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=config, processing_class=tok,
                          train_dataset=dataset, callbacks=[heldout_cb], optimizers=(optimizer, scheduler))
    load_start = loadavg()
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [{k: h.get(k) for k in ("step", "reward", "reward_std", "loss", "grad_norm", "learning_rate",
                                   "completions/mean_length", "clip_ratio/region_mean", "step_time")}
            for h in trainer.state.log_history if "reward" in h]
    train_s = heldout_cb.rows[-1]["time/train_seconds"]
    # Each generation batch must hold exactly our step's prompts (same step, same 16 prompts, 8 completions each).
    ours_steps = [sorted({p.text for p in prompts[b * per_step:(b + 1) * per_step]}) for b in range(steps)]
    prompts_match = seen_batches == ours_steps
    if not prompts_match:
        print(f"WARNING: TRL's generation batches do not hold our per-step prompts ({len(seen_batches)} batches)")
    res = {
        "bench": "trl_arith", "command": "python bench/trl_arith.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(), "trl": __import__("trl").__version__, "seed": args.seed, "steps": steps,
        "eval_every": eval_every, "model_dir": str(mdir), "generation": "vllm colocate" if args.vllm else "transformers generate()",
        "ours_command": f"python train.py experiment={args.experiment} train.seed={args.seed}"
                        + "".join(f" {o}" for o in args.override),
        "prompts_match_ours_per_step": prompts_match, "rows": heldout_cb.rows, "step_seconds": heldout_cb.step_seconds,
        "train_seconds_per_step": train_s / max(steps, 1), "train_seconds": train_s,
        "eval_seconds_total": heldout_cb.eval_total - heldout_cb.save_total, "save_seconds_total": heldout_cb.save_total,
        "checkpoints": args.checkpoints, "vllm_dtype": vllm_dtype if args.vllm else None,
        "vllm_importance_sampling_correction": bool(config.vllm_importance_sampling_correction) if args.vllm else None,
        "gradient_checkpointing": bool(config.gradient_checkpointing), "wall_seconds_train_call": wall,
        "loadavg_start": load_start, "loadavg_end": loadavg(), "max_rss_gb": max_rss_bytes() / 1024**3,
        "trl_config": {k: v for k, v in trl_cfg.items() if k != "output_dir"},
        "optimizer": {"class": "torch.optim.AdamW", **{k: (list(v) if k == "betas" else v) for k, v in opt.items()
                                                        if k != "_target_"}},
        "schedule": {"kind": str(cfg.train.lr_schedule), "warmup_steps": int(cfg.train.warmup_steps),
                     "rule": "grpo.trainer.optim.lr_lambda: (k+1)/(w+1) during warm-up, then constant"},
        "eval": {"items": len(heldout), "decoding": "greedy, transformers generate()", "max_new_tokens": eval_tokens,
                 "correct_reward": correct_name},
        "differences": differences(cfg, args.vllm), "logs": logs,
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS",) if k in os.environ},
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("steps", "train_seconds", "train_seconds_per_step", "eval_seconds_total",
                                          "loadavg_start", "loadavg_end")}))
    print("accuracy:", [(r["step"], r["eval/accuracy"], round(r["time/train_seconds"], 1)) for r in res["rows"]])
    return res


if __name__ == "__main__":
    main()
