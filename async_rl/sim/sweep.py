"""Sweep the pool split and the staleness bound; recommend one, with its gain over sync.

    sweep = run_sweep(profile, units=64, etas=[0, 1, 2, 4, 8], splits=parse_splits("auto", profile, 64))
    print(table(sweep)); print(sweep.recommendation().text)

The baseline is sync on all the units (on GPUs: colocated, generation and training taking turns on
every GPU; on CPU cores: shared cores in sync mode). Each (split, eta) runs async on disjoint pools.
The recommendation takes the best split and, on it, the smallest eta within `tolerance` of that
split's best throughput: staleness costs learning, so it buys only throughput that is there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from async_rl.sim.profile import Profile
from async_rl.sim.run import Placement, SimResult, scale_down, sim_config, simulate_scaled


def parse_splits(text: str, profile: Profile, units: int) -> list[Placement]:
    """`auto`, `shared`, or comma-separated ROLLOUT:TRAINER pairs that add up to `units`."""
    if text == "auto":
        return auto_splits(profile, units)
    out = []
    for part in text.split(","):
        part = part.strip()
        if part == "shared":
            out.append(Placement.shared(units))
            continue
        try:
            rollout, trainer = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--split: {part!r} is not auto, shared or ROLLOUT:TRAINER (e.g. 48:16)") from None
        if rollout < 1 or trainer < 1 or rollout + trainer > units:
            raise ValueError(f"--split: {part} needs 1..{units} units on each side, at most {units} in all")
        out.append(Placement.pools(rollout, trainer))
    return out


def auto_splits(profile: Profile, units: int) -> list[Placement]:
    """Trainer shares of 1/8 .. 3/4 of the units (the rollout side in whole servers)."""
    tp = profile.engine.units if profile.units == "gpu" else 1
    seen, out = set(), []
    for eighths in range(1, 7):
        trainer = max(1, round(units * eighths / 8))
        rollout = (units - trainer) // tp * tp
        if rollout >= tp and trainer >= 1 and (rollout, trainer) not in seen:
            seen.add((rollout, trainer))
            out.append(Placement.pools(rollout, trainer))
    if not out:
        raise ValueError(f"--gpus {units}: too few units to split between a server of {tp} and a trainer")
    return out


@dataclass
class Recommendation:
    placement: Placement
    eta: int
    gain: float  # over the sync baseline
    best_eta: int
    best_gain: float
    text: str


@dataclass
class Sweep:
    units: int
    unit_name: str
    baseline: SimResult
    results: list[SimResult] = field(default_factory=list)
    scale: int = 1  # simulated at 1/scale of the units and batch (run.scale_down)

    def gain(self, r: SimResult) -> float:
        return r.traj_per_s / self.baseline.traj_per_s

    def recommendation(self, tolerance: float = 0.05) -> Recommendation:
        best = max(self.results, key=lambda r: r.traj_per_s)
        same = [r for r in self.results if r.placement == best.placement]
        pick = min((r for r in same if r.traj_per_s >= (1 - tolerance) * best.traj_per_s), key=lambda r: r.eta)
        text = (f"recommended: split {pick.placement.label()} (rollout:trainer {self.unit_name}), eta={pick.eta}: "
                f"{self.gain(pick):.2f}x the trained trajectories/s of sync on "
                f"all {self.units} {self.unit_name}" +
                (f" (eta={best.eta} gives {self.gain(best):.2f}x: within {100 * tolerance:.0f}%, for more staleness)"
                 if best is not pick else ""))
        return Recommendation(pick.placement, pick.eta, self.gain(pick), best.eta, self.gain(best), text)


def run_sweep(profile: Profile, units: int, etas: list[int], splits: list[Placement], steps: int = 20,
              seed: int = 0, overrides: list[str] = (), progress=None) -> Sweep:
    if profile.units == "gpu" and all(p.kind == "shared" for p in splits):
        raise ValueError("--split: nothing to simulate (shared GPUs only run sync: give ROLLOUT:TRAINER splits)")
    base_cfg = sim_config(profile, [*overrides, "mode=sync", f"total_steps={steps}"])
    scale = scale_down(profile, base_cfg, [Placement.shared(units), *splits])
    sweep = Sweep(units, "GPUs" if profile.units == "gpu" else "cores",
                  simulate_scaled(profile, base_cfg, Placement.shared(units), scale, seed), scale=scale)
    for placement in splits:
        for eta in etas:
            if progress is not None:
                progress(placement, eta)
            if placement.kind == "shared" and profile.units == "gpu":
                continue  # only sync is modelled on shared GPUs: that is the baseline
            cfg = sim_config(profile, [*overrides, "mode=async", f"max_staleness={eta}", f"total_steps={steps}"])
            sweep.results.append(simulate_scaled(profile, cfg, placement, scale, seed))
    return sweep


def mean_staleness(r: SimResult) -> float:
    hist = r.staleness_hist
    trained = hist[:-1]
    return sum(i * n for i, n in enumerate(trained)) / max(1, sum(trained))


def table(sweep: Sweep) -> str:
    b = sweep.baseline
    lines = [f"| split (rollout:trainer {sweep.unit_name}) | mode | eta | trained traj/s | vs sync | steady traj/s | "
             "step s | mean staleness | dropped | trainer idle | rollout idle | interrupted | restarted |",
             "|" + "---|" * 13]
    for r in [b, *sweep.results]:
        mode = "sync (colocated)" if r is b and sweep.unit_name == "GPUs" else r.mode
        lines.append(
            f"| {r.placement.label()} | {mode} | {r.eta} | {r.traj_per_s:.3g} | {sweep.gain(r):.2f}x | "
            f"{r.steady_traj_per_s:.3g} | {r.wall_s / len(r.records):.3g} | {mean_staleness(r):.2f} | "
            f"{r.staleness_hist[-1]} | {100 * r.trainer_idle:.0f}% | {100 * r.engine_idle:.0f}% | "
            f"{100 * r.interrupted_frac:.0f}% | {r.restarted} |")
    if sweep.scale > 1:
        lines.append(f"\nSimulated at 1/{sweep.scale} of the {sweep.unit_name} and of the batch (the same load per "
                     "server and per trainer GPU); counts and trajectories/s are scaled back up.")
    return "\n".join(lines)
