"""server=cpu serves seeded requests whose prompts are split by chunked prefill: vLLM 0.32's CPU engine died on them
("RuntimeError: CPU Generator does not use offset", then EngineDeadError on every request): `python train.py
'~experiment' data=local_gsm8k data.max_new_tokens=256` crashed the server at its first eval, before any step, and
the restart crashed the same way. conf/server/cpu.yaml turns chunked prefill off.

One vLLM start (~25 s on 2 cores) with the server config train.py composes for server=cpu."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from conftest import free_port
from grpo.conf import CONFIG_DIR
from grpo.config import register_configs

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
register_configs()


@pytest.mark.slow  # 20-60 s of the CI suite's 25-minute budget: run with `pytest -m slow`
def test_seeded_requests_with_prompts_beyond_a_steps_token_budget_are_served(tiny_qwen2_dir, tmp_path):
    from grpo.inference.process import VLLMServer

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["~experiment", "server=cpu", f"server.port={free_port()}"])
    server = VLLMServer(tiny_qwen2_dir, cfg.server, tmp_path / "vllm.log", served_model_name=str(tiny_qwen2_dir))
    server.start()
    try:
        client = server.client()
        rng = random.Random(0)
        # 48 prompts x 3 seeded samples of 400 tokens: ~58k prompt tokens at once, far past one engine step's budget,
        # so the scheduler must either split prompts (chunked prefill) or hold them for a later step.
        prompts = [[rng.randrange(3, 200) for _ in range(400)] for _ in range(48)]
        out = client.generate(prompts, n=3, max_tokens=4, temperature=1.0, seed=1234)
        assert [len(c) for c in out] == [3] * 48 and all(len(s.token_ids) >= 1 for c in out for s in c)
        assert server.healthy()
        client.close()
    finally:
        server.stop()
    assert "CPU Generator does not use offset" not in (tmp_path / "vllm.log").read_text()
