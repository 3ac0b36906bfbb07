"""Every config composes, every _target_ resolves, and bad configs fail at composition with the key named."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_class
from omegaconf import OmegaConf

from grpo.conf import CONFIG_DIR, EXPERIMENTS_DIR
from grpo.config import ConfigError, register_configs, validate

REPO = Path(__file__).resolve().parents[1]
CONF = CONFIG_DIR
MODES = sorted(p.stem for p in (CONF / "mode").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
OPTIMIZERS = sorted(p.stem for p in (CONF / "optimizer").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml"))

register_configs()


def _compose(overrides: list[str]):
    GlobalHydra.instance().clear()
    # The bare config (~experiment) unless the test picks an experiment: the default job's arith_quick is tested
    # on its own (tests/test_config.py::test_the_default_job_is_the_arithmetic_experiment).
    if not any(o.startswith("experiment=") for o in overrides):
        overrides = ["~experiment", *overrides]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _targets(node, path=""):
    """Every (_target_ path, dotted key) in a config tree."""
    if OmegaConf.is_dict(node):
        for k, v in node.items_ex(resolve=False):
            if k == "_target_":
                yield v, path
            else:
                yield from _targets(v, f"{path}.{k}" if path else str(k))
    elif OmegaConf.is_list(node) and node._is_none() is False:  # noqa: SLF001 - a null list (server.devices) has no items
        for i, v in enumerate(node):
            yield from _targets(v, f"{path}[{i}]")


def test_groups_have_the_promised_options():
    assert set(MODES) == {"none", "lora_only", "lora_restart", "shared_vllm", "broadcast"}
    assert {"hermes8b", "qwen14b", "qwen3b", "tiny_qwen2", "tiny_llama"} <= set(MODELS)
    assert set(OPTIMIZERS) == {"adamw", "adamw_8bit", "adafactor"}
    assert len(EXPERIMENTS) >= 4


@pytest.mark.parametrize("mode,model,optimizer", list(itertools.product(MODES, MODELS, OPTIMIZERS)))
def test_every_combination_composes_and_targets_resolve(mode, model, optimizer):
    cfg = _compose([f"mode={mode}", f"model={model}", f"optimizer={optimizer}"])
    OmegaConf.resolve(cfg)
    assert cfg.optimizer._target_.split(".")[0] in {"torch", "bitsandbytes", "transformers"}
    targets = list(_targets(cfg))
    assert {p for _, p in targets} >= {"mode", "loss", "optimizer", "data"}
    for target, _ in targets:
        get_class(target)  # raises if the module or class does not exist


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes(name):
    cfg = _compose([f"experiment={name}"])
    OmegaConf.resolve(cfg)
    for target, _ in _targets(cfg):
        get_class(target)
    # Experiments are meant to differ from the defaults in at least one place.
    assert cfg != _compose([])


def test_the_default_job_is_the_arithmetic_experiment(tmp_path):
    """`python train.py` with no overrides runs experiment arith_quick: the warm-started model on the skill task,
    judged by held-out accuracy (README, "What the default job shows"); ~experiment gives the bare digits config."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train")
    assert (cfg.name, cfg.model.offline, cfg.data.task._target_) == (
        "arith_quick", "warm-arith", "grpo.tasks.arithmetic.ArithmeticTask")
    assert (cfg.train.steps, cfg.eval.every, cfg.optimizer.lr) == (60, 10, 1e-4)
    validate(cfg, tmp_path / "run")
    bare = _compose([])
    assert (bare.model.name, bare.data.task._target_) == ("tiny-qwen2", "grpo.tasks.prompts.DigitsTask")


GROUP_OPTIONS = [(group, p.stem) for group in ("mode", "model", "optimizer", "loss", "data", "eval", "layers", "lora",
                                                 "server") for p in sorted((CONF / group).glob("*.yaml"))]


