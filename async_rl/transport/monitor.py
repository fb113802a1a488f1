"""What ZeroMQ does to the trainer's queue socket out of the application's sight, made visible.

Two things happen below the messages: a handshake fails (CURVE: a key the trainer does not admit,
a peer without CURVE; `auth.py` says which), and a connection is cut. ZeroMQ cuts a connection
that sends a frame over the socket's MAXMSGSIZE (the frame limit the trainer derives from its
config) without telling the application anything but a DISCONNECTED event, the same event a
producer's normal goodbye makes. So a cut is logged, one line each, unless a goodbye (BYE, within
`settle_s`: it comes on another socket, in no fixed order with the event) or a failed handshake
explains it: a frame over the limit, or a producer that died.

    monitor = QueueMonitor(sock, curve_server_or_None, max_frame)
    poller.register(monitor.sock, zmq.POLLIN)
    refused = monitor.drain()     # when readable: failed handshakes since the last call
    monitor.expect_goodbye()      # a producer said BYE: its disconnect is no news
    monitor.settle()              # every loop turn: disconnects no BYE came for are cuts
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from async_rl.transport.auth import HANDSHAKE_FAILED

logger = logging.getLogger(__name__)


class QueueMonitor:
    def __init__(self, sock: zmq.Socket, auth: Any, max_frame: int, settle_s: float = 2.0):
        self._watched = sock
        self.sock = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED)
        self.auth, self.max_frame, self.settle_s = auth, max_frame, settle_s
        self.cuts = 0  # disconnects no goodbye explained
        self._goodbyes = 0  # BYEs whose disconnect has not come yet
        self._failed = 0  # failed handshakes whose disconnect has not come yet
        self._unexplained: list[float] = []  # disconnects waiting settle_s for their BYE (another socket's order)
        self._window, self._logged = 0.0, 0

    def expect_goodbye(self) -> None:
        if self._unexplained:
            self._unexplained.pop(0)
        else:
            self._goodbyes += 1

    def drain(self) -> int:
        """Handle the events since the last call; return the failed handshakes among them."""
        refused = 0
        while True:
            try:
                event = parse_monitor_message(self.sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return refused
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnected()
                continue
            refused += 1
            self._failed += 1
            if self.auth is not None:
                self.auth.refused(event)

    def _disconnected(self) -> None:
        if self._failed:
            self._failed -= 1
        elif self._goodbyes:
            self._goodbyes -= 1
        else:
            self._unexplained.append(time.monotonic())

    def settle(self) -> None:
        """Count and log the disconnects no goodbye came for within settle_s (call it every loop turn)."""
        now = time.monotonic()
        while self._unexplained and now - self._unexplained[0] > self.settle_s:
            self._unexplained.pop(0)
            self._cut(now)

    def _cut(self, now: float) -> None:
        self.cuts += 1
        if now - self._window > 10.0:
            self._window, self._logged = now, 0
        self._logged += 1
        if self._logged > 10:
            return
        limit = f"over the {self.max_frame}-byte frame limit (the largest group this config can produce, with " \
                f"headroom)" if self.max_frame else "too large for the socket"
        logger.warning("a producer's connection was cut without a goodbye: ZeroMQ refuses a frame %s this way, and a "
                       "producer that died leaves so%s", limit,
                       " (more within 10s are only counted)" if self._logged == 10 else "")

    def close(self) -> None:
        """Before the watched socket closes (its monitor endpoint is named after its file descriptor: a
        later socket given the same one must not find this monitor still bound)."""
        self._watched.disable_monitor()
        self.sock.close(0)
