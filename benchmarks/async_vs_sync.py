"""Async vs sync throughput of the same system on the same cores.

Runs `async-rl run` once per setting (mode=sync, and mode=async for each max_staleness
given), on one config, and reports wall-clock per train step, trained trajectories per
second, the reward reached and the staleness actually seen. Writes
benchmarks/results/async_vs_sync.md (and .json) with the command that made it, and the
runs' learning curves (reward over steps and wall time, accuracy) as async_vs_sync.png.

    python benchmarks/async_vs_sync.py --config configs/debug_cpu.yaml --steps 20 --eta 1 4
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from async_rl.report import compare_runs

ROOT = Path(__file__).resolve().parents[1]


def run_one(config: str, steps: int, mode: str, eta: int, run_dir: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "launch.cli", "run", "--config", config, f"mode={mode}", f"max_staleness={eta}",
           f"total_steps={steps}", f"run_dir={run_dir}", "log.progress=false", *extra]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{mode} eta={eta} failed:\n{res.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {e["when"]: e for e in map(json.loads, (run_dir / "eval.jsonl").read_text().splitlines())}
    trained = sum(r["train/num_trajectories"] for r in rows)
    train_wall = sum(r["timing/step_s"] for r in rows)
    k = max(1, len(rows) // 4)
    return {
        "setting": f"{mode}" + (f" eta={eta}" if mode == "async" else ""),
        "wall_s": wall, "train_loop_s": train_wall, "step_s": train_wall / len(rows),
        "traj_per_s": trained / train_wall,
        "reward_first": sum(r["train/reward_mean"] for r in rows[:k]) / k,
        "reward_last": sum(r["train/reward_mean"] for r in rows[-k:]) / k,
        "staleness_max": max(r["train/staleness_max"] for r in rows),
        "interrupted": sum(r["rollout/interrupted"] for r in rows),
        "wait_s_mean": sum(r["timing/wait_s"] for r in rows) / len(rows),
        "acc_before": evals.get("before", {}).get("eval/accuracy"),
        "acc_after": evals.get("after", {}).get("eval/accuracy"),
    }


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["setting"] == "sync"), results[0])
    head = ("| setting | s/step | traj/s | speed-up | trainer wait s/step | reward first→last | "
            "acc before→after | max staleness | interrupted |")
    lines = [head, "|" + "---|" * 9]
    for r in results:
        acc = (f"{r['acc_before']:.2f}→{r['acc_after']:.2f}" if r["acc_after"] is not None else "n/a")
        lines.append(f"| {r['setting']} | {r['step_s']:.2f} | {r['traj_per_s']:.1f} | "
                     f"{r['traj_per_s'] / base['traj_per_s']:.2f}× | {r['wait_s_mean']:.2f} | "
                     f"{r['reward_first']:.2f}→{r['reward_last']:.2f} | {acc} | {r['staleness_max']} | "
                     f"{r['interrupted']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/debug_cpu.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eta", type=int, nargs="+", default=[0, 1, 4], help="max_staleness values for async runs")
    ap.add_argument("--out", default="benchmarks/results/async_vs_sync")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    results, run_dirs = [], {}
    settings = [("sync", 0)] + [("async", e) for e in args.eta]
    for mode, eta in settings:
        print(f"running {mode} eta={eta} ...", flush=True)
        run_dir = ROOT / "runs" / f"bench_{mode}_{eta}"
        results.append(run_one(args.config, args.steps, mode, eta, run_dir, args.overrides))
        run_dirs[results[-1]["setting"]] = run_dir
    text = table(results)
    print(text)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    note = ("Threads: with engine/trainer num_threads 0, sync gives each process every core (they take "
            "turns) and async gives each half. `trainer wait` is the time the trainer waited for a batch.")
    out.with_suffix(".md").write_text(f"# Async vs sync\n\nCommand: `{command}`\n\n{text}\n\n{note}\n")
    out.with_suffix(".json").write_text(json.dumps({"command": command, "results": results}, indent=2))
    curves = compare_runs(run_dirs, out.with_suffix(".png"), title="Async vs sync: learning curves")
    print(f"curves: {curves}")


if __name__ == "__main__":
    main()