@pytest.mark.parametrize("group,option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option_composes_on_top_of_the_default_job(group, option):
    """`python train.py <group>=<option>` keeps the default job's experiment (arith_quick): none of its keys may be
    missing from another option (e.g. optimizer.betas under adafactor)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"{group}={option}"])
    assert cfg.name == "arith_quick"


def test_each_experiment_names_its_run_dirs_after_itself():
    """Issue 62.20: every run dir was `<time>_<model>_<mode>`, so jobs of different experiments all read
    `..._warm_arith_none`. Now `<time>_<name>`: each experiment's own name (name=... overrides it), `grpo` bare."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    for path in sorted(EXPERIMENTS_DIR.glob("*.yaml")):  # each one's own: no two experiments' dirs alike
        assert OmegaConf.load(path).get("name") == path.stem, path.name
    cases = [(["experiment=cpu_tiny_none"], "cpu_tiny_none"), (["~experiment"], "grpo"), (["name=mine"], "mine")]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for overrides, name in cases:
            cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            run_dir = Path(OmegaConf.select(cfg, "hydra.run.dir"))
            assert run_dir.parent.parent.name == "outputs" and run_dir.name.split("_", 1)[1] == name, (overrides, run_dir)


def test_user_facing_keys_exist():
    cfg = _compose(["optimizer.lr=3e-4", "loss.clip_eps=0.3", "layers=top25", "train.steps=7"])
    assert (cfg.optimizer.lr, cfg.loss.clip_eps, cfg.layers.indices, cfg.train.steps) == (3e-4, 0.3, "top25", 7)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("optimzer.lr=1", "optimzer"),  # misspelled group
        ("optimizer.lrr=1", "lrr"),  # misspelled key
        ("train.steps=many", "steps"),  # wrong type
        ("optimizer=sgd", "sgd"),  # unknown group option
        ("loss.clip_eps=abc", "clip_eps"),
    ],
)
def test_bad_overrides_fail_at_composition(override, needle):
    with pytest.raises(Exception) as info:
        _compose([override])
    assert needle in str(info.value)


def test_layer_indices_out_of_range_fail_before_model_load(tmp_path):
    cfg = _compose(["layers.indices=0-9"])
    with pytest.raises(ConfigError, match="4"):  # the tiny model has 4 blocks
        validate(cfg, tmp_path)


def test_shared_vllm_composes_without_cuda_but_not_with_vllm_parallelism(tmp_path):
    # vLLM's CPU backend shares its weights through a file mapping (tests/test_sync_modes.py runs it).
    validate(_compose(["mode=shared_vllm"]), tmp_path)
    with pytest.raises(ConfigError, match="tensor parallel 2"):
        validate(_compose(["mode=shared_vllm", "server.extra_args=[--tensor-parallel-size,2]"]), tmp_path)


def test_busy_port_fails_clearly(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"server.port={port}"):
            validate(_compose([f"server.port={port}"]), tmp_path)


def test_missing_model_path_fails_clearly(tmp_path):
    cfg = _compose(["model.offline=null", f"model.name={tmp_path}/nope"])
    with pytest.raises(ConfigError, match="does not exist"):
        validate(cfg, tmp_path)


def test_unsupported_lora_rank_fails_clearly(tmp_path):
    with pytest.raises(ConfigError, match="lora.r=12"):
        validate(_compose(["mode=lora_only", "lora.r=12"]), tmp_path)


@pytest.mark.parametrize("mode", ["lora_only", "lora_restart"])
def test_lora_on_gpu_refuses_float32_server(mode):
    """vLLM's GPU LoRA kernels assert fp16/bf16 (seen on an H100: the engine died at start-up); the CPU engine's do not."""
    from hydra.utils import get_class

    cfg = _compose([f"mode={mode}", "server.dtype=float32"])
    sync_cls = get_class(cfg.mode._target_)
    with pytest.raises(ConfigError, match="server.dtype=bfloat16"):
        sync_cls.check_config(cfg, cuda=True)
    sync_cls.check_config(cfg, cuda=False)
    sync_cls.check_config(_compose([f"mode={mode}", "server.dtype=bfloat16"]), cuda=True)


def test_unwritable_run_dir_fails_clearly(tmp_path):
    # A path under a regular file is unwritable for every user, root included.
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="not writable"):
        validate(_compose([]), blocker / "run")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_cli_help_lists_groups():
    out = _cli("--help")
    assert out.returncode == 0
    for group in ("mode", "model", "optimizer", "loss", "data", "layers", "experiment"):
        assert f"{group}:" in out.stdout
    for option in ("shared_vllm", "lora_only", "lora_restart", "hermes8b", "qwen14b", "qwen3b", "adamw_8bit", "adafactor"):
        assert option in out.stdout


