"""The run's headline figures as (label, value) rows: the report's summary table."""

from __future__ import annotations

from async_rl.report.data import RunData


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def _train_rows(run: RunData) -> list[tuple[str, str]]:
    out = []
    steps = run.values("train", "step")
    out.append(("train steps logged", f"{len(steps)}" + (f" (steps {min(steps)}..{max(steps)})" if steps else "")))
    versions = run.values("train", "policy_version")
    if versions:
        out.append(("policy version reached", f"{max(versions)}"))
    step_s = run.values("train", "timing/step_s")
    traj = run.values("train", "train/num_trajectories")
    if step_s:
        out.append(("trainer loop time", f"{sum(step_s):.1f} s ({_mean(step_s):.2f} s/step)"))
    if step_s and traj and sum(step_s) > 0:
        out.append(("trajectories trained", f"{sum(traj):.0f} ({sum(traj) / sum(step_s):.1f} / s)"))
    rewards = run.values("train", "train/reward_mean")
    if rewards:
        k = max(1, min(5, len(rewards) // 3))
        out.append((f"train reward, first {k} → last {k} steps", f"{_mean(rewards[:k]):.3f} → {_mean(rewards[-k:]):.3f}"))
    for key, label in [("train/staleness_max", "max staleness trained"), ("train/dropped_stale", "dropped as stale"),
                       ("rollout/interrupted", "interrupted trajectories")]:
        vals = run.values("train", key)
        if vals:
            value = max(vals) if key.endswith("_max") else sum(vals)
            out.append((label, f"{value:g}"))
    idle = run.values("train", "timing/idle_s") or run.values("train", "timing/wait_s")
    if idle and step_s and sum(step_s) > 0:
        out.append(("trainer idle share", f"{100 * sum(idle) / sum(step_s):.0f}% of its loop"))
    return out


def summary_rows(run: RunData) -> list[tuple[str, str]]:
    """Config, training, evaluation and engine headlines; a row only where the run logged its metric."""
    cfg = run.config
    rows = [("run directory", str(run.run_dir))]
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    for label, value in [("mode", cfg.get("mode")), ("max_staleness", cfg.get("max_staleness")),
                         ("total_steps (config)", cfg.get("total_steps")), ("model", model.get("name"))]:
        if value is not None:
            rows.append((label, str(value)))
    rows += _train_rows(run)
    evals = {e.get("when"): e for e in run.evals}
    before, after = evals.get("before", {}), evals.get("after", {})
    if "eval/accuracy" in before or "eval/accuracy" in after:
        n = after.get("eval/n", before.get("eval/n"))
        rows.append((f"greedy accuracy on {n} held-out problems, before → after",
                     f"{_fmt(before.get('eval/accuracy'))} → {_fmt(after.get('eval/accuracy'))}"))
    tps = run.values("rollout", "engine/tokens_per_s")
    if tps:
        rows.append(("engine tokens / s (mean over updates)", f"{_mean(tps):.0f}"))
    updates = run.values("rollout", "sync/update_s")
    if updates:
        rows.append(("weight updates loaded by the rollout side", f"{len(updates)} ({_mean(updates):.2f} s each)"))
    return rows
