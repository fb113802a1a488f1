"""msgpack codec with numpy arrays as raw bytes + dtype + shape; never pickle.

Arrays travel as msgpack extension type 1 whose payload is
`[dtype str, shape list, raw bytes]` (itself msgpack). Only plain numeric dtypes are
accepted. `decode` turns every malformed frame into a `WireFormatError` with a one-line
message, so a bad peer can never crash the receiver with a deep traceback.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from async_rl.types import WireFormatError

_ND_EXT = 1
DTYPES = frozenset({"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                    "float16", "float32", "float64"})


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.name not in DTYPES:
            raise TypeError(f"cannot encode an array of dtype {obj.dtype}: allowed {sorted(DTYPES)}")
        arr = np.ascontiguousarray(obj)
        payload = msgpack.packb([arr.dtype.name, list(arr.shape), arr.tobytes()], use_bin_type=True)
        return msgpack.ExtType(_ND_EXT, payload)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} on the wire")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _ND_EXT:
        raise WireFormatError(f"unknown msgpack extension type {code}")
    try:
        dtype, shape, raw = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise WireFormatError(f"malformed array header: {exc}") from None
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise WireFormatError(f"array dtype {dtype!r} not allowed")
    if not isinstance(shape, list) or any(not isinstance(d, int) or d < 0 for d in shape):
        raise WireFormatError(f"array shape {shape!r} is not a list of non-negative integers")
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if not isinstance(raw, bytes) or len(raw) != expected:
        raise WireFormatError(f"array of dtype {dtype} and shape {shape} needs {expected} bytes, "
                              f"got {len(raw) if isinstance(raw, bytes) else type(raw).__name__}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def encode(obj: Any) -> bytes:
    """Serialise maps, lists, scalars, bytes and numpy arrays."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes | memoryview) -> Any:
    """Inverse of `encode`; raises WireFormatError on anything malformed."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except WireFormatError:
        raise
    except Exception as exc:  # msgpack raises several types for truncated or invalid data
        raise WireFormatError(f"malformed frame: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") \
            from None
