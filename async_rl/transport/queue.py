"""The trajectory queue: ZeroMQ ROUTER (trainer) <-> DEALER (rollout), msgpack frames.

Flow control is credit based and exact. The trainer buffers at most `capacity`
trajectories, counting those it has allowed producers to send but not yet received;
it returns a credit only when the training loop consumes a trajectory, acknowledging
its id in the same message. A slow trainer therefore blocks producers (backpressure)
and nothing is ever dropped. Producers keep sent-but-unacknowledged trajectories until
they are acknowledged; the trainer drops (and counts) a trajectory id it has already
received, so a re-send after a reconnect is never trained twice.

Frames are `[kind, payload]` (plus the ROUTER identity on the trainer side). Rollout ->
trainer: HELLO, GROUP, HB, BYE. Trainer -> rollout: WELCOME, CREDIT, CONTROL, HB.
The trainer's socket lives in one background thread; the training loop talks to it
through thread-safe methods.
"""

from __future__ import annotations

import asyncio
import logging
import queue as thread_queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from async_rl.transport.codec import decode, encode
from async_rl.types import Trajectory, WireFormatError, new_id

logger = logging.getLogger(__name__)

HELLO, GROUP, HB, BYE = b"HELLO", b"GROUP", b"HB", b"BYE"
WELCOME, CREDIT, CONTROL = b"WELCOME", b"CREDIT", b"CONTROL"


class QueueTimeout(TimeoutError):
    """No full batch arrived in time."""


class PeerUnreachableError(ConnectionError):
    """Nothing answered at the address."""


class PeerTimeoutError(ConnectionError):
    """The peer stopped answering."""


def _bind_addr(addr: str) -> str:
    return addr[:-2] + ":*" if addr.startswith("tcp://") and addr.endswith(":0") else addr


@dataclass
class _Producer:
    identity: bytes
    name: str
    credits: int = 0  # granted, not yet used
    last_seen: float = field(default_factory=time.monotonic)


