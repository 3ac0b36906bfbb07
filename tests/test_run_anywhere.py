"""Issue 22.5: the trainer outside the checkout (`grpo-train` from an installed wheel) and TensorBoard logging."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO
from grpo.conf import CONFIG_DIR, EXPERIMENTS_DIR


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The package built into a wheel and installed (no deps) into a fresh directory: no checkout on its path."""
    root = tmp_path_factory.mktemp("installed")
    # Built from a copy (symlinks kept) so the build's build/ and *.egg-info never land in the checkout.
    source = root / "source"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "outputs", "multirun", "build", "*.egg-info", "__pycache__", ".pytest_cache", "bench", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(root / "wheel"), str(source)], check=True, capture_output=True, timeout=300)
    wheel = next((root / "wheel").glob("grpo-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(root / "site"), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return root / "site"


def grpo_train(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The installed console script, run from `cwd` with only the installed package (and the venv's deps)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(installed), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(installed / "bin" / "grpo-train"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


def test_grpo_train_composes_the_shipped_configs_from_a_directory_outside_the_checkout(installed, tmp_path):
    where = subprocess.run([sys.executable, "-c", "import grpo.train, grpo.conf; print(grpo.train.__file__)"],
                           cwd=tmp_path, env={"PYTHONPATH": str(installed)}, capture_output=True, text=True)
    assert where.stdout.strip().startswith(str(installed)), where  # the wheel's copy, not the checkout
    out = grpo_train(installed, tmp_path, "--cfg", "job", "mode=lora_only", "experiment=cpu_tiny_none")
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = OmegaConf.create(out.stdout)
    assert cfg.name == "cpu_tiny_none"  # experiments/cpu_tiny_none.yaml, as the wheel ships it
    assert cfg.data.task._target_ == "grpo.tasks.prompts.DigitsTask" and cfg.train.steps == 20
    assert cfg.mode._target_ == "grpo.sync.lora_hotswap.LoraHotSwapSync"  # the command line wins over the experiment
    assert cfg.logging.tensorboard is False


def test_grpo_train_config_dir_adds_the_users_own_experiment(installed, tmp_path):
    (tmp_path / "my_conf" / "experiment").mkdir(parents=True)
    (tmp_path / "my_conf" / "experiment" / "mine.yaml").write_text(textwrap.dedent("""\
        # @package _global_
        defaults:
          - override /data: prompt_file
        data:
          task:
            path: prompts.jsonl
        train:
          steps: 7
        """))
    out = grpo_train(installed, tmp_path, "--config-dir", "my_conf", "experiment=mine", "--cfg", "job")
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = OmegaConf.create(out.stdout)
    assert cfg.train.steps == 7 and cfg.data.task._target_ == "grpo.tasks.prompt_file.PromptFileTask"
    assert cfg.data.task.path == "prompts.jsonl"
    help_out = grpo_train(installed, tmp_path, "--config-dir", "my_conf", "--help")
    assert help_out.returncode == 0, help_out.stderr[-2000:]
    groups = dict(line.split(": ", 1) for line in help_out.stdout.splitlines() if line.startswith(("experiment: ", "data: ")))
    assert "mine" in groups["experiment"].split(", ") and "cpu_tiny_none" in groups["experiment"]
    assert "prompt_file" in groups["data"].split(", ")


def test_grpo_train_outside_the_checkout_says_which_config_dir_is_missing_and_names_itself(installed, tmp_path):
    """Issue 44.14: the README's own-task command outside the checkout failed with "experiment=my_task is not one of
    the experiment options" (its --config-dir, relative to the checkout, does not exist there, which was said only
    after that), and the errors named `python train.py` to a user who ran `grpo-train`."""
    out = grpo_train(installed, tmp_path, "--config-dir", "examples/my_task/conf", "experiment=my_task")
    assert out.returncode == 1
    assert out.stderr.strip() == (f"ConfigError: --config-dir examples/my_task/conf: no such directory (a relative path "
                                  f"starts at the working directory, {tmp_path}); give the directory that holds your "
                                  "config groups (e.g. experiment/, data/)")
    typo = grpo_train(installed, tmp_path, "train.stepz=3")
    assert typo.returncode == 1 and "(grpo-train --cfg job prints every key" in typo.stderr, typo.stderr[-2000:]
    # With the example beside it (a copy of the checkout's examples/), the README's command composes it.
    shutil.copytree(REPO / "examples" / "my_task", tmp_path / "examples" / "my_task")
    job = grpo_train(installed, tmp_path, "--config-dir", "examples/my_task/conf", "experiment=my_task", "--cfg", "job",
                     "--resolve")
    assert job.returncode == 0, job.stderr[-2000:]
    # Its files resolve against the config dir (${grpo.config_dir:../prompts.jsonl}), wherever that is.
    assert OmegaConf.create(job.stdout).data.task.path == str(tmp_path / "examples" / "my_task" / "prompts.jsonl")


def _logging_cfg(tensorboard: bool):
    return OmegaConf.create({"wandb": False, "wandb_project": "grpo", "wandb_entity": None,
                             "tensorboard": tensorboard, "progress_bar": False, "plot": False})


def test_tensorboard_events_hold_each_step_metric(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from grpo.trainer.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, _logging_cfg(True), OmegaConf.create({}), total_steps=3, start_step=0)
    for step in (1, 2, 3):
        logger.log({"step": step, "loss": 0.5 / step, "reward/mean": 0.1 * step, "grpo/kl": float("nan")})
    logger.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "reward/mean"}  # the NaN metric is left out, as in metrics.jsonl
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_missing_tensorboard_package_is_a_clear_error_at_start_up(tmp_path):
    # A process where `tensorboard` cannot be imported (as when it is not installed).
    code = textwrap.dedent("""\
        import sys
        sys.modules["tensorboard"] = None
        try:
            from grpo.trainer.metrics import tensorboard_writer_class
            tensorboard_writer_class()
        except ImportError as e:
            print("ERROR:", e)
        """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "ERROR: logging.tensorboard=true needs the `tensorboard` package" in out.stdout, out.stderr[-2000:]
    assert "pip install tensorboard, or set logging.tensorboard=false" in out.stdout
    # Through train.py: validation stops the run before any model loads, naming the key and the package.
    run = subprocess.run([sys.executable, "-c", "import sys, runpy; sys.modules['tensorboard'] = None; "
                          f"sys.argv = ['train.py', 'logging.tensorboard=true', 'hydra.run.dir={tmp_path}']; "
                          "runpy.run_path('train.py', run_name='__main__')"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "ConfigError: logging.tensorboard=true needs the `tensorboard` package" in run.stdout + run.stderr


def test_a_prompt_file_without_held_out_prompts_stops_with_a_config_error(tmp_path):
    # Evaluation is on for local tasks by default; a prompts file alone has nothing held out to evaluate on.
    run = subprocess.run([sys.executable, "train.py", "~experiment", "data=prompt_file",
                          "data.task.path=examples/my_task/prompts.jsonl", "data.task.prompt_column=question",
                          "+data.rewards.c._target_=examples.my_task.my_rewards.exact_answer",
                          "+data.rewards.c._partial_=true", f"hydra.run.dir={tmp_path}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert "ConfigError: PromptFileTask has no held-out prompts: set data.task.eval_path" in run.stderr
    assert "eval.enabled=false" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "logs" / "vllm.pid").exists()  # stopped before any server started


def test_the_config_tree_is_conf_and_experiments_at_the_root_and_the_wheel_ships_both(installed):
    """The promised layout: conf/ (train.yaml, its groups) and experiments/ at the repository root are the files, with
    no symlink (src/grpo/train.py, src/grpo/conf and conf/experiment once were ones) and no copy in the package
    (conf/ holds only the code that finds them); an installed wheel holds every one of them."""
    tracked = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert [line.split("\t", 1)[1] for line in tracked.splitlines() if line.startswith("120000")] == []
    assert (CONFIG_DIR, EXPERIMENTS_DIR) == (REPO / "conf", REPO / "experiments")
    assert list((REPO / "src").rglob("*.yaml")) == [] and not (CONFIG_DIR / "experiment").exists()
    conf = sorted(p.relative_to(CONFIG_DIR) for p in CONFIG_DIR.rglob("*.yaml"))
    experiments = sorted(p.relative_to(EXPERIMENTS_DIR) for p in EXPERIMENTS_DIR.rglob("*.yaml"))
    assert {Path("train.yaml"), Path("mode/none.yaml"), Path("model/tiny_qwen2.yaml"), Path("optimizer/adamw.yaml")} <= set(conf)
    assert Path("arith_quick.yaml") in experiments
    wheel_conf, wheel_experiments = installed / "grpo" / "conf", installed / "grpo" / "experiments"
    assert sorted(p.relative_to(wheel_conf) for p in wheel_conf.rglob("*.yaml")) == conf
    assert sorted(p.relative_to(wheel_experiments) for p in wheel_experiments.rglob("*.yaml")) == experiments


def test_python_train_py_composes_conf_and_experiments_of_the_checkout_from_any_directory(tmp_path):
    """`python train.py experiment=NAME` takes experiments/NAME.yaml: Hydra searches conf/ and, as the group
    `experiment`, experiments/ (hydra_plugins.grpo_experiments), whichever the working directory."""
    # One process: Hydra's search path, the defaults list and the composed config.
    info = subprocess.run([sys.executable, str(REPO / "train.py"), "--info", "all", "experiment=cpu_tiny_lora_only"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr[-2000:]
    rows = [[c.strip() for c in line.strip("| ").split("|")] for line in info.stdout.splitlines() if line.startswith("|")]
    assert ["main", f"file://{REPO / 'conf'}"] in rows
    assert ["grpo-experiments", f"grpo-experiments://{REPO / 'experiments'}"] in rows
    assert ["experiment/cpu_tiny_lora_only", "", "False", "train"] in rows
    cfg = OmegaConf.create(info.stdout.split("\nConfig\n******\n", 1)[1])
    assert cfg.name == "cpu_tiny_lora_only" and cfg.mode._target_ == "grpo.sync.lora_hotswap.LoraHotSwapSync"
