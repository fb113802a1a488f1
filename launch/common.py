"""Small pieces every launcher needs: thread counts, free ports, one-line fatal errors."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def effective_threads(configured: int, mode: str) -> int:
    """Torch threads for one process: as configured, else half the cores when rollout and
    trainer run at once (async), all of them when they take turns (sync)."""
    if configured > 0:
        return configured
    cores = os.cpu_count() or 1
    return cores if mode == "sync" else max(1, cores // 2)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def with_free_port(addr: str) -> str:
    """tcp://HOST:0 -> tcp://HOST:<free port>; anything else unchanged."""
    if addr.startswith("tcp://") and addr.endswith(":0"):
        host = addr[len("tcp://"):-2]
        return f"tcp://{host}:{free_port(host if host not in ('*', '0.0.0.0') else '127.0.0.1')}"
    return addr


def error_file(run_dir: str | Path, name: str) -> Path:
    return Path(run_dir) / "logs" / f"{name}.error"
