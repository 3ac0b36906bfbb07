"""An Atropos environment (atroposlib BaseEnv) of the tests' own that sends multi-turn groups: each sequence is a
prompt, then `TURNS` assistant segments generated through the inference server's /generate (atroposlib's vLLM
client, token ids in and out), with a user message between them rendered by the chat template (masked out).

Run as an Atropos environment: python tests/multi_turn_env.py serve --env.rollout_server_url ... (tests/test_multi_turn.py).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from grpo.tasks.atropos_env import GRPOTaskEnv
from grpo.tasks.environment import TurnRenderer
from grpo.tasks.prompts import Prompt
from grpo.trainer.train_batch import IGNORE_INDEX

TURNS = 3


def user_message(turn: int) -> str:
    """The environment's message after assistant turn `turn` (1-based)."""
    return f"go on {turn}"


class MultiTurnTestEnv(GRPOTaskEnv):
    """The digits task's prompts, played for `TURNS` assistant turns; score = sequence length mod 3 (any spread)."""

    name = "grpo_multi_turn_test"

    async def collect_trajectories(self, item: Prompt) -> tuple[Optional[dict[str, Any]], list]:
        renderer = TurnRenderer(self.tokenizer)
        prompt_ids = self.tokenizer.encode(item.text, add_special_tokens=False)
        group: dict[str, Any] = {"tokens": [], "masks": [], "scores": [], "inference_logprobs": []}
        for _ in range(self.config.group_size):
            tokens, masks, logprobs = list(prompt_ids), [IGNORE_INDEX] * len(prompt_ids), [1.0] * len(prompt_ids)
            for turn in range(1, TURNS + 1):
                _, out_tokens, out_logprobs, _ = await self.server.tokens_and_logprobs_completion(
                    input_ids=tokens, n=1, max_tokens=self.config.max_new_tokens, temperature=self.config.temperature)
                ids = list(out_tokens[0])
                tokens, masks, logprobs = tokens + ids, masks + ids, logprobs + [float(x) for x in out_logprobs[0]]
                if turn < TURNS:
                    env = renderer.tokens("user", user_message(turn))
                    tokens, masks = tokens + env, masks + [IGNORE_INDEX] * len(env)
                    logprobs += [1.0] * len(env)
            group["tokens"].append(tokens)
            group["masks"].append(masks)
            group["inference_logprobs"].append(logprobs)
            group["scores"].append(float(len(tokens) % 3))
        group["generation_params"] = {"temperature": self.config.temperature}
        return group, []


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    MultiTurnTestEnv.cli()
