"""Async vs sync on the same machine, the same run and the same number of trained samples.

Two set-ups, each with mode=sync and async at several `max_staleness` values:
  - pools:  generation and trainer pinned to disjoint cores in both modes (`cores.engine`,
            `cores.trainer`), as separate GPU pools are: sync leaves one pool idle while the
            other works, async overlaps them (the ceiling is 2x on two pools);
  - shared: no pinning. Sync gives every phase all cores; async splits them and, with
            `cores.share`, a side that waits lends its cores to the other.

The policy is frozen by default (`trainer.lr=0`): every step still trains, publishes, loads and
interrupts, but the policy does not move, so every setting generates the same response lengths and
the ratio measures the system alone. `--learn` trains for real (the configured learning rate); then
async and sync policies drift to different lengths and the ratio mixes learning with speed.

Throughput is measured over the whole run and in steady state (the first `--warmup` train steps,
which include start-up and the first evaluation, are left out). Reported per run: wall time, trained
tokens/s, generated tokens/s, trainer idle %, engine idle %, interrupted fraction, the staleness of
the trajectories trained (histogram), reward and held-out accuracy after the same number of trained
samples. Prints a short headline table last. Writes benchmarks/results/NAME.{md,json,png}.

    make bench                                          # sync, eta 2 and 4, one round: a few minutes
    python benchmarks/async_vs_sync.py --eta 1 2 4 8 --repeats 3 --name async_vs_sync_frozen   # the headline
    python benchmarks/async_vs_sync.py --learn          # learning on
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import drop_bulk, write_results  # noqa: E402

SETUPS = {"pools": ["cores.engine=[0]", "cores.trainer=[1]", "cores.share=false"], "shared": ["cores.share=true"]}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run_one(config: str, steps: int, setup: str, mode: str, eta: int, run_dir: Path, warmup: int,
            extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "async_rl.launch.cli", "run", "--config", config, f"mode={mode}", f"max_staleness={eta}",
           f"total_steps={steps}", f"run_dir={run_dir}", "log.progress=false", *SETUPS[setup], *extra]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    total_wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{setup} {mode} eta={eta} failed:\n{res.stderr[-2000:]}")
    drop_bulk(run_dir)
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


def _cell(values: list[float], fmt: str, unit: str = "") -> str:
    """One setting's repeats: the median, then (min-max) when there are several."""
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:{fmt}}{unit}"
    return f"{med:{fmt}}{unit} ({min(values):{fmt}}-{max(values):{fmt}})"


def _groups(results: list[dict]) -> list[tuple[str, str, list[dict]]]:
    """(set-up, setting, its repeats) in first-run order."""
    order: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        order.setdefault((r["setup"], r["setting"]), []).append(r)
    return [(s, name, runs) for (s, name), runs in order.items()]


def _base(results: list[dict], r: dict) -> dict:
    """The sync run of r's set-up in the same round (ratios are taken within a round, then summarised)."""
    return next(b for b in results if b["setup"] == r["setup"] and b["setting"] == "sync"
                and b.get("round", 0) == r.get("round", 0))


def ratios(results: list[dict], runs: list[dict], key: str) -> list[float]:
    return [r[key] / _base(results, r)[key] for r in runs]


def table(results: list[dict]) -> str:
    head = ("| set-up | setting | runs | whole run s | trained traj/s | vs sync | trained tok/s | vs sync | "
            "steady traj/s | vs sync | of ceiling | generated tok/s | trainer idle | engine idle | interrupted | "
            "staleness of arrivals, all runs (lag 0,1,..,>eta) | reward last 5 | acc after |")
    lines = [head, "|" + "---|" * 18]
    for setup, setting, runs in _groups(results):
        med = {k: statistics.median(r[k] for r in runs) for k in
               ("run_wall_s", "run_trained_traj_per_s", "run_trained_tokens_per_s", "trained_traj_per_s",
                "generated_tokens_per_s", "trainer_idle_frac", "interrupted_frac", "reward_last")}
        steady = ratios(results, runs, "trained_traj_per_s")
        tops = [ceiling(_base(results, r)) for r in runs] if setup == "pools" else []
        of_top = ("" if setting == "sync" or not tops or None in tops
                  else f"{100 * statistics.median(s / t for s, t in zip(steady, tops)):.0f}% of "
                       f"{statistics.median(tops):.2f}x")
        idle = [r["engine_idle_frac"] for r in runs if r["engine_idle_frac"] is not None]
        eng = "n/a" if not idle else f"{100 * statistics.median(idle):.0f}%"
        accs = [r["acc_after"] for r in runs if r["acc_after"] is not None]
        acc = "n/a" if not accs else f"{statistics.median(accs):.2f}"
        hist: list[int] = []
        for r in runs:
            h = r["staleness_hist"]
            hist = [a + b for a, b in zip(hist + [0] * (len(h) - len(hist)), h + [0] * (len(hist) - len(h)))]
        lines.append(
            f"| {setup} | {setting} | {len(runs)} | {_cell([r['run_wall_s'] for r in runs], '.1f')} | "
            f"{med['run_trained_traj_per_s']:.1f} | {_cell(ratios(results, runs, 'run_trained_traj_per_s'), '.2f', 'x')} | "
            f"{med['run_trained_tokens_per_s']:.0f} | "
            f"{_cell(ratios(results, runs, 'run_trained_tokens_per_s'), '.2f', 'x')} | "
            f"{med['trained_traj_per_s']:.1f} | {_cell(steady, '.2f', 'x')} | {of_top} | "
            f"{med['generated_tokens_per_s']:.0f} | {100 * med['trainer_idle_frac']:.0f}% | {eng} | "
            f"{100 * med['interrupted_frac']:.0f}% | {hist} | {med['reward_last']:.2f} | {acc} |")
    return "\n".join(lines)


