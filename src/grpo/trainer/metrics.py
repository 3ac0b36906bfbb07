"""Per-step metrics: metrics.jsonl (always), wandb and TensorBoard (when enabled), a progress bar, and a curves plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

# Shown on the progress bar, in this order, when present.
BAR_KEYS = ("reward/mean", "loss", "grpo/clipped_fraction", "sync/seconds")
# TensorBoard event files go here, inside the run dir (`tensorboard --logdir outputs` shows every run).
TENSORBOARD_DIR = "tensorboard"


def tensorboard_writer_class() -> type:
    """torch.utils.tensorboard's SummaryWriter; an ImportError naming the package to install when it is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(
            f"logging.tensorboard=true needs the `tensorboard` package ({e}): pip install tensorboard, "
            "or set logging.tensorboard=false"
        ) from e
    return SummaryWriter


def continue_history(path: Path, start_step: int, earlier: Optional[Path] = None) -> int:
    """Start a run's metrics.jsonl (`path`) with its history up to `start_step`, so a resumed run is one series.

    A fresh run (`start_step` 0) starts an empty file. A run resumed from the checkpoint of step `start_step` keeps
    the rows up to that step, from `earlier` (the resumed run's metrics.jsonl, when it continues in another run dir)
    or from `path` itself; rows past it are the steps the resumed run does again, dropped so that every step appears
    once. Written to a temporary file and renamed, so a crash here leaves the old history whole. Returns the rows
    kept."""
    source = earlier if earlier is not None and earlier.exists() else path
    kept: list[str] = []
    if start_step > 0 and source.exists():
        kept = [line for line in source.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= start_step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(kept)


class MetricsLogger:
    """Writes one JSON line per optimizer step to <run_dir>/metrics.jsonl and mirrors it to wandb and a bar."""

    def __init__(self, run_dir: Path, logging_cfg: DictConfig, full_cfg: DictConfig, total_steps: int, start_step: int,
                 resumed_from: Optional[Path] = None):
        self.path = run_dir / "metrics.jsonl"
        self.run_dir = run_dir
        earlier = Path(resumed_from) / "metrics.jsonl" if resumed_from is not None else None
        continue_history(self.path, start_step, earlier)
        self._file = open(self.path, "a", buffering=1)
        self._wandb = None
        if logging_cfg.wandb:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(
                project=logging_cfg.wandb_project,
                entity=logging_cfg.wandb_entity,
                dir=str(run_dir),
                mode=mode,
                config=OmegaConf.to_container(full_cfg, resolve=True),
            )
        self._tensorboard = None
        if logging_cfg.get("tensorboard", False):
            self._tensorboard = tensorboard_writer_class()(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=start_step + 1)
        self._bar = None
        if logging_cfg.progress_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="grpo", unit="step", dynamic_ncols=True)

    def log(self, metrics: dict[str, Any]) -> None:
        """Record one optimizer step; `metrics` must contain `step`."""
        clean = {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v) for k, v in metrics.items()}
        clean["step"] = int(metrics["step"])
        # JSON has no NaN; keep the line parseable by every reader.
        line = json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in clean.items()})
        self._file.write(line + "\n")
        if self._wandb is not None:
            self._wandb.log(clean, step=clean["step"])
        if self._tensorboard is not None:
            for key, value in clean.items():
                if key != "step" and isinstance(value, float) and math.isfinite(value):
                    self._tensorboard.add_scalar(key, value, clean["step"])
        if self._bar is not None:
            self._bar.update(1 if clean["step"] > 0 else 0)  # the step-0 row (eval before training) is no step
            self._bar.set_postfix({k.split("/")[-1]: f"{clean[k]:.3g}" for k in BAR_KEYS if isinstance(clean.get(k), float)})

    def flush(self) -> None:
        """Force the rows written so far onto disk (fsync), so they outlive a crash of the machine too; the trainer
        calls it before each checkpoint."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Flush and close every sink. Safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if not self._file.closed:
            self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All lines of a metrics.jsonl."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# Eval metrics drawn in the eval panel of curves.png, when a run has them.
EVAL_PLOT_KEYS = ("eval/accuracy", "eval/pass@k", "eval/mean@k")


def plot_curves(metrics_path: Path, out_path: Path, title: str = "") -> Path:
    """PNG of reward and loss against step, plus a panel of the held-out eval metrics when the run has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train_rows = [r for r in rows if r["step"] > 0]  # step 0 is the eval before training
    eval_rows = [r for r in rows if r.get("eval/accuracy") is not None]
    fig, axes = plt.subplots(1, 3 if eval_rows else 2, figsize=(15 if eval_rows else 10, 3.8))
    steps = [r["step"] for r in train_rows]
    for ax, key in zip(axes, ("reward/mean", "loss")):
        ax.plot(steps, [r.get(key) if r.get(key) is not None else float("nan") for r in train_rows], lw=1.5)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    if eval_rows:
        ax = axes[2]
        for key in EVAL_PLOT_KEYS:
            vals = [r.get(key) if r.get(key) is not None else float("nan") for r in eval_rows]
            ax.plot([r["step"] for r in eval_rows], vals, marker="o", lw=1.5, label=key.split("/")[1])
        ax.set_xlabel("optimizer step (weights synced after it)")
        ax.set_ylabel("held-out eval")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


class NullMetrics:
    """The metrics sink of torchrun ranks > 0: rank 0 alone writes metrics."""

    def log(self, metrics: dict) -> None:
        """Drop the row."""

    def flush(self) -> None:
        """Nothing to flush."""

    def close(self) -> None:
        """Nothing to close."""
