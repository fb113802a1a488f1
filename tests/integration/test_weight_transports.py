"""Weight transports end to end: trainer-side publisher -> rollout-side receiver -> real engine servers.

zmq: a version streams as buckets over a real trajectory queue (ROUTER/DEALER on loopback)
into a staged file that a served engine loads: its weights are then bit-identical to the
trainer's. While it streams into a slow receiver, the bytes the trainer has sent and the
rollout side has not acknowledged (everything the rollout side can hold, wherever) stay
within one bucket; a stalled rollout side fails the publish at the deadline, and one that
leaves mid-stream does not hold the trainer up. disk: `/update_weights_from_disk` swaps
a version's directory (or a checkpoint directory of shards) in from a memory map, refuses
a version going backwards or a file path (SGLang loads directories) and keeps the old
weights on any error. dist: a gloo group between the publisher (rank 0) and two served engines,
driven through SGLang's routes (begin, one flattened bucket per request, end): both get
bit-identical weights, a second version reuses the group, a server that never joins fails
the update at the deadline with a clear error (the old weights stay), and the next version
forms a fresh group that every server joins again. A trainer written for SGLang (one
broadcast per tensor, `load_format` None) works too, and a version going backwards is refused.
A process that exits holding dist groups (trainer and server side) drops them, their threads
ended, before the interpreter finalizes (left to it, the process may abort after a good run).
"""

import asyncio
import os
import queue as thread_queue
import subprocess
import sys
import threading
import time

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from async_rl.config import EngineConfig, ModelConfig
from async_rl.engine.client import HttpGenerationClient
from async_rl.models import build_tiny_tokenizer, load_model
from async_rl.transport.client import TrajectoryQueueClient
from async_rl.transport.queue import TrajectoryQueueServer
from async_rl.types import SamplingParams
from async_rl.weight_sync.disk import DiskWeightPublisher
from async_rl.weight_sync import group as weight_group
from async_rl.weight_sync.dist_publisher import DistWeightPublisher
from async_rl.weight_sync.dist_receiver import DistWeightReceiver
from async_rl.weight_sync.staging import WeightSyncError
from async_rl.weight_sync.zmq_buckets import ZmqWeightPublisher, ZmqWeightReceiver
from async_rl.launch.serve import BackgroundServer

ALPHABET = "0123456789+= "


def _model(seed: int):
    tok = build_tiny_tokenizer(ALPHABET)
    return load_model(ModelConfig(dtype="float32", tiny_alphabet=ALPHABET), seed=seed, tokenizer=tok), tok


def _trained(seed: int) -> dict[str, torch.Tensor]:
    model, _ = _model(0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.state_dict()


def _assert_identical(engine, state: dict[str, torch.Tensor]) -> None:
    served = engine.engine.model.state_dict()
    assert set(served) == set(state)
    for name, t in state.items():
        assert torch.equal(served[name], t), name


@pytest.fixture(scope="module")
def servers():
    torch.set_num_threads(1)
    bgs = []
    for seed in (1, 2):
        model, tok = _model(seed)
        bgs.append(BackgroundServer.for_model(model, tok, EngineConfig(kv_cache_mb=4, block_size=8),
                                              model_name="tiny"))
    urls = [bg.start() for bg in bgs]
    yield list(zip(urls, [bg.engine for bg in bgs]))
    for bg in bgs:
        bg.stop()


def test_zmq_buckets_over_the_trajectory_queue_into_a_served_engine(servers, tmp_path):
    url, engine = servers[0]
    state = _trained(seed=10)
    trainer_queue = TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, heartbeat_s=0.5, peer_timeout_s=10)

    async def rollout_side():
        client = TrajectoryQueueClient(trainer_queue.address, heartbeat_s=0.5, peer_timeout_s=10)
        receiver = ZmqWeightReceiver(tmp_path / "rollout", keep_last=2).attach(client)
        http = HttpGenerationClient(url)
        await client.connect(10)
        version = engine.weight_version + 1
        publisher = ZmqWeightPublisher(trainer_queue.broadcast, bucket_bytes=10_000, deadline_s=30)

        def publish():  # the trainer: stream, then broadcast the commit
            trainer_queue.broadcast(publisher.publish(state, version))

        thread = threading.Thread(target=publish)
        thread.start()
        controls = client.controls()
        commit = await asyncio.wait_for(controls.__anext__(), 30)  # buckets never reach the control stream
        thread.join(30)
        assert commit["kind"] == "weights" and commit["num_buckets"] == publisher.stats["sync/buckets"] > 10
        path = await receiver.prepare(commit)
        await receiver.load(http, path, version)
        out = await http.generate([3, 4, 5], SamplingParams(max_new_tokens=4, temperature=0.0))
        await http.close()
        await client.close()
        return version, out

    try:
        version, out = asyncio.run(rollout_side())
    finally:
        trainer_queue.close()
    _assert_identical(engine, state)
    assert engine.weight_version == version and out.output_versions == [version] * 4


