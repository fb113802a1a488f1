"""What the `dist` transport decides before anything starts: backend, dtype on the wire, addresses, ranks.

The GPU-only checks (NCCL between two GPUs under a deadline, a CUDA trainer and a CPU engine
over gloo, a CUDA engine receiving straight into its parameters) are `gpu`-marked at the end;
NCCL has never run in this project's CI.
"""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from async_rl.config import load_config
from async_rl.utils.weights import WeightSource
from async_rl.weight_sync.dist_publisher import DistWeightPublisher
from async_rl.weight_sync.dist_receiver import DistWeightReceiver, host_of
from async_rl.weight_sync.group import choose_backend
from async_rl.weight_sync.publishers import build_publisher, trainer_host, wire_dtype
from async_rl.weight_sync.staging import WeightSyncError

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str):
    return load_config("configs/debug_cpu.yaml", ["weight_sync.transport=dist", *overrides])


def test_nccl_only_when_both_ends_hold_weights_on_cuda():
    assert choose_backend("cuda", ["cuda", "cuda"]) == "nccl"
    assert choose_backend("cuda:1", ["cuda"]) == "nccl"
    assert choose_backend("cuda", ["cpu"]) == "gloo"  # NCCL cannot take the CPU engine's tensors
    assert choose_backend("cuda", ["cuda", "cpu"]) == "gloo"
    assert choose_backend("cpu", ["cuda"]) == "gloo"
    assert choose_backend(torch.device("cpu"), ["cpu"]) == "gloo"


def test_a_cpu_run_publishes_over_gloo_with_one_rank_per_tp_rank_of_each_server():
    pub = build_publisher(_cfg("trainer.device=cpu", "engine.device=cpu", "rollout.num_servers=3",
                               "engine.tp_size=2"), lambda m: None)
    assert isinstance(pub, DistWeightPublisher)
    assert pub.backend == "gloo" and pub.world_size == 1 + 3 * 2


def test_the_wire_dtype_is_the_engines_where_it_is_known_without_measuring():
    assert wire_dtype(_cfg("model.dtype=bfloat16")) == torch.bfloat16
    assert wire_dtype(_cfg("model.dtype=float32")) == torch.float32
    assert wire_dtype(_cfg("engine.backend=sglang")) == torch.bfloat16
    assert wire_dtype(_cfg("engine.device=cpu")) is None  # auto on a CPU measures: send fp32, lossless


@pytest.mark.parametrize("addr,announced", [("tcp://10.1.2.3:5555", "10.1.2.3"), ("tcp://*:5555", ""),
                                            ("tcp://0.0.0.0:5555", ""), ("tcp://[::]:5555", ""),
                                            ("tcp://[fe80::1]:5555", "fe80::1"), ("tcp://trainer-0:1", "trainer-0")])
def test_the_trainer_announces_its_bind_host_and_nothing_for_a_wildcard(addr, announced):
    assert trainer_host(_cfg(f"transport.addr={addr}")) == announced


def test_the_rollout_side_fills_a_wildcard_with_the_host_it_reached_the_trainer_at():
    msg = {"version": 1, "buckets": [], "names": [], "dtypes": [], "shapes": [],
           "group": {"master_address": "", "master_port": 1, "world_size": 2, "group_name": "g"}}
    assert host_of("tcp://gpu-node-7:5555") == "gpu-node-7"
    got = asyncio.run(DistWeightReceiver(5, trainer_host="gpu-node-7").prepare(msg))
    assert got["group"]["master_address"] == "gpu-node-7"
    got = asyncio.run(DistWeightReceiver(5, trainer_host="*").prepare({**msg, "version": 2}))
    assert got["group"]["master_address"] == "127.0.0.1"  # both sides local

    async def twice():
        receiver = DistWeightReceiver(5)
        await receiver.prepare({**msg, "version": 3})
        await receiver.prepare({**msg, "version": 3})

    with pytest.raises(WeightSyncError, match="not newer"):
        asyncio.run(twice())


def test_a_tied_embedding_travels_once_and_floating_tensors_take_the_wire_dtype():
    emb = torch.randn(8, 4)
    source = WeightSource.from_state_dict({"embed.weight": emb, "lm_head.weight": emb,
                                           "steps": torch.arange(3), "norm.weight": torch.ones(4)})
    names, dtypes, shapes = source.specs(torch.bfloat16)
    assert names == ["embed.weight", "steps", "norm.weight"] and source.aliases == {"lm_head.weight": "embed.weight"}
    assert dtypes == ["bfloat16", "int64", "bfloat16"]
    assert torch.equal(source.wire("embed.weight", torch.bfloat16), emb.to(torch.bfloat16))
    assert source.get("embed.weight").data_ptr() == emb.data_ptr()  # a view of the parameter, not a copy


