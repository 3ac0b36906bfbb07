"""Our trainer against the Atropos reference trainer (``atropos-grpo``, atroposlib 0.4.0), both in ``lora_only``.

    python bench/reference_trainer.py [--steps 5] [--which ours ref]

Both trainers read the same scored groups from a real ``run-api`` (a fresh one per trainer): this script registers
as an environment (``POST /register-env``) and pushes ``steps x 8`` groups of 8 sequences (``POST /scored_data``,
the digits prompt through the chat template + 16 random completion tokens, random scores, rollout log-probs)
once the trainer has registered. Same tiny model, 64 sequences per optimizer step (micro-batch 32 x 2), AdamW
lr 1e-5, LoRA r 16 / alpha 32 / dropout 0 on q/k/v/o, clip eps 0.2, adapter hot-swapped into vLLM after every step.

- ref: ``atropos-grpo --weight-bridge-mode lora_only --benchmark`` against a plain
  ``python -m vllm.entrypoints.openai.api_server --enable-lora`` (its lora_only mode needs an external server).
  Step time = its printed ``Step time`` (``run_training_step``: forward/backward of every micro-batch + clip +
  optimizer), sync time = its ``Sync time`` (adapter save + ``/v1/load_lora_adapter``). Peak memory = the trainer
  process's ``ru_maxrss`` (it runs in-process under a small wrapper that prints it at exit).
- ours: ``train.py data=atropos mode=lora_only`` (it launches its own server). Step time = ``time/train_seconds``
  (batching + forward/backward + clip + optimizer), sync = ``sync/seconds``, peak = ``memory/peak_gb`` (the
  trainer process's ``ru_maxrss``) from ``metrics.jsonl``.

Step 1 of each run is left out of the medians (warm-up); runs alternate ref/ours (default ref, ours, ours, ref).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, free_port, loadavg, machine, model_dir  # noqa: E402
from server_throughput import PlainServer  # noqa: E402

GROUP = 8
GROUPS_PER_STEP = 8
COMPLETION = 16
LORA = ["--lora-r", "16", "--lora-alpha", "32", "--lora-dropout", "0.0"]
# Runs the reference trainer's own entry point in this process and prints its peak RSS when it exits.
WRAPPER = (
    "import atexit, resource, sys; "
    "atexit.register(lambda: print('BENCH_MAXRSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)); "
    "from example_trainer.grpo import main; sys.argv = ['atropos-grpo'] + sys.argv[1:]; sys.exit(main())"
)


def make_groups(tok, steps: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    groups = []
    for _ in range(steps * GROUPS_PER_STEP):
        chars = "".join(rng.choice("abcdefghij0123456789") for _ in range(8))
        msgs = [{"role": "user", "content": f"Write digits after: {chars}"}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompt = [int(t) for t in tok.encode(text, add_special_tokens=False)]
        tokens, masks, lps, scores = [], [], [], []
        for _ in range(GROUP):
            comp = [rng.randrange(3, 250) for _ in range(COMPLETION)]
            tokens.append(prompt + comp)
            masks.append([-100] * len(prompt) + comp)
            lps.append([1.0] * len(prompt) + [-rng.uniform(4.0, 6.5) for _ in comp])
            scores.append(rng.random())
        groups.append({"tokens": tokens, "masks": masks, "scores": scores, "inference_logprobs": lps,
                       "generation_params": {"temperature": 1.0}})  # fmt: skip
    return groups


def start_run_api(log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "run-api"), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            requests.get(url + "/status", timeout=1).raise_for_status()
            return proc, url
        except requests.RequestException:
            if proc.poll() is not None:
                raise RuntimeError("run-api died: " + log.read_text()[-2000:])
            time.sleep(0.2)
    raise TimeoutError("run-api did not start")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def feeder(url: str, groups: list[dict], stop_evt: threading.Event) -> None:
    """Wait for the trainer to register, then act as an environment and push every group."""
    while not stop_evt.is_set():
        try:
            info = requests.get(url + "/info", timeout=2).json()
            if info.get("batch_size", -1) not in (-1, None):
                break
        except requests.RequestException:
            pass
        time.sleep(0.5)
    body = {"max_token_length": 512, "desired_name": "bench_digits", "weight": 1.0, "group_size": GROUP}
    env_id = requests.post(url + "/register-env", json=body, timeout=10).json()["env_id"]
    for g in groups:
        requests.post(url + "/scored_data", json={**g, "env_id": env_id}, timeout=10).raise_for_status()


def run_trainer(cmd: list[str], url: str, groups: list[dict], log: Path, env: dict | None = None, timeout=3000):
    stop_evt = threading.Event()
    t = threading.Thread(target=feeder, args=(url, groups, stop_evt), daemon=True)
    t.start()
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)  # fmt: skip
        try:
            rc = proc.wait(timeout)
        finally:
            stop_evt.set()
            stop(proc)
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{cmd[:4]} exited {rc}; log {log}:\n" + log.read_text()[-3000:])
    return wall


def bench_ref(mdir: Path, steps: int, groups: list[dict], work: Path, busy_loop_s: float | None = None) -> dict:
    # busy_loop_s: a control run that gives the reference's plain server our cap on vLLM's idle busy-loop
    # (grpo.inference.vllm_plugin, installed in this environment) to separate trainer from server effects.
    env = {"GRPO_VLLM_BUSY_LOOP_S": str(busy_loop_s)} if busy_loop_s is not None else {}
    plain = PlainServer(mdir, work / "ref_vllm.log", ["--enable-lora", "--max-lora-rank", "64"], env=env)
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    api, url = start_run_api(work / "ref_run_api.log")
    try:
        t0 = time.perf_counter()
        plain.start()
        launch = time.perf_counter() - t0
        cmd = [sys.executable, "-c", WRAPPER, "--model-name", str(mdir), "--weight-bridge-mode", "lora_only",
               "--vllm-port", str(plain.port), "--atropos-url", url, "--training-steps", str(steps),
               "--batch-size", "32", "--gradient-accumulation-steps", "2", "--seq-len", "512", "--lr", "1e-5",
               "--optimizer", "adamw", "--device", "cpu", "--dtype", "auto", "--vllm-restart-interval", "1",
               "--checkpoint-interval", str(steps), "--clip-eps", "0.2", "--save-path", str(work / "ref_ckpt"),
               "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj", *LORA, "--benchmark",
               "--log-dir", str(work / "ref_logs")]  # fmt: skip
        wall = run_trainer(cmd, url, groups, work / "ref_trainer.log")
    finally:
        stop(api)
        plain.stop()
    text = (work / "ref_trainer.log").read_text()
    step_t = [float(x) for x in re.findall(r"Step time: ([0-9.]+)s", text)]
    sync_t = [float(x) for x in re.findall(r"Sync time: ([0-9.]+)s", text)]
    maxrss = re.findall(r"BENCH_MAXRSS_KIB (\d+)", text)
    return {"impl": "ref", "command": "atropos-grpo " + " ".join(cmd[3:]), "server_env": env, "wall_seconds": wall,
            "server_launch_s": launch,
            "step_times": step_t, "sync_times": sync_t,
            "step_s": statistics.median(step_t[1:] or step_t), "sync_s": statistics.median(sync_t[1:] or sync_t) if sync_t else None,
            "peak_gb": int(maxrss[-1]) / 1024**2 if maxrss else None, "loadavg_end": loadavg()}  # fmt: skip


def bench_ours(mdir: Path, steps: int, groups: list[dict], work: Path, overrides: list[str] = ()) -> dict:
    api, url = start_run_api(work / "ours_run_api.log")
    run_dir = work / "ours_run"
    try:
        cmd = [sys.executable, "train.py", "~experiment", "data=atropos", f"data.url={url}", "mode=lora_only", f"train.steps={steps}",
               "train.micro_batch_size=32", "train.grad_accum=2", "optimizer.lr=1e-5", "lora=attention", "lora.r=16",
               "lora.alpha=32", "lora.dropout=0.0", "loss.clip_eps=0.2", f"server.port={free_port()}",
               "logging.progress_bar=false", "logging.plot=false", f"train.checkpoint_every={steps}",
               f"hydra.run.dir={run_dir}", *overrides]  # fmt: skip
        wall = run_trainer(cmd, url, groups, work / "ours_trainer.log")
    finally:
        stop(api)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    step_t = [r["time/train_seconds"] for r in rows]
    fb_t = [r["time/forward_backward_seconds"] for r in rows]
    sync_t = [r["sync/seconds"] for r in rows]
    return {"impl": "ours", "command": " ".join(cmd[1:]), "wall_seconds": wall, "step_times": step_t,
            "fwd_bwd_times": fb_t, "sync_times": sync_t, "step_s": statistics.median(step_t[1:] or step_t),
            "sync_s": statistics.median(sync_t[1:] or sync_t), "peak_gb": max(r["memory/peak_gb"] for r in rows),
            "tokens_trained": rows[-1].get("tokens/trained"), "loadavg_end": loadavg()}  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--which", nargs="+", default=["ref", "ours", "ours", "ref"],
                    help="runs in this order (alternated so both see the same machine load)")
    ap.add_argument("--ours-overrides", nargs="*", default=[],
                    help="extra train.py overrides, e.g. model.dtype=bfloat16 model.gradient_checkpointing=true "
                         "(what atropos-grpo does: it always loads the model in bfloat16 with gradient checkpointing)")
    ap.add_argument("--ref-busy-loop-s", type=float, default=None,
                    help="control: cap the reference's plain vLLM server's idle busy-loop as our server=cpu does "
                         "(default: plain vLLM, 1 s)")
    ap.add_argument("--out", default=str(RESULTS / "reference_trainer.json"))
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    mdir = model_dir("tiny")
    groups = make_groups(AutoTokenizer.from_pretrained(mdir), args.steps)
    work = Path(tempfile.mkdtemp(prefix="bench_ref_"))
    print(f"  work dir {work}", flush=True)
    runs = []
    for i, which in enumerate(args.which):
        sub = work / f"run{i}_{which}"
        sub.mkdir()
        try:
            if which == "ref":
                r = bench_ref(mdir, args.steps, groups, sub, args.ref_busy_loop_s)
            else:
                r = bench_ours(mdir, args.steps, groups, sub, args.ours_overrides)
            print(f"  {which}: step {r['step_s']:.2f}s sync {r['sync_s']}s peak {r['peak_gb']} GB "
                  f"(load {r['loadavg_end']:.1f})", flush=True)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - recorded in the results
            r = {"impl": which, "error": f"{type(e).__name__}: {e}"[-3000:]}
            print(f"  {which} FAILED: {r['error'][-1500:]}", flush=True)
        runs.append(r)
    results = {}
    for which in dict.fromkeys(args.which):
        rs = [r for r in runs if r["impl"] == which and "error" not in r]
        if not rs:
            results[which] = next(r for r in runs if r["impl"] == which)
            continue
        steps = [t for r in rs for t in (r["step_times"][1:] or r["step_times"])]
        syncs = [t for r in rs for t in (r["sync_times"][1:] or r["sync_times"])]
        results[which] = {"impl": which, "command": rs[0]["command"], "runs": len(rs), "step_s": statistics.median(steps),
                          "step_s_min": min(steps), "sync_s": statistics.median(syncs) if syncs else None,
                          "peak_gb": max(r["peak_gb"] or 0 for r in rs) or None}  # fmt: skip
    tokens_per_step = sum(len([m for m in row if m != -100]) for g in groups[:GROUPS_PER_STEP] for row in g["masks"])
    out = {"bench": "reference_trainer", "machine": machine(), "work_dir": str(work),
           "command": "python bench/reference_trainer.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "settings": {"model": "tiny", "sequences_per_step": GROUP * GROUPS_PER_STEP, "micro_batch": 32,
                        "grad_accum": 2, "completion_tokens": COMPLETION, "lora": "r16 a32 d0 q,k,v,o", "lr": 1e-5,
                        "steps": args.steps, "loss_tokens_per_step": tokens_per_step},
           "results": results, "runs": runs}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(table(out))
    return out


def table(out: dict) -> str:
    n = out["settings"]["loss_tokens_per_step"]
    lines = ["| trainer | optimizer-step s (median) | trained tok/s | sync s (median) | peak RSS GB |", "|---|---|---|---|---|"]
    for k, r in out["results"].items():
        if "error" in r:
            lines.append(f"| {k} | failed: {r['error'][:120]} | | | |")
            continue
        lines.append(f"| {k} | {r['step_s']:.3f} | {n / r['step_s']:.0f} | {r['sync_s'] if r['sync_s'] is None else round(r['sync_s'], 3)} "
                     f"| {r['peak_gb']:.2f} |" if r["peak_gb"] else f"| {k} | {r['step_s']:.3f} | {n / r['step_s']:.0f} | {r['sync_s']} | ? |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