def _queue_pair():
    server = TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8, heartbeat_s=0.5, peer_timeout_s=10)
    return server, TrajectoryQueueClient(server.address, heartbeat_s=0.5, peer_timeout_s=10)


def test_zmq_rollout_side_holds_at_most_one_bucket_while_a_version_streams(servers, tmp_path):
    url, engine = servers[0]
    state = _trained(seed=11)
    bucket = 32 << 10  # the tiny model is ~300 KB: ten buckets, forty 8 KB chunks
    trainer_queue, client = _queue_pair()
    receiver = ZmqWeightReceiver(tmp_path / "rollout", keep_last=2)
    held, window = [], []

    def slow_disk(msg):  # 5 ms a message: without flow control the trainer would be the whole model ahead
        time.sleep(0.005)
        window.append(trainer_queue.stats()["queue/bulk_inflight_bytes"])  # sent, not yet acknowledged
        held.append(client.stats()["queue/bulk_held_bytes"])  # taken off the socket, not yet released
        return receiver.handle(msg)

    async def rollout_side():
        for kind in ("weights_manifest", "weights_bucket"):
            client.on_control(kind, slow_disk)
        http = HttpGenerationClient(url)
        await client.connect(10)
        version = engine.weight_version + 1
        publisher = ZmqWeightPublisher(trainer_queue.broadcast, bucket_bytes=bucket, deadline_s=30)
        thread = threading.Thread(target=lambda: trainer_queue.broadcast(publisher.publish(state, version)))
        thread.start()
        commit = await asyncio.wait_for(client.controls().__anext__(), 30)
        thread.join(30)
        await receiver.load(http, await receiver.prepare(commit), version)
        await http.close()
        await client.close()
        return version, publisher.stats

    try:
        version, stats = asyncio.run(rollout_side())
        peak = trainer_queue.stats()["queue/bulk_inflight_peak_bytes"]
    finally:
        trainer_queue.close()
    assert stats["sync/bytes"] > 8 * bucket
    assert max(window) <= peak <= bucket  # the bound holds the whole time
    assert max(window) > 2 * (bucket // 4)  # and the window is used: several chunks in flight at once
    assert max(held) <= bucket // 4  # this side's Python holds one chunk at a time
    _assert_identical(engine, state)
    assert engine.weight_version == version


def _stalling(client):
    """The client takes the manifest, then stalls on the first chunk until `release` is set."""
    stalled, release = threading.Event(), threading.Event()

    def stuck(msg):
        stalled.set()
        release.wait(30)

    client.on_control("weights_manifest", lambda msg: None)
    client.on_control("weights_bucket", stuck)
    return stalled, release


def test_zmq_stalled_rollout_side_fails_the_publish_at_the_deadline(tmp_path):
    trainer_queue, client = _queue_pair()
    stalled, release = _stalling(client)

    async def rollout_side():
        await client.connect(10)
        publisher = ZmqWeightPublisher(trainer_queue.broadcast, bucket_bytes=32 << 10, deadline_s=2)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"weights v1: bucket \d+ not sent within "
                                                  r"weight_sync.deadline_s=2s \(is the rollout side reading\?\)"):
            await asyncio.to_thread(publisher.publish, _trained(seed=12), 1)
        took = time.monotonic() - t0
        release.set()
        await client.close()
        return took

    try:
        took = asyncio.run(rollout_side())
        peak = trainer_queue.stats()["queue/bulk_inflight_peak_bytes"]
    finally:
        release.set()
        trainer_queue.close()
    assert stalled.is_set() and took > 1.5 and peak <= 32 << 10  # it waited for the deadline (the error names it)


