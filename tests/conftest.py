"""Shared fixtures: offline tiny models and free ports. Server fixtures are shared per session (vLLM start-up costs ~20 s)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

# Tests never reach a model hub; wandb stays offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

REPO = Path(__file__).resolve().parents[1]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test that uses a shared vLLM server fixture needs vLLM: it is marked `vllm` even where the marker was left
    out, so `-m "not vllm"` (before the marker selection, which runs after this hook) never starts a server."""
    for item in items:
        if {"vllm_server", "train_server"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.vllm)


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process_then_two_gloo_ranks(step, model_dir: Path, out: Path, *extra) -> None:
    """Run `step(rank, world, port, model_dir, out, *extra)` once in this process (world 1), then on two gloo ranks:
    the shape of every "FSDP2 equals one process" test."""
    from unittest import mock

    import torch.multiprocessing as mp

    with mock.patch.dict(os.environ):  # the step sets torchrun's variables; the session's environment keeps none
        step(0, 1, free_port(), str(model_dir), str(out), *extra)
    mp.spawn(step, args=(2, free_port(), str(model_dir), str(out), *extra), nprocs=2, join=True)


def loss_gradient_through_batch(groups, model_dir: Path):
    """Groups through the batcher, the tiny model's forward and GRPOLoss's backward: (the micro-batch, its logits
    with their gradient, the trainer's log-probs), for tests of which positions carry gradient."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo.pipeline.batching import prepare_batch
    from grpo.trainer.loss import GRPOLoss
    from grpo.trainer.loss_interface import LossInputs

    batch = prepare_batch(groups, max_seq_len=512, micro_batch_size=64, pad_token_id=0).micro_batches[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits.retain_grad()
    labels = batch.labels.clamp(min=0)
    logprobs = torch.log_softmax(logits / batch.temperatures[:, None, None], -1).gather(-1, labels[..., None])[..., 0]
    loss, _ = GRPOLoss()(LossInputs(logprobs, batch.inference_logprobs, batch.advantages, batch.loss_mask))
    loss.backward()
    return batch, logits, logprobs


def untrained_between_trained(loss_mask):
    """Per row, the positions between its first and last trained token that are not trained (tool results,
    environment turns, template markers)."""
    import torch

    between = torch.zeros_like(loss_mask, dtype=torch.bool)
    for b in range(loss_mask.shape[0]):
        trained = loss_mask[b].nonzero()
        first, last = int(trained[0]), int(trained[-1])
        between[b, first:last] = loss_mask[b, first:last] == 0
    return between


@pytest.fixture(scope="session")
def tiny_qwen2_dir() -> Path:
    """Directory of the offline tiny Qwen2 model (built once, cached)."""
    from grpo.models.tiny import build_model_dir

    return build_model_dir("tiny-qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """Directory of the offline tiny Llama model (built once, cached)."""
    from grpo.models.tiny import build_model_dir

    return build_model_dir("tiny-llama", seed=0)


def group_option(group: str, option: str):
    """conf/<group>/<option>.yaml as a run composes it: its schema's defaults (and the options it builds on) with the
    option's own keys on top (the file itself holds only what differs from them). Interpolations stay unresolved."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.conf import CONFIG_DIR
    from grpo.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=f"{group}/{option}")[group]


def server_cfg(port: int | None = None, **overrides):
    """A ServerConfig for the vLLM CPU engine and a tiny model (conf/server/cpu.yaml values)."""
    from grpo.schema import ServerConfig

    base = dict(
        host="127.0.0.1", port=port or free_port(), gpu_memory_utilization=0.2, kv_cache_gb=0.5, max_model_len=512,
        dtype="float32", max_lora_rank=16, startup_timeout_s=240, busy_loop_s=0.02, worker_in_engine_process=True,
        chunked_prefill=False,
    )  # fmt: skip
    base.update(overrides)
    return ServerConfig(**base)


def session_server(model_dir: Path, tmp_path_factory, name: str, cfg, *, enable_lora: bool = False):
    """Start one real vLLM CPU server (grpo.inference.server) on `model_dir`, yield it, stop it: the body of each
    session-scoped server fixture (its log under a temporary folder called `name`)."""
    from grpo.inference.process import VLLMServer

    log = tmp_path_factory.mktemp(name) / "vllm.log"
    server = VLLMServer(model_dir, cfg, log, enable_lora=enable_lora, served_model_name=str(model_dir))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(tiny_qwen2_dir, tmp_path_factory):
    """ONE real vLLM CPU server (our grpo.inference.server) on tiny-qwen2 for the whole session, LoRA enabled, its
    model worker in a process of its own.

    Tests that change its weights must put the original ones back (or use their own server).
    """
    # vLLM's own layout (a worker process beside the engine core, as on a GPU box) for this server; the others run
    # the worker inside the engine core, as conf/server/cpu.yaml does.
    yield from session_server(tiny_qwen2_dir, tmp_path_factory, "vllm_session",
                              server_cfg(worker_in_engine_process=False), enable_lora=True)


@pytest.fixture(scope="session")
def train_server(tiny_qwen2_dir, tmp_path_factory):
    """ONE eager vLLM server without LoRA for the session that `train.py` runs attach to (`attach`), where a test
    checks what the run does rather than how it starts and stops its own server (tests/test_train_e2e.py does that).
    Each start costs ~30-40 s of the suite; runs change its weights, so `attach` puts the original ones back."""
    yield from session_server(tiny_qwen2_dir, tmp_path_factory, "train_server",
                              server_cfg(enforce_eager=True, max_model_len=1024, kv_cache_gb=0.25))


def attach(server, model_dir: Path) -> tuple[str, dict[str, str]]:
    """The override and environment of a `train.py` run attached to `server` (server.external_url, its token in
    GRPO_SERVER_TOKEN as a user attaching would set it), with the server back on `model_dir`'s weights at version 0
    (prefix cache dropped), as a server of the run's own would start."""
    from grpo.inference.identity import TOKEN_ENV

    client = server.client()
    try:
        client.reload_weights(str(model_dir), version=0)
        assert client.weight_version() == 0
    finally:
        client.close()
    return f"server.external_url={server.url}", {TOKEN_ENV: server.token}


def process_group_alive(pgid: int) -> bool:
    """True while any process of group `pgid` exists."""
    import os

    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
