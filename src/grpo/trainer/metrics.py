"""Per-step metrics: metrics.jsonl (always), wandb and TensorBoard (when enabled), a progress bar, and a curves plot."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from grpo.schema import LoggingConfig

log = logging.getLogger(__name__)

# Shown on the progress bar, in this order, when present.
BAR_KEYS = ("reward/mean", "loss", "grpo/clipped_fraction", "sync/seconds")
# The held-out evaluation's logged completions (grpo.pipeline.evaluation), one JSON line each, keyed by "step": part of
# the run's history like metrics.jsonl, so a resume trims and carries them the same way.
EVAL_SAMPLES = "eval_samples.jsonl"
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


class MetricsWriteError(OSError):
    """A metrics row could not be written (a full disk, a file-size limit); the rows before it are on disk."""


class MetricsFileError(ValueError):
    """A metrics.jsonl line other than the last that is not a JSON row: not the trace of a crash mid-write (which
    can only tear the last line), so no reader guesses; the message names the file and the line."""


def _parse_rows(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], Optional[str]]:
    """(line, row) of every row of a metrics.jsonl, and the torn last line (None when there is none).

    A run killed (or a disk filling up) while it writes a row leaves a last line that does not parse, with no newline
    after it; a reader of a running run's file can see one too. That line is returned apart, for the caller to leave
    out and say so. A line that does not parse anywhere else raises MetricsFileError."""
    lines = Path(path).read_text(errors="replace").split("\n")  # a file ending in a newline ends in ""
    out: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            if number == len(lines):
                return out, line
            raise MetricsFileError(
                f"{path}, line {number} of {len(lines) - 1}: not a JSON row ({e}); only the last line of a metrics "
                "file can be torn by a crash, so this one was changed by hand or the disk is damaged: repair or "
                "remove that line"
            ) from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            raise MetricsFileError(f"{path}, line {number}: a metrics row is a JSON object with a 'step', got "
                                   f"{line[:80]!r}")
        out.append((line, row))
    return out, None


def _torn_warning(path: Path, torn: str) -> str:
    return (f"{path} ends with a partial row ({len(torn)} bytes, no newline: the run was stopped or the disk filled "
            f"up while it was written), left out: {torn[:60]!r}...")


def continue_history(path: Path, start_step: int, earlier: Optional[Path] = None) -> tuple[int, int]:
    """Start a run's metrics.jsonl (`path`) with its history up to `start_step`, so a resumed run is one series.

    A fresh run (`start_step` 0) starts an empty file. A run resumed from the checkpoint of step `start_step` keeps
    the rows up to that step, from `earlier` (the resumed run's metrics.jsonl, when it continues in another run dir)
    or from `path` itself; rows past it are the steps the resumed run does again, dropped so that every step appears
    once. A partial last row (a crash while it was written; its step is past the checkpoint, whose rows are flushed
    before it) is dropped with a warning. Written to a temporary file and renamed, so a crash here leaves the old
    history whole. Returns (the rows kept, the partial rows dropped: 0 or 1)."""
    source = earlier if earlier is not None and earlier.exists() else path
    kept: list[str] = []
    torn = None
    if start_step > 0 and source.exists():
        rows, torn = _parse_rows(source)
        kept = [line for line, row in rows if row["step"] <= start_step]
        if torn is not None:
            log.warning(_torn_warning(source, torn))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(kept), int(torn is not None)


class MetricsLogger:
    """Writes one JSON line per optimizer step to <run_dir>/metrics.jsonl and mirrors it to wandb and a bar."""

    def __init__(self, run_dir: Path, logging_cfg: DictConfig, full_cfg: DictConfig, total_steps: int, start_step: int,
                 resumed_from: Optional[Path] = None, name: str = "grpo"):
        self.path = run_dir / "metrics.jsonl"
        self.run_dir = run_dir
        earlier = Path(resumed_from) / "metrics.jsonl" if resumed_from is not None else None
        # A partial row the resumed history ended with is counted in this run's first row (metrics/partial_rows_dropped).
        _, self._partial_rows_dropped = continue_history(self.path, start_step, earlier)
        # The eval samples of steps past the checkpoint are evaluated again by the resumed run: dropped, so each
        # eval's samples are there once (carried over from the resumed run dir when this one is another).
        samples, earlier_samples = run_dir / EVAL_SAMPLES, earlier.with_name(EVAL_SAMPLES) if earlier else None
        if samples.exists() or (earlier_samples is not None and earlier_samples.exists()):
            continue_history(samples, start_step, earlier_samples)
        self._file = open(self.path, "a", buffering=1)
        self._wandb = None
        if logging_cfg.wandb:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(
                project=logging_cfg.wandb_project,
                entity=logging_cfg.wandb_entity,
                name=name,
                dir=str(run_dir),
                mode=mode,
                config=OmegaConf.to_container(full_cfg, resolve=True),
            )
            # Charts against the row's own `step`, not wandb's call counter: an evaluation beside training logs its
            # row after later steps' rows, which wandb's monotonic step would drop.
            self._wandb.define_metric("step")
            self._wandb.define_metric("*", step_metric="step")
        self._tensorboard = None
        if logging_cfg.get("tensorboard", LoggingConfig.tensorboard):
            self._tensorboard = tensorboard_writer_class()(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=start_step + 1)
        self._bar = None
        self._console = contextlib.ExitStack()
        if logging_cfg.progress_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc=name, unit="step", dynamic_ncols=True)
            self._console.enter_context(console_above_the_bar())

    def log(self, metrics: dict[str, Any]) -> None:
        """Record one optimizer step; `metrics` must contain `step`."""
        clean = {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v) for k, v in metrics.items()}
        clean["step"] = int(metrics["step"])
        if self._partial_rows_dropped:
            clean["metrics/partial_rows_dropped"] = float(self._partial_rows_dropped)
            self._partial_rows_dropped = 0
        # JSON has no NaN; keep the line parseable by every reader.
        line = json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in clean.items()})
        if self._file.closed:
            raise MetricsWriteError(f"{self.path} is closed (an earlier row could not be written)")
        try:
            self._file.write(line + "\n")
        except OSError as e:
            # The file keeps the rows before this one (and maybe part of it, which readers leave out). Close it now
            # and drop the part still buffered: another flush would only fail again, in close(), where it would
            # stop the run's teardown (the server's stop) with an error that names no file.
            with contextlib.suppress(OSError):
                self._file.close()
            raise MetricsWriteError(e.errno, f"could not write the metrics row of step {clean['step']} to "
                                    f"{self.path}: {e.strerror or e}") from e
        if self._wandb is not None:
            self._wandb.log(clean)
        if self._tensorboard is not None:
            for key, value in clean.items():
                if key != "step" and isinstance(value, float) and math.isfinite(value):
                    self._tensorboard.add_scalar(key, value, clean["step"])
        if self._bar is not None:
            # Up to the row's step: an evaluation's row (step 0's, or one beside training, written after later
            # steps' rows) moves it no further.
            self._bar.update(max(0, clean["step"] - self._bar.n))
            self._bar.set_postfix({k.split("/")[-1]: f"{clean[k]:.3g}" for k in BAR_KEYS if isinstance(clean.get(k), float)})

    def logged(self, step: int, prefix: str) -> bool:
        """Whether metrics.jsonl holds a row of `step` with a key starting with `prefix` (e.g. a resumed run's
        evaluation of its checkpoint step)."""
        if not self._file.closed:
            self._file.flush()
        return any(row["step"] == step and any(k.startswith(prefix) for k in row) for row in read_metrics(self.path))

    def flush(self) -> None:
        """Force the rows written so far onto disk (fsync), so they outlive a crash of the machine too; the trainer
        calls it before each checkpoint."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Flush and close every sink, the file last. Safe to call twice. A failure of the file's last flush raises
        MetricsWriteError naming it (after the other sinks are closed)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._console.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if not self._file.closed:
            try:
                self._file.close()
            except OSError as e:
                raise MetricsWriteError(e.errno, f"could not write the last metrics rows to {self.path}: "
                                        f"{e.strerror or e}") from e


@contextlib.contextmanager
def console_above_the_bar():
    """While the progress bar is shown, log lines to the console (Python warnings included, through logging) are
    written above it with tqdm.write: a plain handler printed them onto the bar's line ("...| 3/60WARNING ...")."""
    import warnings

    from tqdm.contrib.logging import logging_redirect_tqdm

    captured_already = getattr(warnings.showwarning, "__module__", None) == "logging"
    logging.captureWarnings(True)
    try:
        with logging_redirect_tqdm():
            yield
    finally:
        if not captured_already:
            logging.captureWarnings(False)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl. A partial last line (a run stopped while writing it, or still writing it) is left
    out with a warning; a bad line elsewhere raises MetricsFileError naming it."""
    rows, torn = _parse_rows(Path(path))
    if torn is not None:
        log.warning(_torn_warning(Path(path), torn))
    return [row for _, row in rows]


# Eval metrics drawn in the eval panel of curves.png, when a run has them.
EVAL_PLOT_KEYS = ("eval/accuracy", "eval/pass@k", "eval/mean@k")


def plot_curves(metrics_path: Path, out_path: Path, title: str = "") -> Path:
    """PNG of reward and loss (with the policy's entropy) against step, plus a panel of the held-out eval metrics when
    the run has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train_rows = [r for r in rows if r["step"] > 0]  # step 0 is the eval before training
    # By step: evaluations beside training write their rows when they complete.
    eval_rows = sorted((r for r in rows if r.get("eval/accuracy") is not None), key=lambda r: r["step"])
    fig, axes = plt.subplots(1, 3 if eval_rows else 2, figsize=(15 if eval_rows else 10, 3.8))
    for ax, key in zip(axes, ("reward/mean", "loss")):
        # Only the rows that have the key: with several updates per rollout batch reward/mean is on each batch's
        # first row alone, and NaN gaps between such rows left single points that a line does not draw.
        points = [(r["step"], r[key]) for r in train_rows if r.get(key) is not None]
        ax.plot([x for x, _ in points], [y for _, y in points], lw=1.5, marker="o" if len(points) == 1 else None)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    plot_entropy(axes[1], train_rows)
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


def plot_entropy(ax: Any, train_rows: list[dict[str, Any]]) -> None:
    """`grpo/entropy` on a right-hand axis of the loss panel, dashed (a fall towards 0 is the policy collapsing)."""
    points = [(r["step"], r["grpo/entropy"]) for r in train_rows if r.get("grpo/entropy") is not None]
    if not points:
        return
    right = ax.twinx()
    right.plot([x for x, _ in points], [y for _, y in points], lw=1.2, ls="--", color="C1")
    right.set_ylabel("grpo/entropy (dashed)", color="C1")
    right.set_ylim(bottom=0)


class NullMetrics:
    """The metrics sink of torchrun ranks > 0: rank 0 alone writes metrics."""

    def log(self, metrics: dict) -> None:
        """Drop the row."""

    def logged(self, step: int, prefix: str) -> bool:  # noqa: ARG002
        """Rank 0 writes the rows and decides what to log: said to be there."""
        return True

    def flush(self) -> None:
        """Nothing to flush."""

    def close(self) -> None:
        """Nothing to close."""
