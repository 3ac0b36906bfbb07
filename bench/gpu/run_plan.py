"""Run a plan of real-model jobs on a lent GPU, detached, so that a lease's calls only start it and collect results.

    setsid nohup python3 bench/gpu/run_plan.py PLAN --out /tmp/plan_out > /tmp/plan_out.log 2>&1 &
    bash bench/gpu/real_model.sh collect        # copies /tmp/plan_out to $OUT and prints the progress

PLAN is a text file of waves separated by blank lines; the waves run one after the other, the jobs of a wave at once
(each started once the previous one's vLLM server is ready: vLLM's memory profiling fails when two servers start
on one GPU together). A job line is `name | experiment | overrides...` for `python train.py`, or
`name | trl | experiment seed` for TRL's GRPOTrainer on that experiment (bench/trl_arith.py; its model saved at every
evaluation step into /tmp/trl_ckpt/<name>), or `name | grpo_eval | experiment trl_job [overrides]` for our evaluator
(grpo-eval, a vLLM server of its own) on the initial model and that TRL job's checkpoints, or
`name | trl_step | --preset qwen3b --steps 20 ...` for TRL's whole step at a preset's size (bench/gpu/trl_step.py), or
`name | gen_probe | --preset qwen3b ...` for bench/gpu/gen_probe.py, or `name | sh | script args...` for a script
(bash; $OUT is --out), e.g. bench/gpu/sweep_run.sh, or `name | plan | gpus=1 PLAN` for another plan run by waves on
the job's GPUs (its jobs beside each other on them, while the queue goes on with the other GPUs); a first override
`gpus=2,3` gives the job only those GPUs (CUDA_VISIBLE_DEVICES; inside the job they are numbered 0, 1, ...), and
then `pyspy=ROWS:SECONDS` profiles the run with py-spy for SECONDS once its metrics have ROWS rows
(bench/gpu/pyspy_run.py), and `torchrun=K` starts train.py under torchrun with K processes (an FSDP2 trainer).
Jobs of a wave on disjoint `gpus=` start together; the others one after another's vLLM is ready. Every job's log,
metrics.jsonl, summary.json and the tail of its evaluation samples land flat in --out, and `jobs.jsonl` there has one
row per job (start, end, wall seconds, return code, wave, how many jobs shared the GPU). Lines starting with # are
comments. With --queue the waves are ignored: each job starts as soon as its GPUs are free and no earlier job of the
plan waits for one of them (a multi-GPU lease counts every GPU's idle second).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

RUNS = Path("/tmp/runs")
# The plan's --out (set by main): `sh` jobs write their results there too.
PLAN_OUT = Path("/tmp/plan_out")
# The plan's --stall-s (set by main): a nested plan's runner guards its own jobs with it too.
STALL_S = 300.0
# TRL jobs' checkpoints (bench/trl_arith.py --checkpoints), one folder per job, for grpo_eval jobs.
TRL_CHECKPOINTS = Path("/tmp/trl_ckpt")


def parse_plan(text: str) -> list[list[list[str]]]:
    """Waves of jobs, each job [name, experiment, *overrides]."""
    waves: list[list[list[str]]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#"):
            continue
        if not line:
            if waves[-1]:
                waves.append([])
            continue
        name, kind, *rest = (part.strip() for part in line.split("|"))
        waves[-1].append([name, kind, *" ".join(rest).split()])
    return [w for w in waves if w]


def job_gpus(job: list[str]) -> set[str] | None:
    """The GPUs a job's `gpus=` override gives it (None: every GPU of the machine)."""
    args = job[2:]
    return set(args[0].split("=", 1)[1].split(",")) if args and args[0].startswith("gpus=") else None


def job_port(name: str) -> int:
    """A rendezvous port of the job's own (torchrun's, or TRL's colocated vLLM's), so jobs running at once differ."""
    return 29500 + sum(map(ord, name)) % 1000


def job_env(job: list[str]) -> dict[str, str]:
    gpus = job_gpus(job)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(sorted(gpus, key=int))} if gpus else dict(os.environ)
    if job[1] == "sh":  # the script's own results go where the plan's do
        env["OUT"] = str(PLAN_OUT)
    if job[1] in ("trl", "trl_step"):  # TRL's colocated vLLM joins a one-process group: a port of its own per job
        env["MASTER_PORT"] = str(job_port(job[0]))
    return env


