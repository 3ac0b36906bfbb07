"""What a run leaves on disk when it dies mid-write, read back by a resume and by `grpo.report`.

The real trainer loop, checkpoints and metrics logger on the tiny model without a server (tests/test_run_history.py's
harness): what is tested is the run dir's files, not the data path."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from test_run_history import build_trainer, fit, rows, steps


def tear_last_row(run) -> str:
    """metrics.jsonl as a run killed while it wrote its last row leaves it: that row cut short, no newline; and the
    checkpoint of that step never written (its row is flushed before it). Returns the torn text."""
    path = run / "metrics.jsonl"
    text = path.read_text()
    last = text.rstrip("\n").rsplit("\n", 1)[1]
    torn = last[: len(last) // 2]
    path.write_text(text[: text.rindex(last)] + torn)
    return torn


def test_a_row_torn_by_a_crash_is_left_out_by_readers_and_the_resume_counts_it(tiny_qwen2_dir, tmp_path, caplog):
    from grpo.report import job_row
    from grpo.stop import last_step
    from grpo.trainer.metrics import plot_curves, read_metrics

    run = tmp_path / "run"
    fit(build_trainer(tiny_qwen2_dir, run, steps=3))  # checkpoints at steps 2 and 3
    before = rows(run)
    shutil.rmtree(run / "checkpoints" / "step_000003")
    torn = tear_last_row(run)

    # Readers of the run dir (the stop block, grpo.report, curves) see the whole rows and say what they left out.
    with caplog.at_level(logging.WARNING, logger="grpo.trainer.metrics"):
        assert read_metrics(run / "metrics.jsonl") == before[:2]
    assert "ends with a partial row" in caplog.text and torn[:20] in caplog.text
    assert last_step(run) == 2
    assert job_row(run)["steps"] == 2
    assert plot_curves(run / "metrics.jsonl", run / "curves.png").stat().st_size > 0

    # The resume (a JSONDecodeError before) continues from step 2 and counts the partial row in its first row.
    fit(build_trainer(tiny_qwen2_dir, run, steps=4, resume=run))
    assert steps(run) == [1, 2, 3, 4]
    assert rows(run)[:2] == before[:2]
    assert rows(run)[2]["metrics/partial_rows_dropped"] == 1
    assert "metrics/partial_rows_dropped" not in rows(run)[3]
    assert (run / "metrics.jsonl").read_text().endswith("}\n")


def test_a_bad_line_before_the_last_is_an_error_naming_it_not_rows_dropped(tiny_qwen2_dir, tmp_path):
    from grpo.trainer.metrics import MetricsFileError, read_metrics

    run = tmp_path / "run"
    fit(build_trainer(tiny_qwen2_dir, run, steps=2))
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[0] = lines[0][:40]
    path.write_text("\n".join(lines) + "\n")
    kept = path.read_text()
    for read in (lambda: read_metrics(path),
                 lambda: build_trainer(tiny_qwen2_dir, run, steps=3, resume=run)):
        with pytest.raises(MetricsFileError, match=rf"{path}, line 1 of 2: not a JSON row .*repair or remove"):
            read()
    assert path.read_text() == kept  # the resume refused before rewriting the history
    assert json.loads(lines[1])["step"] == 2


# A subprocess whose writes past `limit` bytes per file fail in the kernel (RLIMIT_FSIZE; Python ignores SIGXFSZ, so
# the write gets EFBIG), as a disk that fills up mid-write fails them with ENOSPC: checkpoint step 1 is written
# before the limit, step 2 and a served-weights dir after it.
_WRITE_PAST_LIMIT = """
import json, resource, sys
import torch
from transformers import AutoModelForCausalLM
from grpo.trainer.checkpoint import CheckpointManager, CheckpointWriteError
from grpo.weights.hf_dir import WeightsWriteError, save_model_weights

model_dir, run, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
optimizer = torch.optim.AdamW(model.parameters())
sum(p.sum() for p in model.parameters()).backward()
optimizer.step()
ckpts = CheckpointManager(run)
ckpts.save(1, model, None, optimizer, None)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
out = {}
for name, write, error in (("checkpoint", lambda: ckpts.save(2, model, None, optimizer, None), CheckpointWriteError),
                           ("weights", lambda: save_model_weights(model, None, run + "/served_weights/v2"),
                            WeightsWriteError)):
    try:
        write()
        out[name] = "written"
    except error as e:
        out[name] = [e.errno, str(e)]
