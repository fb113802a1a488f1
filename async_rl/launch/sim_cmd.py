"""`async-rl sim`: predict a run before renting the GPUs (async_rl/sim).

    async-rl sim --profile configs/sim/areal_h800_r1distill_1p5b.yaml --gpus 64 --eta 0,1,2,4,8 --split auto
    async-rl sim calibrate RUN_DIR [RUN_DIR...] [--out PROFILE.yaml]

The first prints a table (every split and eta against sync on all the GPUs), draws the plots
(OUT/sim.png) and recommends a split and an eta; the second writes a profile measured on a run.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    text = "simulate a run: the pool split and staleness bound to choose, or calibrate a profile on a run"
    p = sub.add_parser("sim", help=text, description=text)
    p.add_argument("words", nargs="*", metavar="calibrate RUN_DIR... | key=value",
                   help="`calibrate RUN_DIR [RUN_DIR...]` writes a profile from runs (pooled); otherwise config "
                        "overrides of the workload")
    p.add_argument("--profile", "-p", help="profile YAML (configs/sim/, or one `sim calibrate` wrote)")
    p.add_argument("--gpus", type=int, default=None, help="units to split (GPUs; cores for a CPU profile)")
    p.add_argument("--eta", default="0,1,2,4,8", help="max_staleness values, comma-separated")
    p.add_argument("--split", default="auto", help="auto, shared, or ROLLOUT:TRAINER pairs, comma-separated")
    p.add_argument("--steps", type=int, default=20, help="train steps per simulated run")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="the recommended eta is the smallest within this share of the best throughput")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", "-o", default=None, help="where the plots and table go (default runs/sim/NAME); "
                                                     "for calibrate: the profile path")


def sim_main(args: argparse.Namespace) -> int:
    if args.words and args.words[0] == "calibrate":
        return _calibrate(args)
    return _sweep(args)


def _calibrate(args: argparse.Namespace) -> int:
    from async_rl.sim.calibrate import calibrate
    from async_rl.sim.profile import save_profile

    if len(args.words) < 2:
        raise ValueError("sim calibrate: expected a RUN_DIR (async-rl sim calibrate RUN_DIR [RUN_DIR...] "
                         "[--out PROFILE.yaml])")
    run_dirs = [Path(w) for w in args.words[1:]]
    profile = calibrate(*run_dirs)
    out = save_profile(profile, args.out or run_dirs[0] / "sim_profile.yaml")
    e, t = profile.engine, profile.trainer
    print(f"engine: {1e3 * e.step_base_s:.2f} ms/step + {1e3 * e.per_seq_s:.3f} ms/sequence + "
          f"{1e6 * e.per_ctx_token_s:.3f} us/context token + {1e6 * e.per_prefill_token_s:.2f} us/prompt token "
          f"on {e.units} {profile.units}(s), scaling {e.scaling:.2f}")
    print(f"trainer: {t.step_overhead_s:.3f} s/step + {1e3 * t.per_token_s:.4f} ms/token on {t.units} "
          f"{profile.units}(s), scaling {t.scaling:.2f}; weight update: publish {profile.sync.publish_s:.3f} s, "
          f"load {profile.sync.load_s:.3f} s; {len(profile.response.samples)} response lengths")
    overlap = {k: v for k, v in profile.measured.items() if "_overlap_" in k}
    if overlap:  # an async run among the runs: how much each side slowed while the other worked
        print("overlap (x slower while the other side works): " + ", ".join(
            f"{k.replace('_overlap_', ' on ')} x{v:.2f}" for k, v in sorted(overlap.items())))
    print(f"profile: {out}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from async_rl.sim.plots import plot_sweep
    from async_rl.sim.profile import load_profile
    from async_rl.sim.sweep import parse_splits, run_sweep, table

    if not args.profile:
        raise ValueError("--profile: required (a YAML in configs/sim/, or `async-rl sim calibrate RUN_DIR` writes one)")
    bad = [w for w in args.words if "=" not in w]
    if bad:
        raise ValueError(f"sim: unexpected argument {bad[0]!r} (expected `calibrate RUN_DIR` or key=value overrides)")
    profile = load_profile(args.profile)
    units = args.gpus if args.gpus is not None else int(profile.measured.get("placement", {}).get("total", 0) or 0)
    if units < 2:
        raise ValueError(f"--gpus: need at least 2 units to split, got {units}")
    etas = _etas(args.eta)
    if args.steps < 4:
        raise ValueError(f"--steps: need at least 4 train steps (3 are warm-up), got {args.steps}")
    if not 0 <= args.tolerance < 1:
        raise ValueError(f"--tolerance: must be in [0, 1), got {args.tolerance}")
    splits = parse_splits(args.split, profile, units)
    sweep = run_sweep(profile, units, etas, splits, steps=args.steps, seed=args.seed, overrides=list(args.words))
    rec = sweep.recommendation(args.tolerance)
    text = table(sweep)
    print(text)
    print(rec.text)
    out = Path(args.out or Path("runs") / "sim" / Path(args.profile).stem)
    png = plot_sweep(sweep, rec, out / "sim.png", title=f"{profile.name}: {units} {sweep.unit_name}")
    (out / "sim.md").write_text(f"# {profile.name}: {units} {sweep.unit_name}\n\n{text}\n\n{rec.text}\n")
    print(f"plots: {png}; table: {out / 'sim.md'}")
    return 0


def _etas(text: str) -> list[int]:
    try:
        etas = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--eta: expected comma-separated integers >= 0, got {text!r}") from None
    if not etas or etas[0] < 0:
        raise ValueError(f"--eta: expected comma-separated integers >= 0, got {text!r}")
    return etas
