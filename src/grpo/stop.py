"""A run stopped by Ctrl-C or SIGTERM: one short block instead of a traceback.

The block says the step reached, the last complete checkpoint, the exact command that resumes the run, and whether
the vLLM server the run started is stopped; the curves of the steps done are still written. Real errors keep their
traceback (this module is only called for KeyboardInterrupt, which train.py also raises for SIGTERM).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

from grpo.trainer.checkpoint import CheckpointManager
from grpo.trainer.metrics import plot_curves, read_metrics

# Command-line flags of a Hydra app that select the config and so belong in the resume command too.
_CONFIG_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")
# Set by a launcher that starts train.py with overrides of its own (python -m grpo.stack: run-api's URL, a server
# port): the user's command line, which the stop block repeats instead of the trainer's (whose run-api is gone).
LAUNCHER_ENV = "GRPO_LAUNCHER_COMMAND"


@dataclass(frozen=True)
class StopReport:
    """What a stopped run leaves: the facts the block prints."""

    signal_name: str
    last_step: Optional[int]
    checkpoint: Optional[Path]
    resume_command: Optional[str]
    rerun_command: str
    server: str
    curves: str
    checkpoint_every: Optional[int] = None

    def format(self) -> str:
        """The block shown on the terminal."""
        step = f"step {self.last_step} was the last one completed" if self.last_step else "no step was completed"
        lines = [f"grpo: stopped by {self.signal_name}; {step}."]
        if self.checkpoint is not None:
            lines.append(f"  last complete checkpoint: {self.checkpoint}")
            lines.append(f"  resume with: {self.resume_command}")
        else:
            every = f" (one every train.checkpoint_every={self.checkpoint_every} steps)" if self.checkpoint_every else ""
            lines.append(f"  no complete checkpoint yet{every}; start again with:")
            lines.append(f"    {self.rerun_command}")
        lines.append(f"  server: {self.server}")
        lines.append(f"  curves: {self.curves}")
        return "\n".join(lines)


def signal_name(error: KeyboardInterrupt) -> str:
    """SIGTERM when train.py turned that signal into this KeyboardInterrupt ('signal 15'), else SIGINT (Ctrl-C)."""
    text = str(error)
    if text.startswith("signal "):
        try:
            return signal.Signals(int(text.split()[1])).name
        except (ValueError, IndexError):
            return text
    return "SIGINT (Ctrl-C)"


def exit_code(error: KeyboardInterrupt) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (130 for Ctrl-C, 143 for SIGTERM)."""
    name = signal_name(error).split()[0]
    try:
        return 128 + int(signal.Signals[name])
    except KeyError:
        return 130


def program(argv: Sequence[str]) -> str:
    """How the user started the trainer: `python train.py` (as given) or the console script's name."""
    first = argv[0] if argv else "train.py"
    if first.endswith(".py"):
        return f"python {shlex.quote(first)}"
    return shlex.quote(os.path.basename(first))


def config_flags(argv: Sequence[str]) -> list[str]:
    """`--config-dir DIR` and the other config-selecting flags of `argv`, in both `--flag VALUE` and `--flag=VALUE`."""
    kept: list[str] = []
    args = list(argv[1:])
    for i, arg in enumerate(args):
        name = arg.split("=", 1)[0]
        if name in _CONFIG_FLAGS:
            kept.append(arg)
            if "=" not in arg and i + 1 < len(args):
                kept.append(args[i + 1])
    return kept


def command(argv: Sequence[str], overrides: Sequence[str], run_dir: Optional[Path] = None,
            resume_from: Optional[Path] = None) -> str:
    """The command line that repeats this run's config; with `run_dir`, continuing it in `run_dir` from the latest
    checkpoint of `resume_from` (default: `run_dir` itself). Under a launcher (LAUNCHER_ENV), the launcher's command
    line with the same two overrides."""
    drop = ("train.resume=", "hydra.run.dir=")
    source = resume_from if resume_from is not None else run_dir
    resume = [f"train.resume={source}", f"hydra.run.dir={run_dir}"] if run_dir is not None else []
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher:
        words = [w for w in shlex.split(launcher) if not w.startswith(drop)]
        return shlex.join([*words, *resume])
    kept = [o for o in overrides if not o.startswith(drop)] + resume
    return " ".join([program(argv), *map(shlex.quote, config_flags(argv)), *map(shlex.quote, kept)])


