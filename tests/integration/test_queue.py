"""The trajectory queue over real sockets: producers in separate (spawned) processes, a trainer-side
server in this one. Exactly-once in-order delivery, exact credit backpressure, two producers,
a large CONTROL blob, unreachable trainer, malformed frames from a raw socket, duplicate
re-sends, a trainer restart (the producer re-sends what was not acknowledged), a silent trainer,
and a producer that goes silent."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import multiprocessing as mp
import socket
import threading
import time

import numpy as np
import pytest
import zmq

from async_rl.transport.codec import decode, encode
from async_rl.transport.messages import PROTOCOL_VERSION
from async_rl.transport.client import TrajectoryQueueClient
from async_rl.transport.queue import PeerTimeoutError, PeerUnreachableError, QueueTimeout, TrajectoryQueueServer
from async_rl.types import Trajectory

SPAWN = mp.get_context("spawn")
FAST = {"heartbeat_s": 0.1, "peer_timeout_s": 10.0}


def make_group(producer: str, k: int, size: int, r: int = 16) -> list[Trajectory]:
    rng = np.random.default_rng(k)
    return [Trajectory(id=f"{producer}-{k}-{j}", group_id=f"{producer}-{k}",
                       prompt_ids=np.arange(8, dtype=np.int32),  # [P]
                       response_ids=rng.integers(0, 100, r).astype(np.int32),  # [R]
                       loss_mask=np.ones(r, np.uint8), behav_logprobs=np.full(r, -0.5, np.float32),
                       versions=np.full(r, k, np.int32), reward=float(j), finish_reason="stop")
            for j in range(size)]


def _producer_main(addr, producer_id, n_groups, group_size, progress, out_q, wait_controls):
    """Runs in a spawned process: push groups, then optionally read CONTROL maps until "stop"."""
    async def main():
        client = TrajectoryQueueClient(addr, producer_id=producer_id, **FAST)
        await client.connect(60)
        controls = client.controls()
        for k in range(n_groups):
            await client.put_group(make_group(producer_id, k, group_size))
            with progress.get_lock():
                progress.value += 1
        seen = []
        if wait_controls:
            async for msg in controls:
                blob = msg.get("blob", b"")
                seen.append({"kind": msg["kind"], "sha": hashlib.sha256(blob).hexdigest(), "n": len(blob)})
                if msg["kind"] == "stop":
                    break
        deadline = time.monotonic() + 10
        while client.unacked and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        out_q.put({"producer": producer_id, "unacked": client.unacked, "controls": seen, "stats": client.stats()})
        await client.close()
    asyncio.run(main())


def start_producer(addr, producer_id, n_groups, group_size, wait_controls=False):
    progress, out_q = SPAWN.Value("i", 0), SPAWN.Queue()
    proc = SPAWN.Process(target=_producer_main, daemon=True,
                         args=(addr, producer_id, n_groups, group_size, progress, out_q, wait_controls))
    proc.start()
    return proc, progress, out_q


def drain(server, n_trajectories, batch, timeout=120):
    groups = []
    while sum(map(len, groups)) < n_trajectories:
        groups += server.get_groups(batch, timeout=timeout)
    return groups


def wait_until(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class LoopThread:
    """An asyncio loop in a thread, so this thread can block on the server meanwhile."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout=60):
        return self.submit(coro).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.stop()


def free_tcp_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


# --------------------------------------------------------------------------- separate processes
def test_groups_arrive_exactly_once_in_order_and_control_blob_intact():
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=16, **FAST) as server:
        proc, progress, out_q = start_producer(server.address, "p0", 30, 4, wait_controls=True)
        groups = drain(server, 120, 8)
        assert [g[0].group_id for g in groups] == [f"p0-{k}" for k in range(30)]
        ids = [t.id for g in groups for t in g]
        assert ids == [f"p0-{k}-{j}" for k in range(30) for j in range(4)]
        sent = make_group("p0", 7, 4)
        assert np.array_equal(groups[7][2].response_ids, sent[2].response_ids)
        assert groups[7][2].versions.dtype == np.int32 and groups[7][2].reward == 2.0
        blob = np.random.default_rng(0).integers(0, 256, 50 * 2**20, dtype=np.uint8).tobytes()  # 50 MB
        server.broadcast({"kind": "weights", "version": 1, "path": "", "blob": blob})
        server.broadcast({"kind": "stop", "final_version": 1})
        report = out_q.get(timeout=30)
        proc.join(10)
        assert report["controls"] == [{"kind": "weights", "sha": hashlib.sha256(blob).hexdigest(), "n": len(blob)},
                                      {"kind": "stop", "sha": hashlib.sha256(b"").hexdigest(), "n": 0}]
        assert report["unacked"] == 0 and report["stats"]["queue/sent"] == 120
        stats = server.stats()
        assert stats["queue/received"] == 120 and stats["queue/duplicates"] == 0 and stats["queue/overrun"] == 0
        assert stats["queue/depth"] == 0 and stats["queue/malformed"] == 0