def headline(results: list[dict]) -> str:
    """The short table: whole-run trained trajectories/s and its ratio to sync, trainer idle, dropped."""
    lines = ["| set-up | setting | runs | trained traj/s | vs sync | trained tok/s vs sync | trainer idle | "
             "dropped over the bound |", "|" + "---|" * 8]
    for setup, setting, runs in _groups(results):
        lines.append(
            f"| {setup} | {setting} | {len(runs)} | "
            f"{statistics.median(r['run_trained_traj_per_s'] for r in runs):.1f} | "
            f"{_cell(ratios(results, runs, 'run_trained_traj_per_s'), '.2f', 'x')} | "
            f"{_cell(ratios(results, runs, 'run_trained_tokens_per_s'), '.2f', 'x')} | "
            f"{100 * statistics.median(r['trainer_idle_frac'] for r in runs):.0f}% | "
            f"{statistics.median(r['dropped_stale'] for r in runs):.0f} |")
    return "\n".join(lines)


def policy_overrides(learn: bool, overrides: list[str]) -> list[str]:
    """Frozen (trainer.lr=0) unless `learn`; a learning rate given without --learn is one error."""
    if learn:
        return overrides
    lrs = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "trainer.lr"]
    if any(lr.strip() not in ("0", "0.0", "0e0", "0.0e0") for lr in lrs):
        raise SystemExit(f"error: trainer.lr={lrs[-1]}: the comparison freezes the policy (trainer.lr=0); "
                         "pass --learn to train at a learning rate")
    return ["trainer.lr=0", *overrides]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/bench_cpu.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="train steps left out of the throughput window")
    ap.add_argument("--eta", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="max_staleness of the async runs")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--quick", action="store_true", help="8 steps, sync and eta 2 only: about 2 minutes a round")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of every setting (each round runs them all once, so drift hits every setting "
                         "alike); the table shows medians (min-max), ratios to sync taken within a round")
    ap.add_argument("--name", default="async_vs_sync", help="results file name under benchmarks/results/")
    ap.add_argument("--runs", default="runs/bench", help="where the run directories go (SETUP_MODE_ETA_rROUND)")
    ap.add_argument("--learn", action="store_true",
                    help="train at the config's learning rate (default: frozen policy, trainer.lr=0)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    ap.add_argument("--render", metavar="JSON", help="re-render the table of a saved results file, run nothing")
    args = ap.parse_args()
    if args.render:
        saved = json.loads(Path(args.render).read_text())["results"]
        print(table(saved) + "\n\n" + headline(saved))
        return
    if args.quick:
        args.steps, args.eta, args.warmup = 8, [2], 2
    if args.repeats < 1:
        raise SystemExit("error: --repeats must be at least 1")
    overrides = policy_overrides(args.learn, args.overrides)
    results, curves = [], {}
    for rnd in range(args.repeats):
        for setup in args.setups:
            for mode, eta in [("sync", 0)] + [("async", e) for e in args.eta]:
                run_dir = ROOT / args.runs / f"{setup}_{mode}_{eta}_r{rnd}"
                print(f"round {rnd + 1}/{args.repeats} {setup}: {mode} eta={eta} ...", flush=True)
                results.append(run_one(args.config, args.steps, setup, mode, eta, run_dir, args.warmup,
                                       overrides) | {"round": rnd})
                if rnd == 0:
                    curves[f"{setup} {results[-1]['setting']}"] = run_dir
    text = table(results)
    print(text)
    key = "run_trained_traj_per_s"
    summary = {s: max(statistics.median(ratios(results, runs, key)) for setup, name, runs in _groups(results)
                      if setup == s and name != "sync") for s in args.setups}
    note = (f"\n\nPolicy: {'learning (--learn)' if args.learn else 'frozen (trainer.lr=0)'}. "
            f"{args.repeats} round(s), each running every setting once; cells are medians over the rounds, "
            "(min-max) where shown; a ratio to sync is taken within its round. Best async / sync trained "
            "trajectories/s over the whole run (median): "
            + ", ".join(f"{s} {v:.2f}x" for s, v in summary.items())
            + ". Whole run: from the moment the rollout side starts generating to the last train step (pipeline "
            "fill included); every run trains total_steps x batch_size trajectories, less those dropped as too "
            f"stale. Steady: steps {args.warmup + 1}..{args.steps - 1} only (at large eta it also consumes the "
            "backlog generated during the warm-up, so it can exceed the 2x ceiling of two pools). Idle: share of "
            "the steady window the trainer waited for a batch / the engine had nothing to decode. Of ceiling (pools): "
            "steady async / sync against 1 / (sync's busier pool's share of its step), the most two pools can "
            "overlap (2x only when generation and training take equally long). Staleness of "
            "arrivals: the lag of each arriving trajectory's oldest token; the last bin (> eta) was dropped.")
    short = headline(results)
    write_results(args.name, text + note + "\n\n" + short, {"results": results, "speedup": summary,
                                                          "steps": args.steps, "repeats": args.repeats,
                                                          "learn": args.learn})
    from async_rl.report import compare_runs

    compare_runs(curves, ROOT / "benchmarks" / "results" / f"{args.name}.png", title="Async vs sync: learning curves")
    print(f"\n{short}\n\nbest async / sync, trained trajectories/s over the whole run: "
          + ", ".join(f"{s} {v:.2f}x" for s, v in summary.items())
          + f" ({args.repeats} round(s); benchmarks/results/{args.name}.md)")


if __name__ == "__main__":
    main()