def test_zmq_rollout_side_leaving_mid_stream_does_not_hold_the_trainer(tmp_path):
    trainer_queue, client = _queue_pair()
    stalled, release = _stalling(client)

    async def rollout_side():
        await client.connect(10)
        publisher = ZmqWeightPublisher(trainer_queue.broadcast, bucket_bytes=32 << 10, deadline_s=60)
        t0 = time.monotonic()
        publishing = asyncio.ensure_future(asyncio.to_thread(publisher.publish, _trained(seed=13), 1))
        await asyncio.to_thread(stalled.wait, 10)
        await client.close()  # BYE: the trainer stops counting on this producer
        commit = await asyncio.wait_for(publishing, 20)
        return commit, time.monotonic() - t0

    try:
        commit, took = asyncio.run(rollout_side())
    finally:
        release.set()
        trainer_queue.close()
    assert commit["version"] == 1 and took < 20  # done long before weight_sync.deadline_s


def test_update_weights_from_disk_swaps_in_place_and_refuses_going_backwards(servers, tmp_path):
    url, engine = servers[1]
    state = _trained(seed=50)
    version = engine.weight_version + 1
    path = DiskWeightPublisher(tmp_path / "w", keep_last=2).publish(state, version)["path"]
    shards = tmp_path / "hf_checkpoint"  # a directory of safetensors files, as Hugging Face saves one
    shards.mkdir()
    sharded = _trained(seed=51)
    names = sorted(n for n in sharded if n != "lm_head.weight")
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: sharded[n].contiguous() for n in part}, str(shards / f"model-0000{i + 1}-of-00002.safetensors"))
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"not a safetensors file at all")

    async def drive():
        http = HttpGenerationClient(url)
        body = await http.update_weights_from_disk(path, version)
        assert body["weight_version"] == version and body["engine/update_load_s"] >= 0
        _assert_identical(engine, state)
        for bad, older, error in ((path, version, f"weight_version: {version} is not newer than the version in use"),
                                  (path, version - 1, "a version going backwards is refused"),
                                  (str(garbage), version + 1, "model_path: cannot load"),
                                  (str(tmp_path / "nope"), version + 1, "model_path: .* does not exist"),
                                  (str(shards / "model-00001-of-00002.safetensors"), version + 1, "is a file")):
            with pytest.raises(ValueError, match=error):
                await http.update_weights_from_disk(bad, older)
            _assert_identical(engine, state)  # the old weights stay
            assert engine.weight_version == version
        await http.update_weights_from_disk(str(shards), version + 1)
        await http.close()

    asyncio.run(drive())
    _assert_identical(engine, sharded)
    assert engine.weight_version == version + 1


# --------------------------------------------------------------------------- dist
def _dist_update(publisher, receiver, urls, state, version):
    """Run the trainer's publish in a thread and the rollout side's prepare/load per server; return the
    publisher's exception (or None) and the per-server results."""
    announced: thread_queue.Queue = thread_queue.Queue()
    publisher.send = announced.put
    errors: list[BaseException] = []

    def trainer():
        try:
            publisher.publish(state, version)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=trainer)
    thread.start()

    async def rollout():
        msg = await asyncio.to_thread(announced.get, True, 30)
        prepared = await receiver.prepare(msg)
        clients = [HttpGenerationClient(u) for u in urls]
        try:
            return await asyncio.gather(*(receiver.load(c, prepared, version) for c in clients),
                                        return_exceptions=True)
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    results = asyncio.run(rollout())
    thread.join(60)
    assert not thread.is_alive()
    return (errors[0] if errors else None), results


def test_dist_gloo_delivers_bit_identical_weights_to_two_servers(servers):
    (url1, e1), (url2, e2) = servers
    publisher = DistWeightPublisher(None, world_size=3, bucket_bytes=20_000, deadline_s=20)
    receiver = DistWeightReceiver(deadline_s=20)
    for seed in (20, 21):  # the second version reuses the group formed by the first
        version = max(e1.weight_version, e2.weight_version) + 1
        state = _trained(seed)
        error, results = _dist_update(publisher, receiver, [url1, url2], state, version)
        assert error is None and results == [None, None]
        for engine in (e1, e2):
            _assert_identical(engine, state)
            assert engine.weight_version == version
    assert publisher.generation == 1 and publisher.stats["sync/buckets"] > 5


def test_dist_missing_server_fails_at_the_deadline_then_the_group_reforms(servers):
    (url1, e1), (url2, e2) = servers
    receiver = DistWeightReceiver(deadline_s=3)
    publisher = DistWeightPublisher(None, world_size=3, bucket_bytes=1 << 20, deadline_s=3)
    before = {k: v.clone() for k, v in e1.engine.model.state_dict().items()}
    version = max(e1.weight_version, e2.weight_version) + 1
    error, results = _dist_update(publisher, receiver, [url1], _trained(30), version)  # server 2 is "fenced"
    assert isinstance(error, WeightSyncError) and "weight_sync.deadline_s=3s" in str(error)  # its deadline, no hang
    assert isinstance(results[0], ValueError) and "could not join" in str(results[0])
    _assert_identical(e1, before)  # the old weights stay
    # the server comes back: the next version forms a fresh group and both servers join it
    state = _trained(31)
    receiver.deadline_s = publisher.deadline_s = 20
    error, results = _dist_update(publisher, receiver, [url1, url2], state, version + 1)
    assert error is None and results == [None, None] and publisher.generation == 2
    _assert_identical(e1, state)
    _assert_identical(e2, state)


