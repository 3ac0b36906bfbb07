"""GRPO training against a vLLM inference server (docs/index.md)."""

import logging

# peft imports bitsandbytes when it is installed, whose CPU backend warns at import that its 4-bit kernels need
# `pip install kernels` ("Failed to load CPU gemm_4bit_forward from kernels-community"): nothing here uses 4-bit
# layers (adamw_8bit keeps 8-bit optimizer states only), so every process that imports grpo mutes that one logger.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
