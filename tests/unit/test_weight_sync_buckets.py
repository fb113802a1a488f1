"""Streamed weights: buckets of a version's byte layout, staged into a version directory and checked on the way.

A version streamed through the zmq publisher into the receiver (here without a socket: the
publisher's `send` hands each message, its parts attached, to the receiver) becomes a
directory (`vNNNNNN/model.safetensors`) that loads into a fresh model with identical outputs, whatever the bucket
size; a bucket (or a chunk of one) that is truncated, corrupted, repeated, out of order or
missing, a manifest that goes backwards or does not hold together rejects its version with
one error naming the problem, and nothing is left behind.
"""

import asyncio

import pytest
import torch

from async_rl.config import ModelConfig
from async_rl.models import build_tiny_tokenizer, load_model
from async_rl.weight_sync.disk import load_weights, weights_version
from async_rl.weight_sync.layout import WeightLayout, crc32
from async_rl.weight_sync.staging import BucketError, StagedFile, WeightsSuperseded, WeightSyncError, map_weights
from async_rl.weight_sync.versions import WEIGHTS_FILE, superseded, version_dir
from async_rl.weight_sync.zmq_buckets import ZmqWeightPublisher, ZmqWeightReceiver, chunk_bytes_for

ALPHABET = "0123456789+= "


@pytest.fixture(scope="module")
def trained():
    tok = build_tiny_tokenizer(ALPHABET)
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=ALPHABET), seed=0, tokenizer=tok)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def _fresh():
    tok = build_tiny_tokenizer(ALPHABET)
    return load_model(ModelConfig(dtype="float32", tiny_alphabet=ALPHABET), seed=5, tokenizer=tok)


def _logits(model):
    with torch.no_grad():
        return model(input_ids=torch.tensor([[3, 4, 5, 6, 7, 8]])).logits


def _stream(state, version, bucket_bytes, tmp_path, receiver=None, tamper=None):
    """Publish through ZmqWeightPublisher into a receiver; `tamper(msg)` may change or drop (None) a message."""
    receiver = receiver or ZmqWeightReceiver(tmp_path / "rollout", keep_last=2)
    sent = []

    def send(control, wait_s, parts, window_bytes):
        assert wait_s > 0 and window_bytes == bucket_bytes  # the flow-control window is one bucket
        sent.append(control["kind"])
        msg = {**control, "parts": list(parts)}
        msg = tamper(msg) if tamper else msg
        if msg is not None:
            receiver.handle(msg)

    commit = ZmqWeightPublisher(send, bucket_bytes, deadline_s=30).publish(state, version)
    return receiver, commit, sent


@pytest.mark.parametrize("bucket_bytes", [1000, 4096, 1 << 20])
def test_streamed_version_loads_into_a_fresh_model_with_identical_outputs(trained, tmp_path, bucket_bytes):
    receiver, commit, sent = _stream(trained.state_dict(), 3, bucket_bytes, tmp_path)
    layout, _ = WeightLayout.from_state_dict(trained.state_dict(), version=3, bucket_bytes=bucket_bytes,
                                             chunk_bytes=chunk_bytes_for(bucket_bytes))
    chunks = [c for i in range(len(layout.buckets)) for c in layout.chunks(i)]
    assert sent == ["weights_manifest"] + ["weights_bucket"] * len(chunks)  # the manifest first
    assert commit == {"kind": "weights", "version": 3, "transport": "zmq", "num_buckets": len(layout.buckets)}
    assert all(end - start <= bucket_bytes for start, end in layout.buckets)
    assert [lo for lo, _ in chunks] == [0] + [hi for _, hi in chunks[:-1]] and chunks[-1][1] == layout.data_len
    assert all(hi - lo <= chunk_bytes_for(bucket_bytes) for lo, hi in chunks)
    path = asyncio.run(receiver.prepare(commit))
    assert weights_version(path) == 3
    fresh = _fresh()
    fresh.load_state_dict(load_weights(path), strict=True)  # tied names restored from the metadata
    assert torch.equal(_logits(fresh), _logits(trained))
    mapped = map_weights(path)  # the engine's reader: views of a memory map, same bytes
    assert set(mapped) == set(trained.state_dict())
    assert all(torch.equal(mapped[k], v) for k, v in trained.state_dict().items())
    assert not list((tmp_path / "rollout").glob(".*partial"))


