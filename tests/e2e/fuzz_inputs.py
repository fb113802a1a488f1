"""Bad input for the fuzz test of a live run (test_fuzz_run.py): trajectory-queue frames and HTTP requests.

`queue_frames(n, seed)` gives n multipart messages as a DEALER sends them ([kind, payload], or a
wrong number of frames), each with the outcome the trainer's queue must count: `malformed` (it
does not decode into a message the trainer accepts) or `unknown_peer` (a well-formed message from
a producer that never said HELLO). They start from valid HELLO / GROUP / HB / BYE / BULK_ACK
messages built with the codec, then flip bits, truncate, pad, swap kinds and payloads, change
field types, lie in headers (lengths, dtypes, shapes, extension types), nest deeply, or are
plain random bytes. A mutant that still decodes as a valid HELLO is drawn again: it would
register a producer, which is not bad input but a (n unauthenticated) peer joining.

`http_requests(n, seed, vocab_size, max_context)` gives n requests the generation server must
answer with 4xx: bad JSON, wrong types, huge numbers, unknown fields, bad paths, wrong methods,
invalid token ids, negative or too many new tokens, bad control-route bodies. None of them is
valid, so none may pause generation, abort requests or load weights.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable

import msgpack
import numpy as np

from async_rl.transport.codec import MAGIC, decode, encode
from async_rl.transport.messages import (
    HELLO, PROTOCOL_VERSION, TO_TRAINER, BulkAck, Bye, Group, Heartbeat, Hello, hello_protocol, pack, unpack)
from async_rl.types import Trajectory, WireFormatError


# --------------------------------------------------------------------------- queue frames
def _trajectory(i: int) -> Trajectory:
    r = 3
    return Trajectory(id=f"fuzz-{i}", group_id="fuzz-g", prompt_ids=np.arange(4, dtype=np.int32),  # [P]
                      response_ids=np.arange(r, dtype=np.int32), loss_mask=np.ones(r, np.uint8),  # [R]
                      behav_logprobs=np.full(r, -0.5, np.float32), versions=np.zeros(r, np.int32),
                      reward=1.0, finish_reason="stop", info={"sample_id": "s"})


SEEDS = [pack(Hello(producer_id="fuzz", session=1)), pack(Group(seq=1, trajectories=(_trajectory(0), _trajectory(1)))),
         pack(Heartbeat(want=8, unacked=2)), pack(Bye(reason="bye")), pack(BulkAck(seq=3, error=""))]
KINDS = [kind for kind, _ in SEEDS]
ODD_VALUES = [None, True, -1, 2**64 - 1, -2**63, 1.5e308, float("nan"), "", "x" * 300, b"\0" * 10, [], {}, [1, 2],
              {"a": 1}]


def outcome(frames: list[bytes]) -> str:
    """What the trainer's queue does with `frames` from a producer that never said HELLO."""
    if len(frames) != 2:
        return "malformed"
    try:
        msg = unpack(frames[0], frames[1], TO_TRAINER)
    except WireFormatError:
        if frames[0] == HELLO and _other_version(frames[1]):
            return "refused"  # a HELLO of another protocol version: counted malformed, answered REFUSED
        return "malformed"
    return "hello" if isinstance(msg, Hello) else "bye" if isinstance(msg, Bye) else "unknown_peer"


def _other_version(payload: bytes) -> bool:
    try:
        theirs = hello_protocol(decode(payload))
    except WireFormatError:
        return False
    return isinstance(theirs, int) and not isinstance(theirs, bool) and theirs != PROTOCOL_VERSION


