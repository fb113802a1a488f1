"""The `dist` transport against SGLang's own code (sglang 0.5.23), wherever it imports.

- The rollout side's request bodies for the dist routes, in order (init, begin, one update per
  bucket, end), validated by SGLang's request models (`srt/managers/io_struct.py`) the way its
  HTTP server validates them (pydantic over msgspec structs: an int `weight_version` is refused).
- The weight group: SGLang's `init_custom_process_group` (`srt/utils/common.py`) on the server
  side, in child processes as two TP ranks of one server (`rank_offset + tp_rank`), our
  publisher (rank 0) on the other, over gloo; a multi-bucket model in bf16 arrives bit-identical,
  each bucket received as SGLang receives a flattened bucket
  (`srt/model_executor/model_runner_components/weight_updater.py`,
  `_receive_bucketed_weights_from_distributed`). Where sglang does not import, the child runs a
  transcription of those functions, named in the child's source.
- Our packed buckets unpacked by SGLang's `FlattenedTensorBucket` (`srt/weight_sync/tensor_bucket.py`).
- A server rank that dies mid-version: the publish fails within the deadline, its group is
  aborted and unregistered, and the next publish forms a fresh group; the same version published
  again (a replay for a server that joined later) forms a fresh group too, which that server joins.

Tests that need SGLang's modules skip, saying so, only when sglang is not installed.
"""

import asyncio
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from torch.distributed import distributed_c10d as c10d

from async_rl.config import ModelConfig, TrainerConfig
from async_rl.engine.client import HttpGenerationClient
from async_rl.models import build_tiny_tokenizer, load_model
from async_rl.trainer.trainer import PPOTrainer
from async_rl.utils.weights import WeightSource
from async_rl.weight_sync import flat_bucket
from async_rl.weight_sync.dist_publisher import DistWeightPublisher
from async_rl.weight_sync.dist_receiver import DistWeightReceiver
from async_rl.weight_sync.staging import WeightSyncError
from tests import sglang_source

ROOT = Path(__file__).resolve().parents[2]
ALPHABET = "0123456789+= "


def sglang(module: str):
    """An sglang module as it imports on a CPU (tests/sglang_source.py: without the GPU stack)."""
    if sglang_source.source_dir() is None:
        pytest.skip(sglang_source.SKIP)
    return sglang_source.load(module)


def _trainer(seed: int = 0) -> PPOTrainer:
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=ALPHABET), seed=seed,
                       tokenizer=build_tiny_tokenizer(ALPHABET))
    return PPOTrainer(model, TrainerConfig(), temperature=1.0, max_staleness=1, seed=seed)


