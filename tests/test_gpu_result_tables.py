"""The scripts that turn a lease's raw files into bench/gpu/README.md's figures: the time-to-TRL table and the
scaling table. Their numbers are the issues' bars, so the arithmetic is checked on small files made here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import real_model_curves  # noqa: E402


def write_ours(path: Path, evals: list[tuple[int, float, float, float]]) -> None:
    """metrics.jsonl rows: (step, accuracy, run seconds at the evaluation's end, the evaluation's seconds)."""
    rows = [{"step": s, "eval/accuracy": a, "time/run_seconds": t, "eval/seconds": e} for s, a, t, e in evals]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_layout_table_times_each_run_to_trls_final_accuracy_with_evaluations_taken_out(tmp_path):
    # Evaluations of 5 s each: training seconds at step 100 are 65 - 5 - 5 - 5 = 50.
    write_ours(tmp_path / "fast.metrics.jsonl", [(0, 0.15, 5, 5), (50, 0.5, 35, 5), (100, 0.72, 65, 5)])
    write_ours(tmp_path / "slow.metrics.jsonl", [(0, 0.15, 5, 5), (50, 0.4, 60, 5), (100, 0.70, 120, 5)])
    trl_rows = [{"step": 0, "eval/accuracy": 0.15, "time/train_seconds": 0.0},
                {"step": 100, "eval/accuracy": 0.71, "time/train_seconds": 200.0}]
    (tmp_path / "trl_s0.json").write_text(json.dumps({"rows": trl_rows}))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real_model_curves.plot_layouts(tmp_path, plt, {"ours k=1": "fast", "other": "slow", "TRL": "trl_s0"})
    table = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in
             (tmp_path / "table.md").read_text().splitlines()[2:]}
    assert table["ours k=1"][2:5] == ["50", "50", "0.25 |"]  # reaches 0.71 at 50 training s: 0.25x TRL's 200 s
    assert table["other"][3:5] == ["never", "never |"]  # ends at 0.70, under TRL's final
    assert table["TRL"][3:5] == ["200", "1.00 |"]
    assert (tmp_path / "layouts.png").stat().st_size > 0


def test_scale_table_reads_a_run_collected_while_it_was_still_going(tmp_path):
    step_rows = [{"step": s, "generation/tokens_per_s": 1000.0 * s, "server/replica0/requests": 1,
                  "server/replica1/requests": 1} for s in range(1, 7)]
    (tmp_path / "r2.metrics.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in step_rows))
    (tmp_path / "r1.metrics.jsonl").write_text(json.dumps({"step": 1, "generation/tokens_per_s": 7.0}) + "\n")
    (tmp_path / "r1.metrics.partial.jsonl").write_text(json.dumps({"step": 1, "generation/tokens_per_s": 9.0}) + "\n")
    out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "scale_table.py"), str(tmp_path), "--skip", "3"],
                         capture_output=True, text=True, check=True).stdout
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in out.splitlines()[2:]}
    assert rows["r2"][1:5] == ["2", "6", "-", "-"] and rows["r2"][5] == "5e+03"  # median of steps 4-6, 2 replicas
    assert rows["r1"][5] == "7"  # the finished run's file, not its partial copy


def test_pair_table_times_each_run_to_the_final_accuracy_of_the_trl_run_beside_it(tmp_path):
    write_ours(tmp_path / "ours_s1.metrics.jsonl", [(0, 0.15, 5, 5), (50, 0.60, 35, 5), (100, 0.70, 65, 5)])
    write_ours(tmp_path / "ours_s2.metrics.jsonl", [(0, 0.15, 5, 5), (50, 0.65, 35, 5), (100, 0.66, 65, 5)])
    for seed, final in ((1, 0.72), (2, 0.62)):
        rows = [{"step": 0, "eval/accuracy": 0.15, "time/train_seconds": 0.0},
                {"step": 100, "eval/accuracy": final, "time/train_seconds": 80.0}]
        (tmp_path / f"trl_s{seed}.json").write_text(json.dumps({"rows": rows}))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real_model_curves.plot_pairs(tmp_path, plt, [("ours_s1", "trl_s1"), ("ours_s2", "trl_s2")])
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in
            (tmp_path / "pairs.md").read_text().splitlines()[2:]}
    # Training seconds 0, 25, 50 (evaluations of 5 s out). s1 never reaches its TRL's 0.72; its best within 40 s
    # (0.5x TRL's 80) is the 0.60 at 25 s, not the 0.70 at 50 s.
    assert rows["ours_s1"][4:7] == ["0.720", "never", "0.600 |"]
    # s2 reaches its own TRL's 0.62 (not s1's) at 25 training s: 0.31x.
    assert rows["ours_s2"][4:7] == ["0.620", "25 s, 0.31x", "0.650 |"]
    assert (tmp_path / "pairs.png").stat().st_size > 0


def test_sync_table_shows_the_servers_phases_and_the_worst_weight_match(tmp_path):
    rows = [{"step": s, "sync/seconds": 0.1 * s, "sync/server_receive_seconds": 0.05, "sync/weights_match": 1.0}
            for s in range(1, 6)]
    rows[3]["sync/weights_match"] = 0.0  # one sync whose weights did not arrive as sent
    (tmp_path / "bcast.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "scale_table.py"), str(tmp_path), "--skip", "1",
                          "--sync"], capture_output=True, text=True, check=True).stdout
    head, _, line = out.splitlines()
    cells = dict(zip(head.strip("| ").split(" | "), line.strip("| ").split(" | ")))
    assert cells["sync s"] == "0.35" and cells["receive s"] == "0.05"  # medians of steps 2-5
    assert cells["weights match (worst)"] == "0" and cells["start s"] == "-"


def test_pipeline_view_gives_the_mean_step_beside_the_median_and_the_trainers_wait(tmp_path):
    # Two batches in flight: the step alternates 0.2 s (no wait) and 0.6 s (0.4 s waited for the batch).
    step_rows = [{"step": s, "time/step_seconds": 0.2 if s % 2 else 0.6,
                  "async/trainer_wait_seconds": 0.0 if s % 2 else 0.4} for s in range(1, 11)]
    (tmp_path / "k1x2.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in step_rows))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "scale_table.py"), str(tmp_path), "--skip", "2",
                          "--pipeline"], capture_output=True, text=True, check=True).stdout
    head = out.splitlines()[0].split(" | ")
    cells = dict(zip(head, out.splitlines()[2].split(" | ")))
    assert cells["step s (mean)"] == "0.4"  # steps 3-10: four of 0.2 s and four of 0.6 s
    assert cells["trainer wait s (mean)"] == "0.2"
    assert cells["generation s"] == "-"  # not in these rows


def test_compressed_results_read_as_the_plain_files_did(tmp_path):
    """The larger raw files are committed gzip-compressed (bench/gpu/result_files.py) so the checkout leaves the kit
    room in a device call: the tables must come out the same from the compressed copies."""
    import result_files

    step_rows = [{"step": s, "generation/tokens_per_s": 1000.0 * s, "padding": "x" * 200} for s in range(1, 2000)]
    for r in step_rows[99::100]:  # an evaluation every 100 steps
        r.update({"eval/accuracy": r["step"] / 4000, "time/run_seconds": r["step"] * 0.5, "eval/seconds": 2.0})
    (tmp_path / "big.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in step_rows))
    write_ours(tmp_path / "small.metrics.jsonl", [(0, 0.15, 5, 5), (50, 0.5, 35, 5)])
    table = [sys.executable, str(REPO / "bench" / "gpu" / "scale_table.py"), str(tmp_path), "--skip", "3"]
    before = subprocess.run(table, capture_output=True, text=True, check=True).stdout
    curve = real_model_curves.ours_curve(tmp_path / "big.metrics.jsonl")
    assert len(curve) == 19

    assert result_files.compress_large(tmp_path) == [tmp_path / "big.metrics.jsonl"]  # the small one stays plain
    assert not (tmp_path / "big.metrics.jsonl").exists() and (tmp_path / "big.metrics.jsonl.gz").exists()
    assert result_files.find(tmp_path, "*.metrics.jsonl") == [tmp_path / "big.metrics.jsonl",
                                                              tmp_path / "small.metrics.jsonl"]
    assert subprocess.run(table, capture_output=True, text=True, check=True).stdout == before
    assert real_model_curves.ours_curve(tmp_path / "big.metrics.jsonl") == curve
    assert "| big |" in before and "| small |" in before


def test_long_completion_table_takes_medians_after_the_first_step_and_shares_of_the_step(tmp_path):
    def row(step, step_s, wait_s, gen_s, peak):
        return {"step": step, "time/step_seconds": step_s, "time/data_seconds": wait_s, "generation/seconds": gen_s,
                "time/train_seconds": 2.0, "sync/seconds": 0.5, "perf/mfu": 0.3, "memory/peak_gb": peak,
                "tokens/trained": 1000.0}

    # The first step (warm-up) is left out of the medians but not of the memory peak.
    rows = [row(1, 60.0, 50.0, 50.0, 40.0), row(2, 10.0, 4.0, 8.0, 30.0), row(3, 12.0, 6.0, 8.0, 31.0),
            row(4, 20.0, 5.0, 9.0, 32.0)]
    (tmp_path / "L2k_1gpu_async.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "L2k_trl.json").write_text(json.dumps({"impl": "trl", "step_s": [9.0, 3.0, 4.0],
                                                       "steady_step_s_median": 3.5}))
    (tmp_path / "jobs.json").write_text(json.dumps([{"not": "a result"}]))
    subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "long_completions.py"), str(tmp_path), "--out",
                    str(tmp_path / "table")], check=True, capture_output=True)
    got = {r["job"]: r for r in json.loads((tmp_path / "table" / "long_completions.json").read_text())}
    ours = got["L2k_1gpu_async"]
    assert (ours["steps"], ours["step_s"], ours["wait_s"], ours["gen_s"]) == (4, 12.0, 5.0, 8.0)
    assert ours["wait_share"] == 5.0 / 12.0 and ours["gen_share"] == 8.0 / 12.0 and ours["peak_gb"] == 40.0
    assert ours["tokens_per_s"] == 1000.0 / 12.0 and ours["mfu"] == 0.3
    assert got["L2k_trl"] == {"job": "L2k_trl", "impl": "trl", "steps": 3, "step_s": 3.5}
    assert set(got) == {"L2k_1gpu_async", "L2k_trl"}
    table = (tmp_path / "table" / "long_completions.md").read_text().splitlines()
    assert table[0].startswith("| job | steps | step s | wait s") and len(table) == 4
