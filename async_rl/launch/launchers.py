"""Run launchers, chosen by `launcher`: place trainer, rollout and generation servers, supervise, tear down.

    lines = LAUNCHERS[cfg.launcher](cfg)     # the run's summary lines

`local` runs them as child processes of this one; `ray` places them on a Ray cluster.
"""

from __future__ import annotations

from collections.abc import Callable

from async_rl.config import Config
from async_rl.launch.local import run_local
from async_rl.launch.ray_launcher import run_ray

LAUNCHERS: dict[str, Callable[[Config], list[str]]] = {"local": run_local, "ray": run_ray}
