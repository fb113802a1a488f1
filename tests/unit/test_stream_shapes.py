"""Streamed /generate chunks in SGLang's two shapes read as the same outputs.

SGLang's default sends the output so far in every chunk; with --incremental-streaming-output only the new
output ids and per-token meta_info entries, while completion_tokens and weight_versions spans count from
the start (sglang/srt/managers/tokenizer_manager.py: _handle_batch_output, _slice_streaming_output_meta_info,
_INCREMENTAL_STREAMING_META_INFO_KEYS), and a request aborted while waiting ends with its last id once more
(_handle_abort_req). `incremental_chunk` makes the second shape from the first; `cumulative_chunk` reads both.
"""

import pytest

from async_rl.engine.sglang_api import cumulative_chunk, incremental_chunk, output_from_response


def _cumulative(n: int, finished: bool = False) -> dict:
    ids = list(range(10, 10 + n))
    spans = [{"version": "3", "start": 0, "end": min(n, 2)}] + ([{"version": "4", "start": 2, "end": n}] if n > 2 else [])
    return {"text": "abcdefgh"[:n], "output_ids": ids, "meta_info": {
        "id": "r", "completion_tokens": n, "finish_reason": {"type": "length", "length": n} if finished else None,
        "weight_versions": spans, "output_token_logprobs": [[-0.1 * i, t, None] for i, t in enumerate(ids)],
        "output_top_logprobs": [[[-0.1 * i, t, None]] for i, t in enumerate(ids)]}}


def _read(chunks: list[dict]):
    body = None
    for chunk in chunks:
        body = cumulative_chunk(body, chunk)
    return body


def test_incremental_chunks_read_as_the_cumulative_ones():
    sizes, sent, text = [1, 3, 4, 7, 8], 0, 0
    cumulative = [_cumulative(n, finished=n == 8) for n in sizes]
    incremental = []
    for c in cumulative:
        incremental.append(incremental_chunk(c, sent, text))
        sent, text = len(c["output_ids"]), len(c["text"])
    assert [len(c["output_ids"]) for c in incremental] == [1, 2, 1, 3, 1]  # the bytes: O(n), not O(n^2)
    assert _read(incremental) == _read(cumulative) == cumulative[-1]
    out = output_from_response("r", _read(incremental))
    assert out.output_versions == [3, 3, 4, 4, 4, 4, 4, 4] and len(out.output_top_logprobs) == 8


def test_the_last_id_sent_again_at_an_abort_adds_nothing():
    first = incremental_chunk(_cumulative(3), 0, 0)
    again = {"output_ids": [12], "meta_info": {"id": "r", "completion_tokens": 3,
                                               "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}}
    body = _read([first, again])
    assert body["output_ids"] == [10, 11, 12] and len(body["meta_info"]["output_token_logprobs"]) == 3
    assert body["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_chunk_in_neither_shape_is_an_error():
    with pytest.raises(ValueError, match="completion_tokens=9 after 3"):
        _read([_cumulative(3), {"output_ids": [1, 2], "meta_info": {"completion_tokens": 9}}])
