"""The sandboxed code reward (grpo.tasks.sandbox, grpo.tasks.code_reward): right programs score 1, wrong ones
0, and programs that loop, fork, allocate 10 GB, open a socket, read /etc, write outside their folder or flood their
output are stopped or refused, score 0, change nothing on the host and leave no process; results are cached; the
reward works in reward worker processes; experiment=code_tiny trains."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from grpo.conf import CONFIG_DIR
from grpo.pipeline.grading import Grader, picklable_specs
from grpo.pipeline.local import build_rewards
from grpo.tasks import sandbox
from grpo.tasks.code_reward import SandboxedTestsReward, extract_program
from grpo.tasks.coding_task import CODE_TINY, CodingTask
from grpo.tasks.prompts import Prompt

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
ADD = Prompt("Write a Python function `add(a, b)` that returns the sum of a and b.", ADD_TESTS)
RIGHT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def reward() -> SandboxedTestsReward:
    return SandboxedTestsReward(timeout_s=1.0, memory_mb=256, output_kb=16, cache_size=0)


def fenced(program: str) -> str:
    return f"Here is the function:\n```python\n{program}```\n"


def sandbox_processes(token: str) -> list[int]:
    """Host pids of processes whose command line holds `token` (every process of one sandboxed run does)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def assert_refused(reward: SandboxedTestsReward, program: str, tests: str = ADD_TESTS) -> sandbox.SandboxResult:
    """`program` scores 0 through the reward, and a run of it fails its tests and leaves no process behind."""
    assert reward(Prompt("q", tests), fenced(program)) == 0.0
    result = reward.run(program, tests)
    assert not result.passed
    assert sandbox_processes(result.token) == []
    return result


def test_a_correct_program_scores_1_and_a_wrong_one_0(reward):
    assert reward(ADD, fenced(RIGHT)) == 1.0
    assert reward(ADD, fenced("def add(a, b):\n    return a - b\n")) == 0.0
    assert reward(ADD, "def add(a, b) return a + b") == 0.0  # not Python: no run
    assert reward(ADD, fenced("def plus(a, b):\n    return a + b\n")) == 0.0  # the tests' name is missing


def test_exiting_early_or_printing_a_verdict_does_not_pass(reward):
    for program in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "print('passed')\nraise SystemExit\n"):
        assert reward(ADD, fenced(RIGHT + program)) == 0.0, program


def test_every_shipped_reference_solution_passes_its_hidden_tests(reward):
    rows = [json.loads(line) for line in CODE_TINY.read_text().splitlines() if line.strip()]
    assert len(rows) >= 32
    # One run for all rows: their solutions, then all their tests.
    result = reward.run("\n".join(r["solution"] for r in rows), "\n".join(r["tests"] for r in rows))
    assert result.passed, result.stderr[-2000:]
    task = CodingTask()
    assert len(task.eval_rows) == 8 and not {q for q, _ in task.eval_rows} & {q for q, _ in task.rows}


def test_extract_program_takes_the_last_fenced_block():
    assert extract_program("a\n```python\nx = 1\n```\nb\n```\ny = 2\n```") == "y = 2\n"
    assert extract_program("```py\nz = 3\n") == "z = 3\n"  # an unclosed fence runs to the end
    assert extract_program("w = 4") == "w = 4"


def test_a_program_that_loops_forever_is_killed_at_the_timeout_and_leaves_no_process(reward):
    start = time.monotonic()
    result = assert_refused(reward, "while True:\n    pass\n")
    assert result.timed_out and result.seconds < 2.0
    assert time.monotonic() - start < 5.0
    assert assert_refused(reward, "import time\ntime.sleep(60)\n").timed_out


def test_a_fork_bomb_is_refused_and_leaves_no_process(reward):
    result = assert_refused(reward, "import os\nwhile True:\n    os.fork()\n" + RIGHT)
    assert "PermissionError" in result.stderr and not result.timed_out
    result = assert_refused(reward, "import subprocess\nsubprocess.run(['true'])\n" + RIGHT)
    assert "PermissionError" in result.stderr
    # Threads are not processes: they still run.
    assert reward(ADD, fenced("import threading\nt = threading.Thread(target=print)\nt.start()\nt.join()\n" + RIGHT))


def test_allocating_10_gb_fails_with_memory_error(reward):
    result = assert_refused(reward, "x = bytearray(10 * 2**30)\n" + RIGHT)
    assert "MemoryError" in result.stderr


def test_a_socket_reaches_no_host_service(reward):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        program = (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5).sendall(b'x')\n"
                   + RIGHT)
        result = assert_refused(reward, program)
        assert "ConnectionRefusedError" in result.stderr  # its own loopback, where nothing listens
        assert_refused(reward, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=0.5)\n" + RIGHT)
        # A connection that reached the host's listener would wait in its backlog, accepted or not.
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


