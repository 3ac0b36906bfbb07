"""summary.json's reward figures: named for what they are, over every step of the run dir (issue 22.1)."""

from __future__ import annotations

import json

from grpo.run import RunSummary


def test_first10_and_last10_reward_means_cover_every_step_of_a_resumed_run(tmp_path):
    # Steps 1-20 in metrics.jsonl (a run resumed in place at step 10); this session returned steps 11-20 only.
    rewards = [0.05 * s for s in range(1, 21)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": r}) + "\n"
                                                    for s, r in zip(range(1, 21), rewards)))
    objective = RunSummary(tmp_path).finish(rewards[10:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_run"] == 20
    assert summary["first10_reward_mean"] == sum(rewards[:10]) / 10
    assert summary["last10_reward_mean"] == objective == sum(rewards[10:]) / 10
    assert "final_reward" not in summary and "first_reward" not in summary


def test_without_metrics_the_session_rewards_are_used_and_a_short_run_has_equal_means(tmp_path):
    RunSummary(tmp_path).finish([0.1, 0.3])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["first10_reward_mean"] == summary["last10_reward_mean"] == 0.2
    assert summary["best_reward"] == 0.3 and summary["status"] == "completed"
