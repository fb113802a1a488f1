"""The sweep's plots, one PNG of three panels: gain against eta per split, staleness of the
recommended split for each eta, and how idle each pool is across splits at the recommended eta."""

from __future__ import annotations

from pathlib import Path

from async_rl.sim.sweep import Recommendation, Sweep


def plot_sweep(sweep: Sweep, rec: Recommendation, out: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (gain, stale, idle) = plt.subplots(1, 3, figsize=(16, 4.6))
    placements = list(dict.fromkeys(r.placement for r in sweep.results))
    for placement in placements:
        rows = sorted((r for r in sweep.results if r.placement == placement), key=lambda r: r.eta)
        gain.plot([r.eta for r in rows], [sweep.gain(r) for r in rows], marker="o", label=placement.label(),
                  linewidth=2.5 if placement == rec.placement else 1.2)
    gain.axhline(1.0, color="grey", linestyle="--", label="sync (all units)")
    gain.set(xlabel="max_staleness (eta)", ylabel="trained trajectories/s vs sync",
             title=f"throughput against eta, per split (rollout:trainer {sweep.unit_name})")
    gain.legend(fontsize=7)

    chosen = sorted((r for r in sweep.results if r.placement == rec.placement), key=lambda r: r.eta)
    width = 0.8 / max(1, len(chosen))
    for i, r in enumerate(chosen):
        hist = r.staleness_hist
        total = max(1, sum(hist))
        stale.bar([k + i * width for k in range(len(hist))], [n / total for n in hist], width=width,
                  label=f"eta={r.eta}")
    stale.set(xlabel="lag of the oldest token (last bar of each: over eta, dropped)", ylabel="share of arrivals",
              title=f"staleness distribution, split {rec.placement.label()}")
    stale.legend(fontsize=7)

    at_eta = [next((r for r in sweep.results if r.placement == p and r.eta == rec.eta), None) for p in placements]
    pairs = [(p, r) for p, r in zip(placements, at_eta) if r is not None]
    xs = range(len(pairs))
    idle.bar([x - 0.2 for x in xs], [100 * r.engine_idle for _, r in pairs], width=0.4, label="rollout pool")
    idle.bar([x + 0.2 for x in xs], [100 * r.trainer_idle for _, r in pairs], width=0.4, label="trainer pool")
    idle.set_xticks(list(xs), [p.label() for p, _ in pairs], rotation=30, fontsize=7)
    idle.set(ylabel="% of steady time idle", title=f"idle time per pool at eta={rec.eta}")
    idle.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
