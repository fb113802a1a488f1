"""The rollout process starts a generation server again when its process dies, on the same port.

    keeper = ServerKeeper(cfg, procs, pool, receiver, relaunch)  # relaunch(index, port) -> (proc, url)
    controller = RolloutController(..., weights=keeper.receiver)  # the wrapped receiver (see below)
    keeper.start()                                                # a watch task on the running loop
    ...
    await keeper.close()                                          # `procs` holds the current processes

A restart: the watch task sees a server's process gone (within `POLL_S`) and takes the server
out of rotation, unhealthy and fenced, so that no health check lets the fresh process, which
starts with the initial weights, back in early. After the backoff of its budget
(`supervise.max_restarts` per server, shared with the launcher's restarts.jsonl) the server
starts again with `engine.port` set to its old port, so the pool's client (same URL) reaches
it, and servers.json names its new pid. Then it is caught up: the last weights message is
prepared again and loaded into it (the `disk` and `zmq` transports keep the current version's
file; with `dist` it stays fenced until the next update loads it), and it rejoins the
rotation. A weight update that arrives meanwhile waits for the restart (in the wrapped
receiver's `prepare`, at most `rollout.connect_timeout_s`), so the update includes the
restarted server rather than finding none to load; and an update that finds its only server
killed mid-load is not fatal (`pool.recovery`): the restart loads that version. A server whose
budget is spent stays out of rotation: the run goes on while another server is in rotation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from async_rl.config import Config
from async_rl.protocols import WeightReceiver
from async_rl.rollout.server_pool import Server, ServerPool
from async_rl.launch.procs import child_cause, one_line, server_name
from async_rl.launch.supervision import RestartBudget

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often the server processes are checked
# weight transports whose last message can be prepared again to load a restarted server
REPLAYABLE = {"disk", "zmq"}

Relaunch = Callable[[int, int], tuple[Any, str]]  # (index, port) -> (process, url), blocking


def write_server_listing(run_dir: str | Path, procs: list[Any], urls: list[str]) -> None:
    """servers.json: which process serves which URL, for which rollout process (never half-written)."""
    listing = [{"index": i, "pid": proc.pid, "url": url, "rollout_pid": os.getpid()}
               for i, (proc, url) in enumerate(zip(procs, urls))]
    tmp = Path(run_dir) / "servers.json.tmp"
    tmp.write_text(json.dumps(listing, indent=1))
    tmp.replace(tmp.with_suffix(""))


class _RememberingReceiver:
    """The run's WeightReceiver, which also keeps the newest weights messages (a restarted server
    loads the pool's version, which is not the newest prepared when that one was superseded) and
    holds an update back while a server restarts."""

    KEEP = 4

    def __init__(self, inner: WeightReceiver, keeper: "ServerKeeper"):
        self.inner, self.keeper = inner, keeper
        self.recent: dict[int, dict[str, Any]] = {}  # version -> its weights message

    async def prepare(self, msg: dict[str, Any]) -> Any:
        await self.keeper.settled()
        prepared = await self.inner.prepare(msg)
        self.recent[int(msg["version"])] = msg
        for old in sorted(self.recent)[:-self.KEEP]:
            del self.recent[old]
        return prepared

    async def load(self, client: Any, prepared: Any, version: int) -> None:
        await self.inner.load(client, prepared, version)

    async def release(self, prepared: Any) -> None:
        await self.inner.release(prepared)

    def superseded(self, prepared: Any, version: int) -> bool:
        return self.inner.superseded(prepared, version)

    def __getattr__(self, name: str) -> Any:  # e.g. a transport's stats
        return getattr(self.inner, name)


class ServerKeeper:
    """Watches this rollout process's generation servers and restarts the ones that die."""

    def __init__(self, cfg: Config, procs: list[Any], pool: ServerPool, receiver: WeightReceiver,
                 relaunch: Relaunch):
        self.cfg, self.procs, self.pool, self.relaunch = cfg, procs, pool, relaunch
        self.urls = [s.address for s in pool.servers]
        self.receiver = _RememberingReceiver(receiver, self)
        self.budget = RestartBudget(cfg)
        self._reviving: dict[int, asyncio.Task] = {}
        self._given_up: set[int] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._watch: asyncio.Task | None = None
        pool.recovery = self.recovering

    def start(self) -> "ServerKeeper":
        self._watch = asyncio.create_task(self._watch_loop(), name="server-keeper")
        return self

    async def close(self) -> None:
        tasks = [t for t in (self._watch, *self._reviving.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def settled(self) -> None:
        """Wait (at most rollout.connect_timeout_s) until no server is being restarted; a server that
        died since the last look counts (a failed request may reveal it before the watch task does)."""
        self._scan()
        try:
            await asyncio.wait_for(self._idle.wait(), self.cfg.rollout.connect_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("a generation server is still restarting after %.0fs; the weight update goes on "
                           "without it", self.cfg.rollout.connect_timeout_s)

    async def recovering(self) -> bool:
        """Whether a server is being restarted (it rejoins caught up to the pool's version). A server
        whose connection just broke counts once its exit shows, which may take a moment after."""
        deadline = time.monotonic() + 2 * POLL_S
        while True:
            self._scan()
            if self._reviving:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    async def _watch_loop(self) -> None:
        while True:
            self._scan()
            await asyncio.sleep(POLL_S)

    def _scan(self) -> None:
        """Start reviving every server whose process is gone (and is not being revived already)."""
        for i, proc in enumerate(self.procs):
            if i not in self._reviving and i not in self._given_up and not proc.is_alive():
                self._idle.clear()
                self._reviving[i] = asyncio.create_task(self._revive(i), name=f"revive-server{i}")
                self._reviving[i].add_done_callback(lambda _t, i=i: self._revived(i))

    def _revived(self, index: int) -> None:
        self._reviving.pop(index, None)
        if not self._reviving:
            self._idle.set()

    async def _revive(self, index: int) -> None:
        server, name = self.pool.servers[index], f"server{index}"
        cause = child_cause(self.cfg, server_name(index), self.procs[index])
        self.pool.mark_unhealthy(server, f"its process died ({cause})")
        self.pool.fence(server, "restarting after its process died")
        while True:
            if not self.budget.allow(name):
                self._given_up.add(index)
                logger.error("generation server %s stays out of rotation: %s", server.address,
                             self.budget.spent(name, cause))
                return
            await asyncio.sleep(self.budget.record(name, cause))
            port = urlsplit(self.urls[index]).port or 0
            try:
                proc, url = await asyncio.to_thread(self.relaunch, index, port)
            except Exception as exc:  # e.g. the port was taken meanwhile: another try, if the budget allows
                cause = f"restart failed: {one_line(exc)}"
                continue
            self.procs[index] = proc
            write_server_listing(self.cfg.run_dir, self.procs, self.urls)
            if url.rstrip("/") != self.urls[index].rstrip("/"):
                logger.error("generation server %d restarted at %s, not at %s: it stays out of rotation",
                             index, url, self.urls[index])
                self._given_up.add(index)
                return
            await self._catch_up(server)
            return

    async def _catch_up(self, server: Server) -> None:
        """Load the current weights into a restarted server, then let it rejoin the rotation."""
        await self.pool.mark_healthy(server)  # it answers; still fenced
        version = self.pool.version
        msg = self.receiver.recent.get(version)
        if version > 0:
            if msg is None or self.cfg.weight_sync.transport not in REPLAYABLE:
                logger.warning("generation server %s restarted; it stays fenced until the next weight update "
                               "(weight_sync.transport=%s)", server.address, self.cfg.weight_sync.transport)
                return
            inner = self.receiver.inner
            try:
                prepared = await inner.prepare(msg)
                try:
                    await asyncio.wait_for(inner.load(server.client, prepared, version),
                                           self.cfg.weight_sync.deadline_s)
                finally:
                    await inner.release(prepared)
            except Exception as exc:  # it stays fenced; the next weight update loads it
                logger.warning("generation server %s restarted but did not load weights v%d (%s); it stays "
                               "fenced until the next weight update", server.address, version, one_line(exc))
                return
        await self.pool.rejoin(server, version)
        logger.warning("generation server %s restarted and back in rotation at weight version %d",
                       server.address, version)
