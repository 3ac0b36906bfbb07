"""Config that used to be silently ignored now stops the run before any model loads (issue 21.6)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from grpo.conf import CONFIG_DIR
from grpo.config import ConfigError, register_configs, validate
from grpo.config.validate import check_optimizer_settings
from grpo.pipeline.base import DataPipeline
from grpo.tasks.prompts import Task
from grpo.trainer.loss import GRPOLoss

REPO = Path(__file__).resolve().parents[1]
register_configs()


def _validate(overrides: list[str], run_dir: Path) -> None:
    """Compose as train.py does (with Hydra's record of choices and overrides) and validate, inside Hydra's context."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
        validate(cfg, run_dir)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("+optimzer.lr=1", "unknown config key optimzer (added with +optimzer=...?): nothing reads it; did you mean optimizer?"),
        ("+train.stepz=3", "unknown config key train.stepz"),
        ("+optimizer.lrr=1", "unknown config key optimizer.lrr"),
        ("+server.prot=9000", "did you mean server.port?"),
    ],
)
def test_added_unknown_keys_fail(tmp_path, override, needle):
    with pytest.raises(ConfigError) as e:
        _validate([override], tmp_path)
    assert needle in str(e.value)


@pytest.mark.parametrize("override", ["optimizer=adamw_schema", "mode=none_schema", "data=local_schema"])
def test_schema_entries_are_not_options(tmp_path, override):
    group, option = override.split("=")
    with pytest.raises(ConfigError, match=f"{override} is the schema behind the {group} options") as e:
        _validate([override], tmp_path)
    if group == "optimizer":
        assert "choose one of adafactor, adamw, adamw_8bit" in str(e.value)


def test_explicit_model_path_with_a_preset_fails(tmp_path):
    with pytest.raises(ConfigError) as e:
        _validate(["model=tiny_qwen2", "model.name=/no/such/path"], tmp_path)
    assert "model.name=/no/such/path was given" in str(e.value) and "model.offline=null" in str(e.value)


def test_explicit_model_path_wins_or_fails(tmp_path, tiny_qwen2_dir):
    with pytest.raises(ConfigError, match="model.name=/no/such/path does not exist"):
        _validate(["model.offline=null", "model.name=/no/such/path"], tmp_path)
    _validate(["model.offline=null", f"model.name={tiny_qwen2_dir}"], tmp_path)  # a real model directory passes


def test_empty_model_directory_fails_naming_it(tmp_path):
    empty = tmp_path / "my_model"
    empty.mkdir()
    with pytest.raises(ConfigError, match=f"no model files in {empty}"):
        _validate(["model.offline=null", f"model.name={empty}"], tmp_path / "run")
    (empty / "config.json").write_text("{}")  # a config alone is not a model either
    with pytest.raises(ConfigError, match=f"no model files in {empty}"):
        _validate(["model.offline=null", f"model.name={empty}"], tmp_path / "run")


@pytest.mark.parametrize("overrides", [[], ["model=qwen3b", "model.offline=qwen3b"],
                                       ["~experiment", "data=atropos", "mode=lora_only"]])
def test_ordinary_configs_still_pass(tmp_path, overrides):
    _validate(overrides, tmp_path)


def test_request_timeout_is_settable_for_atropos(tmp_path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["data=atropos", "data.request_timeout_s=7.5"])
        default = compose(config_name="train", overrides=["data=atropos"])
    assert instantiate(cfg.data, _recursive_=False).request_timeout_s == 7.5
    assert instantiate(default.data, _recursive_=False).request_timeout_s == 60.0


@pytest.mark.parametrize(
    "override, needle",
    [("+optimzer.lr=1", "unknown config key optimzer"), ("model.name=/no/such/path", "model.name=/no/such/path was given"),
     # Hydra's own error listed the *_schema entries as options, with its search path and no suggestion.
     ("optimizer=adamW", "optimizer=adamW is not one of the optimizer options; did you mean optimizer=adamw? choose "
                         "one of adafactor, adamw, adamw_8bit")],
)
def test_cli_stops_before_any_model_loads(tmp_path, override, needle):
    out = subprocess.run([sys.executable, str(REPO / "train.py"), override, f"hydra.run.dir={tmp_path}/run"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode != 0
    assert needle in out.stderr
    assert "Traceback" not in out.stderr  # a config mistake prints its message, not the checks' stack
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "logs").exists()


def test_a_server_context_longer_than_the_models_stops_before_vllm_starts(tmp_path):
    """server=gpu's max_model_len (4096) with the tiny models (1024 positions): vLLM refused it only after its
    start-up, with a pydantic traceback in its log; the run now says which key to set before launching it."""
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "~experiment", "server.max_model_len=4096",
                          f"hydra.run.dir={tmp_path}/run"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode != 0
    assert "server.max_model_len=4096 exceeds the model's max_position_embeddings=1024" in out.stderr
    assert "set server.max_model_len=1024" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "logs" / "vllm.log").exists()


