"""The message kinds of the trajectory queue, their wire forms, and their checks on receipt.

A message travels as two zmq frames, `[kind, codec.encode(msg.to_wire())]`. Rollout ->
trainer: HELLO, GROUP, HB (`Heartbeat`), BYE, BULK_ACK. Trainer -> rollout: WELCOME, CREDIT,
CONTROL, HB (`TrainerHeartbeat`), BULK, REFUSED (a HELLO of another protocol version: both
versions named on both sides, `protocol_mismatch`). `unpack` turns frames into a message of a kind the
receiving side accepts and raises `WireFormatError` naming the bad field otherwise.

BULK is the one message with more frames: `[BULK, header, data frame, ...]`, a CONTROL-like
map whose large payload (a weight bucket) follows as raw frames, sent zero-copy from the
sender's memory. Each BULK is answered by a BULK_ACK once handled; see `bulk.py` for the
byte window that this acknowledgement drives.

Credit counts are cumulative within a session (from one WELCOME to the next):
`granted` is every credit the trainer has granted the producer, and a producer's
`want` is the total it needs granted to send its next group (trajectories already
sent + the group's size). Absolute numbers make every CREDIT and heartbeat idempotent,
so a lost or repeated message never leaks or double-counts capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Union

from async_rl.transport.codec import decode, encode
from async_rl.types import Trajectory, WireFormatError
from async_rl.utils.prompts import PromptSet

PROTOCOL_VERSION = 2  # 2: WELCOME.max_frame, REFUSED
MAX_ID_CHARS = 200

HELLO, GROUP, HEARTBEAT, BYE = b"HELLO", b"GROUP", b"HB", b"BYE"
WELCOME, CREDIT, CONTROL = b"WELCOME", b"CREDIT", b"CONTROL"
BULK, BULK_ACK = b"BULK", b"BULK_ACK"
REFUSED = b"REFUSED"
MAX_ERROR_CHARS = 2000

_MISSING = object()


def _get(d: Any, key: str, kind: type | tuple[type, ...], where: str, default: Any = _MISSING) -> Any:
    """d[key], checked to be of `kind` (bool is never accepted as int)."""
    if not isinstance(d, dict):
        raise WireFormatError(f"{where}: expected a map, got {type(d).__name__}")
    if key not in d:
        if default is _MISSING:
            raise WireFormatError(f"{where}.{key}: missing")
        return default
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise WireFormatError(f"{where}.{key}: expected {'/'.join(k.__name__ for k in kinds)}, "
                              f"got {type(value).__name__}")
    return value


def protocol_mismatch(ours: int, theirs: Any, side: str) -> str:
    """The one error both sides give when their queue protocol versions differ."""
    other = "producer" if side == "trainer" else "trainer"
    return (f"queue protocol mismatch: this {side} speaks version {ours}, the {other} version {theirs!r}; "
            "run the same async_rl version on both sides")


def hello_protocol(payload: Any) -> Any:
    """The protocol version a HELLO's decoded payload states (None if it states none): read before the rest of
    the HELLO, whose shape may be another version's."""
    return payload.get("protocol") if isinstance(payload, dict) else None


def _count(d: Any, key: str, where: str, default: Any = _MISSING) -> int:
    value = _get(d, key, int, where, default)
    if value < 0:
        raise WireFormatError(f"{where}.{key}: must be >= 0, got {value}")
    return value


# --------------------------------------------------------------------------- rollout -> trainer
@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """A producer introduces itself and starts a new session (its credits restart at 0). `session`
    numbers its HELLOs; the WELCOME echoes it, so a producer can ignore answers to older ones."""

    KIND: ClassVar[bytes] = HELLO
    producer_id: str
    session: int = 0
    protocol: int = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        return {"producer_id": self.producer_id, "session": self.session, "protocol": self.protocol}

    @classmethod
    def from_wire(cls, d: Any) -> "Hello":
        pid = _get(d, "producer_id", str, "HELLO")
        if not 0 < len(pid) <= MAX_ID_CHARS:
            raise WireFormatError(f"HELLO.producer_id: must have 1..{MAX_ID_CHARS} characters, got {len(pid)}")
        protocol = _get(d, "protocol", int, "HELLO")
        if protocol != PROTOCOL_VERSION:
            raise WireFormatError(protocol_mismatch(PROTOCOL_VERSION, protocol, "trainer"))
        return cls(producer_id=pid, session=_count(d, "session", "HELLO", 0), protocol=protocol)


