"""Flow control of streamed weights: the trainer's byte window per producer (`transport/bulk.py`) and
the BULK / BULK_ACK messages that carry weight chunks on the queue connection.

A BULK goes only while every producer's unacknowledged bytes plus its own fit the window
(a producer holding nothing always has room); an acknowledgement settles its message and
every earlier one; a producer that leaves or starts a new session holds nothing; a waiter
never waits past its timeout, and a closed queue wakes it with an error.
"""

import threading
import time

import numpy as np
import pytest

from async_rl.transport.bulk import BulkLedger
from async_rl.transport.codec import decode
from async_rl.transport.messages import TO_ROLLOUT, TO_TRAINER, Bulk, BulkAck, pack, unpack
from async_rl.types import WireFormatError

A, B = b"producer-a", b"producer-b"


def _ledger(*producers):
    ledger = BulkLedger()
    for p in producers:
        ledger.open(p)
    return ledger


def test_window_bounds_the_bytes_each_producer_holds():
    ledger = _ledger(A, B)
    assert ledger.reserve(40, 100, 1) == (1, [A, B])
    assert ledger.reserve(60, 100, 1)[0] == 2  # exactly full
    with pytest.raises(TimeoutError, match="no room in the bulk window"):
        ledger.reserve(1, 100, 0.05)
    ledger.ack(A, 1)
    with pytest.raises(TimeoutError):  # B still holds 100 bytes: the slowest producer sets the pace
        ledger.reserve(40, 100, 0.05)
    ledger.ack(B, 1)
    assert ledger.reserve(40, 100, 1)[0] == 3
    assert ledger.inflight(A) == ledger.inflight(B) == 100 and ledger.peak_inflight == 100


def test_a_producer_holding_nothing_takes_a_message_larger_than_the_window():
    ledger = _ledger(A)
    assert ledger.reserve(500, 100, 1)[0] == 1
    with pytest.raises(TimeoutError):
        ledger.reserve(1, 100, 0.05)


def test_an_ack_settles_every_earlier_message_so_a_lost_ack_cannot_pin_the_window():
    ledger = _ledger(A)
    for _ in range(3):
        ledger.reserve(30, 100, 1)
    ledger.ack(A, 3)
    assert ledger.inflight(A) == 0
    ledger.wait_acked(3, 0)  # nothing left to wait for


def test_a_blocked_sender_wakes_on_the_ack_that_makes_room():
    ledger = _ledger(A)
    ledger.reserve(80, 100, 1)
    got = {}
    sender = threading.Thread(target=lambda: got.update(seq=ledger.reserve(80, 100, 5)[0]))
    sender.start()
    time.sleep(0.1)
    assert sender.is_alive() and not got  # waiting for room
    ledger.ack(A, 1, error="weights v3 rejected")  # a rejection frees the room as well, and is counted
    sender.join(5)
    assert got == {"seq": 2} and ledger.rejected == 1


def test_a_producer_gone_or_restarted_holds_nothing_and_a_closed_queue_wakes_waiters():
    ledger = _ledger(A, B)
    seq, _ = ledger.reserve(100, 100, 1)
    ledger.drop(A)  # left (BYE) or timed out
    ledger.open(B)  # a new session: earlier messages are not coming back
    ledger.wait_acked(seq, 0)
    ledger.reserve(100, 100, 0)
    errors = []

    def waiter():
        try:
            ledger.reserve(100, 100, 30)
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    ledger.close()
    t.join(5)
    assert errors and "closed" in errors[0]
    pending = _ledger(A)
    seq, _ = pending.reserve(1, 10, 1)
    with pytest.raises(TimeoutError, match="not acknowledged by every producer within 0.05s"):
        pending.wait_acked(seq, 0.05)


def test_bulk_frames_round_trip_and_are_checked():
    parts = [np.arange(10, dtype=np.uint8), np.zeros(0, dtype=np.uint8), np.ones(3, dtype=np.float32)]
    msg = Bulk(seq=7, body={"kind": "weights_bucket", "version": 2}, part_bytes=(10, 0, 12), parts=tuple(parts))
    kind, header, *data = msg.frames()
    got = unpack(kind, header, TO_ROLLOUT).with_parts(data)
    assert got.seq == 7 and got.body == {"kind": "weights_bucket", "version": 2}
    assert [bytes(memoryview(p).cast("B")) for p in got.parts] == [p.tobytes() for p in parts]
    with pytest.raises(WireFormatError, match=r"BULK.part_bytes: announced 3 frames of 22 bytes, got 2 of 10"):
        unpack(kind, header, TO_ROLLOUT).with_parts(data[:2])
    with pytest.raises(WireFormatError, match=r"BULK.body: CONTROL.kind: missing"):
        Bulk.from_wire({"seq": 1, "body": {}, "part_bytes": []})
    with pytest.raises(WireFormatError, match=r"BULK.part_bytes"):
        Bulk.from_wire({"seq": 1, "body": {"kind": "x"}, "part_bytes": [-1]})
    back = unpack(*pack(BulkAck(seq=7, error="x" * 5000)), TO_TRAINER)
    assert back.seq == 7 and len(back.error) == 2000  # a long reason is cut, not refused
    assert decode(pack(BulkAck(seq=1))[1]) == {"seq": 1, "error": ""}