def test_a_sweep_skips_a_job_whose_config_is_wrong_and_goes_on(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "model.attn_implementation=flex_attention,bogus",
                          f"hydra.sweep.dir={tmp_path}/sweep"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "#1 : model.attn_implementation=bogus" in log  # launched after job 0 failed
    assert log.count("(this job is skipped; the sweep goes on)") == 2
    assert "model.attn_implementation=bogus is not one of" in log and "flex_attention needs a CUDA trainer" in log
    from grpo.report import report

    _, rows = report(tmp_path / "sweep")  # before, the report called both jobs "not started"
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    summary = json.loads((tmp_path / "sweep" / "1" / "summary.json").read_text())
    assert summary["error"].startswith("ConfigError: model.attn_implementation=bogus is not one of")


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["~experiment", "train.max_staleness=1", "data=atropos"], "set train.stale_policy=drop"),
        (["~experiment", "train.max_staleness=1", "data=atropos", "train.stale_policy=drop", "train.rollout_queue=2"],
         "has no effect with data=grpo.pipeline.atropos.AtroposPipeline"),
        (["train.max_staleness=1", "loss.old_logprobs=recompute"], "without loss.tis_cap would take pi_old"),
        (["train.max_staleness=-1"], "train.max_staleness must be >= 0"),
        (["train.max_staleness=2", "mode=lora_only"], "use train.max_staleness=1 with lora_only"),
        (["train.max_staleness=1", "train.stale_policy=drop", "train.rollout_queue=0"], "train.rollout_queue must be >= 1"),
        # Settings that were silently ignored (the run was synchronous, or waited with no queue to bound).
        (["train.stale_policy=drop"], "train.stale_policy=drop acts only with asynchronous rollouts"),
        (["train.rollout_queue=3"], "train.rollout_queue=3 acts only with asynchronous rollouts"),
        (["train.max_staleness=1", "train.rollout_queue=3"], "bounds the queue of stale_policy=drop only"),
        # Several batches in flight: more than the queue bound lets run ahead, or a source that generates on its own.
        (["train.rollout_batches_in_flight=2"], "train.rollout_batches_in_flight=2 acts only with asynchronous"),
        (["train.max_staleness=1", "train.rollout_batches_in_flight=3"], "at most 2 rollout batches may be generated"),
        (["train.max_staleness=2", "train.stale_policy=drop", "train.rollout_queue=1", "train.rollout_batches_in_flight=2"],
         "at most 1 rollout batches may be generated"),
        (["~experiment", "train.max_staleness=2", "data=atropos", "train.stale_policy=drop", "train.rollout_batches_in_flight=2"],
         "train.rollout_batches_in_flight=2 has no effect with data=grpo.pipeline.atropos.AtroposPipeline"),
    ],
)
def test_async_rollout_settings_are_checked(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as e:
        _validate(overrides, tmp_path)
    assert needle in str(e.value)


def test_async_rollouts_with_recompute_and_tis_cap_or_rollout_logprobs_pass(tmp_path):
    _validate(["train.max_staleness=2", "loss.old_logprobs=recompute", "loss.tis_cap=2.0"], tmp_path)
    _validate(["train.max_staleness=1", "train.stale_policy=drop"], tmp_path)
    _validate(["train.max_staleness=2", "train.rollout_batches_in_flight=2"], tmp_path)
    _validate(["train.max_staleness=1", "train.rollout_batches_in_flight=2"], tmp_path)  # one-step-off, two at once
    _validate(["train.max_staleness=1", "train.stale_policy=drop", "train.rollout_batches_in_flight=2"], tmp_path)
    # Atropos generates on its own: k drops its older groups.
    _validate(["~experiment", "train.max_staleness=2", "data=atropos", "train.stale_policy=drop"], tmp_path)


class ProducerReadySource(DataPipeline):
    """A user's own data source that declares it can be run ahead of the loop by the rollout producer."""

    supports_async_rollouts = True

    def setup(self, ctx):
        self.ctx = ctx

    def next_groups(self, step):
        return []


class OneAtATimeSource(ProducerReadySource):
    """The same source without the capability."""

    supports_async_rollouts = False


class FussySource(ProducerReadySource):
    """A source with a check of its own config, which validation runs before anything is built."""

    @classmethod
    def check_config(cls, cfg, ctx):
        super().check_config(cfg, ctx)
        if cfg.data.group_size < 4:
            raise ConfigError(f"data.group_size={cfg.data.group_size}: FussySource needs at least 4")


def test_a_data_source_gets_asynchronous_rollouts_by_declaring_it_not_by_its_class(tmp_path):
    # What the async-rollouts check reads is the source's capability, not whether it is a LocalRolloutPipeline.
    _validate(["train.max_staleness=1", f"data._target_={__name__}.ProducerReadySource"], tmp_path)
    with pytest.raises(ConfigError, match="is neither one nor an asynchronous source like data=atropos"):
        _validate(["train.max_staleness=1", f"data._target_={__name__}.OneAtATimeSource"], tmp_path)


def test_a_data_sources_own_config_check_runs_at_validation(tmp_path):
    with pytest.raises(ConfigError, match="FussySource needs at least 4"):
        _validate([f"data._target_={__name__}.FussySource", "data.group_size=2"], tmp_path)
    _validate([f"data._target_={__name__}.FussySource", "data.group_size=4"], tmp_path)


class StrictLoss(GRPOLoss):
    """A user's own loss with a start-up check of the run's config, beside its class."""

    @classmethod
    def check_config(cls, cfg, ctx):
        super().check_config(cfg, ctx)
        if cfg.train.ppo_epochs < 2:
            raise ConfigError(f"{ctx.key}._target_=StrictLoss needs train.ppo_epochs >= 2")


class TruncationReportingSource(ProducerReadySource):
    """A source of one's own that declares its groups say which completions hit the token limit."""

    reports_truncation = True


def test_a_losss_own_config_check_runs_at_validation_after_the_shipped_losss(tmp_path):
    with pytest.raises(ConfigError, match="loss._target_=StrictLoss needs train.ppo_epochs >= 2"):
        _validate([f"loss._target_={__name__}.StrictLoss"], tmp_path)
    # GRPOLoss's own checks (grpo.trainer.loss_checks) still run first for the subclass.
    with pytest.raises(ConfigError, match="the data source AtroposPipeline does not report which completions"):
        _validate(["~experiment", "data=atropos", f"loss._target_={__name__}.StrictLoss", "loss.mask_truncated=true"],
                  tmp_path)


def test_the_losss_truncation_check_reads_the_sources_declared_capability_not_its_class(tmp_path):
    _validate([f"data._target_={__name__}.TruncationReportingSource", "loss.mask_truncated=true"], tmp_path)
    with pytest.raises(ConfigError, match="the data source ProducerReadySource does not report which completions"):
        _validate([f"data._target_={__name__}.ProducerReadySource", "loss.mask_truncated=true"], tmp_path)


class PickyTask(Task):
    """A user's own task with a check of its config node."""

    @classmethod
    def check_config(cls, cfg, ctx):
        if ctx.node(cfg).get("level") is None:
            raise ConfigError(f"{ctx.key}.level is missing: PickyTask needs one")


def test_a_tasks_own_config_check_runs_at_validation_with_its_key(tmp_path):
    with pytest.raises(ConfigError, match="data.task.level is missing: PickyTask needs one"):
        _validate([f"data.task._target_={__name__}.PickyTask"], tmp_path)
    _validate([f"data.task._target_={__name__}.PickyTask", "+data.task.level=3"], tmp_path)
    with pytest.raises(ConfigError, match="eval.task.path=/no/such/held_out.jsonl: no file or directory there"):
        _validate(["+eval.task._target_=grpo.tasks.prompt_file.PromptFileTask", "+eval.task.path=/no/such/held_out.jsonl"],
                  tmp_path)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["loss.tis_cap=2.0"], "leave loss.tis_cap null"),
        (["train.max_staleness=1"], "use train.max_staleness=0"),
        (["mode.sync_every=2"], "use mode.sync_every=1"),
        (["train.ppo_epochs=2", "train.steps=4"], "set loss.old_logprobs=recompute"),
        (["loss.kl_coef=0.1"], "set loss.kl_coef=0"),
        (["mode=shared_vllm", "mode.in_flight_updates=true"], "set mode.in_flight_updates=false"),
    ],
)
def test_rollouts_without_log_probs_refuse_what_needs_them(tmp_path, overrides, needle):
    # Each of these would train with a ratio of exactly 1 (or a KL of 0) without a word.
    with pytest.raises(ConfigError) as e:
        _validate(["data.rollout_logprobs=false", *overrides], tmp_path)
    assert "data.rollout_logprobs=false trains each rollout as on-policy" in str(e.value) and needle in str(e.value)
    _validate(overrides, tmp_path)  # the same settings with the sampler's log-probs are fine


def test_rollouts_without_log_probs_pass_where_they_are_exact(tmp_path):
    _validate(["data.rollout_logprobs=false"], tmp_path)
    # Several updates per batch: exact with pi_old recomputed by the trainer.
    _validate(["data.rollout_logprobs=false", "train.ppo_epochs=2", "train.steps=4", "loss.old_logprobs=recompute"],
              tmp_path)


def test_worker_in_engine_process_needs_one_worker(tmp_path, monkeypatch):
    # conf/server/cpu.yaml turns it on; a tensor-parallel server needs vLLM's worker processes.
    with pytest.raises(ConfigError, match="set server.worker_in_engine_process=false"):
        _validate(["server.extra_args=[--tensor-parallel-size,2]"], tmp_path)
    _validate(["server.extra_args=[--tensor-parallel-size,2]", "server.worker_in_engine_process=false"], tmp_path)
    monkeypatch.setattr(sys.modules["grpo.config.validate"], "_cuda_available", lambda: True)  # server=gpu wants a GPU box
    _validate(["server=gpu", "server.extra_args=['-tp=2']"], tmp_path)  # off on a GPU box


