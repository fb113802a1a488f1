"""Do agentic runs learn? Per-step reward and tool/user behaviour of the multi-turn configs.

    python benchmarks/agentic.py                                # tir_math (SmolLM2 + python/calculator tools)
    python benchmarks/agentic.py --config interaction_debug     # tiny model + simulated user
    python benchmarks/agentic.py --steps 12 -- max_staleness=4  # overrides after `--`

Runs `async-rl run` on the config (async, its own staleness bound) and tabulates every train
step from run_dir/metrics.jsonl: mean train reward, tool calls and tool errors per episode,
assistant and user turns per episode, response tokens, the oldest token's lag and the step's
wall time. Prints the table and writes benchmarks/results/agentic_<config>.{md,json} with the
command and the machine.
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
    cmd = [sys.executable, "-m", "launch.cli", "run", "--config", f"configs/{config}.yaml", f"run_dir={run_dir}",
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
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="agentic_") as tmp:
        rows, wall = run(args.config, args.steps, args.seed, args.overrides, Path(tmp) / "run")
    lines = ["| step | " + " | ".join(c for c, _, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    lines += [f"| {r['step']} | " + " | ".join(cell(r, k, f) for _, k, f in COLUMNS) + " |" for r in rows]
    summary = {c: thirds(rows, k) for c, k, _ in COLUMNS[:5]}
    lines += ["", "Means over the first / middle / last third of the steps:", "",
              "| | first | middle | last |", "|---|---|---|---|"]
    lines += [f"| {c} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in vals) + " |"
              for c, vals in summary.items()]
    lines.append(f"\nWhole run (model load, generation, {len(rows)} train steps): {wall:.0f} s")
    text = "\n".join(lines)
    print(text)
    write_results(f"agentic_{args.config}", text, {"config": args.config, "steps": args.steps, "seed": args.seed,
                                                   "overrides": args.overrides, "wall_s": wall, "rows": rows,
                                                   "thirds": summary})


if __name__ == "__main__":
    main()