@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """One GRPO group, sent whole; `seq` numbers a producer's groups from 1."""

    KIND: ClassVar[bytes] = GROUP
    seq: int
    trajectories: tuple[Trajectory, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"seq": self.seq, "trajectories": [t.to_wire() for t in self.trajectories]}

    @classmethod
    def from_wire(cls, d: Any) -> "Group":
        seq = _count(d, "seq", "GROUP")
        wires = _get(d, "trajectories", list, "GROUP")
        if not wires:
            raise WireFormatError("GROUP.trajectories: a group needs at least one trajectory")
        trajs = []
        for i, w in enumerate(wires):
            try:
                trajs.append(Trajectory.from_wire(w))
            except WireFormatError as exc:
                raise WireFormatError(f"GROUP.trajectories[{i}]: {exc}") from None
            except (TypeError, ValueError) as exc:
                raise WireFormatError(f"GROUP.trajectories[{i}]: {type(exc).__name__}: {exc}") from None
        if len({t.id for t in trajs}) != len(trajs):
            raise WireFormatError("GROUP.trajectories: trajectory ids repeat within the group")
        return cls(seq=seq, trajectories=tuple(trajs))


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """Producer keep-alive; also states its demand (`want`, 0 when not waiting)."""

    KIND: ClassVar[bytes] = HEARTBEAT
    want: int = 0
    unacked: int = 0  # trajectories sent but not yet acknowledged (informational)

    def to_wire(self) -> dict[str, Any]:
        return {"want": self.want, "unacked": self.unacked}

    @classmethod
    def from_wire(cls, d: Any) -> "Heartbeat":
        return cls(want=_count(d, "want", "HB", 0), unacked=_count(d, "unacked", "HB", 0))


@dataclass(frozen=True, slots=True, kw_only=True)
class Bye:
    """A producer leaves; the trainer takes back the credits it still held."""

    KIND: ClassVar[bytes] = BYE
    reason: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def from_wire(cls, d: Any) -> "Bye":
        return cls(reason=_get(d, "reason", str, "BYE", ""))


# --------------------------------------------------------------------------- trainer -> rollout
@dataclass(frozen=True, slots=True, kw_only=True)
class Welcome:
    """Answer to HELLO: a new session starts with `granted` credits (cumulative from here).

    It also carries the trainer's accounting, so a side that (re)joins mid-run starts where the
    run is: `policy_version` (the weights it must load before generating) and `admitted`
    (trajectories the staleness bound already counts: trained batch slots + what is buffered)
    and `prompts`, the stream positions consumed, buffered or in training: the side generates
    every other position from the set's low-water mark on, none of those."""

    KIND: ClassVar[bytes] = WELCOME
    capacity: int
    granted: int = 0
    session: int = 0  # the HELLO's
    protocol: int = PROTOCOL_VERSION
    policy_version: int = 0
    admitted: int = 0
    run_id: str = ""  # the trainer's run (a producer's durable outbox belongs to one run)
    prompts: PromptSet = field(default_factory=PromptSet)
    max_frame: int = 0  # the largest GROUP frame the trainer takes (bytes; 0 = no limit): a bigger one cuts the link

    def to_wire(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "granted": self.granted, "session": self.session,
                "protocol": self.protocol, "policy_version": self.policy_version, "admitted": self.admitted,
                "run_id": self.run_id, "prompts": self.prompts.to_wire(), "max_frame": self.max_frame}

    @classmethod
    def from_wire(cls, d: Any) -> "Welcome":
        capacity = _count(d, "capacity", "WELCOME")
        if capacity < 1:
            raise WireFormatError("WELCOME.capacity: must be >= 1, got 0")
        return cls(capacity=capacity, granted=_count(d, "granted", "WELCOME"),
                   session=_count(d, "session", "WELCOME", 0), protocol=_get(d, "protocol", int, "WELCOME"),
                   policy_version=_count(d, "policy_version", "WELCOME", 0),
                   admitted=_count(d, "admitted", "WELCOME", 0), run_id=_get(d, "run_id", str, "WELCOME", ""),
                   prompts=_prompt_set(_get(d, "prompts", dict, "WELCOME", {}), "WELCOME.prompts"),
                   max_frame=_count(d, "max_frame", "WELCOME", 0))


def _prompt_set(d: dict[str, Any], where: str) -> PromptSet:
    try:
        return PromptSet.from_wire(d)
    except ValueError as exc:
        raise WireFormatError(f"{where}: {exc}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Credit:
    """Credits granted so far in this session, and ids of trajectories the trainer consumed (or dropped
    as duplicates): the producer may forget those."""

    KIND: ClassVar[bytes] = CREDIT
    granted: int
    acks: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"granted": self.granted, "acks": list(self.acks)}

    @classmethod
    def from_wire(cls, d: Any) -> "Credit":
        acks = _get(d, "acks", list, "CREDIT", [])
        if any(not isinstance(a, str) for a in acks):
            raise WireFormatError("CREDIT.acks: expected a list of trajectory id strings")
        return cls(granted=_count(d, "granted", "CREDIT"), acks=tuple(acks))