def test_server_gpu_without_a_gpu_says_to_use_server_cpu(tmp_path, monkeypatch):
    """On a CPU-only machine vLLM would start on the CPU with the GPU settings and fail on one of them (the
    server's max_model_len of 4096 against the model's 1024 positions), in a pydantic error from its log."""
    monkeypatch.setattr(sys.modules["grpo.config.validate"], "_cuda_available", lambda: False)
    with pytest.raises(ConfigError, match="server=gpu runs the vLLM server on a CUDA GPU and none is visible here; "
                                          "use server=cpu"):
        _validate(["server=gpu"], tmp_path)
    _validate(["server=gpu", "server.external_url=http://127.0.0.1:9"], tmp_path)  # a GPU server elsewhere


def test_worker_in_engine_process_reaches_the_vllm_command_and_environment(tmp_path, monkeypatch):
    import os

    from conftest import server_cfg
    from grpo.inference.process import VLLMServer

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    one = VLLMServer(tmp_path, server_cfg(worker_in_engine_process=True), tmp_path / "a.log")
    assert one.command()[-2:] == ["--distributed-executor-backend", "uni"]
    assert one.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # All cores but one, as vLLM's worker process binds (unbound pools beside the trainer's spin on the same cores).
    assert one.environment()["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) - 1))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the caller's choice stands
    assert one.environment()["OMP_NUM_THREADS"] == "3"
    monkeypatch.delenv("OMP_NUM_THREADS")
    two = VLLMServer(tmp_path, server_cfg(worker_in_engine_process=False), tmp_path / "b.log")
    assert "--distributed-executor-backend" not in two.command()
    env = two.environment()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and "OMP_NUM_THREADS" not in env


def test_kv_cache_gb_sizes_the_kv_cache_in_bytes_or_leaves_it_to_the_memory_share(tmp_path):
    """The CPU engine sizes its KV cache from gpu_memory_utilization as a share of the first NUMA node minus the
    server's own memory, which depends on the machine; server.kv_cache_gb (server=cpu sets 1 GiB) fixes the size."""
    from conftest import server_cfg
    from grpo.inference.process import VLLMServer

    cmd = VLLMServer(tmp_path, server_cfg(kv_cache_gb=0.25), tmp_path / "a.log").command()
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(256 * 2**20)
    assert "--kv-cache-memory-bytes" not in VLLMServer(tmp_path, server_cfg(kv_cache_gb=None), tmp_path / "b.log").command()
    with pytest.raises(ConfigError, match="server.kv_cache_gb must be a positive number"):
        _validate(["server.kv_cache_gb=0"], tmp_path)
    _validate(["server.kv_cache_gb=null"], tmp_path)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.attn_implementation=flash"], "model.attn_implementation=flash is not one of sdpa, eager, varlen, flex_attention"),
        (["model.attn_implementation=flex_attention", "train.device=cpu"], "needs a CUDA trainer"),
    ],
)
def test_attention_kernel_is_checked(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        _validate(overrides + [f"hydra.run.dir={tmp_path}/run"], tmp_path / "run")
    _validate(["model.attn_implementation=eager", f"hydra.run.dir={tmp_path}/run2"], tmp_path / "run2")


def test_a_hub_model_out_of_reach_stops_at_once_with_what_to_do_instead(tmp_path, monkeypatch):
    """model=qwen3b names a hub id: with the hub unreachable (HF_ENDPOINT on a closed local port) and nothing cached,
    validation says so before the hub client's minute of retries, naming the offline presets."""
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=rf"the hub \(127.0.0.1:{port}\) cannot be reached") as e:
        _validate(["model=qwen3b", f"hydra.run.dir={tmp_path}/run"], tmp_path / "run")
    assert "model.name=Qwen/Qwen2.5-3B-Instruct" in str(e.value) and "qwen3b" in str(e.value).split("known shape")[1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache, and HF_HUB_OFFLINE=1"):
        _validate(["model=qwen3b", f"hydra.run.dir={tmp_path}/run"], tmp_path / "run")
    _validate(["model=qwen3b", "model.offline=qwen3b", f"hydra.run.dir={tmp_path}/run"], tmp_path / "run")


def test_a_local_pipeline_too_small_for_the_batch_stops_before_the_server(tmp_path):
    with pytest.raises(ConfigError, match=r"data.prompts_per_step x data.group_size = \d+ sequences per step, fewer "
                                          r"than the \d+ of train.micro_batch_size x train.grad_accum; raise"):
        _validate(["data.group_size=2", f"hydra.run.dir={tmp_path}/run"], tmp_path / "run")
    _validate(["data.group_size=2", "train.micro_batch_size=16", f"hydra.run.dir={tmp_path}/r2"],
              tmp_path / "r2")


def test_another_data_option_on_the_default_job_is_refused_naming_the_bare_config(tmp_path):
    """Issue 44.7: `python train.py data=atropos` ran under the default experiment (arith_quick): labelled arith_quick,
    with its warm-start model and settings, unless the user knew to write '~experiment'. (data=local_digits got a
    batch-size error that named the experiment.) `python train.py` itself composes as before."""
    for data in ("atropos", "local_digits"):
        with pytest.raises(ConfigError, match=re.escape(
                f"data={data} runs under experiment=arith_quick, which conf/train.yaml applies by default and which "
                f"was written for data=arithmetic (it sets its own name, model, batch and learning rate); for the bare "
                f"config with your data add '~experiment' (python train.py '~experiment' data={data} ...)")):
            _validate([f"data={data}", f"hydra.run.dir={tmp_path}/run"], tmp_path / "run")
    _validate(["~experiment", "data=atropos", f"hydra.run.dir={tmp_path}/r1"], tmp_path / "r1")
    _validate(["data=arithmetic", f"hydra.run.dir={tmp_path}/r2"], tmp_path / "r2")  # the experiment's own data
    _validate([f"hydra.run.dir={tmp_path}/r3"], tmp_path / "r3")  # the default run
    # An experiment named on the command line with other data is the user's own combination.
    with pytest.raises(ConfigError, match=re.escape("(experiment=arith_quick sets the batch for its own data; "
                                                    "'~experiment' gives the bare config)")):
        _validate(["experiment=arith_quick", "data=local_digits", f"hydra.run.dir={tmp_path}/r4"], tmp_path / "r4")


@pytest.mark.parametrize("override, needle", [
    # Every completion's advantage is its reward minus its group's mean: alone in its group, always 0.
    ("data.group_size=1", "data.group_size=1 gives every completion advantage 0"),
    # A task class that is not a Task died with AttributeError after vLLM's start-up.
    ("data.task._target_=collections.OrderedDict", "data.task (OrderedDict) has no sample(rng, n) method"),
])
def test_a_local_pipeline_that_cannot_train_stops_before_the_server(override, needle):
    from grpo.build import build_data  # train.py builds the data source before it starts the server

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["~experiment", override])
    with pytest.raises(ConfigError, match=re.escape(needle)):
        build_data(cfg)


def write_checkpoint(ckpt: Path, step: int) -> None:
    """A complete checkpoint of `step` as a resume's start-up checks see one: its files there and whole (no weights
    worth loading)."""
    import torch
    from safetensors.torch import save_file

    from grpo.trainer.checkpoint import COMPLETE

    ckpt.mkdir(parents=True)
    save_file({"w": torch.zeros(1)}, str(ckpt / "model.safetensors"))
    for name in ("optimizer.pt", "rng.pt"):
        torch.save({}, ckpt / name)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
    (ckpt / COMPLETE).write_text("")


