"""Weight-sync modes on the real vLLM CPU engine: after a real optimizer step and a sync, the server's log-probs of a
fixed sequence equal the trainer's new ones; shutdown leaves no process behind."""

from __future__ import annotations

import pytest
import torch

from conftest import process_group_alive, server_cfg
from grpo.conf import CONFIG_DIR

SEQ = [5, 17, 99, 3, 42, 7, 8, 200, 11, 12, 64, 65, 66]


def trainer_logprobs(model, seq=SEQ) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


def optimizer_step(model, lr: float) -> None:
    """One Adam step on the NLL of SEQ (a real loss, a real optimizer)."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    ids = torch.tensor([SEQ])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def lora_model(model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    return get_peft_model(base, cfg)


def check_moves(sync, model, lr: float, step: int = 1) -> dict:
    """Server == trainer before; a step moves the trainer; after sync the server follows."""
    client = sync.server.client
    before_server = torch.tensor(client.prompt_logprobs(SEQ, model=sync.served_model))
    before = trainer_logprobs(model)
    assert (before_server - before).abs().max() < 1e-4
    optimizer_step(model, lr)
    after = trainer_logprobs(model)
    moved = (after - before).abs().mean().item()
    assert moved > 1e-2, f"the optimizer step barely moved the log-probs ({moved})"
    metrics = sync.sync(model, step)
    after_server = torch.tensor(client.prompt_logprobs(SEQ, model=sync.served_model))
    diff = (after_server - after).abs().mean().item()
    print(f"\n{type(sync).__name__}: step moved log-probs by {moved:.3f}; |server - trainer| after sync = {diff:.2e}; "
          f"sync {metrics['sync/seconds']:.2f}s")  # fmt: skip
    assert diff < 1e-4
    assert metrics["sync/version"] == sync.version == step and metrics["sync/seconds"] > 0
    (gen,) = client.generate([SEQ[:4]], n=1, max_tokens=3, model=sync.served_model)
    assert gen[0].weight_version == sync.version
    return metrics


def make_ctx(tmp_path, model_dir, **cfg):
    from transformers import AutoTokenizer

    from grpo.sync.base import SyncContext

    return SyncContext(
        run_dir=tmp_path, model_dir=model_dir, server_cfg=server_cfg(**cfg), tokenizer=AutoTokenizer.from_pretrained(model_dir)
    )


def serve(sync, ctx):
    """The server session of a run of `sync` (grpo.serving.session, as grpo.build builds it), launched."""
    from grpo.serving.session import ServerSession

    session = ServerSession(sync, ctx)
    session.launch()
    return session


def shutdown_and_check(session) -> None:
    pgid = session.server.process.pid
    session.shutdown()
    session.shutdown()  # idempotent
    assert not process_group_alive(pgid), "a process of the server's group survived shutdown"


@pytest.mark.vllm
def test_mode_none_reloads_in_place(tmp_path, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    from grpo.sync.save_and_reload import SaveAndReloadSync

    sync = SaveAndReloadSync()
    session = serve(sync, make_ctx(tmp_path, tiny_qwen2_dir, enforce_eager=True))  # no torch.compile: ~12 s less
    try:
        pid = sync.server.process.pid
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
        metrics = check_moves(sync, model, lr=1e-3)
        assert metrics["sync/inplace"] == 1.0 and sync.server.process.pid == pid  # no restart
        arrived = sync.check_arrival(model)  # issue 44.12: the served weights themselves, not log-probs
        assert arrived["sync/served_version"] == 1.0 and arrived["sync/weights_match"] == 1.0, arrived
        optimizer_step(model, 1e-3)  # the trainer moves on without a sync: the check must see the difference
        stale = sync.check_arrival(model)
        assert stale["sync/weights_match"] == 0.0 and stale["sync/weights_max_rel_diff"] > 1e-6, stale
        sync.sync(model, 2)
        assert sync.check_arrival(model) | {"sync/arrival_check_seconds": 0} == {
            "sync/served_version": 2.0, "sync/weights_match": 1.0, "sync/weights_max_rel_diff": 0.0,
            "sync/arrival_check_seconds": 0}
        assert sorted(p.name for p in (tmp_path / "served_weights").iterdir()) == ["v2"]
    finally:
        shutdown_and_check(session)


@pytest.mark.slow  # 22 s of the CI suite for the opt-in mode.reload=background; test_mode_none_reloads_in_place keeps mode=none
@pytest.mark.vllm
def test_mode_none_background_reload_lands_before_generation_and_a_failed_one_is_redone(tmp_path, tiny_qwen2_dir):
    """mode.reload=background: sync() returns once the weights are saved (the version already the new one); a
    request sent through endpoint() from another thread (the rollout producer) waits for the reload, so it samples
    the new weights under the new version; a reload that fails is redone when the trainer's thread settles it."""
    import threading

    from transformers import AutoModelForCausalLM

    from grpo.inference.client import InferenceServerError
    from grpo.sync.save_and_reload import SaveAndReloadSync

    sync = SaveAndReloadSync(reload="background")
    session = serve(sync, make_ctx(tmp_path, tiny_qwen2_dir, enforce_eager=True))
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
        optimizer_step(model, 1e-3)
        metrics = sync.sync(model, 1)
        assert sync.version == metrics["sync/version"] == 1 and metrics["sync/reload_wait_seconds"] == 0.0
        seen = {}

        def producer() -> None:  # what the rollout producer does: endpoint(), then sample at once
            endpoint = session.endpoint()
            (gen,) = sync.server.client.generate([SEQ[:4]], n=1, max_tokens=3, model=endpoint.model)
            seen["version"] = gen[0].weight_version

        thread = threading.Thread(target=producer)
        thread.start()
        thread.join(60)
        assert seen["version"] == 1  # admitted on the reloaded weights, never on version 0's
        sync.settle()
        server = torch.tensor(sync.server.client.prompt_logprobs(SEQ, model=sync.served_model))
        assert (server - trainer_logprobs(model)).abs().max() < 1e-4

        # The next reload fails once (the server said no): the trainer's next settle redoes it in place.
        optimizer_step(model, 1e-3)
        real_reload, calls = sync.server.client.reload_weights, []

        def failing_once(path, version=None):
            calls.append(path)
            if len(calls) == 1:
                raise InferenceServerError("reload refused (test)")
            return real_reload(path, version=version)

        sync.server.client.reload_weights = failing_once
        metrics = sync.sync(model, 2)
        session.endpoint()  # on the trainer's thread (an evaluation): settles, redoing the failed reload
        assert len(calls) == 2 and sync.version == 2
        server = torch.tensor(sync.server.client.prompt_logprobs(SEQ, model=sync.served_model))
        assert (server - trainer_logprobs(model)).abs().max() < 1e-4
        assert sync.server.client.weight_version() == 2
        sync.sync(model, 3)
        assert sorted(p.name for p in (tmp_path / "served_weights").iterdir()) in (["v2", "v3"], ["v3"])
    finally:
        shutdown_and_check(session)


