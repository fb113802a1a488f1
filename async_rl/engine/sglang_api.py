"""SGLang's native /generate shapes in one place: the body a client sends, the answer a server gives.

The embedded server renders answers with these functions and the HTTP client parses them
with the same ones, so one contract holds for the embedded engine and for SGLang itself:

    request   {"input_ids", "rid", "sampling_params" (SGLang's names), "return_logprob", "top_logprobs_num"}
    answer    {"text", "output_ids", "meta_info"}, or a list of those when sampling_params.n > 1
    meta_info "id", "finish_reason" ({"type": "stop", "matched": …} | {"type": "length", "length": n} |
              {"type": "abort", "message": …}), "prompt_tokens", "completion_tokens", "cached_tokens",
              "weight_version", "num_retractions", and with return_logprob "output_token_logprobs"
              (and "output_top_logprobs") as [logprob, token_id, text or null] entries;
              "weight_versions": spans {"version", "start", "end"} over output tokens, [start, end),
              as SGLang >= 0.5.19 reports them;
              the embedded server adds "output_token_versions" (one int per token) and "num_interruptions".

Policy versions are ints in this project; SGLang labels them with strings (its initial
label is "default"), so a label that is not an integer means "unknown" to the parser.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from async_rl.types import GenerationOutput, SamplingParams


# --------------------------------------------------------------------------- request
def generate_body(input_ids: list[int], params: SamplingParams, rid: str, *, stream: bool = False,
                  stream_interval: int = 1, cache_salt: str | None = None) -> dict[str, Any]:
    """A /generate body both servers accept, asking for the log-prob of every sampled token. A stream with
    `stream_interval` > 1 asks for a chunk only once that many tokens are unsent (SGLang's per-request
    `sampling_params.stream_interval`; the first token and the end always come at once). `cache_salt`
    (SGLang's "cache namespace used to isolate otherwise-identical prefixes", io_struct.GenerateReqInput)
    keeps this request off prefixes cached under another salt."""
    body: dict[str, Any] = {"input_ids": [int(t) for t in input_ids], "rid": rid, "return_logprob": True,
                            "sampling_params": params.to_wire()}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if params.top_logprobs:
        body["top_logprobs_num"] = params.top_logprobs
    if stream:
        body["stream"] = True
        if stream_interval > 1:
            body["sampling_params"]["stream_interval"] = int(stream_interval)
    return body


def piece_rid(rid: str, piece: int) -> str:
    """The rid piece `piece` of request `rid` is sent under (0 first, then one per move to another server).
    SGLang's /abort_request aborts every request whose rid *starts with* the one given
    (sglang/srt/managers/scheduler.py, `Scheduler.abort_request`: `req.rid.startswith(recv_req.rid)`), so the
    abort of one piece must not be a prefix of another's rid: "<len(rid)>:<rid>/<piece>." is self-delimiting,
    and no two such rids, whatever `rid` is, ever prefix each other. The one rule for "this rid belongs to that
    request"; every other rid this side sends is a `new_id()` (32 hex digits: equal lengths, no prefixes)."""
    return f"{len(rid)}:{rid}/{int(piece)}."


# --------------------------------------------------------------------------- answer (server side)
def finish_reason_json(out: GenerationOutput, matched: int | str | None = None) -> dict[str, Any]:
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.output_ids)}
    if out.finish_reason == "abort":
        return {"type": "abort", "message": "request aborted", "status_code": 200, "err_type": None}
    return {"type": out.finish_reason, "matched": matched}


def logprob_entries(logprobs: list[float], ids: list[int],
                    token_text: Callable[[int], str] | None = None) -> list[list[Any]]:
    """SGLang's [logprob, token_id, text] entries; text is null unless `token_text` is given."""
    return [[lp, t, None if token_text is None else token_text(t)] for lp, t in zip(logprobs, ids)]