def test_dtypes_and_views_survive_bucket_boundaries(tmp_path):
    base = torch.arange(24, dtype=torch.float32)
    state = {"a": base[:5], "b": base[5:], "bf": torch.randn(7, 3).to(torch.bfloat16), "i": torch.arange(9),
             "mask": torch.tensor([True, False, True]), "t": torch.randn(4, 6).t(), "scalar": torch.tensor(2.5),
             "empty": torch.zeros(0, 4)}
    receiver, commit, _ = _stream(state, 0, 7, tmp_path)
    back = map_weights(asyncio.run(receiver.prepare(commit)))
    for k, v in state.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def _bucket_tamper(index, change):
    def tamper(msg):
        if msg["kind"] == "weights_bucket" and msg["index"] == index:
            return change(dict(msg))
        return msg
    return tamper


@pytest.mark.parametrize("change, error", [
    (lambda m: {**m, "parts": [p[:-3] for p in m["parts"]]}, "bucket 2 is truncated or oversized"),
    (lambda m: {**m, "parts": [p.copy() for p in m["parts"]][:-1] + [m["parts"][-1].copy() ^ 1]},
     "bucket 2 is corrupted"),
    (lambda m: None, r"truncated: \d+ of \d+ buckets arrived \(missing \[2\]\)"),
    (lambda m: {**m, "index": 999}, "bucket index 999 out of range"),
    (lambda m: {**m, "index": 1}, "bucket 1 arrived twice"),
    (lambda m: {k: v for k, v in m.items() if k != "crc32"}, "crc32: missing"),
])
def test_bad_bucket_rejects_the_version_with_one_clear_error(trained, tmp_path, change, error):
    receiver, commit, _ = _stream(trained.state_dict(), 4, 4096, tmp_path, tamper=_bucket_tamper(2, change))
    with pytest.raises(WeightSyncError, match=error):
        asyncio.run(receiver.prepare(commit))
    assert not list((tmp_path / "rollout").iterdir())  # no file, partial or whole: the old weights stay
    # the next version streams fine
    receiver, commit, _ = _stream(trained.state_dict(), 5, 4096, tmp_path, receiver=receiver)
    assert weights_version(asyncio.run(receiver.prepare(commit))) == 5


def test_version_going_backwards_is_rejected(trained, tmp_path):
    receiver, commit, _ = _stream(trained.state_dict(), 7, 1 << 20, tmp_path)
    asyncio.run(receiver.prepare(commit))
    receiver, old, _ = _stream(trained.state_dict(), 6, 1 << 20, tmp_path, receiver=receiver)
    with pytest.raises(WeightSyncError, match=r"manifest.version: 6 is not newer than the version already accepted \(7\)"):
        asyncio.run(receiver.prepare(old))
    publisher = ZmqWeightPublisher(lambda c, w, **kw: None, 1 << 20, deadline_s=5)
    publisher.publish({"w": torch.ones(2)}, 3)
    publisher.publish({"w": torch.ones(2)}, 3)  # the same version again: a replay for a side that joined
    with pytest.raises(WeightSyncError, match="version: 2 is older than the last published"):
        publisher.publish({"w": torch.ones(2)}, 2)


def test_a_replayed_version_the_receiver_holds_is_skipped(trained, tmp_path):
    receiver, commit, _ = _stream(trained.state_dict(), 4, 1 << 20, tmp_path)
    first = asyncio.run(receiver.prepare(commit))
    receiver, again, _ = _stream(trained.state_dict(), 4, 1 << 20, tmp_path, receiver=receiver)
    assert asyncio.run(receiver.prepare(again)) == first  # nothing staged twice, no error sent back


