"""Wire codec: msgpack for structure, raw bytes for numpy arrays and large blobs; never pickle.

A frame is one `bytes` object laid out as

    b"ARW1" | header length (u64 little-endian) | msgpack header | zero padding to 8 | tail

The msgpack header holds the whole object. Each numpy array in it is a msgpack
extension (`EXT_ARRAY`) whose payload is `offset u64 | ndim u8 | ndim x dim u64 |
dtype name (ASCII)`; the array's bytes sit in the tail at that offset (8-byte aligned,
little-endian, C order). Each `bytes` value of at least `BLOB_MIN_BYTES` is an extension
(`EXT_BLOB`) with payload `offset u64 | length u64`, also in the tail. Keeping large
payloads out of the msgpack stream means encoding copies them once, and decoding an
array copies nothing: it is a `np.frombuffer` view of the received frame (writable when
the frame is, e.g. a zmq frame; read-only when it is `bytes`). Blobs come back as
`bytes` (one copy).

Only the numeric dtypes in `DTYPES` travel. `decode` checks everything it reads and
turns any malformed frame into a `WireFormatError` with a one-line message.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np

from async_rl.types import WireFormatError

MAGIC = b"ARW1"
_PREFIX = struct.Struct("<4sQ")  # magic, header length
_ARRAY_HEAD = struct.Struct("<QB")  # offset, ndim (then ndim u64 dims, then the dtype name)
_BLOB_HEAD = struct.Struct("<QQ")  # offset, length
_MAX_NDIM = 32
_DIMS = [struct.Struct(f"<{n}Q") for n in range(_MAX_NDIM + 1)]
EXT_ARRAY = 1
EXT_BLOB = 2
BLOB_MIN_BYTES = 64 * 1024  # smaller bytes values stay inside the msgpack header
_ALIGN = 8
# wire name -> explicit little-endian numpy dtype
DTYPES: dict[str, np.dtype] = {name: np.dtype(name).newbyteorder("<") for name in (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64")}
_NAME_OF = {dtype: name for name, dtype in DTYPES.items()}  # fast path for native little-endian arrays
_CONTAINERS = (dict, list, tuple)
_BYTES = (bytes, bytearray, memoryview)


class _Blob:
    """Marks a large bytes value that goes to the tail."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | bytearray | memoryview):
        self.data = data