def test_cli_cfg_job_prints_config():
    out = _cli("--cfg", "job", "mode=lora_only", "model=qwen3b", "optimizer=adafactor")
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.optimizer._target_ == "transformers.optimization.Adafactor"
    assert cfg.model.name == "Qwen/Qwen2.5-3B-Instruct"


def test_cli_unknown_key_fails_before_loading(tmp_path):
    out = _cli("optimzer.lr=1", f"hydra.run.dir={tmp_path}/run")
    assert out.returncode != 0
    assert "optimzer" in out.stderr
    # Nothing was trained: the run dir holds no metrics or checkpoints.
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_loss_option_is_grpo_with_what_differs():
    """conf/loss/dapo.yaml, dr_grpo.yaml, gspo.yaml and cispo.yaml build on grpo.yaml (`defaults: [grpo]`) and list only what differs: the
    composed loss is grpo's with those keys changed, and the files hold nothing else."""
    base = OmegaConf.to_container(_compose(["loss=grpo"]).loss)
    options = {
        "dapo": {"clip_eps_high": 0.28}, "dr_grpo": {"aggregation": "seq_mean_token_sum_norm"},
        "gspo": {"objective": "gspo", "clip_eps": 3e-4, "clip_eps_high": 4e-4,
                 "aggregation": "seq_mean_token_mean"},
        "cispo": {"objective": "cispo", "clip_eps": 1.0, "clip_eps_high": 0.28},
    }
    for option, differs in options.items():
        composed = OmegaConf.to_container(_compose([f"loss={option}"]).loss)
        assert {k: getattr(v, "value", v) for k, v in composed.items()} == {**base, **differs}, option
        own = OmegaConf.to_container(OmegaConf.load(CONF / "loss" / f"{option}.yaml"))
        assert own == {"defaults": ["grpo", "_self_"], **differs}, option


@pytest.mark.parametrize("override,key", [
    ("train.advantage_norm=groupwise", "advantage_norm"), ("train.lr_schedule=step", "lr_schedule"),
    ("train.device=tpu", "device"), ("loss.aggregation=mean", "aggregation"), ("model.dtype=fp8", "dtype"),
])
def test_a_choice_outside_its_enum_fails_at_composition(override, key):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        _compose([override])
    assert key in str(e.value.__cause__ or e.value)


def test_help_lists_the_options_to_pick_and_not_the_schemas_they_build_on():
    """`python train.py --help` (the README's way to see every group): each group with its real options, and none of
    the `*_schema` bases that share the groups in Hydra's ConfigStore (Hydra's own list showed 17 of them)."""
    out = _cli("--help")
    assert out.returncode == 0, out.stderr
    groups = dict(line.split(": ", 1) for line in out.stdout.split("== Config ==")[0].splitlines() if ": " in line)
    assert groups["mode"] == "broadcast, lora_only, lora_restart, none, shared_vllm"
    assert groups["optimizer"] == "adafactor, adamw, adamw_8bit"
    assert "arith_grpo" in groups["experiment"] and set(groups) >= {"data", "eval", "loss", "model", "server", "sweep"}
    assert "_schema" not in out.stdout



def test_help_describes_each_key_and_points_to_the_page_that_describes_each_group():
    """`--help` listed the groups and the bare config but described no key: each key now comes with the first
    sentence of its comment, from its schema dataclass (train.ppo_epochs) or else its group's YAML (the loss keys),
    for the config the overrides compose (mode=broadcast's keys with mode=broadcast)."""
    out = _cli("--help", "mode=broadcast")
    assert out.returncode == 0, out.stderr
    keys = out.stdout.split("== Config ==")[1]
    assert "docs/configuring.md" in keys
    assert "  ppo_epochs: 1    # Passes over each rollout batch (PPO epochs); > 1 lets the policy move away" in keys
    assert "  clip_eps: 0.2    # Lower clip range: the ratio is clipped at 1 - clip_eps." in keys
    assert "  transfer_dtype: null    # Cast weights to this dtype before sending (e.g. bfloat16)" in keys
    described = [line for line in keys.splitlines() if line.startswith("  ")]
    assert sum("    # " in line for line in described) >= 0.9 * len(described)


