"""vLLM general plugin (entry point ``vllm.general_plugins``): caps the worker's idle busy-loop.

After every message from the engine (each decode step, each adapter load, each RPC), vLLM's worker keeps polling
its shared-memory queue with ``sched_yield`` for one second before it goes to sleep on a socket
(``SpinCondition.busy_loop_s``). On a GPU box that is one idle CPU core. On a CPU machine where the trainer shares
the cores with the server, it is a core taken from the trainer's next step: after each adapter load of
``lora_only`` the trainer's OpenMP threads ran the next forward/backward up to 7x slower (tiny model, 2 cores).

vLLM loads this plugin in every one of its processes, but it acts only where ``GRPO_VLLM_BUSY_LOOP_S`` is set, which
only our server launcher does (``server.busy_loop_s``); any other vLLM in the same environment keeps its default.
"""

from __future__ import annotations

import logging
import os

# A child of vLLM's logger, so the line reaches the server log through vLLM's own handler, with the process prefix.
log = logging.getLogger("vllm.grpo_busy_loop")
ENV = "GRPO_VLLM_BUSY_LOOP_S"
# This plugin's entry-point name in pyproject.toml (what a VLLM_PLUGINS allow-list must name).
PLUGIN_NAME = "grpo_busy_loop"


# Marks vLLM's SpinCondition as patched by us, so a second register() in the same process patches nothing.
CAPPED_MARK = "grpo_busy_loop_capped"


def register() -> None:
    """Cap ``SpinCondition.busy_loop_s`` at ``$GRPO_VLLM_BUSY_LOOP_S`` seconds (no-op when unset)."""
    value = os.environ.get(ENV)
    if not value:
        return
    cap = float(value)
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # older vLLM without SpinCondition: nothing to cap (decoding is unaffected either way)
        log.warning("%s=%s: this vLLM has no SpinCondition; the worker's busy-loop is left as it is", ENV, value)
        return
    if getattr(SpinCondition, CAPPED_MARK, False):
        return
    original = SpinCondition.wait

    # Patched on the class and applied at each wait, so queues created before the plugin loaded are capped too.
    def wait(self, timeout_ms=None):
        if self.busy_loop_s > cap:
            self.busy_loop_s = cap
        return original(self, timeout_ms)

    SpinCondition.wait = wait
    setattr(SpinCondition, CAPPED_MARK, True)
    log.info("grpo: vLLM worker busy-loop capped at %s s (%s)", cap, ENV)