def test_manifest_that_does_not_hold_together_is_rejected(trained, tmp_path):
    def tamper(msg):
        return {**msg, "num_buckets": msg["num_buckets"] + 1} if msg["kind"] == "weights_manifest" else msg

    receiver, commit, _ = _stream(trained.state_dict(), 1, 4096, tmp_path, tamper=tamper)
    with pytest.raises(WeightSyncError, match="manifest.num_buckets"):
        asyncio.run(receiver.prepare(commit))

    def bad_dtype(msg):
        return {**msg, "dtypes": ["complex64"] + msg["dtypes"][1:]} if msg["kind"] == "weights_manifest" else msg

    receiver, commit, _ = _stream(trained.state_dict(), 2, 4096, tmp_path, tamper=bad_dtype)
    with pytest.raises(WeightSyncError, match=r"dtypes\[0\]: dtype 'complex64' cannot travel"):
        asyncio.run(receiver.prepare(commit))


def test_commit_without_any_bucket_and_a_superseded_version(trained, tmp_path):
    receiver = ZmqWeightReceiver(tmp_path, keep_last=2)
    with pytest.raises(WeightSyncError, match="no manifest or bucket"):
        asyncio.run(receiver.prepare({"kind": "weights", "version": 1}))
    # v2 stops after its manifest and one bucket; v3 arrives whole: v2 is reported truncated, v3 loads
    stop_after = {"n": 0}

    def cut(msg):
        stop_after["n"] += 1
        return msg if stop_after["n"] <= 2 else None

    _stream(trained.state_dict(), 2, 4096, tmp_path, receiver=receiver, tamper=cut)
    _, commit3, _ = _stream(trained.state_dict(), 3, 4096, tmp_path, receiver=receiver)
    with pytest.raises(WeightsSuperseded, match="v2: truncated: superseded by v3"):  # skipped, not fatal
        asyncio.run(receiver.prepare({"kind": "weights", "version": 2}))
    assert weights_version(asyncio.run(receiver.prepare(commit3))) == 3
    # v4 and v5 complete before v4's commit is handled: with keep_last=1 v4's file is pruned behind v5
    receiver.keep_last = 1
    _, commit4, _ = _stream(trained.state_dict(), 4, 4096, tmp_path, receiver=receiver)
    _, commit5, _ = _stream(trained.state_dict(), 5, 4096, tmp_path, receiver=receiver)
    with pytest.raises(WeightsSuperseded, match="v4: superseded by v5"):
        asyncio.run(receiver.prepare(commit4))
    path5 = asyncio.run(receiver.prepare(commit5))
    assert weights_version(path5) == 5 and not receiver.superseded(path5, 5)
    assert receiver.superseded(str(version_dir(tmp_path, 4)), 4)  # gone, and v5 is beside it


def test_a_version_gone_is_superseded_only_with_a_newer_version_beside_it(tmp_path):
    for v in (3, 5):
        version_dir(tmp_path, v).mkdir()
        (version_dir(tmp_path, v) / WEIGHTS_FILE).write_bytes(b"x")
    assert not superseded(version_dir(tmp_path, 3), 3)  # still there
    assert superseded(version_dir(tmp_path, 2), 2) and superseded(version_dir(tmp_path, 4), 4)
    assert not superseded(version_dir(tmp_path, 6), 6)  # nothing newer: missing, not superseded
    assert not superseded(version_dir(tmp_path / "elsewhere", 1), 1)  # a directory this side does not see
    (tmp_path / ".v000007.partial").mkdir()  # v7 being written over v6's old file
    version_dir(tmp_path, 6).mkdir()  # v6's directory, its weights file already taken over
    assert superseded(version_dir(tmp_path, 6), 6)
    (tmp_path / "v000009.replaced").mkdir()  # not a version: nothing newer than v6 but v7
    assert not superseded(version_dir(tmp_path, 8), 8)


