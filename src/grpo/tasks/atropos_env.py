"""An Atropos environment (atroposlib `BaseEnv`) for the built-in tasks: digits and GSM8K-style math.

It samples prompts from `grpo.tasks.prompts`, generates `group_size` completions per prompt through the inference
server's `POST /generate` (atroposlib's `server_type=vllm` client; `python -m grpo.inference.server` serves it),
scores them with `grpo.tasks.rewards` and pushes the scored groups to run-api, where `data=atropos` picks them up.
Run it the way Atropos environments run:

    python -m grpo.tasks.atropos_env serve --env.task digits --env.tokenizer_name tiny-qwen2 \\
        --env.rollout_server_url http://127.0.0.1:8000 --openai.base_url http://127.0.0.1:9001/v1 \\
        --openai.tokenizer_name tiny-qwen2

`tokenizer_name` may name an offline preset of `grpo.models.tiny` (tiny-qwen2, tiny-llama): it resolves to the
built model directory, so no model hub is needed. Start it after the trainer (run-api only accepts environments
once the trainer polls /batch); `python -m grpo.stack` does all of this in one command.

Each group carries the weight versions the inference server reported (`GET /grpo/weight_version`) before its
requests went out and after they came back, as `generation_params.weight_version` / `last_weight_version` (the one
place run-api keeps them), so the trainer knows the group's lag (grpo.pipeline.atropos). A server without that
endpoint (not ours) gives groups without a version: logged once, and the trainer counts them as unversioned.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, Optional

import requests
from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from pydantic import Field

from grpo.models.tiny import TINY_PRESETS, build_model_dir
from grpo.tasks.prompts import DigitsTask, GSM8KTask, Prompt, Task
from grpo.tasks.rewards import AnswerFormatReward, DigitFractionReward, MathAnswerReward
from grpo.trainer.train_batch import IGNORE_INDEX

log = logging.getLogger(__name__)


def resolve_model_name(name: str) -> str:
    """An offline preset name of grpo.models.tiny → its built directory; anything else unchanged."""
    return str(build_model_dir(name)) if name in TINY_PRESETS else name


class GRPOTaskEnvConfig(BaseEnvConfig):
    """BaseEnv settings plus the built-in task, its sampling and its rewards."""

    task: str = Field(default="digits", description="Built-in task: digits or gsm8k")
    prompt_chars: int = Field(default=8, description="digits: letters per random prompt")
    gsm8k_path: Optional[str] = Field(default=None, description="gsm8k: JSONL of {question, answer}; null = shipped set")
    chat_template: bool = Field(default=True, description="gsm8k: render prompts with the tokenizer's chat template")
    format_weight: float = Field(default=0.1, description="gsm8k: weight of the '#### <number>' format reward")
    max_new_tokens: int = Field(default=16, description="Completion length cap in tokens")
    temperature: float = Field(default=1.0, description="Sampling temperature (sent with each group)")
    top_p: float = Field(default=1.0, description="Nucleus sampling threshold")
    seed: int = Field(default=0, description="Seed of the prompt stream")


class GRPOTaskEnv(BaseEnv):
    """Built-in tasks as an Atropos environment; groups carry rollout log-probs and the sampling temperature."""

    name = "grpo_task"
    env_config_cls = GRPOTaskEnvConfig

    def __init__(self, config: GRPOTaskEnvConfig, server_configs: Any, slurm: bool = False, testing: bool = False):
        config.tokenizer_name = resolve_model_name(config.tokenizer_name)
        for sc in server_configs if isinstance(server_configs, list) else [server_configs]:
            if isinstance(sc, APIServerConfig):
                # atroposlib's vLLM client loads this tokenizer (model_name when tokenizer_name is "none").
                if sc.tokenizer_name == "none":
                    sc.tokenizer_name = config.tokenizer_name
                sc.tokenizer_name = resolve_model_name(sc.tokenizer_name)
        super().__init__(config, server_configs, slurm=slurm, testing=testing)
        self.config: GRPOTaskEnvConfig
        self.task, self.rewards = self._build_task(config)
        self.task.bind_tokenizer(self.tokenizer)
        self.rng = random.Random(f"grpo-env:{config.seed}")
        self.recent_scores: list[float] = []
        # The first inference server's version endpoint (its OpenAI base_url without /v1).
        configs = [sc for sc in (server_configs if isinstance(server_configs, list) else [server_configs])
                   if isinstance(sc, APIServerConfig)]
        base = configs[0].base_url.rstrip("/").removesuffix("/v1") if configs and configs[0].base_url else None
        self.version_url = f"{base}/grpo/weight_version" if base else None
        self._version_warned = False

    @staticmethod
    def _build_task(config: GRPOTaskEnvConfig) -> tuple[Task, list[tuple[Any, float]]]:
        if config.task == "digits":
            return DigitsTask(config.prompt_chars), [(DigitFractionReward(), 1.0)]
        if config.task == "gsm8k":
            rewards = [(MathAnswerReward(), 1.0), (AnswerFormatReward(), config.format_weight)]
            return GSM8KTask(config.gsm8k_path, config.chat_template), rewards
        raise ValueError(f"--env.task must be digits or gsm8k, got {config.task!r}")

    @classmethod
    def config_init(cls) -> tuple[GRPOTaskEnvConfig, list[APIServerConfig]]:
        env = GRPOTaskEnvConfig(
            tokenizer_name="tiny-qwen2",
            group_size=8,
            use_wandb=False,
            rollout_server_url="http://127.0.0.1:8000",
            max_token_length=512,
            # -1: take the run length from the trainer's /register.
            total_steps=-1,
            # No evaluation pass: the trainer owns evaluation.
            steps_per_eval=0,
            max_num_workers_per_node=8,
            wandb_name="grpo_task",
        )
        # A list: a single non-list config makes atroposlib's ServerManager ignore base_url (default local ports).
        server = APIServerConfig(
            # api_key: a placeholder the openai client insists on; our server runs without --api-key.
            server_type="vllm", base_url="http://127.0.0.1:9001/v1", api_key="EMPTY", model_name="default",
            tokenizer_name="none",
            timeout=300, num_max_requests_at_once=64, num_requests_for_eval=8,
        )
        return env, [server]

    async def setup(self) -> None:
        """Nothing to load: the task was built in __init__."""

    async def get_next_item(self) -> Prompt:
        return self.task.sample(self.rng, 1)[0]

    async def served_version(self) -> Optional[int]:
        """The weight version the inference server serves now; None when it does not say (warned once)."""
        if self.version_url is None:
            return None
        try:
            answer = await asyncio.to_thread(requests.get, self.version_url, timeout=10)
            answer.raise_for_status()
            return int(answer.json()["weight_version"])
        except (requests.RequestException, ValueError, KeyError, TypeError) as e:
            if not self._version_warned:
                self._version_warned = True
                log.warning("no weight version from %s (%s): groups go without one, so the trainer cannot tell "
                            "their lag", self.version_url, e)
            return None

    async def collect_trajectories(self, item: Prompt) -> tuple[Optional[ScoredDataGroup], list]:
        prompt_ids = self.tokenizer.encode(item.text, add_special_tokens=False)
        max_tokens = self.config.max_new_tokens
        if self.max_token_len > 0:
            # atroposlib drops a group with any sequence of max_token_len tokens or more.
            max_tokens = min(max_tokens, self.max_token_len - 1 - len(prompt_ids))
        if max_tokens < 1:
            log.warning("prompt of %d tokens leaves no room under max_token_len %d; skipped",
                        len(prompt_ids), self.max_token_len)
            return None, []
        # Before the requests: at most the version of any token; after: at least.
        first_version = await self.served_version()
        _, out_tokens, out_logprobs, _ = await self.server.tokens_and_logprobs_completion(
            input_ids=prompt_ids, n=self.config.group_size, max_tokens=max_tokens,
            temperature=self.config.temperature, top_p=self.config.top_p,
        )
        last_version = await self.served_version()
        group: dict[str, Any] = {"tokens": [], "masks": [], "scores": [], "inference_logprobs": []}
        for ids, lps in zip(out_tokens, out_logprobs):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            score = sum(w * float(fn(item, text)) for fn, w in self.rewards)
            group["tokens"].append(prompt_ids + list(ids))
            group["masks"].append([IGNORE_INDEX] * len(prompt_ids) + list(ids))
            group["inference_logprobs"].append([1.0] * len(prompt_ids) + [float(x) for x in lps])
            group["scores"].append(score)
        group["generation_params"] = {"temperature": self.config.temperature}
        if first_version is not None and last_version is not None:
            group["generation_params"].update(weight_version=first_version, last_weight_version=last_version)
        self.recent_scores.extend(group["scores"])
        return group, []

    async def evaluate(self, *args, **kwargs) -> None:
        """No evaluation pass (steps_per_eval=0)."""

    async def wandb_log(self, wandb_metrics: Optional[dict] = None) -> None:
        if self.recent_scores:
            log.info("step %d: mean score %.4f over %d rollouts", self.curr_step,
                     sum(self.recent_scores) / len(self.recent_scores), len(self.recent_scores))
            self.recent_scores = []
        if self.config.use_wandb:
            await super().wandb_log(wandb_metrics)
        else:
            # atroposlib builds W&B tables even when W&B is off; only reset its buffers.
            self.rollouts_for_wandb, self.completion_lengths = [], []
            self.perf_stats({})


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    GRPOTaskEnv.cli()
