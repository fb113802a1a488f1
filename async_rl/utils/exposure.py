"""Closed by default: what listens where other machines reach it must hold a key.

Two things listen: the trainer's trajectory queue (`transport.addr`), which takes trajectories into
training and sends weights out, and each generation server (`engine.host`), whose routes load
weights and generate. On a loopback address (127.0.0.0/8, ::1, localhost) or a local transport
(ipc://, inproc://) only this machine reaches them, and no key is needed: the default
single-machine run needs none. Anywhere else (an interface's address, a wildcard, a host name
that is not all loopback) the queue needs CURVE keys (`transport.curve_keys_dir`) and a server
an API key (`engine.api_key`), or start-up stops with one line naming the key and
`async-rl keys`; `transport.insecure=true` / `engine.insecure=true` run open all the same, with a
warning at every start.

    check_queue(cfg.transport.addr, cfg.transport.curve_keys_dir, cfg.transport.insecure)  # raises ExposedError
    check_server(cfg.engine.host, cfg.engine.api_key, cfg.engine.insecure)
"""

from __future__ import annotations

import ipaddress
import logging
import socket

logger = logging.getLogger(__name__)


class ExposedError(ValueError):
    """Something would listen, unguarded, where other machines reach it."""


def is_loopback(host: str) -> bool:
    """Only this machine reaches `host`: a loopback address, or a name that resolves to loopback only."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host in ("", "*"):
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False  # not resolvable here (a ZeroMQ interface name): treated as reachable
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def queue_host(addr: str) -> str | None:
    """The host a tcp:// address binds, None for a local transport (ipc://, inproc://)."""
    if not addr.startswith("tcp://"):
        return None
    rest = addr[len("tcp://"):]
    if rest.startswith("["):
        return rest[1:rest.index("]")] if "]" in rest else rest
    return rest.rsplit(":", 1)[0]


def check_queue(addr: str, curve_keys_dir: str, insecure: bool) -> None:
    host = queue_host(addr)
    if host is None or is_loopback(host) or curve_keys_dir:
        return
    if insecure:
        logger.warning("transport.insecure=true: the trajectory queue at %s takes trajectories into training from "
                       "anyone who reaches it, and sends them the weights (no transport.curve_keys_dir)", addr)
        return
    raise ExposedError(f"transport.curve_keys_dir: the trajectory queue binds {addr}, which other machines reach, "
                      "and has no keys: anyone who reaches it could feed the trainer; make them with `async-rl keys "
                      "--out DIR` and set transport.curve_keys_dir=DIR on both sides (or bind 127.0.0.1; "
                      "transport.insecure=true runs it open)")


def check_server(host: str, api_key: str, insecure: bool) -> None:
    if is_loopback(host) or api_key:
        return
    if insecure:
        logger.warning("engine.insecure=true: the generation server on %s loads weights for anyone who reaches it "
                       "(no engine.api_key)", host)
        return
    raise ExposedError(f"engine.api_key: the generation server binds {host}, which other machines reach, and has no "
                      "API key: anyone who reaches it could load weights into it; make one with `async-rl keys "
                      "--out DIR` and set engine.api_key=file:DIR/api_key on the server and the rollout side (or "
                      "bind engine.host=127.0.0.1; engine.insecure=true runs it open)")
