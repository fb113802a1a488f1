"""What a broken or hostile producer cannot make the trainer's queue do, on real sockets.

A group beyond its producer's credits is refused, not trained; a group that does not parse (a
non-finite reward) is refused, acknowledged, and leaves no credits held; everything taken in or
refused is journalled (the trainer's ledger) under the identity that delivered it, which under
CURVE is the producer's key, not the name it says; a queue built with greet=False answers no HELLO
until `open()`; a HELLO of another protocol version is one error on both sides naming both
versions; a frame over the queue's frame limit cuts the sender's link (logged) and a client
refuses to send one.
"""

from __future__ import annotations

import functools
import logging
import shutil
import time

import numpy as np
import pytest
import zmq
import zmq.auth

from async_rl.transport import client as client_module
from async_rl.transport.auth import create_keys
from async_rl.transport.client import ProtocolMismatchError, TrajectoryQueueClient
from async_rl.transport.codec import decode, encode
from async_rl.transport.messages import PROTOCOL_VERSION, Hello
from async_rl.transport.queue import QueueTimeout, TrajectoryQueueServer
from async_rl.types import GroupRefused
from tests.integration.test_queue import FAST, LoopThread, make_group, wait_until


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.loop.call_soon_threadsafe(lt.loop.stop)


class Journal:
    """Stands where the trainer's ledger does: `journal(event, ids, **extra)`."""

    def __init__(self):
        self.rows: list[tuple[str, list[str], dict]] = []

    def __call__(self, event, ids=(), **extra):
        self.rows.append((event, list(ids), extra))

    def of(self, event):
        return [(ids, extra) for e, ids, extra in self.rows if e == event]


def _raw(server, name, hello=True, protocol=PROTOCOL_VERSION):
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.IDENTITY, name.encode())
    raw.connect(server.address)
    if hello:
        raw.send_multipart([b"HELLO", encode({"producer_id": name, "protocol": protocol})])
    return raw


def _recv(raw, kind, timeout_ms=10_000):
    while True:
        assert raw.poll(timeout_ms), f"no {kind!r} from the server"
        got, payload = raw.recv_multipart()
        if got == kind:
            return decode(payload)


def _group_frame(group):
    return [b"GROUP", encode({"seq": 1, "trajectories": [t.to_wire() for t in group]})]


def test_a_group_beyond_its_credits_is_refused_not_trained():
    journal = Journal()
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, **FAST) as server:
        server.journal = journal
        raw = _raw(server, "greedy")
        _recv(raw, b"WELCOME")
        group = make_group("greedy", 0, 4)
        raw.send_multipart(_group_frame(group))  # no credits asked for, none granted
        wait_until(lambda: journal.of("refused"), 60, "the refusal")
        (ids, extra), = journal.of("refused")
        assert ids == [t.id for t in group] and "beyond its credits" in extra["reason"]
        assert extra["identity"] == "greedy" and server.stats()["queue/overrun"] == 4
        with pytest.raises(QueueTimeout):
            server.get_groups(4, timeout=0.5)  # not trained
        assert not journal.of("received")
        # kept by its producer (not acknowledged): sent again within credits, it is taken
        raw.send_multipart([b"HB", encode({"want": 8})])
        assert _recv(raw, b"CREDIT")["granted"] == 8
        raw.send_multipart(_group_frame(group))
        assert [t.id for t in server.get_groups(4, timeout=60)[0]] == ids
        raw.close(0)


