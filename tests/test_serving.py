"""The server layer (grpo.serving.InferenceServer) without vLLM: a dead replica is restarted alone, through the weight
sync's `restore_replica`, counted and bounded by server.max_restarts; a healthy one is left alone. The processes are
stand-ins that report their health (the real VLLMServer path is tests/test_reliability.py's). And the server session
that runs it for a run's weight sync (grpo.serving.session; with vLLM in tests/test_sync_modes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from grpo.inference.client import InferenceServerError, ServerUnreachable
from grpo.serving.server import InferenceServer, Replica


class Process:
    """A launched server that is up or dead."""

    def __init__(self, pid: int, up: bool = True) -> None:
        self.pid, self.up, self.log_path, self.stopped = pid, up, Path(f"/tmp/vllm-{pid}.log"), False
        self.url = f"http://127.0.0.1:{pid}"

    def healthy(self, timeout: float) -> bool:
        return self.up

    def running(self) -> bool:
        return self.up

    def busy(self, timeout: float) -> bool:  # a stand-in that misses /health is dead, never busy
        return False

    def log_tail(self, n: int) -> str:
        return "last lines"

    def stop(self) -> None:
        self.stopped = True


class Client:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Weights:
    """The weight sync's side: what a restarted replica must serve."""

    version = 3

    def __init__(self) -> None:
        self.restored: list[int] = []

    def restore_replica(self, replica: Replica) -> None:
        self.restored.append(replica.process.pid)
        replica.process.up = True


def two_replicas(max_restarts: int) -> tuple[InferenceServer, Weights]:
    server, weights = InferenceServer(), Weights()
    # What `launch` records (the server config and the sync that drives it), without starting vLLM.
    server._cfg, server._weights = OmegaConf.create({"max_restarts": max_restarts}), weights
    server.replicas = [Replica(Client(), Process(101), index=0), Replica(Client(), Process(102), index=1)]
    return server, weights


def test_a_dead_replica_is_restarted_alone_counted_and_bounded(caplog):
    server, weights = two_replicas(max_restarts=1)
    assert server.check_health() is False and weights.restored == []
    server.replicas[1].process.up = False
    assert server.recover(ServerUnreachable("no answer")) is True  # the caller retries
    assert weights.restored == [102] and server.restarts == 1
    assert "inference server replica 1 (http://127.0.0.1:102) exited; restart 1 of 1 on weight version 3" in caplog.text
    assert [r.restarts for r in server.replicas] == [0, 1] and all(r.available for r in server.replicas)
    server.replicas[0].process.up = False  # the other replica has a bound of its own
    assert server.check_health() is True and weights.restored == [102, 101] and server.restarts == 2
    server.replicas[1].process.up = False
    with pytest.raises(RuntimeError, match=r"giving up after 1 restarts \(server.max_restarts=1\)"):
        server.check_health()
    assert weights.restored == [102, 101]


def test_an_error_that_is_not_the_servers_is_not_retried():
    server, weights = two_replicas(max_restarts=3)
    assert server.recover(ValueError("a bug")) is False
    assert server.recover(InferenceServerError("400: bad request")) is False  # the server answers: not a crash
    assert weights.restored == [] and server.restarts == 0
    assert InferenceServer().recover(ServerUnreachable("no server launched")) is False


def test_the_one_replica_accessors_refuse_several_and_shutdown_stops_every_replica():
    server, _ = two_replicas(max_restarts=3)
    with pytest.raises(RuntimeError, match="2 replicas"):
        server.client  # noqa: B018 - the property is what is tested
    server.shutdown()
    assert all(r.process.stopped and r.client.closed for r in server.replicas)
    with pytest.raises(RuntimeError, match="not launched"):
        InferenceServer().url  # noqa: B018
    assert InferenceServer().process is None


def test_the_server_session_hands_the_sync_its_server_and_stops_it_once_the_sync_has_let_go(tmp_path):
    """grpo.serving.session.ServerSession owns the server: the sync gets the session's server to move weights into
    (`attach`); a sync that serves nothing (torchrun ranks > 0) starts nothing, early or not; at shutdown the sync
    lets go first (`detach`), and the replicas stop even when that fails."""
    from grpo.serving.session import ServerSession
    from grpo.sync.base import SyncContext
    from grpo.sync.follower import FollowerSync

    order: list[str] = []

    class LettingGo(FollowerSync):
        def detach(self) -> bool:
            order.append("detach")
            raise OSError("the weight file could not be removed")

    sync = LettingGo()
    ctx = SyncContext(run_dir=tmp_path, model_dir=tmp_path, server_cfg=OmegaConf.create({}))
    session = ServerSession(sync, ctx)
    assert sync.server is session.server and sync.ctx is ctx
    assert session.start_early() is False
    session.launch()
    assert session.server.replicas == [] and not session.started_here
    session.server.replicas = [Replica(Client(), Process(101))]  # what a launch leaves, without vLLM
    with pytest.raises(OSError, match="could not be removed"):
        session.shutdown()
    assert order == ["detach"] and session.server.replicas[0].process.stopped
