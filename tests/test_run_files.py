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