def _lift_blobs(obj: Any) -> Any:
    """`obj` with every large bytes value wrapped in `_Blob`; containers are copied only if changed."""
    kind = type(obj)
    if kind in _BYTES:
        return _Blob(obj) if memoryview(obj).nbytes >= BLOB_MIN_BYTES else obj
    if kind is dict:
        out = None
        for key, value in obj.items():
            if type(value) in _CONTAINERS or type(value) in _BYTES:
                new = _lift_blobs(value)
                if new is not value:
                    out = dict(obj) if out is None else out
                    out[key] = new
        return obj if out is None else out
    if kind is list or kind is tuple:
        items = [_lift_blobs(v) if type(v) in _CONTAINERS or type(v) in _BYTES else v for v in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else items
    return obj


def _array_ext(value: np.ndarray, place: Any) -> msgpack.ExtType:
    """The extension standing for one array; `place` puts its bytes in the tail and returns the offset."""
    name = _NAME_OF.get(value.dtype)
    if name is None or not value.flags.c_contiguous:  # big-endian, strided, or not a number at all
        name = value.dtype.name
        if name not in DTYPES or value.dtype.fields is not None:
            raise TypeError(f"cannot encode an array of dtype {value.dtype}: allowed {', '.join(DTYPES)}")
        value = np.asarray(value, dtype=DTYPES[name], order="C")  # keeps 0-d arrays 0-d
    offset = place(memoryview(value.reshape(-1)).cast("B"))
    head = _ARRAY_HEAD.pack(offset, value.ndim) + _DIMS[value.ndim].pack(*value.shape)
    return msgpack.ExtType(EXT_ARRAY, head + name.encode())


def encode(obj: Any) -> bytes:
    """Serialise maps, lists, tuples (as lists), str, numbers, bool, None, bytes and numpy arrays.

    Raises TypeError for anything else (sets, objects, arrays of non-numeric dtype).
    """
    buffers: list[memoryview] = []
    size = 0

    def place(view: memoryview) -> int:
        nonlocal size
        offset = -(-size // _ALIGN) * _ALIGN
        buffers.append(view)
        size = offset + view.nbytes
        return offset

    def default(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return _array_ext(value, place)
        if isinstance(value, _Blob):
            view = memoryview(value.data).cast("B")
            return msgpack.ExtType(EXT_BLOB, _BLOB_HEAD.pack(place(view), view.nbytes))
        if isinstance(value, np.generic) and value.dtype.name in DTYPES:
            return value.item()
        raise TypeError(f"cannot encode a value of type {type(value).__name__} on the wire")

    header = msgpack.packb(_lift_blobs(obj), default=default, use_bin_type=True)
    parts: list[Any] = [_PREFIX.pack(MAGIC, len(header)), header]
    pos = _PREFIX.size + len(header)
    parts.append(bytes(-pos % _ALIGN))
    pos = 0
    for view in buffers:
        parts.append(bytes(-pos % _ALIGN))
        pos += -pos % _ALIGN
        parts.append(view)
        pos += view.nbytes
    return b"".join(parts)


class _TailReader:
    """Resolves extension payloads against the frame's tail; remembers how far the tail was used."""

    def __init__(self, tail: memoryview):
        self.tail = tail
        self.end = 0

    def _span(self, offset: int, nbytes: int, what: str) -> slice:
        if offset % _ALIGN:
            raise WireFormatError(f"{what}: bad offset {offset} (must be a multiple of {_ALIGN})")
        if offset + nbytes > len(self.tail):
            raise WireFormatError(f"{what}: needs bytes {offset}..{offset + nbytes} but the frame's data section "
                                  f"has {len(self.tail)} (truncated frame or wrong array byte length)")
        self.end = max(self.end, offset + nbytes)
        return slice(offset, offset + nbytes)

    def __call__(self, code: int, data: bytes) -> Any:
        if code == EXT_ARRAY:
            return self._array(data)
        if code == EXT_BLOB:
            if len(data) != _BLOB_HEAD.size:
                raise WireFormatError(f"blob header: expected {_BLOB_HEAD.size} bytes, got {len(data)}")
            offset, nbytes = _BLOB_HEAD.unpack(data)
            return bytes(self.tail[self._span(offset, nbytes, "blob")])
        raise WireFormatError(f"unknown msgpack extension type {code} (known: {EXT_ARRAY} array, {EXT_BLOB} blob)")

    def _array(self, data: bytes) -> np.ndarray:
        if len(data) < _ARRAY_HEAD.size:
            raise WireFormatError(f"array header: {len(data)} bytes is too short")
        offset, ndim = _ARRAY_HEAD.unpack_from(data)
        names_at = _ARRAY_HEAD.size + 8 * ndim
        if ndim > _MAX_NDIM or len(data) <= names_at:
            raise WireFormatError(f"array header: {len(data)} bytes cannot hold {ndim} dims and a dtype "
                                  f"(at most {_MAX_NDIM} dims)")
        shape = _DIMS[ndim].unpack_from(data, _ARRAY_HEAD.size)
        name = data[names_at:].decode("ascii", "replace")
        dtype = DTYPES.get(name)
        if dtype is None:
            raise WireFormatError(f"array dtype {name[:40]!r} is not allowed (allowed: {', '.join(DTYPES)})")
        if max(shape, default=0) >= 1 << 48:
            raise WireFormatError(f"array shape {shape} has an impossible size")
        count = 1
        for d in shape:
            count *= d
        span = self._span(offset, count * dtype.itemsize, f"array {name}{list(shape)}")
        if count == 0:
            return np.empty(shape, dtype=dtype)
        return np.frombuffer(self.tail, dtype=dtype, count=count, offset=span.start).reshape(shape)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Inverse of `encode`. Arrays are views of `data` (keep it alive, copy before mutating
    a view of shared memory). Raises WireFormatError naming what is wrong with a malformed frame."""
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError) as exc:
        raise WireFormatError(f"frame: not a contiguous byte buffer ({_first_line(exc)})") from None
    if len(view) < _PREFIX.size:
        raise WireFormatError(f"frame: {len(view)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireFormatError(f"frame: bad magic {bytes(magic)!r} (expected {MAGIC!r}; not an async_rl frame)")
    header_end = _PREFIX.size + header_len
    tail_start = -(-header_end // _ALIGN) * _ALIGN
    if tail_start > len(view):
        raise WireFormatError(f"frame: a {header_len}-byte header (padded to {tail_start} bytes in all) does not "
                              f"fit in a {len(view)}-byte frame (truncated?)")
    reader = _TailReader(view[tail_start:])
    try:
        obj = msgpack.unpackb(view[_PREFIX.size:header_end], ext_hook=reader, raw=False, strict_map_key=False)
    except WireFormatError:
        raise
    except Exception as exc:  # msgpack raises several types for truncated, invalid or unhashable data
        raise WireFormatError(f"frame: malformed msgpack header ({_first_line(exc)})") from None
    if reader.end != len(reader.tail):
        raise WireFormatError(f"frame: {len(reader.tail) - reader.end} unexpected trailing bytes after the data")
    return obj