def test_sglang_style_trainer_per_tensor_broadcast_and_bad_requests(servers):
    url, engine = servers[0]
    state = _trained(40)
    names = list(state)[:-1] if "lm_head.weight" not in state else [n for n in state if n != "lm_head.weight"]
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    version = engine.weight_version + 1

    async def drive():
        http = HttpGenerationClient(url)
        group_box = {}
        maker = threading.Thread(target=lambda: group_box.update(
            g=weight_group.new_group("gloo", store, f"sg{id(store)}", 0, 2, 20)))
        maker.start()
        name = f"sg{id(store)}"
        await http.init_weights_update_group("127.0.0.1", store.port, 1, 2, name, "gloo", timeout_s=20)
        maker.join(20)
        group = group_box["g"]

        def broadcast_each():
            for n in names:
                group.broadcast(state[n].contiguous(), 0).wait()

        sender = threading.Thread(target=broadcast_each)
        sender.start()
        await http.begin_weight_update()  # SGLang 0.5.23 refuses the update outside this session
        body = await http.update_weights_from_distributed(
            names, [str(state[n].dtype) for n in names], [list(state[n].shape) for n in names], name, version)
        sender.join(20)
        assert body["weight_version"] == version
        with pytest.raises(ValueError, match="weight_version: 1 is not newer"):
            await http.update_weights_from_distributed(names[:1], ["float32"], [[1]], name, 1)
        with pytest.raises(ValueError, match=r"dtypes\[0\]: dtype 'complex64' cannot travel"):
            await http.update_weights_from_distributed(names[:1], ["complex64"], [[1]], name, version + 1)
        with pytest.raises(ValueError, match="group_name: 'nope' is not initialised"):
            await http.update_weights_from_distributed(names[:1], ["float32"], [[1]], "nope", version + 1)
        await http.end_weight_update()
        with pytest.raises(ValueError, match="must run between begin_weight_update"):
            await http.update_weights_from_distributed(names[:1], ["float32"], [[1]], name, version + 1)
        assert (await http.destroy_weights_update_group(name))["success"]
        weight_group.close(group)
        await http.close()

    asyncio.run(drive())
    _assert_identical(engine, state)


HOLDS_GROUPS_AT_EXIT = r"""
import atexit, os, sys, threading
sys.path.insert(0, os.getcwd())

def gloo_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)

atexit.register(lambda: print("at finalization:", gloo_threads(), flush=True))  # registered first: runs last
import torch
from async_rl.weight_sync.dist_publisher import DistWeightPublisher
from async_rl.weight_sync.dist_server import DistWeightGroups

announced = []
publisher = DistWeightPublisher(announced.append, world_size=2, bucket_bytes=1 << 20, deadline_s=20)
state = {"w": torch.arange(6, dtype=torch.float32)}
thread = threading.Thread(target=publisher.publish, args=(state, 1))
thread.start()
while not announced:
    threading.Event().wait(0.01)
msg = announced[0]
g = msg["group"]
server = DistWeightGroups("cpu")
server.init("127.0.0.1", g["master_port"], 1, 2, g["group_name"], "gloo", 20)
got = server.receive(g["group_name"], msg["names"], msg["dtypes"], msg["shapes"], "flattened_bucket")
thread.join()
assert torch.equal(got[0][1], state["w"])
print("while held:", gloo_threads(), flush=True)
"""


def test_a_process_holding_dist_groups_drops_them_before_the_interpreter_finalizes():
    """Trainer and server side both hold a live gloo group when the script ends: each holder's close runs
    at exit (weight_sync.group.close_at_exit) and the groups' threads are gone before finalization."""
    out = subprocess.run([sys.executable, "-c", HOLDS_GROUPS_AT_EXIT], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parents[2]), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(": ") for line in out.stdout.splitlines())
    assert int(lines["while held"]) > 0  # the probe sees the groups' threads
    assert lines["at finalization"] == "0", out.stdout
