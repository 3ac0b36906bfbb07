"""A run talks only to the server it started (issue 21.1): the run token, no port sharing, a free port by default,
and what the launcher says while vLLM starts (issue 22.2)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from conftest import free_port, process_group_alive, server_cfg

TOKEN = "X-GRPO-Token"


# ---------------------------------------------------------------- no vLLM needed
def _bind_shared(port: int) -> socket.socket:
    """A socket bound the way a second vLLM would try: SO_REUSEADDR and SO_REUSEPORT, not yet listening."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    return s


GUARDED_BIND = """
import socket, sys, time
from grpo.inference import identity
port = int(sys.argv[1])
if sys.argv[2] == "guard":
    identity.exclusive_listen(port)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
s.bind(("127.0.0.1", port))   # what vLLM does long before it listens
print("bound", flush=True)
time.sleep(30)
"""


@pytest.mark.parametrize("mode", ["guard", "plain"])
def test_exclusive_listen_keeps_other_binds_off_the_port(mode):
    """Without the guard a second SO_REUSEADDR/SO_REUSEPORT socket binds the same port (how two vLLMs shared one);
    with it the kernel refuses the second bind."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", GUARDED_BIND, str(port), mode], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "bound"
        if mode == "guard":
            with pytest.raises(OSError) as e:
                _bind_shared(port).close()
            assert e.value.errno == 98  # EADDRINUSE
        else:
            _bind_shared(port).close()  # the hole the guard closes
    finally:
        proc.kill()
        proc.wait()


def test_token_problem():
    from grpo.inference.identity import token_problem

    assert token_problem(None, None) is None  # started by hand: no checks
    assert token_problem("abc", "abc") is None
    assert token_problem("abc", None)[0] == 401
    assert token_problem("abc", "abd")[0] == 403


@pytest.mark.vllm
def test_port_null_picks_a_free_port_and_start_failure_shows_the_log(tmp_path, tiny_qwen2_dir, caplog):
    """server.port=null: a free port is chosen at start; a failed start logs progress and the log's last lines."""
    from grpo.inference.process import ServerStartError, VLLMServer

    bad = VLLMServer(tiny_qwen2_dir, _cfg_port_none(), tmp_path / "vllm.log",
                     extra_args=["--no-such-flag"])
    assert bad.port is None
    with caplog.at_level(logging.INFO, logger="grpo.inference.process"):
        with pytest.raises(ServerStartError, match="no-such-flag"):
            bad.start(timeout=120)
    assert isinstance(bad.port, int) and bad.port > 0
    assert f"starting vLLM on 127.0.0.1:{bad.port} (log: {tmp_path / 'vllm.log'})" in caplog.text
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and "no-such-flag" in errors[-1] and "last lines of" in errors[-1]


def test_start_up_progress_says_what_vllm_is_doing(tmp_path):
    """The "starting vLLM: N s" lines carry vLLM's last log message: a 3-minute GPU start-up (weights, compile,
    CUDA-graph capture) otherwise reads as a hang."""
    from grpo.inference.process import VLLMServer

    server = VLLMServer("unused-model-dir", _cfg_port_none(), tmp_path / "vllm.log")
    assert server.start_up_phase() == ""  # no log yet
    (tmp_path / "vllm.log").write_text(
        "\n===== grpo: starting python -m grpo.inference.server ...\n"
        "(EngineCore pid=77) INFO 11-25 07:36:39 [gpu_model_runner.py:4321] Capturing CUDA graphs (decode): 35%\n\n"
    )
    assert server.start_up_phase() == " (Capturing CUDA graphs (decode): 35%)"
    (tmp_path / "vllm.log").write_text("===== grpo: starting python -m grpo.inference.server ...\n")
    assert server.start_up_phase() == ""  # only our own header: nothing from vLLM yet


def test_the_cpu_aot_note_and_a_long_vllm_message_read_with_matched_brackets(tmp_path):
    """Issue 62.21: the progress line quoted the 101-character CPU note cut at 100 characters, in brackets of its
    own: "(grpo: VLLM_USE_AOT_COMPILE=0 on CPU (vLLM's AOT cache never loads there; torch's inductor cache does)"."""
    from grpo.inference.process import VLLMServer
    from grpo.inference.server import CPU_AOT_NOTE

    def balanced(text: str) -> bool:
        depth = 0
        for ch in text:
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth < 0:
                return False
        return depth == 0

    server = VLLMServer("unused-model-dir", _cfg_port_none(), tmp_path / "vllm.log")
    long_message = "Loading weights (" + "shard " * 30 + "of 4)"
    for message, shown in ((CPU_AOT_NOTE, f" ({CPU_AOT_NOTE})"), (long_message, None)):
        (tmp_path / "vllm.log").write_text(f"===== grpo: starting ...\n{message}\n")
        phase = server.start_up_phase()
        assert balanced(CPU_AOT_NOTE) and balanced(phase), phase
        assert shown is None or phase == shown
    assert phase.endswith("...))") and len(phase) <= 106


