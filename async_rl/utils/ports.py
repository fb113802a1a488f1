"""A free TCP port for an address this run must know before the process that binds it starts
(the trajectory queue, a TCPStore, an SGLang server's --port).

Such a port is free when picked and bound later, by another process. Picked with bind(0) it
comes from the kernel's ephemeral range, the very range every other bind(0) and every outgoing
connection on the machine draws from, so another run starting at the same moment can be given
the same port in between (CI saw a generation server's listen fail with EADDRINUSE this way).
So the port is drawn at random from below the ephemeral range (`ip_local_port_range`), where the
kernel never hands out ports by itself, and above the ports Ray uses by default (`LOWEST`),
and checked by binding it; only where that range is empty or taken does it fall back to bind(0).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Below this: well-known and registered services, and Ray's defaults on every node of a Ray cluster
# (client server 10001, worker ports 10002-19999: `ray start` refuses a head whose --port falls there)
LOWEST = 20000
TRIES = 64
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bind(host: str, port: int) -> int | None:
    """The port a socket bound to host:port got (port 0: one the kernel picks), or None if taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return None
        return s.getsockname()[1]


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port on `host` that nothing holds now, outside the kernel's ephemeral range where possible."""
    host = "127.0.0.1" if host in ("", "*", "0.0.0.0") else host
    rng = rng or random.SystemRandom()
    top = ephemeral_start()
    for _ in range(TRIES if top > LOWEST else 0):
        port = _bind(host, rng.randrange(LOWEST, top))
        if port is not None:
            return port
    port = _bind(host, 0)
    if port is None:
        raise OSError(f"no free port on {host}")
    return port
