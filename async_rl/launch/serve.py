"""`async-rl serve`: one embedded generation server (model + engine + HTTP) in this process.

`serve_main` binds `engine.host:engine.port` itself (port 0 = a free port), and once
uvicorn accepts requests prints exactly one line, `serving on http://HOST:PORT`, to stdout
and writes the URL to `ready_file` if one is given. SIGINT/SIGTERM abort the requests in
flight, stop the HTTP server and the engine loop, and return.

`BackgroundServer` serves the same app from a background thread of the calling process
(tests, notebooks, benchmarks):

    with BackgroundServer.for_model(model, tokenizer, EngineConfig(), model_name="tiny") as url:
        ...  # http://127.0.0.1:<free port>
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI

from async_rl.config import Config, EngineConfig
from async_rl.engine.async_engine import AsyncEngine, EngineStoppedError
from async_rl.engine.llm_engine import LLMEngine
from async_rl.engine.server import build_app
from async_rl.models import eos_token_ids, load_model, load_tokenizer
from async_rl.placement import engine_share, kv_cache_bytes
from async_rl.utils.exposure import check_server
from async_rl.utils.hardware import resolve_device
from async_rl.launch.common import cap_gpu_memory, setup_cores

logger = logging.getLogger(__name__)


class EngineServer(uvicorn.Server):
    """uvicorn serving one engine: on shutdown it first aborts the requests in flight (so their
    handlers answer at once instead of holding the shutdown), and SIGINT/SIGTERM end `serve()`
    normally instead of being re-raised after it. What is still running `GRACE_S` later (a request
    whose client never sent its whole body) is cancelled and answered 503 (connection closed) if
    nothing was sent yet, with one warning and no traceback: the server is stopping."""

    GRACE_S = 3.0

    def __init__(self, app: FastAPI, engine: AsyncEngine):
        super().__init__(uvicorn.Config(self._quiet_when_stopping(app), log_level="warning", access_log=False,
                                        lifespan="off", timeout_graceful_shutdown=self.GRACE_S,
                                        timeout_keep_alive=30))
        self.engine = engine

    def _quiet_when_stopping(self, app: FastAPI) -> Callable[..., Awaitable[None]]:
        async def asgi(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
            started = False

            async def tracked(message: dict[str, Any]) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            try:
                await app(scope, receive, tracked if scope["type"] == "http" else send)
            except asyncio.CancelledError:
                if not self.should_exit or scope["type"] != "http":
                    raise
                # cancelled by the shutdown's grace timeout (uvicorn's own error line is filtered: _GraceFilter)
                if not started:  # an answer, so uvicorn has nothing to complain about
                    body = b'{"error": "the server is shutting down"}'
                    await send({"type": "http.response.start", "status": 503,
                                "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                            (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
        return asgi

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        # a child of a launcher ignores SIGINT (the launcher stops it with SIGTERM, in order)
        wanted = [signal.SIGTERM] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else [])
        previous = {s: signal.signal(s, self.handle_exit) for s in wanted}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        with contextlib.suppress(EngineStoppedError):
            await self.engine.abort_all()
        await super().shutdown(sockets=sockets)


class _GraceFilter(logging.Filter):
    """uvicorn logs the requests it cancels at the end of a stop's grace period as an ERROR; for a
    server that is stopping they are expected: one warning of ours says it instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().endswith("timeout graceful shutdown exceeded"):
            logger.warning("stopping: %s request(s) still running after %.0fs were cancelled",
                           record.args[0] if record.args else "some", EngineServer.GRACE_S)
            return False
        return True


logging.getLogger("uvicorn.error").addFilter(_GraceFilter())


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0 = a free port; read it back with `socket_url`).

    It listens at once, not when uvicorn starts serving seconds later (after the model loads):
    with SO_REUSEADDR (kept so a restarted server gets its old port back out of TIME_WAIT) a
    socket that is only bound does not hold its port against another SO_REUSEADDR bind, such
    as ZeroMQ's for a queue address picked by `async_rl.launch.common.free_port`, and this server's
    listen would then fail with EADDRINUSE. Connections that arrive early wait in the backlog.

    Its protocol is named (IPPROTO_TCP) and TCP_NODELAY is set on it, which the connections it
    accepts inherit. asyncio sets TCP_NODELAY only on sockets whose `proto` is IPPROTO_TCP
    (`base_events._set_nodelay`), and one made with proto 0 is not: uvicorn then writes a
    response's head and body as two segments, Nagle holds the second until the client's delayed
    ACK, and every request on a kept-alive connection waited ~40 ms (measured: 44 ms for
    /model_info, against 0.8 ms with it; tests/integration/test_server_latency.py)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as exc:
        sock.close()
        raise OSError(f"engine.host/engine.port: cannot bind {host}:{port} ({exc.strerror}); "
                      "use engine.port=0 for a free port") from None
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def build_engine(model: torch.nn.Module, tokenizer: Any, config: EngineConfig, cores: Any = None) -> AsyncEngine:
    """An AsyncEngine (not started) around `model`, ending responses at its EOS ids."""
    return AsyncEngine(LLMEngine(model, config, tokenizer=tokenizer, eos_token_ids=eos_token_ids(model, tokenizer)),
                       cores=cores)


