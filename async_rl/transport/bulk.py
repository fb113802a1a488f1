"""Flow control for BULK messages (large payloads such as weight buckets) on the trajectory queue.

The trainer sends a BULK to every producer with its payload as raw frames that are views
of the trainer's own memory (no encoded copy), and each producer answers BULK_ACK once its
handler is done and the frames are dropped. `BulkLedger` is the trainer side's account:
per producer, the bytes sent and not yet acknowledged. A sender asks it for room first
(`reserve`), so a new BULK goes only while every producer's unacknowledged bytes plus the
new ones stay within the sender's `window_bytes`. Whatever a producer holds of these
messages, wherever it sits (kernel socket buffers, ZeroMQ's queues, the handler), is
therefore at most one window: ZeroMQ's high-water marks count messages, not bytes, and
the queue needs them unlimited for its own traffic, so they could not bound this.

    seq, targets = ledger.reserve(nbytes, window_bytes, timeout)   # blocks for room
    ... the socket thread sends the BULK to `targets`; BULK_ACK -> ledger.ack(identity, seq)
    ledger.wait_acked(seq, timeout)                                  # everything up to seq handled

Acknowledgements arrive in order on one connection, so an ack of `seq` settles every
earlier one too (a lost ack cannot pin the window). A producer that leaves, times out or
starts a new session is dropped from the account, so nobody waits for it.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class BulkLedger:
    """Bytes in flight per producer (thread-safe); `peak_inflight` is the most any one producer had."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[bytes, dict[int, int]] = {}  # producer identity -> {seq: bytes}
        self._last_error: dict[bytes, str] = {}
        self._seq = 0
        self._closed = False
        self.peak_inflight = 0
        self.rejected = 0

    def open(self, identity: bytes) -> None:
        """A producer (re)starts a session: it holds nothing of earlier BULKs."""
        with self._cond:
            self._pending[identity] = {}
            self._cond.notify_all()

    def drop(self, identity: bytes) -> None:
        """A producer is gone: nobody waits for its acknowledgements."""
        with self._cond:
            self._pending.pop(identity, None)
            self._last_error.pop(identity, None)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def inflight(self, identity: bytes) -> int:
        with self._cond:
            return sum(self._pending.get(identity, {}).values())

    def max_inflight(self) -> int:
        """The most bytes any producer holds right now."""
        with self._cond:
            return max((sum(p.values()) for p in self._pending.values()), default=0)

    def reserve(self, nbytes: int, window_bytes: int, timeout: float | None) -> tuple[int, list[bytes]]:
        """Wait until every producer has room for `nbytes` within `window_bytes` (a producer holding
        nothing always has room), then book them; return (seq, the producers it goes to).
        TimeoutError after `timeout` seconds."""
        def room() -> bool:
            return self._closed or all(not p or sum(p.values()) + nbytes <= window_bytes
                                       for p in self._pending.values())

        with self._cond:
            if not self._cond.wait_for(room, None if timeout is None else max(0.0, timeout)):
                raise TimeoutError(f"no room in the bulk window ({window_bytes} bytes) within {timeout:g}s")
            self._raise_if_closed()
            self._seq += 1
            targets = list(self._pending)
            for identity in targets:
                pending = self._pending[identity]
                pending[self._seq] = nbytes
                self.peak_inflight = max(self.peak_inflight, sum(pending.values()))
            return self._seq, targets

    def ack(self, identity: bytes, seq: int, error: str = "", name: str = "") -> None:
        """BULK_ACK from `identity`: `seq` and everything before it are handled."""
        with self._cond:
            pending = self._pending.get(identity)
            if pending is None:
                return
            for s in [s for s in pending if s <= seq]:
                del pending[s]
            if error:
                self.rejected += 1
                if self._last_error.get(identity) != error:  # one line per distinct reason, not per bucket
                    logger.warning("producer %s rejected bulk message %d: %s", name or identity[:40], seq, error)
            self._last_error[identity] = error
            self._cond.notify_all()

    def forget(self, identity: bytes, seq: int) -> None:
        """BULK `seq` could not be sent to `identity`: it holds none of it."""
        with self._cond:
            self._pending.get(identity, {}).pop(seq, None)
            self._cond.notify_all()

    def wait_acked(self, seq: int, timeout: float) -> None:
        """Return once every producer still here has acknowledged `seq`; TimeoutError after `timeout`."""
        deadline = time.monotonic() + max(0.0, timeout)

        def done() -> bool:
            return self._closed or all(min(p, default=seq + 1) > seq for p in self._pending.values())

        with self._cond:
            if not self._cond.wait_for(done, max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"bulk message {seq} not acknowledged by every producer within {timeout:g}s")
            self._raise_if_closed()

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("the trajectory queue was closed while a bulk send was waiting")


class BulkTicket:
    """What `TrajectoryQueueServer.broadcast(..., parts=...)` returns: wait for that BULK's acknowledgements."""

    __slots__ = ("_ledger", "seq", "nbytes")

    def __init__(self, ledger: BulkLedger, seq: int, nbytes: int):
        self._ledger, self.seq, self.nbytes = ledger, seq, nbytes

    def wait(self, timeout: float) -> None:
        """Return once every producer has handled this BULK and every one before it; TimeoutError otherwise."""
        self._ledger.wait_acked(self.seq, timeout)
