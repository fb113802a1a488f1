"""How well `async-rl sim` predicts: measured against predicted on this machine, published against predicted on GPUs.

This machine: runs benchmarks/async_vs_sync.py (pools and shared cores, sync and async at each eta),
calibrates a profile per round on that round's sync runs (pinned and shared cores: speed on 1 and 2
cores) and eta=2 runs (how much each side slows the other), predicts every other run of the round with
that run's own settings and placement, and reports the async / sync ratio of trained trajectories per
second (whole run) and the staleness histogram, measured and predicted, with the error per setting:
predicted with each run's own lengths (the system model) and forecast with the sync runs' lengths.

Publications: with the GPU profiles in configs/sim/, fits the one unknown (the mean response length,
which neither paper gives) to the published *sync* step time, then predicts the async runs:
AReaL's 2.77x (1.5B, 128 H800) and the shape of its eta sweep; verl's fully-async scaling (1.92x at
64 GPUs, 2.35-2.67x at 128). Writes benchmarks/results/sim_validation.{md,json}.

    python benchmarks/sim_validation.py            # 20-step runs, eta 0 1 2 4 8 (long; a quiet machine)
    python benchmarks/sim_validation.py --quick    # 8-step runs, sync and eta 2 (the small form)
    python benchmarks/sim_validation.py --reuse    # the runs already under runs/bench, nothing new is run
    python benchmarks/sim_validation.py --eta 1 2 4 8 --repeats 3 --runs runs/bench_frozen \
        --name sim_validation_frozen trainer.lr=0                # a frozen policy: lengths do not drift
"""

from __future__ import annotations

import argparse
import copy
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
from async_rl.sim.lengths import LengthDist  # noqa: E402
from async_rl.sim.run import simulate  # noqa: E402
from async_rl.utils.metrics import read_jsonl  # noqa: E402
from benchmarks.async_vs_sync import SETUPS, measure  # noqa: E402
from benchmarks.common import write_results  # noqa: E402
from benchmarks.sim_publications import areal_section, verl_section  # noqa: E402

BENCH = ROOT / "runs" / "bench"  # --runs


def run_benchmark(args: argparse.Namespace) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "async_vs_sync.py"), "--name", f"{args.name}_runs",
           "--runs", str(BENCH)]
    cmd += ["--quick"] if args.quick else ["--steps", str(args.steps), "--eta", *map(str, args.eta)]
    cmd += ["--repeats", str(args.repeats), *args.overrides]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def placement_of(run_dir: Path) -> Placement:
    cfg = config_from_yaml_text((run_dir / "config.yaml").read_text())
    if cfg.cores.engine or cfg.cores.trainer:
        return Placement.pools(len(cfg.cores.engine), len(cfg.cores.trainer))
    return Placement.shared(len(os.sched_getaffinity(0)))


