"""How well `async-rl sim` predicts: measured against predicted on this machine, published against predicted on GPUs.

This machine: runs benchmarks/async_vs_sync.py (pools and shared cores, sync and async at each eta),
calibrates a profile on its sync runs only (pinned and shared cores: speed on 1 and 2 cores), predicts
every async run from it (and the sync runs back) with
that run's own settings and placement, and reports the async / sync ratio of trained trajectories per
second (whole run) and the staleness histogram, measured and predicted, with the error per setting.

Publications: with the GPU profiles in configs/sim/, fits the one unknown (the mean response length,
which neither paper gives) to the published *sync* step time, then predicts the async runs:
AReaL's 2.77x (1.5B, 128 H800) and the shape of its eta sweep; verl's fully-async scaling (1.92x at
64 GPUs, 2.35-2.67x at 128). Writes benchmarks/results/sim_validation.{md,json}.

    python benchmarks/sim_validation.py            # 20-step runs, eta 0 1 2 4 8 (long; a quiet machine)
    python benchmarks/sim_validation.py --quick    # 8-step runs, sync and eta 2 (the small form)
    python benchmarks/sim_validation.py --reuse    # the runs already under runs/bench, nothing new is run
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from async_rl.config import config_from_yaml_text  # noqa: E402
from async_rl.sim import Placement, sim_config  # noqa: E402
from async_rl.sim.calibrate import calibrate  # noqa: E402
from async_rl.sim.run import simulate  # noqa: E402
from benchmarks.async_vs_sync import SETUPS, measure  # noqa: E402
from benchmarks.common import write_results  # noqa: E402
from benchmarks.sim_publications import areal_section, verl_section  # noqa: E402

BENCH = ROOT / "runs" / "bench"


def run_benchmark(args: argparse.Namespace) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "async_vs_sync.py"), "--name", "sim_validation_runs"]
    cmd += ["--quick"] if args.quick else ["--steps", str(args.steps), "--eta", *map(str, args.eta)]
    cmd += ["--repeats", str(args.repeats)]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def placement_of(run_dir: Path) -> Placement:
    cfg = config_from_yaml_text((run_dir / "config.yaml").read_text())
    if cfg.cores.engine or cfg.cores.trainer:
        return Placement.pools(len(cfg.cores.engine), len(cfg.cores.trainer))
    return Placement.shared(len(os.sched_getaffinity(0)))


def predict(profile, run_dir: Path, seeds: int, warmup: int) -> dict:
    cfg = config_from_yaml_text((run_dir / "config.yaml").read_text())
    overrides = [f"mode={cfg.mode}", f"max_staleness={cfg.max_staleness}", f"total_steps={cfg.total_steps}"]
    results = [simulate(profile, sim_config(profile, overrides), placement_of(run_dir), seed=s, warmup=warmup)
               for s in range(seeds)]
    # the staleness of the steady window, as async_vs_sync.measure counts it
    hist = np.sum([rec.hist for r in results for rec in r.records[warmup + 1:]], axis=0)
    return {"traj_per_s": float(np.mean([r.traj_per_s for r in results])), "staleness_hist": hist.tolist(),
            "trainer_idle": float(np.mean([r.trainer_idle for r in results])),
            "engine_idle": float(np.mean([r.engine_idle for r in results]))}


def shares(hist: list[int]) -> list[float]:
    total = max(1, sum(hist))
    return [round(n / total, 2) for n in hist]


def this_machine(args: argparse.Namespace) -> tuple[str, list[dict]]:
    runs = sorted(d for d in BENCH.glob("*_*_*_r*") if (d / "metrics.jsonl").is_file()
                  and d.name.split("_")[0] in SETUPS)
    if not runs:
        raise SystemExit(f"no benchmark runs under {BENCH}: run without --reuse")
    calib = [BENCH / name for name in args.calibrate_on]
    profile = calibrate(*calib)
    rows = []
    for run in runs:
        setup, mode, eta, rnd = run.name.split("_")  # async_vs_sync.py names them SETUP_MODE_ETA_rROUND
        measured = measure(run, args.warmup)
        rows.append({"run": run.name, "setup": setup, "round": rnd, "setting": mode + (f" eta={eta}" if mode == "async" else ""),
                     "measured": measured["run_trained_traj_per_s"], "measured_hist": measured["staleness_hist"],
                     "calibrated_on": run in calib, **{"predicted_" + k: v for k, v in
                                                      predict(profile, run, args.seeds, args.warmup).items()}})
    lines = ["| set-up | setting | measured traj/s | predicted traj/s | measured vs sync | predicted vs sync | "
             "error of the ratio | staleness measured (shares of lag 0,1,..,>eta) | predicted |", "|" + "---|" * 9]
    for r in rows:
        base = next((b for b in rows if b["setup"] == r["setup"] and b["round"] == r["round"]
                     and b["setting"] == "sync"), None)
        if base is None:
            continue
        r["measured_ratio"] = r["measured"] / base["measured"]
        r["predicted_ratio"] = r["predicted_traj_per_s"] / base["predicted_traj_per_s"]
        r["error"] = abs(r["predicted_ratio"] - r["measured_ratio"]) / r["measured_ratio"]
        mark = " (calibrated on)" if r["calibrated_on"] else ""
        error = "-" if r["setting"] == "sync" else f"{100 * r['error']:.0f}%"
        lines.append(f"| {r['setup']} | {r['setting']}{mark} | {r['measured']:.1f} | {r['predicted_traj_per_s']:.1f} | "
                     f"{r['measured_ratio']:.2f}x | {r['predicted_ratio']:.2f}x | "
                     f"{error} | "
                     f"{shares(r['measured_hist'])} | {shares(r['predicted_staleness_hist'])} |")
    errors = [r["error"] for r in rows if "error" in r and r["setting"] != "sync"]
    per_setting, setting_errors = _per_setting(rows)
    slowdown = []  # what the model leaves out: a side slowed down by the other running at once on this machine
    for setup in sorted({r["setup"] for r in rows}):
        per_token = {r["setting"]: _train_s_per_token(BENCH / r["run"]) for r in rows
                     if r["setup"] == setup and r["round"] == rows[0]["round"]}
        for setting, value in per_token.items():
            if setting != "sync" and "sync" in per_token:
                slowdown.append(f"{setup} {setting} {value / per_token['sync']:.1f}x")
    e, t = profile.engine, profile.trainer
    text = "\n".join(lines) + (
        f"\n\nCalibrated on {', '.join(f'`runs/bench/{c}`' for c in args.calibrate_on)} only: engine {1e3 * e.step_base_s:.1f} ms/step + "
        f"{1e3 * e.per_seq_s:.2f} ms/sequence + {1e6 * e.per_prefill_token_s:.0f} us/prompt token on {e.units} core(s) "
        f"(speed on more cores: x (cores/{e.units})^{e.scaling:.2f}"
        f"{'' if profile.measured.get('engine_scaling_measured') else ', not measured: 1.0 assumed'}), trainer "
        f"{1e3 * t.per_token_s:.3f} ms/token + {t.step_overhead_s:.2f} s/step (scaling {t.scaling:.2f}"
        f"{'' if profile.measured.get('trainer_scaling_measured') else ', not measured: 1.0 assumed'}), "
        f"weight update {profile.sync.publish_s:.2f} s publish + {profile.sync.load_s:.2f} s load, "
        f"{len(profile.response.samples)} response lengths (mean {np.mean(profile.response.samples):.1f}). "
        f"Predictions average {args.seeds} seeds. Error of the async / sync ratio: "
        + (f"mean {100 * np.mean(errors):.0f}%, max {100 * max(errors):.0f}% over {len(errors)} runs, one round "
           f"each; against each setting's median over its rounds (the table below): mean "
           f"{100 * np.mean(setting_errors):.0f}%, max {100 * max(setting_errors):.0f}% over {len(setting_errors)} "
           f"settings (target: 10%)." if errors else "no async settings.")
        + (f" Train step time per batch token in the async runs against the same set-up's sync run: "
           f"{', '.join(slowdown)} (the model trains at the calibrated speed whatever the other side does); load "
           f"average when this was written: {os.getloadavg()[0]:.1f} on {len(os.sched_getaffinity(0))} cores."
           if slowdown else "")) + ("\n\n" + per_setting if per_setting else "")
    return text, rows


def _per_setting(rows: list[dict]) -> tuple[str, list[float]]:
    """Per set-up and async setting: the median (min-max) over rounds of the measured async / sync ratio
    (each round's sync is its own baseline) against the predicted ratio, and the error of the median."""
    keys = sorted({(r["setup"], r["setting"]) for r in rows if "error" in r and r["setting"] != "sync"})
    if not keys:
        return "", []
    lines = ["| set-up | setting | rounds | measured vs sync, median (min-max) | predicted vs sync | error of the median |",
             "|" + "---|" * 6]
    errors = []
    for setup, setting in keys:
        same = [r for r in rows if (r["setup"], r["setting"]) == (setup, setting) and "error" in r]
        measured = [r["measured_ratio"] for r in same]
        med, predicted = float(np.median(measured)), float(np.median([r["predicted_ratio"] for r in same]))
        errors.append(abs(predicted - med) / med)
        lines.append(f"| {setup} | {setting} | {len(same)} | {med:.2f}x ({min(measured):.2f}-{max(measured):.2f}) | "
                     f"{predicted:.2f}x | {100 * errors[-1]:.0f}% |")
    return "\n".join(lines), errors


def _train_s_per_token(run_dir: Path) -> float:
    from async_rl.utils.metrics import read_jsonl

    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl")[1:] if r.get("train/batch_tokens")]
    return float(np.mean([r["timing/train_s"] / r["train/batch_tokens"] for r in rows])) if rows else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small form: 8-step runs, sync and eta 2")
    ap.add_argument("--reuse", action="store_true", help="use the runs under runs/bench; run nothing")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eta", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the steady window (default 3, 2 quick)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of async_vs_sync.py (each setting once a round)")
    ap.add_argument("--calibrate-on", nargs="+", default=["pools_sync_0_r0", "shared_sync_0_r0"],
                    help="the runs under runs/bench the profile is fitted to (pooled; default: the two sync runs, one "
                         "pinned to a core a side and one on both cores, so speed on 1 and 2 cores is measured)")
    ap.add_argument("--seeds", type=int, default=3, help="simulations averaged per prediction")
    ap.add_argument("--skip-publications", action="store_true")
    ap.add_argument("--name", default="sim_validation", help="results file name under benchmarks/results/")
    args = ap.parse_args()
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    if not args.reuse:
        run_benchmark(args)
    machine_text, rows = this_machine(args)
    reused = ("The runs were made earlier (`--reuse`): " + ", ".join(
        f"{r['run']} {r['measured']:.1f} traj/s" for r in rows) + ".\n\n") if args.reuse else ""
    sections = ["## This machine: calibrated on the sync runs, predicting the async ones\n\n" + reused + machine_text]
    data = {"this_machine": rows}
    if not args.skip_publications:
        for name, section in (("areal", areal_section), ("verl", verl_section)):
            text, rows = section()
            sections.append(text)
            data[name] = rows
    out = write_results(args.name, "\n\n".join(sections), data)
    print("\n\n".join(sections))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