@pytest.mark.vllm
def test_mode_lora_restart(tmp_path, tiny_qwen2_dir):
    from grpo.sync.lora_restart import LoraRestartSync

    sync = LoraRestartSync()
    session = serve(sync, make_ctx(tmp_path, tiny_qwen2_dir))
    try:
        old_pid = sync.server.process.pid
        model = lora_model(tiny_qwen2_dir)
        check_moves(sync, model, lr=2e-2)
        assert sync.served_model == "policy" and sync.server.process.pid != old_pid
        assert not process_group_alive(old_pid)
        assert "--enforce-eager" not in sync.server.process.command()
    finally:
        shutdown_and_check(session)


@pytest.mark.vllm
def test_mode_lora_only_hot_swaps(tmp_path, tiny_qwen2_dir):
    from grpo.sync.lora_hotswap import LoraHotSwapSync

    sync = LoraHotSwapSync()
    session = serve(sync, make_ctx(tmp_path, tiny_qwen2_dir))
    try:
        pid = sync.server.process.pid
        model = lora_model(tiny_qwen2_dir)
        assert sync.served_model is None  # fresh adapter == base model
        check_moves(sync, model, lr=2e-2, step=1)
        assert sync.served_model == "policy-v1"
        check_moves(sync, model, lr=2e-2, step=2)
        check_moves(sync, model, lr=2e-2, step=3)
        served = sync.server.client.models()
        assert "policy-v3" in served and "policy-v2" in served and "policy-v1" not in served
        assert sync.server.process.pid == pid and "--enforce-eager" not in sync.server.process.command()
    finally:
        shutdown_and_check(session)


