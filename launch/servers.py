"""Generation-server launchers, chosen by `engine.backend`: start server number `index`, return (process, url).

    proc, url = SERVER_LAUNCHERS[cfg.engine.backend](cfg, 0)

`embedded` starts this project's engine (`async-rl serve`) as a child process; `sglang`
starts `python -m sglang.launch_server` on GPU `index` (`launch.sglang_server`). Backends
register here; the rollout side and the Ray launcher pick from this
dict and never test backend names themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from async_rl.config import Config
from launch.procs import start_server
from launch.sglang_server import start_sglang

ServerLauncher = Callable[[Config, int], tuple[Any, str]]


def start_embedded(cfg: Config, index: int) -> tuple[Any, str]:
    return start_server(cfg, index)


SERVER_LAUNCHERS: dict[str, ServerLauncher] = {"embedded": start_embedded, "sglang": start_sglang}