def predict(profile, run_dir: Path, seeds: int, warmup: int, lengths: list[int] | None = None) -> dict:
    """The run predicted from `profile` with its own settings and placement; `lengths`: the lengths the run
    itself trained, replayed in its order (the system model alone), else the profile's (a forecast)."""
    cfg = config_from_yaml_text((run_dir / "config.yaml").read_text())
    if lengths is not None:
        profile = copy.deepcopy(profile)
        profile.response = LengthDist(kind="sequence", max=profile.response.max, samples=lengths)
        seeds = 1  # nothing else is drawn at random
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
    rounds = sorted({run.name.split("_")[-1] for run in runs})
    calib = {rnd: [BENCH / name.format(round=rnd) for name in args.calibrate_on] for rnd in rounds}
    missing = [c.name for cs in calib.values() for c in cs if not (c / "metrics.jsonl").is_file()]
    if missing:
        raise SystemExit(f"--calibrate-on: no run {missing[0]} under {BENCH}")
    profiles = {rnd: calibrate(*calib[rnd]) for rnd in rounds}
    rows = []
    for run in runs:
        setup, mode, eta, rnd = run.name.split("_")  # async_vs_sync.py names them SETUP_MODE_ETA_rROUND
        measured = measure(run, args.warmup)
        lengths = [int(n) for r in read_jsonl(run / "metrics.jsonl") for n in r["train/response_lens"]]
        own = predict(profiles[rnd], run, args.seeds, args.warmup, lengths)
        forecast = predict(profiles[rnd], run, args.seeds, args.warmup)
        rows.append({"run": run.name, "setup": setup, "round": rnd, "setting": mode + (f" eta={eta}" if mode == "async" else ""),
                     "measured": measured["run_trained_traj_per_s"], "measured_hist": measured["staleness_hist"],
                     "mean_length": float(np.mean(lengths)),
                     "calibrated_on": run in calib[rnd], **{"predicted_" + k: v for k, v in own.items()},
                     **{"forecast_" + k: v for k, v in forecast.items()}})
    lines = ["| set-up | setting | round | mean length | measured traj/s | predicted traj/s | measured vs sync | "
             "predicted vs sync | error | forecast vs sync | error | staleness measured (shares of lag 0,1,..,>eta) "
             "| predicted |", "|" + "---|" * 13]
    for r in rows:
        base = next((b for b in rows if b["setup"] == r["setup"] and b["round"] == r["round"]
                     and b["setting"] == "sync"), None)
        if base is None:
            continue
        r["measured_ratio"] = r["measured"] / base["measured"]
        r["predicted_ratio"] = r["predicted_traj_per_s"] / base["predicted_traj_per_s"]
        r["forecast_ratio"] = r["forecast_traj_per_s"] / base["forecast_traj_per_s"]
        r["error"] = abs(r["predicted_ratio"] - r["measured_ratio"]) / r["measured_ratio"]
        r["forecast_error"] = abs(r["forecast_ratio"] - r["measured_ratio"]) / r["measured_ratio"]
        mark = " (calibrated on)" if r["calibrated_on"] else ""
        err = lambda v: "-" if r["setting"] == "sync" else f"{100 * v:.0f}%"  # noqa: E731
        lines.append(f"| {r['setup']} | {r['setting']}{mark} | {r['round']} | {r['mean_length']:.1f} | "
                     f"{r['measured']:.1f} | {r['predicted_traj_per_s']:.1f} | {r['measured_ratio']:.2f}x | "
                     f"{r['predicted_ratio']:.2f}x | {err(r['error'])} | {r['forecast_ratio']:.2f}x | "
                     f"{err(r['forecast_error'])} | {shares(r['measured_hist'])} | {shares(r['predicted_staleness_hist'])} |")
    per_setting, errors, forecast_errors = _per_setting(rows)
    e, t = profiles[rounds[0]].engine, profiles[rounds[0]].trainer
    names = ", ".join(f"`{n}`" for n in args.calibrate_on)
    text = "\n".join(lines) + (
        f"\n\nCalibrated per round on {names} of that round (the sync runs give the speeds and the lengths, the "
        "async ones how much each side slows the other on shared hardware), predicting that round's other runs. "
        f"Round {rounds[0]}: engine {1e3 * e.step_base_s:.1f} ms/step + {1e3 * e.per_seq_s:.2f} ms/sequence + "
        f"{1e6 * e.per_prefill_token_s:.0f} us/prompt token on {e.units} core(s) (speed on more cores: x "
        f"(cores/{e.units})^{e.scaling:.2f}), slowed x{e.overlap_pools:.2f} (pools) / x{e.overlap_shared:.2f} "
        f"(shared) while the trainer works; trainer {1e3 * t.per_token_s:.3f} ms/token + {t.step_overhead_s:.2f} "
        f"s/step (scaling {t.scaling:.2f}), slowed x{t.overlap_pools:.2f} / x{t.overlap_shared:.2f} while the engine "
        f"works. **Predicted**: each run simulated with the lengths it trained, in its order (the system model "
        f"alone). **Forecast**: with the sync runs' lengths, as a user predicts before running (a policy that learns "
        f"moves its lengths, which no throughput model knows; mean response length of the sync runs "
        f"{_mean_length(rows, 'sync'):.1f}, of the async ones {_mean_length(rows, 'async'):.1f}). Error of the "
        f"async / sync ratio per setting, the median over rounds, the settings calibrated on left out: predicted "
        f"mean {100 * np.mean(errors):.0f}%, max {100 * max(errors):.0f}% over {len(errors)} settings; forecast mean "
        f"{100 * np.mean(forecast_errors):.0f}%, max {100 * max(forecast_errors):.0f}% (target: 10%). Noise of the "
        f"measurement itself: the sync runs of one set-up differ by {_sync_spread(rows)} between rounds with the "
        f"same lengths (the machine's speed drifts over minutes); load average when this was written: "
        f"{os.getloadavg()[0]:.1f} on {len(os.sched_getaffinity(0))} cores.") + "\n\n" + per_setting
    return text, rows


