"""The run summary's times are wall-clock and its accuracy targets come from the config."""

import json
from pathlib import Path

from async_rl.config import load_config
from async_rl.launch.local import summary

DEBUG = str(Path(__file__).resolve().parents[2] / "configs" / "debug_cpu.yaml")


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_times_are_wall_clock_and_targets_come_from_the_config(tmp_path):
    # three 1 s steps ending at 110, 120, 130: the trainer mostly waited, generation began at 105
    _write(tmp_path / "metrics.jsonl", [{"step": s, "time": 110.0 + 10 * s, "timing/step_s": 1.0,
                                         "train/reward_mean": 0.1 * s} for s in range(3)])
    _write(tmp_path / "rollout_metrics.jsonl", [{"step": 0, "time": 105.0, "rollout/generation_started": 1.0}])
    _write(tmp_path / "eval.jsonl", [
        {"when": "before", "policy_version": 0, "eval/accuracy": 0.0, "eval/n": 3},
        {"when": "periodic", "step": 2, "timing/train_wall_s": 14.0, "eval/accuracy": 0.667},
        {"when": "after", "policy_version": 3, "eval/accuracy": 0.667, "eval/n": 3}])
    lines = summary(load_config(DEBUG, [f"run_dir={tmp_path}", "task.eval_targets=[0.5,0.9]"]))
    assert ("wall time: 25.0s from the first generation to the end of the last of 3 train steps "
            "(3.0s inside train steps)") in lines
    assert "greedy accuracy on 3 held-out problems (none trained on): before 0.000 -> after 0.667" in lines
    assert [line for line in lines if line.startswith("time to accuracy")] == [
        "time to accuracy >= 0.50: 14s of training, wall clock (version 2)", "time to accuracy >= 0.90: not reached"]
    plain = summary(load_config(DEBUG, [f"run_dir={tmp_path}"]))  # the debug task names no target
    assert not [line for line in plain if line.startswith("time to accuracy")]