def command(job: list[str], out: Path) -> list[str]:
    name, kind, *args = job
    if args and args[0].startswith("gpus="):
        args = args[1:]
    if kind == "trl":
        experiment, seed, *extra = args
        return [sys.executable, "bench/trl_arith.py", "--experiment", experiment, "--vllm", "--seed", seed,
                "--checkpoints", str(TRL_CHECKPOINTS / name), "--out", str(out / f"{name}.json"), *extra]
    if kind == "grpo_eval":  # our evaluator on a TRL job's checkpoints, with the experiment's eval settings
        experiment, source, *extra = args
        return [sys.executable, "-m", "grpo.eval", f"experiment={experiment}", "--initial", str(TRL_CHECKPOINTS / source),
                "--work-dir", str(RUNS / name), "--out", str(out / f"{name}.json"), *extra]
    if kind == "sh":  # a script of bench/gpu/ (e.g. sweep_run.sh), its arguments as given; it writes into $OUT
        return ["bash", *args]
    if kind == "plan":  # a plan of its own, by waves, on this job's GPUs; its files land flat beside this plan's
        return [sys.executable, __file__, args[0], "--out", str(out), "--nested", name, "--stall-s", str(STALL_S)]
    if kind in ("trl_step", "gen_probe"):  # bench/gpu/trl_step.py (TRL's whole step at a preset's size) or
        # bench/gpu/gen_probe.py (our /generate against vLLM in-process), their arguments as given
        return [sys.executable, f"bench/gpu/{kind}.py", *args, "--out", str(out / f"{name}.json")]
    spy = args.pop(0).split("=", 1)[1].split(":") if args and args[0].startswith("pyspy=") else None
    launch = [sys.executable, "train.py"]
    if args and args[0].startswith("torchrun="):
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", args.pop(0).split("=", 1)[1],
                  "--master-port", str(job_port(name)), "train.py"]
    if spy is not None:  # profiled in its steady state (bench/gpu/pyspy_run.py)
        launch = [sys.executable, "bench/gpu/pyspy_run.py", "--metrics", str(RUNS / name / "metrics.jsonl"),
                  "--after-rows", spy[0], "--seconds", spy[1], "--out", str(out / name), "--", *launch]
    return [*launch, f"experiment={kind}", "logging.progress_bar=false", f"hydra.run.dir={RUNS / name}", *args]


def server_ready(log: Path) -> bool:
    return log.exists() and "vLLM ready at" in log.read_text(errors="replace")


def collect(job: list[str], out: Path) -> None:
    run = RUNS / job[0]
    for src, dst in (("metrics.jsonl", "metrics.jsonl"), ("summary.json", "summary.json"), ("logs/vllm.log", "vllm.log")):
        if (run / src).exists():
            shutil.copy(run / src, out / f"{job[0]}.{dst}")
    samples = run / "eval_samples.jsonl"
    if samples.exists():
        (out / f"{job[0]}.eval_samples_tail.txt").write_bytes(samples.read_bytes()[-3000:])


def last_progress(job: list[str], log: Path) -> float:
    """When the job last wrote anything: its log, its metrics.jsonl or its vLLM log (seconds since the epoch)."""
    run = RUNS / job[0]
    paths = [log, run / "metrics.jsonl", *(run / "logs").glob("vllm*.log")]
    return max((p.stat().st_mtime for p in paths if p.exists()), default=0.0)


