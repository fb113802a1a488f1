"""SGLang's flattened bucket: the tensors named in one request, packed back to back, sent as ONE broadcast.

SGLang 0.5.23 receives `load_format="flattened_bucket"` in one broadcast of a uint8
tensor holding every tensor named in the request in order, each at a byte offset that is a
multiple of its dtype's size (`srt/weight_sync/tensor_bucket.py`,
`FlattenedTensorBucket.empty`, which refuses an unaligned one;
`srt/model_executor/model_runner_components/weight_updater.py`,
`_receive_bucketed_weights_from_distributed`). So a model goes in several requests, one per
bucket, each naming only its bucket's tensors (as AReaL and slime send it):

    buckets = plan(dtypes, shapes, bucket_bytes)            # [(a, b)] index ranges into names
    flat = pack(source, names[a:b], dtypes[a:b], shapes[a:b], device)   # the sender's one tensor
    for name, t in unpack(flat, names, dtypes, shapes): ... # the receiver's views of it
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from async_rl.utils.weights import WeightSource
from async_rl.weight_sync.layout import DTYPES, dtype_name


def _sizes(dtypes: list[str], shapes: list[list[int]]) -> list[tuple[int, int]]:
    """(bytes, itemsize) per tensor."""
    out = []
    for dtype, shape in zip(dtypes, shapes, strict=True):
        item = DTYPES[dtype_name(dtype)][1].itemsize
        out.append((math.prod(shape) * item, item))
    return out


def plan(dtypes: list[str], shapes: list[list[int]], bucket_bytes: int) -> list[tuple[int, int]]:
    """Consecutive tensors grouped into buckets of at most `bucket_bytes` (a larger tensor alone), a new
    bucket wherever the next tensor's offset would not be a multiple of its dtype's size."""
    buckets, first, size = [], 0, 0
    for i, (n, item) in enumerate(_sizes(dtypes, shapes)):
        if i > first and (size + n > bucket_bytes or size % item):
            buckets.append((first, i))
            first, size = i, 0
        size += n
    if first < len(dtypes):
        buckets.append((first, len(dtypes)))
    return buckets


def offsets(dtypes: list[str], shapes: list[list[int]]) -> tuple[list[tuple[int, int]], int]:
    """[(start, end)] byte ranges of the tensors in one bucket and its length; ValueError if one is
    unaligned (SGLang's `FlattenedTensorBucket.empty` refuses it the same way)."""
    ranges, at = [], 0
    for i, (n, item) in enumerate(_sizes(dtypes, shapes)):
        if at % item:
            raise ValueError(f"dtypes[{i}]: tensor at byte offset {at} is not aligned to its dtype's {item} bytes "
                             "(a flattened bucket packs each tensor at a multiple of its size)")
        ranges.append((at, at + n))
        at += n
    return ranges, at


def pack(source: WeightSource, names: list[str], dtypes: list[str], shapes: list[list[int]],
         device: torch.device | str, out: torch.Tensor | None = None) -> torch.Tensor:
    """One uint8 tensor on `device` holding `names` back to back in `dtypes`, each tensor converted straight
    into its slot; written into the front of `out` when given (one buffer reused for every bucket)."""
    ranges, total = offsets(dtypes, shapes)
    flat = torch.empty(total, dtype=torch.uint8, device=device) if out is None else out[:total]
    with torch.no_grad():
        for name, dtype, (start, end) in zip(names, dtypes, ranges):
            if end > start:
                flat[start:end].view(DTYPES[dtype_name(dtype)][1]).copy_(source.get(name).reshape(-1))
    return flat


def unpack(flat: torch.Tensor, names: list[str], dtypes: list[str],
           shapes: list[list[int]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view of `flat`) per tensor, as SGLang's `reconstruct_tensors` gives them."""
    ranges, total = offsets(dtypes, shapes)
    if flat.numel() != total:
        raise ValueError(f"flattened bucket: {flat.numel()} bytes, the names list {total}")
    for name, dtype, shape, (start, end) in zip(names, dtypes, shapes, ranges):
        yield name, flat[start:end].view(DTYPES[dtype_name(dtype)][1]).reshape(shape)