def last_step(run_dir: Path) -> Optional[int]:
    """The last step written to metrics.jsonl (the largest: an evaluation beside training writes its row after later
    steps' rows), or None before the first."""
    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path) if path.exists() else []
    return max(int(r["step"]) for r in rows) if rows else None


def server_state(run_dir: Path, external_url: Optional[str]) -> str:
    """Whether the vLLM servers this run started are gone (each pid file is removed on stop, its group checked):
    `logs/vllm.pid` of replica 0 and `logs/vllm-replica<i>.pid` of the others (grpo.serving.server.replica_log)."""
    if external_url:
        return f"attached to {external_url}, which this run did not start; it keeps running"
    log_path = run_dir / "logs" / "vllm.log"
    if not log_path.exists():
        return "none was started yet"
    for pid_path in [run_dir / "logs" / "vllm.pid", *sorted((run_dir / "logs").glob("vllm-replica*.pid"))]:
        if not pid_path.exists():
            continue
        pid = int(pid_path.read_text().strip() or 0)
        try:
            os.killpg(pid, 0)
            return f"vLLM (pid {pid}) is STILL RUNNING: stop it with `kill -- -{pid}`"
        except ProcessLookupError:
            pass
        except PermissionError:
            return f"vLLM (pid {pid}) may still be running: check with `ps -g {pid}`"
    return f"the vLLM server this run started is stopped (log: {log_path})"


def write_curves(run_dir: Path, plot: bool) -> str:
    """curves.png of the steps done; says why when there is none."""
    if not plot:
        return "not written (logging.plot=false)"
    if last_step(run_dir) is None:
        return "not written (no step completed)"
    try:
        return str(plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png", title=f"{run_dir.name} (stopped)"))
    except Exception as e:  # the block must still be printed; say what went wrong instead of a traceback
        return f"not written ({type(e).__name__}: {e})"


def reachable_checkpoint(run_dir: Path, resume: Optional[str]) -> tuple[Optional[Path], Optional[Path]]:
    """The newest complete checkpoint this run can continue from, and the run dir it lies in: the run's own, else
    (a run resumed from another dir, stopped before its own first checkpoint) the resumed run's. Following "start
    again" there would have started from step 0 with that checkpoint still on disk."""
    own = CheckpointManager(run_dir).latest()
    if own is not None or resume is None:
        return own, run_dir if own is not None else None
    earlier = CheckpointManager(Path(resume)).latest()
    return earlier, Path(resume) if earlier is not None else None


def report_stop(
    error: KeyboardInterrupt, cfg: Any, run_dir: Path, overrides: Sequence[str],
    argv: Optional[Sequence[str]] = None, stream: Optional[TextIO] = None,
) -> StopReport:
    """Write the curves, print the stop block to `stream` (stderr) and return what it said.

    Call after the run's teardown (`grpo.build.RunParts.close` stops the server), so the block reports the
    server's real state. `overrides` are the job's command-line overrides (Hydra's `overrides.task`).
    """
    argv = list(sys.argv if argv is None else argv)
    checkpoint, source = reachable_checkpoint(run_dir, cfg.train.get("resume"))
    report = StopReport(
        signal_name=signal_name(error),
        last_step=last_step(run_dir),
        checkpoint=checkpoint,
        resume_command=command(argv, overrides, run_dir, source) if checkpoint is not None else None,
        rerun_command=command(argv, overrides),
        server=server_state(run_dir, cfg.server.get("external_url") or ", ".join(cfg.server.get("external_urls") or [])),
        curves=write_curves(run_dir, bool(cfg.logging.plot)),
        checkpoint_every=int(cfg.train.checkpoint_every),
    )
    out = stream or sys.stderr
    print("\n" + report.format(), file=out, flush=True)
    return report