def version_spans(versions: list[int]) -> list[dict[str, Any]]:
    """Per-token versions as SGLang's spans: [{"version": "3", "start": 0, "end": 5}, …], end exclusive."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def meta_info(out: GenerationOutput, return_logprob: bool, weight_version: int, finished: bool = True, *,
              retractions: int = 0, token_text: Callable[[int], str] | None = None,
              matched: int | str | None = None) -> dict[str, Any]:
    """SGLang's `meta_info` of one answer (see `sglang_api`), plus our per-token versions."""
    meta: dict[str, Any] = {
        "id": out.request_id, "finish_reason": finish_reason_json(out, matched) if finished else None,
        "prompt_tokens": out.prompt_len, "completion_tokens": len(out.output_ids),
        "cached_tokens": out.prefix_cached_tokens, "weight_version": str(weight_version),  # a string, as SGLang
        "weight_versions": version_spans(out.output_versions), "output_token_versions": out.output_versions,
        "num_interruptions": out.num_interruptions, "num_retractions": retractions,
    }
    if return_logprob:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = logprob_entries(out.output_logprobs, out.output_ids, token_text)
        if out.output_top_logprobs is not None:
            meta["output_top_logprobs"] = [[[lp, t, None if token_text is None else token_text(t)] for t, lp in pos]
                                           for pos in out.output_top_logprobs]
    return meta


# --------------------------------------------------------------------------- streaming: both shapes
# meta_info lists with one entry per output token: a chunk of incremental streaming carries only its own
# (SGLang: tokenizer_manager._INCREMENTAL_STREAMING_META_INFO_KEYS; output_token_versions is ours); the rest
# (completion_tokens, weight_versions spans, finish_reason) always counts from the start
PER_TOKEN_META = ("output_token_logprobs", "output_top_logprobs", "output_token_versions")


def incremental_chunk(chunk: dict[str, Any], sent: int, sent_text: int) -> dict[str, Any]:
    """A cumulative /generate chunk cut down to what follows the first `sent` output ids (and `sent_text`
    characters of text): SGLang's shape under --incremental-streaming-output."""
    meta = {k: v[sent:] if k in PER_TOKEN_META and isinstance(v, list) else v for k, v in chunk["meta_info"].items()}
    out = {**chunk, "output_ids": chunk["output_ids"][sent:], "meta_info": meta}
    if isinstance(chunk.get("text"), str):
        out["text"] = chunk["text"][sent_text:]
    return out


def cumulative_chunk(prev: dict[str, Any] | None, chunk: dict[str, Any]) -> dict[str, Any]:
    """A streamed /generate chunk in SGLang's default shape (the output so far), whichever shape it came in;
    `prev` is the previous chunk as this returned it. Under --incremental-streaming-output SGLang sends only
    the new output ids and per-token entries (tokenizer_manager._handle_batch_output), and a request aborted
    while waiting ends with its last id once more (_handle_abort_req); `completion_tokens` tells them apart."""
    ids, meta = chunk["output_ids"], chunk["meta_info"]
    total, done = meta.get("completion_tokens"), len(prev["output_ids"]) if prev else 0
    if total is None or total == len(ids):
        return chunk  # the output so far (or the first chunk, the same in both shapes)
    if prev is None or total not in (done, done + len(ids)):
        raise ValueError(f"/generate stream: a chunk of {len(ids)} output ids says completion_tokens={total} "
                         f"after {done}: neither SGLang's cumulative nor its incremental shape")
    new = total > done  # else nothing new: the last id sent again
    merged = {k: list(prev["meta_info"].get(k) or []) + list((meta.get(k) or []) if new else [])
              for k in PER_TOKEN_META if k in meta or k in prev["meta_info"]}
    out = {**chunk, "output_ids": prev["output_ids"] + (ids if new else []), "meta_info": {**meta, **merged}}
    if isinstance(prev.get("text"), str) and isinstance(chunk.get("text"), str):
        out["text"] = prev["text"] + (chunk["text"] if new else "")
    return out