print(json.dumps(out))
"""


# 1 MiB: model.safetensors (2.5 MB, a safetensors write) fails, in the checkpoint and in the served weights;
# 4 MiB: the model fits, optimizer.pt (5 MB, torch.save) fails.
@pytest.mark.parametrize("limit_mib, failing", [(1, "model.safetensors"), (4, "optimizer.pt")])
def test_a_write_failing_mid_checkpoint_is_a_checkpoint_write_error_and_the_last_checkpoint_stays(
        tiny_qwen2_dir, tmp_path, limit_mib, failing):
    """Before: a full disk in torch.save was `RuntimeError: [enforce fail at inline_container.cc:672] unexpected pos`
    and in the safetensors write a SafetensorError, neither naming the checkpoint nor the OS error."""
    import errno
    import subprocess
    import sys

    from conftest import REPO
    from grpo.trainer.checkpoint import CheckpointManager

    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", _WRITE_PAST_LIMIT, str(tiny_qwen2_dir), str(run),
                           str(limit_mib * 1024**2)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    code, message = out["checkpoint"]
    assert code == errno.EFBIG, (failing, message)
    assert f"could not write checkpoint step 2 under {run / 'checkpoints'}: [Errno 27] File too large" in message
    if failing == "model.safetensors":
        code, message = out["weights"]
        assert code == errno.EFBIG and f"could not write weights to {run}/served_weights/v2: " in message, message
        assert "File too large" in message
    else:
        assert out["weights"] == "written"
    # Step 1's checkpoint is the latest and whole; nothing half-written is left.
    ckpts = CheckpointManager(run)
    assert ckpts.latest() == run / "checkpoints" / "step_000001"
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["step_000001"]
    assert [p.name for p in (run / "served_weights").iterdir()] == ([] if failing == "model.safetensors" else ["v2"])
    torch_load = __import__("torch").load
    assert torch_load(ckpts.latest() / "optimizer.pt", weights_only=False)["state"]


_ROWS_PAST_LIMIT = """
import json, resource, sys
from pathlib import Path
from omegaconf import OmegaConf
from grpo.schema import LoggingConfig
from grpo.trainer.metrics import MetricsLogger, MetricsWriteError

run = Path(sys.argv[1])
logger = MetricsLogger(run, OmegaConf.structured(LoggingConfig(progress_bar=False, plot=False)), OmegaConf.create({}),
                       100, 0)
resource.setrlimit(resource.RLIMIT_FSIZE, (4000, resource.RLIM_INFINITY))
out = {}
try:
    for step in range(1, 100):
        logger.log({"step": step, **{f"metric/{i}": 0.5 for i in range(20)}})
except MetricsWriteError as e:
    out["log"] = [step, e.errno, str(e)]
try:
    logger.close()
    out["close"] = "ok"
except OSError as e:
    out["close"] = repr(e)
