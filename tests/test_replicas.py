"""Several vLLM replicas behind one trainer (issue 42, docs/replicas.md): requests spread by load with a group on one
replica, every sync reaching each replica (its weight version and the trainer's log-probs), a replica killed mid-run
restarted alone, and the configurations refused at start-up. The vLLM tests run on the CPU engine with the tiny
model; the routing and the checks need no server."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_class

from conftest import server_cfg
from grpo.conf import CONFIG_DIR
from grpo.config import ConfigError, register_configs, validate
from grpo.inference.client import InferenceClient
from grpo.inference.routing import ReplicaLoad, RoutedClient, Share, water_fill
from grpo.sync.base import worst_arrival
from grpo.sync.nccl_broadcast import transfer_ranks

register_configs()  # the structured schemas the YAML groups extend


def _compose(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=["~experiment", *overrides])


# ---------------------------------------------------------------------------------------------------- routing
def test_requests_fill_the_least_loaded_replica_first_in_contiguous_shares():
    assert water_fill([0, 0], 8) == [4, 4]
    assert water_fill([6, 0], 8) == [1, 7]  # the busy replica gets work only once the other caught up
    assert water_fill([0, 0, 0], 2) == [1, 1, 0]
    load = ReplicaLoad()
    first = load.reserve(["http://a", "http://b"], 8)
    assert first == [Share("http://a", 0, 4), Share("http://b", 4, 4)]
    second = load.reserve(["http://a", "http://b"], 4)  # another thread's batch while the first is out
    load.release("http://a", 4)  # a's share of the first batch answered
    third = load.reserve(["http://a", "http://b"], 6)
    assert second == [Share("http://a", 0, 2), Share("http://b", 2, 2)]
    assert third == [Share("http://a", 0, 5), Share("http://b", 5, 1)]  # a: 2 out, b: 6 out
    assert load.sent == {"http://a": 11, "http://b": 7}


@pytest.mark.vllm
def test_a_share_whose_replica_does_not_answer_goes_to_another_and_keeps_its_seeds(vllm_server):
    """One replica is a port nothing listens on: its prompts are sent to the live one (counted as a failover), with
    the seeds they have in a single call, so the completions equal one server's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    prompts = [[5, 17, 99, 3], [42, 7, 8], [200, 11], [12, 64, 65, 66]]
    sampling = dict(n=2, max_tokens=4, temperature=1.0, seed=1234, logprobs=False)
    load = ReplicaLoad()
    routed = RoutedClient([dead, vllm_server.url], load, retries=1, backoff_s=0.05)
    single = InferenceClient(vllm_server.url)
    try:
        got = routed.generate(prompts, **dict(sampling))
        want = single.generate(prompts, **dict(sampling))
    finally:
        routed.close()
        single.close()
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
    assert load.failovers == 1 and load.outstanding == {dead: 0, vllm_server.url: 0}


def test_one_nccl_group_reaches_every_worker_of_every_replica():
    assert transfer_ranks([1]) == (2, [1])
    assert transfer_ranks([1, 1]) == (3, [1, 2])
    assert transfer_ranks([2, 2, 2]) == (7, [1, 3, 5])  # tensor parallel 2: each replica's workers in a row


def test_several_replicas_report_each_arrival_and_the_worst():
    one = {"sync/served_version": 2.0, "sync/weights_match": 1.0, "sync/weights_max_rel_diff": 0.0}
    assert worst_arrival([one]) == one
    lagging = {"sync/served_version": 1.0}  # a replica still on the previous version: no fingerprint compared
    both = worst_arrival([one, lagging])
    assert both["sync/served_version"] == 1.0 and both["sync/weights_match"] == 1.0
    assert both["sync/replica0/served_version"] == 2.0 and both["sync/replica1/served_version"] == 1.0
    assert "sync/replica1/weights_match" not in both