def _cfg_port_none():
    cfg = server_cfg()
    cfg.port = None
    return cfg


# ---------------------------------------------------------------- the real server
@pytest.mark.vllm
def test_health_proves_the_token_and_weight_calls_need_it(vllm_server):
    url = vllm_server.url
    ok = requests.get(url + "/health", headers={TOKEN: vllm_server.token}, timeout=10)
    assert ok.status_code == 200 and ok.headers["X-GRPO-Token-Verified"] == "true"
    wrong = requests.get(url + "/health", headers={TOKEN: "not-the-token"}, timeout=10)
    assert wrong.status_code == 403 and "another run" in wrong.json()["error"]
    # Without a token /health is vLLM's plain answer (Atropos environments poll it), with no proof in it.
    plain = requests.get(url + "/health", timeout=10)
    assert plain.status_code == 200 and "X-GRPO-Token-Verified" not in plain.headers
    assert vllm_server.probe()[0] == "ours" and vllm_server.healthy()

    calls = [
        ("/grpo/reload_weights", {"path": "/no/such/dir"}),
        ("/grpo/rpc", {"method": "grpo_param_info"}),
        ("/grpo/weight_version", {"weight_version": 99}),
        ("/grpo/weight_transfer/init", {}),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter"}),
        ("/v1/unload_lora_adapter", {"lora_name": "x"}),
    ]
    for path, body in calls:
        assert requests.post(url + path, json=body, timeout=30).status_code == 401, path
        assert requests.post(url + path, json=body, headers={TOKEN: "other"}, timeout=30).status_code == 403, path
    # Nothing changed: the version is what it was.
    assert requests.get(url + "/grpo/weight_version", timeout=10).json()["weight_version"] != 99
    # With the token the call reaches its handler (which rejects the bad path itself).
    r = requests.post(url + "/grpo/reload_weights", json={"path": "/no/such/dir"}, headers={TOKEN: vllm_server.token})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]
    client = vllm_server.client()
    v = client.weight_version()
    client.set_weight_version(v)  # the token travels with the client
    # Generation needs no token.
    r = requests.post(url + "/generate", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


class _ForeignFirst:
    """Starts `python -m http.server` (with a file named `health`) on the port right after our server is launched,
    i.e. while vLLM is still importing: the situation of issue 21.1 (b)."""

    def __init__(self, port: int, root) -> None:
        (root / "health").write_text("ok")
        self.port, self.root, self.proc = port, root, None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1"],
                                     cwd=self.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if requests.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                time.sleep(0.1)
        raise RuntimeError("http.server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.mark.vllm
def test_something_else_answering_health_is_not_adopted(tmp_path, tiny_qwen2_dir):
    from grpo.inference.process import NotOurServerError, VLLMServer

    port = free_port()
    foreign = _ForeignFirst(port, tmp_path)

    class LaunchedThenRaced(VLLMServer):
        def wait_healthy(self, timeout: float) -> None:
            foreign.start()  # our process is launched; the other program takes the port before vLLM binds it
            super().wait_healthy(timeout)

    ours = LaunchedThenRaced(tiny_qwen2_dir, server_cfg(port), tmp_path / "vllm.log")
    try:
        with pytest.raises(NotOurServerError, match=f"something else answers on 127.0.0.1:{port}") as e:
            ours.start(timeout=240)
        assert "without proving this run's token" in str(e.value)
        pgid = ours.proc.pid if ours.proc is not None else None
        assert not ours.running()
        assert pgid is None or not process_group_alive(pgid)
        # The other program is left alone.
        assert foreign.proc.poll() is None
    finally:
        ours.stop()
        foreign.stop()


@pytest.fixture(scope="module")
def race(tmp_path_factory, tiny_qwen2_dir):
    """Two real launches at once on one fixed port (two runs started together with the same server.port)."""
    from grpo.inference.process import VLLMServer

    tmp = tmp_path_factory.mktemp("race")
    port = free_port()
    servers = [
        # Eager: no torch.compile (~12 s less per start, two starts at once on the same cores).
        VLLMServer(tiny_qwen2_dir, server_cfg(port, enforce_eager=True), tmp / f"vllm{i}.log",
                   served_model_name=[str(tiny_qwen2_dir), "tiny-qwen2"])
        for i in range(2)
    ]
    errors: dict[int, BaseException] = {}
    started = [threading.Event(), threading.Event()]
    release = threading.Event()

    def start(i: int) -> None:
        try:
            servers[i].start(timeout=300)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions
            errors[i] = e
        started[i].set()
        # The launching thread must outlive the server: its exit fires the server's PDEATHSIG (process.py).
        release.wait()

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for e in started:
        e.wait()
    try:
        yield port, servers, errors
    finally:
        for s in servers:
            s.stop()
        release.set()
        for t in threads:
            t.join()


@pytest.mark.vllm
def test_two_launches_on_one_port_one_wins_one_fails_clearly(race):
    from grpo.inference.process import ServerStartError

    port, servers, errors = race
    assert len(errors) == 1, f"exactly one launch must fail, got errors {errors}"
    (loser_i, err), = errors.items()
    winner, loser = servers[1 - loser_i], servers[loser_i]
    assert isinstance(err, ServerStartError)
    msg = str(err)
    assert f"{port}" in msg and ("something else answers" in msg or "taken by another process" in msg), msg
    assert not loser.running() and winner.healthy()
    # The port belongs to the winner alone: the loser's token is refused, the winner's proves it.
    assert winner.probe()[0] == "ours" and loser.probe()[0] == "foreign"
    r = requests.post(winner.url + "/grpo/weight_version", json={"weight_version": 5}, headers={TOKEN: loser.token})
    assert r.status_code == 403


@pytest.mark.vllm
def test_served_model_alias(race):
    """The base model answers to its directory and to the alias (model.name, conf/server's served_model_aliases)."""
    _, servers, errors = race
    winner = next(s for i, s in enumerate(servers) if i not in errors)
    ids = [m["id"] for m in requests.get(winner.url + "/v1/models", timeout=10).json()["data"]]
    assert ids[0] == winner.served_model_names[0]
    for name in winner.served_model_names:
        r = requests.post(winner.url + "/v1/completions", json={"model": name, "prompt": [1, 2, 3], "max_tokens": 2},
                          timeout=60)
        assert r.status_code == 200, (name, r.text)
    r = requests.post(winner.url + "/v1/completions", json={"model": "nope", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 404


def test_grpo_serve_help_says_what_it_adds_without_vllms_deprecation_warnings():
    """`grpo-serve --help` printed only vLLM's help, led by two warnings that the module is deprecated in favour of
    `vllm serve`: a newcomer learnt neither what grpo-serve adds nor that the warning is not about their command."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "grpo.inference.server", "--help"], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert text.lstrip().startswith("grpo-serve (python -m grpo.inference.server)")
    assert "POST /generate" in text and "--max-model-len" in text  # ours first, then vLLM's own options
    # Where it listens, and what guards its weight endpoints (it said neither, and listened on every interface).
    assert "--host 127.0.0.1 (this machine only" in text and "GRPO_SERVER_TOKEN (environment)" in text
    assert "A --host beyond loopback (e.g. 0.0.0.0) is refused without it" in text
    assert "--max-sequences-per-request N" in text
    assert "DeprecationWarning" not in text and "is deprecated" not in text


@pytest.mark.slow  # 13 s of the CI suite: starts two servers one after another; test_replicas starts replicas at once
@pytest.mark.vllm
def test_a_replica_waited_for_after_another_counts_its_start_up_from_its_own_launch(tmp_path, tiny_qwen2_dir, caplog):
    """Issue 62.18: replicas start side by side and are waited for in turn; the second's "starting vLLM" line and
    clock began only when its wait did, so it was "ready after 0 s". Launched, then waited for 7 s later (while the
    first replica would be waited for), its line comes at the launch and its first progress line counts from there."""
    from grpo.inference.process import PROGRESS_FIRST_S, ServerStartError, VLLMServer

    server = VLLMServer(tiny_qwen2_dir, _cfg_port_none(), tmp_path / "vllm.log")
    with caplog.at_level(logging.INFO, logger="grpo.inference.process"):
        server.start(wait=False)
        try:
            assert f"starting vLLM on 127.0.0.1:{server.port} (log: " in caplog.text  # at the launch, not the wait
            time.sleep(PROGRESS_FIRST_S + 2)
            with pytest.raises(ServerStartError, match="not healthy"):
                server.wait_healthy(timeout=PROGRESS_FIRST_S + 3)  # 1 s of waiting left: stops it, unready
        finally:
            server.stop()
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("starting vLLM: ")]
    assert progress, caplog.text
    assert int(progress[0].split()[2]) >= PROGRESS_FIRST_S + 2, progress  # counted from the launch
