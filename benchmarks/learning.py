"""Is async learning sound? Held-out accuracy at equal trained samples, sync vs async, several seeds.

SmolLM2-135M on arithmetic (configs/smollm2_arith.yaml): sync and async at max_staleness 1, 2, 4,
three seeds each, plus async at a large bound with the behaviour-policy correction switched off
(`trainer.loss=no_behav_correction`) to show what the decoupled loss buys. Every run evaluates
greedy accuracy on the held-out set every `--eval-every` versions beside training, so
time-to-accuracy (training wall time of the first evaluation at >= 0.70 and >= 0.75) is measured.

    python benchmarks/learning.py                                   # the full table (hours on 2 CPU cores)
    python benchmarks/learning.py --seeds 0 --settings sync async-2  # a slice

Prints a table (mean +- std over seeds) and writes benchmarks/results/learning.{md,json,png}.
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

from benchmarks.common import write_results  # noqa: E402

SETTINGS = {
    "sync": ["mode=sync"],
    "async-1": ["mode=async", "max_staleness=1"],
    "async-2": ["mode=async", "max_staleness=2"],
    "async-4": ["mode=async", "max_staleness=4"],
    "async-8-no-correction": ["mode=async", "max_staleness=8", "trainer.loss=no_behav_correction"],
    "async-8": ["mode=async", "max_staleness=8"],
}
DEFAULT = ["sync", "async-1", "async-2", "async-4", "async-8-no-correction"]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run_one(config: str, label: str, seed: int, steps: int, eval_every: int, run_dir: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "launch.cli", "run", "--config", config, f"seed={seed}", f"total_steps={steps}",
           f"run_dir={run_dir}", f"rollout.eval_every={eval_every}", "log.progress=false", *SETTINGS[label], *extra]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{label} seed {seed} failed:\n{res.stderr[-2000:]}")
    evals = _jsonl(run_dir / "eval.jsonl")
    periodic = [e for e in evals if e["when"] == "periodic"]
    final = next(e for e in evals if e["when"] == "after")
    before = next(e for e in evals if e["when"] == "before")

    def reach(threshold: float) -> float | None:
        return next((e["timing/train_wall_s"] for e in periodic if e["eval/accuracy"] >= threshold), None)

    return {"setting": label, "seed": seed, "acc_before": before["eval/accuracy"], "acc_after": final["eval/accuracy"],
            "time_to_0.70_s": reach(0.70), "time_to_0.75_s": reach(0.75), "wall_s": time.perf_counter() - t0,
            "curve": [(e["step"], e["timing/train_wall_s"], e["eval/accuracy"]) for e in periodic]}


def _mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def table(rows: list[dict]) -> str:
    lines = ["| setting | seeds | accuracy before | accuracy after (equal trained samples) | time to 0.70 s | "
             "time to 0.75 s | runs reaching 0.75 |", "|---|---|---|---|---|---|---|"]
    for label in dict.fromkeys(r["setting"] for r in rows):
        rs = [r for r in rows if r["setting"] == label]
        t70 = [r["time_to_0.70_s"] for r in rs if r["time_to_0.70_s"] is not None]
        t75 = [r["time_to_0.75_s"] for r in rs if r["time_to_0.75_s"] is not None]
        lines.append(f"| {label} | {len(rs)} | {_mean_std([r['acc_before'] for r in rs])} | "
                     f"{_mean_std([r['acc_after'] for r in rs])} | {_mean_std(t70)} | {_mean_std(t75)} | "
                     f"{len(t75)}/{len(rs)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2_arith.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--settings", nargs="+", default=DEFAULT, choices=list(SETTINGS))
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--name", default="learning")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the result of a run already finished under runs/learning/ (resume an interrupted table)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    rows, curves = [], {}
    for label in args.settings:
        for seed in args.seeds:
            run_dir = ROOT / "runs" / "learning" / f"{label}_s{seed}"
            saved = run_dir / "learning_row.json"
            if args.reuse and saved.is_file():
                rows.append(json.loads(saved.read_text()))
            else:
                rows.append(run_one(args.config, label, seed, args.steps, args.eval_every, run_dir, args.overrides))
                saved.write_text(json.dumps(rows[-1]))
            curves[f"{label} seed {seed}"] = run_dir
            r = rows[-1]
            print(f"{label} seed {seed}: accuracy {r['acc_before']:.3f} -> {r['acc_after']:.3f}, "
                  f"0.70 at {r['time_to_0.70_s']}, 0.75 at {r['time_to_0.75_s']} ({r['wall_s']:.0f}s)", flush=True)
    text = table(rows)
    print(text)
    note = (f"\n\n{args.steps} train steps per run (equal trained samples); accuracy: greedy, on the config's "
            f"held-out set; time to X: training wall time (since generation began) of the first evaluation at "
            f">= X, evaluating every {args.eval_every} versions.")
    write_results(args.name, text + note, {"rows": rows})
    from async_rl.report import compare_runs

    compare_runs(curves, ROOT / "benchmarks" / "results" / f"{args.name}.png", title="Held-out accuracy: sync vs async")


if __name__ == "__main__":
    main()