def test_resuming_a_finished_run_says_how_to_go_on_instead_of_starting_a_server(tmp_path):
    ckpt = tmp_path / "old" / "checkpoints" / "step_000004"
    write_checkpoint(ckpt, 4)
    resume = f"train.resume={tmp_path / 'old'}"
    with pytest.raises(ConfigError, match=r"\(step_000004\) is at step 4, and train.steps=4, so there is nothing left "
                                          r"to train; to go on, raise train.steps \(e.g. train.steps=8"):
        _validate([resume, "train.steps=4", f"hydra.run.dir={tmp_path}/run"], tmp_path / "run")
    _validate([resume, "train.steps=6", f"hydra.run.dir={tmp_path}/run"], tmp_path / "run")  # steps 5-6 are left


def _build_loss(overrides: list[str]):
    """Compose as train.py does and build the run's loss as `build_parts` does (the one place it is built)."""
    from grpo.build import build_loss

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return build_loss(compose(config_name="train", overrides=overrides))


@pytest.mark.parametrize("override, needle", [
    ("loss.clip_eps=-0.1", "clip_eps must be in (0, 1], got -0.1"),
    ("loss.kl_coef=-1", "kl_coef must be >= 0, got -1"),
    ("loss.dual_clip=0.5", "dual_clip must be > 1, got 0.5"),
])
def test_a_bad_loss_setting_is_a_config_error_before_the_server_starts(override, needle):
    """The loss validates itself when built; the run builds it first thing (grpo.build.build_loss), so a sweep's bad
    value is a ConfigError naming it."""
    with pytest.raises(ConfigError, match="loss \\(grpo.trainer.loss.GRPOLoss\\): " + re.escape(needle)):
        _build_loss([override])


@pytest.mark.parametrize("overrides, needle", [
    (["loss.token_mask=[1.5,2.0]"], "loss (grpo.trainer.loss.GRPOLoss): loss.token_mask must be [low, high] with 0 < low < 1 < high"),
    (["loss.sequence_mask=[0.5]"], "loss (grpo.trainer.loss.GRPOLoss): loss.sequence_mask must be [low, high]"),
    (["loss=cispo", "loss.dual_clip=2.0"],
     "loss (grpo.trainer.loss.GRPOLoss): loss.dual_clip does not apply to loss.objective=cispo"),
])
def test_an_off_policy_band_or_a_cispo_dual_clip_is_refused_when_the_loss_is_built(overrides, needle):
    """The masks' bands and CISPO's refusal of a dual clip are checked when the loss is built."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        _build_loss(overrides)


@pytest.mark.parametrize("overrides, needle", [
    (["loss.token_mask=[0.5,2.0]", "data.rollout_logprobs=false"],
     "data.rollout_logprobs=false trains each rollout as on-policy, but loss.token_mask=[0.5, 2.0] mask tokens by "
     "pi_old / vLLM's sampling probability"),
    (["loss.sequence_mask=[0.9,1.1]", "train.ppo_epochs=2", "train.steps=4"],
     "loss.sequence_mask=[0.9, 1.1] with 2 updates per batch (train.ppo_epochs x train.mini_batches) and "
     "loss.old_logprobs=rollout would compare vLLM's log-probs with weights the batch's updates already moved"),
])
def test_an_off_policy_mask_that_cannot_work_is_refused_at_start_up(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        _validate(overrides, tmp_path)


def test_a_loss_error_that_says_what_to_set_gets_no_second_fix():
    """CISPO's refusal names its own fix ("set loss.dual_clip=null"); the generic "set the loss.* key it names" once
    followed it anyway. A cause without a fix (a bad clip range) still gets it."""
    with pytest.raises(ConfigError) as e:
        _build_loss(["loss=cispo", "loss.dual_clip=2.0"])
    assert str(e.value).endswith("set loss.dual_clip=null")
    with pytest.raises(ConfigError) as e:
        _build_loss(["loss.clip_eps=-0.1"])
    assert str(e.value).endswith("; set the loss.* key it names")


def test_dynamic_sampling_is_a_local_pipeline_setting_refused_for_atropos(tmp_path):
    """Issue 40: Atropos environments choose what they send; data=atropos has no dynamic_sampling key, so the override
    fails when the config is composed, naming it."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        _validate(["data=atropos", "data.dynamic_sampling=true"], tmp_path)
    assert "dynamic_sampling" in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize("overrides, needle", [
    (["optimizer.lr=-1"], "optimizer (torch.optim.AdamW): Invalid learning rate: -1.0"),
    (["optimizer.betas=[0.9,1.5]"], "optimizer (torch.optim.AdamW): Invalid beta parameter at index 1: 1.5"),
])
def test_a_setting_the_optimizer_refuses_is_a_config_error_before_the_model_loads(tmp_path, overrides, needle):
    """torch checks lr, betas, eps and weight decay only when the optimizer is built, after the model:
    check_optimizer_settings builds it on one parameter first (grpo.build.build_parts, while vLLM starts; validate
    leaves it out: the first optimizer built imports torch._dynamo, seconds before vLLM's launch)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
        validate(cfg, tmp_path)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        check_optimizer_settings(cfg)


@pytest.mark.parametrize("override, needle", [
    ("data.top_p=0", "ConfigError: data.top_p must be in (0, 1] (1 = the whole distribution), got 0.0"),
    ("data.temperature=-1", "ConfigError: data.temperature must be > 0 (the loss divides logits by it), got -1.0"),
])
def test_a_setting_the_data_pipeline_refuses_stops_the_run_with_its_message(tmp_path, override, needle):
    """The local pipeline checks its settings when built (before the server starts); train.py prints the message as a
    ConfigError instead of Hydra's InstantiationException traceback."""
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "~experiment", override, f"hydra.run.dir={run}"],
                         capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-2000:]
    assert needle in out.stderr and "Traceback" not in out.stderr
    assert not (run / "logs" / "vllm.log").exists()


