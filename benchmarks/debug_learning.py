"""Does the debug task clearly learn? configs/debug_cpu.yaml on several seeds, async at several bounds and sync.

    python benchmarks/debug_learning.py                       # seeds 0 1 2 x {eta 0, 2, 4, sync}, 60 steps
    python benchmarks/debug_learning.py --seeds 0 --steps 30  # quicker

For each run: mean train reward of the first 5 steps, of the last 10, the first step whose
5-step moving average reaches 0.6, and the wall time. Prints a table and writes
benchmarks/results/debug_learning.{md,json} with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, write_results  # noqa: E402

SETTINGS = {"async eta=0": ["mode=async", "max_staleness=0"], "async eta=2": ["mode=async", "max_staleness=2"],
            "async eta=4": ["mode=async", "max_staleness=4"], "sync": ["mode=sync"],
            # the behaviour-correction ablation and its control (not in the default table)
            "async eta=8": ["mode=async", "max_staleness=8"],
            "async eta=8 no correction": ["mode=async", "max_staleness=8", "trainer.loss=no_behav_correction"]}
DEFAULT = ["async eta=0", "async eta=2", "async eta=4", "sync"]


def run_one(label: str, seed: int, steps: int, workdir: Path) -> dict:
    run_dir = workdir / f"{label.replace(' ', '_').replace('=', '')}_s{seed}"
    cmd = [sys.executable, "-m", "async_rl.launch.cli", "run", "--config", "configs/debug_cpu.yaml", f"run_dir={run_dir}",
           f"seed={seed}", f"total_steps={steps}", "log.progress=false", *SETTINGS[label]]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{label} seed {seed} failed: {res.stderr[-2000:]}")
    rewards = [json.loads(line)["train/reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    moving = [statistics.mean(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
    reach = next((i + 1 for i, m in enumerate(moving) if i >= 4 and m >= 0.6), None)
    return {"setting": label, "seed": seed, "first5": statistics.mean(rewards[:5]),
            "last10": statistics.mean(rewards[-10:]), "step_reach_0.6": reach, "wall_s": wall}


def _spread(values: list[float], fmt: str) -> str:
    cell = lambda v: "never" if v == float("inf") else fmt.format(v)  # noqa: E731
    return f"{cell(statistics.median(values))} ({cell(min(values))}-{cell(max(values))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--settings", nargs="+", default=DEFAULT, choices=list(SETTINGS))
    ap.add_argument("--name", default="debug_learning", help="results file name under benchmarks/results/")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="debug_learning_") as tmp:
        for label in args.settings:
            for seed in args.seeds:
                rows.append(run_one(label, seed, args.steps, Path(tmp)))
                r = rows[-1]
                print(f"{label:12s} seed {seed}: {r['first5']:.2f} -> {r['last10']:.2f}, "
                      f"0.6 at step {r['step_reach_0.6']}, {r['wall_s']:.0f}s", flush=True)
    lines = ["| setting | seed | reward first 5 steps | reward last 10 steps | first step at 0.6 (5-step avg) | wall s |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['setting']} | {r['seed']} | {r['first5']:.3f} | {r['last10']:.3f} | {r['step_reach_0.6']} "
              f"| {r['wall_s']:.0f} |" for r in rows]
    ok = all(r["first5"] <= 0.2 + 1e-9 and r["step_reach_0.6"] is not None for r in rows)
    lines.append(f"\nAll runs from <= 0.2 to >= 0.6 within {args.steps} steps: {'yes' if ok else 'NO'}")
    lines += ["", "Per setting, median (min-max) over the seeds:", "",
              "| setting | seeds | reward last 10 steps | first step at 0.6 | wall s |", "|---|---|---|---|---|"]
    for label in args.settings:
        mine = [r for r in rows if r["setting"] == label]
        reach = [r["step_reach_0.6"] if r["step_reach_0.6"] is not None else float("inf") for r in mine]
        lines.append(f"| {label} | {len(mine)} | {_spread([r['last10'] for r in mine], '{:.3f}')} | "
                     f"{_spread(reach, '{:.0f}')} | {_spread([r['wall_s'] for r in mine], '{:.0f}')} |")
    print("\n".join(lines))
    write_results(args.name, "\n".join(lines), {"rows": rows, "steps": args.steps, "all_learn": ok})


if __name__ == "__main__":
    main()
