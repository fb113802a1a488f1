"""Generation-server launchers, chosen by `engine.backend`: start server number `index`, return (process, url).

    proc, url = SERVER_LAUNCHERS[cfg.engine.backend](cfg, 0, slot.env(), starting)

`embedded` starts this project's engine (`async-rl serve`) as a child process; `sglang`
starts `python -m sglang.launch_server` (`async_rl.launch.sglang_server`), `vllm` vLLM's OpenAI server in
its own environment (`async_rl.launch.vllm_server`). Each runs with `env` added to its environment: the
CUDA_VISIBLE_DEVICES of the GPUs async_rl.placement gave it (`cfg` already says its device and
memory share). `starting` (`async_rl.launch.external_server.Starting`) tracks the process from its spawn,
so a start that is abandoned (Ctrl-C, SIGTERM) leaves nothing running. Backends register here;
the rollout side and the Ray launcher pick from this dict and never test backend names themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from async_rl.config import Config
from async_rl.launch.external_server import Starting
from async_rl.launch.procs import start_server
from async_rl.launch.sglang_server import start_sglang
from async_rl.launch.vllm_server import start_vllm

ServerLauncher = Callable[[Config, int, dict[str, str], Starting], tuple[Any, str]]


def start_embedded(cfg: Config, index: int, env: dict[str, str], starting: Starting) -> tuple[Any, str]:
    return start_server(cfg, index, env, starting=starting)


SERVER_LAUNCHERS: dict[str, ServerLauncher] = {"embedded": start_embedded, "sglang": start_sglang,
                                               "vllm": start_vllm}