def test_a_malformed_group_is_refused_acknowledged_and_holds_no_credits():
    """The hang of issue 41: a non-finite reward made the trainer drop the group silently; its producer's
    credits stayed held, and with no room left the run stopped."""
    journal = Journal()
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=4, **FAST) as server:
        server.journal = journal
        raw = _raw(server, "nan")
        _recv(raw, b"WELCOME")
        raw.send_multipart([b"HB", encode({"want": 4})])
        assert _recv(raw, b"CREDIT")["granted"] == 4  # the whole queue
        group = make_group("nan", 0, 4)
        wire = [t.to_wire() for t in group]
        wire[2]["reward"] = float("nan")
        raw.send_multipart([b"GROUP", encode({"seq": 1, "trajectories": wire})])
        assert sorted(_recv(raw, b"CREDIT")["acks"]) == sorted(t.id for t in group)  # the producer forgets it
        release = _recv(raw, b"CONTROL")
        assert release["kind"] == "release" and release["n"] == 4  # its staleness count given back
        (ids, extra), = journal.of("refused")
        assert extra["reason"] == "malformed: Trajectory.reward: must be finite, got nan"
        raw.send_multipart([b"HB", encode({"want": 8})])  # room again: nothing is held for the refused group
        assert _recv(raw, b"CREDIT")["granted"] == 8
        assert server.stats()["queue/refused"] == 4 and server.stats()["queue/depth"] == 0
        raw.close(0)


def test_what_is_taken_in_is_journalled_under_the_identity_that_delivered_it(loop):
    journal = Journal()
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, **FAST) as server:
        server.journal = journal
        client = TrajectoryQueueClient(server.address, producer_id="side-a", **FAST)
        loop.run(client.connect(60))
        group = make_group("side-a", 0, 4)
        loop.run(client.put_group(group))
        server.get_groups(4, timeout=60)
        assert journal.of("session") == [([], {"producer": "side-a", "identity": "side-a"})]
        assert journal.of("received") == [([t.id for t in group], {"prompts": [None] * 4, "identity": "side-a"})]
        loop.run(client.close())
        assert set(server.unconsumed_ids()) == set()


def test_a_queue_that_has_not_loaded_its_state_greets_no_one(loop):
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, greet=False, **FAST) as server:
        client = TrajectoryQueueClient(server.address, producer_id="early", **FAST)
        connecting = loop.submit(client.connect(30))
        time.sleep(1.0)
        assert not connecting.done() and server.stats()["queue/sessions"] == 0  # HELLO waits
        server.set_trainer_state(3, 96)  # what a resumed trainer restored
        server.open()
        connecting.result(10)
        assert client.trainer_state["policy_version"] == 3 and client.trainer_state["admitted"] == 96
        loop.run(client.close())


def test_a_protocol_mismatch_is_one_error_on_both_sides_naming_both_versions(loop, monkeypatch, caplog):
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, **FAST) as server:
        raw = _raw(server, "old", protocol=1)
        refused = _recv(raw, b"REFUSED")
        assert refused["protocol"] == PROTOCOL_VERSION and "version 1" in refused["reason"]
        for odd in ("2", np.array([1, 2]), True):  # not a version number: malformed, as before (an array once
            raw.send_multipart([b"HELLO", encode({"producer_id": "old", "protocol": odd})])  # killed the thread)
        wait_until(lambda: server.stats()["queue/malformed"] == 4, 60, "the odd HELLOs counted")
        raw.close(0)
        # a client of another version: its connect fails at once, naming both
        monkeypatch.setattr(client_module, "PROTOCOL_VERSION", 1)
        monkeypatch.setattr(client_module, "Hello", functools.partial(Hello, protocol=1))
        client = TrajectoryQueueClient(server.address, producer_id="old2", **FAST)
        with caplog.at_level(logging.ERROR):
            with pytest.raises(ProtocolMismatchError) as err:
                loop.run(client.connect(60))
        assert f"speaks version 1, the trainer version {PROTOCOL_VERSION}" in str(err.value)
        trainer_lines = [r.getMessage() for r in caplog.records if r.name == "async_rl.transport.queue"]
        assert any(f"this trainer speaks version {PROTOCOL_VERSION}, the producer version 1" in m
                   for m in trainer_lines), trainer_lines
        assert server.stats()["queue/malformed"] == 5 and server.stats()["queue/sessions"] == 0