def test_full_queue_blocks_the_producer_until_the_trainer_consumes():
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, **FAST) as server:
        proc, progress, out_q = start_producer(server.address, "slow", 5, 4)
        wait_until(lambda: progress.value == 2, 120, "two groups sent")
        time.sleep(1.0)  # the third put_group must not return while 8 trajectories are buffered
        assert progress.value == 2
        assert server.stats()["queue/depth"] == 8
        first = server.get_groups(4, timeout=60)
        assert [t.id for t in first[0]] == [f"slow-0-{j}" for j in range(4)]
        wait_until(lambda: progress.value == 3, 60, "third group after consuming one")
        time.sleep(0.3)
        assert progress.value == 3 and server.stats()["queue/depth"] == 8
        rest = drain(server, 16, 4)
        assert [g[0].group_id for g in rest] == [f"slow-{k}" for k in range(1, 5)]
        assert out_q.get(timeout=120)["unacked"] == 0
        proc.join(10)
        assert server.stats()["queue/received"] == 20


def test_two_producers_over_ipc_share_a_small_queue(tmp_path):
    with TrajectoryQueueServer(f"ipc://{tmp_path}/q.sock", capacity=8, **FAST) as server:
        procs = [start_producer(server.address, f"p{i}", 10, 4) for i in range(2)]
        wait_until(lambda: server.stats()["queue/depth"] == 8, 120, "a full queue")
        time.sleep(0.5)  # not consuming: neither producer may get room beyond capacity
        assert server.stats()["queue/depth"] == 8 and sum(p.value for _, p, _ in procs) == 2
        groups = []
        while len(groups) < 20:
            groups += server.get_groups(4, timeout=120)
            stats = server.stats()  # room promised (buffered + granted, not yet received) never exceeds capacity
            assert stats["queue/depth"] + stats["queue/credits_out"] <= 8, stats
        for name in ("p0", "p1"):
            mine = [g[0].group_id for g in groups if g[0].group_id.startswith(name)]
            assert mine == [f"{name}-{k}" for k in range(10)]
        for proc, _, out_q in procs:
            assert out_q.get(timeout=120)["unacked"] == 0
            proc.join(10)
        assert server.stats()["queue/received"] == 80


# --------------------------------------------------------------------------- failures, in-process
def test_connecting_where_no_trainer_listens_fails_quickly(loop):
    addr = free_tcp_addr()
    client = TrajectoryQueueClient(addr)
    with pytest.raises(PeerUnreachableError, match=f"{addr} within 0.5s"):  # its own timeout ended the wait
        loop.run(client.connect(0.5))


def test_malformed_frames_are_counted_and_the_server_keeps_working(loop):
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, **FAST) as server:
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.address)
        good = make_group("raw", 0, 1)[0].to_wire()
        raw.send_multipart([b"just one frame"])
        raw.send_multipart([b"GROUP", b"not a frame at all"])
        raw.send_multipart([b"WHAT", encode({})])
        raw.send_multipart([b"HELLO", encode({"producer_id": 5, "protocol": PROTOCOL_VERSION})])
        raw.send_multipart([b"HELLO", encode({"producer_id": "raw", "protocol": PROTOCOL_VERSION})])
        assert raw.poll(60_000) and raw.recv_multipart()[0] == b"WELCOME"
        raw.send_multipart([b"GROUP", encode({"seq": 1, "trajectories": [{**good, "loss_mask": np.ones(3)}]})])
        wait_until(lambda: server.stats()["queue/malformed"] == 4, 60, "4 malformed messages counted")
        # a registered producer's group that does not parse is refused and acknowledged, not left holding credits
        assert _recv(raw, b"CREDIT")["acks"] == [good["id"]] and server.stats()["queue/refused"] == 1
        client = TrajectoryQueueClient(server.address, producer_id="good", **FAST)
        loop.run(client.connect(60))
        loop.run(client.put_group(make_group("good", 0, 4)))
        assert [t.id for t in server.get_groups(4, timeout=60)[0]] == [f"good-0-{j}" for j in range(4)]
        loop.run(client.close())
        raw.close(0)


def _raw_producer(server, name):
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.IDENTITY, name.encode())
    raw.connect(server.address)
    raw.send_multipart([b"HELLO", encode({"producer_id": name, "protocol": PROTOCOL_VERSION})])
    return raw