@pytest.mark.vllm
def test_lora_jobs_sharing_one_server_each_count_their_own_versions_and_unload_their_adapters(
        tmp_path, tiny_qwen2_dir, vllm_server, monkeypatch):
    """mode.shared_server (LoRA configurations at once): two jobs attached to one server hot-swap adapters under
    their own names; each rollout and arrival check reports the version of the job's own adapter (job A at 2, job
    B at 1), not the last one any job set; the server's own version is left alone; each job unloads its adapters
    when it ends, and the server keeps serving."""
    from grpo.inference.identity import TOKEN_ENV
    from grpo.sync.lora_hotswap import LoraHotSwapSync

    monkeypatch.setenv(TOKEN_ENV, vllm_server.token)
    client = vllm_server.client()
    global_version = client.weight_version()
    jobs = {name: LoraHotSwapSync(adapter_prefix=name, shared_server=True) for name in ("jobA", "jobB")}
    sessions = []
    try:
        for name, sync in jobs.items():
            sessions.append(serve(sync, make_ctx(tmp_path / name, tiny_qwen2_dir, external_url=vllm_server.url)))
        model_a, model_b = lora_model(tiny_qwen2_dir), lora_model(tiny_qwen2_dir)
        for sync, model, step in ((jobs["jobA"], model_a, 1), (jobs["jobB"], model_b, 1), (jobs["jobA"], model_a, 2)):
            optimizer_step(model, 2e-2)
            sync.sync(model, step)  # the last version set on the server: A's 2
        assert {jobs["jobA"].served_model, jobs["jobB"].served_model} <= set(client.models())
        for sync, model, version in ((jobs["jobA"], model_a, 2), (jobs["jobB"], model_b, 1)):
            (gen,) = client.generate([SEQ[:4]], n=1, max_tokens=3, model=sync.served_model)
            assert gen[0].weight_version == version
            assert sync.check_arrival(model)["sync/served_version"] == version
        assert client.weight_version() == global_version
    finally:
        for session in sessions:
            session.shutdown()
    assert [m for m in client.models() if m.startswith("job")] == []
    assert vllm_server.healthy()
    client.close()


@pytest.mark.vllm
def test_shared_vllm_on_the_cpu_trains_the_servers_own_memory_and_a_restart_keeps_it(tmp_path, tiny_qwen2_dir):
    """mode=shared_vllm on vLLM's CPU backend: the trainer's parameters are views of the server's (one shared file
    mapping, the server multiplying with them as they are), so an optimizer step changes what vLLM computes with no
    weights sent; a crashed server is restarted on the trained weights, not the initial ones; shutdown removes the
    mapping's file."""
    import os
    import signal

    from grpo.sync.shared_memory import SharedMemorySync

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA (the CUDA IPC path runs on the GPU kit)")
    sync = SharedMemorySync()
    ctx = make_ctx(tmp_path, tiny_qwen2_dir)
    session = serve(sync, ctx)
    try:
        model = sync.load_model(ctx)
        shared = sync.shared_file
        assert shared is not None and shared.exists()
        before = trainer_logprobs(model)
        sync.before_optimizer_step()
        optimizer_step(model, lr=2e-2)
        sync.after_optimizer_step()
        # The server computes with the new weights before any sync: nothing was sent, it reads the same memory.
        served = torch.tensor(sync.server.client.prompt_logprobs(SEQ))
        assert (served - trainer_logprobs(model)).abs().max() < 1e-4
        assert (served - before).abs().mean() > 1e-2
        metrics = check_moves(sync, model, lr=2e-2, step=1)
        assert metrics["sync/seconds"] < 5
        trained = trainer_logprobs(model)
        os.killpg(sync.server.process.pid, signal.SIGKILL)  # the server this test started
        assert sync.server.check_health() is True  # restarted
        served = torch.tensor(sync.server.client.prompt_logprobs(SEQ))
        assert (served - trained).abs().max() < 1e-4, "the restarted server serves other weights than the trainer's"
        check_moves(sync, model, lr=2e-2, step=2)  # and the trainer still trains the memory it serves
    finally:
        shutdown_and_check(session)
    assert not shared.exists()