def _flip(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def _mutate(rng: random.Random, obj):
    """One structural change somewhere in a decoded message: a field dropped, added, retyped, resized."""
    if isinstance(obj, dict) and obj:
        obj, key = dict(obj), rng.choice(sorted(obj))
        op = rng.randrange(5)
        if op == 0:
            del obj[key]
        elif op == 1:
            obj[key] = rng.choice(ODD_VALUES)
        elif op == 2:
            obj[rng.choice(["extra", "", "seq", 7])] = rng.random()
        elif op == 3:  # an array of the wrong dtype or shape, or a large one
            obj[key] = np.zeros(rng.choice([(0,), (3,), (2, 2), (70_000,)]), rng.choice(["float64", "int8", "bool"]))
        else:
            obj[key] = _mutate(rng, obj[key])
        return obj
    if isinstance(obj, list) and obj:
        obj = list(obj)
        i = rng.randrange(len(obj))
        obj[i] = _mutate(rng, obj[i])
        return obj + obj[:1] if rng.random() < 0.3 else obj  # a repeated trajectory id
    if isinstance(obj, np.ndarray):
        return rng.choice([obj[:-1], obj.astype("int64"), obj.reshape(1, -1), np.concatenate([obj, obj]),
                           obj.astype("float16")])
    return rng.choice([None, 0, -5, "", "z", 3.0, [obj], {"k": obj}])


def _lying_header(rng: random.Random) -> bytes:
    """A frame whose codec header lies: lengths past the end, impossible shapes, bad dtypes or extensions."""
    op = rng.randrange(5)
    if op == 0:
        return MAGIC + struct.pack("<Q", rng.choice([2**63, 2**64 - 1, 10**9, 17])) + b"\x80" * rng.randint(0, 16)
    if op == 1:
        dims = rng.choice([(2**47,), (2**40, 2**40), (1,) * 33, (3,), ()])
        dtype = rng.choice([b"float32", b"object", b"complex128", b"<U8", b"", b"float32" * 100])
        head = struct.pack("<QB", rng.choice([0, 3, 2**63]), len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        header = msgpack.packb({"seq": 1, "trajectories": [{"response_ids": msgpack.ExtType(1, head + dtype)}]})
    elif op == 2:
        header = msgpack.packb({"want": msgpack.ExtType(rng.choice([0, 2, 3, 99]), struct.pack("<QQ", 0, 2**62))})
    elif op == 3:  # deep nesting, or msgpack lengths pointing far past the end
        header = rng.choice([b"\x91" * rng.randint(100, 5000) + b"\xc0", b"\xdb\xff\xff\xff\xff",
                             b"\xc6\x7f\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\x7f\xff\xff\xff"])
    else:  # map keys that are lists (unhashable) or not strings
        header = b"\x81\x91\x01\x02" if rng.random() < 0.5 else msgpack.packb({1: 2, b"k": 3})
    return MAGIC + struct.pack("<Q", len(header)) + header + bytes(-(12 + len(header)) % 8)


def _one_frame(rng: random.Random) -> list[bytes]:
    kind, payload = rng.choice(SEEDS)
    op = rng.randrange(10)
    if op == 0:  # random bytes, 1..4 frames
        return [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(1, 4))]
    if op == 1:
        return [rng.choice(KINDS), _flip(rng, payload)]
    if op == 2:
        return [rng.choice(KINDS), payload[:rng.randrange(len(payload))]]
    if op == 3:
        return [rng.choice(KINDS), payload + rng.randbytes(rng.randint(1, 16))]
    if op == 4:  # another kind's payload
        return [rng.choice(KINDS), rng.choice(SEEDS)[1]]
    if op == 5:
        try:
            return [kind, encode(_mutate(rng, decode(payload)))]
        except TypeError:  # the codec refuses to encode the mutant (e.g. a float16 array): send it cut short
            return [kind, payload[:5]]
    if op == 6:
        return [kind, _lying_header(rng)]
    if op == 7:  # wrong frame counts
        return rng.choice([[kind], [kind, payload, payload], [kind, payload, b"", b"x"], [b""]])
    if op == 8:  # a kind that does not exist
        return [_flip(rng, kind) if rng.random() < 0.5 else kind.lower(), payload]
    return [kind, msgpack.packb(decode(payload) if kind != b"GROUP" else {"seq": 1})]  # msgpack without the codec


def queue_frames(n: int, seed: int) -> list[tuple[list[bytes], str]]:
    """n (frames, outcome) pairs; outcome is "malformed", "refused" (a HELLO of another protocol version),
    "unknown_peer" or "bye" (an unknown peer's BYE)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        frames = _one_frame(rng)
        what = outcome(frames)
        if what != "hello":
            out.append((frames, what))
    return out


# --------------------------------------------------------------------------- HTTP requests
Request = tuple[str, str, bytes | None]  # method, path, body (JSON or not)
JSON_ROUTES = ["/generate", "/v1/chat/completions", "/v1/completions", "/pause_generation", "/continue_generation",
               "/update_weights_from_disk", "/abort_request", "/init_weights_update_group",
               "/update_weights_from_distributed", "/destroy_weights_update_group"]


def _post(path: str, body) -> Request:
    return "POST", path, json.dumps(body).encode()


def _bad_json(rng: random.Random, vocab: int, ctx: int) -> Request:
    body = rng.choice([b"{", b'{"input_ids": [1, 2', b"\xff\xfe\xfd", b"{'input_ids': [1]}", b'{"a": 1}}', b"nul",
                       b'{"input_ids": [1] "x": 2}', b"[" * 5000 + b"]" * 5000, rng.randbytes(rng.randint(1, 64))])
    return "POST", rng.choice(JSON_ROUTES), body


def _wrong_type(rng: random.Random, vocab: int, ctx: int) -> Request:
    key, bad = rng.choice([("input_ids", "123"), ("input_ids", 5), ("input_ids", [1.5]), ("input_ids", [True]),
                           ("input_ids", [[1]]), ("input_ids", [None]), ("input_ids", ["1"]), ("sampling_params", []),
                           ("sampling_params", "x"), ("rid", 5), ("stream", []), ("return_logprob", "maybe"),
                           ("top_logprobs_num", "2")])
    if rng.random() < 0.5:
        return _post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, key: bad})
    sp = rng.choice(["max_new_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "ignore_eos", "min_p"])
    bad = rng.choice({"stop": [[5], "", [""]], "ignore_eos": ["1", [1], {}, 1]}.get(sp, ["1", [1], {}, True]))
    return _post("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, sp: bad}})


def _huge_number(rng: random.Random, vocab: int, ctx: int) -> Request:
    big = rng.choice([10**30, 2**63, 2**64, -(2**63) - 1, 10**400])
    field = rng.choice(["max_new_tokens", "n", "top_logprobs", "seed", "temperature"])
    sp = {"max_new_tokens": 1, field: big if field != "temperature" else 1e308}
    return _post("/generate", rng.choice([{"input_ids": [1], "sampling_params": sp}, {"input_ids": [big]}]))


def _unknown_field(rng: random.Random, vocab: int, ctx: int) -> Request:
    name = rng.choice(["bogus", "inputs", "max_tokens_", "x" * 100, "\u00e9"])
    return rng.choice([_post("/generate", {"input_ids": [1], name: 1}),
                       _post("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, name: 1}}),
                       _post("/v1/chat/completions", {"messages": [{"role": "user", "content": "1+1="}], name: 1}),
                       _post("/v1/completions", {"prompt": [1], "max_tokens": 1, name: 1}),
                       _post("/pause_generation", {name: "abort"}), _post("/continue_generation", {name: True}),
                       _post("/abort_request", {name: True})])


def _bad_tokens(rng: random.Random, vocab: int, ctx: int) -> Request:
    ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
    ids.insert(rng.randint(0, len(ids)), rng.choice([-1, vocab, vocab + rng.randrange(10**6), 2**31, -(2**31)]))
    body = rng.choice([{"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}, {"input_ids": []},
                       {"input_ids": [1] * (ctx + rng.randint(0, 100))}, {}])
    return rng.choice([_post("/generate", body), _post("/v1/completions", {"prompt": ids, "max_tokens": 1})])


def _bad_lengths(rng: random.Random, vocab: int, ctx: int) -> Request:
    n = rng.choice([-1, -(10**9), ctx, ctx + rng.randrange(10**6)])
    return rng.choice([_post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": n}}),
                       _post("/generate", {"input_ids": [1],
                                           "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}}),
                       _post("/v1/completions", {"prompt": [1], "max_tokens": rng.choice([0, n])}),
                       _post("/v1/chat/completions", {"messages": [{"role": "user", "content": "2"}], "max_tokens": n}),
                       _post("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "n": 0}})])


def _bad_path(rng: random.Random, vocab: int, ctx: int) -> Request:
    path = rng.choice(["/generat", "/v1/chat", "/v2/completions", "/generate/x", "/%00", "/..%2f..%2fetc%2fpasswd",
                       "/" + "a" * rng.randint(1, 4000), "/metrics/x", "/" + rng.randbytes(8).hex()])
    return rng.choice(["GET", "POST", "PUT", "DELETE"]), path, b"{}"


def _wrong_method(rng: random.Random, vocab: int, ctx: int) -> Request:
    return rng.choice([("GET", "/generate"), ("DELETE", "/generate"), ("PUT", "/v1/chat/completions"),
                       ("GET", "/pause_generation"), ("PATCH", "/continue_generation"), ("POST", "/health"),
                       ("DELETE", "/metrics"), ("GET", "/update_weights_from_disk"), ("OPTIONS", "/abort_request"),
                       ("GET", "/v1/completions"), ("POST", "/get_model_info")]) + (None,)


def _bad_control(rng: random.Random, vocab: int, ctx: int) -> Request:
    return rng.choice([
        _post("/pause_generation", {"mode": rng.choice(["x", "", 1, None, ["abort"]])}), _post("/pause_generation", []),
        _post("/continue_generation", {"torch_empty_cache": "maybe"}), _post("/update_weights_from_disk", {}),
        _post("/update_weights_from_disk", {"model_path": 5}),
        _post("/update_weights_from_disk", {"model_path": f"/nonexistent/{rng.randrange(10**6)}.safetensors"}),
        _post("/update_weights_from_disk", {"model_path": "/etc/hostname", "weight_version": 0}),
        _post("/abort_request", {}), _post("/abort_request", {"rid": 5}),
        _post("/abort_request", {"abort_all": "maybe"}),
        _post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "1"}),
        _post("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"],
                                                   "shapes": [[rng.choice([2**62, 10**20, -1])]]}),
        _post("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["x"], "shapes": [[1]]}),
        _post("/update_weights_from_distributed", {"names": ["a", "a"], "dtypes": ["float32"], "shapes": [[1]]}),
        _post("/destroy_weights_update_group", {"group_name": 5})])


def _bad_openai(rng: random.Random, vocab: int, ctx: int) -> Request:
    user = [{"role": "user", "content": "1+2="}]
    return rng.choice([
        _post("/v1/chat/completions", {"messages": rng.choice(["hi", [], [{}], [1], [{"role": 5, "content": "x"}],
                                                                [{"role": "user", "content": 5}]])}),
        _post("/v1/chat/completions", {"messages": user,
                                       rng.choice(["temperature", "top_p"]): rng.choice([-1, 1e308, "x"])}),
        _post("/v1/chat/completions", {"messages": user, "n": rng.choice([0, 10**9])}),
        _post("/v1/chat/completions", {"messages": user, "logprobs": True, "top_logprobs": rng.choice([-1, 21])}),
        _post("/v1/chat/completions", {"messages": user, "stop": [rng.choice([5, None])]}),
        _post("/v1/completions", {"prompt": rng.choice([[], [[]], 5, {}, "\ud800", ["\udfff"]])}),
        _post("/v1/completions", {"prompt": [1], "logprobs": rng.choice([-1, 21])}),
        _post("/v1/completions", {"prompt": [1], "echo": True}),
        _post("/generate", {"text": rng.choice(["\ud800", "a\udfffb"])}),
        _post("/generate", {"text": "1", "input_ids": [1]}),
        _post("/generate", {"input_ids": [1], rng.choice(["image_data", "lora_path"]): "x"}),
        _post("/generate", {"input_ids": [1], "sampling_params": {"regex": "a+"}})])


HTTP_CASES: list[Callable[[random.Random, int, int], Request]] = [
    _bad_json, _wrong_type, _huge_number, _unknown_field, _bad_tokens, _bad_lengths, _bad_path, _wrong_method,
    _bad_control, _bad_openai]


def http_requests(n: int, seed: int, vocab_size: int, max_context: int) -> list[Request]:
    rng = random.Random(seed)
    return [rng.choice(HTTP_CASES)(rng, vocab_size, max_context) for _ in range(n)]