# --------------------------------------------------------------------------- answer (client side)
# the meta_info keys the client reads: SGLang's GenerateMetaInfo (api/v1/api_types.py) declares all but the
# embedded server's extras (output_token_versions, num_interruptions, num_retractions); a contract test holds it
META_KEYS_READ = ("id", "prompt_tokens", "completion_tokens", "finish_reason", "cached_tokens", "weight_version",
                  "weight_versions", "output_token_logprobs", "output_top_logprobs", "output_token_versions",
                  "num_interruptions", "num_retractions")

def parse_version(label: Any) -> int | None:
    """A version label as an int, or None when it is not one (SGLang's "default", null)."""
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return label
    if isinstance(label, str):
        try:
            return int(label.strip())
        except ValueError:
            return None
    return None


def versions_from_spans(spans: Any, n: int) -> list[int] | None:
    """One version per output token from SGLang's spans; None when they do not cover 0..n or a label
    is not an integer."""
    if not isinstance(spans, list):
        return None
    out: list[int] = []
    for span in spans:
        version = parse_version(span.get("version")) if isinstance(span, dict) else None
        if version is None or span.get("start") != len(out) or not isinstance(span.get("end"), int):
            return None
        out += [version] * (min(span["end"], n) - len(out))
    return out if len(out) == n else None


def server_versions(meta: dict[str, Any], n: int) -> list[int] | None:
    """The per-token versions a server reported (ours, or SGLang's spans), or None."""
    ours = meta.get("output_token_versions")
    if isinstance(ours, list) and len(ours) == n:
        return [int(v) for v in ours]
    return versions_from_spans(meta.get("weight_versions"), n)


def output_from_response(rid: str, body: dict[str, Any], version: int | None = None,
                         interruptions: int = 0) -> GenerationOutput:
    """A /generate answer of either server as GenerationOutput. When the server reports no per-token
    versions, every token gets `version` (else the answer's integer `weight_version`, else 0); when it
    reports no `num_interruptions`, `interruptions` is used."""
    meta = body["meta_info"]
    ids = [int(t) for t in body["output_ids"]]
    lps = [float(e[0]) for e in meta.get("output_token_logprobs") or []]
    if len(lps) != len(ids):  # a behaviour log-prob is never made up: the trainer's importance weights use them
        raise RuntimeError(f"request {meta.get('id', rid)}: the server sent {len(lps)} log-probs for "
                           f"{len(ids)} output tokens")
    versions = server_versions(meta, len(ids))
    if versions is None:
        fallback = version if version is not None else parse_version(meta.get("weight_version"))
        versions = [fallback or 0] * len(ids)
    top = meta.get("output_top_logprobs")
    reason = meta.get("finish_reason")
    return GenerationOutput(
        request_id=str(meta.get("id", rid)), prompt_len=int(meta.get("prompt_tokens", 0)), output_ids=ids,
        output_logprobs=lps, output_versions=versions,
        finish_reason=reason.get("type", "abort") if isinstance(reason, dict) else str(reason or "abort"),
        num_interruptions=int(meta.get("num_interruptions", interruptions)),
        output_top_logprobs=None if top is None else [[(int(e[1]), float(e[0])) for e in pos or []] for pos in top],
        prefix_cached_tokens=int(meta.get("cached_tokens") or 0),
    )


def joined_output(rid: str, prompt_len: int, pieces: list[GenerationOutput]) -> GenerationOutput:
    """One output from the pieces of a request re-submitted after aborts: tokens, log-probs and versions
    in order; the finish reason of the last piece."""
    tops = [p.output_top_logprobs for p in pieces]
    return GenerationOutput(
        request_id=rid, prompt_len=prompt_len, output_ids=[t for p in pieces for t in p.output_ids],
        output_logprobs=[x for p in pieces for x in p.output_logprobs],
        output_versions=[v for p in pieces for v in p.output_versions], finish_reason=pieces[-1].finish_reason,
        num_interruptions=sum(p.num_interruptions for p in pieces),
        output_top_logprobs=None if any(t is None for t in tops) else [e for t in tops for e in t],
        prefix_cached_tokens=pieces[0].prefix_cached_tokens)
