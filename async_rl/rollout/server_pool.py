"""The rollout side's generation servers: least-loaded placement, health checks, rotation and fencing.

    pool = ServerPool(clients, health_interval_s=5.0)
    await pool.check_model(model_name="tiny", min_vocab=len(tokenizer))  # wrong server -> one clear error
    pool.start()                                   # periodic health checks
    server = await pool.acquire(timeout_s=60)      # the least-loaded server in rotation
    ...; pool.release(server)
    session = Session()                            # one episode's turns (see PooledGenerationClient)
    server = await pool.acquire(session=session, overload_margin=8)  # its server while that stays fit
    pool.fence(server, "missed the deadline of weight update v3")
    pool.rejoin(server, version=3)                 # back once it has loaded the current version
    pool.stats()                                   # pool/* metrics, per server too
    await pool.close()

A server is *in rotation* while it is healthy and not fenced. It leaves rotation when a
health check fails (except while this side holds it paused: SGLang's /health gets no
answer then, and the weight update that paused it has its own deadline), when a request to
it fails for want of a connection, or when it is fenced (it missed a weight update's
deadline, or the update failed on it). Leaving sets the server's `gone` event: generations
running on it (see `failover.py`) stop waiting for it and continue on another server. An
unhealthy server that answers again rejoins by itself if it still holds the current
weights; a fenced one rejoins only once it has loaded the current version (at the next
weight update, or when a late load turns out to have finished: the health check asks it
for its `weight_version`).

Placement. A request without a session goes to the server in rotation with the fewest
requests in flight; among equals, to the one holding the fewest sessions, and among those
round-robin, so a burst of new episodes spreads evenly. A *session* (one multi-turn episode)
is bound to the server its first request went to, and every later request of it goes there,
where the engine's prefix cache still holds the conversation so far. It moves only when its
own server is unfit: out of rotation, or overloaded (more than `overload_margin` requests in
flight beyond the least-loaded server in rotation; no margin given = never for load). Then its next
request is placed like a new one and sent whole, so the new server rebuilds the prefix.
Nothing else ever moves a session: a server that rejoins or idles does not pull sessions
back, and sessions on fit servers stay put. Moves are counted (`rollout/session_moves`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from async_rl.protocols import GenerationClient
from async_rl.weight_sync.versions import version_of

logger = logging.getLogger(__name__)


class NoServerError(RuntimeError):
    """No generation server has been in rotation for too long."""


@dataclass(eq=False)
class Server:
    """One generation server as the pool sees it."""

    index: int
    client: GenerationClient
    in_flight: int = 0  # requests running on it now
    sessions: int = 0  # sticky sessions bound to it now
    requests: int = 0  # requests placed on it so far
    failures: int = 0  # times it left rotation
    healthy: bool = True
    fenced: bool = False
    reason: str = ""  # why it is out of rotation
    version: int = 0  # weight version it holds (as far as this side knows)
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set while out of rotation

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def in_rotation(self) -> bool:
        return self.healthy and not self.fenced

    def describe(self) -> str:
        return f"{self.address}: {'in rotation' if self.in_rotation else self.reason}"


@dataclass(eq=False)
class Session:
    """One sticky session (a multi-turn episode): the server that holds its prefix, once placed."""

    server: Server | None = None


class ServerPool:
    """Generation servers of one rollout side, balanced by requests in flight."""

    def __init__(self, clients: list[GenerationClient], *, health_interval_s: float = 5.0,
                 health_timeout_s: float = 5.0):
        if not clients:
            raise ValueError("rollout.server_addrs: at least one generation server is needed")
        self.servers = [Server(i, c) for i, c in enumerate(clients)]
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.version = 0  # the newest weight version loaded anywhere
        self.counts = {"pool/reissued": 0, "pool/reissued_tokens": 0, "pool/fenced_total": 0,
                       "pool/unhealthy_total": 0, "pool/rejoined_total": 0, "rollout/session_moves": 0,
                       "rollout/session_moves_gone": 0, "rollout/session_moves_overload": 0}
        self._cursor = -1  # index of the last server a request was placed on (round-robin among equals)
        self._changed: asyncio.Condition | None = None
        self._health: asyncio.Task | None = None
        # whoever restarts dead servers (async_rl/launch/server_keeper.py): `await recovery()` says whether one is
        # coming back, caught up to `version`; a weight update that no server loaded is fatal only if not
        self.recovery: Callable[[], Awaitable[bool]] | None = None

    @property
    def clients(self) -> list[GenerationClient]:
        return [s.client for s in self.servers]

    @property
    def in_flight(self) -> list[int]:
        return [s.in_flight for s in self.servers]

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:  # made lazily, inside the event loop that uses it
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        async with self._cond():
            self._cond().notify_all()

    # ------------------------------------------------------------------ placement
    def _least_loaded(self) -> Server | None:
        live = [s for s in self.servers if s.in_rotation]
        if not live:
            return None
        n = len(self.servers)
        best = min(live, key=lambda s: (s.in_flight, s.sessions, (s.index - self._cursor - 1) % n))
        self._cursor = best.index
        return best

    def _unfit(self, server: Server, overload_margin: int | None) -> str | None:
        """Why a session must leave `server` now (None: it stays)."""
        if not server.in_rotation:
            return "gone"
        if overload_margin is not None:
            least = min(s.in_flight for s in self.servers if s.in_rotation)
            if server.in_flight > least + overload_margin:
                return "overload"
        return None

    def _pick(self, prefer: Server | None, overload_margin: int | None) -> Server | None:
        if prefer is not None and self._unfit(prefer, overload_margin) is None:
            return prefer
        return self._least_loaded()

    async def acquire(self, prefer: Server | None = None, timeout_s: float = 60.0, *,
                      session: Session | None = None, overload_margin: int | None = None) -> Server:
        """A server for one request; waits up to `timeout_s` for one in rotation.

        With a `session`, its server while that is in rotation and (given `overload_margin`) not
        overloaded, else the least-loaded one, which the session is bound to from then on. Without,
        `prefer` if it is in rotation, else the least-loaded server."""
        if session is not None:
            prefer = session.server
        deadline = time.monotonic() + timeout_s
        async with self._cond():
            while (server := self._pick(prefer, overload_margin if session is not None else None)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoServerError(
                        f"no generation server in rotation for {timeout_s:g}s (rollout.connect_timeout_s): "
                        + "; ".join(s.describe() for s in self.servers))
                # asyncio.timeout, not wait_for: wait() runs in this task, so a cancellation
                # reaches it directly and it holds the lock again before `async with` exits
                # (wait_for cancelled twice could leave without it and release someone else's)
                try:
                    async with asyncio.timeout(left):
                        await self._cond().wait()
                except TimeoutError:
                    pass
        if session is not None and server is not session.server:
            self._bind(session, server, overload_margin)
        server.in_flight += 1
        server.requests += 1
        return server

    def _bind(self, session: Session, server: Server, overload_margin: int | None) -> None:
        old = session.server
        if old is not None:
            why = self._unfit(old, overload_margin) or "gone"
            self.counts["rollout/session_moves"] += 1
            self.counts[f"rollout/session_moves_{why}"] += 1
            old.sessions -= 1
            logger.debug("session moves from %s to %s (%s)", old.address, server.address,
                         old.reason if why == "gone" else f"{old.in_flight} requests in flight there")
        session.server = server
        server.sessions += 1

    def end_session(self, session: Session) -> None:
        """The episode is over: its server no longer counts it (safe to call more than once)."""
        if session.server is not None:
            session.server.sessions -= 1
            session.server = None

    def release(self, server: Server) -> None:
        server.in_flight -= 1

    # ------------------------------------------------------------------ rotation
    def _leave(self, server: Server, reason: str) -> None:
        if server.in_rotation:
            server.failures += 1
        server.reason = reason
        server.gone.set()

    def mark_unhealthy(self, server: Server, reason: str) -> None:
        if server.healthy:
            logger.warning("generation server %s out of rotation: %s", server.address, reason)
            self.counts["pool/unhealthy_total"] += 1
        self._leave(server, reason)
        server.healthy = False

    def fence(self, server: Server, reason: str) -> None:
        if not server.fenced:
            logger.warning("generation server %s fenced: %s", server.address, reason)
            self.counts["pool/fenced_total"] += 1
        self._leave(server, reason)
        server.fenced = True

    async def _enter(self, server: Server) -> None:
        if server.in_rotation:
            server.reason = ""
            server.gone.clear()
            await self._notify()

    async def rejoin(self, server: Server, version: int) -> None:
        """`server` holds weight version `version` now: unfence it if that is the current one."""
        server.version = version
        if server.fenced and version >= self.version:
            server.fenced = False
            self.counts["pool/rejoined_total"] += 1
            logger.info("generation server %s rejoins at weight version %d", server.address, version)
        await self._enter(server)

    async def mark_healthy(self, server: Server) -> None:
        if not server.healthy:
            logger.info("generation server %s answers again", server.address)
            server.healthy = True
            if server.version < self.version:
                self.fence(server, f"holds weight version {server.version}, behind the current {self.version}")
        await self._enter(server)

    # ------------------------------------------------------------------ health
    async def _check_one(self, server: Server) -> None:
        paused = _paused_by_us(server)
        try:
            ok = await asyncio.wait_for(server.client.health(), self.health_timeout_s)
        except (asyncio.TimeoutError, OSError) as exc:
            ok, why = False, f"no health answer ({type(exc).__name__})"
        else:
            why = "health check failed"
        if not ok and (paused or _paused_by_us(server)):
            return  # this side paused it for a weight update, which has its own deadline: a probe proves nothing
        if not ok:
            self.mark_unhealthy(server, why)
            return
        await self.mark_healthy(server)
        if server.fenced:
            await self._catch_up(server)

    async def _catch_up(self, server: Server) -> None:
        """A fenced server whose late weight load finished after all rejoins without waiting for the next one."""
        try:
            info = await asyncio.wait_for(server.client.get_model_info(), self.health_timeout_s)
        except Exception as exc:  # best effort: it stays fenced until the next update
            logger.debug("no model info from fenced server %s: %s", server.address, exc)
            return
        held = info.get("weight_version")
        if held is not None and str(held) == str(self.version):
            try:
                await asyncio.wait_for(server.client.continue_generation(), self.health_timeout_s)
            except Exception as exc:
                logger.debug("fenced server %s did not continue: %s", server.address, exc)
                return
            await self.rejoin(server, self.version)

    async def check_health(self) -> None:
        """One round of health checks over every server, concurrently."""
        await asyncio.gather(*(self._check_one(s) for s in self.servers))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # a bug here must not end health checking for the rest of the run
                logger.exception("health check round failed")

    def start(self) -> "ServerPool":
        if self._health is None:
            self._health = asyncio.create_task(self._health_loop(), name="server-health")
        return self

    async def close(self, close_clients: bool = True) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
            self._health = None
        if close_clients:
            await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    # ------------------------------------------------------------------ start-up checks
    async def check_model(self, *, model_name: str, min_vocab: int, key: str = "rollout.server_addrs") -> None:
        """Fail with one line naming the server if one runs another model than `model_name`."""
        seen: dict[str, Any] = {}
        for s in self.servers:
            info = await s.client.get_model_info()
            name = _served_model(info)
            where = f"{key}[{s.index}] ({s.address})"
            if name and not _same_model(name, model_name):
                raise ValueError(f"{where}: serves model {name!r}, but model.name is {model_name!r}; "
                                 "point it at a server running the configured model")
            vocab = info.get("vocab_size")
            if vocab is not None and int(vocab) < min_vocab:
                raise ValueError(f"{where}: its model has a {vocab}-token vocabulary, smaller than the "
                                 f"{min_vocab} tokens of model.name={model_name!r}'s tokenizer: it runs another model")
            if vocab is not None:
                first = seen.setdefault("vocab", (int(vocab), s))
                if first[0] != int(vocab):
                    raise ValueError(f"{where}: its model has a {vocab}-token vocabulary but {first[1].address} "
                                     f"has {first[0]}: the servers run different models")

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {
            "pool/servers": len(self.servers), "pool/in_rotation": sum(s.in_rotation for s in self.servers),
            "pool/fenced": sum(s.fenced for s in self.servers), "pool/unhealthy": sum(not s.healthy for s in self.servers),
            "pool/in_flight": sum(s.in_flight for s in self.servers), **self.counts}
        for s in self.servers:
            p = f"pool/server{s.index}"
            out.update({f"{p}/requests": s.requests, f"{p}/in_flight": s.in_flight, f"{p}/sessions": s.sessions,
                        f"{p}/healthy": int(s.healthy),
                        f"{p}/fenced": int(s.fenced), f"{p}/version": s.version, f"{p}/failures": s.failures})
        return out


def _paused_by_us(server: Server) -> bool:
    """Whether this side holds `server` paused now (its client's pause in effect): SGLang's /health gets no
    answer then (it generates a token), so a failed probe is no sign of a dead server."""
    return getattr(server.client, "paused", None) is not None


def _served_model(info: dict[str, Any]) -> str:
    """The model a server says it runs (/model_info). After an update from disk SGLang reports the weights'
    directory as `model_path` (tokenizer_manager._update_model_path_info); for a weight version's directory
    the model is the one its tokenizer came from (`tokenizer_path`, set at launch)."""
    path = str(info.get("model_path") or info.get("served_model_name") or "")
    return str(info.get("tokenizer_path") or "") if version_of(path) is not None else path


def _same_model(served: str, configured: str) -> bool:
    """Same name, or the same checkpoint directory given by a different path."""
    return served == configured or served.rstrip("/").rsplit("/", 1)[-1] == configured.rstrip("/").rsplit("/", 1)[-1]
