"""`engine.backend=sglang`: one SGLang server per GPU (`python -m sglang.launch_server`), driven by our client.

    proc, url = SERVER_LAUNCHERS["sglang"](cfg, index, env, starting)   # = start_sglang

Server `index` runs on the GPU async_rl.placement gave it (`env` holds its CUDA_VISIBLE_DEVICES,
physical ids, added to the inherited environment), listens on `engine.host` and
`engine.port + index` (a free port when engine.port is 0), serves `model.name` (a Hugging
Face checkpoint directory or hub id), labels its weights version 0 (`--weight-version 0`,
so per-token versions are integers from the start) and logs to `run_dir/logs/server<index>.out`;
it runs under `engine.python` where SGLang has an environment of its own (its torch and
transformers pins differ from the trainer's), else under this interpreter. It is started under
a guard (`async_rl.launch.external_server`): tracked from its spawn, stopped with its starter. What the run configures reaches SGLang's flags:
`engine.incremental_streaming_output` (--incremental-streaming-output),
`engine.deterministic_inference` (--enable-deterministic-inference: without it SGLang ignores
`sampling_seed`), the GPU memory share placement gives a server (`engine.gpu_memory_fraction`:
--mem-fraction-static, always where it shares the GPU with the trainer), `engine.tp_size`
(--tp-size), `engine.api_key` and `model.dtype`. /health is left as SGLang has it (it
generates a token, so no answer while paused): the client probes /model_info while it holds
a server paused. The launcher returns once /health answers 200; a server
that exits first, or is not up within `engine.start_timeout_s`, is an error quoting the end of its log.
Without SGLang installed it fails at once with an error naming `engine.backend=sglang`
(without a GPU for it, placement refused the run before it started). SGLang servers started
elsewhere are used through `rollout.server_addrs` instead (no launcher involved).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from async_rl.config import Config, resolve_secret
from async_rl.utils.exposure import check_server
from async_rl.utils.ports import free_port
from async_rl.launch.external_server import Starting, start_guarded, wait_healthy
from async_rl.launch.procs import server_name

BUILT_IN_MODELS = ("tiny", "smollm2-135m")  # built in-process by async_rl.models: SGLang cannot load them


def check_sglang(cfg: Config, index: int) -> None:
    """Fail early, naming the config key, where SGLang cannot run server `index`."""
    own_env = bool(cfg.engine.python)  # SGLang in an environment of its own (engine.python): its start tells
    if not own_env and (importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sgl_kernel") is None):
        raise RuntimeError("engine.backend=sglang: SGLang's server is not installed in this environment (make "
                           "install puts in only its Python source, for the tests; pip install 'sglang[all]' on a "
                           "CUDA machine), or start SGLang servers yourself and list their URLs in "
                           "rollout.server_addrs")
    if cfg.model.name in BUILT_IN_MODELS:
        raise RuntimeError(f"engine.backend=sglang: model.name={cfg.model.name!r} is built in-process and SGLang "
                           "cannot load it; give a Hugging Face checkpoint directory or hub id")


def sglang_command(cfg: Config, port: int) -> list[str]:
    cmd = [cfg.engine.python or sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model.name,
           "--host", cfg.engine.host, "--port", str(port), "--weight-version", "0",
           "--random-seed", str(cfg.seed)]
    if cfg.model.dtype != "auto":
        cmd += ["--dtype", cfg.model.dtype]
    if cfg.engine.incremental_streaming_output:  # each streamed chunk carries only its new tokens
        cmd.append("--incremental-streaming-output")
    if cfg.engine.deterministic_inference:  # else SGLang ignores sampling_seed
        cmd.append("--enable-deterministic-inference")
    if cfg.engine.gpu_memory_fraction:  # its share of a GPU (placement sets it where the trainer shares the GPU)
        cmd += ["--mem-fraction-static", f"{cfg.engine.gpu_memory_fraction:g}"]
    if cfg.engine.tp_size > 1:  # its ranks in the dist weight group follow (rank_offset + tp_rank)
        cmd += ["--tp-size", str(cfg.engine.tp_size)]
    if cfg.engine.api_key:  # SGLang then refuses requests without the bearer token, as the embedded server does
        cmd += ["--api-key", resolve_secret(cfg.engine.api_key, "engine.api_key")]
    return cmd


def _auth(cfg: Config) -> dict[str, str]:
    token = resolve_secret(cfg.engine.api_key, "engine.api_key") if cfg.engine.api_key else ""
    return {"Authorization": f"Bearer {token}"} if token else {}


def start_sglang(cfg: Config, index: int, env: dict[str, str] | None = None,
                 starting: Starting | None = None) -> tuple[Any, str]:
    """Start SGLang server `index` with `env` added to the inherited environment (its GPU: never the
    index, which would discard the user's or Ray's mask); return it and its URL once /health answers 200."""
    check_sglang(cfg, index)
    check_server(cfg.engine.host, cfg.engine.api_key, cfg.engine.insecure)  # closed by default
    starting = starting or Starting()
    port = cfg.engine.port or free_port(cfg.engine.host)  # server_config already gave server `index` its own port
    host = f"[{cfg.engine.host}]" if ":" in cfg.engine.host else cfg.engine.host
    url = f"http://{host}:{port}"
    what = f"engine.backend=sglang: server {index} ({url})"
    proc = start_guarded(cfg, server_name(index), sglang_command(cfg, port), {}, starting, what=what, env=env)
    wait_healthy(cfg, proc, url, starting, what=what, timeout_s=cfg.engine.start_timeout_s, headers=_auth(cfg))
    return proc, url
