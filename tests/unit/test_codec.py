"""The wire codec and message schema: round trips, zero-copy arrays, and rejection of malformed frames."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.transport import codec
from async_rl.transport.codec import DTYPES, decode, encode
from async_rl.transport.messages import (
    CONTROL, GROUP, PROTOCOL_VERSION, TO_ROLLOUT, TO_TRAINER, Control, Credit, Group, Hello, Welcome, pack, unpack)
from async_rl.types import Trajectory, WireFormatError


def make_traj(i: int = 0, r: int = 6, p: int = 4, seed: int = 0) -> Trajectory:
    rng = np.random.default_rng(seed + i)
    return Trajectory(
        id=f"t{i}", group_id="g0",
        prompt_ids=rng.integers(0, 1000, p).astype(np.int32),  # [P]
        response_ids=rng.integers(0, 1000, r).astype(np.int32),  # [R]
        loss_mask=(rng.random(r) < 0.7).astype(np.uint8),
        behav_logprobs=-rng.random(r).astype(np.float32),
        versions=rng.integers(-1, 5, r).astype(np.int32),
        reward=float(i), finish_reason="stop", num_interruptions=1,
        timings={"gen_s": 0.5}, info={"task": "arith", "n": 3})


def assert_same_traj(a: Trajectory, b: Trajectory) -> None:
    for name in ("prompt_ids", "response_ids", "loss_mask", "behav_logprobs", "versions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    assert (a.id, a.group_id, a.reward, a.finish_reason, a.num_interruptions, a.timings, a.info) == \
           (b.id, b.group_id, b.reward, b.finish_reason, b.num_interruptions, b.timings, b.info)


def frame(header_obj, tail: bytes = b"") -> bytes:
    """Build a frame by hand (to forge malformed ones)."""
    header = msgpack.packb(header_obj, use_bin_type=True)
    prefix = struct.pack("<4sQ", codec.MAGIC, len(header))
    return prefix + header + bytes(-(len(prefix) + len(header)) % 8) + tail


def array_ext(dtype: str, shape: list[int], offset: int) -> msgpack.ExtType:
    head = struct.pack(f"<QB{len(shape)}Q", offset, len(shape), *shape)
    return msgpack.ExtType(codec.EXT_ARRAY, head + dtype.encode())


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("r", [0, 1, 7, 4096])
def test_trajectory_round_trip(r):
    t = make_traj(r=r)
    back = Trajectory.from_wire(decode(encode(t.to_wire())))
    assert_same_traj(t, back)


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 0, 2), (2, 3, 4)])
def test_every_dtype_and_shape(name, shape):
    rng = np.random.default_rng(0)
    a = np.asarray(rng.random(shape) * 100).astype(name)  # [*shape]
    b = decode(encode({"a": a}))["a"]
    assert b.dtype == np.dtype(name) and b.shape == shape and np.array_equal(a, b, equal_nan=True)


def test_non_contiguous_and_big_endian_arrays():
    a = np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2]
    b = np.arange(5, dtype=">i4")
    out = decode(encode([a, b]))
    assert np.array_equal(out[0], a) and out[0].flags.c_contiguous
    assert np.array_equal(out[1], b) and out[1].dtype == np.dtype("<i4")


def test_nested_structures_scalars_and_blobs():
    obj = {"a": [1, -2.5, None, True, "x", {"b": [np.int64(7), np.float32(0.5)]}], "t": (1, 2),
           "small": b"xyz", "blob": bytes(range(256)) * 1000, "k": {3: "int key"}, "empty": {}}
    out = decode(encode(obj))
    assert out["a"][:5] == [1, -2.5, None, True, "x"] and out["a"][5] == {"b": [7, 0.5]}
    assert out["t"] == [1, 2] and out["small"] == b"xyz" and out["blob"] == obj["blob"]
    assert out["k"] == {3: "int key"} and out["empty"] == {}
    assert isinstance(out["blob"], bytes)


def test_big_array_is_a_zero_copy_view_of_the_frame():
    a = np.random.default_rng(0).random(4_000_000)  # [N] float64, 32 MB
    buf = bytearray(encode({"a": a}))
    b = decode(buf)["a"]
    assert np.array_equal(a, b)
    assert np.shares_memory(b, np.frombuffer(buf, np.uint8)) and b.flags.aligned
    assert not decode(bytes(buf))["a"].flags.writeable  # a view of read-only bytes stays read-only


def test_encode_refuses_what_is_not_data():
    with pytest.raises(TypeError, match="dtype"):
        encode({"a": np.array(["s"], dtype=object)})
    with pytest.raises(TypeError, match="complex"):
        encode(np.zeros(2, np.complex64))
    with pytest.raises(TypeError, match="set"):
        encode({1, 2})


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=False),
                  st.text(max_size=20), st.binary(max_size=40),
                  st.sampled_from(sorted(DTYPES)).flatmap(
                      lambda d: st.integers(0, 40).map(lambda n: (np.arange(n) % 7).astype(d))))
_tree = st.recursive(_leaf, lambda c: st.one_of(st.lists(c, max_size=4),
                                                st.dictionaries(st.text(max_size=8), c, max_size=4)), max_leaves=20)


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b and type(a) is type(b)


@settings(max_examples=150, deadline=None)
@given(_tree)
def test_property_round_trip(obj):
    assert _same(obj, decode(encode(obj)))


# --------------------------------------------------------------------------- malformed frames
def _rejects(data, *words: str) -> str:
    with pytest.raises(WireFormatError) as info:
        decode(data)
    msg = str(info.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


def test_rejects_what_is_not_a_frame():
    _rejects(b"", "shorter")
    _rejects(msgpack.packb({"a": 1}), "shorter")
    _rejects(msgpack.packb({"key": "a longer map"}), "bad magic")
    _rejects(b"ARW1" + struct.pack("<Q", 1 << 40) + b"\x80", "does not fit")
    _rejects(frame(None)[:12] + b"\xc1" + bytes(3), "malformed msgpack")  # 0xc1 is never valid msgpack


def test_every_truncation_is_rejected():
    data = encode({"t": make_traj().to_wire(), "blob": bytes(70_000)})
    for cut in list(range(0, 400)) + list(range(len(data) - 64, len(data))):
        with pytest.raises(WireFormatError):
            decode(data[:cut])
    _rejects(data + b"\0", "trailing")


def test_rejects_bad_arrays_naming_the_problem():
    _rejects(frame([array_ext("float32", [4], 0)], bytes(8)), "array float32[4]", "needs bytes 0..16", "has 8")
    _rejects(frame([array_ext("float32", [2], 0)], bytes(16)), "trailing")
    _rejects(frame([array_ext("object", [1], 0)], bytes(8)), "dtype 'object' is not allowed")
    _rejects(frame([array_ext("complex64", [1], 0)], bytes(8)), "not allowed")
    _rejects(frame([array_ext("", [1], 0)], bytes(8)), "cannot hold 1 dims and a dtype")
    _rejects(frame([array_ext("int8", [1 << 50, 0], 0)]), "impossible size")
    _rejects(frame([array_ext("int8", [2], 3)], bytes(8)), "bad offset 3")
    _rejects(frame([msgpack.ExtType(codec.EXT_ARRAY, b"\x01")]), "array header", "too short")
    _rejects(frame([msgpack.ExtType(codec.EXT_ARRAY, struct.pack("<QB", 0, 200) + b"int8")]), "at most 32 dims")


def test_rejects_unknown_extensions_and_bad_blobs():
    _rejects(frame([msgpack.ExtType(9, b"")]), "unknown msgpack extension type 9")
    _rejects(frame([msgpack.ExtType(codec.EXT_BLOB, struct.pack("<QQ", 0, 100))], bytes(50)),
             "blob", "needs bytes 0..100")
    _rejects(frame([msgpack.ExtType(codec.EXT_BLOB, b"xy")]), "blob header")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_property_corrupted_frames_fail_only_with_wire_format_error(data):
    good = bytearray(encode({"t": make_traj().to_wire(), "n": [1, 2.0, "s"]}))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(good))
    except WireFormatError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_property_random_bytes_fail_only_with_wire_format_error(raw):
    for data in (raw, codec.MAGIC + struct.pack("<Q", len(raw)) + raw):
        try:
            decode(data)
        except WireFormatError:
            pass


# --------------------------------------------------------------------------- messages
def test_messages_round_trip_through_frames():
    group = Group(seq=3, trajectories=(make_traj(0), make_traj(1)))
    kind, payload = pack(group)
    back = unpack(kind, payload, TO_TRAINER)
    assert back.seq == 3 and len(back.trajectories) == 2
    for a, b in zip(group.trajectories, back.trajectories):
        assert_same_traj(a, b)
    ctl = {"kind": "weights", "version": 2, "path": "/w", "blob": bytes(200_000)}
    assert unpack(*pack(Control(body=ctl)), TO_ROLLOUT).body == ctl
    assert unpack(*pack(Credit(granted=8, acks=("a", "b"))), TO_ROLLOUT) == Credit(granted=8, acks=("a", "b"))
    assert unpack(*pack(Welcome(capacity=4)), TO_ROLLOUT) == Welcome(capacity=4)


def test_messages_are_validated_on_receipt():
    def bad(kind, body, accepted, *words):
        with pytest.raises(WireFormatError) as info:
            unpack(kind, encode(body), accepted)
        assert all(w in str(info.value) for w in words), str(info.value)

    good = make_traj().to_wire()
    bad(b"NOPE", {}, TO_TRAINER, "unknown message kind", "HELLO")
    bad(CONTROL, {"kind": "stop"}, TO_TRAINER, "unknown message kind")  # wrong direction
    bad(b"HELLO", {"producer_id": 3, "protocol": PROTOCOL_VERSION}, TO_TRAINER, "HELLO.producer_id", "expected str")
    bad(b"HELLO", {"producer_id": "p", "protocol": 99}, TO_TRAINER, "protocol mismatch", "version 2", "version 99")
    bad(GROUP, {"seq": 1, "trajectories": []}, TO_TRAINER, "at least one")
    bad(GROUP, {"seq": True, "trajectories": [good]}, TO_TRAINER, "GROUP.seq", "bool")
    bad(GROUP, {"seq": 1, "trajectories": [good, good]}, TO_TRAINER, "repeat")
    bad(GROUP, {"seq": 1, "trajectories": [{**good, "loss_mask": np.ones(2, np.uint8)}]}, TO_TRAINER,
        "GROUP.trajectories[0]", "loss_mask")
    bad(GROUP, {"seq": 1, "trajectories": [{**good, "versions": good["versions"].astype(np.int64)}]}, TO_TRAINER,
        "versions", "int32")
    bad(b"HB", {"want": -1}, TO_TRAINER, "HB.want", ">= 0")
    bad(b"CREDIT", {"granted": 1, "acks": [1]}, TO_ROLLOUT, "CREDIT.acks")
    bad(CONTROL, {"version": 1}, TO_ROLLOUT, "CONTROL.kind", "missing")
    bad(CONTROL, [1, 2], TO_ROLLOUT, "CONTROL", "expected a map")
    with pytest.raises(WireFormatError, match="HELLO.producer_id"):
        Hello.from_wire({"producer_id": "", "protocol": PROTOCOL_VERSION})
