"""The trajectory queue between rollout (producers) and trainer: ZeroMQ DEALER -> ROUTER.

Flow control is credit based and exact. The trainer holds at most `capacity`
trajectories counting everything it has promised room for: buffered, handed to the
training loop but not yet acknowledged, and credits granted to producers but not yet
used. A producer asks for what it needs to send its next group (its `want`); the
trainer grants credits, first come first served and all at once for a group, only from
free room; room frees only when the training loop consumes a trajectory. A slow trainer
therefore blocks `put_group` (backpressure) and nothing is dropped.

Delivery is at least once on the wire and exactly once into training: a producer keeps
every trajectory until the trainer acknowledges it (CREDIT.acks) and re-sends what is
unacknowledged when it starts a new session (the trainer restarted, or timed it out);
the trainer drops ids it has already received and counts them (`queue/duplicates`).
Consuming a trajectory (`ack(ids, commit=False)`) frees its room at once, but producers are
told only when the trainer `commit`s it, i.e. once a checkpoint holds the training it went
into: a trainer that crashes before that gets it sent again, not lost. A re-sent id the
trainer consumed but has not committed is dropped and acknowledged at the next commit.

Bound where other machines reach it (not loopback, ipc or inproc), the queue refuses to start without
`curve_keys_dir` unless `insecure` (async_rl/utils/exposure.py). With `curve_keys_dir` the connection is encrypted and only producers with an authorised
client key get past the handshake (`auth.py`); refused handshakes count in `queue/auth_refused`.
A producer's identity is then its public key (every message is checked to come from the key its
routing id names), not the name it says in HELLO.

What a producer cannot make the trainer train: a group beyond its credits, a group that does not
parse (a non-finite reward included), a frame over `max_frame` bytes (ZeroMQ's MAXMSGSIZE cuts
the connection; each cut without a goodbye is logged). A refused group is `journal`led with its
reason (the trainer's ledger: the audit counts it lost unless its prompt is trained through
another group); a malformed one is acknowledged (sending it again cannot help) and its room given
back to its producer's staleness count. Every group taken in is journalled `received` under its
producer's identity, so the audit can tell what was delivered, by whom.

A trainer that resumes builds its queue with `greet=False`: HELLOs wait, unanswered, until
`open()` (after the checkpoint is loaded and `set_trainer_state` holds what it restored), so no
producer joins an empty state.

Example (trainer side; the rollout side runs `TrajectoryQueueClient` from `client.py`):

    server = TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=64)
    print(server.address)                     # tcp://127.0.0.1:<port>, give it to producers
    groups = server.get_groups(32, timeout=60) # whole groups, >= 32 trajectories, acknowledged
    server.broadcast({"kind": "weights", "version": 1, "path": "/w/v1.safetensors"})
    ticket = server.broadcast({"kind": "weights_bucket", ...}, 60, parts=[array], window_bytes=128 << 20)
    ticket.wait(60)                           # every producer has handled it (see bulk.py)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from async_rl.transport.auth import CurveServer
from async_rl.transport.batching import take_groups
from async_rl.transport.bulk import BulkLedger, BulkTicket
from async_rl.transport.codec import encode
from async_rl.transport.intake import Intake
from async_rl.transport.messages import CONTROL, Bulk, Control, Credit, Hello, Message, TrainerHeartbeat, pack
from async_rl.transport.monitor import QueueMonitor
from async_rl.transport.peers import (  # noqa: F401  (errors re-exported: callers import them from here)
    PeerTimeoutError, PeerUnreachableError, QueueTimeout, _check_addr, _check_timing, _Producer, _RecentIds,
    grant_credits, heard_within)
from async_rl.types import Trajectory
from async_rl.utils.exposure import check_queue
from async_rl.utils.prompts import PromptSet, prompt_of

logger = logging.getLogger(__name__)


class TrajectoryQueueServer(Intake):
    """Trainer side. One background thread owns the ROUTER socket; every public method is thread-safe.

    `get_groups` acknowledges what it returns unless called with `ack=False`; then the caller
    acknowledges with `ack(ids)` (e.g. after the train step), and until then those trajectories
    keep their room in `capacity`. For progress, `capacity` must be at least the largest
    `num_trajectories` asked for plus one group less one trajectory (with equal groups and a
    batch that is a multiple of the group size, capacity >= batch is enough).
    """

    def __init__(self, addr: str, capacity: int, *, heartbeat_s: float = 2.0, peer_timeout_s: float = 60.0,
                 dedup_window: int = 1_000_000, curve_keys_dir: str = "", max_frame: int = 0, greet: bool = True,
                 insecure: bool = False):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"transport.capacity: must be an integer >= 1, got {capacity!r}")
        _check_timing(heartbeat_s, peer_timeout_s)
        check_queue(_check_addr(addr), curve_keys_dir, insecure)  # closed by default: keys where others reach it
        self.capacity, self.heartbeat_s, self.peer_timeout_s = capacity, heartbeat_s, peer_timeout_s
        self._auth = CurveServer(curve_keys_dir) if curve_keys_dir else None  # CURVE + ZAP, its own context
        self._sock = self._auth.socket(zmq.ROUTER) if self._auth else zmq.Context.instance().socket(zmq.ROUTER)
        # MAXMSGSIZE bounds every frame a peer can make this process take in (ZeroMQ cuts its link instead)
        for opt, value in ((zmq.LINGER, 0), (zmq.ROUTER_MANDATORY, 1), (zmq.ROUTER_HANDOVER, 1),
                           (zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.MAXMSGSIZE, max_frame or -1)):
            self._sock.setsockopt(opt, value)
        self.max_frame = max_frame
        self._monitor = QueueMonitor(self._sock, self._auth, max_frame)
        bind = _check_addr(addr)
        if bind.startswith("tcp://") and bind.endswith(":0"):
            bind = bind[:-2] + ":*"
        try:
            self._sock.bind(bind)
        except zmq.ZMQError as exc:
            self._monitor.close()
            self._sock.close(0)
            if self._auth:
                self._auth.close()
            raise OSError(f"transport.addr: cannot bind the trajectory queue at {addr}: {exc}") from None
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # shared with the training loop, under _cond
        self._cond = threading.Condition()
        self._buffer: deque[list[Trajectory]] = deque()
        self._buffered = 0
        self._handed: dict[str, int | None] = {}  # given out by get_groups(ack=False), not yet consumed -> prompt
        self._counts = dict.fromkeys(("queue/received", "queue/groups", "queue/consumed", "queue/producers",
                                      "queue/credits_out", "queue/duplicates", "queue/malformed", "queue/overrun",
                                      "queue/unknown_peer", "queue/lost_producers", "queue/send_failed",
                                      "queue/sessions", "queue/refused", "queue/wrong_key"), 0)
        self._trainer_state = (0, 0)  # (policy_version, trained batch slots): told to every producer that joins
        self._consumed_prompts = PromptSet()  # stream positions the trainer consumed (told to producers that join)
        self.run_id = ""  # the run this trainer belongs to (told to producers: their outboxes are per run)
        self._counts["queue/auth_refused"] = 0  # handshakes refused by CURVE/ZAP (auth.py)
        self._error: BaseException | None = None
        # owned by the socket thread
        self._producers: dict[bytes, _Producer] = {}
        self._owner: dict[str, bytes] = {}  # trajectory id -> producer identity, until acknowledged
        self._seen = _RecentIds(dedup_window)
        self._committed = _RecentIds(dedup_window)  # ids whose consumption a checkpoint holds
        self._sessions: set[tuple[str, str]] = set()  # (name, identity) of every producer greeted (journalled once)
        self._greet = greet  # HELLOs answered; until open(), they wait in _waiting
        self._waiting: dict[bytes, Hello] = {}
        self._protocol_logged: set[bytes] = set()
        self._quiet_until = 0.0  # no malformed-message warning before this time (monotonic)
        self.journal: Callable[..., None] | None = None  # journal(event, ids, **extra): the trainer's ledger
        self._outbox: deque[tuple[str, Any]] = deque()
        self._bulk = BulkLedger()  # bytes of BULK messages each producer has not acknowledged yet
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trajectory-queue", daemon=True)
        self._thread.start()
        logger.info("trajectory queue bound at %s (capacity %d)", self.address, capacity)

    # ------------------------------------------------------------------ training-loop side
    def get_groups(self, num_trajectories: int, timeout: float | None = None, *,
                   ack: bool = True) -> list[list[Trajectory]]:
        """Whole groups totalling >= num_trajectories, the oldest first (`take_groups`); raises QueueTimeout."""
        if not 1 <= num_trajectories <= self.capacity:
            raise ValueError(f"get_groups: num_trajectories must be in [1, capacity={self.capacity}], "
                             f"got {num_trajectories}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._buffered < num_trajectories:
                self._raise_if_stopped()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise QueueTimeout(f"trajectory queue at {self.address}: {self._buffered}/{num_trajectories} "
                                       f"trajectories buffered after {timeout:g}s")
                self._cond.wait(left)
            groups = take_groups(self._buffer, num_trajectories)
            taken = sum(len(g) for g in groups)
            self._buffered -= taken
            ids = [t.id for g in groups for t in g]
            if ack:
                self._counts["queue/consumed"] += taken
            else:
                self._handed.update((t.id, prompt_of(t.info)) for g in groups for t in g)
        if ack:
            self._post("ack", ids)
        return groups

    def ack(self, ids: Iterable[str], *, commit: bool = True) -> None:
        """Consume trajectories returned by get_groups(ack=False): frees their room; with `commit`,
        tells their producers at once, else at a later `commit(ids)`."""
        ids = list(ids)
        with self._cond:
            unknown = [i for i in ids if i not in self._handed]
            if unknown:
                raise ValueError(f"ack: trajectory {unknown[0]!r} was not handed out by get_groups(ack=False) "
                                 "or is already acknowledged")
            for tid in ids:
                del self._handed[tid]
            self._counts["queue/consumed"] += len(ids)
        if commit:
            self._post("ack", ids)

    def commit(self, ids: Iterable[str]) -> None:
        """The consumption of `ids` is durable (a checkpoint holds it): their producers may forget them."""
        self._post("ack", list(ids))

    def broadcast(self, control: dict[str, Any], wait_s: float | None = None, *, parts: list[Any] | None = None,
                  window_bytes: int | None = None) -> BulkTicket | None:
        """Send a CONTROL map (with a string "kind"; may hold large bytes or arrays) to every producer.

        With `wait_s`, return only once ZeroMQ has handed the frame to every producer's connection
        (so a sender of large payloads holds one at a time), or raise TimeoutError after `wait_s`.

        With `parts` (buffers), send a BULK instead: the map, then the parts as raw frames straight
        from their memory (keep them unchanged until the ticket's `wait` returns). It waits up to
        `wait_s` for room in every producer's `window_bytes` (see bulk.py), then returns a ticket."""
        Control.from_wire(control)  # reject a map producers would reject, here, with the same message
        if parts is not None:
            return self._broadcast_bulk(control, parts, wait_s, window_bytes)
        if wait_s is None:
            self._post("control", encode(control))
            return
        frame = zmq.Frame(encode(control), track=True)
        tracker = frame.tracker
        self._post("control", frame)
        del frame  # the socket thread drops its reference once sent; then the tracker completes
        try:
            tracker.wait(wait_s)
        except zmq.NotDone:
            raise TimeoutError(f"trajectory queue at {self.address}: a {control.get('kind')!r} message was not "
                               f"sent within {wait_s:g}s") from None

    def _broadcast_bulk(self, control: dict[str, Any], parts: list[Any], wait_s: float | None,
                        window_bytes: int | None) -> BulkTicket:
        if not isinstance(window_bytes, int) or window_bytes < 1:
            raise ValueError(f"broadcast: window_bytes must be an integer >= 1 with parts, got {window_bytes!r}")
        sizes = tuple(memoryview(p).nbytes for p in parts)
        self._raise_if_stopped()
        try:
            seq, targets = self._bulk.reserve(sum(sizes), window_bytes, wait_s)
        except TimeoutError:
            raise TimeoutError(f"trajectory queue at {self.address}: no producer room for a {control['kind']!r} "
                               f"message ({sum(sizes)} bytes, window {window_bytes}) within {wait_s:g}s") from None
        self._post("bulk", (seq, targets, Bulk(seq=seq, body=control, part_bytes=sizes, parts=tuple(parts))))
        return BulkTicket(self._bulk, seq, sum(sizes))

    def mark_seen(self, ids: Iterable[str]) -> None:
        """Ids consumed and committed before this process started (a resumed trainer): a producer
        that sends them again gets them acknowledged as duplicates, never trained twice."""
        self._post("seen", list(ids))

    def set_trainer_state(self, policy_version: int, trained_slots: int, prompts: PromptSet | None = None) -> None:
        """What a producer that joins from now on is told: the version of the current weights, the
        trajectories the staleness bound already counts (trained batch slots; the buffer is added)
        and the stream positions consumed (the buffer's are added)."""
        with self._cond:
            self._trainer_state = (int(policy_version), int(trained_slots))
            if prompts is not None:
                self._consumed_prompts = prompts.copy()

    def open(self) -> None:
        """Answer HELLOs from now on (those that waited first): the trainer's state is loaded and set."""
        self._post("open", None)

    def unconsumed_ids(self) -> list[str]:
        """Ids taken in and not consumed: buffered, or handed out by get_groups(ack=False) and not acknowledged."""
        with self._cond:
            return [t.id for g in self._buffer for t in g] + list(self._handed)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"queue/depth": self._buffered, "queue/unacked": len(self._handed), **self._counts,
                    "queue/bulk_inflight_bytes": self._bulk.max_inflight(),
                    "queue/bulk_inflight_peak_bytes": self._bulk.peak_inflight,
                    "queue/bulk_rejected": self._bulk.rejected, "queue/cut": self._monitor.cuts}

    def producers_heard_within(self, seconds: float) -> int:
        """Connected producers that sent anything in the last `seconds` (peers.heard_within)."""
        return heard_within(list(self._producers.values()), seconds)

    def wait_for_producer(self, timeout: float | None = None) -> None:
        """Block until at least one producer has said HELLO; raises QueueTimeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._counts["queue/producers"] > 0 or self._error is not None
                                       or self._closed.is_set(), timeout):
                raise QueueTimeout(f"no producer connected to {self.address} within {timeout:g}s")
            self._raise_if_stopped()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._bulk.close()
        self._wake()
        self._thread.join(10)
        os.close(self._wake_r)
        os.close(self._wake_w)
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> "TrajectoryQueueServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _raise_if_stopped(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"trajectory queue thread failed: {self._error!r}")
        if self._closed.is_set():
            raise RuntimeError(f"trajectory queue at {self.address} is closed")

    def _post(self, what: str, item: Any) -> None:
        self._outbox.append((what, item))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # pipe full: the thread is already due to wake up
            pass

    # ------------------------------------------------------------------ socket thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug here must not leave the training loop waiting forever
            logger.exception("trajectory queue thread failed")
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            self._monitor.close()
            self._sock.close(0)
            if self._auth:
                self._auth.close()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._monitor.sock, zmq.POLLIN)
        next_hb = time.monotonic()
        while not self._closed.is_set():
            events = dict(poller.poll(max(0, min(100, int((next_hb - time.monotonic()) * 1000)))))
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            for _ in range(256):  # bounded, so acks and controls are not starved by a flood
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._receive(frames)
            if self._monitor.sock in events:  # after the messages: a BYE explains its disconnect
                self._count("queue/auth_refused", self._monitor.drain())
            self._monitor.settle()
            acks = self._drain_outbox()
            self._grant_and_notify(acks)
            if time.monotonic() >= next_hb:
                self._heartbeat()
                next_hb = time.monotonic() + self.heartbeat_s

    def _drain_outbox(self) -> dict[bytes, list[str]]:
        """Send queued controls; return consumed ids to acknowledge, by producer."""
        acks: dict[bytes, list[str]] = {}
        while self._outbox:
            what, item = self._outbox.popleft()
            if what == "control":
                for identity in list(self._producers):
                    self._send_frames(identity, [CONTROL, item])
                del item  # a tracked frame completes once no reference is left
            elif what == "open":
                self._greet = True
                for identity, hello in self._waiting.items():
                    self._welcome(identity, hello)
                self._waiting.clear()
            elif what == "seen":
                for tid in item:
                    self._seen.add(tid)
                    self._committed.add(tid)
            elif what == "bulk":
                seq, targets, bulk = item
                frames = bulk.frames()
                for identity in targets:
                    if identity not in self._producers or not self._send_frames(identity, frames):
                        self._bulk.forget(identity, seq)
                del item, bulk, frames
            else:
                for tid in item:
                    self._committed.add(tid)
                    identity = self._owner.pop(tid, None)
                    if identity is not None and identity in self._producers:
                        acks.setdefault(identity, []).append(tid)
        return acks

    def _grant_and_notify(self, acks: dict[bytes, list[str]]) -> None:
        """Grant free room to waiting producers (oldest demand first, a whole group at a time)."""
        with self._cond:
            free = self.capacity - self._buffered - len(self._handed)
        free -= sum(p.held for p in self._producers.values())
        granted = grant_credits(list(self._producers.values()), free, self.capacity)
        if granted:
            self._set_producer_count()
        for identity in granted | set(acks):
            self._send(identity, Credit(granted=self._producers[identity].granted, acks=tuple(acks.get(identity, ()))))

    def _heartbeat(self) -> None:
        now = time.monotonic()
        for identity, p in list(self._producers.items()):
            silent = now - p.last_seen
            if silent > self.peer_timeout_s:
                del self._producers[identity]
                self._bulk.drop(identity)
                self._count("queue/lost_producers")
                logger.warning("producer %s silent for %.0fs (peer_timeout_s=%g): dropped; its buffered "
                               "trajectories stay, its %d unused credits are freed", p.name, silent,
                               self.peer_timeout_s, p.held)
            else:
                self._send(identity, TrainerHeartbeat(granted=p.granted))
        self._set_producer_count()

    def _send(self, identity: bytes, msg: Message) -> None:
        self._send_frames(identity, pack(msg))

    def _send_frames(self, identity: bytes, frames: list[bytes]) -> bool:
        try:
            self._sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # peer gone (EHOSTUNREACH); credits heal with the next message
            self._count("queue/send_failed")
            logger.debug("send to %r failed: %s", identity[:40], exc)
            return False
        return True

    def _count(self, key: str, n: int = 1) -> None:
        with self._cond:
            self._counts[key] += n

    def _set_producer_count(self) -> None:
        """Publish the producer count and the credits they hold (granted, not yet received)."""
        with self._cond:
            self._counts["queue/producers"] = len(self._producers)
            self._counts["queue/credits_out"] = sum(p.held for p in self._producers.values())
            self._cond.notify_all()
