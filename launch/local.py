"""`async-rl run`: trainer and rollout (with its generation servers) as supervised local processes.

The launcher supervises the trainer and the rollout process; the rollout process owns its
generation servers (`rollout.num_servers`), and a server that dies is taken out of rotation
there, so the run goes on while one server remains. A dead trainer or rollout ends the run.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from async_rl.config import Config, save_config
from async_rl.utils.metrics import read_jsonl
from async_rl.trainer.backends import get_backend
from launch.common import with_free_port
from launch.procs import child_error, spawn, stop_all, with_overrides
from launch.rollout_proc import rollout_main
from launch.trainer_proc import trainer_main

logger = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """A child process of the run died."""


def supervise(cfg: Config, procs: dict, finish_s: float) -> None:
    """Wait until every child exits 0; if one fails, stop the others and raise."""
    done_at: float | None = None
    while any(p.is_alive() for p in procs.values()):
        for name, p in procs.items():
            if not p.is_alive() and p.exitcode not in (0, None):
                stop_all(list(procs.values()))
                raise RunFailed(child_error(cfg, name, p))
        if not procs["trainer"].is_alive():
            done_at = done_at or time.monotonic()
            if time.monotonic() - done_at > finish_s:
                logger.warning("rollout did not finish %.0fs after the trainer; stopping it", finish_s)
                stop_all(list(procs.values()))
                return
        time.sleep(0.2)
    for name, p in procs.items():
        if p.exitcode != 0:
            raise RunFailed(child_error(cfg, name, p))


def summary(cfg: Config) -> list[str]:
    lines = []
    rows = read_jsonl(Path(cfg.run_dir) / "metrics.jsonl")
    if rows:
        k = max(1, min(3, len(rows) // 3))
        first = sum(r.get("train/reward_mean") or 0 for r in rows[:k]) / k
        last = sum(r.get("train/reward_mean") or 0 for r in rows[-k:]) / k
        lines.append(f"train reward mean: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
        lines.append(f"max staleness trained: {max(r.get('train/staleness_max') or 0 for r in rows)}; "
                     f"dropped stale: {sum(r.get('train/dropped_stale') or 0 for r in rows)}; "
                     f"interrupted trajectories: {sum(r.get('rollout/interrupted') or 0 for r in rows)}")
        lines.append(f"wall time: {sum(r.get('timing/step_s') or 0 for r in rows):.1f}s in {len(rows)} train steps")
    pool = read_jsonl(Path(cfg.run_dir) / "rollout_metrics.jsonl")[-1:]
    if pool and pool[0].get("pool/servers", 1) > 1:
        p = pool[0]
        lines.append(f"generation servers: {p['pool/servers']}, in rotation at the end: {p['pool/in_rotation']}; "
                     f"fenced {p['pool/fenced_total']} times, out of rotation {p['pool/unhealthy_total']} times; "
                     f"requests moved to another server: {p['pool/reissued']}")
    all_evals = read_jsonl(Path(cfg.run_dir) / "eval.jsonl")
    evals = {r["when"]: r for r in all_evals}
    if "before" in evals and "after" in evals:
        lines.append(f"greedy accuracy on {evals['before']['eval/n']} held-out problems: "
                     f"before {evals['before']['eval/accuracy']:.3f} -> after {evals['after']['eval/accuracy']:.3f}")
    periodic = [r for r in all_evals if r["when"] == "periodic"]
    if periodic:
        curve = ", ".join(f"v{r['step']} {r['eval/accuracy']:.2f}" for r in periodic)
        lines.append(f"accuracy during training: {curve}")
        for threshold in (0.70, 0.75):
            hit = next((r for r in periodic if r["eval/accuracy"] >= threshold), None)
            lines.append(f"time to accuracy >= {threshold:.2f}: " + (
                f"{hit['timing/train_wall_s']:.0f}s of training (version {hit['step']})" if hit else "not reached"))
    return lines


def run_local(cfg: Config) -> list[str]:
    get_backend(cfg.trainer.backend).check(cfg.trainer)  # every trainer rank runs here: fail before starting any
    cfg = with_overrides(cfg, transport={"addr": with_free_port(cfg.transport.addr)})
    save_config(cfg, cfg.run_dir)
    for stale in ("metrics.jsonl", "eval.jsonl", "rollout_metrics.jsonl"):
        (Path(cfg.run_dir) / stale).unlink(missing_ok=True)
    procs = {"trainer": spawn("trainer", trainer_main, cfg)}
    procs["rollout"] = spawn("rollout", rollout_main, cfg)
    try:
        supervise(cfg, procs, finish_s=cfg.rollout.connect_timeout_s + 300)
    except KeyboardInterrupt:
        stop_all(list(procs.values()))
        raise
    return summary(cfg)
