"""The built-in Atropos environment (BaseEnv) against the real run-api and our inference server, without a trainer.

The digits task runs end to end with the trainer in test_atropos_stack.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from grpo.inference.client import Endpoint
from grpo.pipeline.atropos import AtroposPipeline
from grpo.pipeline.base import PipelineContext
from grpo.pipeline.generation import GenerationHandle
from grpo.trainer.train_batch import IGNORE_INDEX
from test_atropos_pipeline import _start_run_api, _stop

pytestmark = [pytest.mark.vllm]


def test_gsm8k_environment_pushes_scored_groups(vllm_server, tiny_qwen2_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    api, url = _start_run_api(tmp_path)
    env = None
    try:
        pipe = AtroposPipeline(url=url, poll_interval_s=0.1, max_wait_s=180, max_retries=2)
        pipe.setup(PipelineContext(
            tokenizer=tok,
            generation=GenerationHandle(lambda: Endpoint("http://unused", None, 0)),
            batch_size=8, max_seq_len=512, run_dir=tmp_path,
            total_steps=2, start_step=0, checkpoint_every=5, seed=0,
        ))
        cmd = [
            sys.executable, "-m", "grpo.tasks.atropos_env", "serve", "--env.task=gsm8k",
            f"--env.rollout_server_url={url}", "--env.tokenizer_name=tiny-qwen2", "--env.group_size=4",
            "--env.max_new_tokens=24", "--env.temperature=0.7",
            # A random model scores 0 on every math problem; atroposlib would skip such groups by default.
            "--env.ensure_scores_are_not_same=false",
            f"--openai.base_url={vllm_server.url}/v1",
        ]
        with open(tmp_path / "env.log", "wb") as log:
            env = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        groups = pipe.next_groups(0)  # its /batch polls let the environment register
        assert sum(len(g.tokens) for g in groups) == 8, (tmp_path / "env.log").read_text()[-3000:]
        for g in groups:
            assert len(g.tokens) == 4 and g.temperatures == [0.7] * 4
            n_prompt = g.masks[0].count(IGNORE_INDEX)
            prompt = tok.decode(g.tokens[0][:n_prompt])
            assert prompt.startswith("<|im_start|>user\nSolve the math problem") and prompt.endswith("assistant\n")
            for tokens, masks, lps in zip(g.tokens, g.masks, g.inference_logprobs):
                assert masks[n_prompt:] == tokens[n_prompt:] and 1 <= len(tokens) - n_prompt <= 24
                assert lps[:n_prompt] == [1.0] * n_prompt and all(x <= 0 for x in lps[n_prompt:])
            assert all(s in (0.0, 0.1, 1.0, 1.1) for s in g.scores)
        assert pipe.last_metrics["data/dropped_malformed"] == 0
    finally:
        if env is not None and env.poll() is None:
            os.killpg(env.pid, signal.SIGTERM)
            env.wait(30)
        _stop(api)