class TrajectoryQueueServer:
    """Trainer side: receives groups, hands them to the training loop, returns credits."""

    def __init__(self, addr: str, capacity: int, *, heartbeat_s: float = 2.0, peer_timeout_s: float = 60.0):
        if capacity <= 0:
            raise ValueError(f"transport.capacity: must be > 0, got {capacity}")
        self.capacity = capacity
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(_bind_addr(addr))
        except zmq.ZMQError as exc:
            self._sock.close()
            raise PeerUnreachableError(f"cannot bind the trajectory queue at {addr}: {exc}") from None
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._producers: dict[bytes, _Producer] = {}
        self._buffer: deque[list[Trajectory]] = deque()
        self._buffered = 0
        self._cond = threading.Condition()
        self._outbox: thread_queue.Queue = thread_queue.Queue()
        self._seen: set[str] = set()
        self._owner: dict[str, bytes] = {}  # trajectory id -> producer identity, until acknowledged
        self._counts = {"queue/received": 0, "queue/duplicates": 0, "queue/malformed": 0, "queue/overrun": 0,
                        "queue/lost_producers": 0}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trajectory-queue", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training-loop side
    def get_groups(self, num_trajectories: int, timeout: float | None = None) -> list[list[Trajectory]]:
        """Whole groups, in arrival order, totalling >= num_trajectories; acknowledges them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._buffered < num_trajectories:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise QueueTimeout(f"{self._buffered}/{num_trajectories} trajectories after {timeout}s")
                self._cond.wait(left)
            groups, taken = [], 0
            while taken < num_trajectories:
                group = self._buffer.popleft()
                groups.append(group)
                taken += len(group)
            self._buffered -= taken
        self._outbox.put(("ack", [t for g in groups for t in g]))
        return groups

    def broadcast(self, control: dict[str, Any]) -> None:
        """Send a CONTROL map to every connected producer (in order with other messages)."""
        self._outbox.put(("control", encode(control)))

    def stats(self) -> dict[str, float]:
        with self._cond:
            return {"queue/depth": self._buffered, "queue/producers": len(self._producers), **self._counts}

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        self._sock.close(0)

    # ------------------------------------------------------------------ socket thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        last_hb = 0.0
        while not self._closed.is_set():
            if poller.poll(20):
                while self._sock.poll(0):
                    self._receive(self._sock.recv_multipart(copy=False))
            self._drain_outbox()
            now = time.monotonic()
            if now - last_hb >= self.heartbeat_s:
                last_hb = now
                self._heartbeat(now)

    def _receive(self, frames: list) -> None:
        if len(frames) != 3:
            self._counts["queue/malformed"] += 1
            logger.warning("malformed message: %d frames", len(frames))
            return
        identity, kind, payload = frames[0].bytes, frames[1].bytes, frames[2].buffer
        try:
            body = decode(payload)
            self._handle(identity, kind, body)
        except (WireFormatError, KeyError, TypeError, ValueError) as exc:
            self._counts["queue/malformed"] += 1
            logger.warning("malformed %s message from %r: %s", kind[:16], identity[:16], exc)

    def _handle(self, identity: bytes, kind: bytes, body: Any) -> None:
        producer = self._producers.get(identity)
        if producer is not None:
            producer.last_seen = time.monotonic()
        if kind == HELLO:
            if producer is None:
                producer = self._producers[identity] = _Producer(identity, str(body["producer_id"]))
                logger.info("producer %s connected", producer.name)
            producer.credits += self._free_credits()
            self._send(identity, WELCOME, {"credits": producer.credits, "capacity": self.capacity})
        elif kind == GROUP:
            self._accept_group(identity, producer, body)
        elif kind == BYE:
            if self._producers.pop(identity, None) is not None:
                logger.info("producer %s said goodbye", producer.name)
        elif kind != HB:
            raise ValueError(f"unknown message kind {kind[:16]!r}")

    def _accept_group(self, identity: bytes, producer: _Producer | None, body: Any) -> None:
        trajs = [Trajectory.from_wire(d) for d in body["trajectories"]]
        fresh = [t for t in trajs if t.id not in self._seen]
        self._counts["queue/duplicates"] += len(trajs) - len(fresh)
        if producer is not None:
            if len(trajs) > producer.credits:
                self._counts["queue/overrun"] += len(trajs) - producer.credits
            producer.credits = max(0, producer.credits - len(trajs))
        fresh_ids = {t.id for t in fresh}
        dups = [t.id for t in trajs if t.id not in fresh_ids]
        if dups and producer is not None:  # duplicates take no room: give their credit straight back
            producer.credits += len(dups)
            self._send(identity, CREDIT, {"credits": len(dups), "acks": dups})
        if not fresh:
            return
        self._seen.update(fresh_ids)
        self._owner.update((tid, identity) for tid in fresh_ids)
        with self._cond:
            self._buffer.append(fresh)
            self._buffered += len(fresh)
            self._counts["queue/received"] += len(fresh)
            self._cond.notify_all()

    def _free_credits(self) -> int:
        with self._cond:
            used = self._buffered + sum(p.credits for p in self._producers.values())
        return max(0, self.capacity - used)

    def _drain_outbox(self) -> None:
        while True:
            try:
                what, item = self._outbox.get_nowait()
            except thread_queue.Empty:
                return
            if what == "control":
                for identity in list(self._producers):
                    self._sock.send_multipart([identity, CONTROL, item], copy=False)
            elif what == "ack":
                by_producer: dict[bytes, list[str]] = {}
                for t in item:
                    by_producer.setdefault(self._owner.pop(t.id), []).append(t.id)
                for identity, ids in by_producer.items():
                    producer = self._producers.get(identity)
                    if producer is not None:
                        producer.credits += len(ids)
                        self._send(identity, CREDIT, {"credits": len(ids), "acks": ids})

    def _heartbeat(self, now: float) -> None:
        for identity, producer in list(self._producers.items()):
            if now - producer.last_seen > self.peer_timeout_s:
                logger.warning("producer %s silent for %.0fs: dropped", producer.name, now - producer.last_seen)
                del self._producers[identity]
                self._counts["queue/lost_producers"] += 1
            else:
                self._send(identity, HB, {})

    def _send(self, identity: bytes, kind: bytes, body: dict) -> None:
        self._sock.send_multipart([identity, kind, encode(body)])


class TrajectoryQueueClient:
    """Rollout side (asyncio): sends whole groups when credits allow, receives control messages."""

    def __init__(self, addr: str, *, producer_id: str | None = None, heartbeat_s: float = 2.0,
                 peer_timeout_s: float = 60.0):
        self.addr = addr
        self.producer_id = producer_id or new_id()[:12]
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IDENTITY, self.producer_id.encode())
        self.credits = 0
        self.unacked: dict[str, Trajectory] = {}
        self._credit_event = asyncio.Event()
        self._controls: asyncio.Queue = asyncio.Queue()
        self._last_seen = time.monotonic()
        self._tasks: list[asyncio.Task] = []
        self._seq = 0

    async def connect(self, timeout_s: float) -> None:
        self._sock.connect(self.addr)
        await self._sock.send_multipart([HELLO, encode({"producer_id": self.producer_id})])
        if not await self._sock.poll(int(timeout_s * 1000)):
            raise PeerUnreachableError(f"no trainer answered at {self.addr} within {timeout_s:.0f}s "
                                       "(is `async-rl train` running with this transport.addr?)")
        kind, payload = await self._sock.recv_multipart()
        if kind != WELCOME:
            raise PeerUnreachableError(f"unexpected first reply {kind[:16]!r} from {self.addr}")
        self.credits = int(decode(payload)["credits"])
        self._last_seen = time.monotonic()
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._hb_loop())]

    async def put_group(self, trajectories: list[Trajectory]) -> None:
        n = len(trajectories)
        while self.credits < n:
            self._credit_event.clear()
            try:
                await asyncio.wait_for(self._credit_event.wait(), self.heartbeat_s)
            except asyncio.TimeoutError:
                self._check_alive()
        self.credits -= n
        self._seq += 1
        for t in trajectories:
            self.unacked[t.id] = t
        body = {"seq": self._seq, "trajectories": [t.to_wire() for t in trajectories]}
        await self._sock.send_multipart([GROUP, encode(body)], copy=False)

    async def controls(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            item = await self._controls.get()
            if item is None:
                return
            yield item

    def _check_alive(self) -> None:
        silent = time.monotonic() - self._last_seen
        if silent > self.peer_timeout_s:
            raise PeerTimeoutError(f"trainer at {self.addr} silent for {silent:.0f}s")

    async def _recv_loop(self) -> None:
        try:
            while True:
                kind, payload = await self._sock.recv_multipart()
                self._last_seen = time.monotonic()
                body = decode(payload)
                if kind == CREDIT:
                    self.credits += int(body["credits"])
                    for tid in body.get("acks", []):
                        self.unacked.pop(tid, None)
                    self._credit_event.set()
                elif kind == CONTROL:
                    await self._controls.put(body)
        except (WireFormatError, KeyError, ValueError) as exc:
            logger.error("malformed message from the trainer: %s", exc)
            await self._controls.put(None)

    async def _hb_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self._sock.send_multipart([HB, encode({})])
            if time.monotonic() - self._last_seen > self.peer_timeout_s:
                logger.error("trainer at %s silent for over %.0fs", self.addr, self.peer_timeout_s)
                await self._controls.put(None)
                return

    def stats(self) -> dict[str, float]:
        return {"queue/credits": self.credits, "queue/unacked": len(self.unacked)}

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._sock.send_multipart([BYE, encode({})]), 1.0)
        except Exception:
            pass
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close(0)