def test_publisher_deadline_names_the_config_key():
    def never(control, wait_s, **kw):
        raise TimeoutError

    with pytest.raises(WeightSyncError, match=r"manifest not sent within weight_sync.deadline_s=2s"):
        ZmqWeightPublisher(never, 1 << 20, deadline_s=2).publish({"w": torch.ones(3)}, 1)


def test_staged_file_checks_each_bucket(tmp_path):
    layout, tensors = WeightLayout.from_state_dict({"w": torch.arange(10, dtype=torch.int64)}, version=1,
                                                   bucket_bytes=32)
    stage = StagedFile(tmp_path / "v1.safetensors", layout)
    parts = layout.read(tensors, *layout.buckets[0])
    stage.write(0, parts, crc32(parts))
    with pytest.raises(BucketError, match="truncated: 1 of 3 buckets arrived"):
        stage.finish()
    assert not list(tmp_path.iterdir())


def test_chunks_of_a_bucket_must_arrive_whole_and_in_order(trained, tmp_path):
    """4096-byte buckets travel as 1024-byte chunks: a lost, reordered or short chunk names the bucket."""
    assert chunk_bytes_for(4096) == 1024 and chunk_bytes_for(128 << 20) == 16 << 20 and chunk_bytes_for(1) == 1

    def drop_second_chunk_of_bucket_1(msg):
        return None if msg["kind"] == "weights_bucket" and (msg["index"], msg["offset"]) == (1, 1024) else msg

    receiver, commit, _ = _stream(trained.state_dict(), 1, 4096, tmp_path, tamper=drop_second_chunk_of_bucket_1)
    with pytest.raises(WeightSyncError, match=r"bucket 1: a chunk at byte 2048 arrived, expected byte 1024"):
        asyncio.run(receiver.prepare(commit))

    def short_last_chunk(msg):
        if msg["kind"] == "weights_bucket" and (msg["index"], msg["offset"]) == (3, 3072):
            return {**msg, "parts": [p[:-1] for p in msg["parts"]][:1]}
        return msg

    receiver, commit, _ = _stream(trained.state_dict(), 2, 4096, tmp_path, receiver=receiver, tamper=short_last_chunk)
    with pytest.raises(WeightSyncError, match=r"bucket 3 is truncated or oversized: \d+ bytes at byte 3072, "
                                              r"expected 1024"):
        asyncio.run(receiver.prepare(commit))
    assert not list((tmp_path / "rollout").iterdir())
    receiver, commit, _ = _stream(trained.state_dict(), 3, 4096, tmp_path, receiver=receiver)
    assert weights_version(asyncio.run(receiver.prepare(commit))) == 3


def test_rejection_reason_goes_back_to_the_sender(trained, tmp_path):
    """`handle` returns why a message was refused (the producer sends it back in BULK_ACK); it never raises."""
    receiver = ZmqWeightReceiver(tmp_path, keep_last=2)
    assert "has no manifest" in receiver.handle({"kind": "weights_bucket", "version": 9, "index": 0, "offset": 0,
                                                  "crc32": 0, "parts": []})
    assert receiver.handle({"kind": "weights_manifest", "version": 1, "names": [], "dtypes": [], "shapes": [],
                            "bucket_bytes": 8, "num_buckets": 0, "data_len": 0, "parts": []}) is None
    bad = receiver.handle({"kind": "weights_manifest", "version": 2, "names": ["w"], "dtypes": ["float32"],
                           "shapes": [[2]], "bucket_bytes": 8, "chunk_bytes": 9, "num_buckets": 1, "data_len": 8,
                           "parts": []})
    assert "chunk_bytes: must be an integer in [1, bucket_bytes=8], got 9" in bad