def _expected(trainer: PPOTrainer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    src = trainer.weights()
    return {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in
            ((n, src.get(n)) for n in src.names)}


# --------------------------------------------------------------------------- request bodies
def test_dist_request_bodies_pass_sglangs_request_models_in_session_order():
    if sglang_source.source_dir() is None:
        pytest.skip(sglang_source.SKIP)
    io = sglang_source.io_struct_models("InitWeightsUpdateGroupReqInput", "BeginWeightUpdateReqInput",
                                        "UpdateWeightsFromDistributedReqInput", "EndWeightUpdateReqInput")
    models = {"/init_weights_update_group": io["InitWeightsUpdateGroupReqInput"],
              "/begin_weight_update": io["BeginWeightUpdateReqInput"],
              "/update_weights_from_distributed": io["UpdateWeightsFromDistributedReqInput"],
              "/end_weight_update": io["EndWeightUpdateReqInput"]}
    calls: list[tuple[str, str, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"tp_size": 2})
        body = json.loads(request.content or b"{}")
        calls.append((str(request.url.host), request.url.path, body))
        return httpx.Response(200, json={"success": True, "message": "ok"})

    names, dtypes, shapes = _trainer().weights().specs(torch.bfloat16)
    buckets = flat_bucket.plan(dtypes, shapes, 20_000)
    assert len(buckets) > 3
    msg = {"kind": "weights", "version": 7, "transport": "dist", "names": names, "dtypes": dtypes, "shapes": shapes,
           "buckets": buckets, "group": {"master_address": "", "master_port": 1234, "world_size": 5,
                                         "group_name": "g", "backend": "gloo"}}

    async def drive():
        receiver = DistWeightReceiver(deadline_s=5, trainer_host="10.0.0.9")
        clients = [HttpGenerationClient(f"http://server{i}:1") for i in range(2)]
        for c in clients:
            c._http = httpx.AsyncClient(base_url=c.address, transport=httpx.MockTransport(handler))
        prepared = await receiver.prepare(msg)
        for c in clients:  # one after the other, so the order of calls per server is plain
            await receiver.load(c, prepared, 7)
            await c.close()

    asyncio.run(drive())
    for host in ("server0", "server1"):
        mine = [(path, body) for h, path, body in calls if h == host]
        assert [p for p, _ in mine] == (["/init_weights_update_group", "/begin_weight_update"]
                                        + ["/update_weights_from_distributed"] * len(buckets) + ["/end_weight_update"])
        for path, body in mine:
            sglang_source.validate(models[path], body)  # raises on a body SGLang's server would refuse (400)
        init, updates = mine[0][1], [b for p, b in mine if p == "/update_weights_from_distributed"]
        assert init["master_address"] == "10.0.0.9"  # the trainer bound a wildcard: the host we reached it at
        assert init["rank_offset"] == {"server0": 1, "server1": 3}[host]  # two TP ranks each
        assert [b["weight_version"] for b in updates] == [None] * (len(buckets) - 1) + ["7"]
        assert all(b["load_format"] == "flattened_bucket" for b in updates)
        assert [n for b in updates for n in b["names"]] == names  # each tensor in exactly one bucket


# --------------------------------------------------------------------------- the group, against SGLang's helper
SGLANG_SIDE = r'''
import json, sys, torch
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["root"])
from tests import sglang_source
try:  # SGLang's own functions: imported where they import, else compiled from the installed file's text
    FlattenedTensorBucket = sglang_source.load("sglang.srt.weight_sync.tensor_bucket").FlattenedTensorBucket
    init_custom_process_group = sglang_source.function(
        "srt/utils/common.py", "init_custom_process_group",
        {"torch": torch, "torch_release": tuple(int(x) for x in torch.__version__.split(".")[:2])})
    how = "sglang"
except (ImportError, AttributeError) as exc:
    how = f"transcription ({type(exc).__name__}: {exc})"
    FlattenedTensorBucket = None

    def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                                  store=None, group_name=None, pg_options=None, device_id=None):
        # sglang 0.5.23 srt/utils/common.py lines 2859-2927, the init_method branch as it runs
        from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                        default_pg_timeout, rendezvous)
        backend = Backend(backend)
        timeout = default_pg_timeout if timeout is None else timeout
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
        pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                          backend_options=pg_options, timeout=timeout, device_id=device_id)
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        return pg

g = cfg["group"]
# srt/model_executor/model_runner_components/weight_updater.py init_weights_update_group: rank_offset + tp_rank
pg = init_custom_process_group(backend=g["backend"], init_method=f"tcp://{g['master_address']}:{g['master_port']}",
                               world_size=g["world_size"], rank=cfg["rank_offset"] + cfg["tp_rank"],
                               group_name=g["group_name"])
out = {}
for a, b in cfg["buckets"]:
    names, dtypes, shapes = cfg["names"][a:b], cfg["dtypes"][a:b], cfg["shapes"][a:b]
    if FlattenedTensorBucket is not None:  # _receive_bucketed_weights_from_distributed, as SGLang runs it
        bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        tensors = bucket.reconstruct_tensors()
    else:  # its transcription: one uint8 tensor, each tensor a dtype view at its byte offset
        sizes = [torch.Size(s).numel() * getattr(torch, d).itemsize for d, s in zip(dtypes, shapes)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        torch.distributed.broadcast(flat, src=0, group=pg)
        tensors, at = [], 0
        for n, d, s, size in zip(names, dtypes, shapes, sizes):
            tensors.append((n, flat[at:at + size].view(getattr(torch, d)).reshape(s)))
            at += size
    out.update({n: t.clone() for n, t in tensors})
    if cfg.get("die_after") is not None and len(out) and a >= cfg["die_after"]:
        import os
        os._exit(3)
torch.save(out, cfg["out"])
print(how, flush=True)
# destroyed and dropped while the interpreter is whole, as our own holders do (weight_sync/group.py
# close_at_exit): a gloo group alive at finalization can abort the process (exit -6, "terminate called
# without an active exception"); SGLang's server holds its group for its whole life
torch.distributed.destroy_process_group(pg)
del pg
'''


def _sglang_rank(msg: dict, tp_rank: int, out: str, die_after: int | None = None) -> subprocess.Popen:
    cfg = {"root": str(ROOT), "group": msg["group"], "rank_offset": 1, "tp_rank": tp_rank, "names": msg["names"],
           "dtypes": msg["dtypes"], "shapes": msg["shapes"], "buckets": msg["buckets"], "out": out,
           "die_after": die_after}
    return subprocess.Popen([sys.executable, "-c", SGLANG_SIDE, json.dumps(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait(child: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The child's output once it exits; killed (never left behind) if it has not within `timeout`."""
    try:
        return child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


def _publish(publisher: DistWeightPublisher, weights, version: int):
    announced: list[dict] = []
    ready, errors = threading.Event(), []
    publisher.send = lambda m: (announced.append(m), ready.set())

    def run():
        try:
            publisher.publish(weights, version)
        except BaseException as exc:  # noqa: BLE001 -- reported to the test
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert ready.wait(30)
    return thread, announced, errors


def test_sglangs_own_group_helper_meets_our_publisher_and_gets_a_multi_bucket_model_bit_identical(tmp_path):
    trainer = _trainer(seed=3)
    publisher = DistWeightPublisher(None, world_size=3, bucket_bytes=20_000, deadline_s=60, dtype=torch.bfloat16)
    thread, announced, errors = _publish(publisher, trainer.weights(), 1)
    msg = announced[0]
    assert len(msg["buckets"]) > 5
    assert msg["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}  # tied: sent once
    assert "lm_head.weight" not in msg["names"]
    children = [_sglang_rank(msg, tp, str(tmp_path / f"tp{tp}.pt")) for tp in (0, 1)]
    outs = [_wait(c, 120) for c in children]
    thread.join(60)
    assert not errors and not thread.is_alive(), errors
    for child, (stdout, stderr) in zip(children, outs):
        assert child.returncode == 0, (stdout, stderr[-2000:])
        # where sglang is installed (make install), its own helper and bucket class ran, not the transcription
        assert stdout.strip() == "sglang" or sglang_source.source_dir() is None, stdout
    want = _expected(trainer, torch.bfloat16)
    for tp in (0, 1):
        got = torch.load(tmp_path / f"tp{tp}.pt")
        assert list(got) == list(want)
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    publisher.close()


def test_a_rank_that_dies_mid_version_fails_the_publish_within_the_deadline_and_the_group_is_aborted(tmp_path):
    trainer = _trainer(seed=4)
    deadline = 60.0  # a child that imports sglang takes a while to start on a busy machine
    publisher = DistWeightPublisher(None, world_size=2, bucket_bytes=20_000, deadline_s=deadline)
    thread, announced, errors = _publish(publisher, trainer.weights(), 1)
    msg = announced[0]
    name = msg["group"]["group_name"]
    child = _sglang_rank(msg, 0, str(tmp_path / "dead.pt"), die_after=msg["buckets"][2][0])
    _, stderr = _wait(child, 120)
    assert child.returncode == 3, stderr[-2000:]
    thread.join(deadline + 10)
    assert not thread.is_alive()  # a clean failure (the error names its deadline), not a hang
    assert len(errors) == 1 and isinstance(errors[0], WeightSyncError), errors
    assert "weight_sync.deadline_s=60s" in str(errors[0]) and "bucket" in str(errors[0])
    assert publisher._group is None and name not in c10d._world.pg_names.values()  # aborted and unregistered
    assert publisher.last_version == -1  # nothing was published
    # the next publish forms a fresh group, which a live rank joins
    thread, announced, errors = _publish(publisher, trainer.weights(), 2)
    assert announced[0]["group"]["group_name"] != name
    child = _sglang_rank(announced[0], 0, str(tmp_path / "live.pt"))
    _, stderr = _wait(child, 120)
    thread.join(60)
    assert child.returncode == 0 and not errors, stderr[-2000:]
    # version 2 again, for a server that joined after it went out (async_rl/trainer/versions.py VersionReplay): the group
    # of the first delivery is torn down and a fresh one formed, which the new server joins alone
    formed = announced[0]["group"]["group_name"]
    thread, announced, errors = _publish(publisher, trainer.weights(), 2)
    assert announced[0]["group"]["group_name"] not in (name, formed) and publisher.generation == 3
    child = _sglang_rank(announced[0], 0, str(tmp_path / "joined.pt"))
    _, stderr = _wait(child, 120)
    thread.join(60)
    assert child.returncode == 0 and not errors, stderr[-2000:]
    want = _expected(trainer, torch.float32)
    got = torch.load(tmp_path / "joined.pt")
    assert all(torch.equal(got[n], t) for n, t in want.items())
    publisher.close()


# --------------------------------------------------------------------------- the flattened bucket
def _mixed_source() -> WeightSource:
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3, 5, generator=g), "mask": torch.tensor([True, False, True]),
             "b": torch.randn(7, generator=g).to(torch.bfloat16), "ids": torch.arange(5, dtype=torch.int64),
             "c": torch.randn(4, 4, generator=g), "bytes": torch.arange(3, dtype=torch.uint8), "d": torch.randn(9)}
    return WeightSource.from_state_dict(state)


def test_buckets_are_dtype_aligned_bounded_and_cover_every_tensor_once():
    source = _mixed_source()
    names, dtypes, shapes = source.specs(torch.float16)
    for bucket_bytes in (1, 16, 40, 1 << 20):
        buckets = flat_bucket.plan(dtypes, shapes, bucket_bytes)
        assert [i for a, b in buckets for i in range(a, b)] == list(range(len(names)))
        for a, b in buckets:
            ranges, total = flat_bucket.offsets(dtypes[a:b], shapes[a:b])  # raises if one is unaligned
            assert b - a == 1 or total <= bucket_bytes


def test_our_packed_buckets_unpack_bit_identical_with_sglangs_flattened_tensor_bucket():
    FlattenedTensorBucket = sglang("sglang.srt.weight_sync.tensor_bucket").FlattenedTensorBucket
    source = _mixed_source()
    names, dtypes, shapes = source.specs(torch.bfloat16)
    for bucket_bytes in (16, 64, 1 << 20):
        for a, b in flat_bucket.plan(dtypes, shapes, bucket_bytes):
            flat = flat_bucket.pack(source, names[a:b], dtypes[a:b], shapes[a:b], "cpu")
            bucket = FlattenedTensorBucket.empty(names[a:b], dtypes[a:b], shapes[a:b], "cpu")  # refuses unaligned
            bucket.get_flattened_tensor().copy_(flat)  # what one broadcast delivers
            for (name, got), want_name in zip(bucket.reconstruct_tensors(), names[a:b]):
                want = source.wire(want_name, torch.bfloat16)
                assert name == want_name and got.dtype == want.dtype and torch.equal(got, want), name