# --------------------------------------------------------------------------- GPU only
PEER = r'''
import json, os, sys
from async_rl.weight_sync.dist_server import DistWeightGroups
cfg = json.loads(sys.argv[1])
groups = DistWeightGroups(cfg["device"])
g = cfg["group"]
groups.init(g["master_address"], g["master_port"], 1, 2, g["group_name"], g["backend"], 60)
for i, (a, b) in enumerate(cfg["buckets"]):
    if cfg["die_at"] == i:
        os._exit(3)
    groups.receive(g["group_name"], cfg["names"][a:b], cfg["dtypes"][a:b], cfg["shapes"][a:b], "flattened_bucket")
print("received", flush=True)
os._exit(0)
'''


def _publish_to_peer(backend: str, trainer_device: str, peer_device: str, die_at: int | None, deadline_s: float):
    weights = {f"w{i}": torch.randn(256, 256, device=trainer_device) for i in range(8)}
    pub = DistWeightPublisher(None, world_size=2, bucket_bytes=256 * 256 * 4, deadline_s=deadline_s,
                              backend=backend, device=trainer_device)
    peers, errors = [], []

    def send(msg):
        cfg = {k: msg[k] for k in ("group", "names", "dtypes", "shapes", "buckets")}
        peers.append(subprocess.Popen([sys.executable, "-c", PEER, json.dumps({**cfg, "device": peer_device,
                                                                                  "die_at": die_at})],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))

    pub.send = send
    thread = threading.Thread(target=lambda: _catch(errors, pub.publish, weights, 1))
    thread.start()
    thread.join(deadline_s + 60)
    try:
        out, err = peers[0].communicate(timeout=60)
    finally:
        peers[0].kill()  # never left behind (a no-op once it has exited)
    return not thread.is_alive(), errors, peers[0].returncode, out + err, pub


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001
        errors.append(exc)


@pytest.mark.gpu
def test_a_cuda_trainer_reaches_a_cpu_engine_over_gloo():
    done, errors, rc, out, _ = _publish_to_peer(choose_backend("cuda", ["cpu"]), "cuda", "cpu", None, 60)
    assert done and not errors and rc == 0, out[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank (two ranks, two GPUs)")
def test_nccl_a_dead_peer_fails_the_publish_within_the_deadline_and_the_group_is_aborted():
    done, errors, rc, out, pub = _publish_to_peer("nccl", "cuda:0", "cuda:1", 3, 20)
    assert done and rc == 3, out[-2000:]  # no hang, no watchdog SIGABRT of this process
    assert len(errors) == 1 and isinstance(errors[0], WeightSyncError) and pub._group is None


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank (two ranks, two GPUs)")
def test_nccl_delivers_a_version_between_two_gpus():
    done, errors, rc, out, _ = _publish_to_peer("nccl", "cuda:0", "cuda:1", None, 60)
    assert done and not errors and rc == 0 and "received" in out, out[-2000:]


@pytest.mark.gpu
def test_a_cpu_trainer_reaches_a_cuda_engine_which_receives_on_the_gpu():
    done, errors, rc, out, _ = _publish_to_peer(choose_backend("cpu", ["cuda"]), "cpu", "cuda", None, 60)
    assert done and not errors and rc == 0 and "received" in out, out[-2000:]


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_an_nccl_peer_that_never_joins_fails_the_broadcast_instead_of_hanging():
    """The non-blocking init used to be asked for by an environment variable set only while the group object
    was built; torch reads it at the first collective, after it was gone, so the first broadcast to a server
    that never joined waited NCCL's 30 minutes. Rank 0 of a world of 2 alone, in a fresh process (the init
    timeout is read once per process): the broadcast fails within the deadline (pytest's timeout is the hang)."""
    code = textwrap.dedent("""
        import datetime, torch, torch.distributed as dist
        from async_rl.utils.ports import free_port
        from async_rl.weight_sync.group import broadcast, new_group
        from async_rl.weight_sync.staging import WeightSyncError
        store = dist.TCPStore("127.0.0.1", free_port("127.0.0.1"), 2, True, timeout=datetime.timedelta(seconds=20))
        group = new_group("nccl", store, "never-joined", 0, 2, timeout_s=10.0)
        try:
            broadcast(group, torch.ones(4, device="cuda:0"), "weights v1", 10.0)
        except WeightSyncError as exc:
            print("failed as it should:", exc)
        """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "failed as it should" in res.stdout, res.stdout + res.stderr[-2000:]