# ---------------------------------------------------------------------------------------------------- start-up checks
@pytest.mark.parametrize("overrides, message", [
    (["mode=shared_vllm", "server.replicas=2"], "mode=shared_vllm trains the tensors of one vLLM server in place"),
    (["mode=shared_vllm", "server.external_urls=[http://h1:1,http://h2:2]"], "cannot serve 2 replicas"),
    (["server.replicas=0"], "server.replicas must be a whole number >= 1"),
    (["server.replicas=3", "server.devices=[1,2]"], "names 2 device(s) for server.replicas=3"),
    (["server.external_url=http://h:1", "server.external_urls=[http://h:2]"], "not both"),
    (["server.replicas=3", "server.external_urls=[http://h:1,http://h:2]"], "lists 2 servers"),
    (["server.replicas=2", "server.external_url=http://h:1"], "list several servers in server.external_urls"),
    (["server.replicas=2", "data=atropos"], "the other replicas would stay idle"),
], ids=["shared_vllm", "shared_vllm_external", "zero", "devices", "both_urls", "url_count", "one_url", "atropos"])
def test_replica_settings_that_cannot_work_are_refused_at_start_up(overrides, message):
    cfg = _compose(overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        validate(cfg)


def test_replicas_on_gpus_need_a_device_each_and_broadcast_gpus_apart_from_the_trainer():
    from grpo.serving.checks import check_replicas

    with pytest.raises(ConfigError, match=r"set server.devices \(e.g. server.devices=\[1, 2\]\)"):
        check_replicas(_compose(["server=gpu", "server.replicas=2"]), "gpu")
    broadcast = get_class("grpo.sync.nccl_broadcast.NCCLBroadcastSync")
    with pytest.raises(ConfigError, match=r"server.devices=\[0, 1\] \(each the first of 1 GPU\(s\)\) must give distinct"):
        broadcast.check_config(_compose(["mode=broadcast", "server.replicas=2", "server.devices=[0,1]"]), cuda=True)
    broadcast.check_config(_compose(["mode=broadcast", "server.replicas=2", "server.devices=[1,2]"]), cuda=True)
    # Tensor parallel 2: each replica spans two GPUs, so [1, 2] overlaps on GPU 2 and [1, 3] does not.
    tp2 = ["mode=broadcast", "server.replicas=2", "server.extra_args=[--tensor-parallel-size,2]"]
    with pytest.raises(ConfigError, match=r"each the first of 2 GPU\(s\).*e.g. server.devices=\[1, 3\]"):
        broadcast.check_config(_compose([*tp2, "server.devices=[1,2]"]), cuda=True)
    broadcast.check_config(_compose([*tp2, "server.devices=[1,3]"]), cuda=True)


def test_a_tensor_parallel_server_takes_its_device_and_the_gpus_after_it_as_the_trainer_numbers_them(monkeypatch,
                                                                                                    tmp_path):
    from grpo.inference.launch_args import server_visible_devices
    from grpo.inference.process import VLLMServer

    assert server_visible_devices(1, 3, None) == "1,2,3"
    assert server_visible_devices(1, 1, "4,5") == "5"  # index 1 within the trainer's CUDA_VISIBLE_DEVICES
    with pytest.raises(ConfigError, match=r"GPUs \[1, 2\].*beyond the 2 GPU\(s\) of CUDA_VISIBLE_DEVICES=4,5"):
        server_visible_devices(1, 2, "4,5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5")
    server = VLLMServer(tmp_path / "model", {"device": 1, "extra_args": ["--tensor-parallel-size", "3"]},
                        tmp_path / "vllm.log")
    assert server.environment()["CUDA_VISIBLE_DEVICES"] == "3,4,5"


# ---------------------------------------------------------------------------------------------------- syncs on vLLM
def trainer_logprobs(model, seq: list[int]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


SEQ = [5, 17, 99, 3, 42, 7, 8, 200, 11, 12, 64, 65, 66]


@pytest.fixture(scope="module")
def replica_pair(vllm_server, tiny_qwen2_dir, tmp_path_factory):
    """Two replicas started elsewhere (server.external_urls), LoRA enabled: the session's server and a second one
    with the same run token (one GRPO_SERVER_TOKEN attaches to both). One vLLM start-up for this module."""
    from grpo.inference.process import VLLMServer

    second = VLLMServer(tiny_qwen2_dir, server_cfg(), tmp_path_factory.mktemp("second_replica") / "vllm.log",
                        enable_lora=True, served_model_name=str(tiny_qwen2_dir))
    second.token = vllm_server.token
    second.start()
    try:
        yield [vllm_server, second]
    finally:
        second.stop()


def _attached(sync, replica_pair, tiny_qwen2_dir, tmp_path, monkeypatch):
    """`sync` moving weights into both replicas of `replica_pair`, attached by the run's server session."""
    from transformers import AutoTokenizer

    from grpo.inference.identity import TOKEN_ENV
    from grpo.serving.session import ServerSession
    from grpo.sync.base import SyncContext

    monkeypatch.setenv(TOKEN_ENV, replica_pair[0].token)
    urls = [server.url for server in replica_pair]
    session = ServerSession(sync, SyncContext(run_dir=tmp_path, model_dir=tiny_qwen2_dir,
                                              server_cfg=server_cfg(external_urls=urls),
                                              tokenizer=AutoTokenizer.from_pretrained(tiny_qwen2_dir)))
    session.launch()
    return sync, session


def _step_and_check_every_replica(sync, model, lr: float, step: int) -> None:
    """A real optimizer step, a sync; then every replica serves the trainer's version and log-probs (fp32, 1e-5)."""
    from test_sync_modes import optimizer_step

    before = trainer_logprobs(model, SEQ)
    optimizer_step(model, lr)
    after = trainer_logprobs(model, SEQ)
    assert (after - before).abs().mean().item() > 1e-2, "the optimizer step barely moved the log-probs"
    assert sync.sync(model, step)["sync/version"] == step
    for replica in sync.server.replicas:
        served = torch.tensor(replica.client.prompt_logprobs(SEQ, model=sync.served_model))
        assert (served - after).abs().max().item() < 1e-5, replica.url
        assert replica.client.weight_version() == step
    arrival = sync.check_arrival(model)
    assert arrival["sync/replica0/served_version"] == arrival["sync/replica1/served_version"] == step, arrival


@pytest.mark.vllm
def test_mode_none_reloads_every_replica(replica_pair, tiny_qwen2_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from grpo.sync.save_and_reload import SaveAndReloadSync

    sync, session = _attached(SaveAndReloadSync(), replica_pair, tiny_qwen2_dir, tmp_path, monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    try:
        for step in (1, 2):
            _step_and_check_every_replica(sync, model, 1e-3, step)
        arrival = sync.check_arrival(model)
        assert arrival["sync/replica0/weights_match"] == arrival["sync/replica1/weights_match"] == 1.0, arrival
    finally:
        sync.server.each(lambda replica: replica.client.reload_weights(str(tiny_qwen2_dir), version=0))
        session.shutdown()  # attached: closes the clients, stops nothing


@pytest.mark.vllm
def test_mode_lora_only_hot_swaps_into_every_replica(replica_pair, tiny_qwen2_dir, tmp_path, monkeypatch):
    from grpo.sync.lora_hotswap import LoraHotSwapSync
    from test_sync_modes import lora_model

    sync, session = _attached(LoraHotSwapSync(adapter_prefix=f"replicas-{tmp_path.name}"), replica_pair,
                              tiny_qwen2_dir, tmp_path, monkeypatch)
    model = lora_model(tiny_qwen2_dir)
    try:
        for step in (1, 2, 3):
            _step_and_check_every_replica(sync, model, 2e-2, step)
        for replica in sync.server.replicas:  # the adapter of two syncs ago is gone from each
            served = replica.client.models()
            assert sync.served_model in served and sync.served_model.replace("v3", "v1") not in served
    finally:
        for replica in sync.server.replicas:
            for name in replica.client.models()[1:]:
                if name.startswith(f"replicas-{tmp_path.name}"):
                    replica.client.unload_lora(name)
            replica.client.set_weight_version(0)
        session.shutdown()


# ---------------------------------------------------------------------------------------------------- a whole run
@pytest.mark.vllm
@pytest.mark.slow
def test_two_replicas_serve_a_run_and_one_killed_mid_run_is_restarted_alone(tmp_path):
    """server.replicas=2, mode=none: both replicas receive requests; after every sync both serve the trainer's
    version and weights; replica 0 killed (SIGKILL of its own process group, from logs/vllm.pid) as batch 2 is sent:
    its prompts go to replica 1, the next step's health check restarts it alone (replica 1 keeps its process), and
    every step has its row."""
    from test_reliability import server_starts, train
    from test_train_e2e import assert_clean

    run = tmp_path / "run"
    code, out, marker = train("train.steps=3", "server.replicas=2", "server.max_restarts=1",
                              f"hydra.run.dir={run}", fault="kill_server_generating@2", timeout=600)
    assert code == 0, out[-3000:]
    table = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in table] == [1, 2, 3]
    assert all(r["server/replica0/requests"] > 0 and r["server/replica1/requests"] > 0 for r in table)
    assert table[-1]["server/failovers"] >= 1, out[-3000:]
    assert [r["server/replica0/restarts"] for r in table][-1] == 1 and table[-1]["server/replica1/restarts"] == 0
    for r in table:
        assert r["sync/replica0/served_version"] == r["sync/replica1/served_version"] == r["sync/version"], r
        assert r["sync/replica0/weights_match"] == r["sync/replica1/weights_match"] == 1.0, r
    assert len(server_starts(run)) == 2  # replica 0: its start and its restart
    assert len(server_starts(run, "vllm-replica1.log")) == 1  # replica 1: never restarted
    assert_clean(marker)


def test_a_resume_keeps_every_replicas_earlier_log(tmp_path):
    from grpo.run_records import keep_earlier_server_log

    logs = tmp_path / "logs"
    logs.mkdir()
    for session in ("1", "2"):
        (logs / "vllm.log").write_text(session)
        (logs / "vllm-replica1.log").write_text(session)
        assert keep_earlier_server_log(tmp_path) == logs / f"vllm.{session}.log"
    assert sorted(p.name for p in logs.iterdir()) == ["vllm-replica1.1.log", "vllm-replica1.2.log", "vllm.1.log",
                                                      "vllm.2.log"]
    assert (logs / "vllm-replica1.2.log").read_text() == "2"


def test_an_asynchronous_batch_from_replicas_at_different_versions_keeps_only_groups_within_max_staleness():
    """Replicas take a sync one after another (or one restarts on older weights): a rollout batch can hold groups of
    several versions. Each group carries its own replica's version, so those more than train.max_staleness versions
    behind the trainer are dropped and the trained ones stay within the bound."""
    from test_async_rollouts import Scripted, Server, make

    class TwoReplicas(Scripted):
        """Group 0 from an up-to-date replica, group 1 from one two versions behind."""

        def next_groups(self, step):
            groups = super().next_groups(step)
            groups[1].weight_version = groups[1].last_weight_version = max(groups[0].weight_version - 2, 0)
            return groups

    server, inner = Server(), TwoReplicas()
    src = make(inner, server, k=1)
    try:
        rows = []
        for b in range(4):
            src.next_batch(b)
            rows.append(src.metrics())
            server.version += 1
    finally:
        src.close()
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert sum(r["async/dropped_groups"] for r in rows) >= 2  # the lagging replica's groups once it lags by 2