@pytest.mark.parametrize("override, needle", [
    ("server.port=99999", "server.port=99999 is not a TCP port: use 1-65535, or null to pick a free one"),
    ("server.port=0", "server.port=0 is not a TCP port"),
])
def test_a_port_outside_the_tcp_range_is_a_config_error(tmp_path, override, needle):
    """Before, the free-port probe's bind raised OverflowError (a traceback)."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        _validate([override], tmp_path)


def test_a_port_held_by_the_server_a_sweeps_job_kept_is_no_config_error(tmp_path):
    """A sweep with a fixed server.port: the job before kept its server on that port (server.reuse_across_jobs), which
    this job's launch takes or stops; only a port held by anything else stops the job (it skipped every job after
    the first)."""
    from grpo.inference.process import VLLMServer
    from grpo.serving import kept

    with socket.socket() as listener:  # what listens there: the kept server's API process
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        overrides = ["~experiment", f"server.port={port}"]
        with pytest.raises(ConfigError, match=f"server.port={port} on 127.0.0.1 is already in use"):
            _validate(overrides, tmp_path / "a")
        kept.keep("the job before's", [VLLMServer(tmp_path, {"port": port}, tmp_path / "vllm.log")])
        try:
            _validate(overrides, tmp_path / "b")
        finally:
            kept.take(None)  # stops what is kept (a process never started: nothing to stop)


def test_a_mandatory_value_left_unset_is_named(tmp_path):
    """data=prompt_file without data.task.path: before, Hydra's MissingMandatoryValue inside two instantiation
    errors."""
    with pytest.raises(ConfigError, match=re.escape("data.task.path must be set (??? in the config, no default); add "
                                                    "data.task.path=... to the command line")):
        _validate(["~experiment", "data=prompt_file"], tmp_path)


def test_a_fresh_run_into_a_run_dir_holding_a_run_stops_instead_of_overwriting_it(tmp_path):
    """Before, a second `python train.py hydra.run.dir=X` truncated X's metrics.jsonl and replaced its checkpoints."""
    run = tmp_path / "run"
    _validate([f"hydra.run.dir={run}"], run)  # a new (or empty) dir is fine
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    # No checkpoint (a run stopped before its first one): train.resume would refuse it, so it is not offered.
    with pytest.raises(ConfigError, match=re.escape(f"run dir {run} already holds a run (metrics.jsonl with rows), "
                                                    "which this run would overwrite; it has no checkpoint to continue "
                                                    "from; start a new one in another dir")):
        _validate([f"hydra.run.dir={run}"], run)
    ckpt = run / "checkpoints" / "step_000004"
    write_checkpoint(ckpt, 4)
    with pytest.raises(ConfigError, match=re.escape(f"(metrics.jsonl with rows, checkpoints up to step_000004), which "
                                                    f"this run would overwrite; continue that run with "
                                                    f"train.resume={run}, or start a new one in another dir")):
        _validate([f"hydra.run.dir={run}"], run)
    _validate([f"train.resume={run}", "train.steps=6", f"hydra.run.dir={run}"], run)  # continuing it is fine
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=f"run dir {other} already holds a run"):  # ... but not into another run's
        _validate([f"train.resume={run}", "train.steps=6", f"hydra.run.dir={other}"], other)


def test_a_sweep_option_without_multirun_is_refused_not_run_as_one_job(tmp_path):
    """Before, `python train.py sweep=lr` ran one job at the default lr: the sweep silently ignored."""
    with pytest.raises(ConfigError, match=re.escape("sweep=lr sets the values a sweep runs over, and without -m Hydra "
                                                    "runs one job with none of them; add -m (python train.py -m sweep=lr")):
        _validate(["sweep=lr"], tmp_path)
    _validate(["hydra.mode=MULTIRUN", "sweep=lr"], tmp_path)  # a sweep's job


def test_a_resume_dir_without_a_checkpoint_says_what_to_give_instead(tmp_path):
    """Before, each failed in the run with a FileNotFoundError traceback ("has no complete checkpoint"), and a
    checkpoint given as train.resume got the run's .hydra/, train.log and summary.json written into it."""
    run = tmp_path / "old"
    ckpt = run / "checkpoints" / "step_000004"
    write_checkpoint(ckpt, 4)
    for given in (ckpt, run / "checkpoints"):
        with pytest.raises(ConfigError, match=re.escape(f"train.resume={given} is inside a run's checkpoints/; "
                                                        f"train.resume takes the run dir, and the run goes on from "
                                                        f"its latest complete checkpoint: train.resume={run}")):
            _validate([f"train.resume={given}", "train.steps=8", f"hydra.run.dir={tmp_path}/run"], tmp_path / "run")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=re.escape(f"train.resume={empty} has no complete checkpoint under "
                                                    "checkpoints/ (one is written every train.checkpoint_every steps")):
        _validate([f"train.resume={empty}", f"hydra.run.dir={tmp_path}/run"], tmp_path / "run")


def test_sweep_optuna_without_its_plugin_says_what_to_install(tmp_path):
    """Before, Hydra stopped with "Could not find 'hydra/sweeper/optuna'", which names no package."""
    import importlib.util

    if importlib.util.find_spec("hydra_plugins") and importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper"):
        pytest.skip("the Optuna sweeper is installed here")
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "sweep=optuna", f"hydra.sweep.dir={tmp_path}"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 1
    assert ('ConfigError: sweep=optuna needs Hydra\'s hydra-optuna-sweeper plugin, which is not installed: '
            'pip install -e ".[sweep]"') in out.stderr
    assert "Could not find" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("override", ["lora.r=8", "lora=all_linear"])
def test_lora_settings_with_a_full_fine_tuning_mode_are_refused_not_ignored(tmp_path, override):
    """Before, `python train.py lora.r=8` (mode=none) trained every weight and ignored the setting."""
    with pytest.raises(ConfigError, match=re.escape(f"{override} sets the LoRA adapter, but mode=none trains the full "
                                                    "weights (no adapter) and would ignore it; for an adapter pick "
                                                    "mode=lora_only")):
        _validate([override], tmp_path)
    _validate(["mode=lora_only", override], tmp_path)
    _validate(["hydra.mode=MULTIRUN", override], tmp_path)  # a sweep's common setting, e.g. over mode=none,lora_only


