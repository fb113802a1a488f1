"""The rollout side of the trajectory queue (asyncio ZeroMQ DEALER); see `queue.py` for the protocol.

    client = TrajectoryQueueClient("tcp://trainer:5555")
    await client.connect(timeout_s=30)
    await client.put_group(trajectories)      # waits for credits: backpressure from the trainer
    async for control in client.controls():   # {"kind": "weights", ...}, {"kind": "stop", ...}
        ...

BULK messages (weight buckets) go to the handler registered for their kind with `on_control`,
run one at a time in a worker thread (so a bucket's checksum and write do not stall the event
loop), with their data frames as `body["parts"]` (buffers valid during the call); the client
drops the frames and then answers BULK_ACK, which is what lets the trainer send more.

With `curve_keys_dir` (see `auth.py`) the socket is a CURVE client of the trainer; a trainer
that refuses it at the handshake makes `connect` raise `HandshakeRefusedError` at once, saying why.
Its identity, to the trainer, is then its public key, not the name it says (`identity`); its zmq
routing id is that key too, so a peer that says the same name is another producer, never this one.

A trainer of another protocol version answers HELLO with REFUSED: `connect` raises
`ProtocolMismatchError` naming both versions. A group whose frame is larger than the trainer takes
(`WELCOME.max_frame`) is refused here (`GroupRefused`), before it is kept or sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from async_rl.transport.auth import HANDSHAKE_FAILED, client_curve_options, client_handshake_error
from async_rl.transport.messages import (
    BULK, MAX_ID_CHARS, PROTOCOL_VERSION, TO_ROLLOUT, Bulk, BulkAck, Bye, Control, Credit, Group, Heartbeat, Hello,
    Message, Refused, TrainerHeartbeat, Welcome, pack, protocol_mismatch, unpack)
from async_rl.transport.peers import PeerTimeoutError, PeerUnreachableError, _check_addr, _check_timing
from async_rl.types import GroupRefused, Trajectory, WireFormatError, new_id

logger = logging.getLogger(__name__)


_END = object()  # ends controls()


class ProtocolMismatchError(ConnectionError):
    """The trainer speaks another version of the queue protocol."""


@dataclass
class _Outgoing:
    frames: list[bytes]  # the GROUP message, encoded once by put_group
    size: int
    open_ids: set[str]  # not yet acknowledged by the trainer


class TrajectoryQueueClient:
    """Rollout side (asyncio). One sender task sends groups in order as credits allow; one receiver
    task applies credits and acks and queues CONTROL maps; one task exchanges heartbeats.

    Producer ids must be unique among producers of one trainer (the id is the zmq identity).
    """

    def __init__(self, addr: str, *, producer_id: str | None = None, heartbeat_s: float = 2.0,
                 peer_timeout_s: float = 60.0, curve_keys_dir: str = ""):
        _check_timing(heartbeat_s, peer_timeout_s)
        self.addr = _check_addr(addr)
        self._curve = client_curve_options(curve_keys_dir) if curve_keys_dir else {}  # socket options
        self.producer_id = producer_id or f"{socket.gethostname()}-{os.getpid()}-{new_id()[:6]}"
        if not 0 < len(self.producer_id) <= MAX_ID_CHARS or len(self.producer_id.encode()) > 255 \
                or self.producer_id.startswith("\0"):
            raise ValueError(f"producer_id: must have 1..{MAX_ID_CHARS} characters (255 bytes in UTF-8) and not "
                             f"start with NUL, got {self.producer_id!r}")
        self.heartbeat_s, self.peer_timeout_s = heartbeat_s, peer_timeout_s
        # who the trainer takes this producer to be: its CURVE public key when keys are on, else its name
        self.identity = self._curve[zmq.CURVE_PUBLICKEY].decode() if self._curve else self.producer_id
        self._sock: zmq.asyncio.Socket | None = None
        self.capacity = 0
        self.max_frame = 0  # the largest GROUP frame the trainer takes (WELCOME; 0 = no limit)
        self.trainer_state: dict[str, Any] = {}  # from WELCOME: policy_version, admitted, run_id
        self.on_acked: Callable[[list[str]], None] | None = None  # ids the trainer consumed (the outbox forgets them)
        self.on_session: Callable[[dict[str, Any]], None] | None = None  # a later WELCOME's trainer_state
        self._granted = self._sent = self._want = 0  # this session's credit counts (see messages.py)
        self._registered = False
        self._session = 0  # number of the last HELLO sent
        self._groups: dict[int, _Outgoing] = {}  # seq -> a group with unacknowledged trajectories
        self._group_of: dict[str, int] = {}  # trajectory id -> seq, until acknowledged
        self._to_send: deque[int] = deque()  # seqs to send in this session, in order
        self._waiters: dict[int, asyncio.Future] = {}  # seq -> put_group waiting for its first send
        self._seq = 0
        self._kick = asyncio.Event()
        self._controls: asyncio.Queue = asyncio.Queue()
        self._handlers: dict[str, Callable[[dict[str, Any]], None]] = {}
        self._trainer_finished = False  # the trainer said "stop": the run ended normally
        self._error: BaseException | None = None
        self._closed = False
        self._last_seen = time.monotonic()
        self._tasks: list[asyncio.Task] = []
        self._counts = {"queue/sent": 0, "queue/resent": 0, "queue/sessions": 0, "queue/malformed": 0,
                        "queue/bulk_received": 0, "queue/bulk_held_peak_bytes": 0}
        self._bulk_held = 0  # bytes of BULK frames taken off the socket and not yet released
        self._bulk_pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def unacked(self) -> int:
        """Trajectories handed to put_group that the trainer has not acknowledged yet."""
        return len(self._group_of)

    @property
    def credits(self) -> int:
        return max(0, self._granted - self._sent) if self._registered else 0

    def stats(self) -> dict[str, int]:
        return {"queue/credits": self.credits, "queue/unacked": self.unacked, **self._counts,
                "queue/bulk_held_bytes": self._bulk_held}

    async def connect(self, timeout_s: float = 30.0) -> None:
        """Say HELLO and wait for WELCOME; raises PeerUnreachableError if nobody answers in time,
        HandshakeRefusedError if the trainer refuses the connection (CURVE keys)."""
        if self._sock is not None:
            raise RuntimeError("TrajectoryQueueClient.connect: already connected")
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0), *self._curve.items()):
            sock.setsockopt(opt, value)
        sock.setsockopt(zmq.IDENTITY, self.identity.encode())
        monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)  # a refused handshake fails connect at once
        try:
            sock.connect(self.addr)
        except zmq.ZMQError as exc:
            monitor.close(0)
            sock.close(0)
            raise ValueError(f"transport.addr: cannot connect to {self.addr}: {exc}") from None
        self._sock = sock
        try:
            msg = await self._welcome(monitor, timeout_s)
        except BaseException:
            self._sock = None
            raise
        finally:
            sock.disable_monitor()
            monitor.close(0)
            if self._sock is None:
                sock.close(0)
        self._on_welcome(msg)
        self._tasks = [asyncio.create_task(coro) for coro in (self._sender(), self._receiver(), self._heartbeats())]

    async def _welcome(self, monitor: zmq.asyncio.Socket, timeout_s: float) -> Welcome:
        # HELLO goes out beside the wait: after a refused handshake the socket has no peer, and a send waits forever
        hello = asyncio.ensure_future(self._hello())
        hello.add_done_callback(lambda f: f.cancelled() or f.exception())
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                events = dict(await poller.poll(max(1, int(left * 1000)))) if left > 0 else {}
                if monitor in events:
                    raise client_handshake_error(await monitor.recv_multipart(), self.addr)
                if self._sock not in events:
                    raise PeerUnreachableError(f"no trainer answered at {self.addr} within {timeout_s:g}s "
                                               "(is the trainer running and bound to this address?)")
                msg = self._parse(await self._sock.recv_multipart(copy=False))
                if isinstance(msg, Refused):
                    raise self._refused(msg)
                if isinstance(msg, Welcome) and msg.session == self._session:
                    if msg.protocol != PROTOCOL_VERSION:
                        raise self._refused(Refused(reason="", protocol=msg.protocol))
                    return msg
        finally:
            hello.cancel()  # nothing if it was sent

    def _refused(self, msg: Refused) -> ProtocolMismatchError:
        error = ProtocolMismatchError(f"the trainer at {self.addr} refused this producer: "
                                      f"{protocol_mismatch(PROTOCOL_VERSION, msg.protocol, 'producer')}")
        logger.error("%s", error)
        return error

    def pack_group(self, trajectories: list[Trajectory]) -> list[bytes]:
        """The GROUP frames of `trajectories`, numbered as the next group (hand them to `put_group` with no
        await between); GroupRefused if the trainer would not take a frame that large (WELCOME.max_frame)."""
        frames = pack(Group(seq=self._seq + 1, trajectories=tuple(trajectories)))
        size = len(frames[1])
        if self.max_frame and size > self.max_frame:
            raise GroupRefused(f"its frame is {size} bytes, over the {self.max_frame} bytes the trainer takes (the "
                               "largest group its config can produce, with headroom): a larger one would cut "
                               "the link")
        return frames

    async def put_group(self, trajectories: list[Trajectory], frames: list[bytes] | None = None) -> None:
        """Send one group whole; returns once it is sent, waiting for credits (backpressure) first.
        `frames`: the group's `pack_group`, when the caller made them already.

        Raises PeerTimeoutError if the trainer goes silent meanwhile, TypeError if a trajectory
        holds something the codec cannot send, GroupRefused if its frame is over the trainer's
        limit. If cancelled before the group went out, the group is withdrawn.
        """
        trajs = list(trajectories)
        if not trajs or not all(isinstance(t, Trajectory) for t in trajs):
            raise ValueError("put_group: expected a non-empty list of Trajectory")
        if len({t.id for t in trajs}) != len(trajs) or any(t.id in self._group_of for t in trajs):
            raise ValueError("put_group: trajectory ids repeat (within the group or with an unacknowledged one)")
        if self._sock is None or self._closed:
            raise RuntimeError("put_group: the queue client is not connected (call connect() first)")
        self._raise_if_failed()
        if len(trajs) > self.capacity:
            raise ValueError(f"put_group: a group of {len(trajs)} never fits the trainer's capacity "
                             f"{self.capacity}; raise transport.capacity")
        frames = frames or self.pack_group(trajs)
        self._seq += 1
        seq = self._seq
        self._groups[seq] = _Outgoing(frames, len(trajs), {t.id for t in trajs})
        self._group_of.update((t.id, seq) for t in trajs)
        self._to_send.append(seq)
        waiter = self._waiters[seq] = asyncio.get_running_loop().create_future()
        self._kick.set()
        try:
            await waiter
        except asyncio.CancelledError:
            if self._waiters.pop(seq, None) is not None:  # never sent: withdraw it
                self._forget(seq)
            raise

    def on_control(self, kind: str, handler: Callable[[dict[str, Any]], None]) -> None:
        """Hand CONTROL maps of `kind` to `handler` as they arrive (in the receive task, in order with
        the rest) instead of queueing them for `controls()`; e.g. weight buckets written to disk at once.
        BULK messages of `kind` go to it too, in the worker thread; a str it returns is the rejection
        reason sent back in BULK_ACK."""
        self._handlers[kind] = handler

    def _dispatch(self, body: dict[str, Any]) -> None:
        if body["kind"] == "stop":
            self._trainer_finished = True
        handler = self._handlers.get(body["kind"])
        if handler is None:
            self._controls.put_nowait(body)
            return
        try:
            handler(body)
        except Exception:  # a handler's bug must not stop the receive task (credits, acks, heartbeats)
            logger.exception("control handler for %r failed", body["kind"])

    async def controls(self) -> AsyncIterator[dict[str, Any]]:
        """CONTROL maps from the trainer, in order; ends at close(), raises PeerTimeoutError if it goes silent."""
        while True:
            item = await self._controls.get()
            if item is _END:
                self._controls.put_nowait(_END)
                if self._error is not None:
                    raise self._error
                return
            yield item

    async def close(self) -> None:
        """Say BYE and stop. Unacknowledged trajectories are lost with this object (logged)."""
        if self._closed:
            return
        self._closed = True
        if self.unacked and self._trainer_finished:  # the normal end: what was produced beyond the last step
            logger.info("%d trajectories produced after the trainer's last step were not trained", self.unacked)
        elif self.unacked:
            logger.warning("closing the queue client with %d trajectories not acknowledged by the trainer",
                           self.unacked)
        if self._sock is not None:
            try:
                await self._send(Bye(reason="closed"))
            except zmq.ZMQError:
                pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._bulk_pool is not None:
            self._bulk_pool.shutdown(wait=False)
        self._fail_waiters(RuntimeError("the queue client was closed before this group was sent"))
        if self._sock is not None:
            self._sock.close(linger=1000)  # lets BYE leave
        self._controls.put_nowait(_END)

    # ------------------------------------------------------------------ internals
    async def _send(self, msg: Message) -> None:
        await self._sock.send_multipart(pack(msg), copy=False)

    async def _hello(self) -> None:
        self._session += 1
        await self._send(Hello(producer_id=self.producer_id, session=self._session))

    def _parse(self, frames: list[zmq.Frame]) -> Message | None:
        try:
            bulk = len(frames) >= 2 and frames[0].bytes == BULK
            if len(frames) != 2 and not bulk:
                raise WireFormatError(f"expected frames [kind, payload], got {len(frames)} frames")
            msg = unpack(frames[0].bytes, frames[1].buffer, TO_ROLLOUT)
            if bulk:
                msg = msg.with_parts([f.buffer for f in frames[2:]])
        except WireFormatError as exc:
            self._counts["queue/malformed"] += 1
            logger.warning("malformed message from the trainer at %s dropped: %s", self.addr, exc)
            return None
        self._last_seen = time.monotonic()
        return msg

    def _on_welcome(self, msg: Welcome) -> None:
        self.capacity, self._granted, self._sent, self._want = msg.capacity, msg.granted, 0, 0
        self.max_frame = msg.max_frame
        self._registered = True
        self.trainer_state = {"policy_version": msg.policy_version, "admitted": msg.admitted, "run_id": msg.run_id,
                              "prompts": msg.prompts}
        self._counts["queue/sessions"] += 1
        if self._counts["queue/sessions"] > 1 and self.on_session is not None:
            self.on_session(self.trainer_state)
        if self._counts["queue/sessions"] > 1 and self._groups:
            logger.info("new session with the trainer: re-sending %d unacknowledged groups", len(self._groups))
        self._counts["queue/resent"] += sum(g.size for s, g in self._groups.items() if s not in self._waiters)
        self._to_send = deque(self._groups)  # everything unacknowledged goes (again), oldest first
        self._kick.set()

    def _forget(self, seq: int) -> None:
        group = self._groups.pop(seq, None)
        for tid in group.open_ids if group else ():
            self._group_of.pop(tid, None)
        if seq in self._to_send:
            self._to_send.remove(seq)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail_waiters(self, exc: BaseException) -> None:
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(exc)
        self._waiters.clear()

    async def _sender(self) -> None:
        try:
            while self._error is None:
                self._kick.clear()
                await self._send_next()
                await self._kick.wait()
        except Exception as exc:  # e.g. the socket failed: fail the callers instead of leaving them waiting
            logger.exception("the queue client's sender failed")
            self._error = exc
            self._controls.put_nowait(_END)
        self._fail_waiters(self._error)

    async def _send_next(self) -> None:
        """Send queued groups, oldest first, while credits last; otherwise state the demand."""
        while self._to_send and self._registered:
            seq = self._to_send[0]
            group = self._groups.get(seq)
            if group is None:  # fully acknowledged or withdrawn meanwhile
                self._to_send.popleft()
                continue
            if self._granted - self._sent < group.size:
                if self._want != self._sent + group.size:
                    self._want = self._sent + group.size
                    await self._send(Heartbeat(want=self._want, unacked=self.unacked))
                return
            await self._sock.send_multipart(group.frames, copy=False)
            self._sent += group.size
            self._counts["queue/sent"] += group.size
            self._want = 0
            self._to_send.popleft()
            waiter = self._waiters.pop(seq, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def _receiver(self) -> None:
        while True:
            msg = self._parse(await self._sock.recv_multipart(copy=False))
            if isinstance(msg, Credit):
                self._granted = msg.granted
                if self.on_acked is not None and msg.acks:
                    self.on_acked(list(msg.acks))
                for tid in msg.acks:
                    seq = self._group_of.pop(tid, None)
                    if seq is not None:
                        self._groups[seq].open_ids.discard(tid)
                        if not self._groups[seq].open_ids:
                            del self._groups[seq]
            elif isinstance(msg, Control):
                self._dispatch(msg.body)
            elif isinstance(msg, TrainerHeartbeat):
                if msg.registered:
                    self._granted = msg.granted
                elif self._registered:
                    logger.warning("the trainer at %s does not know this producer (it restarted or timed us "
                                   "out): saying HELLO again", self.addr)
                    self._registered = False
                    await self._hello()
            elif isinstance(msg, (Refused, Welcome)) and (isinstance(msg, Refused) or msg.protocol != PROTOCOL_VERSION):
                self._error = self._refused(msg if isinstance(msg, Refused) else Refused(reason="", protocol=msg.protocol))
                self._kick.set()
                self._controls.put_nowait(_END)
                return
            elif isinstance(msg, Welcome) and msg.session == self._session:
                self._on_welcome(msg)
            elif isinstance(msg, Bulk):
                seq, msg = msg.seq, await self._handle_bulk(msg)  # drops the frames before the ack goes
                await self._send(BulkAck(seq=seq, error=msg))
            self._kick.set()

    async def _handle_bulk(self, msg: Bulk) -> str:
        """Run the BULK's handler in the worker thread; return the rejection reason ("" if accepted)."""
        nbytes = sum(msg.part_bytes)
        self._bulk_held += nbytes
        self._counts["queue/bulk_received"] += 1
        self._counts["queue/bulk_held_peak_bytes"] = max(self._counts["queue/bulk_held_peak_bytes"], self._bulk_held)
        if self._bulk_pool is None:
            self._bulk_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="queue-bulk")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._bulk_pool, self._run_bulk, msg)
        finally:
            self._bulk_held -= nbytes

    def _run_bulk(self, msg: Bulk) -> str:
        kind = msg.body["kind"]
        handler = self._handlers.get(kind)
        if handler is None:
            logger.warning("bulk message of kind %r dropped: no handler on this producer", kind)
            return f"no handler for {kind!r} on producer {self.producer_id}"
        try:
            result = handler({**msg.body, "parts": list(msg.parts)})
        except Exception as exc:  # a handler's bug must not stop the receive task
            logger.exception("bulk handler for %r failed", kind)
            return f"{type(exc).__name__}: {exc}"
        return result if isinstance(result, str) else ""

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            silent = time.monotonic() - self._last_seen
            if silent > self.peer_timeout_s:
                self._error = PeerTimeoutError(
                    f"the trainer at {self.addr} has been silent for {silent:.0f}s "
                    f"(peer_timeout_s={self.peer_timeout_s:g}); is it still running?")
                logger.error("%s", self._error)
                self._kick.set()
                self._controls.put_nowait(_END)
                return
            if self._registered:
                await self._send(Heartbeat(want=self._want, unacked=self.unacked))
            else:  # HELLO again in case the last one was lost
                await self._hello()
