"""Do agentic runs learn? Per-step reward and tool/user behaviour of the multi-turn configs.

    python benchmarks/agentic.py                                # tir_math (SmolLM2 + python/calculator tools)
    python benchmarks/agentic.py --config interaction_debug     # tiny model + simulated user
    python benchmarks/agentic.py --steps 12 -- max_staleness=4  # overrides after `--`

Runs `async-rl run` on the config (async, its own staleness bound) `--runs` times (3, the same
command one after the other: async batch order depends on timing, so runs differ) and summarises
each run's train steps from run_dir/metrics.jsonl: mean train reward, tool calls and tool errors
per episode, assistant and user turns per episode over the first, middle and last third of the
steps, as the median (min-max) over the runs, and every step of every run (response tokens, the
oldest token's lag, the step's wall time too). Prints the tables and writes
benchmarks/results/agentic_<config>.{md,json} with the command and the machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from async_rl.utils.metrics import read_jsonl  # noqa: E402
from benchmarks.common import write_results  # noqa: E402

# (column, metrics.jsonl key, format); a key a run does not log shows as "-"
COLUMNS = [("reward", "train/reward_mean", "{:.3f}"),
           ("tool calls / episode", "rollout/agent/tool_calls", "{:.2f}"),
           ("tool errors / episode", "rollout/agent/tool_errors", "{:.2f}"),
           ("assistant turns", "rollout/agent/turns", "{:.2f}"),
           ("user turns", "rollout/agent/user_turns", "{:.2f}"),
           ("response tokens", "train/response_len_mean", "{:.1f}"),
           ("staleness max", "train/staleness_max", "{:.0f}"),
           ("step s", "timing/step_s", "{:.1f}")]


def run(config: str, steps: int, seed: int, overrides: list[str], run_dir: Path) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "async_rl.launch.cli", "run", "--config", f"configs/{config}.yaml", f"run_dir={run_dir}",
           f"seed={seed}", f"total_steps={steps}", "log.progress=false", *overrides]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{config} failed:\n{res.stderr[-3000:]}")
    return read_jsonl(run_dir / "metrics.jsonl"), wall


def cell(row: dict, key: str, fmt: str) -> str:
    return fmt.format(row[key]) if isinstance(row.get(key), (int, float)) else "-"


def thirds(rows: list[dict], key: str) -> list[float | None]:
    """Mean of `key` over the first, middle and last third of the steps."""
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    if len(values) < 3:
        return [None, None, None]
    k = len(values) // 3
    return [statistics.mean(values[:k]), statistics.mean(values[k:-k]), statistics.mean(values[-k:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tir_math", help="a config name under configs/")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="dotted overrides for the run (after --)")
    ap.add_argument("--runs", type=int, default=3, help="runs of the same command; medians (min-max) over them")
    args = ap.parse_args()
    if args.runs < 1:
        raise SystemExit("error: --runs must be at least 1")
    runs = []
    for k in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="agentic_") as tmp:
            rows, wall = run(args.config, args.steps, args.seed, args.overrides, Path(tmp) / "run")
        runs.append({"rows": rows, "wall_s": wall, "thirds": {c: thirds(rows, key) for c, key, _ in COLUMNS[:5]}})
        print(f"run {k}: {wall:.0f} s, reward by thirds {runs[-1]['thirds']['reward']}", flush=True)
    lines = [f"{args.runs} runs of the same command, one after the other. Means over the first / middle / last "
             "third of each run's steps; median (min-max) over the runs:", "",
             "| | first | middle | last |", "|---|---|---|---|"]
    for c, _, _ in COLUMNS[:5]:
        cells = []
        for third in range(3):
            got = [r["thirds"][c][third] for r in runs if r["thirds"][c][third] is not None]
            cells.append("-" if not got else median_cell(got))
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append(f"\nWhole run (model load, generation, {args.steps} train steps): "
                 f"{median_cell([r['wall_s'] for r in runs], '.0f')} s")
    for k, r in enumerate(runs):
        lines += ["", f"Run {k}, every step:", "",
                  "| step | " + " | ".join(c for c, _, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
        lines += [f"| {row['step']} | " + " | ".join(cell(row, key, f) for _, key, f in COLUMNS) + " |"
                  for row in r["rows"]]
    text = "\n".join(lines)
    print(text)
    write_results(f"agentic_{args.config}", text, {"config": args.config, "steps": args.steps, "seed": args.seed,
                                                   "overrides": args.overrides, "runs": runs})


def median_cell(values: list[float], fmt: str = ".3f") -> str:
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


if __name__ == "__main__":
    main()