def test_etc_passwd_and_shadow_are_not_in_the_view(reward):
    # The function is right only when a read succeeded: a score of 0 shows that every read failed.
    program = ("import os\nseen = []\nfor path in ('/etc/passwd', '/etc/shadow', '/etc/hostname'):\n"
               "    try:\n        seen.append(open(path).read())\n    except OSError as e:\n"
               "        print(type(e).__name__, path)\n"
               "print(os.path.exists('/etc'), sorted(os.listdir('/')))\n"
               "def add(a, b):\n    return a + b if seen else 0\n")
    result = assert_refused(reward, program)
    assert result.stdout.count("FileNotFoundError") == 3
    assert "False" in result.stdout  # no /etc at all
    for host_path in ("/etc/passwd", "/etc/hostname"):
        if Path(host_path).is_file() and Path(host_path).read_text().strip():
            assert Path(host_path).read_text().splitlines()[0] not in result.stdout + result.stderr


def test_writes_outside_the_box_are_refused_and_no_host_file_changes(reward, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("host data\n")
    before = victim.stat().st_mtime_ns
    usr_file = sorted(Path("/usr/lib").glob("*"))[0]
    marker = f"grpo-sandbox-write-{os.getpid()}"
    targets = [str(victim), f"/tmp/{marker}", f"/{marker}", f"/usr/{marker}", f"/dev/{marker}", str(usr_file)]
    # The function is right only when a write succeeded.
    program = (f"wrote = []\nfor path in {targets!r}:\n    try:\n        with open(path, 'a') as f:\n"
               "            f.write('sandbox')\n        wrote.append(path)\n    except OSError as e:\n"
               "        print(type(e).__name__, path)\n"
               "def add(a, b):\n    return a + b if wrote else 0\n")
    result = assert_refused(reward, program)
    assert result.stdout.count("Error") == len(targets)
    assert victim.read_text() == "host data\n" and victim.stat().st_mtime_ns == before
    for path in (f"/tmp/{marker}", f"/{marker}", f"/usr/{marker}"):
        assert not Path(path).exists()
    # Its own folder is writable (and vanishes with the run).
    assert reward(ADD, fenced("open('scratch.txt', 'w').write('x' * 1000)\nimport tempfile\ntempfile.mkstemp()\n"
                              + RIGHT)) == 1.0


def test_output_beyond_the_limit_is_cut_and_scores_0(reward):
    result = assert_refused(reward, "while True:\n    print('x' * 1000)\n")
    assert result.output_truncated and len(result.stdout) <= 16 * 1024


def test_results_are_cached_per_distinct_program_and_tests():
    cached = SandboxedTestsReward(timeout_s=1.0)
    assert [cached(ADD, fenced(RIGHT)) for _ in range(3)] == [1.0] * 3
    assert cached(ADD, "Again:\n```python\n" + RIGHT + "```") == 1.0  # the same program in other words
    assert cached.runs == 1
    assert cached(Prompt("q", "assert add(2, 2) == 5\n"), fenced(RIGHT)) == 0.0  # other tests: a run of their own
    assert cached.runs == 2


def test_the_reward_refuses_to_start_without_bwrap_and_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox._probe.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxUnavailable, match="apt-get install bubblewrap"):
            SandboxedTestsReward()
    finally:
        monkeypatch.undo()
        sandbox._probe.cache_clear()


def test_a_sandbox_bwrap_fails_to_start_is_an_error_not_a_zero_score():
    with pytest.raises(sandbox.SandboxError, match="--size"):
        sandbox.run_sandboxed(RIGHT, ADD_TESTS, sandbox.SandboxLimits(box_bytes=0))


def test_hostile_programs_score_0_in_reward_workers_and_the_batch_goes_on():
    specs = OmegaConf.load(CONFIG_DIR / "data" / "code_tiny.yaml").rewards
    specs.correct.timeout_s = 1.0
    hostile = ["while True:\n    pass\n", "import os\nos.fork()\n", "x = bytearray(10 * 2**30)\n",
               "open('/etc/passwd').read()\n", "import os\nos._exit(0)\n"]
    pairs = [(ADD, fenced(RIGHT))] + [(ADD, fenced(p + RIGHT)) for p in hostile] + [(ADD, fenced(RIGHT))]
    grader = Grader(build_rewards(specs), picklable_specs(specs), build_rewards, workers=1)
    try:
        grades = grader.grade(pairs)
    finally:
        grader.close()
    assert [g.values["correct"] for g in grades] == [1.0, 0, 0, 0, 0, 0, 1.0]


@pytest.mark.vllm
def test_code_tiny_trains_3_steps_with_the_sandboxed_reward(tmp_path, train_server, tiny_qwen2_dir):
    from test_evaluation import _train

    rows = _train(train_server, tiny_qwen2_dir, tmp_path / "run", "experiment=code_tiny", "train.steps=3",
                  "data.prompts_per_step=4", "data.group_size=4", "train.micro_batch_size=8", "train.grad_accum=2",
                  "data.max_new_tokens=16", "eval.samples_per_prompt=1", "eval.k=1", "logging.progress_bar=false",
                  base=())
    trained = [r for r in rows if r["step"] > 0 and "loss" in r]  # evaluations beside training: rows of their own
    assert [r["step"] for r in trained] == [1, 2, 3]
    for r in trained:
        assert {"reward/correct", "loss"} <= set(r) and r["reward/correct"] == 0.0  # random weights: no working code
    # Evaluations beside training write rows of their own when scored: the initial weights' and the last step's.
    assert {r["step"] for r in rows if "eval/accuracy" in r} == {0, 3}
