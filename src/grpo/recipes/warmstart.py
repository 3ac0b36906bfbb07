"""Warm-start models: an offline model given a short supervised warm-up on a task, so it has *part* of a skill.

GRPO needs a policy whose sampled groups disagree (some right, some wrong): a random model never answers an
arithmetic question right, a fully trained one always does, and both give zero advantages. A warm-start preset builds
a tiny model of `grpo.models.tiny` (byte tokenizer, real architecture), then trains it for a fixed number of
deterministic supervised steps on the task's *training* stream (`task.sample`, which never draws a held-out item)
until it answers some of the held-out set right: the preset's step count is tuned so that held-out greedy accuracy
lands between 5 % and 40 %.

The task and its correctness reward are named by `_target_` in the preset: any task with `sample(rng, n)` and
`eval_prompts()`, any reward `reward(prompt, completion) -> float`. The preset is data (its JSON is part of the
cache key, so the names stay strings); this module lives in `grpo.recipes`, a layer above the tasks whose
classes it instantiates, so no layer below reaches up for it.

The directory is Hugging Face format (safetensors, config, tokenizer, generation config), so vLLM, transformers and
TRL load it, plus `warmstart.json` with what was measured at build time (held-out greedy accuracy in transformers,
the pass rate of samples, build seconds, machine load). It is cached under the content hash of everything that
determines it (preset, seed, the task's held-out set and training stream, this module's version).

A preset may start from a packaged real model (grpo.models.packaged) and learn from a chat teacher, whose episodes
are OpenAI messages rendered with the agent's chat template (grpo.recipes.chat_demos): smollm2-135m-warm-calc teaches
SmolLM2 the openai-SDK calculator agent's tool calls.

CLI: ``python -m grpo.recipes.warmstart warm-arith`` (or ``grpo-warmstart``) builds it (progress bar) and prints the
directory and how long it took. Runs get it through ``model.offline=warm-arith`` (conf/model/warm_arith.yaml).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from grpo.models.packaged import PACKAGED_MODELS, build_packaged_model_dir
from grpo.models.tiny import build_model_dir, cache_root, publish_model_dir
from grpo.recipes.chat_demos import ChatEpisodes, measure_chat

log = logging.getLogger(__name__)

# Bump when the training recipe below changes in a way the preset does not show (invalidates cached builds).
WARMSTART_VERSION = 3
METADATA_FILE = "warmstart.json"

WARMSTART_PRESETS: dict[str, dict[str, Any]] = {
    # Arithmetic (grpo.tasks.arithmetic, the defaults of conf/data/arithmetic.yaml: two 2-digit operands, + and -)
    # on tiny-qwen2 (0.6 M params). The SFT answers come from a careless teacher that drops carries and borrows on
    # 80 % of the items (right on the others): the model learns both procedures, greedy decoding mostly follows the
    # careless one, samples hold the right answer often enough for GRPO to find it. Constant learning rate after
    # warm-up (no decay to 0): an annealed model sits in a sharp minimum that the first RL updates knock it out of,
    # which hid every gain in our trials (bench/README.md, "Skill task"). lr 5e-4, not 1e-3: at 1e-3 only 6 of 17
    # builds (other seeds / data streams) left the plateau of loss ~0.9 within 2500 steps; at 5e-4, 11 of 11 did.
    # The calculator (grpo.tasks.calculator, the defaults of conf/data/calculator.yaml: 3-digit x 3-digit
    # products, the tool offered) on tiny-qwen2: whole teacher episodes (CalculatorTeacher), the loss on the model's
    # turns only. Phase 1 (call share 0.8) teaches the model to copy a call and the tool's value exactly; phase 2
    # (call share 0.25, a fresh optimizer) makes calling rare, so the warm start mostly guesses the product and GRPO
    # has a right habit (calling) and a wrong one (guessing) to tell apart (bench/README.md, "Multi-turn: the
    # calculator tool"). The settings of bench/calculator_tool.py's warm start.
    "warm-calc": {
        "base": "tiny-qwen2",
        "task": {
            "_target_": "grpo.tasks.calculator.LongArithmeticTask",
            "min_digits": 3,
            "max_digits": 3,
            "operators": "*",
            "heldout_size": 64,
            "heldout_seed": 20261126,
        },
        "reward": {"_target_": "grpo.tasks.calculator.LongAnswerReward"},
        "phases": [
            {"teacher": {"_target_": "grpo.tasks.calculator.CalculatorTeacher", "call_share": 0.8,
                         "plain_share": 0.2},
             "sft": {"steps": 1500, "batch_size": 32, "lr": 5e-4, "warmup_steps": 100, "schedule": "constant",
                     "betas": [0.9, 0.98], "max_grad_norm": 1.0}},
            {"teacher": {"_target_": "grpo.tasks.calculator.CalculatorTeacher", "call_share": 0.25,
                         "plain_share": 0.2},
             "sft": {"steps": 300, "batch_size": 32, "lr": 5e-4, "warmup_steps": 100, "schedule": "constant",
                     "betas": [0.9, 0.98], "max_grad_norm": 1.0}},
        ],
        # The first turn's answer (the product guessed without the tool) on the held-out prompts.
        "measure": {"max_new_tokens": 16, "temperature": 1.0, "sample_n": 8, "sample_prompts": 64},
    },
    # The openai-SDK calculator agent (grpo.tasks.agent_calculator, data=agent_calculator's task) on the packaged
    # SmolLM2-135M-Instruct, which never calls the tool by itself: a short supervised fine-tune on the agent's own
    # episodes (AgentCalculatorTeacher: the agent's system message and tool list, then half the time a <tool_call>
    # JSON block, the tool's value and that value as the answer, else the product at once) rendered with the agent
    # experiment's chat template (chatml_tools). Demonstrations that all call leave a model that calls and is right
    # every time, so GRPO has nothing to tell apart; half and half makes its sampled episodes disagree (calls right,
    # guesses wrong). No episode is asked without the tool, so that task stays undemonstrated. Few steps (on both
    # threads of a 2-core CPU): a format to learn, not arithmetic. The measure: first turns at temperature 1 read
    # back as calls, and the answers without the tool (bench/README.md, "Agents: SmolLM2's warm start").
    "smollm2-135m-warm-calc": {
        "base": "smollm2-135m",
        "task": {
            "_target_": "grpo.tasks.agent_calculator.CalculatorQuestions",
            "min_digits": 3,
            "max_digits": 3,
            "operators": "*",
            "heldout_size": 64,
            "heldout_seed": 20261126,
            "question": "{expression}=",
        },
        "reward": {"_target_": "grpo.tasks.calculator.LongAnswerReward"},
        "chat_template": "chatml_tools",
        "threads": 2,
        "gpu_if_available": True,
        "teacher": {"_target_": "grpo.tasks.agent_calculator.AgentCalculatorTeacher", "call_share": 0.5},
        "sft": {"steps": 16, "batch_size": 8, "lr": 1e-4, "warmup_steps": 2, "schedule": "cosine",
                "betas": [0.9, 0.999], "max_grad_norm": 1.0},
        "measure": {"max_new_tokens": 48, "temperature": 1.0, "sample_n": 4, "sample_prompts": 16},
    },
    "warm-arith": {
        "base": "tiny-qwen2",
        "task": {
            "_target_": "grpo.tasks.arithmetic.ArithmeticTask",
            "min_operands": 2,
            "max_operands": 2,
            "min_digits": 2,
            "max_digits": 2,
            "heldout_size": 500,
            "heldout_seed": 20261122,
        },
        "reward": {"_target_": "grpo.tasks.arithmetic.ArithmeticCorrectReward"},
        # Who writes the SFT answers: teacher(prompt, rng) -> answer text; null = the task's right answers.
        "teacher": {"_target_": "grpo.tasks.arithmetic.CarelessTeacher", "share": 0.8},
        "sft": {"steps": 2500, "batch_size": 64, "lr": 5e-4, "warmup_steps": 50, "schedule": "constant",
                "betas": [0.9, 0.98], "max_grad_norm": 1.0},
        # What warmstart.json measures: greedy accuracy on the whole held-out set, and `sample_n` samples at
        # `temperature` for the first `sample_prompts` held-out prompts (the pass rate GRPO starts from).
        "measure": {"max_new_tokens": 8, "temperature": 1.0, "sample_n": 8, "sample_prompts": 64},
    },
}


def _instantiate(node: dict[str, Any]) -> Any:
    from hydra.utils import instantiate

    return instantiate(node, _convert_="all")


def _fingerprint(name: str, seed: int, spec: dict[str, Any], task: Any) -> str:
    """Hash of everything that determines the weights: preset, seed, recipe version, the task's actual data."""
    h = hashlib.sha256()
    # Where it builds is left out: a build from either device serves (the metadata says which it was).
    recipe = {k: v for k, v in spec.items() if k != "gpu_if_available"}
    h.update(json.dumps({"name": name, "seed": seed, "spec": recipe, "version": WARMSTART_VERSION}, sort_keys=True).encode())
    # The task's data itself, so a changed generator is a new model even when its arguments did not change.
    for p in task.eval_prompts():
        h.update(f"{p.text}\x00{p.answer}\x01".encode())
    for p in task.sample(random.Random(f"warmstart-fingerprint:{seed}"), 256):
        h.update(f"{p.text}\x00{p.answer}\x01".encode())
    return h.hexdigest()[:12]