def _mean_length(rows: list[dict], mode: str) -> float:
    return float(np.mean([r["mean_length"] for r in rows if r["setting"].startswith(mode)] or [float("nan")]))


def _sync_spread(rows: list[dict]) -> str:
    parts = []
    for setup in sorted({r["setup"] for r in rows}):
        vals = [r["measured"] for r in rows if r["setup"] == setup and r["setting"] == "sync"]
        if len(vals) > 1:
            parts.append(f"{setup} {100 * (max(vals) / min(vals) - 1):.0f}%")
    return ", ".join(parts) or "n/a (one round)"


def _per_setting(rows: list[dict]) -> tuple[str, list[float], list[float]]:
    """Per set-up and async setting: the median over rounds of the measured async / sync ratio (each round's
    sync is its own baseline) against the median predicted and forecast ratios, and their errors."""
    keys = sorted({(r["setup"], r["setting"]) for r in rows if "error" in r and r["setting"] != "sync"})
    lines = ["| set-up | setting | rounds | measured vs sync, median (min-max) | predicted | error | forecast | error |",
             "|" + "---|" * 8]
    errors, forecast_errors = [], []
    for setup, setting in keys:
        same = [r for r in rows if (r["setup"], r["setting"]) == (setup, setting) and "error" in r]
        measured = [r["measured_ratio"] for r in same]
        med = float(np.median(measured))
        predicted = float(np.median([r["predicted_ratio"] for r in same]))
        forecast = float(np.median([r["forecast_ratio"] for r in same]))
        err, ferr = abs(predicted - med) / med, abs(forecast - med) / med
        calibrated = all(r["calibrated_on"] for r in same)
        if not calibrated:
            errors.append(err)
            forecast_errors.append(ferr)
        lines.append(f"| {setup} | {setting}{' (calibrated on)' if calibrated else ''} | {len(same)} | {med:.2f}x "
                     f"({min(measured):.2f}-{max(measured):.2f}) | {predicted:.2f}x | {100 * err:.0f}% | "
                     f"{forecast:.2f}x | {100 * ferr:.0f}% |")
    return "\n".join(lines), errors or [float("nan")], forecast_errors or [float("nan")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small form: 8-step runs, sync and eta 2")
    ap.add_argument("--reuse", action="store_true", help="use the runs under runs/bench; run nothing")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eta", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the steady window (default 3, 2 quick)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of async_vs_sync.py (each setting once a round)")
    ap.add_argument("--calibrate-on", nargs="+", default=["pools_sync_0_{round}", "shared_sync_0_{round}",
                                                          "pools_async_2_{round}", "shared_async_2_{round}"],
                    help="the runs under runs/bench each round's profile is fitted to ({round}: that round; default: "
                         "the two sync runs, pinned to a core a side and on both cores, for the speeds on 1 and 2 "
                         "cores, and the two eta=2 runs for how much each side slows the other)")
    ap.add_argument("--seeds", type=int, default=3, help="simulations averaged per prediction")
    ap.add_argument("--skip-publications", action="store_true")
    ap.add_argument("--name", default="sim_validation", help="results file name under benchmarks/results/")
    ap.add_argument("--runs", default="runs/bench", help="where the benchmark's run directories are (or go)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run of the benchmark (not with --reuse)")
    args = ap.parse_args()
    global BENCH
    BENCH = (ROOT / args.runs).resolve()
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    if not args.reuse:
        run_benchmark(args)
    machine_text, rows = this_machine(args)
    cfg = config_from_yaml_text((BENCH / rows[0]["run"] / "config.yaml").read_text())
    workload = (f"Workload of the runs: {cfg.model.name}, {cfg.total_steps} steps of {cfg.trainer.batch_size} "
                f"trajectories, learning {'on (lr ' + format(cfg.trainer.lr, 'g') + ')' if cfg.trainer.lr > 0 else 'off'}"
                f", trainer.stale_tokens={cfg.trainer.stale_tokens}, rollout.restart_stale="
                f"{str(cfg.rollout.restart_stale).lower()}.\n\n")
    reused = ("The runs were made earlier (`--reuse`): " + ", ".join(
        f"{r['run']} {r['measured']:.1f} traj/s" for r in rows) + ".\n\n") if args.reuse else ""
    sections = ["## This machine: calibrated on the sync and eta=2 runs of each round, predicting the others\n\n"
                + workload + reused + machine_text]
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