@pytest.mark.parametrize("override, needle", [
    ("train.checkpoint_every=0", "train.checkpoint_every must be >= 1, got 0"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints must be >= 1, got 0"),
    ("train.logprob_chunk=0", "train.logprob_chunk must be >= 1, got 0"),
    ("train.max_nonfinite_steps=0", "train.max_nonfinite_steps must be >= 1, got 0"),
    ("train.warmup_steps=-1", "train.warmup_steps must be >= 0, got -1"),
    ("train.max_grad_norm=0", "train.max_grad_norm must be > 0, or null for no gradient clipping; got 0.0"),
    ("train.torch_threads=0", "train.torch_threads must be >= 1, or null for torch's default (one per core); got 0"),
])
def test_loop_counts_out_of_range_are_config_errors_before_the_server_starts(tmp_path, override, needle):
    """Before, each passed start-up and failed in the run (checkpoint_every=0: ZeroDivisionError after the first
    step, before its checkpoint; warmup_steps=-1: the scheduler's ValueError after the server's start-up)."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        _validate([override], tmp_path)


@pytest.mark.parametrize("key", ["micro_batch_size", "grad_accum", "steps", "ppo_epochs", "mini_batches"])
def test_a_loop_size_below_one_is_refused_naming_its_own_key(tmp_path, key):
    """Issue 62.16: train.steps=-3 said "train.micro_batch_size, train.grad_accum and train.steps must all be >= 1"."""
    with pytest.raises(ConfigError) as refused:
        _validate([f"train.{key}=-3"], tmp_path)
    assert str(refused.value) == f"train.{key} must be >= 1, got -3"


def test_a_missing_held_out_prompt_file_is_named_by_its_key(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "2+2="}\n')
    with pytest.raises(ConfigError, match=re.escape(f"data.task.eval_path={tmp_path}/held_out.jsonl: no file or")):
        _validate(["~experiment", "data=prompt_file", f"data.task.path={prompts}",
                   f"data.task.eval_path={tmp_path}/held_out.jsonl"], tmp_path / "run")


def test_an_unknown_offline_preset_is_a_config_error_naming_the_nearest(tmp_path):
    """Before, model.offline=tiny_qwen2 (the model option's spelling) passed start-up and was the model builder's
    ValueError traceback, whose list of presets left out warm-arith."""
    with pytest.raises(ConfigError, match=re.escape("model.offline=tiny_qwen2 is not an offline model preset (those "
                                                    "are tiny-llama, tiny-qwen2, hermes8b, qwen14b, qwen3b, "
                                                    "smollm2-135m-warm-calc, warm-arith, warm-calc, smollm2-135m)"
                                                    "; did you mean model.offline=tiny-qwen2?")):
        _validate(["~experiment", "model.offline=tiny_qwen2"], tmp_path)
    with pytest.raises(ConfigError, match=re.escape("did you mean model.offline=warm-arith?")):
        _validate(["model.offline=warm_arith"], tmp_path)
    with pytest.raises(ConfigError, match=re.escape("did you mean model.offline=smollm2-135m?")):
        _validate(["model.offline=smollm2_135m"], tmp_path)
    _validate(["model.offline=warm-arith"], tmp_path)
    _validate(["~experiment", "model.offline=tiny-llama"], tmp_path)


def test_a_local_model_whose_block_count_differs_from_model_num_layers_is_refused(tmp_path):
    """Before, model.name=<a 6-block model> with model.num_layers left at 4 trained blocks 0-3 only under layers=all
    (embeddings and head frozen too), silently."""
    model = tmp_path / "my_model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6}))
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=re.escape(f"model.num_layers=4, but {model / 'config.json'} says the model "
                                                    "has 6 blocks; set model.num_layers=6")):
        _validate(["model.offline=null", f"model.name={model}"], tmp_path / "run")
    _validate(["model.offline=null", f"model.name={model}", "model.num_layers=6"], tmp_path / "run")


def test_a_completion_cap_beyond_the_sequence_length_is_refused_not_cut(tmp_path):
    """Before, data.max_new_tokens=500 with model.max_seq_len=64 ran with completions cut to fit, silently."""
    with pytest.raises(ConfigError, match=re.escape("data.max_new_tokens=500 cannot be reached: model.max_seq_len=64 "
                                                    "bounds prompt + completion")):
        _validate(["~experiment", "data.max_new_tokens=500", "model.max_seq_len=64"], tmp_path)
    with pytest.raises(ConfigError, match=re.escape("eval.max_new_tokens=64 cannot be reached")):
        _validate(["~experiment", "eval.max_new_tokens=64", "model.max_seq_len=64"], tmp_path)
    _validate(["~experiment", "data.max_new_tokens=32", "model.max_seq_len=64"], tmp_path)
    # vLLM's own bound: server.max_model_len=16 ran data.max_new_tokens=16 at 8 tokens, silently.
    with pytest.raises(ConfigError, match=re.escape("data.max_new_tokens=16 cannot be reached: server.max_model_len=16")):
        _validate(["~experiment", "data.max_new_tokens=16", "server.max_model_len=16"], tmp_path)


def test_a_group_option_typo_is_named_with_the_nearest_option(tmp_path):
    """Options come from every config dir's group folder (--config-dir adds experiments); comma lists (a sweep) are
    checked one by one; keys that are not groups, and a sweep's function syntax, pass through."""
    from grpo.config.command_line import check_group_option_names

    mine = tmp_path / "conf"
    (mine / "experiment").mkdir(parents=True)
    (mine / "experiment" / "my_task.yaml").write_text("")
    dirs = [CONFIG_DIR, mine]
    check_group_option_names(["experiment=my_task", "-m", "loss=grpo,dapo", "data.task.path=x", "--config-dir",
                              str(mine), "optimizer.lr=interval(1e-4, 1e-3)", "layers=choice(all,top25)"], dirs)
    with pytest.raises(ConfigError, match="experiment=my_tsk is not one of the experiment options; did you mean "
                                          "experiment=my_task?"):
        check_group_option_names(["experiment=my_tsk"], dirs)
    with pytest.raises(ConfigError, match="loss=dapo2 is not one of the loss options"):
        check_group_option_names(["loss=grpo,dapo2"], dirs)


def test_an_option_of_a_config_dir_left_out_names_the_config_dir_to_add(tmp_path, monkeypatch):
    """`python train.py experiment=my_task` (the README's own task, without its --config-dir) listed the shipped
    experiments only: nothing said that my_task is in examples/my_task/conf or that --config-dir adds it."""
    from grpo.config.command_line import check_group_option_names

    (tmp_path / "examples" / "my_task" / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "examples" / "my_task" / "conf" / "experiment" / "my_task.yaml").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(
            "experiment=my_task is not one of the experiment options; examples/my_task/conf/experiment/my_task.yaml "
            "has it, but the config is not searched there: add --config-dir examples/my_task/conf; otherwise choose")):
        check_group_option_names(["experiment=my_task"], [CONFIG_DIR])
    check_group_option_names(["experiment=my_task", "--config-dir", "examples/my_task/conf"],
                             [CONFIG_DIR, Path("examples/my_task/conf")])


def test_a_refused_run_leaves_the_held_runs_hydra_record_as_it_was(tmp_path):
    """The run-dir check runs as a Hydra callback before the job starts: before, the refused command's config and
    overrides had already replaced the earlier run's .hydra/ (what `--config-path <run>/.hydra` reruns)."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("the earlier run's config\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "~experiment", f"hydra.run.dir={run}"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 1 and f"ConfigError: run dir {run} already holds a run" in out.stderr, out.stderr[-2000:]
    assert (run / ".hydra" / "config.yaml").read_text() == "the earlier run's config\n"
    assert sorted(p.name for p in run.iterdir()) == [".hydra", "metrics.jsonl"]  # no train.log, no overrides.yaml


def test_a_checkpoint_given_as_train_resume_gets_nothing_written_into_it(tmp_path):
    """A resume's default run dir is train.resume: before, a checkpoint dir given there got Hydra's .hydra/ and
    train.log (then provenance.json and summary.json) written into it."""
    from grpo.trainer.checkpoint import COMPLETE

    ckpt = tmp_path / "old" / "checkpoints" / "step_000004"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 4}))
    (ckpt / COMPLETE).write_text("")
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "~experiment", f"train.resume={ckpt}"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 1 and "train.resume takes the run dir" in out.stderr, out.stderr[-2000:]
    assert sorted(p.name for p in ckpt.iterdir()) == [COMPLETE, "trainer_state.json"]


def test_a_resume_path_that_does_not_exist_is_refused_before_hydra_creates_it(tmp_path):
    """A resume's default run dir is train.resume: before, a mistyped path, or a checkpoint that the run had since
    pruned (train.keep_checkpoints), was created with .hydra/, train.log and .grpo.lock in it, and then refused as
    having 'no complete checkpoint under checkpoints/'."""
    run = tmp_path / "old"
    (run / "checkpoints" / "step_000040").mkdir(parents=True)
    pruned = run / "checkpoints" / "step_000004"
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "~experiment", f"train.resume={pruned}"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert (f"ConfigError: train.resume={pruned} does not exist (a run keeps only its last train.keep_checkpoints "
            f"checkpoints); train.resume takes the run dir, and the run goes on from its latest complete checkpoint: "
            f"train.resume={run}") in out.stderr, out.stderr[-2000:]
    assert not pruned.exists()
    typo = tmp_path / "no_such_run"
    with pytest.raises(ConfigError, match=re.escape(f"train.resume={typo} does not exist; give the run dir")):
        _validate([f"train.resume={typo}", f"hydra.run.dir={tmp_path}/run"], tmp_path / "run")


@pytest.mark.parametrize("mode", ["none", "lora_only", "lora_restart"])
def test_sync_every_below_1_is_a_config_error_of_the_mode(tmp_path, mode):
    """mode.sync_every=0 was the strategy constructor's ValueError inside Hydra's 'Error executing job ... Error in
    call to target' block, after the run's start-up lines; it is the mode's start-up check."""
    with pytest.raises(ConfigError, match=r"mode.sync_every must be >= 1 .* got 0"):
        _validate(["~experiment", f"mode={mode}", "mode.sync_every=0"], tmp_path)
    _validate(["~experiment", f"mode={mode}", "mode.sync_every=2"], tmp_path)


def test_a_misspelt_key_is_named_with_the_nearest_key_before_hydra_composes(tmp_path):
    """Hydra's own error for `optimzer.lr=1` ("Could not override ... To append to your config use +optimzer.lr=1")
    advised the `+` form, which adds a key nothing reads; the check says which key was meant."""
    from grpo.config.command_line import check_group_option_names

    mine = tmp_path / "conf"
    (mine / "mygroup").mkdir(parents=True)
    dirs = [CONFIG_DIR, mine]
    for arg, where, fix in [("optimzer.lr=1", "optimzer", "optimizer.lr=1"), ("train.stepz=3", "train.stepz", "train.steps=3"),
                            ("server.prot=9000", "server.prot", "server.port=9000"), ("nme=x", "nme", "name=x"),
                            ("logging.tensorbord=true", "logging.tensorbord", "logging.tensorboard=true"),
                            # Hydra advised +eval.evry=2: eval's options all build on EvalConfig, typed Any at the root
                            ("eval.evry=2", "eval.evry", "eval.every=2")]:
        with pytest.raises(ConfigError, match=re.escape(f"{arg}: the config has no key {where}; did you mean {fix}?")):
            check_group_option_names([arg], dirs)
    # Real keys, keys under a node whose schema depends on the option (optimizer, data, ...), Hydra's own keys, a
    # group of your config dir, +/~ forms (checked after composing) and a sweep's values pass through.
    check_group_option_names(["-m", "train.steps=3,6", "loss.clip_eps=0.1", "optimizer.betas=[0.9,0.99]",
                              "data.task.path=x", "mode.sync_every=2", "hydra.run.dir=/x", "hydra/launcher=basic",
                              "mygroup.key=1", "+optimzer.lr=1", "~experiment", "--cfg", "job", "name=x",
                              "eval.every=2", "eval.task._target_=x"], dirs)
    # A config dir of the user's with eval options of its own (another evaluator's keys): left to Hydra.
    (mine / "eval").mkdir()
    check_group_option_names(["eval.evry=2"], dirs)


def test_a_group_the_defaults_choose_given_with_plus_says_to_drop_the_plus(tmp_path):
    """`+experiment=cpu_tiny_none` (the form other Hydra projects use for experiments) got Hydra's "Multiple values
    for experiment. To override a value use 'override experiment: cpu_tiny_none'", YAML syntax for a command line."""
    from grpo.config.command_line import check_group_option_names

    mine = tmp_path / "conf"
    (mine / "mygroup").mkdir(parents=True)
    (mine / "mygroup" / "x.yaml").write_text("{}\n")
    dirs = [CONFIG_DIR, mine]
    for arg, fix in [("+experiment=cpu_tiny_none", "experiment=cpu_tiny_none"), ("+sweep=lr", "sweep=lr"),
                     ("+model=tiny_llama", "model=tiny_llama")]:
        with pytest.raises(ConfigError, match=re.escape(f"{arg}: the config's defaults (conf/train.yaml) already "
                                                        f"choose an option of {fix.split('=')[0]}") + ".*"
                                              + re.escape(f"pick this one without the +: {fix}")):
            check_group_option_names([arg], dirs)
    check_group_option_names(["+mygroup=x", "experiment=cpu_tiny_none", "+optimzer.lr=1"], dirs)  # a group to add


def test_a_memory_share_that_vllm_would_ignore_is_refused(tmp_path):
    """Before, server.gpu_memory_utilization=0.3 on server=cpu (the Atropos trainer's --gpu-memory-utilization) was
    passed to vLLM beside server.kv_cache_gb's --kv-cache-memory-bytes, which makes vLLM ignore it: silently."""
    with pytest.raises(ConfigError, match=re.escape("server.gpu_memory_utilization=0.3 would be ignored: "
                                                    "server.kv_cache_gb=1.0 sizes vLLM's KV cache")):
        _validate(["server.gpu_memory_utilization=0.3"], tmp_path)
    _validate(["server.gpu_memory_utilization=0.3", "server.kv_cache_gb=null"], tmp_path)
    _validate(["hydra.mode=MULTIRUN", "server.gpu_memory_utilization=0.3"], tmp_path)  # a sweep's common setting


@pytest.mark.parametrize("override, needle", [
    ("mode=lora_restart", "mode=lora_restart restarts the vLLM server at every sync, so it cannot use a server started "
                          "elsewhere (server.external_url=http://127.0.0.1:9); use mode=lora_only"),
    ("mode.reload=restart", "mode.reload=restart restarts the vLLM server at every sync, so it cannot use a server "
                            "started elsewhere (server.external_url=http://127.0.0.1:9); use mode.reload=inplace"),
])
def test_a_mode_that_restarts_the_server_refuses_an_external_one(tmp_path, override, needle):
    """Before, mode=lora_restart with server.external_url was a RuntimeError traceback once the model was built, and
    mode.reload=restart one at the first sync, after a step had trained."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        _validate(["~experiment", override, "server.external_url=http://127.0.0.1:9"], tmp_path)
    _validate(["~experiment", "mode=lora_only", "server.external_url=http://127.0.0.1:9"], tmp_path)


def test_a_clip_range_that_cannot_bind_is_refused_not_ignored(tmp_path, caplog):
    """Before, `python train.py loss.clip_eps=0.1` and `loss.clip_eps=0.3` trained alike (measured: the same rewards
    and losses): with one update per rollout batch at the weights that sampled it the ratio is 1 and the clip never
    binds. The README's sweep example varied it so, over 12 jobs."""
    for exact in (["data.rollout_logprobs=false"], ["loss.old_logprobs=recompute"], ["loss.tis_cap=2.0"]):
        with pytest.raises(ConfigError, match=re.escape("loss.clip_eps=0.1: each rollout batch gets one optimizer "
                                                        "step, at the weights that sampled it")) as e:
            _validate([*exact, "loss.clip_eps=0.1"], tmp_path)
        assert "the ratio the clip sees is exactly 1 here" in str(e.value)
    # The default pi_old is vLLM's: the clip sees the trainer/sampler mismatch (a few percent in bf16), so it may bind.
    with caplog.at_level("WARNING", logger="grpo.config.checks"):
        _validate(["loss.clip_eps=0.1"], tmp_path)
    assert "the clip sees only the trainer/vLLM numerical mismatch" in caplog.text
    caplog.clear()
    for moving in (["train.ppo_epochs=2"], ["train.max_staleness=1"], ["mode.sync_every=2"],
                   ["~experiment", "data=atropos"], ["hydra.mode=MULTIRUN"]):
        with caplog.at_level("WARNING", logger="grpo.config.checks"):
            _validate([*moving, "loss.clip_eps=0.1"], tmp_path)
    assert "numerical mismatch" not in caplog.text


def test_a_grad_accum_that_local_data_would_ignore_is_refused(tmp_path):
    """Before, `python train.py train.grad_accum=1` (the Atropos trainer's --gradient-accumulation-steps) trained as
    grad_accum=2 did: the local pipeline's 128 sequences per step, in 2 micro-batches of 64 (measured:
    batch/micro_batches 2, data/sequences 128), silently."""
    with pytest.raises(ConfigError, match=re.escape(
            "train.grad_accum=1 would be ignored: each step trains all 128 sequences the data generates "
            "(data.prompts_per_step x data.group_size), in micro-batches of train.micro_batch_size=64 (2 of them)")):
        _validate(["train.grad_accum=1"], tmp_path)
    _validate(["train.grad_accum=2"], tmp_path)
    _validate(["train.micro_batch_size=32", "train.grad_accum=4"], tmp_path)
    _validate(["~experiment", "data=atropos", "train.grad_accum=1"], tmp_path)  # run-api packs that many sequences
    _validate(["hydra.mode=MULTIRUN", "train.grad_accum=1"], tmp_path)
    # A data source whose module does not import is left to its build, which names the package to install.
    _validate(["~experiment", "data=atropos", "data._target_=no.such.Pipeline", "train.grad_accum=1"], tmp_path)


def test_a_grad_accum_from_the_config_that_local_data_ignores_is_warned_about(tmp_path, caplog):
    """An experiment's own train.grad_accum, outgrown by a larger data.group_size on the command line, once ran
    without a word (256 sequences a step against the experiment's 64 x 2): the run goes on, and says so."""
    with caplog.at_level("WARNING", logger="grpo.config.checks"):
        _validate(["data.group_size=16"], tmp_path)
    assert ("train.grad_accum=2 (from the config) has no effect: each step trains all 256 sequences the data "
            "generates (data.prompts_per_step x data.group_size), in micro-batches of train.micro_batch_size=64 "
            "(4 of them), not 64 x 2 = 128") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo.config.checks"):
        _validate([], tmp_path)
    assert "grad_accum" not in caplog.text


def test_eval_settings_of_a_run_that_does_not_evaluate_are_refused(tmp_path):
    """Before, `data=atropos eval.every=5` (no eval.task: the evaluator is never built) and `eval=off eval.k=2` ran
    without an evaluation and said nothing of the setting."""
    with pytest.raises(ConfigError, match=re.escape("eval.every=5 would be ignored: this run does not evaluate, as "
                                                    "the training data (data=atropos) has no task to evaluate; to "
                                                    "evaluate name one: +eval.task._target_=")):
        _validate(["~experiment", "data=atropos", "eval.every=5"], tmp_path)
    with pytest.raises(ConfigError, match=re.escape("eval.k=2 would be ignored: this run does not evaluate, as "
                                                    "eval.enabled=false (eval=off)")):
        _validate(["eval=off", "eval.k=2"], tmp_path)
    _validate(["eval=off"], tmp_path)
    _validate(["eval.every=5"], tmp_path)
    _validate(["hydra.mode=MULTIRUN", "eval=off", "eval.every=5"], tmp_path)


def test_wandb_settings_without_wandb_logging_are_refused(tmp_path):
    """Before, `logging.wandb_project=myproj` (the Atropos trainer's --wandb-project) ran with W&B off, silently."""
    with pytest.raises(ConfigError, match=re.escape("logging.wandb_project=myproj would be ignored: W&B logging is "
                                                    "off; add logging.wandb=true")):
        _validate(["logging.wandb_project=myproj"], tmp_path)
    _validate(["logging.wandb=true", "logging.wandb_project=myproj"], tmp_path)


def test_a_value_of_the_wrong_type_is_a_config_error_not_hydras_merge_error(tmp_path):
    """Issue 44.16: `train.steps=many` printed Hydra's "Error merging override ... HYDRA_FULL_ERROR=1", not the
    `ConfigError:` form the README promises for exactly this example."""
    from conftest import REPO as repo

    out = subprocess.run([sys.executable, str(repo / "train.py"), "train.steps=many", f"hydra.run.dir={tmp_path}/run"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip() == ("ConfigError: train.steps=many: Value 'many' of type 'str' could not be converted to "
                                  "Integer (python train.py --cfg job prints every key and its value)")
    assert not (tmp_path / "run").exists()


def test_values_the_schema_takes_pass_the_type_check():
    from grpo.config.command_line import check_group_option_names

    with pytest.raises(ConfigError, match=r"model.max_seq_len=1.5: Value '1.5' of type 'float' could not be converted"):
        check_group_option_names(["model.max_seq_len=1.5"], [CONFIG_DIR])
    check_group_option_names(["train.steps=12", "train.resume=null", "server.port=null", "train.steps=3,6",
                              "train.steps=${train.checkpoint_every}", "layers.indices=0-3", "loss.clip_eps=0.1",
                              "train.advantage_norm=group", "name=my run"], [CONFIG_DIR])
    # A sweep's list is checked value by value: `-m train.steps=2,many` printed Hydra's raw merge error.
    with pytest.raises(ConfigError, match=r"^train.steps=many: Value 'many' of type 'str' could not be converted"):
        check_group_option_names(["train.steps=2,many"], [CONFIG_DIR])
    check_group_option_names(["train.steps=range(2,6,2)", "data.seeded_sampling=true,false", "loss.clip_eps=0.1,0.2",
                              "optimizer.lr=interval(1e-4,1e-3)"], [CONFIG_DIR])


@pytest.mark.parametrize("multirun", [False, True])
def test_a_run_dir_that_cannot_be_written_is_one_line_naming_it_and_the_error(tmp_path, multirun):
    """Issue 44.2: an unwritable run dir ended in Hydra's traceback ("ValueError: Unable to configure handler
    'file'"), the cause (PermissionError ... train.log) buried in it. Here the dir's parent is a file (root may write
    anywhere else)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    args = ["-m", "~experiment", "train.steps=1,2"] if multirun else ["~experiment"]
    out = subprocess.run([sys.executable, str(REPO / "train.py"), *args, f"{key}={blocker}/run"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr.strip() == (f"ConfigError: run dir {blocker}/run is not writable (NotADirectoryError: [Errno 20] "
                                  f"Not a directory: '{blocker}/run'); set {key} to a writable path"), out.stderr[-2000:]


@pytest.mark.parametrize("args, needle", [
    (["+optimzer.lr=1"], "unknown config key optimzer"),
    (["sweep=clip_eps"], "add -m"),
    (["data=prompt_file", "data.task.path=/no/such/prompts.jsonl"],
     "ConfigError: data.task.path=/no/such/prompts.jsonl: no file or directory there"),
    (["model.offline=null", "model.name=/no/such/model_dir"], "/no/such/model_dir"),
])
def test_a_start_up_mistake_leaves_no_run_dir_behind(tmp_path, args, needle):
    """Issue 44.15: each of these left a run dir (.hydra/, train.log), some with a summary.json saying `failed`."""
    run = tmp_path / "outputs" / "run"
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "~experiment", *args, f"hydra.run.dir={run}"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 1 and needle in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "outputs").exists(), sorted(p.name for p in run.iterdir())  # nor the parent it made
    assert "run dir" not in out.stdout + out.stderr  # issue 62.16: no log line names the dir that is discarded


def test_a_start_up_mistake_in_a_dir_that_existed_keeps_it_and_writes_no_summary(tmp_path):
    run = tmp_path / "mine"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "~experiment", "data=prompt_file",
                          "data.task.path=/no/such/prompts.jsonl", f"hydra.run.dir={run}"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert (run / "notes.txt").read_text() == "mine" and not (run / "summary.json").exists()