def _recv(raw, kind):
    while True:
        assert raw.poll(60_000), f"no {kind!r} from the server"
        got, payload = raw.recv_multipart()
        if got == kind:
            return decode(payload)


def test_resent_duplicates_are_dropped_counted_and_acknowledged():
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, **FAST) as server:
        raw = _raw_producer(server, "dup")
        assert _recv(raw, b"WELCOME") == {"capacity": 8, "granted": 0, "session": 0, "protocol": PROTOCOL_VERSION,
                                      "policy_version": 0, "admitted": 0, "run_id": "",
                                      "prompts": {"low": 0, "above": []}, "max_frame": 0}
        group = {"seq": 1, "trajectories": [t.to_wire() for t in make_group("dup", 0, 4)]}
        raw.send_multipart([b"HB", encode({"want": 4})])
        assert _recv(raw, b"CREDIT")["granted"] == 4
        raw.send_multipart([b"GROUP", encode(group)])
        raw.send_multipart([b"HB", encode({"want": 8})])
        assert _recv(raw, b"CREDIT")["granted"] == 8
        raw.send_multipart([b"GROUP", encode(group)])  # the same ids again, as after a reconnect
        wait_until(lambda: server.stats()["queue/duplicates"] == 4, 60, "the copies counted")
        stats = server.stats()
        assert stats["queue/received"] == 4 and stats["queue/depth"] == 4
        end = time.monotonic() + 0.3
        while raw.poll(max(1, int((end - time.monotonic()) * 1000))):
            kind, payload = raw.recv_multipart()
            assert not (kind == b"CREDIT" and decode(payload)["acks"]), "acknowledged before the commit"
        assert len(server.get_groups(4, timeout=60)) == 1  # consumed and committed at once (ack=True)
        assert sorted(_recv(raw, b"CREDIT")["acks"]) == [f"dup-0-{j}" for j in range(4)]
        with pytest.raises(QueueTimeout):
            server.get_groups(1, timeout=0.3)
        raw.close(0)


def test_unacknowledged_room_is_held_until_ack(loop):
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=4, **FAST) as server:
        client = TrajectoryQueueClient(server.address, producer_id="a", **FAST)
        loop.run(client.connect(60))
        loop.run(client.put_group(make_group("a", 0, 4)))
        batch = server.get_groups(4, timeout=5, ack=False)
        second = loop.submit(client.put_group(make_group("a", 1, 4)))
        time.sleep(0.5)
        assert not second.done() and client.unacked == 8 and server.stats()["queue/unacked"] == 4
        server.ack(t.id for g in batch for t in g)
        second.result(5)
        wait_until(lambda: client.unacked == 4, 60, "the first group acknowledged")
        with pytest.raises(ValueError, match="a-0-0"):
            server.ack(["a-0-0"])
        loop.run(client.close())


def test_consumed_ids_are_acknowledged_to_their_producer_only_when_committed(loop):
    """The producer keeps what the trainer consumed until a checkpoint commits it: a re-sent copy
    (the producer reconnected) is dropped, and acknowledged with the rest at the commit."""
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, **FAST) as server:
        client = TrajectoryQueueClient(server.address, producer_id="a", **FAST)
        loop.run(client.connect(60))
        loop.run(client.put_group(make_group("a", 0, 4)))
        ids = [t.id for g in server.get_groups(4, timeout=5, ack=False) for t in g]
        server.ack(ids, commit=False)
        loop.run(client.put_group(make_group("a", 1, 4)))  # room was freed at once
        time.sleep(0.5)
        assert client.unacked == 8  # nothing acknowledged to the producer yet
        server.commit(ids)
        wait_until(lambda: client.unacked == 4, 60, "the committed group acknowledged")
        loop.run(client.close())


