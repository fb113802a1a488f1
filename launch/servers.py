"""Generation-server launchers, chosen by `engine.backend`: start server number `index`, return (process, url).

    proc, url = SERVER_LAUNCHERS[cfg.engine.backend](cfg, 0, slot.env())

`embedded` starts this project's engine (`async-rl serve`) as a child process; `sglang`
starts `python -m sglang.launch_server` (`launch.sglang_server`). Each runs with `env` added
to its environment: the CUDA_VISIBLE_DEVICES of the GPU async_rl.placement gave it (`cfg`
already says its device and memory share). Backends register here; the rollout side and the
Ray launcher pick from this dict and never test backend names themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from async_rl.config import Config
from launch.procs import start_server
from launch.sglang_server import start_sglang

ServerLauncher = Callable[[Config, int, dict[str, str]], tuple[Any, str]]


def start_embedded(cfg: Config, index: int, env: dict[str, str]) -> tuple[Any, str]:
    return start_server(cfg, index, env)


SERVER_LAUNCHERS: dict[str, ServerLauncher] = {"embedded": start_embedded, "sglang": start_sglang}
