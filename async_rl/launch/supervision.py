"""Restart budgets and the restart record: what supervision shares.

    budget = RestartBudget(cfg)                  # supervise.max_restarts per component
    if budget.allow("trainer"):
        delay = budget.record("trainer", "killed by SIGKILL")   # logged, appended to run_dir/restarts.jsonl

Components are the trainer, the rollout process (both restarted by the launcher, async_rl/launch/local.py)
and each generation server, `server0`, `server1`, ... (restarted by the rollout process that owns
it, async_rl/launch/server_keeper.py). The launcher and the rollout process append to the same
`restarts.jsonl`, one JSON line per restart, and a budget counts the lines already there, so a
restarted rollout process does not give its servers a fresh budget. The trainer's SIGTERM flag,
which the launcher's drain relies on, is async_rl/trainer/drain.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path

from async_rl.config import Config
from async_rl.utils.metrics import read_jsonl

logger = logging.getLogger(__name__)

RESTARTS_FILE = "restarts.jsonl"
MAX_BACKOFF_S = 60.0


def restarts_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / RESTARTS_FILE


def read_restarts(run_dir: str | Path) -> list[dict]:
    return read_jsonl(restarts_path(run_dir))


class RestartBudget:
    """`supervise.max_restarts` restarts per component, each after an exponential backoff."""

    def __init__(self, cfg: Config):
        self.run_dir = Path(cfg.run_dir)
        self.max_restarts = cfg.supervise.max_restarts
        self.backoff_s = cfg.supervise.restart_backoff_s
        self.used = Counter(r["component"] for r in read_restarts(self.run_dir) if r.get("counted", True))

    def allow(self, component: str) -> bool:
        return self.used[component] < self.max_restarts

    def spent(self, component: str, cause: str) -> str:
        """The line that ends the run (or leaves a server out) once `component`'s budget is spent."""
        if not self.max_restarts:
            return cause
        return (f"{cause}; restarted {self.used[component]} times already, the most supervise.max_restarts="
                f"{self.max_restarts} allows")

    def record(self, component: str, cause: str, *, counted: bool = True) -> float:
        """Count one restart of `component` (not when `counted` is False: a restart forced by another
        component's), log it and append it to restarts.jsonl; returns the seconds to wait before it."""
        if counted:
            self.used[component] += 1
        n = self.used[component]
        delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** max(0, n - 1)) if counted else 0.0
        row = {"time": time.time(), "component": component, "cause": cause, "restart": n,
               "max_restarts": self.max_restarts, "counted": counted, "delay_s": delay}
        path = restarts_path(self.run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:  # one short line per write: the launcher and the rollout process both append
            f.write(json.dumps(row) + "\n")
        if counted:
            logger.warning("%s died (%s): restart %d of %d in %.1fs", component, cause, n, self.max_restarts, delay)
        else:
            logger.warning("%s restarts too (%s)", component, cause)
        return delay


def restart_lines(run_dir: str | Path) -> list[str]:
    """The run summary's line about restarts (none when nothing restarted)."""
    rows = read_restarts(run_dir)
    if not rows:
        return []
    per = Counter(r["component"] for r in rows)
    forced = Counter(r["component"] for r in rows if not r.get("counted", True))  # e.g. the rollout side after a trainer restart
    listed = ", ".join(f"{name} {n}" + (f" ({forced[name]} following another's restart)" if forced[name] else "")
                       for name, n in sorted(per.items()))
    return [f"restarts: {listed} (causes in {restarts_path(run_dir)})"]