print(json.dumps(out))
"""


def test_a_metrics_row_that_cannot_be_written_names_the_file_and_close_does_not_fail_again(tmp_path):
    """A row written past a file-size limit (as on a full disk). Before: `OSError: [Errno 27] File too large` naming
    no file, raised again by close() in train.py's teardown, which then skipped the rest of it (the vLLM server's
    stop: it died only with the trainer, by PR_SET_PDEATHSIG, and left logs/vllm.pid behind)."""
    import errno
    import subprocess
    import sys

    from conftest import REPO
    from grpo.trainer.metrics import read_metrics

    run = tmp_path / "run"
    run.mkdir()
    done = subprocess.run([sys.executable, "-c", _ROWS_PAST_LIMIT, str(run)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    step, code, message = out["log"]
    assert code == errno.EFBIG
    assert f"could not write the metrics row of step {step} to {run / 'metrics.jsonl'}: File too large" in message
    assert out["close"] == "ok"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, step))


def test_a_resume_trims_and_carries_the_eval_samples_like_the_metrics_rows(tmp_path):
    """Before: eval_samples.jsonl was only appended to, so a run stopped after evaluating step 4 with its checkpoint at
    step 3 had step 4's samples twice once resumed (the resumed run evaluates step 4 again), and a resume into another
    run dir started without the earlier ones."""
    from omegaconf import OmegaConf

    from grpo.schema import LoggingConfig
    from grpo.trainer.metrics import EVAL_SAMPLES, MetricsLogger

    def stopped_run(path):
        path.mkdir()
        (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in range(5)))
        (path / EVAL_SAMPLES).write_text("".join(json.dumps({"step": s, "completion": f"c{i}"}) + "\n"
                                                 for s in (0, 2, 4) for i in range(2)))

    def resume(run_dir, resumed_from):
        run_dir.mkdir(exist_ok=True)
        MetricsLogger(run_dir, OmegaConf.structured(LoggingConfig(progress_bar=False, plot=False)),
                      OmegaConf.create({}), 6, start_step=3, resumed_from=resumed_from).close()
        return [json.loads(line)["step"] for line in (run_dir / EVAL_SAMPLES).read_text().splitlines()]

    run, other = tmp_path / "run", tmp_path / "other"
    stopped_run(run)
    earlier = (run / EVAL_SAMPLES).read_text()
    assert resume(other, run) == [0, 0, 2, 2]  # carried into another dir; the resumed one is left as it was
    assert (run / EVAL_SAMPLES).read_text() == earlier
    assert resume(run, run) == [0, 0, 2, 2]  # in its own dir: step 4's samples go, the resumed run writes them again


def test_the_report_of_a_sweep_with_a_torn_summary_or_metrics_file_names_it_and_reports_the_others(tmp_path, capsys):
    """Before: one job's summary.json cut short (a run killed or a disk full while it was written) or a bad metrics
    line made `python -m grpo.report` fail with a JSONDecodeError for the whole sweep."""
    from grpo.report import main

    for job, status in (("0", "completed"), ("1", "completed"), ("2", "failed")):
        d = tmp_path / job
        (d / ".hydra").mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5, "loss": 0.1}) + "\n"
                                                 for s in (1, 2)))
        (d / "summary.json").write_text(json.dumps({"status": status, "steps_run": 2}, indent=2))
    (tmp_path / "1" / "summary.json").write_text('{\n  "status": "compl')
    (tmp_path / "2" / "metrics.jsonl").write_text('{"step": 1, "rew\n{"step": 2, "reward/mean": 0.5}\n')
    main([str(tmp_path)])
    out, err = capsys.readouterr()
    assert f"cannot read {tmp_path / '1' / 'summary.json'}: " in err
    assert f"cannot read {tmp_path / '2' / 'metrics.jsonl'}, line 1 of 2: not a JSON row" in err
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(r["job"], r["status"], r["steps"]) for r in report] == [("0", "completed", 2), ("1", "unreadable", 2),
                                                                    ("2", "unreadable", 0)]


def test_curves_draw_the_reward_of_a_run_with_several_updates_per_batch(tmp_path, monkeypatch):
    """With train.ppo_epochs x train.mini_batches = 4 reward/mean is on each rollout batch's first row only; the
    curve was drawn through NaN gaps, so its points stood alone and curves.png's reward panel was empty."""
    import matplotlib.axes

    from grpo.trainer.metrics import plot_curves

    rows = [{"step": s, "loss": 0.1 * s, **({"reward/mean": 0.5 + s / 100} if s % 4 == 1 else {})}
            for s in range(1, 13)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn: list[tuple[list, list]] = []
    plot = matplotlib.axes.Axes.plot

    def recording_plot(ax, xs, ys, *args, **kwargs):  # what each line is given, then the real plot
        drawn.append((list(xs), list(ys)))
        return plot(ax, xs, ys, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording_plot)
    plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert drawn[0] == ([1, 5, 9], [0.51, 0.55, 0.59])  # the reward panel: one connected line
    assert drawn[1][0] == list(range(1, 13))  # the loss panel: every step
    assert len(drawn) == 2  # reward and loss: no entropy axis for a run that logged none


def test_curves_draw_the_policys_entropy_beside_the_loss(tmp_path, monkeypatch):
    """grpo/entropy goes on a right-hand axis of the loss panel (dashed), so a collapse shows in every curves.png."""
    import matplotlib.axes

    from grpo.trainer.metrics import plot_curves

    rows = [{"step": 0, "eval/accuracy": 0.2}] + [
        {"step": s, "loss": 0.1, "reward/mean": 0.5, "grpo/entropy": 2.0 / s} for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn: list[tuple[list, list, object]] = []
    plot = matplotlib.axes.Axes.plot

    def recording_plot(ax, xs, ys, *args, **kwargs):
        drawn.append((list(xs), list(ys), kwargs.get("ls")))
        return plot(ax, xs, ys, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording_plot)
    plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert ([1, 2, 3, 4], [2.0, 1.0, 2.0 / 3, 0.5], "--") in drawn
    assert (tmp_path / "curves.png").stat().st_size > 0


@pytest.mark.parametrize("durable", [True, False])
def test_served_weights_skip_the_fsyncs_and_stay_loadable(tiny_qwen2_dir, tmp_path, monkeypatch, durable):
    """Weights written only to be served next (`durable=False`, a sync's save) are not fsynced; checkpoints and
    other writes are. Either way the directory replaces an older one atomically and loads back the same tensors."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from grpo.weights.hf_dir import save_model_weights

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    out = tmp_path / "served_weights" / "v1"
    save_model_weights(model, None, out)  # an older copy to replace
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    save_model_weights(model, None, out, durable=durable)
    assert bool(synced) == durable
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    assert sorted(p.name for p in out.parent.iterdir()) == ["v1"]  # no temporary or old dir left behind


def test_a_resume_keeps_each_earlier_sessions_record_in_order(tmp_path):
    """Before, a resume in place wrote its .hydra/ and provenance.json over the earlier session's: the command and
    config of the run's first session were gone. Now each is moved into sessions/NN/ first."""
    from grpo.run_records import keep_earlier_session

    run = tmp_path / "run"
    run.mkdir()
    assert keep_earlier_session(run) is None and not (run / "sessions").exists()  # a fresh dir: nothing to keep
    for session in ("first", "second"):
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text(session)
        (run / "provenance.json").write_text(json.dumps({"argv": [session]}))
        kept = keep_earlier_session(run)
        assert not (run / ".hydra").exists() and not (run / "provenance.json").exists()
    assert kept == run / "sessions" / "02"
    assert (run / "sessions" / "01" / ".hydra" / "config.yaml").read_text() == "first"
    assert json.loads((run / "sessions" / "02" / "provenance.json").read_text()) == {"argv": ["second"]}


def test_warnings_and_log_lines_are_written_above_the_progress_bar_not_onto_it(tmp_path, capsys):
    """Issue 44.8: a warning printed onto the bar's line ("...| 1/10 [00:00<...]WARNING ...")."""
    import logging
    import sys
    import warnings

    from omegaconf import OmegaConf

    from grpo.schema import LoggingConfig
    from grpo.trainer.metrics import MetricsLogger

    console = logging.StreamHandler(sys.stderr)  # as Hydra's console handler
    logging.root.addHandler(console)
    try:
        logger = MetricsLogger(tmp_path, OmegaConf.structured(LoggingConfig(progress_bar=True, plot=False)),
                               OmegaConf.create({}), total_steps=10, start_step=0)
        logger.log({"step": 1, "loss": 0.5})
        logging.getLogger("grpo.test").warning("a log line during the run")
        warnings.warn("a Python warning during the run", UserWarning, stacklevel=1)
        logger.close()
    finally:
        logging.root.removeHandler(console)
    err = capsys.readouterr().err
    for text in ("a log line during the run", "a Python warning during the run"):
        assert text in err
        line_so_far = err[:err.index(text)].split("\n")[-1].split("\r")[-1]  # what is on the line before it
        assert "1/10" not in line_so_far and "|" not in line_so_far, repr(err)


def test_each_session_gets_its_own_vllm_log(tmp_path):
    """Issue 44.17: logs/vllm.log was appended across resumes, so a resumed run's start-up progress lines quoted the
    previous run's last messages (a leaked-semaphore warning). Each session's is kept as logs/vllm.<n>.log."""
    import subprocess
    import sys

    from conftest import REPO
    from grpo.run_records import keep_earlier_server_log

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    assert keep_earlier_server_log(run) is None
    (run / "logs" / "vllm.log").write_text("session 1\n")
    assert keep_earlier_server_log(run) == run / "logs" / "vllm.1.log"
    (run / "logs" / "vllm.log").write_text("session 2\n")
    # Through the run dir guard of a real start (stopped by a config mistake right after it).
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "~experiment", "+optimzer.lr=1", f"hydra.run.dir={run}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "unknown config key optimzer" in out.stderr, out.stderr[-2000:]
    assert not (run / "logs" / "vllm.log").exists()
    assert [(run / "logs" / f"vllm.{n}.log").read_text() for n in (1, 2)] == ["session 1\n", "session 2\n"]
