"""`server.launch_early`: the run starts vLLM's processes once its config is checked and its weight sync is built, and
checks the optimizer's settings (torch._dynamo's import) and loads the tokenizer (transformers' import) while vLLM
starts; the server waited for later is the one started early, and a run that fails in between stops it. What runs
before the launch imports none of the heavy modules it does not need."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import process_group_alive
from grpo.conf import CONFIG_DIR
from test_train_e2e import QUICK


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[*QUICK, "mode=shared_vllm", *overrides])


def _server_pid(run_dir: Path) -> int | None:
    pid_file = run_dir / "logs" / "vllm.pid"
    return int(pid_file.read_text()) if pid_file.exists() else None


@pytest.mark.vllm
@pytest.mark.parametrize("early", [True, False])
def test_the_server_process_starts_before_the_tokenizer_loads(tmp_path, monkeypatch, early):
    """With launch_early the server's process runs by the time the tokenizer starts loading; without it none has
    started when build_parts returns (build_trainer starts it). Closing the run stops the server started early."""
    import grpo.build as build

    run_dir = tmp_path / "run"
    seen: dict[str, object] = {}
    load_tokenizer = build.load_tokenizer

    check_optimizer_settings = build.check_optimizer_settings

    def load_and_note(model_dir):
        pid = _server_pid(run_dir)
        seen["server_running"] = pid is not None and process_group_alive(pid)
        return load_tokenizer(model_dir)

    def check_and_note(cfg):
        seen["running_at_optimizer_check"] = _server_pid(run_dir) is not None
        return check_optimizer_settings(cfg)

    monkeypatch.setattr(build, "load_tokenizer", load_and_note)
    monkeypatch.setattr(build, "check_optimizer_settings", check_and_note)
    parts = build.build_parts(_compose(f"server.launch_early={str(early).lower()}"), run_dir)
    pid = _server_pid(run_dir)
    try:
        assert seen["server_running"] is early and parts.server_started_early is early
        assert seen["running_at_optimizer_check"] is early  # torch._dynamo's import: after the launch
        assert parts.tokenizer is not None and parts.sync_ctx.tokenizer is parts.tokenizer
    finally:
        parts.close(failed=RuntimeError("stopped by the test before build_trainer"))
    if early:
        assert pid is not None and not process_group_alive(pid)
        assert not (run_dir / "logs" / "vllm.pid").exists()


@pytest.mark.vllm
def test_a_run_failing_after_the_early_start_stops_the_server(tmp_path, monkeypatch):
    """An error after the server's processes started (here: the tokenizer's load) stops them before it is raised."""
    import grpo.build as build

    run_dir = tmp_path / "run"
    started: list[int] = []

    def fail(model_dir):
        started.append(_server_pid(run_dir))
        raise OSError(f"no tokenizer in {model_dir}")

    monkeypatch.setattr(build, "load_tokenizer", fail)
    with pytest.raises(OSError, match="no tokenizer"):
        build.build_parts(_compose(), run_dir)
    assert started and started[0] is not None
    assert not process_group_alive(started[0]) and not (run_dir / "logs" / "vllm.pid").exists()


def test_the_wall_clock_gives_when_vllm_was_launched_and_ready_beside_the_parts_it_overlaps():
    """summary.json's `startup_at` holds moments (seconds from the origin), not parts: the start-up's parts still add
    up to `startup_seconds`; the last line names both moments."""
    import time

    from grpo.trainer.wall_clock import WallClock, describe

    origin = time.time() - 30.0
    clock = WallClock(origin=origin)
    clock.mark("server_launched", at=origin + 5.0)
    clock.mark("server_launched", at=origin + 9.0)  # the first note counts (an early start's, then the launch's)
    clock.mark("server_ready", at=origin + 20.0)
    clock.add_startup("server_wait", 12.0)
    clock.loop_started()
    summary = clock.summary()
    assert summary["startup_at"] == pytest.approx({"server_launched_seconds": 5.0, "server_ready_seconds": 20.0})
    assert sum(summary["startup"].values()) == pytest.approx(summary["startup_seconds"])
    assert "server wait 12 s" in describe(summary) and "vLLM launched at 5 s; ready at 20 s" in describe(summary)


def test_the_imports_moment_is_the_first_jobs_alone():
    """`startup_at.imported_seconds`: when the trainer's imports were done (grpo.train notes it), for the job whose
    clock starts at the process's start; a sweep's later job, whose clock starts at its own start, has none."""
    import time

    from grpo.trainer.wall_clock import WallClock, describe

    origin = time.time() - 30.0
    first, later = WallClock(origin=origin), WallClock(origin=origin + 20.0)
    for clock in (first, later):
        clock.mark("imported", at=origin + 4.0)
        clock.loop_started()
    assert first.summary()["startup_at"] == pytest.approx({"imported_seconds": 4.0})
    assert "imports done at 4 s" in describe(first.summary())
    assert later.summary()["startup_at"] == {}


# Composes and checks the bare config and finds its (cached) model directory, as a run does before vLLM's launch,
# then asks for a model's decoder and head, as the trainer does once vLLM is ready (a plain module has none: the
# error is expected); prints which heavy modules the first part imported, and whether the second imported peft.
_BEFORE_LAUNCH = """
import json, sys
from pathlib import Path
from hydra import compose, initialize_config_dir
from grpo.conf import CONFIG_DIR
from grpo.config import register_configs, validate
from grpo.recipes.initial_weights import resolve_model_dir
register_configs()
with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
    cfg = compose(config_name="train", overrides=sys.argv[2:], return_hydra_config=True)
    validate(cfg, Path(sys.argv[1]))
model_dir = resolve_model_dir(cfg.model)
heavy = ("torch._dynamo", "transformers", "peft")
before = [m for m in heavy if m in sys.modules]
import torch
from grpo.trainer.logprobs import backbone_and_head
try:
    backbone_and_head(torch.nn.Module())  # no CausalLM: fails, after asking whether it is a PEFT model
except AttributeError:
    pass
print(json.dumps({"before_launch": before, "peft_after": "peft" in sys.modules}))
"""


def test_what_runs_before_the_launch_imports_neither_dynamo_nor_transformers(tmp_path):
    """The config's checks leave the optimizer's build (torch._dynamo's import, seconds) to after vLLM's launch, and a
    cached model directory is found without transformers' import; a plain model's trainer never imports peft
    (which imports bitsandbytes, whose CPU ops call torch.compile at import). A fresh interpreter: the test
    session has imported them all."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grpo.config import register_configs
    from grpo.recipes.initial_weights import resolve_model_dir

    overrides = ["~experiment"]
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        resolve_model_dir(compose(config_name="train", overrides=overrides).model)  # cached for the child
    out = subprocess.run([sys.executable, "-c", _BEFORE_LAUNCH, str(tmp_path / "run"), *overrides],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"before_launch": [], "peft_after": False}
