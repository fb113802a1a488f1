"""Async vs sync on the same machine, the same run and the same number of trained samples.

Two set-ups, each with mode=sync and async at several `max_staleness` values:
  - pools:  generation and trainer pinned to disjoint cores in both modes (`cores.engine`,
            `cores.trainer`), as separate GPU pools are: sync leaves one pool idle while the
            other works, async overlaps them (the ceiling is 2x on two pools);
  - shared: no pinning. Sync gives every phase all cores; async splits them and, with
            `cores.share`, a side that waits lends its cores to the other.

Throughput is measured in steady state (the first `--warmup` train steps, which include
start-up and the first evaluation, are left out). Reported per run: wall time, trained
tokens/s, generated tokens/s, trainer idle %, engine idle %, interrupted fraction, the
staleness of the trajectories trained (histogram), reward and held-out accuracy after
the same number of trained samples. Writes benchmarks/results/async_vs_sync.{md,json,png}.

    python benchmarks/async_vs_sync.py --quick          # under 5 minutes
    python benchmarks/async_vs_sync.py                  # configs/bench_cpu.yaml, 20 steps, eta 0 1 2 4 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_results  # noqa: E402

SETUPS = {"pools": ["cores.engine=[0]", "cores.trainer=[1]", "cores.share=false"], "shared": ["cores.share=true"]}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run_one(config: str, steps: int, setup: str, mode: str, eta: int, run_dir: Path, warmup: int,
            extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "launch.cli", "run", "--config", config, f"mode={mode}", f"max_staleness={eta}",
           f"total_steps={steps}", f"run_dir={run_dir}", "log.progress=false", *SETUPS[setup], *extra]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    total_wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{setup} {mode} eta={eta} failed:\n{res.stderr[-2000:]}")
    return measure(run_dir, warmup) | {"setup": setup, "setting": mode + (f" eta={eta}" if mode == "async" else ""),
                                       "total_wall_s": total_wall}


def measure(run_dir: Path, warmup: int) -> dict:
    rows = _jsonl(run_dir / "metrics.jsonl")
    if len(rows) <= warmup + 1:
        raise SystemExit(f"{run_dir}: {len(rows)} steps is too few for a warm-up of {warmup}")
    window = rows[warmup + 1:]  # steady state: from the end of step `warmup` to the end of the run
    wall = rows[-1]["time"] - rows[warmup]["time"]
    trained_tokens = sum(r["train/num_tokens"] for r in window)
    arrived = [r["train/num_trajectories"] + r["train/dropped_stale"] for r in window]
    generated = sum(n * r["train/response_len_mean"] for n, r in zip(arrived, window))
    hist: list[int] = []
    for r in window:
        h = r.get("train/staleness_hist") or []
        hist = [a + b for a, b in zip(hist + [0] * (len(h) - len(hist)), h + [0] * (len(hist) - len(h)))]
    evals = {e.get("when"): e for e in _jsonl(run_dir / "eval.jsonl")}
    rollout_rows = _jsonl(run_dir / "rollout_metrics.jsonl")
    started = next((r["time"] for r in rollout_rows if "rollout/generation_started" in r), None)
    whole = rows[-1]["time"] - started if started is not None else None  # pipeline fill and drain included
    pool = [r for r in rollout_rows if "engine/idle_s_total" in r]
    inside = [r for r in pool if rows[warmup]["time"] <= r["time"] <= rows[-1]["time"]]
    engine_idle = ((inside[-1]["engine/idle_s_total"] - inside[0]["engine/idle_s_total"])
                   / max(1e-9, inside[-1]["time"] - inside[0]["time"])) if len(inside) >= 2 else None
    return {
        "steps_measured": len(window), "wall_s": wall, "trained_tokens_per_s": trained_tokens / wall,
        "trained_traj_per_s": sum(r["train/num_trajectories"] for r in window) / wall,
        "run_wall_s": whole, "run_trained_traj_per_s": (sum(r["train/num_trajectories"] for r in rows) / whole
                                                        if whole else None),
        "run_trained_tokens_per_s": sum(r["train/num_tokens"] for r in rows) / whole if whole else None,
        "generated_tokens_per_s": generated / wall, "trained_traj": sum(r["train/num_trajectories"] for r in rows),
        "trainer_idle_frac": sum(r["timing/wait_s"] for r in window) / wall,
        "engine_idle_frac": engine_idle,
        "interrupted_frac": sum(r["rollout/interrupted"] for r in window) / max(1.0, sum(arrived)),
        "staleness_hist": hist, "dropped_stale": sum(r["train/dropped_stale"] for r in rows),
        "reward_last": sum(r["train/reward_mean"] for r in rows[-5:]) / len(rows[-5:]),
        "acc_after": evals.get("after", {}).get("eval/accuracy"),
    }


def ceiling(sync: dict) -> float | None:
    """The most overlapping can give on two pools: sync's step over its busier pool's share of it
    (2x only when generation and training take equally long; the busier pool bounds async)."""
    if sync["engine_idle_frac"] is None:
        return None
    return 1.0 / max(1.0 - sync["trainer_idle_frac"], 1.0 - sync["engine_idle_frac"], 1e-9)


def table(results: list[dict]) -> str:
    head = ("| set-up | setting | whole run s | trained traj/s | vs sync | trained tok/s | vs sync | steady traj/s | "
            "vs sync | of ceiling | generated tok/s | trainer idle | engine idle | interrupted | staleness of arrivals "
            "(lag 0,1,..,>eta) | reward last 5 | acc after |")
    lines = [head, "|" + "---|" * 17]
    for r in results:
        base = next(b for b in results if b["setup"] == r["setup"] and b["setting"] == "sync")
        top = ceiling(base) if r["setup"] == "pools" else None
        steady = r["trained_traj_per_s"] / base["trained_traj_per_s"]
        of_top = "" if top is None or r is base else f"{100 * steady / top:.0f}% of {top:.2f}x"
        eng = "n/a" if r["engine_idle_frac"] is None else f"{100 * r['engine_idle_frac']:.0f}%"
        acc = "n/a" if r["acc_after"] is None else f"{r['acc_after']:.2f}"
        lines.append(
            f"| {r['setup']} | {r['setting']} | {r['run_wall_s']:.1f} | {r['run_trained_traj_per_s']:.1f} | "
            f"{r['run_trained_traj_per_s'] / base['run_trained_traj_per_s']:.2f}x | "
            f"{r['run_trained_tokens_per_s']:.0f} | "
            f"{r['run_trained_tokens_per_s'] / base['run_trained_tokens_per_s']:.2f}x | "
            f"{r['trained_traj_per_s']:.1f} | {steady:.2f}x | {of_top} | "
            f"{r['generated_tokens_per_s']:.0f} | "
            f"{100 * r['trainer_idle_frac']:.0f}% | {eng} | {100 * r['interrupted_frac']:.0f}% | "
            f"{r['staleness_hist']} | {r['reward_last']:.2f} | {acc} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/bench_cpu.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="train steps left out of the throughput window")
    ap.add_argument("--eta", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="max_staleness of the async runs")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--quick", action="store_true", help="8 steps, sync and eta 2 only: under 5 minutes")
    ap.add_argument("--name", default="async_vs_sync", help="results file name under benchmarks/results/")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    ap.add_argument("--render", metavar="JSON", help="re-render the table of a saved results file, run nothing")
    args = ap.parse_args()
    if args.render:
        print(table(json.loads(Path(args.render).read_text())["results"]))
        return
    if args.quick:
        args.steps, args.eta, args.warmup = 8, [2], 2
    results, curves = [], {}
    for setup in args.setups:
        for mode, eta in [("sync", 0)] + [("async", e) for e in args.eta]:
            run_dir = ROOT / "runs" / "bench" / f"{setup}_{mode}_{eta}"
            print(f"{setup}: {mode} eta={eta} ...", flush=True)
            results.append(run_one(args.config, args.steps, setup, mode, eta, run_dir, args.warmup, args.overrides))
            curves[f"{setup} {results[-1]['setting']}"] = run_dir
    text = table(results)
    print(text)
    key = "run_trained_tokens_per_s"
    summary = {s: max(r[key] for r in results if r["setup"] == s and r["setting"] != "sync")
               / next(r[key] for r in results if r["setup"] == s and r["setting"] == "sync") for s in args.setups}
    note = ("\n\nBest async / sync trained tokens/s over the whole run: "
            + ", ".join(f"{s} {v:.2f}x" for s, v in summary.items())
            + ". Whole run: from the moment the rollout side starts generating to the last train step (pipeline "
            "fill included); every run trains total_steps x batch_size trajectories, less those dropped as too "
            f"stale. Steady: steps {args.warmup + 1}..{args.steps - 1} only (at large eta it also consumes the "
            "backlog generated during the warm-up, so it can exceed the 2x ceiling of two pools). Idle: share of "
            "the steady window the trainer waited for a batch / the engine had nothing to decode. Of ceiling (pools): "
            "steady async / sync against 1 / (sync's busier pool's share of its step), the most two pools can "
            "overlap (2x only when generation and training take equally long). Staleness of "
            "arrivals: the lag of each arriving trajectory's oldest token; the last bin (> eta) was dropped.")
    write_results(args.name, text + note, {"results": results, "speedup": summary, "steps": args.steps})
    from async_rl.report import compare_runs

    compare_runs(curves, ROOT / "benchmarks" / "results" / f"{args.name}.png", title="Async vs sync: learning curves")


if __name__ == "__main__":
    main()