def test_shared_weight_files_of_dead_trainers_are_removed_and_live_ones_kept(tmp_path):
    """A trainer killed with SIGKILL leaves its /dev/shm weight file behind; the next shared_vllm run on the CPU
    deletes it, never the file of a trainer still running (nor a file that is not ours)."""
    import os
    import subprocess
    import sys

    from grpo.sync.shared_memory import SHARED_FILE_PREFIX, remove_orphaned_shared_files

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{SHARED_FILE_PREFIX}{int(gone.stdout)}-abcd1234.bin"
    live = tmp_path / f"{SHARED_FILE_PREFIX}{os.getpid()}-abcd1234.bin"
    other = tmp_path / "grpo-shared-weights-notapid.bin"
    for path in (dead, live, other):
        path.write_bytes(b"x")
    assert remove_orphaned_shared_files(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and other.exists()


@pytest.mark.parametrize("in_flight", [False, True])
def test_shared_vllm_pauses_and_resets_unless_updates_are_in_flight(in_flight):
    """What shared_vllm asks of the server around an optimizer step and at the sync: pause / resume and a prefix
    cache reset by default; with mode.in_flight_updates=true only the version bump (generation never stops)."""
    from grpo.serving.server import Replica
    from grpo.sync.shared_memory import SharedMemorySync

    calls = []

    class Server:  # records the calls a real InferenceClient would send
        def pause(self):
            calls.append("pause")

        def resume(self):
            calls.append("resume")

        def set_weight_version(self, version, reset_prefix_cache=False):
            calls.append(("version", version, reset_prefix_cache))

    sync = SharedMemorySync(in_flight_updates=in_flight)
    sync.server.replicas, sync.shared_file = [Replica(Server())], object()  # a CPU mapping: no CUDA synchronisation
    sync.before_optimizer_step()
    calls.append("optimizer step")
    sync.after_optimizer_step()
    metrics = sync.sync(torch.nn.Linear(1, 1), step=1)
    if in_flight:
        assert calls == ["optimizer step", ("version", 1, False)]
        assert "sync/gen_stall_seconds" not in metrics and sync.take_generation_stall()["sync/gen_stall_seconds"] == 0
    else:
        assert calls == ["pause", "optimizer step", "resume", ("version", 1, True)]
        assert sync.take_generation_stall()["sync/gen_stall_seconds"] > 0
    assert metrics["sync/version"] == 1 == sync.version


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama"])
def test_shared_vllm_rebuilds_the_meta_rotary_buffers_on_the_device_without_a_deprecation_warning(preset):
    """shared_vllm builds the HF model on meta and points its parameters at vLLM's tensors; the rotary embedding's
    inv_freq (a buffer vLLM has no copy of) is rebuilt on the device. A run printed transformers' FutureWarning
    about the `device` argument on every start (hermes8b, H100); the rebuilt model must also compute exactly what a
    normally built one does."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo.models.tiny import build_model_dir
    from grpo.sync.shared_memory import rebuild_meta_buffer_modules

    model_dir = build_model_dir(preset)
    config = AutoConfig.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for name, p in reference.named_parameters():  # what the views into vLLM's tensors are, on CPU
        module_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, torch.nn.Parameter(p.detach().clone()))
    if config.tie_word_embeddings:  # as load_model does: lm_head shares the embedding (one parameter above)
        model.tie_weights()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning fails the test
        rebuild_meta_buffer_modules(model, config, torch.device("cpu"))
    assert not [n for n, b in model.named_buffers() if b.is_meta]
    torch.testing.assert_close(trainer_logprobs(model), trainer_logprobs(reference), rtol=0, atol=0)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_model_the_strategy_builds_gets_the_same_training_set_up(tiny_qwen2_dir, checkpointing):
    """mode=shared_vllm builds its own model (views of vLLM's tensors) instead of loading one. train.py must give it
    what a loaded model gets: train mode, no KV cache, and `model.gradient_checkpointing`. The flag was once
    silently ignored in that mode, so a GPU benchmark ran ours without the recompute it claimed. Recompute is seen
    directly: a checkpointed block's MLP starts twice per forward + backward (a pre-hook: torch stops the recompute
    as soon as it has the saved tensors, before the MLP's forward returns)."""
    from types import SimpleNamespace

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo.config import register_configs
    from grpo.recipes.trainable_model import build_model

    class OwnModelSync:  # a strategy that, like shared_vllm, hands train.py a model of its own making
        uses_lora = False

        def load_model(self, ctx):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ctx.model_dir)).eval()

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "~experiment", "model=tiny_qwen2", f"model.gradient_checkpointing={str(checkpointing).lower()}"])
    ctx = SimpleNamespace(model_dir=tiny_qwen2_dir)
    model = build_model(cfg, OwnModelSync(), ctx, None, torch.device("cpu"), None)
    assert model.training and model.config.use_cache is False
    assert model.is_gradient_checkpointing is checkpointing

    calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.tensor([SEQ])
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert len(calls) == (2 if checkpointing else 1)


def test_an_external_server_that_does_not_answer_is_a_config_error(tmp_path):
    """Before, server.external_url=<nothing there> was a RuntimeError traceback (Hydra's 'Error executing job')."""
    import socket

    from omegaconf import OmegaConf

    from grpo.config_values import ConfigError
    from grpo.serving.session import ServerSession
    from grpo.sync.base import SyncContext
    from grpo.sync.save_and_reload import SaveAndReloadSync

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    ctx = SyncContext(run_dir=tmp_path, model_dir=tmp_path, server_cfg=OmegaConf.create({"external_url": url}))
    with pytest.raises(ConfigError, match=f"server.external_url={url} does not answer /health: start that server "
                                          "first"):
        ServerSession(SaveAndReloadSync(), ctx).launch()
