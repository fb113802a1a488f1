"""Does asynchrony cost learning? Held-out accuracy at equal trained samples: sync vs async eta = 1, 2, 4, 8.

On `configs/learning_arith.yaml` (SmolLM2-135M on two-digit sums, a task meant to keep improving
past 40 steps), every setting trains the same number of steps from the same seeds: `mode=sync`,
async at max_staleness 1, 2, 4, 8 with the decoupled loss's behaviour correction, async at 8
without it (`trainer.loss=no_behav_correction`, the ablation), and async at 8 paced
(`rollout.pace=true`: the rollout side runs only as far ahead as keeps the trainer fed). Each run
scores greedy accuracy on
`--eval-size` held-out problems (`task.eval_size`, >= 256 so that one run's evaluation noise,
about +-0.03, is small against the differences measured) before training, every `--eval-every`
versions beside it, and after it.

    python benchmarks/learning.py                                      # the full table (hours on 2 CPU cores)
    python benchmarks/learning.py --settings sync sync-no-correction --name learning_mismatch  # what the mismatch costs
    python benchmarks/learning.py --config configs/debug_cpu.yaml --settings sync async-4 --seeds 0 --steps 4 \
        --eval-every 2 --eval-size 32 --name learning_smoke                     # a smoke test (2 minutes)

Prints a table of medians (min-max over seeds) and writes benchmarks/results/NAME.{md,json} (the
command, the machine, the date) and NAME.png (median held-out accuracy and train reward per step).
They are written after every run (the runs not there yet named; each row with its commit, finishing
time and CPU), so `--reuse` continues a table longer than one session, on a fresh clone too.
Per-step training signals come from each run's metrics: the engine/trainer log-prob mismatch
(`train/logprob_mismatch_mean`, tokens sampled by the trainer's own version) and the share of
tokens whose behaviour weight exceeded the cap (`train/behav_capped_frac`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import cpu_model, drop_bulk, median_range, write_results  # noqa: E402

SETTINGS = {
    "sync": ["mode=sync"],
    "async-1": ["mode=async", "max_staleness=1"],
    "async-2": ["mode=async", "max_staleness=2"],
    "async-4": ["mode=async", "max_staleness=4"],
    "async-8": ["mode=async", "max_staleness=8"],
    "async-8-no-correction": ["mode=async", "max_staleness=8", "trainer.loss=no_behav_correction"],
    "async-8-paced": ["mode=async", "max_staleness=8", "rollout.pace=true"],
    # not in the default table: at eta = 0 the behaviour weight corrects only the engine/trainer
    # log-prob mismatch, so this measures what that mismatch costs when nothing corrects it
    "sync-no-correction": ["mode=sync", "trainer.loss=no_behav_correction"],
}
DEFAULT = ["sync", "async-1", "async-2", "async-4", "async-8", "async-8-no-correction", "async-8-paced"]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run_one(args: argparse.Namespace, label: str, seed: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "async_rl.launch.cli", "run", "--config", args.config, f"seed={seed}",
           f"total_steps={args.steps}", f"run_dir={run_dir}", f"rollout.eval_every={args.eval_every}",
           f"task.eval_size={args.eval_size}", "log.progress=false", *SETTINGS[label], *args.overrides]
    commit = git_commit()  # the code the run imports is the code at its start
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{label} seed {seed} failed:\n{res.stderr[-2000:]}")
    row = summarise(label, seed, run_dir, time.perf_counter() - t0)
    row["provenance"] = provenance(commit)  # a table may gather its rows over days: each says where it came from
    drop_bulk(run_dir)  # ~3.5 GB a run with SmolLM2 (model + Adam state): 18 runs fill a disk
    return row


def git_commit() -> str:
    """This checkout's commit, with '+' when tracked files have changes."""
    return subprocess.run(["git", "describe", "--always", "--dirty=+", "--abbrev=7"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or "unknown"


def provenance(commit: str) -> dict:
    """One run's commit (taken at its start), finishing time and CPU kind."""
    from async_rl.utils.hardware import cpu_capability

    return {"commit": commit, "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": f"{cpu_model()}, {cpu_capability()}"}


def summarise(label: str, seed: int, run_dir: Path, wall_s: float) -> dict:
    """One run's row: accuracies from eval.jsonl, per-step signals from metrics.jsonl."""
    evals = _jsonl(run_dir / "eval.jsonl")
    before = next(e for e in evals if e["when"] == "before")
    after = next(e for e in evals if e["when"] == "after")
    curve = [(0, before["eval/accuracy"])] + [(e["step"], e["eval/accuracy"]) for e in evals
                                              if e["when"] == "periodic"]
    if not curve or curve[-1][0] < after["policy_version"]:
        curve.append((after["policy_version"], after["eval/accuracy"]))
    steps = _jsonl(run_dir / "metrics.jsonl")

    def step_mean(key: str, measured: str | None = None) -> float:
        """Mean over steps of `key`, over the steps where `measured` (a share of tokens) is > 0."""
        vals = [r[key] for r in steps
                if r.get(key) is not None and (measured is None or r.get(measured, 0) > 0)]
        return statistics.mean(vals) if vals else float("nan")

    return {"setting": label, "seed": seed, "eval_n": after["eval/n"], "acc_before": before["eval/accuracy"],
            "acc_after": after["eval/accuracy"], "acc_last3": statistics.mean(a for _, a in curve[-3:]),
            "acc_peak": max(a for _, a in curve), "curve": curve,
            "reward": [(r["step"], r["train/reward_mean"]) for r in steps],
            "train_s_per_step": step_mean("timing/step_s"),
            "mismatch_mean": step_mean("train/logprob_mismatch_mean", "train/logprob_mismatch_frac"),
            "mismatch_max": max((r.get("train/logprob_mismatch_max", 0.0) for r in steps), default=float("nan")),
            "behav_capped_frac": step_mean("train/behav_capped_frac"),
            "behav_weight_max": max((r.get("train/behav_weight_max", 0.0) for r in steps), default=float("nan")),
            "staleness_mean": step_mean("train/staleness_mean"),
            "dropped_stale": sum(r.get("train/dropped_stale", 0) for r in steps), "wall_s": wall_s}


COLUMNS = [("final accuracy", "acc_after", ".3f"), ("mean of last 3 evals", "acc_last3", ".3f"),
           ("peak accuracy", "acc_peak", ".3f"), ("mean staleness of trained data", "staleness_mean", ".2f"),
           ("sync delayed by that staleness", "sync_delayed", ".3f"), ("train s/step", "train_s_per_step", ".1f"),
           ("log-prob mismatch, mean abs (lag 0)", "mismatch_mean", ".2g"),
           ("behaviour weight max", "behav_weight_max", ".2f"), ("capped share", "behav_capped_frac", ".4f")]


def delay_sync(rows: list[dict]) -> None:
    """Each row's `sync_delayed`: its seed's sync curve read at (its last step - its mean staleness).

    Learning from data `s` versions old is, to first order, sync learning delayed by `s` steps; a setting
    that ends near this figure loses no more than its lag, one well below it loses to something else.
    Paired by seed (same initial weights and prompts), so the seeds' spread mostly cancels."""
    sync = {r["seed"]: r["curve"] for r in rows if r["setting"] == "sync"}
    for r in rows:
        stale, curve = r.get("staleness_mean", float("nan")), sync.get(r["seed"])
        if curve is None or stale != stale:
            r["sync_delayed"] = float("nan")
            continue
        at = r["curve"][-1][0] - stale
        spans = ((x0, y0, x1, y1) for (x0, y0), (x1, y1) in zip(curve, curve[1:]) if x0 <= at <= x1)
        r["sync_delayed"] = next((y0 + (y1 - y0) * (at - x0) / (x1 - x0) for x0, y0, x1, y1 in spans),
                                 float("nan"))  # outside that seed's sync curve: not comparable


def paired_gap(rs: list[dict], reference: Callable[[dict], float]) -> str:
    """Mean over seeds of (a run's final accuracy - `reference(run)`, a sync figure of its own seed): seeds share
    initial weights, prompts and held-out set, so their own spread mostly cancels. Empty where nothing pairs."""
    gaps = [r["acc_after"] - ref for r in rs if (ref := reference(r)) == ref]  # NaN: no sync run of that seed
    return f"{statistics.mean(gaps):+.3f}" if gaps else ""


def cpus(rs: list[dict]) -> str:
    """The CPU kinds a setting's runs ran on (its seconds per step compare only within one)."""
    return " + ".join(dict.fromkeys(r["provenance"]["cpu"] for r in rs if "provenance" in r)) or "not recorded"


def table(rows: list[dict]) -> str:
    delay_sync(rows)
    sync = {r["seed"]: r for r in rows if r["setting"] == "sync"}
    heads = ["setting", "seeds", "accuracy before", *(c for c, _, _ in COLUMNS), "vs sync, mean of paired differences",
             "vs sync delayed, mean of paired differences", "CPU"]
    lines = ["| " + " | ".join(heads) + " |", "|---" * len(heads) + "|"]
    for label in dict.fromkeys(r["setting"] for r in rows):
        rs = [r for r in rows if r["setting"] == label]
        cells = [median_range([r[key] for r in rs], spec) for _, key, spec in COLUMNS]
        if label != "sync":
            cells += [paired_gap(rs, lambda r: sync[r["seed"]]["acc_after"] if r["seed"] in sync else float("nan")),
                      paired_gap(rs, lambda r: r["sync_delayed"])]
        else:
            cells += ["", ""]
        cells.append(cpus(rs))
        before = median_range([r["acc_before"] for r in rs])
        lines.append(f"| {label} | {len(rs)} | {before} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def median_curves(rows: list[dict], key: str) -> dict[str, tuple[list[float], list[float]]]:
    """Per setting, the median over seeds of a per-step curve, at the steps every seed has."""
    out = {}
    for label in dict.fromkeys(r["setting"] for r in rows):
        curves = [dict(r[key]) for r in rows if r["setting"] == label]
        xs = sorted(set.intersection(*(set(c) for c in curves)))
        out[label] = (xs, [statistics.median(c[x] for c in curves) for x in xs])
    return out


def provenance_note(rows: list[dict]) -> str:
    """Where the rows came from: runs grouped by commit and CPU, each group with its first and last finishing time."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        p = r.get("provenance")
        if p:
            groups.setdefault((p["commit"], p["cpu"]), []).append(r)
    if not groups:
        return ""
    parts = [f"{len(rs)} run(s) at commit {commit} on {cpu}, finished {min(r['provenance']['finished'] for r in rs)}"
             f" to {max(r['provenance']['finished'] for r in rs)}" for (commit, cpu), rs in groups.items()]
    return " Runs: " + "; ".join(parts) + "."


def plot(rows: list[dict], path: Path, eval_n: int) -> None:
    from async_rl.report.plots import new_figure, plot_curves, save

    fig, (acc, reward) = new_figure(2, title="Learning at equal trained samples: median over seeds")
    plot_curves(median_curves(rows, "curve"), ax=acc, title=f"held-out greedy accuracy ({eval_n} problems)",
                xlabel="policy version (train steps)", ylabel="accuracy", markers=True)
    plot_curves(median_curves(rows, "reward"), ax=reward, title="train reward", xlabel="train step",
                ylabel="mean reward", smooth_window=5)
    save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/learning_arith.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--settings", nargs="+", default=DEFAULT, choices=list(SETTINGS))
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--eval-every", type=int, default=8)
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--name", default="learning")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the rows of runs already finished under runs/NAME/, or in benchmarks/results/NAME.json "
                         "at the same --steps (continue an interrupted table)")
    ap.add_argument("--no-run", action="store_true",
                    help="with --reuse: the table of the rows there are, running nothing (the missing ones are named)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    if args.no_run and not args.reuse:
        ap.error("--no-run: only with --reuse (the rows come from earlier runs)")
    rows, missing = [], []
    # rows of an earlier table (a fresh clone has no runs/): reused by --reuse like the run directories' own
    results = ROOT / "benchmarks" / "results" / f"{args.name}.json"
    earlier = json.loads(results.read_text()) if args.reuse and results.is_file() else {}
    published = ({(r["setting"], r["seed"]): r for r in earlier.get("rows", [])}
                 if (earlier.get("steps"), earlier.get("config"), earlier.get("overrides")) == (args.steps, args.config,
                                                                                args.overrides) else {})
    for label in args.settings:
        for seed in args.seeds:
            run_dir = ROOT / "runs" / args.name / f"{label}_s{seed}"
            saved = run_dir / "learning_row.json"
            if args.reuse and saved.is_file():
                row = json.loads(saved.read_text())
                if (run_dir / "metrics.jsonl").is_file():  # the run's own files are there: read them again
                    row = {**summarise(label, seed, run_dir, row["wall_s"]),
                           **({"provenance": row["provenance"]} if "provenance" in row else {})}
                rows.append(row)
            elif (label, seed) in published:
                rows.append(published[(label, seed)])
            elif args.no_run:
                missing.append(f"{label} seed {seed}")
                continue
            else:
                rows.append(run_one(args, label, seed, run_dir))
                saved.write_text(json.dumps(rows[-1]))
                # the table so far goes out after every new run: a long table survives an interrupted session
                publish(args, rows, missing + pending(args, label, seed), quiet=True)
            r = rows[-1]
            print(f"{label} seed {seed}: accuracy {r['acc_before']:.3f} -> {r['acc_after']:.3f} "
                  f"(last 3 evals {r['acc_last3']:.3f}, peak {r['acc_peak']:.3f}), {r['wall_s']:.0f}s", flush=True)
    if not rows:
        raise SystemExit("no finished runs to tabulate (--no-run): run without it")
    publish(args, rows, missing)


def pending(args: argparse.Namespace, label: str, seed: int) -> list[str]:
    """The (setting, seed) pairs after this one in the loop's order, by name."""
    order = [(lb, sd) for lb in args.settings for sd in args.seeds]
    return [f"{lb} seed {sd}" for lb, sd in order[order.index((label, seed)) + 1:]]


def publish(args: argparse.Namespace, rows: list[dict], missing: list[str], quiet: bool = False) -> None:
    """benchmarks/results/NAME.{md,json,png} for the rows there are; the runs not there yet are named."""
    rows = [dict(r) for r in rows]  # delay_sync adds a column: keep the caller's rows as they were
    text = table(rows)
    if not quiet:
        print(text)
    eval_n = rows[0]["eval_n"]
    note = (f"\n\n{args.steps} train steps per run (equal trained samples), seeds {args.seeds}, config "
            f"`{args.config}`{' ' + ' '.join(args.overrides) if args.overrides else ''}. Accuracy: greedy, on "
            f"{eval_n} held-out problems (one run's binomial noise at accuracy p: sqrt(p(1-p)/{eval_n}), "
            f"{(0.25 / eval_n) ** 0.5:.3f} at p = 0.5), evaluated every {args.eval_every} versions beside training; "
            "cells are the median over seeds (min-max). Log-prob mismatch: mean |log pi_trainer - log pi_engine| "
            "over tokens sampled by the trainer's own version, averaged over the steps that had such tokens; "
            "behaviour weight max: the largest pi_prox / pi_behav of any step; capped share: tokens whose weight "
            "exceeded trainer.behav_weight_cap, averaged over steps. Mean staleness: versions between the "
            "policy that sampled a trained trajectory and the one trained, over the run; sync delayed by that "
            "staleness: the same seed's sync curve read that many steps before the end (interpolated), what a "
            "setting would reach if its stale data cost it only the delay; the paired differences are means over "
            "the seeds of a run's final accuracy minus its seed's sync final (or delayed sync) accuracy, whose "
            "evaluation noise is about sqrt(2/seeds) x one run's binomial noise. Train s/step compare only between "
            "rows on the same CPU."
            + (f" Not run yet: {', '.join(missing)}." if missing else "")
            + provenance_note(rows))
    write_results(args.name, text + note, {"rows": rows, "steps": args.steps, "seeds": args.seeds,
                                           "config": args.config, "overrides": args.overrides})
    plot(rows, ROOT / "benchmarks" / "results" / f"{args.name}.png", eval_n)


if __name__ == "__main__":
    main()