def test_a_frame_over_the_limit_cuts_the_link_and_a_client_will_not_send_one(loop, caplog):
    limit = 1 << 20
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, max_frame=limit, **FAST) as server:
        raw = _raw(server, "big")
        _recv(raw, b"WELCOME")
        raw.send_multipart([b"HB", encode({"want": 4})])
        _recv(raw, b"CREDIT")
        with caplog.at_level(logging.WARNING):
            raw.send_multipart(_group_frame(make_group("big", 0, 4, r=100_000)))  # 4 x 1.3 MB
            wait_until(lambda: server.stats()["queue/cut"] == 1, 60, "the cut")
        assert any(f"over the {limit}-byte frame limit" in r.getMessage() for r in caplog.records)
        assert server.stats()["queue/received"] == 0
        raw.send_multipart([b"BYE", encode({"reason": "done"})])  # it reconnected: a goodbye, no cut, this time
        wait_until(lambda: server.stats()["queue/producers"] == 0, 60, "the first goodbye")
        raw.close(0)
        client = TrajectoryQueueClient(server.address, producer_id="polite", **FAST)
        loop.run(client.connect(60))
        assert client.max_frame == limit
        with pytest.raises(GroupRefused, match=f"over the {limit} bytes the trainer takes"):
            client.pack_group(make_group("polite", 0, 4, r=100_000))
        loop.run(client.put_group(make_group("polite", 0, 4)))  # an ordinary one goes
        assert len(server.get_groups(4, timeout=60)) == 1
        loop.run(client.close())
        wait_until(lambda: server.stats()["queue/producers"] == 0, 60, "the goodbye")
        time.sleep(3.0)  # past the monitor's settle_s: a disconnect no goodbye explained would be counted by now
        assert server.stats()["queue/cut"] == 1  # a goodbye is no cut


def test_under_curve_a_producer_is_its_key_not_the_name_it_says(tmp_path, loop):
    """A second authorised producer that says the first one's name is another producer: its own session,
    its deliveries journalled under its own key; a socket that takes the first one's key as its routing id
    without holding that key gets nothing in."""
    create_keys(tmp_path / "run")
    thief = tmp_path / "thief"
    thief.mkdir()
    public, secret = zmq.auth.create_certificates(tmp_path, "thief")
    shutil.copy(tmp_path / "run" / "server.key", thief / "server.key")
    shutil.copy(secret, thief / "client.key_secret")
    shutil.copy(public, tmp_path / "run" / "authorized_clients" / "thief.key")
    journal = Journal()
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=16, curve_keys_dir=str(tmp_path / "run"),
                               **FAST) as server:
        server.journal = journal
        real = TrajectoryQueueClient(server.address, producer_id="P", curve_keys_dir=str(tmp_path / "run"), **FAST)
        fake = TrajectoryQueueClient(server.address, producer_id="P", curve_keys_dir=str(thief), **FAST)
        assert real.identity != fake.identity
        for client, k in ((real, 0), (fake, 1)):
            loop.run(client.connect(60))
            loop.run(client.put_group(make_group("P", k, 4)))
        server.get_groups(8, timeout=60)
        assert {e["identity"] for _, e in journal.of("session")} == {real.identity, fake.identity}
        assert {e["identity"]: ids for ids, e in journal.of("received")} == {
            real.identity: [f"P-0-{j}" for j in range(4)], fake.identity: [f"P-1-{j}" for j in range(4)]}
        assert server.stats()["queue/producers"] == 2  # neither took the other's place
        # routing id = the real producer's key, but the thief's key pair: dropped, counted
        from async_rl.transport.auth import client_curve_options

        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.IDENTITY, real.identity.encode())
        for opt, value in client_curve_options(str(thief)).items():
            raw.setsockopt(opt, value)
        raw.connect(server.address)
        raw.send_multipart([b"HELLO", encode({"producer_id": "P", "protocol": PROTOCOL_VERSION})])
        wait_until(lambda: server.stats()["queue/wrong_key"] >= 1, 60, "the impostor's message dropped")
        assert server.stats()["queue/sessions"] == 2
        raw.close(0)
        for client in (real, fake):
            loop.run(client.close())