@pytest.mark.slow
def test_a_run_does_not_print_bitsandbytes_advice_about_4bit_kernels(tmp_path):
    """peft (imported by every run for its weight handling) imports bitsandbytes when installed, whose CPU backend
    warned on every run "Failed to load CPU gemm_4bit_forward ... pip install kernels": advice about a feature no
    run uses. The run's logging config (conf/train.yaml, hydra.job_logging) mutes that logger."""
    pytest.importorskip("bitsandbytes")
    app = ("import sys; from pathlib import Path; import hydra\n"
           "from grpo.config import register_configs\n"
           "register_configs()\n"
           f"@hydra.main(version_base='1.3', config_path={str(CONF)!r}, config_name='train')\n"
           "def main(cfg):\n"
           "    import logging, peft  # noqa: F401\n"
           "    logging.getLogger('train').info('imported peft')\n"
           f"sys.argv = ['app', '~experiment', 'hydra.run.dir={tmp_path}']\n"
           "main()\n")
    out = subprocess.run([sys.executable, "-c", app], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "imported peft" in out.stdout, out.stderr[-2000:]
    assert "gemm_4bit" not in out.stdout + out.stderr and "kernels" not in out.stdout + out.stderr


def test_the_install_check_and_any_process_importing_grpo_print_no_4bit_kernel_advice():
    """Issue 62.21: scripts/install.sh's last line imported peft, whose bitsandbytes printed "Failed to load CPU
    gemm_4bit_forward from kernels-community ..." unexplained at the end of the install."""
    pytest.importorskip("bitsandbytes")
    check = [line for line in (REPO / "scripts" / "install.sh").read_text().splitlines()
             if line.startswith('python -c "import ')][-1]
    imports = check.split('"', 2)[1].split(";")[0].removeprefix("import ").split(", ")
    assert imports[0] == "grpo" and "peft" in imports  # grpo (which mutes that logger) is imported first
    # bitsandbytes warns at its import (peft imports it): the cheaper import of the two shows the same.
    out = subprocess.run([sys.executable, "-c", "import grpo, bitsandbytes"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "gemm_4bit" not in out.stdout + out.stderr and "kernels" not in out.stdout + out.stderr


def test_instantiation_cause_is_the_error_the_config_caused():
    """Hydra wraps an error in a nested `_target_` once per level; the loss check, the data build and the reward
    build all report the innermost one (the line that names the bad value)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from grpo.config_values import instantiation_cause

    # A component that instantiates a node of its own in __init__ (as pipelines build their task): two wrappers,
    # which a one-level unwrap (the loss check's and the data build's before) left as a traceback.
    node = {"_target_": "hydra.utils.instantiate", "_recursive_": False,
            "config": {"_target_": "builtins.int", "_args_": ["twelve"]}}
    with pytest.raises(InstantiationException) as e:
        instantiate(node)
    assert isinstance(e.value.__cause__, InstantiationException)
    cause = instantiation_cause(e.value)
    assert isinstance(cause, ValueError) and "twelve" in str(cause)
    plain = KeyError("x")
    assert instantiation_cause(plain) is plain


def test_a_hub_model_in_the_local_cache_is_checked_against_model_num_layers(tmp_path, monkeypatch):
    """model.name=<hub id> with a preset's num_layers: a cached hub model of another depth made `layers=all` train
    only the first blocks, silently (local directories were already checked; hub ids were not)."""
    import huggingface_hub.constants

    from grpo.config_values import ConfigError
    from grpo.recipes.model_checks import check_model

    repo = tmp_path / "models--acme--deep-7b"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text('{"model_type": "qwen2", "num_hidden_layers": 28}')
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    cfg = _compose(["model=qwen3b", "model.name=acme/deep-7b"])
    assert cfg.model.num_layers == 36
    with pytest.raises(ConfigError, match=r"model.num_layers=36, but .*config.json says the model has 28 blocks"):
        check_model(cfg, cuda=False)
    check_model(_compose(["model=qwen3b", "model.name=acme/deep-7b", "model.num_layers=28"]), cuda=False)


def test_server_cpu_keeps_chunked_prefill_off_when_extra_args_are_given():
    """The flag lived in server=cpu's extra_args, so a user's own server.extra_args silently dropped it (and with it
    the fix for vLLM 0.32's CPU engine dying on seeded prompts split across steps)."""
    from grpo.inference.process import VLLMServer

    def command(*overrides: str) -> list[str]:
        cfg = _compose(["server=cpu", *overrides])
        return VLLMServer("model-dir", cfg.server, Path("vllm.log")).command()

    assert "--no-enable-chunked-prefill" in command()
    args = command("server.extra_args=[--max-num-seqs,64]")
    assert "--no-enable-chunked-prefill" in args and "--max-num-seqs" in args
    assert "--enable-chunked-prefill" in command("server.chunked_prefill=true")
    gpu = _compose(["server=gpu"])
    assert not any("chunked-prefill" in a for a in VLLMServer("model-dir", gpu.server, Path("vllm.log")).command())


def test_server_compile_and_cuda_graph_sizes_reach_vllm_as_one_compilation_config():
    """server.compile=false and server.cuda_graph_sizes become vLLM's --compilation-config (no torch.compile, whole
    decode steps captured for the given sizes); both null leave vLLM's defaults; a compilation flag of its own in
    server.extra_args beside them is refused rather than one silently replacing the other."""
    import json

    from grpo.config_values import ConfigError
    from grpo.inference.process import VLLMServer

    def command(*overrides: str) -> list[str]:
        cfg = _compose(["server=gpu", *overrides])
        return VLLMServer("model-dir", cfg.server, Path("vllm.log")).command()

    assert "--compilation-config" not in command()
    args = command("server.compile=false", "server.cuda_graph_sizes=[64,1,8,8]")
    config = json.loads(args[args.index("--compilation-config") + 1])
    assert config == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 8, 64]}
    sizes_only = command("server.cuda_graph_sizes=[4]")
    assert json.loads(sizes_only[sizes_only.index("--compilation-config") + 1]) == {"cudagraph_capture_sizes": [4]}
    with pytest.raises(ConfigError, match="keep one"):
        command("server.compile=false", "server.extra_args=[-O0]")
    real = _compose(["experiment=smollm2_chat_arith_shared"]).server
    assert real.compile is False and list(real.cuda_graph_sizes)[-1] == 512


def test_the_data_source_counts_rollout_batches_not_optimizer_steps():
    """run-api was registered with the optimizer step as its starting step and the optimizer steps as num_steps,
    while it counts rollout batches (the trainer's `step` when it fetches): they differ when a batch trains
    ppo_epochs x mini_batches > 1 optimizer steps (a resume at step 8 of sweep=clip_eps started run-api at 8, not 2)."""
    from grpo.trainer.minibatch import rollout_batches

    cfg = _compose(["train.steps=16", "train.ppo_epochs=2", "train.mini_batches=2"]).train
    assert rollout_batches(cfg, 0, None) == (0, 4)
    assert rollout_batches(cfg, 8, None) == (2, 4)  # an older checkpoint without the batch number
    assert rollout_batches(cfg, 8, 2) == (2, 4)
    assert rollout_batches(_compose(["train.steps=16"]).train, 8, None) == (8, 16)


def test_mode_none_reload_is_a_setting_the_readme_can_offer():
    """README's sync table offered `mode=none mode.reload=restart`; the config had no such key (Hydra refused it,
    and +mode.reload was refused as read by nothing), though the sync class takes it."""
    from hydra.utils import instantiate

    assert _compose(["mode=none"]).mode.reload == "inplace"
    assert instantiate(_compose(["mode=none", "mode.reload=restart"]).mode).reload == "restart"
    from grpo.config.validate import validate
    from grpo.config_values import ConfigError

    with pytest.raises(ConfigError, match="mode.reload=bogus is not one of inplace, restart"):
        validate(_compose(["mode=none", "mode.reload=bogus"]))


def test_broadcast_direct_receive_refuses_a_quantized_server():
    """mode.receive=direct skips the post-load processing a quantized vLLM model needs: refused at start-up."""
    broadcast = get_class("grpo.sync.nccl_broadcast.NCCLBroadcastSync")
    quantized = ["mode=broadcast", "server.device=1", "server.extra_args=[--quantization,fp8]"]
    with pytest.raises(ConfigError, match="mode.receive=engine"):
        broadcast.check_config(_compose([*quantized, "mode.receive=direct"]), cuda=True)
    broadcast.check_config(_compose(quantized), cuda=True)  # the engine's reload handles it
    broadcast.check_config(_compose(["mode=broadcast", "server.device=1", "mode.receive=direct"]), cuda=True)
