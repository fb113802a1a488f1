"""What the trainer's queue does with each message a producer sends: greet it, take its groups in, or refuse.

Part of `TrajectoryQueueServer` (queue.py), split off by what it does: these methods run in the
queue's socket thread and use its state. A producer's identity is its CURVE key when keys are on
(checked on every message), else the name it says. A HELLO of another protocol version is
REFUSED, naming both versions; before `open()` a HELLO waits unanswered. A group is taken in
whole, journalled `received` under its producer's identity, or refused with its reason:
beyond its producer's credits (kept by the producer: not acknowledged), or not parsing
(acknowledged, and its room released on the producer's side). Only a group whose trajectories
cannot even be counted ends its producer's session: its credits cannot be settled otherwise.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from typing import Any

import zmq

from async_rl.transport.codec import decode
from async_rl.transport.messages import (
    GROUP, HELLO, PROTOCOL_VERSION, TO_TRAINER, BulkAck, Bye, Control, Credit, Group, Heartbeat, Hello, Message,
    Refused, TrainerHeartbeat, Welcome, hello_protocol, protocol_mismatch, unpack)
from async_rl.transport.peers import _Producer, readable_group
from async_rl.types import WireFormatError
from async_rl.utils.prompts import held_positions, prompt_of

logger = logging.getLogger("async_rl.transport.queue")


class Intake:
    def _receive(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if self._auth is not None and len(frames) > 1 and frames[1].get("User-Id") != identity.decode(errors="replace"):
            self._count("queue/wrong_key")  # a routing id that is not the sender's key: someone else's name
            logger.warning("dropped a message whose routing id %r is not its sender's key %s...", identity[:40],
                           frames[1].get("User-Id")[:8])
            return
        try:
            if len(frames) != 3:
                raise WireFormatError(f"expected frames [kind, payload], got {len(frames) - 1} frames")
            if frames[1].bytes == HELLO and self._other_protocol(identity, frames[2].buffer):
                return
            msg = unpack(frames[1].bytes, frames[2].buffer, TO_TRAINER)
        except WireFormatError as exc:
            producer = self._producers.get(identity)
            if producer is not None and len(frames) == 3 and frames[1].bytes == GROUP:
                self._refuse_malformed(producer, frames[2].buffer, exc)
                return
            self._count("queue/malformed")
            now = time.monotonic()
            if now >= self._quiet_until:  # a flood of bad frames is counted, not logged line by line
                self._quiet_until = now + 10.0
                logger.warning("malformed message from %r dropped: %s (more within 10s are only counted in "
                               "queue/malformed)", identity[:40], exc)
            return
        self._handle(identity, msg)

    def _other_protocol(self, identity: bytes, payload: Any) -> bool:
        """A HELLO of another protocol version: REFUSED, naming both versions, and one error line per peer."""
        try:
            theirs = hello_protocol(decode(payload))
        except WireFormatError:
            return False  # unpack says what is wrong with it
        if not isinstance(theirs, int) or isinstance(theirs, bool) or theirs == PROTOCOL_VERSION:
            return False  # not a version number at all: unpack says what is wrong with it
        why = protocol_mismatch(PROTOCOL_VERSION, theirs, "trainer")
        self._count("queue/malformed")  # a HELLO this trainer cannot read, answered REFUSED
        if identity not in self._protocol_logged:
            self._protocol_logged.add(identity)
            logger.error("refused producer %r: %s", identity[:40], why)
        self._send(identity, Refused(reason=why))
        return True

    def _handle(self, identity: bytes, msg: Message) -> None:
        producer = self._producers.get(identity)
        if isinstance(msg, Hello):
            if self._greet:
                self._welcome(identity, msg)
            else:  # the trainer is loading its state: answered by open()
                self._waiting[identity] = msg
            return
        if producer is None:  # we restarted or timed it out: it must say HELLO (and re-send) first
            self._count("queue/unknown_peer")
            if not isinstance(msg, Bye):
                self._send(identity, TrainerHeartbeat(granted=0, registered=False))
            return
        producer.last_seen = time.monotonic()
        if isinstance(msg, Group):
            self._accept(producer, msg)
        elif isinstance(msg, Heartbeat):
            if msg.want > producer.granted and producer.want <= producer.granted:
                producer.waiting_since = time.monotonic()
            producer.want = msg.want
        elif isinstance(msg, BulkAck):
            self._bulk.ack(identity, msg.seq, msg.error, producer.name)
        elif isinstance(msg, Bye):
            del self._producers[identity]
            self._bulk.drop(identity)
            self._set_producer_count()
            self._monitor.expect_goodbye()
            logger.info("producer %s left%s", producer.name, f": {msg.reason}" if msg.reason else "")

    def _welcome(self, identity: bytes, msg: Hello) -> None:
        old = self._producers.get(identity)
        if old is not None:
            logger.info("producer %s starts a new session (its %d held credits are freed)", old.name, old.held)
        who = identity.decode(errors="replace") if self._auth else msg.producer_id  # its key, or the name it says
        self._producers[identity] = _Producer(identity, msg.producer_id, who=who)
        self._bulk.open(identity)
        self._set_producer_count()
        logger.info("producer %s connected%s", msg.producer_id, f" (key {who[:8]}...)" if self._auth else "")
        if (msg.producer_id, who) not in self._sessions:
            self._sessions.add((msg.producer_id, who))
            self._journal("session", producer=msg.producer_id, identity=who)
        with self._cond:
            version, slots = self._trainer_state
            self._counts["queue/sessions"] += 1
            admitted = slots + self._buffered + len(self._handed)
            held = held_positions(self._consumed_prompts, self._buffer, self._handed.values())
        self._send(identity, Welcome(capacity=self.capacity, granted=0, session=msg.session, policy_version=version,
                                     admitted=admitted, run_id=self.run_id, prompts=held, max_frame=self.max_frame))

    def _accept(self, producer: _Producer, group: Group) -> None:
        n = len(group.trajectories)
        producer.received += n
        if producer.received > producer.granted:  # refused whole: a group is trained whole or not at all
            self._count("queue/overrun", n)
            self._refuse(producer, group.trajectories, f"sent beyond its credits ({producer.granted} granted in this "
                                                       f"session, {producer.received} trajectories sent)", ack=False)
            return
        fresh = [t for t in group.trajectories if t.id not in self._seen]
        if len(fresh) < n:
            dups = [t.id for t in group.trajectories if t.id in self._seen]
            self._count("queue/duplicates", len(dups))
            logger.info("dropped %d re-sent trajectories from %s", len(dups), producer.name)
            done = tuple(i for i in dups if i in self._committed)
            for tid in dups:  # consumed, not committed yet: acknowledged to this producer at the commit
                if tid not in self._committed:
                    self._owner[tid] = producer.identity
            if done:
                self._send(producer.identity, Credit(granted=producer.granted, acks=done))
        if not fresh:
            return
        self._journal("received", [t.id for t in fresh], prompts=[prompt_of(t.info) for t in fresh],
                      identity=producer.who)  # before the training loop can consume them
        for t in fresh:
            self._seen.add(t.id)
            self._owner[t.id] = producer.identity
        with self._cond:
            self._buffer.append(fresh)
            self._buffered += len(fresh)
            self._counts["queue/received"] += len(fresh)
            self._counts["queue/groups"] += 1
            self._counts["queue/credits_out"] = sum(p.held for p in self._producers.values())
            self._cond.notify_all()

    def _refuse_malformed(self, producer: _Producer, payload: Any, exc: WireFormatError) -> None:
        """A GROUP that does not parse (a non-finite reward, a bad field): refused and acknowledged (sending it
        again cannot help), its room given back to its producer's staleness count. One whose trajectories
        cannot even be counted leaves its credits unsettled: its session ends (the producer says HELLO again)."""
        readable = readable_group(payload)
        if readable is None:
            self._count("queue/malformed")
            del self._producers[producer.identity]
            self._bulk.drop(producer.identity)
            self._set_producer_count()
            logger.warning("unreadable group from producer %s (%s): its session is ended", producer.name, exc)
            return
        n, ids, prompts = readable
        producer.received += n
        why = re.sub(r"^GROUP\.trajectories\[\d+\]: ", "", str(exc))  # the same words for each group refused so
        self._refuse(producer, [], f"malformed: {why}", ack=True, ids=ids, prompts=prompts, n=n)

    def _refuse(self, producer: _Producer, trajs: Any, reason: str, *, ack: bool, ids: list[str] | None = None,
                prompts: list[Any] | None = None, n: int | None = None) -> None:
        """Refuse a group from `producer` (never trained): one line, the trainer's ledger, and with `ack`
        an acknowledgement and its room released on the producer's side."""
        ids = [t.id for t in trajs] if ids is None else ids
        prompts = [prompt_of(t.info) for t in trajs] if prompts is None else prompts
        n = len(ids) if n is None else n
        self._count("queue/refused", n)
        if producer.may_log():
            logger.warning("refused a group of %d trajectories from producer %s: %s", n, producer.name, reason)
        self._journal("refused", ids, prompts=prompts, reason=reason, producer=producer.name, identity=producer.who)
        if ack:
            if ids:
                self._send(producer.identity, Credit(granted=producer.granted, acks=tuple(ids)))
            self._send(producer.identity, Control(body={"kind": "release", "n": n, "reason": f"refused: {reason}"}))

    def _journal(self, event: str, ids: Iterable[str] = (), **extra: Any) -> None:
        if self.journal is not None:
            self.journal(event, ids, **extra)