@dataclass(frozen=True, slots=True, kw_only=True)
class Control:
    """A map the trainer broadcasts, e.g. {"kind": "weights", "version": v, "path": p} or
    {"kind": "stop", "final_version": v}; values may include one large bytes blob."""

    KIND: ClassVar[bytes] = CONTROL
    body: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return self.body

    @classmethod
    def from_wire(cls, d: Any) -> "Control":
        kind = _get(d, "kind", str, "CONTROL")
        if not kind:
            raise WireFormatError("CONTROL.kind: must be a non-empty string")
        if any(not isinstance(k, str) for k in d):
            raise WireFormatError("CONTROL: keys must be strings")
        return cls(body=d)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerHeartbeat:
    """Trainer keep-alive; repeats the credit total, and `registered=False` tells a producer the
    trainer does not know it (restarted, or timed it out): it must say HELLO again."""

    KIND: ClassVar[bytes] = HEARTBEAT
    granted: int = 0
    registered: bool = True

    def to_wire(self) -> dict[str, Any]:
        return {"granted": self.granted, "registered": self.registered}

    @classmethod
    def from_wire(cls, d: Any) -> "TrainerHeartbeat":
        return cls(granted=_count(d, "granted", "HB", 0), registered=_get(d, "registered", bool, "HB", True))


@dataclass(frozen=True, slots=True, kw_only=True)
class Bulk:
    """A CONTROL-like `body` whose payload travels as raw frames after the header (`parts`, each
    `part_bytes[i]` long); `seq` numbers the trainer's BULKs. The producer answers BULK_ACK."""

    KIND: ClassVar[bytes] = BULK
    seq: int
    body: dict[str, Any]
    part_bytes: tuple[int, ...] = ()
    parts: tuple[Any, ...] = ()  # buffers; attached on receipt by `with_parts`

    def to_wire(self) -> dict[str, Any]:
        return {"seq": self.seq, "body": self.body, "part_bytes": list(self.part_bytes)}

    def frames(self) -> list[Any]:
        """[BULK, header, *parts]: the parts go as they are (zero-copy when sent with copy=False)."""
        return [BULK, encode(self.to_wire()), *self.parts]

    @classmethod
    def from_wire(cls, d: Any) -> "Bulk":
        body = _get(d, "body", dict, "BULK")
        try:
            Control.from_wire(body)
        except WireFormatError as exc:
            raise WireFormatError(f"BULK.body: {exc}") from None
        sizes = _get(d, "part_bytes", list, "BULK")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
            raise WireFormatError("BULK.part_bytes: expected a list of byte counts >= 0")
        return cls(seq=_count(d, "seq", "BULK"), body=body, part_bytes=tuple(sizes))

    def with_parts(self, parts: list[Any]) -> "Bulk":
        """This message with its data frames; WireFormatError if they are not the ones announced."""
        got = [memoryview(p).nbytes for p in parts]
        if got != list(self.part_bytes):
            raise WireFormatError(f"BULK.part_bytes: announced {len(self.part_bytes)} frames of "
                                  f"{sum(self.part_bytes)} bytes, got {len(got)} of {sum(got)} (truncated?)")
        return Bulk(seq=self.seq, body=self.body, part_bytes=self.part_bytes, parts=tuple(parts))


@dataclass(frozen=True, slots=True, kw_only=True)
class BulkAck:
    """A producer has handled BULK `seq` (and every earlier one) and dropped its frames; `error` is
    why its handler rejected it ("" when accepted)."""

    KIND: ClassVar[bytes] = BULK_ACK
    seq: int
    error: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"seq": self.seq, "error": self.error[:MAX_ERROR_CHARS]}

    @classmethod
    def from_wire(cls, d: Any) -> "BulkAck":
        return cls(seq=_count(d, "seq", "BULK_ACK"), error=_get(d, "error", str, "BULK_ACK", ""))


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    """The trainer turns a HELLO away (its protocol version is another): `reason` says why, `protocol` is the
    trainer's version. Its shape never changes between versions, so a producer of any version reads it."""

    KIND: ClassVar[bytes] = REFUSED
    reason: str
    protocol: int = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        return {"reason": self.reason[:MAX_ERROR_CHARS], "protocol": self.protocol}

    @classmethod
    def from_wire(cls, d: Any) -> "Refused":
        return cls(reason=_get(d, "reason", str, "REFUSED"), protocol=_get(d, "protocol", int, "REFUSED"))


Message = Union[Hello, Group, Heartbeat, Bye, Welcome, Credit, Control, TrainerHeartbeat, Bulk, BulkAck, Refused]
TO_TRAINER: Mapping[bytes, type] = {m.KIND: m for m in (Hello, Group, Heartbeat, Bye, BulkAck)}
TO_ROLLOUT: Mapping[bytes, type] = {m.KIND: m for m in (Welcome, Credit, Control, TrainerHeartbeat, Bulk, Refused)}


def pack(msg: Message) -> list[bytes]:
    """The frames of `msg`: [kind, payload]."""
    return [msg.KIND, encode(msg.to_wire())]


def unpack(kind: bytes, payload: bytes | memoryview, accepted: Mapping[bytes, type]) -> Message:
    """Decode and check one message; raises WireFormatError naming the kind or field at fault."""
    cls = accepted.get(bytes(kind))
    if cls is None:
        raise WireFormatError(f"unknown message kind {bytes(kind)[:24]!r} (expected one of "
                              f"{', '.join(k.decode() for k in accepted)})")
    return cls.from_wire(decode(payload))