def rebind(addr, **kw) -> TrajectoryQueueServer:
    """A new server on a just-closed server's address (zmq releases the port in the background)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return TrajectoryQueueServer(addr, **kw)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_producer_resends_unacknowledged_groups_to_a_restarted_trainer(loop):
    first = TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, **FAST)
    addr = first.address
    client = TrajectoryQueueClient(addr, producer_id="r", **FAST)
    loop.run(client.connect(60))
    for k in range(2):
        loop.run(client.put_group(make_group("r", k, 4)))
    wait_until(lambda: first.stats()["queue/depth"] == 8, 60, "both groups buffered")
    first.close()  # the trainer dies without consuming anything
    with rebind(addr, capacity=8, **FAST) as second:
        groups = drain(second, 8, 8)
        assert [t.id for g in groups for t in g] == [f"r-{k}-{j}" for k in range(2) for j in range(4)]
        wait_until(lambda: client.unacked == 0, 60, "acks after the re-send")
        assert client.stats()["queue/sessions"] == 2 and client.stats()["queue/resent"] == 8
        loop.run(client.put_group(make_group("r", 2, 4)))
        assert second.get_groups(4, timeout=60)[0][0].id == "r-2-0"
        loop.run(client.close())


def test_a_silent_trainer_raises_peer_timeout(loop):
    server = TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=4, heartbeat_s=0.1, peer_timeout_s=0.6)
    client = TrajectoryQueueClient(server.address, heartbeat_s=0.1, peer_timeout_s=0.6)
    loop.run(client.connect(60))
    loop.run(client.put_group(make_group("s", 0, 4)))
    server.close()

    async def read_controls():
        async for _ in client.controls():
            pass

    with pytest.raises(PeerTimeoutError, match=r"silent for .*\(peer_timeout_s=0\.6\)"):  # its timeout, not a hang
        loop.run(client.put_group(make_group("s", 1, 4)), timeout=60)
    with pytest.raises(PeerTimeoutError):
        loop.run(read_controls(), timeout=60)
    loop.run(client.close())


def test_a_silent_producer_is_dropped_and_its_credits_freed(loop):
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=4, heartbeat_s=0.1, peer_timeout_s=1.0) as server:
        raw = _raw_producer(server, "mute")
        _recv(raw, b"WELCOME")
        raw.send_multipart([b"HB", encode({"want": 4})])
        assert _recv(raw, b"CREDIT")["granted"] == 4  # then it goes silent, holding all the room
        client = TrajectoryQueueClient(server.address, producer_id="live", heartbeat_s=0.1, peer_timeout_s=5)
        loop.run(client.connect(60))
        put = loop.submit(client.put_group(make_group("live", 0, 4)))
        time.sleep(0.5)
        assert not put.done() and server.stats()["queue/lost_producers"] == 0
        wait_until(lambda: server.stats()["queue/lost_producers"] == 1, 60, "the silent producer dropped")
        put.result(5)
        assert server.stats()["queue/producers"] == 1
        assert server.get_groups(4, timeout=60)[0][0].id == "live-0-0"
        loop.run(client.close())
        raw.close(0)


def test_put_group_refuses_bad_groups_before_sending(loop):
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=4, **FAST) as server:
        client = TrajectoryQueueClient(server.address, producer_id="b", **FAST)
        loop.run(client.connect(60))
        group = make_group("b", 0, 4)
        with pytest.raises(ValueError, match="non-empty"):
            loop.run(client.put_group([]))
        with pytest.raises(ValueError, match="repeat"):
            loop.run(client.put_group([group[0], group[0]]))
        with pytest.raises(ValueError, match="capacity 4"):
            loop.run(client.put_group(make_group("b", 1, 5)))
        bad = dataclasses.replace(group[0], info={"tags": {"x"}})
        with pytest.raises(TypeError, match="set"):
            loop.run(client.put_group([bad]))
        assert client.unacked == 0
        loop.run(client.put_group(group))
        assert [t.id for t in server.get_groups(4, timeout=60)[0]] == [t.id for t in group]
        assert server.stats()["queue/received"] == 4
        loop.run(client.close())


# --------------------------------------------------------------------------- weights replayed to a joining side
class _RecordingPublisher:
    """A WeightPublisher that records the versions it publishes (the replay decision is under test here)."""

    def __init__(self):
        self.versions: list[int] = []

    def publish(self, weights, version):
        self.versions.append(version)
        return None


class _Policy:
    policy_version = 0

    def weights(self):
        return {}


def test_weights_are_replayed_to_a_side_that_joined_after_the_publish_and_to_no_other(loop):
    from async_rl.trainer.versions import VersionReplay

    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, **FAST) as server:
        publisher, policy = _RecordingPublisher(), _Policy()
        versions = VersionReplay(server, publisher, policy)
        first = TrajectoryQueueClient(server.address, producer_id="first", **FAST)
        loop.run(first.connect(60))
        wait_until(lambda: server.stats()["queue/sessions"] == 1, 60, "the first session counted")
        policy.policy_version = 1  # trained before any check saw the side that was there from the start
        versions.publish()
        versions.check()
        assert publisher.versions == [1]  # it got version 1 with everyone else: no replay (with dist: a collective)
        second = TrajectoryQueueClient(server.address, producer_id="second", **FAST)
        loop.run(second.connect(60))
        wait_until(lambda: server.stats()["queue/sessions"] == 2, 60, "the second session counted")
        versions.check()
        versions.check()
        assert publisher.versions == [1, 1]  # joined after version 1 went out: replayed to, once
        for client in (first, second):
            loop.run(client.close())
