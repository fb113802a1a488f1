"""`make demo`'s run, several times: the README's per-CPU demo rows as medians (min-max) over the runs.

    python benchmarks/demo.py                  # 3 runs of configs/smollm2_arith.yaml, as `make demo` runs it
    python benchmarks/demo.py --avx2           # the same on AVX2 kernels (emulates an AVX2-only CPU)
    python benchmarks/demo.py --runs 5 mode=sync    # overrides go to every run
    python benchmarks/demo.py --seeds 1 2 3 4 trainer.kl_coef=0.05    # one run per seed (seed=N added)
    python benchmarks/demo.py --n-seeds 10 --name demo_seeds           # seeds 0..9: does learning hold?
    python benchmarks/demo.py --merge demo_a demo_b --name demo_ab        # one report over two sweeps' runs

Each run is the command `make demo` runs (`async-rl run --config configs/smollm2_arith.yaml`),
in its own run directory, one after the other. Per run: the process's wall time, the wall time
from the first generation to the last train step, held-out accuracy before and after, and the
wall-clock training time to each `task.eval_targets` accuracy (from the periodic evaluations), the
highest periodic accuracy and the curve. Repeats of one seed on one machine give nearly the same
curve (fp32 is deterministic but for timing races): how often learning falls back needs `--seeds`.
What each run did: versions loaded into its servers, trajectories interrupted by a weight update, the
largest staleness trained, `async-rl audit`'s verdict. Whether learning holds, over the runs: how many end within `HOLD` (0.03) of their best test accuracy
(the highest of the periodic ones and the final), the median final and best, and the version
`async-rl run` kept as run_dir/best (chosen on validation) with its test accuracy. Each run's
per-step learning diagnostics (`DIAGNOSTICS`) go to the .json. Writes benchmarks/results/demo[_avx2].md
and .json, after every run (a sweep cut short keeps the runs it finished).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import drop_bulk, write_results  # noqa: E402

CONFIG = "configs/smollm2_arith.yaml"
HOLD = 0.03  # a run holds when it ends within this of its best test accuracy
DIAGNOSTICS = ("train/reward_mean", "train/entropy", "train/kl_init", "train/kl_prev", "train/grad_norm",
               "train/grad_norm_clipped", "train/zero_var_groups_frac", "train/response_len_mean",
               "train/truncated_frac", "train/behav_weight_max", "train/lr", "timing/kl_probe_s",
               "timing/keep_best_s", "timing/train_s")
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def one_run(run_dir: Path, overrides: list[str], env: dict[str, str]) -> dict:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "async_rl.launch.cli", "run", "--config", CONFIG, f"run_dir={run_dir}",
                        "log.progress=false", *overrides], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, **env})
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"run failed ({p.returncode}): {p.stderr[-2000:]}")
    evals = rows(run_dir / "eval.jsonl")
    before = next(e for e in evals if e["when"] == "before")
    after = next(e for e in reversed(evals) if e["when"] == "after")
    metrics = rows(run_dir / "metrics.jsonl")
    started = next(r["time"] for r in rows(run_dir / "rollout_metrics.jsonl") if "rollout/generation_started" in r)
    config = _config(run_dir)
    targets = json.loads(json.dumps(config["task"]["eval_targets"]))
    periodic = [e for e in evals if e["when"] == "periodic"]
    reach = {f"{t:.2f}": next((e["timing/train_wall_s"] for e in periodic if e["eval/accuracy"] >= t), None)
             for t in targets}
    dtype = next((line for line in p.stdout.splitlines() if line.startswith("engine dtype:")), "")
    curve = [round(e["eval/accuracy"], 4) for e in periodic]
    best = _best(run_dir)
    audit = subprocess.run([sys.executable, "-m", "async_rl.launch.cli", "audit", str(run_dir)], cwd=ROOT, capture_output=True,
                           text=True)
    loaded = [r for r in rows(run_dir / "rollout_metrics.jsonl") if r.get("sync/servers_loaded")]
    drop_bulk(run_dir)  # ~4.6 GB of checkpoints and weight versions a run: a seed sweep filled the disk
    return {"seed": config.get("seed"), "peak": max(curve, default=None), "curve": curve,
            "val_curve": [round(e["eval/val_accuracy"], 4) for e in periodic if "eval/val_accuracy" in e],
            "wall_s": wall, "train_wall_s": metrics[-1]["time"] - started, "steps": len(metrics),
            "accuracy_before": before["eval/accuracy"], "accuracy_after": after["eval/accuracy"],
            "eval_n": after["eval/n"], "time_to": reach, "dtype_line": dtype, "best_kept": best,
            "interrupted": sum(r.get("rollout/interrupted", 0) for r in metrics),
            "staleness_max": max((r.get("train/staleness_max", 0) for r in metrics), default=None),
            "versions_loaded": len(loaded), "audit_ok": audit.returncode == 0,
            "audit": audit.stdout.strip().splitlines()[-1] if audit.stdout.strip() else audit.stderr[-300:],
            "diagnostics": {k: [r.get(k) for r in metrics] for k in DIAGNOSTICS if any(k in r for r in metrics)}}


def _best(run_dir: Path) -> dict | None:
    path = run_dir / "best" / "meta.json"
    if not path.is_file():
        return None
    meta = json.loads(path.read_text())
    return {k: meta.get(k) for k in ("policy_version", "chosen_on", "val_accuracy", "test_accuracy")}


def held(run: dict) -> bool:
    """The run ended within HOLD of its best test accuracy (periodic or final)."""
    return run["accuracy_after"] >= max([*run["curve"], run["accuracy_after"]]) - HOLD


def _config(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


def summary(values: list[float | None], unit: str = "") -> str:
    got = [v for v in values if v is not None]
    if not got:
        return f"not reached in {len(values)} runs"
    cell = (f"{statistics.median(got):.3g}{unit} ({min(got):.3g}-{max(got):.3g})" if len(got) > 1
            else f"{got[0]:.3g}{unit}")
    return cell + ("" if len(got) == len(values) else f", reached in {len(got)} of {len(values)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--avx2", action="store_true", help="hold torch's kernels to AVX2 (an AVX2-only CPU)")
    ap.add_argument("--name", default=None, help="results file name (default demo, demo_avx2 with --avx2)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="one run per seed, `seed=N` added to its overrides (instead of --runs repeats)")
    ap.add_argument("--n-seeds", type=int, default=0, help="one run per seed 0..N-1 (as --seeds 0 1 ... N-1)")
    ap.add_argument("--merge", nargs="+", metavar="NAME", default=None,
                    help="run nothing: one report over the runs of these results files (sweeps of one config "
                         "run in parts); give the parts' overrides, which label it")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = ap.parse_args()
    if args.merge:
        runs = [r for part in args.merge
                for r in json.loads((ROOT / "benchmarks" / "results" / f"{part}.json").read_text())["runs"]]
        print(report(args.name or "demo", runs, args.overrides, seeds=[r.get("seed") for r in runs]).read_text())
        return
    env = AVX2 if args.avx2 else {}
    name = args.name or ("demo_avx2" if args.avx2 else "demo")
    seeds = args.seeds or (list(range(args.n_seeds)) if args.n_seeds else None)
    per_run = [[f"seed={s}"] for s in seeds] if seeds else [[] for _ in range(args.runs)]
    runs = []
    for k, own in enumerate(per_run):
        run = one_run(ROOT / "runs" / f"{name}_{k}", [*args.overrides, *own], env)
        runs.append(run)
        print(f"run {k}: {json.dumps(run)}", flush=True)
        path = report(name, runs, args.overrides, seeds=seeds[:k + 1] if seeds else None)
    print(path.read_text())


def report(name: str, runs: list[dict], overrides: list[str], seeds: list[int] | None = None) -> Path:
    """Write benchmarks/results/NAME.md and .json from the runs' records (the `run k: {...}` lines)."""
    targets = sorted(runs[0]["time_to"])
    how = f"one run per seed ({', '.join(map(str, seeds))})" if seeds else f"{len(runs)} runs"
    lines = [f"`make demo` = `async-rl run --config {CONFIG}`{' ' + ' '.join(overrides) if overrides else ''}"
             f", {how} one after the other; median (min-max).", "",
             f"{runs[0]['dtype_line']}", "",
             "| make demo wall | steps | training wall clock | held-out accuracy before -> after | highest periodic | "
             + " | ".join(f"time to {t}" for t in targets) + " |",
             "|---|---|---|---|---|" + "---|" * len(targets),
             f"| {summary([r['wall_s'] for r in runs], ' s')} | {runs[0]['steps']} | "
             f"{summary([r['train_wall_s'] for r in runs], ' s')} | "
             f"{summary([r['accuracy_before'] for r in runs])} -> {summary([r['accuracy_after'] for r in runs])} "
             f"on {runs[0]['eval_n']} problems | {summary([r.get('peak') for r in runs])} | "
             + " | ".join(summary([r['time_to'][t] for r in runs], " s") for t in targets) + " |", ""]
    lines += holding(runs) + ["Runs:", ""]
    lines += [f"- seed {r.get('seed')}: {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}, highest "
              f"{r.get('peak')}, curve {r.get('curve')}" + _kept_text(r) + _accounting_text(r)
              for r in runs if "curve" in r]
    lines += ["", "Records (per-step diagnostics in the .json):", ""]
    lines += [f"- {json.dumps({k: v for k, v in r.items() if k != 'diagnostics'})}" for r in runs]
    return write_results(name, "\n".join(lines), {"runs": runs})