class BackgroundServer:
    """Serve an engine's app from a background thread (its own event loop) on a free port."""

    def __init__(self, app: FastAPI, engine: AsyncEngine, host: str = "127.0.0.1", port: int = 0,
                 own_engine: bool = False):
        self.engine, self.own_engine = engine, own_engine
        self.sock = bind_socket(host, port)
        self.url = socket_url(self.sock)
        self.server = EngineServer(app, engine)
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                        name="http-server", daemon=True)

    @classmethod
    def for_model(cls, model: torch.nn.Module, tokenizer: Any, config: EngineConfig, *,
                  model_name: str) -> "BackgroundServer":
        """Engine, app and server around `model`; `stop()` also shuts the engine down."""
        engine = build_engine(model, tokenizer, config).start()
        return cls(build_app(engine, model_name=model_name, tokenizer=tokenizer), engine, own_engine=True)

    def start(self, timeout_s: float = 30.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"server at {self.url} failed to start (see the log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server at {self.url} did not start within {timeout_s:g}s")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self.sock.close()
        if self.own_engine:
            self.engine.shutdown()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _write_ready(ready_file: str, url: str) -> None:
    path = Path(ready_file)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(url)
    tmp.replace(path)  # readers never see a half-written address


def gpu_engine_config(cfg: Config, device: torch.device) -> EngineConfig:
    """On CUDA the KV pool is sized from the engine's share of its GPU (`engine.gpu_memory_fraction`, which
    placement resolved) once the weights are loaded, not from `engine.kv_cache_mb` (kept for CPU)."""
    if device.type != "cuda":
        return cfg.engine
    free, total = torch.cuda.mem_get_info(device)
    kv = kv_cache_bytes(fraction=engine_share(cfg, shared=False), total=total, free=free,
                        held=torch.cuda.memory_reserved(device), bucket=int(cfg.weight_sync.bucket_mb * 2**20))
    logger.info("KV cache on %s: %.0f MiB (engine.gpu_memory_fraction=%g of %.1f GiB)", device, kv / 2**20,
                engine_share(cfg, shared=False), total / 2**30)
    return dataclasses.replace(cfg.engine, kv_cache_mb=kv / 2**20)


def serve_main(cfg: Config, *, ready_file: str | None = None) -> None:
    check_server(cfg.engine.host, cfg.engine.api_key, cfg.engine.insecure)  # closed by default: a key where others reach it
    cores = setup_cores(cfg, "engine")
    sock = bind_socket(cfg.engine.host, cfg.engine.port)  # fail early (port taken) before loading the model
    url = socket_url(sock)
    tokenizer = load_tokenizer(cfg.model)
    device = resolve_device(cfg.engine.device, "engine.device")
    cap_gpu_memory(str(device), engine_share(cfg, shared=False))  # its part of a GPU it may share
    model = load_model(cfg.model, seed=cfg.seed, tokenizer=tokenizer, device=device)
    engine = build_engine(model, tokenizer, gpu_engine_config(cfg, device), cores).start()
    server = EngineServer(build_app(engine, model_name=cfg.model.name, tokenizer=tokenizer), engine)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        if ready_file:  # started by a launcher, which reads the address and owns the console
            _write_ready(ready_file, url)
        else:
            print(f"serving on {url}", flush=True)
        logger.info("serving %s on %s (%s, %s, torch threads: %d)", cfg.model.name, url, device,
                    next(model.parameters()).dtype, torch.get_num_threads())

    async def main() -> None:
        task = asyncio.create_task(announce())
        try:
            await server.serve(sockets=[sock])
        finally:
            task.cancel()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
        sock.close()
        logger.info("server on %s stopped", url)