def stop_job(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the job's own process group (torchrun and its ranks; train.py stops its vLLM, which also dies with
    its parent), SIGKILL after `grace` seconds."""
    for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def start_job(job: list[str], out: Path) -> tuple[list[str], subprocess.Popen, float]:
    log = out / f"{job[0]}.log"
    proc = subprocess.Popen(command(job, out), stdout=log.open("w"), stderr=subprocess.STDOUT, env=job_env(job),
                            start_new_session=True)
    return job, proc, time.time()


def finished(item: tuple[list[str], subprocess.Popen, float], out: Path, stall_s: float, row: dict) -> bool:
    """Whether the job has ended (or was stopped for writing nothing for `stall_s` seconds: a hung run must not hold
    the lease, lease 6 lost 13 minutes to one); an ended job's files are collected and its row written."""
    job, proc, t0 = item
    stalled = proc.poll() is None and time.time() - max(t0, last_progress(job, out / f"{job[0]}.log")) > stall_s
    if stalled:
        stop_job(proc)
    elif proc.poll() is None:
        return False
    collect(job, out)
    row = {"name": job[0], "command": " ".join(command(job, out)), **row,
           "gpus": ",".join(sorted(job_gpus(job), key=int)) if job_gpus(job) else os.environ.get("CUDA_VISIBLE_DEVICES", "all"),
           "start": time.strftime("%H:%M:%S", time.gmtime(t0)), "wall_s": round(time.time() - t0, 1),
           "rc": proc.returncode, "stalled": stalled}
    with (out / "jobs.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    return True


def run_wave(wave: list[list[str]], index: int, out: Path, stall_s: float) -> None:
    """The wave's jobs at once, until each has ended or stalled."""
    procs = []
    for job in wave:
        item = start_job(job, out)
        procs.append(item)
        # Stagger: the next server starts once this one is up (or this job ended, or 300 s passed), unless every
        # job after it runs on other GPUs: vLLM's memory profiling fails when two servers start on one GPU together.
        later = [job_gpus(j) for j in wave[wave.index(job) + 1:]]
        mine = job_gpus(job)
        apart = mine is not None and all(g is not None and not (g & mine) for g in later)
        log, proc, t0 = out / f"{job[0]}.log", item[1], item[2]
        while later and not apart and proc.poll() is None and not server_ready(log) and time.time() - t0 < 300:
            time.sleep(2)
    pending, beat = list(procs), time.time()
    while pending:
        for item in list(pending):
            if finished(item, out, stall_s, {"wave": index, "jobs_in_wave": len(wave)}):
                pending.remove(item)
        if time.time() - beat > 60:  # a nested plan's runner: its parent's stall guard watches this output
            print(f"wave {index}: {len(pending)} of {len(wave)} jobs running", flush=True)
            beat = time.time()
        time.sleep(2)


def overlap(a: set[str] | None, b: set[str] | None) -> bool:
    """Whether two jobs' GPUs overlap (None: every GPU of the machine)."""
    return a is None or b is None or bool(a & b)


def startable(waiting: list[list[str]], running: list[list[str]]) -> list[list[str]]:
    """The waiting jobs that may start now: none of their GPUs held by a running job or wanted by an earlier waiting
    job (order is kept per GPU: a job never overtakes an earlier one that shares a GPU with it, and a GPU never idles
    behind a job that waits for another GPU)."""
    ready, ahead = [], []
    for job in waiting:
        gpus = job_gpus(job)
        if not any(overlap(gpus, job_gpus(other)) for other in running + ahead):
            ready.append(job)
        ahead.append(job)
    return ready


def run_queue(jobs: list[list[str]], out: Path, stall_s: float) -> None:
    """The jobs in plan order per GPU, each started as soon as its GPUs are free (a job without `gpus=` holds them
    all) and no earlier job waits for one of them: no GPU waits for the slowest job of a wave, so a plan lists each
    GPU's jobs in order of need and what runs beside what follows from their lengths."""
    waiting, running, beside = list(jobs), [], {}
    while waiting or running:
        for job in startable(waiting, [item[0] for item in running]):
            beside[job[0]] = [item[0][0] for item in running]  # what ran on the other GPUs when it started
            running.append(start_job(job, out))
            waiting.remove(job)
        for item in list(running):
            if finished(item, out, stall_s, {"queue": True, "started_beside": beside[item[0][0]]}):
                running.remove(item)
        time.sleep(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", type=Path)
    ap.add_argument("--out", type=Path, default=Path("/tmp/plan_out"))
    ap.add_argument("--stall-s", type=float, default=300.0,
                    help="stop a job that writes nothing (log, metrics, vLLM log) for this many seconds")
    ap.add_argument("--nested", metavar="NAME",
                    help="run as the `plan` job NAME of another plan: its plan file kept as plan_NAME.txt, no DONE")
    ap.add_argument("--queue", action="store_true",
                    help="ignore the waves: start each job once its GPUs are free and no earlier job waits for one "
                         "of them (a job without gpus= holds every GPU)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    global PLAN_OUT, STALL_S
    PLAN_OUT, STALL_S = args.out, args.stall_s
    shutil.copy(args.plan, args.out / (f"plan_{args.nested}.txt" if args.nested else "plan.txt"))
    waves = parse_plan(args.plan.read_text())
    if args.queue:
        run_queue([job for wave in waves for job in wave], args.out, args.stall_s)
    else:
        for i, wave in enumerate(waves):
            run_wave(wave, i, args.out, args.stall_s)
    if not args.nested:
        (args.out / "DONE").write_text(time.strftime("%Y-%m-%d %H:%M:%S UTC\n", time.gmtime()))


if __name__ == "__main__":
    main()