def holding(runs: list[dict]) -> list[str]:
    """Does learning hold: runs ending within HOLD of their best, median final and best, the kept version."""
    bests = [max([*r["curve"], r["accuracy_after"]]) for r in runs]
    kept = [r["best_kept"]["test_accuracy"] for r in runs if r.get("best_kept")]
    return ["| runs ending within {:.2f} of their best | median final (min-max) | median best | "
            "run_dir/best's test accuracy (chosen on validation) |".format(HOLD), "|---|---|---|---|",
            f"| {sum(held(r) for r in runs)} of {len(runs)} | {summary([r['accuracy_after'] for r in runs])} | "
            f"{summary(bests)} | {summary(kept) if kept else 'n/a'} |", ""]


def _accounting_text(run: dict) -> str:
    """What the run did with its weights and trajectories (absent from records made before these fields)."""
    if "audit" not in run:
        return ""
    return (f"; {run['versions_loaded']} versions loaded, {run['interrupted']} trajectories interrupted by an "
            f"update, staleness at most {run['staleness_max']}, audit {'clean' if run['audit_ok'] else 'FAILED'}")


def _kept_text(run: dict) -> str:
    kept = run.get("best_kept")
    if not kept:
        return ""
    val = f", validation {kept['val_accuracy']:.3f}" if kept.get("val_accuracy") is not None else ""
    return f"; kept v{kept['policy_version']} (test {kept['test_accuracy']:.3f}{val})"


if __name__ == "__main__":
    main()
