"""`engine.backend=sglang`: one SGLang server per GPU (`python -m sglang.launch_server`), driven by our client.

    proc, url = SERVER_LAUNCHERS["sglang"](cfg, index, env)   # = start_sglang

Server `index` runs on the GPU async_rl.placement gave it (`env` holds its CUDA_VISIBLE_DEVICES,
physical ids, added to the inherited environment), listens on `engine.host` and
`engine.port + index` (a free port when engine.port is 0), serves `model.name` (a Hugging
Face checkpoint directory or hub id), labels its weights version 0 (`--weight-version 0`,
so per-token versions are integers from the start) and logs to
`run_dir/logs/sglang<index>.log`. What the run configures reaches SGLang's flags:
`engine.incremental_streaming_output` (--incremental-streaming-output),
`engine.deterministic_inference` (--enable-deterministic-inference: without it SGLang ignores
`sampling_seed`), the GPU memory share placement gives a server (`engine.gpu_memory_fraction`:
--mem-fraction-static, always where it shares the GPU with the trainer), `engine.tp_size`
(--tp-size), `engine.api_key` and `model.dtype`. /health is left as SGLang has it (it
generates a token, so no answer while paused): the client probes /model_info while it holds
a server paused. The launcher returns once /health answers 200; a server
that exits first, or is not up within `timeout_s`, is an error quoting the end of its log.
Without SGLang installed it fails at once with an error naming `engine.backend=sglang`
(without a GPU for it, placement refused the run before it started). SGLang servers started
elsewhere are used through `rollout.server_addrs` instead (no launcher involved).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from async_rl.config import Config, resolve_secret
from async_rl.utils.ports import free_port

BUILT_IN_MODELS = ("tiny", "smollm2-135m")  # built in-process by async_rl.models: SGLang cannot load them


class SGLangProcess:
    """A launched SGLang server with the `multiprocessing.Process` surface `launch.procs.stop_all` uses;
    stopping it signals its whole process group (SGLang runs scheduler and detokenizer children)."""

    def __init__(self, popen: subprocess.Popen, log_path: Path):
        self.popen, self.log_path = popen, log_path
        self.pid = popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def check_sglang(cfg: Config, index: int) -> None:
    """Fail early, naming the config key, where SGLang cannot run server `index`."""
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sgl_kernel") is None:
        raise RuntimeError("engine.backend=sglang: SGLang's server is not installed in this environment (make "
                           "install puts in only its Python source, for the tests; pip install 'sglang[all]' on a "
                           "CUDA machine), or start SGLang servers yourself and list their URLs in "
                           "rollout.server_addrs")
    if cfg.model.name in BUILT_IN_MODELS:
        raise RuntimeError(f"engine.backend=sglang: model.name={cfg.model.name!r} is built in-process and SGLang "
                           "cannot load it; give a Hugging Face checkpoint directory or hub id")


def sglang_command(cfg: Config, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model.name,
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


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_sglang(cfg: Config, index: int, env: dict[str, str] | None = None,
                 timeout_s: float = 900.0) -> tuple[SGLangProcess, str]:
    """Start SGLang server `index` with `env` added to the inherited environment (its GPU: never the
    index, which would discard the user's or Ray's mask); return it and its URL once /health answers 200."""
    check_sglang(cfg, index)
    port = cfg.engine.port or free_port(cfg.engine.host)  # server_config already gave server `index` its own port
    host = f"[{cfg.engine.host}]" if ":" in cfg.engine.host else cfg.engine.host
    url = f"http://{host}:{port}"
    log_path = Path(cfg.run_dir) / "logs" / f"sglang{index}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        popen = subprocess.Popen(sglang_command(cfg, port), stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})},
                                 start_new_session=True)
    proc = SGLangProcess(popen, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.is_alive():
            raise RuntimeError(f"engine.backend=sglang: server {index} exited with code {proc.exitcode} "
                               f"(log: {log_path}):\n{_log_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=5.0, trust_env=False, headers=_auth(cfg)).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.terminate()
    proc.join(20)
    proc.kill()
    raise RuntimeError(f"engine.backend=sglang: server {index} not healthy within {timeout_s:.0f}s "
                       f"(log: {log_path}):\n{_log_tail(log_path)}")