def _phases(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The supervised phases of a preset: its `phases`, or its one `teacher` and `sft`."""
    return spec.get("phases") or [{"teacher": spec.get("teacher"), "sft": spec["sft"]}]


def warmstart_path(name: str, seed: int = 0) -> Path:
    """The cache directory of preset `name` (built or not)."""
    spec = _preset(name)
    task = _instantiate(dict(spec["task"]))
    return cache_root() / f"{name}-s{seed}-{_fingerprint(name, seed, spec, task)}"


def _preset(name: str) -> dict[str, Any]:
    if name not in WARMSTART_PRESETS:
        raise ValueError(f"unknown warm-start preset {name!r}; known: {', '.join(sorted(WARMSTART_PRESETS))}")
    return WARMSTART_PRESETS[name]


def _encode_example(tokenizer: Any, prompt_text: str, answer: str, eos_id: int) -> tuple[list[int], list[int]]:
    """Token ids of prompt + answer + EOS, and labels with the prompt masked (-100): the model learns the answer."""
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [eos_id]
    return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids


def _sft_batch(tokenizer: Any, examples: Sequence[tuple[str, str]], eos_id: int, pad_id: int):
    return _padded([_encode_example(tokenizer, text, answer, eos_id) for text, answer in examples], pad_id)


def _padded(pairs: Sequence[tuple[list[int], list[int]]], pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in pairs)
    ids = torch.tensor([i + [pad_id] * (width - len(i)) for i, _ in pairs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in pairs])
    return ids, labels


def supervised_warmup(model: Any, tokenizer: Any, task: Any, sft: dict[str, Any], seed: int, progress: bool = True,
                      teacher: Any = None, stream: str = "") -> float:
    """Train `model` in place on `sft["steps"]` batches of `task.sample` items (answer tokens only); returns seconds.

    AdamW with linear warm-up, then `sft["schedule"]`: constant, or cosine decay to 0. The answers are
    `teacher(prompt, rng)` (the task's own answers when None), or a teacher with an `episode(task, prompt, rng,
    tokenizer) -> (ids, labels)` method writes whole examples (multi-turn episodes); prompts and teacher draw from
    one stream, `random.Random(f"warmstart-sft:{seed}{stream}")`.
    """
    import torch
    from tqdm.auto import tqdm

    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
    steps, warmup = int(sft["steps"]), int(sft["warmup_steps"])
    torch.manual_seed(seed)
    rng = random.Random(f"warmstart-sft:{seed}{stream}")
    opt = torch.optim.AdamW(model.parameters(), lr=float(sft["lr"]), betas=tuple(sft["betas"]), weight_decay=0.0)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if sft.get("schedule", "cosine") == "constant":
            return 1.0
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    device = next(model.parameters()).device  # the batches are built on the CPU; the model may be on a GPU
    t0 = time.monotonic()
    bar = tqdm(range(steps), desc="warm-start SFT", disable=not progress, mininterval=1.0)
    for _ in bar:
        prompts = task.sample(rng, int(sft["batch_size"]))
        if hasattr(teacher, "episode"):
            ids, labels = _padded([teacher.episode(task, p, rng, tokenizer) for p in prompts], pad_id)
        else:
            examples = [(p.text, teacher(p, rng) if teacher is not None else str(p.answer)) for p in prompts]
            ids, labels = _sft_batch(tokenizer, examples, eos_id, pad_id)
        loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), float(sft["max_grad_norm"]))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    model.eval()
    return time.monotonic() - t0


def generate_answers(
    model: Any, tokenizer: Any, texts: Sequence[str], max_new_tokens: int, temperature: float = 0.0,
    num_return_sequences: int = 1, batch_size: int = 256,
) -> list[str]:
    """Completions of `texts` with transformers (greedy when temperature == 0), decoded without special tokens.

    Prompts are left-padded by hand so the tokenizer's own padding side is never changed. The result holds
    `num_return_sequences` completions per text, consecutive.
    """
    import torch

    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
    out: list[str] = []
    for start in range(0, len(texts), batch_size):
        enc = [tokenizer.encode(t, add_special_tokens=False) for t in texts[start:start + batch_size]]
        width = max(len(e) for e in enc)
        device = next(model.parameters()).device
        ids = torch.tensor([[pad_id] * (width - len(e)) + e for e in enc], device=device)
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc], device=device)
        sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 else {"do_sample": False}
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos_id,
                pad_token_id=pad_id, num_return_sequences=num_return_sequences, **sampling,
            )
        out.extend(tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True))
    return out


def score(reward: Callable[[Any, str], float], prompts: Sequence[Any], completions: Sequence[str]) -> list[float]:
    """`reward(prompt, completion)` for each completion; `completions` holds len(completions)/len(prompts) per prompt."""
    per = len(completions) // len(prompts)
    return [float(reward(prompts[i // per], c)) for i, c in enumerate(completions)]


def measure(model: Any, tokenizer: Any, task: Any, reward: Any, cfg: dict[str, Any], seed: int) -> dict[str, float]:
    """Held-out greedy accuracy, and pass rate / share of groups with reward variance of samples at temperature."""
    import torch

    heldout = task.eval_prompts()
    greedy = score(reward, heldout, generate_answers(model, tokenizer, [p.text for p in heldout], cfg["max_new_tokens"]))
    subset = heldout[: int(cfg["sample_prompts"])]
    n = int(cfg["sample_n"])
    torch.manual_seed(seed)
    sampled = score(reward, subset, generate_answers(
        model, tokenizer, [p.text for p in subset], cfg["max_new_tokens"], float(cfg["temperature"]), n))
    groups = [sampled[i:i + n] for i in range(0, len(sampled), n)]
    return {
        "heldout_greedy_accuracy": sum(greedy) / len(greedy),
        "heldout_items": len(heldout),
        "sampled_pass_rate": sum(sampled) / len(sampled),
        "sampled_groups_with_variance": sum(max(g) != min(g) for g in groups) / len(groups),
        "sample_temperature": float(cfg["temperature"]),
    }


def _base_dir(spec: dict[str, Any], seed: int) -> Path:
    """The model the preset starts from: a packaged real model (grpo.models.packaged) or a tiny one of that seed."""
    if spec["base"] in PACKAGED_MODELS:
        return build_packaged_model_dir(spec["base"])
    return build_model_dir(spec["base"], seed=seed)


def _teacher(spec: dict[str, Any], phase: dict[str, Any], tokenizer: Any) -> Any:
    """A phase's teacher; a chat teacher (OpenAI messages) rendered with the preset's `chat_template`."""
    if not phase.get("teacher"):
        return None
    teacher = _instantiate(dict(phase["teacher"]))
    return ChatEpisodes(teacher, tokenizer, spec["chat_template"]) if hasattr(teacher, "messages") else teacher


def _measure(spec: dict[str, Any], model: Any, tokenizer: Any, task: Any, reward: Any, seed: int) -> dict[str, float]:
    if "chat_template" not in spec:
        return measure(model, tokenizer, task, reward, spec["measure"], seed)
    teacher = _instantiate(dict(_phases(spec)[-1]["teacher"]))
    return measure_chat(model, tokenizer, task, reward, teacher, spec["chat_template"], spec["measure"], seed,
                        generate_answers)


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def warmstart_dir_complete(path: Path) -> bool:
    """Whether `path` holds a built warm-start model (its metadata is written last)."""
    return (path / METADATA_FILE).exists() and (path / "config.json").exists()


def _train_phases(spec: dict[str, Any], model: Any, tokenizer: Any, task: Any, seed: int, progress: bool,
                  sft_threads: int) -> float:
    """The preset's supervised phases on `model`, in order, each with a fresh optimizer and its own data stream (the
    first one's is the stream a preset of one phase always had); returns their seconds."""
    import torch

    # One thread for the tiny models: a second one only adds synchronisation, and on a loaded 2-core machine two
    # threads ran 4x slower (2.7 vs 11 steps/s); a real model's preset says how many. The weights do not depend on it.
    threads = torch.get_num_threads()
    torch.set_num_threads(sft_threads)
    sft_s = 0.0
    try:
        for i, phase in enumerate(_phases(spec)):
            teacher = _teacher(spec, phase, tokenizer)
            sft_s += supervised_warmup(model, tokenizer, task, phase["sft"], seed, progress, teacher,
                                       f":phase{i}" if i else "")
    finally:
        torch.set_num_threads(threads)
    return sft_s


def build_warmstart_dir(name: str = "warm-arith", seed: int = 0, out_dir: str | Path | None = None,
                        progress: bool = True) -> Path:
    """Build (or reuse from the cache) warm-start preset `name` and return its Hugging Face directory.

    Atomic like `grpo.models.tiny.build_model_dir`: a half-built directory never appears under the final name.
    """
    spec = _preset(name)
    final = Path(out_dir) if out_dir else warmstart_path(name, seed)
    if warmstart_dir_complete(final):
        return final  # before torch's and transformers' imports: a cached model costs a run's start-up nothing
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t0 = time.monotonic()
    load_before = _load_average()
    log.info("building warm-start model %s (seed %d) into %s: once, then cached; %d supervised steps (warm-arith: "
             "about 2-4 min on 2 CPU cores, warm-calc about 15, smollm2-135m-warm-calc 8-15 or seconds on a GPU)", name, seed, final,
             sum(int(p["sft"]["steps"]) for p in _phases(spec)))
    base = _base_dir(spec, seed)
    task = _instantiate(dict(spec["task"]))
    reward = _instantiate(dict(spec["reward"]))
    tokenizer = AutoTokenizer.from_pretrained(base)
    task.bind_tokenizer(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # A real model's preset may build on a GPU when there is one (seconds instead of minutes; the same recipe, other
    # kernels, so not the CPU's weights to the bit); the tiny presets build on the CPU everywhere.
    device = "cuda" if spec.get("gpu_if_available") and torch.cuda.is_available() else "cpu"
    model.to(device)
    sft_threads = int(spec.get("threads", 1))
    sft_s = _train_phases(spec, model, tokenizer, task, seed, progress, sft_threads)
    metrics = _measure(spec, model, tokenizer, task, reward, seed)
    if device == "cuda":  # the run that builds it trains on that GPU next: give back what the build cached there
        model.to("cpu")
        torch.cuda.empty_cache()
    meta: dict[str, Any] = {}

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        GenerationConfig.from_pretrained(base).save_pretrained(tmp)
        meta.update({
            "preset": name, "seed": seed, "spec": spec, "version": WARMSTART_VERSION, **metrics,
            "sft_seconds": round(sft_s, 1), "build_seconds": round(time.monotonic() - t0, 1),
            "torch_threads": sft_threads, "cpu_count": os.cpu_count(), "device": device,
            "load_average_before": load_before, "load_average_after": _load_average(),
        })
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")

    # 0o755: mkdtemp makes it private; the cache is shared.
    publish_model_dir(final, write, mode=0o755, complete=warmstart_dir_complete)
    log.info("warm-start model %s built in %.1f s: %s", name, meta["build_seconds"],
             ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if isinstance(v, float)))
    return final


def read_metadata(model_dir: str | Path) -> dict[str, Any]:
    """The `warmstart.json` of a built warm-start directory (what was measured when it was built)."""
    path = Path(model_dir) / METADATA_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: {model_dir} is not a warm-start model directory")
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a warm-start model (tiny model + short supervised warm-up).")
    parser.add_argument("preset", nargs="?", default="warm-arith", help=f"one of: {', '.join(sorted(WARMSTART_PRESETS))}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="output directory (default: the cache)")
    args = parser.parse_args(argv)
    if args.preset not in WARMSTART_PRESETS:  # else _preset's ValueError, a traceback, after the imports
        known = sorted(WARMSTART_PRESETS)
        close = difflib.get_close_matches(args.preset.replace("_", "-"), known, n=1)
        parser.error(f"unknown preset {args.preset!r}" + (f"; did you mean {close[0]}?" if close else "")
                     + f" (presets: {', '.join(known)}; model=warm_arith is the train.py option that builds "
                     "warm-arith)")
    t0 = time.monotonic()
    path = build_warmstart_dir(args.preset, seed=args.seed, out_dir=args.out)
    meta = read_metadata(path)
    measured = ", ".join(f"{k.replace('_', ' ')} {meta[k]:.3f}" for k in ("heldout_greedy_accuracy", "sampled_pass_rate",
                         "first_turn_call_rate", "first_turn_right_call_rate", "no_tool_greedy_accuracy") if k in meta)
    print(f"{path}\n{measured} (samples at T={meta['sample_temperature']}), built in {meta['build_seconds']} s "
          f"(this call: {time.monotonic() - t0:.1f} s)")


if __name__ == "__main__":
    main()
