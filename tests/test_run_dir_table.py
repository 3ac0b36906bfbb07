"""docs/running.md "What a run writes" names everything a run leaves in its run dir; here the optional sinks' dirs (the default
run's own entries are checked by tests/test_default_run.py). `logging.wandb=true` wrote a wandb/ dir the table did
not name."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]


def readme_run_dir_names() -> set[str]:
    """The top-level names in the first column of the README's table of what a run writes."""
    table = (REPO / "docs" / "running.md").read_text().split("## What a run writes", 1)[1].split("\n## ", 1)[0]
    return {m.split("/")[0] or m for row in table.splitlines() if row.startswith("| `")
            for m in re.findall(r"`([^`]+)`", row.split(" | ")[0])}


def test_the_wandb_and_tensorboard_sinks_write_only_what_the_readme_table_names(tmp_path, monkeypatch):
    from grpo.trainer.metrics import MetricsLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # offline: nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = OmegaConf.create({"wandb": True, "wandb_project": "grpo-test", "wandb_entity": None, "tensorboard": True,
                            "progress_bar": False})
    logger = MetricsLogger(tmp_path, cfg, OmegaConf.create({"train": {"steps": 1}}), total_steps=1, start_step=0)
    logger.log({"step": 1, "reward/mean": 0.5, "loss": 0.1})
    logger.close()
    written = {p.name for p in tmp_path.iterdir()}
    assert {"metrics.jsonl", "wandb", "tensorboard"} <= written
    assert written <= readme_run_dir_names()


def test_the_run_name_labels_the_progress_bar_and_names_the_wandb_run(tmp_path, monkeypatch, capsys):
    """Before, `name=my_lr_test` (documented as shown in logs and the run dir) was read by nothing: the bar said
    'grpo' and the W&B run got a random name."""
    import wandb

    from grpo.trainer.metrics import MetricsLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = OmegaConf.create({"wandb": True, "wandb_project": "grpo-test", "wandb_entity": None, "tensorboard": False,
                            "progress_bar": True})
    logger = MetricsLogger(tmp_path, cfg, OmegaConf.create({}), total_steps=1, start_step=0, name="my_lr_test")
    try:
        assert wandb.run is not None and wandb.run.name == "my_lr_test"
        logger.log({"step": 1, "reward/mean": 0.5, "loss": 0.1})
    finally:
        logger.close()
    assert "my_lr_test: 100%" in capsys.readouterr().err
