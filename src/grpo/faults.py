"""Test-only fault injection, driven by the GRPO_FAULT environment variable; every call is a no-op when it is unset.

GRPO_FAULT holds `;`-separated faults, `<kind>@<where>`; steps are 1-based (the step being run, as in
metrics.jsonl):

    sigterm@<phase>:<step>    SIGTERM this process in <phase> of <step>. Phases:
                                generate          0.05 s into the rollout request (a timer thread, so it lands
                                                  while generation runs)
                                optimizer_step    right before optimizer.step()
                                checkpoint_write  model and optimizer files written, COMPLETE not yet
                                checkpoint_published  the checkpoint renamed into place, older ones not pruned
    nan_loss@<s>,<s>,...      the loss of these steps becomes NaN before backward (so the gradients are NaN too)
    kill_server@<s>,<s>,...   SIGKILL the inference server's process group at the start of these steps (a crash)
    stop_server@<s>,<s>,...   SIGSTOP it there (a hang; the health check's timeout must notice)
    kill_server_generating@<b>,...  SIGKILL it (pid from <run_dir>/logs/vllm.pid) as the local pipeline sends the
                              requests of rollout batch <b> (1-based); with train.max_staleness >= 1 that is the
                              producer thread, while the trainer trains the batch before
    stop_server_generating@<b>,...  SIGSTOP it there instead (a server that hangs with the requests out)
    kill_server_evaluating@<s>,...  SIGKILL it (pid from <run_dir>/logs/vllm.pid) as the evaluator sends its requests
                              after step <s> (0: the eval before training)
    kill_server_syncing@<s>,...  SIGKILL it in the weight sync after step <s>, once the weights are written and
                              before the server is asked to take them (file-based modes: none, lora_only,
                              lora_restart); stop_server_syncing@<s> SIGSTOPs it there (a hang)

Example: GRPO_FAULT="nan_loss@3;sigterm@checkpoint_write:5".
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

GENERATE_DELAY_S = 0.05


def _faults() -> dict[str, set[str]]:
    spec = os.environ.get("GRPO_FAULT", "")
    out: dict[str, set[str]] = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        kind, _, where = item.partition("@")
        out.setdefault(kind, set()).update(w.strip() for w in where.split(","))
    return out


def active(kind: str, step: int) -> bool:
    """True when GRPO_FAULT asks for `kind` at `step` (nan_loss, kill_server, stop_server)."""
    return str(step) in _faults().get(kind, ())


def point(phase: str, step: int) -> None:
    """Named point `phase` of `step`: SIGTERM ourselves when GRPO_FAULT says sigterm@<phase>:<step>."""
    if f"{phase}:{step}" not in _faults().get("sigterm", ()):
        return
    log.warning("GRPO_FAULT: SIGTERM in %s of step %d", phase, step)
    if phase == "generate":
        threading.Timer(GENERATE_DELAY_S, os.kill, (os.getpid(), signal.SIGTERM)).start()
    else:
        os.kill(os.getpid(), signal.SIGTERM)


_fired: set[tuple[str, int]] = set()


def _kill_once(kind: str, n: int, pid_file, where: str, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to the server whose process group is in `pid_file` when GRPO_FAULT says <kind>@<n>; once per
    process, so a retry meets the restarted server."""
    if not active(kind, n) or (kind, n) in _fired:
        return
    _fired.add((kind, n))
    try:
        pid = int(open(pid_file).read())
    except (OSError, ValueError):
        return
    log.warning("GRPO_FAULT: %s (pgid %d) at %s %d", kind, pid, where, n)
    os.killpg(pid, sig)


def kill_server_generating(batch: int, pid_file) -> None:
    """Before rollout batch `batch`'s (1-based) requests: SIGKILL the server (a crash during generation) when
    GRPO_FAULT says kill_server_generating@<batch>, SIGSTOP it (a hang) for stop_server_generating@<batch>."""
    _kill_once("kill_server_generating", batch, pid_file, "rollout batch")
    _kill_once("stop_server_generating", batch, pid_file, "rollout batch", signal.SIGSTOP)


def kill_server_evaluating(step: int, pid_file) -> None:
    """Before the requests of the evaluation after step `step`: SIGKILL the server (a crash during an in-run
    evaluation) when GRPO_FAULT says kill_server_evaluating@<step>."""
    _kill_once("kill_server_evaluating", step, pid_file, "the evaluation after step")


def kill_server_syncing(step: int, pid_file) -> None:
    """In the sync after `step`, between writing the weights and handing them to the server: SIGKILL the server (a
    crash during a sync) when GRPO_FAULT says kill_server_syncing@<step>."""
    _kill_once("kill_server_syncing", step, pid_file, "the sync after step")
    _kill_once("stop_server_syncing", step, pid_file, "the sync after step", signal.SIGSTOP)


def server_faults(step: int, pid: int | None) -> None:
    """At the start of `step`: kill or stop the inference server (process group `pid`; None = no server of ours)
    when GRPO_FAULT says so."""
    if pid is None:
        return
    for kind, sig in (("kill_server", signal.SIGKILL), ("stop_server", signal.SIGSTOP)):
        if active(kind, step):
            log.warning("GRPO_FAULT: %s (pgid %d) at step %d", kind, pid, step)
            os.killpg(pid, sig)
