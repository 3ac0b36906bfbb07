"""vLLM general plugin (entry point ``vllm.general_plugins``): caps the worker's idle busy-loop, and keeps CPU
linear weights where mode=shared_vllm can write them.

After every message from the engine (each decode step, each adapter load, each RPC), vLLM's worker keeps polling
its shared-memory queue with ``sched_yield`` for one second before it goes to sleep on a socket
(``SpinCondition.busy_loop_s``). On a GPU box that is one idle CPU core. On a CPU machine where the trainer shares
the cores with the server, it is a core taken from the trainer's next step: after each adapter load of
``lora_only`` the trainer's OpenMP threads ran the next forward/backward up to 7x slower (tiny model, 2 cores).

vLLM loads this plugin in every one of its processes, but it acts only where ``GRPO_VLLM_BUSY_LOOP_S`` is set, which
only our server launcher does (``server.busy_loop_s``); any other vLLM in the same environment keeps its default.

Plain CPU GEMMs (``GRPO_VLLM_CPU_PLAIN_GEMM=1``, set by mode=shared_vllm's launcher only): after loading, vLLM's CPU
backend copies each linear layer's weight into a kernel-specific packed buffer (oneDNN, or sgl-kernel for small
shapes) and drops the original, so writes to the parameter never reach its GEMMs. With the variable set, each 2-D
linear weight stays the layer's parameter and the layer multiplies with ``torch.nn.functional.linear`` on the weight
as it is at call time, so the trainer can train that very memory (grpo.sync.shared_memory). On the tiny models of
this machine a generation step was no slower (0.044-0.049 s against 0.046-0.053 s packed, same engine, alternated).
"""

from __future__ import annotations

import logging
import os

# A child of vLLM's logger, so the line reaches the server log through vLLM's own handler, with the process prefix.
log = logging.getLogger("vllm.grpo_busy_loop")
ENV = "GRPO_VLLM_BUSY_LOOP_S"
PLAIN_GEMM_ENV = "GRPO_VLLM_CPU_PLAIN_GEMM"
# This plugin's entry-point name in pyproject.toml (what a VLLM_PLUGINS allow-list must name).
PLUGIN_NAME = "grpo_busy_loop"


# Marks vLLM's SpinCondition as patched by us, so a second register() in the same process patches nothing.
CAPPED_MARK = "grpo_busy_loop_capped"
# Marks vLLM's CPU GEMM dispatch as replaced by the plain one.
PLAIN_GEMM_MARK = "grpo_plain_cpu_gemm"


def register() -> None:
    """Apply what the environment asks for: the busy-loop cap and plain CPU GEMMs (each a no-op when unset)."""
    cap_busy_loop()
    if os.environ.get(PLAIN_GEMM_ENV) == "1":
        keep_cpu_linear_weights()


def keep_cpu_linear_weights() -> None:
    """Make vLLM's CPU linear layers multiply with their own weight parameter (``F.linear``), never a packed copy."""
    import torch.nn.functional as F
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # CUDA kernels read the parameters as they are anyway
        return
    from vllm.model_executor.layers import utils

    packed_dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(packed_dispatch, PLAIN_GEMM_MARK, False):
        return

    # vLLM imports the dispatcher from `utils` when each layer finishes loading, so replacing the module attribute
    # reaches every linear layer and the LM head.
    def plain_dispatch(layer, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:  # not a dense GEMM: vLLM's own handling
            packed_dispatch(layer, remove_weight)
            return
        layer.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)

    setattr(plain_dispatch, PLAIN_GEMM_MARK, True)
    utils.dispatch_cpu_unquantized_gemm = plain_dispatch
    log.info("grpo: vLLM CPU linear layers use their weight parameters as they are (%s=1)", PLAIN_GEMM_ENV)


def cap_busy_loop() -> None:
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
